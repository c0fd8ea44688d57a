"""Validators of hyper-parameter tables: each raises ``ValueError`` naming the table's field
and its flag (``muon.lr (--muon.lr)``). The rules are :mod:`nanoshampoo.validation`'s; this module
only turns a table and a field name into the label.

Learning rates and weight decays must be finite and >= 0; epsilons finite and > 0 (an infinite
epsilon makes a step that changes nothing, a zero one divides by zero); betas in [0, 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from nanoshampoo import validation
from nanoshampoo.validation import check_float, check_int, is_int, is_real


def field_label(table: str, name: str) -> str:
    """``"muon.lr (--muon.lr)"``: the field and the flag that sets it."""
    return f"{table}.{name} (--{table}.{name.replace('_', '-')})"


def check_finite_nonnegative(table: str, obj: Any, *names: str) -> None:
    for name in names:
        check_float(field_label(table, name), getattr(obj, name), at_least=0.0)


def check_epsilon(table: str, obj: Any, *names: str) -> None:
    for name in names:
        check_float(field_label(table, name), getattr(obj, name), greater_than=0.0)


def check_beta(table: str, obj: Any, *names: str) -> None:
    for name in names:
        check_float(field_label(table, name), getattr(obj, name), at_least=0.0, less_than=1.0)


def check_at_least(table: str, obj: Any, minimum: int, *names: str) -> None:
    for name in names:
        check_int(field_label(table, name), getattr(obj, name), at_least=minimum)


def check_choice(table: str, obj: Any, name: str, choices: tuple[str, ...]) -> None:
    validation.check_choice(field_label(table, name), getattr(obj, name), choices)


def check_types(owner: str, obj: Any) -> None:
    """Every field of the dataclass ``obj`` holds a value of its annotated type (int for a
    float is fine; a bool is never an int or a float; a tuple field may hold a list)."""
    for f in dataclasses.fields(obj):
        check_value_type(f"{owner}.{f.name}", getattr(obj, f.name), f.type)


# The type a field annotation names, as a test of the value (range checks come after it).
_TYPES: dict[str, Callable[[Any], bool]] = {
    "bool": lambda v: isinstance(v, bool),
    "int": is_int,
    "float": is_real,
    "str": lambda v: isinstance(v, str),
}


def check_value_type(label: str, value: Any, annotation: Any) -> None:
    """Raise ``ValueError`` unless ``value`` fits the field annotation (a string, as
    ``from __future__ import annotations`` leaves it: ``"float"``, ``"tuple[int, ...]"``,
    ``"tuple[float, ...]"``, ``"dict[str, Any]"``)."""
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    if kind.startswith("tuple"):
        fits, items = (is_real, "numbers") if "float" in str(annotation) else (is_int, "integers")
        if not (isinstance(value, (tuple, list)) and all(fits(v) for v in value)):
            raise ValueError(f"{label} must be a list of {items}, got {value!r}")
        return
    if kind.startswith("dict"):
        if not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
            raise ValueError(f"{label} must be a table of named values, got {value!r}")
        return
    fits = _TYPES.get(kind)
    if fits is not None and not fits(value):
        raise ValueError(
            f"{label} must be {'an' if kind == 'int' else 'a'} {kind}, "
            f"got {value!r} ({type(value).__name__})"
        )
