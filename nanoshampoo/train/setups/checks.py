"""Validators of hyper-parameter tables: each raises ``ValueError`` naming the table's field
and its flag (``muon.lr (--muon.lr)``).

Learning rates and weight decays must be finite and >= 0; epsilons finite and > 0 (an infinite
epsilon makes a step that changes nothing, a zero one divides by zero); betas in [0, 1).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


def field_label(table: str, name: str) -> str:
    """``"muon.lr (--muon.lr)"``: the field and the flag that sets it."""
    return f"{table}.{name} (--{table}.{name.replace('_', '-')})"


def check_finite_nonnegative(table: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{field_label(table, name)} must be finite and >= 0, got {value}")


def check_epsilon(table: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{field_label(table, name)} must be finite and > 0, got {value}")


def check_beta(table: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{field_label(table, name)} must be in [0, 1), got {value}")


def check_at_least(table: str, obj: Any, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < minimum:
            raise ValueError(f"{field_label(table, name)} must be >= {minimum}, got {value}")


def check_choice(table: str, obj: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    if value not in choices:
        raise ValueError(f"{field_label(table, name)} must be one of {list(choices)}, "
                         f"got {value!r}")


def check_types(owner: str, obj: Any) -> None:
    """Every field of the dataclass ``obj`` holds a value of its annotated type (int for a
    float is fine; a bool is never an int or a float; a tuple field may hold a list)."""
    for f in dataclasses.fields(obj):
        check_value_type(f"{owner}.{f.name}", getattr(obj, f.name), f.type)


_TYPES: dict[str, tuple[type, ...]] = {
    "bool": (bool,), "int": (int,), "float": (int, float), "str": (str,),
}


def check_value_type(label: str, value: Any, annotation: Any) -> None:
    """Raise ``ValueError`` unless ``value`` fits the field annotation (a string, as
    ``from __future__ import annotations`` leaves it: ``"float"``, ``"tuple[int, ...]"``,
    ``"dict[str, Any]"``)."""
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    if kind.startswith("tuple"):
        if not (isinstance(value, (tuple, list)) and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value)):
            raise ValueError(f"{label} must be a list of integers, got {value!r}")
        return
    if kind.startswith("dict"):
        if not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
            raise ValueError(f"{label} must be a table of named values, got {value!r}")
        return
    allowed = _TYPES.get(kind)
    if allowed is None:
        return
    if isinstance(value, bool) and kind != "bool" or not isinstance(value, allowed):
        raise ValueError(f"{label} must be {'an' if kind == 'int' else 'a'} {kind}, "
                         f"got {value!r} ({type(value).__name__})")
