"""Nested block-state dicts: flattened to dotted keys, and cloned."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def clone_tree(tree: Mapping[Any, Any]) -> dict[Any, Any]:
    """A copy of nested dicts of tensors, every tensor cloned."""
    return {k: clone_tree(v) if isinstance(v, Mapping) else v.clone() for k, v in tree.items()}


def flatten_tree(tree: Mapping[Any, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one dict of dotted names (``prefix.key.subkey``); leaves kept as they are."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten_tree(value, name))
        else:
            flat[name] = value
    return flat
