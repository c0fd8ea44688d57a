"""The one way to check a value: ints, floats, bools, dtypes and choices.

Every check takes the field's *label* first (``"AdamPreconditionerConfig.epsilon"``,
``"muon.lr (--muon.lr)"``), returns the value when it passes, and raises ``ValueError`` whose
message starts with the label otherwise, so a config's ``__post_init__`` reads one line per field.

Rules shared by all checks:

- a ``bool`` is never an int or a float (``True`` passes ``isinstance(True, int)``, but
  ``precondition_frequency=True`` is a mistake, not a 1);
- a float is never an int (``2.0`` steps is refused: the caller meant something else);
- NaN is never in range; infinities are refused unless ``finite=False``;
- torch is imported only by the dtype check, so the commands that never load it (``prepare``,
  the evidence tools) stay fast to start;
- bounds: ``at_least``/``at_most`` are closed (``>=``/``<=``), ``greater_than``/``less_than``
  open (``>``/``<``); the message shows the interval as ``(0, 1]``.

Example:
    >>> check_float("AdamPreconditionerConfig.beta2", 0.999, greater_than=0.0, at_most=1.0)
    0.999
    >>> check_int("muon.ns_steps (--muon.ns-steps)", True, at_least=1)
    Traceback (most recent call last):
    ...
    ValueError: muon.ns_steps (--muon.ns-steps) must be an int >= 1, got True
    >>> import torch
    >>> check_dtype("shampoo.root_dtype", "bfloat16", (torch.float32, torch.bfloat16))
    torch.bfloat16
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def bounds_text(
    at_least: float | None = None,
    greater_than: float | None = None,
    at_most: float | None = None,
    less_than: float | None = None,
) -> str:
    """The bounds as the message shows them: ``">= 1"``, ``"in (0, 1]"`` or ``""`` (none)."""
    if at_least is not None and greater_than is not None:
        raise TypeError("give at most one of at_least and greater_than")
    if at_most is not None and less_than is not None:
        raise TypeError("give at most one of at_most and less_than")
    low = at_least if at_least is not None else greater_than
    high = at_most if at_most is not None else less_than
    if low is not None and high is not None:
        left = "[" if at_least is not None else "("
        right = "]" if at_most is not None else ")"
        return f"in {left}{low}, {high}{right}"
    if low is not None:
        return f"{'>=' if at_least is not None else '>'} {low}"
    if high is not None:
        return f"{'<=' if at_most is not None else '<'} {high}"
    return ""


def _within(
    value: float,
    at_least: float | None,
    greater_than: float | None,
    at_most: float | None,
    less_than: float | None,
) -> bool:
    # Written as "not (value < bound)" would let NaN through; these comparisons are all False
    # for NaN, so NaN is never in range.
    return (
        (at_least is None or value >= at_least)
        and (greater_than is None or value > greater_than)
        and (at_most is None or value <= at_most)
        and (less_than is None or value < less_than)
    )


def _fail(
    label: str, expected: str, value: Any, optional: bool, or_infinity: bool = False
) -> ValueError:
    alternatives = " or math.inf" * or_infinity + " or None" * optional
    return ValueError(f"{label} must be {expected}{alternatives}, got {value!r}")


def is_int(value: Any) -> bool:
    """An integer that is not a bool (``numbers.Integral``: numpy ints count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A real number that is not a bool: an int or a float (NaN and infinities included)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(
    label: str,
    value: Any,
    *,
    at_least: int | None = None,
    greater_than: int | None = None,
    at_most: int | None = None,
    less_than: int | None = None,
    optional: bool = False,
    or_infinity: bool = False,
) -> Any:
    """``value`` if it is an int (not a bool) within the bounds (``optional``: or None;
    ``or_infinity``: or ``math.inf``, the Shampoo library's "no limit" for sizes and steps)."""
    if (value is None and optional) or (or_infinity and is_real(value) and value == math.inf):
        return value
    bounds = bounds_text(at_least, greater_than, at_most, less_than)
    if not (is_int(value) and _within(value, at_least, greater_than, at_most, less_than)):
        raise _fail(label, f"an int {bounds}".rstrip(), value, optional, or_infinity)
    return value


def check_float(
    label: str,
    value: Any,
    *,
    at_least: float | None = None,
    greater_than: float | None = None,
    at_most: float | None = None,
    less_than: float | None = None,
    finite: bool = True,
    optional: bool = False,
) -> Any:
    """``value`` if it is a real number (an int or a float, not a bool, not NaN; finite unless
    ``finite=False``) within the bounds (``optional``: or None)."""
    if value is None and optional:
        return value
    bounds = bounds_text(at_least, greater_than, at_most, less_than)
    ok = (
        is_real(value)
        and not math.isnan(value)
        and (not finite or math.isfinite(value))
        and _within(value, at_least, greater_than, at_most, less_than)
    )
    if not ok:
        raise _fail(label, _float_expectation(bounds, finite), value, optional)
    return value


def _float_expectation(bounds: str, finite: bool) -> str:
    """``"in (0.0, 1.0]"`` (two bounds: finite goes without saying), ``"finite and > 0.0"``,
    ``">= 0.0"`` (infinities allowed), ``"a finite number"`` or ``"a number"`` (no bounds)."""
    if bounds.startswith("in "):
        return bounds
    if bounds:
        return f"finite and {bounds}" if finite else bounds
    return "a finite number" if finite else "a number"


def check_bool(label: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False`` (not 0, 1 or a string)."""
    if not isinstance(value, bool):
        raise ValueError(f"{label} must be a bool, got {value!r}")
    return value


def check_choice(label: str, value: T, choices: Collection[Any]) -> T:
    """``value`` if it equals one of ``choices`` (a bool never matches 0 or 1, nor 1 True)."""
    if not any(isinstance(value, bool) == isinstance(c, bool) and value == c for c in choices):
        raise ValueError(f"{label} must be one of {list(choices)}, got {value!r}")
    return value


def dtype_name(dtype: torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``."""
    return str(dtype).removeprefix("torch.")


def check_dtype(
    label: str, value: Any, allowed: Collection[torch.dtype], *, optional: bool = False
) -> torch.dtype | None:
    """The ``torch.dtype`` that ``value`` names, if it is one of ``allowed``.

    ``value`` is a ``torch.dtype`` or its name, with or without the ``torch.`` prefix
    (``"bfloat16"``, ``"torch.bfloat16"``: how TOML files and flags spell it); ``optional``:
    None passes (returned as None).
    """
    import torch

    if value is None and optional:
        return None
    dtype = value
    if isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
    if not (isinstance(dtype, torch.dtype) and dtype in allowed):
        names = [dtype_name(d) for d in allowed]
        raise _fail(label, f"one of {names}", value, optional)
    return dtype
