"""Bad input to DistAdam: loaded state, gradients, parameters. Each raises ValueError or TypeError
naming the entry or parameter, and leaves the parameters, the state and the gradients as they
were (validate, then mutate)."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from nanoshampoo.optim.dist_adam import DistAdam


def make() -> tuple[list[torch.nn.Parameter], DistAdam]:
    """Three parameters (a matrix, a bias, a 0-D gain) after two steps, with fresh gradients."""
    torch.manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(8, 4)),
        torch.nn.Parameter(torch.randn(8)),
        torch.nn.Parameter(torch.tensor(1.5)),
    ]
    opt = DistAdam(params, lr=0.1, weight_decay=0.01)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        if opt.state:
            break
        opt.step()
    opt.step()
    for p in params:
        p.grad = torch.randn_like(p)
    return params, opt


def everything(params: list[Tensor], opt: DistAdam) -> Any:
    """A deep copy of what a failed call must not change."""
    return copy.deepcopy(
        (
            [p.detach().clone() for p in params],
            [None if p.grad is None else p.grad.clone() for p in params],
            opt.state_dict(),
        )
    )


def assert_same(a: Any, b: Any) -> None:
    (pa, ga, sa), (pb, gb, sb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(ga, gb))
    assert sa["param_groups"] == sb["param_groups"]
    for index, entry in sa["state"].items():
        other = sb["state"][index]
        assert entry["step"] == other["step"]
        assert torch.equal(entry["exp_avg"], other["exp_avg"])
        assert torch.equal(entry["exp_avg_sq"], other["exp_avg_sq"])


@pytest.mark.parametrize(
    "key, value, error, match",
    [
        ("step", -1, ValueError, r"state\[0\]\['step'\] must be an int >= 1"),
        ("step", 0, ValueError, r"'step'\] must be an int >= 1"),
        ("step", "abc", ValueError, r"'step'\] must be an int >= 1, got 'abc'"),
        ("step", 1.5, ValueError, r"'step'\]"),
        ("exp_avg", 0, TypeError, r"state\[0\]\['exp_avg'\] must be a tensor, got int"),
        ("exp_avg", torch.full((8, 4), math.nan), ValueError, r"'exp_avg'\] holds NaN"),
        (
            "exp_avg_sq",
            torch.full((8, 4), math.inf),
            ValueError,
            r"'exp_avg_sq'\] holds NaN or Inf",
        ),
        ("exp_avg_sq", -torch.ones(8, 4), ValueError, r"'exp_avg_sq'\] holds negative"),
        ("exp_avg", torch.zeros(4, 8), ValueError, r"shape \(4, 8\), expected the local shard"),
        ("exp_avg", torch.zeros(8, 4, dtype=torch.int64), ValueError, r"dtype torch.int64"),
    ],
)
def test_load_state_dict_refuses_a_bad_entry_and_changes_nothing(
    key: str, value: Any, error: type[Exception], match: str
) -> None:
    params, opt = make()
    bad = copy.deepcopy(opt.state_dict())
    bad["state"][0][key] = value
    before = everything(params, opt)
    with pytest.raises(error, match=match):
        opt.load_state_dict(bad)
    assert_same(everything(params, opt), before)
    opt.step()  # the optimizer still works, from its own state
    assert all(opt.state[p]["step"] == 3 for p in params)


@pytest.mark.parametrize(
    "mangle, error, match",
    [
        (lambda sd: sd.update(state=[1, 2]), ValueError, r"state_dict\['state'\] must be a dict"),
        (lambda sd: sd.update(param_groups="x"), ValueError, "param_groups"),
        (
            lambda sd: sd["state"].update({7: sd["state"][0]}),
            ValueError,
            r"state index \(of \d+ params\) must be an int in \[0, \d+\), got 7",
        ),
        (lambda sd: sd["state"].update({0: "x"}), TypeError, r"state\[0\] must be a dict"),
        (lambda sd: sd.update(dist_adam="x"), ValueError, "no 'dist_adam' entry"),
    ],
)
def test_load_state_dict_refuses_a_bad_layout(
    mangle: Any, error: type[Exception], match: str
) -> None:
    params, opt = make()
    bad = copy.deepcopy(opt.state_dict())
    mangle(bad)
    before = everything(params, opt)
    with pytest.raises(error, match=match):
        opt.load_state_dict(bad)
    assert_same(everything(params, opt), before)


@settings(max_examples=40, deadline=None, database=None)
@given(
    index=st.integers(0, 2),
    key=st.sampled_from(["step", "exp_avg", "exp_avg_sq"]),
    value=st.one_of(
        st.integers(-3, 3),
        st.floats(),
        st.none(),
        st.text(max_size=3),
        st.one_of(st.floats(-1e6, 1e6), st.sampled_from([math.nan, math.inf, -math.inf])).map(
            lambda x: torch.full((8, 4), x)
        ),
    ),
)
def test_any_loaded_state_either_steps_finitely_or_is_refused_unchanged(
    index: int, key: str, value: Any
) -> None:
    params, opt = make()
    bad = copy.deepcopy(opt.state_dict())
    bad["state"][index][key] = value
    before = everything(params, opt)
    try:
        opt.load_state_dict(bad)
    except (ValueError, TypeError) as exc:
        assert f"state[{index}]" in str(exc)
        assert_same(everything(params, opt), before)
        return
    opt.step()
    assert all(bool(torch.isfinite(p).all()) for p in params)


@pytest.mark.parametrize(
    "corrupt, error, match",
    [
        (
            lambda opt, ps: opt.state[ps[0]].update(step=-1),
            ValueError,
            r"param 0 of group 0.*'step'",
        ),
        (
            lambda opt, ps: opt.state[ps[1]].update(exp_avg=0),
            TypeError,
            r"exp_avg'\] must be a tensor",
        ),
        (
            lambda opt, ps: setattr(ps[1], "grad", ps[1].grad.to_sparse()),
            TypeError,
            r"param 0 of group 1 \(shape \(8,\)\) has a torch.sparse_coo gradient",
        ),
        (
            lambda opt, ps: setattr(ps[0].grad, "data", torch.ones(4, 8)),
            ValueError,
            r"param 0 of group 0 \(shape \(8, 4\)\) has a gradient of shape \(4, 8\)",
        ),
    ],
)
def test_step_validates_before_changing_anything(
    corrupt: Any, error: type[Exception], match: str
) -> None:
    params, opt = make()
    corrupt(opt, params)
    before = [p.detach().clone() for p in params], [copy.deepcopy(opt.state[p]) for p in params]
    with pytest.raises(error, match=match):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before[0]))
    for p, saved in zip(params, before[1]):
        for key, value in saved.items():
            now = opt.state[p][key]
            assert torch.equal(now, value) if isinstance(value, Tensor) else now == value


def test_a_set_of_parameters_is_refused() -> None:
    params = {torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))}
    with pytest.raises(TypeError, match="not a set"):
        DistAdam(params)
    with pytest.raises(TypeError, match="not a set"):
        DistAdam([{"params": params}])


@pytest.mark.parametrize("key", ["learning_rate", "momentum", "amsgrad", "weight_decy"])
def test_a_param_group_key_distadam_does_not_read_is_refused(key: str) -> None:
    # Before: accepted and ignored, so the option stayed at its default.
    params, opt = make()
    extra = torch.nn.Parameter(torch.randn(3, 3))
    before, groups = everything(params, opt), len(opt.param_groups)
    with pytest.raises(ValueError, match=f"param group {groups}: unknown option.*{key}"):
        opt.add_param_group({"params": [extra], key: 5.0})
    assert len(opt.param_groups) == groups and extra._post_accumulate_grad_hooks is None
    assert_same(before, everything(params, opt))
    with pytest.raises(ValueError, match=f"unknown option.*{key}"):
        DistAdam([{"params": [extra], key: 5.0}])


@settings(max_examples=15, deadline=None, database=None)
@given(
    order=st.lists(st.integers(0, 2), min_size=2, max_size=6).filter(
        lambda xs: len(set(xs)) < len(xs)
    )
)
def test_a_parameter_listed_twice_is_refused(order: list[int]) -> None:
    # Before: DistAdam([p, p]) accepted, and p was updated twice per step.
    params = [torch.nn.Parameter(torch.randn(4, 2)) for _ in range(3)]
    listed = [params[i] for i in order]
    with pytest.raises(ValueError, match="same tensor"):
        DistAdam(listed)
    with pytest.raises(ValueError, match="same tensor"):
        DistAdam(iter(listed))  # a generator too
    assert all(p._post_accumulate_grad_hooks is None for p in params)  # no hook left behind


@pytest.mark.parametrize(
    "tensor", [torch.randn(3), torch.zeros(3, dtype=torch.long)], ids=["no-grad", "integer"]
)
def test_a_tensor_that_does_not_require_grad_is_a_value_error(tensor: Tensor) -> None:
    # Before: RuntimeError "cannot register a hook on a tensor that doesn't require gradient".
    with pytest.raises(ValueError, match="does not require grad"):
        DistAdam([torch.nn.Parameter(torch.randn(2)), tensor])
