"""Field checks shared by the Shampoo config dataclasses, and the error for unsupported configs.

Each check raises ``ValueError`` whose message starts with the field name, so a config's
``__post_init__`` reads as one line per field. The checks are the Shampoo configs' names for the
rules of :mod:`nanoshampoo.validation`, which holds them once.
"""

from __future__ import annotations

import torch

from nanoshampoo import validation
from nanoshampoo.validation import check_bool, check_dtype, check_float

__all__ = [
    "FLOAT_DTYPES",
    "UnsupportedConfigError",
    "check_bool",
    "check_ema_storage_dtype",
    "check_int",
    "check_open_closed_unit",
    "check_optional_tolerance",
    "check_positive",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class UnsupportedConfigError(ValueError, NotImplementedError):
    """A config this optimizer does not implement (the message names the field and what to use).

    Both a ``ValueError`` (this project's error for bad input) and a ``NotImplementedError``
    (what the well-known Distributed Shampoo library raises there), so a script written for
    either catches it.
    """


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
    """Finite and > 0: an infinite epsilon divides every update to zero (a step that does nothing)."""
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
