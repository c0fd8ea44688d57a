"""Field checks shared by the Shampoo config dataclasses, and the error for unsupported configs.

Each check raises ``ValueError`` naming the field, so a config's ``__post_init__`` reads as one
line per field. Where the reference library has a rule for the field, the message starts with the
reference's sentence (``"Invalid epsilon value: 0.0. Must be > 0.0."``), so a script written
against it recognises the error, and this library's hint follows; the error's ``field`` attribute
names the field either way (:func:`field_error`). The other checks are the Shampoo configs' names
for the rules of :mod:`nanoshampoo.validation`, which holds them once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from nanoshampoo import validation
from nanoshampoo.validation import check_bool, check_dtype, check_float, is_int, is_real

__all__ = [
    "FLOAT_DTYPES",
    "UnsupportedConfigError",
    "check_bool",
    "check_ema_storage_dtype",
    "check_int",
    "check_open_closed_unit",
    "check_optional_tolerance",
    "check_positive",
    "check_rule",
    "error_field",
    "field_error",
    "refuse",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class UnsupportedConfigError(ValueError, NotImplementedError):
    """A config this optimizer does not implement (the message names the field and what to use).

    Both a ``ValueError`` (this project's error for bad input) and a ``NotImplementedError``
    (what the well-known Distributed Shampoo library raises there), so a script written for
    either catches it.
    """


def field_error(field: str, message: str, error: type[ValueError] = ValueError) -> ValueError:
    """``error(message)`` with ``field`` (the config field or group entry it is about, e.g.
    ``"betas[0]"``) as its ``field`` attribute: the message starts with the reference library's
    sentence, so a caller that names the field in its own words (the trainer names its flag)
    reads it from there."""
    err = error(message)
    err.field = field  # type: ignore[attr-defined]
    return err


def error_field(err: ValueError) -> str:
    """The config field or group entry ``err`` is about: its ``field`` attribute
    (:func:`field_error`), else the first word of its message (the checks without a reference
    sentence start with the field's name: ``"use_nesterov must be a bool, got 1"``)."""
    field = getattr(err, "field", None)
    return field if isinstance(field, str) else str(err).split(" ", 1)[0].rstrip(":")


def refuse(field: str, sentence: str, hint: str = "") -> ValueError:
    """The error for a bad ``field``: the reference library's ``sentence``, then ``hint`` (what
    this library adds: a reason, or what to use instead)."""
    return field_error(field, f"{sentence} {hint}" if hint else sentence)


def check_rule(
    field: str,
    prefix: str,
    value: Any,
    requirement: str,
    ok: Callable[[Any], bool],
    *,
    integer: bool = False,
    finite: bool = True,
    hint: str = "",
) -> None:
    """Raise :func:`refuse` with the reference's sentence ``f"{prefix} {requirement}"`` unless
    ``ok(value)``; ``prefix`` is the reference's ``"Invalid <field> value: <value>."``.

    This library's stricter rules come in the same form: first ``value`` must be a number
    (``integer``: an int), not a bool (``prefix`` + ``"Must be a number."``); last, ``finite``:
    not infinite (``"Must be finite."``). ``ok`` is written so that NaN fails it (every
    comparison with NaN is false), as it fails the reference's rule.
    """
    if not (is_int(value) if integer else is_real(value)):
        raise refuse(field, f"{prefix} Must be {'an integer' if integer else 'a number'}.")
    if not ok(value):
        raise refuse(field, f"{prefix} {requirement}", hint)
    if finite and not math.isfinite(value):
        raise refuse(field, f"{prefix} Must be finite.")


def check_open_closed_unit(name: str, value: float, low_open: bool, high_open: bool) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` lies in the given unit interval."""
    check_float(
        name,
        value,
        **{
            "greater_than" if low_open else "at_least": 0.0,
            "less_than" if high_open else "at_most": 1.0,
        },
    )


def check_positive(name: str, value: float) -> None:
    """Finite and > 0: an infinite epsilon divides every update to zero (a step that does
    nothing)."""
    check_float(name, value, greater_than=0.0)


def check_ema_storage_dtype(name: str, dtype: object, weight: float, weight_name: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``dtype`` (None or a float dtype) can hold an
    EMA ``V <- (1 - w) V + w X`` whose new-sample weight is ``weight``.

    Rounding to storage every step stalls the EMA when ``w < finfo(dtype).eps``: the change
    ``w (X - V)`` is then below half an ulp of ``V`` unless ``X`` is far from ``V`` (bfloat16:
    ``w >= 2^-7``, i.e. ``beta <= 0.992``). ``weight = 0`` means an accumulating sum
    (AdaGrad), which stalls too once ``t > 1 / eps``. Only dtypes narrower than float32 are
    checked.
    """
    if check_dtype(name, dtype, FLOAT_DTYPES, optional=True) is None:
        return
    eps = torch.finfo(dtype).eps
    # float32/float64 storage is what the computation uses anyway: never refused.
    if eps > torch.finfo(torch.float32).eps and not weight >= eps:
        raise ValueError(
            f"{name} {dtype} cannot hold this EMA: {weight_name} {weight!r} must be >= "
            f"finfo({dtype}).eps = {eps} (each step's change would round away)"
        )


def check_optional_tolerance(name: str, value: object, allow_none: bool = True) -> None:
    check_float(name, value, at_least=0.0, optional=allow_none)


def check_int(name: str, value: object, minimum: int) -> None:
    validation.check_int(name, value, at_least=minimum)
