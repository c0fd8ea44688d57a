"""Field checks shared by the Shampoo config dataclasses, and the error for unsupported configs.

Each check raises ``ValueError`` whose message starts with the field name, so a config's
``__post_init__`` reads as one line per field.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class UnsupportedConfigError(ValueError, NotImplementedError):
    """A config this optimizer does not implement (the message names the field and what to use).

    Both a ``ValueError`` (this project's error for bad input) and a ``NotImplementedError``
    (what the well-known Distributed Shampoo library raises there), so a script written for
    either catches it.
    """


def check_open_closed_unit(name: str, value: float, low_open: bool, high_open: bool) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` lies in the given unit interval."""
    low_ok = value > 0.0 if low_open else value >= 0.0
    high_ok = value < 1.0 if high_open else value <= 1.0
    if not (isinstance(value, (int, float)) and low_ok and high_ok):
        interval = f"{'(' if low_open else '['}0.0, 1.0{')' if high_open else ']'}"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")


def check_positive(name: str, value: float) -> None:
    """Finite and > 0: an infinite epsilon divides every update to zero (a step that does nothing)."""
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name} must be finite and > 0.0, got {value!r}")


def check_ema_storage_dtype(name: str, dtype: object, weight: float, weight_name: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``dtype`` (None or a float dtype) can hold an
    EMA ``V <- (1 - w) V + w X`` whose new-sample weight is ``weight``.

    Rounding to storage every step stalls the EMA when ``w < finfo(dtype).eps``: the change
    ``w (X - V)`` is then below half an ulp of ``V`` unless ``X`` is far from ``V`` (bfloat16:
    ``w >= 2^-7``, i.e. ``beta <= 0.992``). ``weight = 0`` means an accumulating sum
    (AdaGrad), which stalls too once ``t > 1 / eps``. Only dtypes narrower than float32 are
    checked.
    """
    if dtype is None:
        return
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be None or one of {FLOAT_DTYPES}, got {dtype!r}")
    eps = torch.finfo(dtype).eps
    # float32/float64 storage is what the computation uses anyway: never refused.
    if eps > torch.finfo(torch.float32).eps and not weight >= eps:
        raise ValueError(
            f"{name} {dtype} cannot hold this EMA: {weight_name} {weight!r} must be >= "
            f"finfo({dtype}).eps = {eps} (each step's change would round away)"
        )


def check_optional_tolerance(name: str, value: object, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not (
        isinstance(value, (int, float)) and math.isfinite(value) and value >= 0.0
    ):
        expected = "a finite float >= 0" + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
