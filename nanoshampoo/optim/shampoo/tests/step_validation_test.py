"""A DistributedShampoo step is all or nothing: bad values and gradients are refused before
anything moves, and hyperparameters changed after construction apply where they are defined."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from flat_shampoo_state import assert_same_flat_state, flat_state

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DDPDistributedConfig,
    DistributedShampoo,
    EigenConfig,
    EigenvalueCorrectedShampooPreconditionerConfig,
    PseudoInverseConfig,
    RootInvShampooPreconditionerConfig,
    SGDPreconditionerConfig,
    group_validation,
)
from nanoshampoo.optim.shampoo.config_checks import error_field

torch.set_num_threads(1)

SHAPES = [(6, 5), (7,), (3, 4, 5)]


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _set_grads(params: list[torch.nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _two_group_optimizer() -> tuple[DistributedShampoo, list[torch.nn.Parameter]]:
    params = _params()
    opt = DistributedShampoo(
        [{"params": params[:1]}, {"params": params[1:]}],
        lr=0.01,
        epsilon=1e-8,
        max_preconditioner_dim=8,
        grafting_config=AdamPreconditionerConfig(),
    )
    return opt, params


def _snapshot(opt: DistributedShampoo, params: list[torch.nn.Parameter]) -> dict[str, Any]:
    """Parameters and the whole state (each group's step included), cloned."""
    return {"params": [p.detach().clone() for p in params], "state": flat_state(opt.state_dict())}


def _assert_unchanged(
    opt: DistributedShampoo, params: list[torch.nn.Parameter], before: dict[str, Any]
) -> None:
    after = _snapshot(opt, params)
    assert all(torch.equal(a, b) for a, b in zip(after["params"], before["params"], strict=True))
    assert_same_flat_state(after["state"], before["state"])


INVALID_VALUES = [
    ("lr", math.inf),
    ("lr", math.nan),
    ("weight_decay", math.inf),
    ("weight_decay", math.nan),
    ("epsilon", math.inf),
    ("epsilon", math.nan),
    ("epsilon", 0.0),
    ("betas", 0.9),
]


@pytest.mark.parametrize(
    ("field", "value"), INVALID_VALUES, ids=[f"{f}={v}" for f, v in INVALID_VALUES]
)
def test_non_finite_values_and_scalar_betas_are_refused_at_construction(
    field: str, value: Any
) -> None:
    with pytest.raises(ValueError) as info:
        DistributedShampoo(_params(), **{field: value})
    assert re.match(field, error_field(info.value)), str(info.value)


def test_epsilon_zero_only_with_a_pseudo_inverse() -> None:
    pseudo = RootInvShampooPreconditionerConfig(
        amortized_computation_config=EigenConfig(
            rank_deficient_stability_config=PseudoInverseConfig()
        )
    )
    DistributedShampoo(_params(), epsilon=0.0, preconditioner_config=pseudo)
    with pytest.raises(
        ValueError,
        match=r"^Invalid param_group\[EPSILON\]=1e-12\. Must be == 0\.0 when PseudoInverseConfig "
        r"is",
    ):
        DistributedShampoo(_params(), epsilon=1e-12, preconditioner_config=pseudo)
    with pytest.raises(
        ValueError,
        match=r"^Invalid param_group\[EPSILON\]=0\.0\. Must be > 0\.0\..*PseudoInverseConfig",
    ):
        DistributedShampoo(
            _params(), epsilon=0.0, preconditioner_config=RootInvShampooPreconditionerConfig()
        )


# Values a scheduler or a user may set on a group between steps that the step must refuse.
CHANGES_REFUSED = [
    ("lr", math.inf),
    ("lr", math.nan),
    ("weight_decay", math.nan),
    ("epsilon", math.inf),
    ("betas", 0.9),
    ("momentum", 1.0),
    ("use_nesterov", True),
    ("start_preconditioning_step", 0),
    ("max_preconditioner_dim", 4),
    ("preconditioner_config", EigenvalueCorrectedShampooPreconditionerConfig()),
    ("grafting_config", SGDPreconditionerConfig()),
    ("distributed_config", DDPDistributedConfig()),
]


@pytest.mark.parametrize(
    ("field", "value"),
    CHANGES_REFUSED,
    ids=[f"{f}-{i}" for i, (f, _) in enumerate(CHANGES_REFUSED)],
)
def test_invalid_change_between_steps_is_refused_before_anything_moves(
    field: str, value: Any
) -> None:
    opt, params = _two_group_optimizer()
    _set_grads(params, 1)
    opt.step()
    before = _snapshot(opt, params)
    _set_grads(params, 2)
    opt.param_groups[1][field] = value  # group 0 comes first and is valid: it must not move either
    with pytest.raises(ValueError, match=r"\(param_groups\[1\]; no parameter or state") as info:
        opt.step()
    assert error_field(info.value) == field
    _assert_unchanged(opt, params, before)


def test_changed_params_list_is_refused() -> None:
    opt, params = _two_group_optimizer()
    _set_grads(params, 1)
    before = _snapshot(opt, params)
    built = opt.param_groups[1]["params"]
    opt.param_groups[1]["params"] = params[1:2]
    with pytest.raises(ValueError, match=r"^params cannot change"):
        opt.step()
    opt.param_groups[1]["params"] = built  # torch's state_dict() needs every state's parameter
    _assert_unchanged(opt, params, before)


def test_sparse_gradient_is_refused_naming_the_parameter_before_anything_moves() -> None:
    opt, params = _two_group_optimizer()
    _set_grads(params, 1)
    opt.step()
    before = _snapshot(opt, params)
    _set_grads(params, 2)
    params[2].grad = params[2].grad.to_sparse()
    with pytest.raises(
        ValueError, match=r"params'\]\[1\] \(shape \(3, 4, 5\)\) is torch.sparse_coo"
    ):
        opt.step()
    _assert_unchanged(opt, params, before)


def test_complex_gradient_is_refused_naming_the_parameter_before_anything_moves() -> None:
    opt, params = _two_group_optimizer()
    _set_grads(params, 1)
    opt.step()
    before = _snapshot(opt, params)
    _set_grads(params, 2)
    params[1].grad_dtype = None  # torch >= 2.10 otherwise refuses a complex .grad on a real param
    params[1].grad = torch.complex(params[1].grad, params[1].grad)
    with pytest.raises(
        ValueError, match=r"params'\]\[0\] \(shape \(7,\)\) has dtype torch.complex64"
    ):
        opt.step()
    _assert_unchanged(opt, params, before)


def test_complex_parameter_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"^params\[1\] is complex"):
        DistributedShampoo(
            [
                torch.nn.Parameter(torch.zeros(3)),
                torch.nn.Parameter(torch.zeros(3, dtype=torch.cfloat)),
            ]
        )


