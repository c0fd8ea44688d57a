"""``nanoshampoo.validation``: each check passes exactly the values its rule admits and names
the field in its error."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nanoshampoo.validation import (
    bounds_text,
    check_bool,
    check_choice,
    check_dtype,
    check_float,
    check_int,
)

LABEL = "muon.lr (--muon.lr)"


@pytest.mark.parametrize("value", [True, False, 1.0, 2.5, "3", None, [1]])
def test_check_int_refuses_what_is_not_an_int_and_names_the_field(value: object) -> None:
    with pytest.raises(ValueError, match=r"^muon\.lr \(--muon\.lr\) must be an int, got "):
        check_int(LABEL, value)


@pytest.mark.parametrize("value", [0, -7, 10**30, np.int64(3)])
def test_check_int_returns_an_int_without_bounds(value: int) -> None:
    assert check_int(LABEL, value) is value


@pytest.mark.parametrize(
    "kwargs, inside, outside",
    [
        (dict(at_least=1), [1, 2], [0, -1]),
        (dict(greater_than=1), [2], [1, 0]),
        (dict(at_most=3), [3, -5], [4]),
        (dict(less_than=3), [2], [3]),
        (dict(at_least=0, less_than=4), [0, 3], [-1, 4]),
    ],
)
def test_check_int_bounds_open_and_closed(kwargs: dict, inside: list, outside: list) -> None:
    for value in inside:
        assert check_int(LABEL, value, **kwargs) == value
    for value in outside:
        with pytest.raises(ValueError, match=f"got {value}$"):
            check_int(LABEL, value, **kwargs)


def test_check_int_optional_admits_none_and_says_so() -> None:
    assert check_int("x", None, optional=True) is None
    with pytest.raises(ValueError, match=r"^x must be an int >= 1 or None, got 0$"):
        check_int("x", 0, at_least=1, optional=True)


def test_check_int_or_infinity_admits_math_inf_only() -> None:
    assert check_int("split_size", math.inf, at_least=1, or_infinity=True) == math.inf
    for value in (-math.inf, math.nan, 2.5, 0):
        with pytest.raises(ValueError) as raised:
            check_int("split_size", value, at_least=1, or_infinity=True)
        assert str(raised.value) == f"split_size must be an int >= 1 or math.inf, got {value!r}"
    with pytest.raises(ValueError, match="got inf$"):
        check_int("split_size", math.inf, at_least=1)


@pytest.mark.parametrize("value", [True, False, "0.1", None, torch.tensor(0.5)])
def test_check_float_refuses_bools_strings_and_tensors(value: object) -> None:
    with pytest.raises(ValueError, match=r"^AdamPreconditionerConfig\.epsilon must be finite and "):
        check_float("AdamPreconditionerConfig.epsilon", value, greater_than=0.0)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_check_float_refuses_nan_and_infinities_by_default(value: float) -> None:
    with pytest.raises(ValueError, match="must be a finite number"):
        check_float(LABEL, value)


def test_check_float_finite_false_admits_infinities_never_nan() -> None:
    assert check_float(LABEL, math.inf, finite=False, at_least=0.0) == math.inf
    with pytest.raises(ValueError, match="must be >= 0.0, got -inf"):
        check_float(LABEL, -math.inf, finite=False, at_least=0.0)
    with pytest.raises(ValueError, match="got nan"):
        check_float(LABEL, math.nan, finite=False)
    # NaN compares False with everything: a check written as "not value < low" would pass it.
    with pytest.raises(ValueError, match="got nan"):
        check_float(LABEL, math.nan, finite=False, at_most=1.0)


@pytest.mark.parametrize("value", [0, 3, 0.25, np.float32(0.5)])
def test_check_float_admits_ints_and_numpy_floats(value: float) -> None:
    assert check_float(LABEL, value) is value


@pytest.mark.parametrize(
    "kwargs, text, inside, outside",
    [
        (dict(greater_than=0.0, at_most=1.0), "in (0.0, 1.0]", [1e-300, 1.0], [0.0, 1.0000001]),
        (dict(at_least=0.0, less_than=1.0), "in [0.0, 1.0)", [0.0, 0.999], [1.0, -1e-300]),
        (dict(greater_than=0.0, less_than=1.0), "in (0.0, 1.0)", [0.5], [0.0, 1.0]),
        (dict(at_least=0.0, at_most=1.0), "in [0.0, 1.0]", [0.0, 1.0], [-0.1, 1.1]),
        (dict(greater_than=0.0), "finite and > 0.0", [1e-12], [0.0, -1.0, math.inf]),
        (dict(at_least=0.0), "finite and >= 0.0", [0.0], [-1e-12, math.nan]),
        (dict(), "a finite number", [-1e300], [math.inf]),
        (dict(finite=False), "a number", [math.inf], [math.nan]),
    ],
)
def test_check_float_bounds_open_and_closed(
    kwargs: dict, text: str, inside: list, outside: list
) -> None:
    for value in inside:
        assert check_float(LABEL, value, **kwargs) == value
    for value in outside:
        message = f"{LABEL} must be {text}, got {value!r}"
        with pytest.raises(ValueError) as raised:
            check_float(LABEL, value, **kwargs)
        assert str(raised.value) == message


def test_bounds_text_refuses_two_lower_or_two_upper_bounds() -> None:
    with pytest.raises(TypeError):
        bounds_text(at_least=0, greater_than=0)
    with pytest.raises(TypeError):
        bounds_text(at_most=1, less_than=1)
    assert bounds_text() == ""


def test_check_bool_admits_only_true_and_false() -> None:
    assert check_bool("x", True) is True and check_bool("x", False) is False
    for value in (0, 1, "true", None):
        with pytest.raises(ValueError, match=r"^x must be a bool, got "):
            check_bool("x", value)


def test_check_choice_admits_the_choices_and_lists_them() -> None:
    assert check_choice("preconditioner.root_method", "eigh", ("eigh", "warm-qr")) == "eigh"
    with pytest.raises(ValueError) as raised:
        check_choice("preconditioner.root_method", "qr", ("eigh", "warm-qr"))
    assert (
        str(raised.value)
        == "preconditioner.root_method must be one of ['eigh', 'warm-qr'], got 'qr'"
    )


def test_check_choice_does_not_mix_bools_and_ints() -> None:
    # True == 1 in Python, so a plain ``in`` would accept True for 1 and 0 for False.
    with pytest.raises(ValueError):
        check_choice("x", True, (1, 2))
    with pytest.raises(ValueError):
        check_choice("x", 0, (False, None))
    assert check_choice("x", 1, (1, 2)) == 1 and check_choice("x", False, (False,)) is False


FLOATS = (torch.float32, torch.bfloat16)


@pytest.mark.parametrize(
    "value, expected",
    [
        ("bfloat16", torch.bfloat16),
        ("torch.bfloat16", torch.bfloat16),
        ("float32", torch.float32),
        (torch.float32, torch.float32),
    ],
)
def test_check_dtype_reads_strings_and_dtypes(value: object, expected: torch.dtype) -> None:
    assert check_dtype("shampoo.root_dtype", value, FLOATS) is expected


@pytest.mark.parametrize("value", ["float16", torch.float16, "bf16", "Size", 16, None, "torch."])
def test_check_dtype_refuses_others_and_lists_the_allowed(value: object) -> None:
    with pytest.raises(ValueError) as raised:
        check_dtype("shampoo.root_dtype", value, FLOATS)
    assert str(raised.value) == (
        f"shampoo.root_dtype must be one of ['float32', 'bfloat16'], got {value!r}"
    )


def test_check_dtype_optional_admits_none() -> None:
    assert check_dtype("x", None, FLOATS, optional=True) is None
    with pytest.raises(ValueError, match=r"or None, got 'int8'$"):
        check_dtype("x", "int8", FLOATS, optional=True)