def test_invalid_group_added_later_leaves_the_optimizer_as_it_was() -> None:
    opt, params = _two_group_optimizer()
    extra = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"^Invalid param_group\[LR\]"):
        opt.add_param_group({"params": [extra], "lr": math.inf})
    assert len(opt.param_groups) == 2 and extra not in opt.state
    _set_grads(params, 1)
    opt.step()  # still steps: no half-added group is left behind


def test_momentum_and_weight_decay_turned_on_after_construction_apply_from_the_next_step() -> None:
    """The case of the issue: momentum and weight decay set on the group after construction.
    From zero momentum, the first step's update is the same as without momentum (times
    ``1 - dampening``), and decoupled decay adds ``lr * wd * W``, exactly."""
    w = torch.nn.Parameter(
        torch.randn(6, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    )
    twin = torch.nn.Parameter(w.detach().clone())
    config = RootInvShampooPreconditionerConfig(factor_matrix_dtype=torch.float64)
    opts = [
        DistributedShampoo(
            [p], lr=0.1, epsilon=1e-6, max_preconditioner_dim=8, preconditioner_config=config
        )
        for p in (w, twin)
    ]
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(6, 5, generator=gen, dtype=torch.float64) for _ in range(2)]
    for p, opt in zip((w, twin), opts):
        p.grad = grads[0].clone()
        opt.step()
    opts[0].param_groups[0].update(momentum=0.9, dampening=0.5, weight_decay=0.1)
    w_before = w.detach().clone()
    twin_before = twin.detach().clone()
    for p, opt in zip((w, twin), opts):
        p.grad = grads[1].clone()
        opt.step()
    plain_update = twin.detach() - twin_before  # -lr * P
    expected = w_before + 0.5 * (plain_update - 0.1 * 0.1 * w_before)
    torch.testing.assert_close(w.detach(), expected, rtol=1e-12, atol=1e-14)
    momentum = opts[0].state[w]["block_0"]["momentum_buffer"]
    torch.testing.assert_close(momentum, (w_before - w.detach()) / 0.1, rtol=1e-12, atol=1e-14)


def test_a_step_re_checks_only_the_entries_that_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation runs when a group is added; a step with unchanged entries runs none, one
    after a schedule's ``lr`` write runs the ``lr`` rule alone, and one after any other change
    runs every rule (they relate entries)."""
    opt, params = _two_group_optimizer()
    calls = []
    real = group_validation.validate_group
    monkeypatch.setattr(group_validation, "validate_group", lambda g: calls.append(1) or real(g))
    for seed, change, expected in [
        (1, {}, 0),
        (2, {}, 0),
        (3, {"lr": 0.005}, 0),
        (4, {"betas": (0.8, 1.0)}, 1),
        (5, {}, 0),
    ]:
        opt.param_groups[0].update(change)
        _set_grads(params, seed)
        opt.step()
        assert len(calls) == expected, (seed, change)
        calls.clear()


def test_a_scheduler_writing_lr_steps_as_that_lr_given_at_construction() -> None:
    """``LambdaLR`` halving lr 0.02 at every step moves the parameters exactly as lr 0.01 set
    at construction does (halving is exact in binary floating point)."""
    moved = []
    for lr, factor in [(0.02, 0.5), (0.01, 1.0)]:
        params = _params()
        opt = DistributedShampoo(
            params, lr=lr, epsilon=1e-8, grafting_config=AdamPreconditionerConfig()
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step, f=factor: f)
        for seed in range(1, 4):
            _set_grads(params, seed)
            opt.step()
            schedule.step()
        moved.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*moved, strict=True))
