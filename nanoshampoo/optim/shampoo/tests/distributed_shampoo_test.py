"""DistributedShampoo against a slow dense reference written from the spec's equations."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from flat_shampoo_state import flat_state, group_step

from nanoshampoo.optim.shampoo import (
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    CoupledNewtonConfig,
    DistributedShampoo,
    EigenConfig,
    NonFiniteGradientError,
    RMSpropPreconditionerConfig,
    RootInvShampooPreconditionerConfig,
    ScheduleFreeConfig,
    SGDPreconditionerConfig,
    WeightDecayType,
)

torch.set_num_threads(1)

MAX_DIM = 8
# Shape -> block structure with max_preconditioner_dim 8: (6,5) 2-D; (7,) 1-D; (3,4,5) 3-D (does
# not merge); (2,1,2,3) -> (2,6) merged 2-D; (16,5) -> two (8,5) blocks; (10,7) -> (8,7), (2,7);
# (1,6) -> (6,); (2,2) -> (4,).
SHAPES = [(6, 5), (7,), (3, 4, 5), (2, 1, 2, 3), (16, 5), (10, 7), (1, 6), (2, 2)]
STEPS = 10


# ----------------------------------------------------------------------------------------------
# Reference: dense, float64, numpy eigh, one block at a time, the spec's equations in order.
# ----------------------------------------------------------------------------------------------


def reference_merged_shape(shape: tuple[int, ...], max_dim: int) -> tuple[int, ...]:
    """Drop size-1 dims; merge from the back while the product stays <= max_dim."""
    dims = [d for d in shape if d != 1] or [1]
    merged = [dims[-1]]
    for d in reversed(dims[:-1]):
        if merged[0] * d <= max_dim:
            merged[0] *= d
        else:
            merged.insert(0, d)
    return tuple(merged)


def reference_blocks(tensor: torch.Tensor, max_dim: int) -> list[torch.Tensor]:
    blocks = [tensor.reshape(reference_merged_shape(tuple(tensor.shape), max_dim))]
    for dim in range(blocks[0].dim()):
        blocks = [piece for b in blocks for piece in torch.split(b, max_dim, dim)]
    return blocks


def reference_exponent(order: int, dim: int, override: dict[int, Any]) -> float:
    value = override.get(order, {})
    if isinstance(value, dict):
        return value.get(dim, 1.0 / (2 * order))
    return value


def unfold(g: np.ndarray, dim: int) -> np.ndarray:
    return np.moveaxis(g, dim, 0).reshape(g.shape[dim], -1)


def reference_root(a: np.ndarray, eps: float, exponent: float) -> np.ndarray:
    mu, q = np.linalg.eigh(a)
    lam = mu + eps
    if lam.min() < eps:
        lam = lam + (eps - lam.min())
    return (q * lam ** (-exponent)) @ q.T


class ReferenceBlock:
    def __init__(self, shape: tuple[int, ...], h: dict[str, Any]) -> None:
        self.h = h
        self.order = len(shape)
        self.exponents = [
            reference_exponent(self.order, i, h["override"]) for i in range(self.order)
        ]
        self.factors = [np.zeros((n, n)) for n in shape]
        self.roots = [np.eye(n) for n in shape]
        self.v = np.zeros(shape)
        self.m = np.zeros(shape)
        self.mom = np.zeros(shape)

    def step(self, t: int, g: np.ndarray, w: np.ndarray) -> np.ndarray:
        h = self.h
        b1, b2 = h["betas"]
        b3 = b1 if h["beta3"] == -1.0 else h["beta3"]
        f = h["precondition_frequency"]
        s = f if h["start_preconditioning_step"] == -1 else h["start_preconditioning_step"]
        wd, l2 = h["weight_decay"], h["weight_decay_type"] == WeightDecayType.L2
        if l2:
            g = g + wd * w  # (1)
        weight = 1.0 if b2 == 1.0 else 1.0 - b2
        for i in range(self.order):  # (2)
            if self.exponents[i] != 0.0:
                gi = unfold(g, i)
                self.factors[i] = b2 * self.factors[i] + weight * gi @ gi.T
        bc2 = 1.0 - b2**t if h["use_bias_correction"] and b2 < 1.0 else 1.0
        graft = h["grafting_config"]  # (3)
        # Subclasses first: Adam is an RMSprop, which is an AdaGrad (as in the reference library).
        if isinstance(graft, AdamPreconditionerConfig):
            self.v = graft.beta2 * self.v + (1 - graft.beta2) * g * g
            gbc = 1.0 - graft.beta2**t
            p_g_of = lambda x: x / (np.sqrt(self.v / gbc) + graft.epsilon)
        elif isinstance(graft, RMSpropPreconditionerConfig):
            self.v = graft.beta2 * self.v + (1 - graft.beta2) * g * g
            p_g_of = lambda x: x / (np.sqrt(self.v) + graft.epsilon)
        elif isinstance(graft, AdaGradPreconditionerConfig):
            self.v = self.v + g * g
            p_g_of = lambda x: x / (np.sqrt(self.v) + graft.epsilon)
        else:
            p_g_of = lambda x: x
        if (t % f == 0 and t > s) or t == s:  # (4)
            for i in range(self.order):
                if self.exponents[i] != 0.0:
                    self.roots[i] = reference_root(
                        self.factors[i] / bc2, h["epsilon"], self.exponents[i]
                    )
        if b1 == 0.0:  # (5)
            gbar = g
        else:
            current = b3 * self.m + (1 - b3) * g
            self.m = b1 * self.m + (1 - b1) * g
            gbar = current / (1.0 - b3 * b1 ** (t - 1)) if h["use_bias_correction"] else current
        if t >= s:  # (6)
            p_s = gbar
            for i in range(self.order):
                if self.exponents[i] != 0.0:
                    p_s = np.moveaxis(np.tensordot(self.roots[i], p_s, axes=([1], [i])), 0, i)
            if graft is None:
                p = p_s
            else:
                p_g = p_g_of(gbar)
                p = p_s * np.linalg.norm(p_g) / (np.linalg.norm(p_s) + 1e-16)
        else:
            p = p_g_of(gbar) if graft is not None else gbar
        if not l2:  # (7)
            p = p + wd * w
        mu = h["momentum"]
        if mu > 0.0:
            self.mom = mu * self.mom + (1 - h["dampening"]) * p
            p = p + mu * self.mom if h["use_nesterov"] else self.mom
        return w - h["lr"] * p  # (8)


DEFAULTS: dict[str, Any] = dict(
    lr=0.05,
    betas=(0.9, 1.0),
    beta3=-1.0,
    epsilon=1e-3,
    momentum=0.0,
    dampening=0.0,
    use_nesterov=False,
    weight_decay=0.0,
    weight_decay_type=WeightDecayType.DECOUPLED,
    precondition_frequency=1,
    start_preconditioning_step=-1,
    use_bias_correction=True,
    grafting_config=None,
    override={},
)

CASES = {
    "default_no_grafting": {},
    "adam_grafting": dict(grafting_config=AdamPreconditionerConfig(beta2=0.99, epsilon=1e-8)),
    "adagrad_grafting": dict(grafting_config=AdaGradPreconditionerConfig(epsilon=1e-8)),
    "rmsprop_grafting": dict(grafting_config=RMSpropPreconditionerConfig(beta2=0.9, epsilon=1e-8)),
    "sgd_grafting": dict(grafting_config=SGDPreconditionerConfig()),
    "frequency3_start_default": dict(
        precondition_frequency=3, grafting_config=AdamPreconditionerConfig()
    ),
    "frequency3_start5": dict(
        precondition_frequency=3,
        start_preconditioning_step=5,
        grafting_config=AdaGradPreconditionerConfig(epsilon=1e-8),
    ),
    "start5": dict(start_preconditioning_step=5),
    "beta2_ema": dict(betas=(0.9, 0.95), grafting_config=AdamPreconditionerConfig()),
    "beta2_ema_no_bias_correction": dict(betas=(0.8, 0.95), use_bias_correction=False),
    "no_filtering": dict(betas=(0.0, 1.0)),
    "beta3": dict(betas=(0.95, 0.99), beta3=0.8, grafting_config=AdamPreconditionerConfig()),
    "l2": dict(
        weight_decay=0.1,
        weight_decay_type=WeightDecayType.L2,
        grafting_config=AdamPreconditionerConfig(),
    ),
    "decoupled": dict(
        weight_decay=0.1,
        weight_decay_type=WeightDecayType.DECOUPLED,
        grafting_config=AdamPreconditionerConfig(),
    ),
    "momentum": dict(momentum=0.9, dampening=0.1, grafting_config=AdamPreconditionerConfig()),
    "nesterov": dict(momentum=0.9, use_nesterov=True, grafting_config=AdamPreconditionerConfig()),
    "exponent_override": dict(override={2: {0: 0.0}, 1: 0.25, 3: 0.2}),
    # Preconditioning from the first steps, while every factor is still rank-deficient (the
    # settings of the issue-19 side-by-side check): the first root uses the step-2 (or step-1)
    # gradient, and epsilon is the only thing on the factors' null spaces.
    "start2_frequency2_rank_deficient": dict(
        betas=(0.9, 0.999),
        epsilon=1e-6,
        precondition_frequency=2,
        start_preconditioning_step=2,
        weight_decay=0.01,
        grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
    ),
    "start1_epsilon_1e-12_rank_deficient": dict(
        betas=(0.9, 0.999),
        epsilon=1e-12,
        precondition_frequency=1,
        start_preconditioning_step=1,
        weight_decay=0.01,
        grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
    ),
}


def _make_params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in SHAPES]


def _grad_sequence(seed: int, steps: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed + 1)
    return [
        [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES] for _ in range(steps)
    ]


def _optimizer(
    params: list[torch.nn.Parameter], h: dict[str, Any], **extra: Any
) -> DistributedShampoo:
    kwargs = {k: v for k, v in h.items() if k != "override"}
    config = RootInvShampooPreconditionerConfig(
        factor_matrix_dtype=torch.float64,
        inverse_exponent_override=h["override"],
        **extra.pop("shampoo", {}),
    )
    return DistributedShampoo(
        params, max_preconditioner_dim=MAX_DIM, preconditioner_config=config, **kwargs, **extra
    )


def _run(
    opt: DistributedShampoo, params: list[torch.nn.Parameter], grads: list[list[torch.Tensor]]
) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_dense_reference(case: str) -> None:
    _check_against_dense_reference(case)


@pytest.mark.parametrize(
    "case", ["adam_grafting", "beta2_ema", "exponent_override", "frequency3_start5"]
)
def test_full_factors_match_dense_reference(case: str) -> None:
    """``use_symmetric_packing=False`` (the default packs upper triangles): the same float64
    trajectory."""
    _check_against_dense_reference(case, shampoo={"use_symmetric_packing": False})


def _reference_block_lists(params: list[torch.Tensor], h: dict[str, Any]) -> list[list[Any]]:
    """One float64 ``ReferenceBlock`` per block of each parameter, as the optimizer blocks it."""
    return [
        [ReferenceBlock(tuple(b.shape), h) for b in reference_blocks(p.detach(), MAX_DIM)]
        for p in params
    ]


def _check_against_dense_reference(case: str, **extra: Any) -> None:
    h = {**DEFAULTS, **CASES[case]}
    params = _make_params(0)
    grads = _grad_sequence(0, STEPS)
    expected = [p.detach().clone() for p in params]
    ref_blocks = _reference_block_lists(params, h)
    for t, step_grads in enumerate(grads, start=1):
        for index, g in enumerate(step_grads):
            w_blocks = reference_blocks(expected[index], MAX_DIM)
            g_blocks = reference_blocks(g, MAX_DIM)
            for block, wb, gb in zip(ref_blocks[index], w_blocks, g_blocks):
                wb.copy_(torch.from_numpy(block.step(t, gb.numpy(), wb.numpy().copy())))

    opt = _optimizer(params, h, **extra)
    _run(opt, params, grads)
    for p, e in zip(params, expected):
        relative = (torch.linalg.vector_norm(p.detach() - e) / torch.linalg.vector_norm(e)).item()
        assert relative < 1e-9, (case, tuple(p.shape), relative)


def test_reference_blocking_matches_the_spec_examples() -> None:
    assert reference_merged_shape((2, 1, 2, 3), 8) == (2, 6)
    assert reference_merged_shape((3, 4, 5), 8) == (3, 4, 5)
    assert [tuple(b.shape) for b in reference_blocks(torch.zeros(10, 7), 8)] == [(8, 7), (2, 7)]
    assert [tuple(b.shape) for b in reference_blocks(torch.zeros(768, 3072), 1024)] == [
        (768, 1024)
    ] * 3
    assert reference_merged_shape((1, 64), 1024) == (64,)


# Per-factor inverse exponents by block shape (max_preconditioner_dim 8): the rule 1 / (2 * order)
# by default; with the "exponent_override" case ({2: {0: 0.0}, 1: 0.25, 3: 0.2}) a 2-D block has no
# dim-0 factor, 1-D blocks use 1/4 and 3-D blocks 1/5 on every dim. None: no factor on that dim.
EXPECTED_EXPONENTS = {
    "default": {1: [1 / 2], 2: [1 / 4, 1 / 4], 3: [1 / 6, 1 / 6, 1 / 6]},
    "exponent_override": {1: [1 / 4], 2: [None, 1 / 4], 3: [1 / 5, 1 / 5, 1 / 5]},
}


def _symmetric_from_packed(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The symmetric ``n x n`` matrix whose row-major upper triangle is ``packed``."""
    assert packed.shape == (n * (n + 1) // 2,)
    rows, cols = torch.triu_indices(n, n)
    full = torch.zeros(n, n, dtype=packed.dtype)
    full[rows, cols] = packed
    full[cols, rows] = packed
    return full


@pytest.mark.parametrize("case", sorted(EXPECTED_EXPONENTS))
def test_block_state_keys_and_exponents(case: str) -> None:
    """Every block has one factor per dim with a nonzero exponent, and its root after step 1 is
    ``(F + eps I)^(-e)`` with ``e`` from the rule (or the override), checked per factor."""
    h = {**DEFAULTS, **CASES.get(case, {})}
    params = _make_params(0)
    opt = _optimizer(params, h)
    state = flat_state(opt.state_dict())
    assert "block_1.shampoo.factor_matrices.1" in state[4]  # (16, 5): two blocks
    assert state[0]["block_0.shampoo.factor_matrices.1"].dtype == torch.float64
    _run(
        opt, params, _grad_sequence(0, 1)
    )  # b2 = 1, frequency 1: roots at step 1, no bias correction
    state = flat_state(opt.state_dict())
    checked = 0
    for index, param in enumerate(params):
        for j, block in enumerate(reference_blocks(param.detach(), MAX_DIM)):
            for dim, exponent in enumerate(EXPECTED_EXPONENTS[case][block.dim()]):
                key = f"block_{j}.shampoo.{{}}.{dim}"
                if exponent is None:
                    assert key.format("factor_matrices") not in state[index], (index, j, dim)
                    continue
                n = block.shape[dim]
                # Factors and roots packed by default, as the reference: the row-major upper
                # triangle (the roots are exactly symmetric, so nothing is lost).
                factor = _symmetric_from_packed(state[index][key.format("factor_matrices")], n)
                expected = reference_root(factor.numpy(), h["epsilon"], exponent)
                root = _symmetric_from_packed(
                    state[index][key.format("inv_factor_matrices")], n
                ).numpy()
                np.testing.assert_allclose(
                    root, expected, rtol=1e-8, atol=1e-10, err_msg=f"{index} {j} {dim}"
                )
                checked += 1
            assert f"block_{j}.shampoo.factor_matrices.{block.dim()}" not in state[index]
    assert checked == {"default": 18, "exponent_override": 12}[case]


def test_kronecker_form_of_the_matrix_preconditioner() -> None:
    """vec(X_L G X_R) == (X_L kron X_R^T) vec(G) for one 2-D block, built densely."""
    gen = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.randn(5, 4, generator=gen, dtype=torch.float64))
    opt = DistributedShampoo(
        [w],
        lr=1.0,
        betas=(0.0, 1.0),
        epsilon=1e-3,
        max_preconditioner_dim=5,
        preconditioner_config=RootInvShampooPreconditionerConfig(factor_matrix_dtype=torch.float64),
    )
    history = []
    for _ in range(3):
        g = torch.randn(5, 4, generator=gen, dtype=torch.float64)
        history.append(g)
        w.grad = g.clone()
        before = w.detach().clone()
        opt.step()
    block = opt.state[w]["block_0"]["shampoo"]
    x_l, x_r = block.inv_factor_matrices[0], block.inv_factor_matrices[1]
    left = sum(g @ g.T for g in history)
    right = sum(g.T @ g for g in history)
    torch.testing.assert_close(
        x_l, torch.from_numpy(reference_root(left.numpy(), 1e-3, 0.25)), rtol=1e-10, atol=1e-12
    )
    torch.testing.assert_close(
        x_r, torch.from_numpy(reference_root(right.numpy(), 1e-3, 0.25)), rtol=1e-10, atol=1e-12
    )
    direction = before - w.detach()  # lr = 1, no filtering, no grafting: P = X_L G X_R
    dense = torch.kron(x_l, x_r.T.contiguous()) @ history[-1].reshape(-1)
    torch.testing.assert_close(direction.reshape(-1), dense, rtol=1e-10, atol=1e-12)


def test_coupled_newton_roots_match_eigendecomposition() -> None:
    results = []
    for solver in (EigenConfig(), CoupledNewtonConfig(max_iterations=200, tolerance=1e-12)):
        params = _make_params(1)
        opt = _optimizer(
            params,
            {**DEFAULTS, "grafting_config": AdamPreconditionerConfig()},
            shampoo=dict(amortized_computation_config=solver),
        )
        _run(opt, params, _grad_sequence(1, 4))
        results.append([p.detach().clone() for p in params])
    for eig, newton in zip(*results):
        torch.testing.assert_close(newton, eig, rtol=1e-7, atol=1e-9)


def test_bucketed_float32_step_matches_float64_reference_loosely() -> None:
    """Default dtypes (float32 params and factors) track the float64 optimizer."""
    params64 = _make_params(2)
    params32 = [torch.nn.Parameter(p.detach().float()) for p in params64]
    grads = _grad_sequence(2, 5)
    h = {**DEFAULTS, "grafting_config": AdamPreconditionerConfig()}
    _run(_optimizer(params64, h), params64, grads)
    opt32 = DistributedShampoo(
        params32, max_preconditioner_dim=MAX_DIM, **{k: v for k, v in h.items() if k != "override"}
    )
    _run(opt32, params32, [[g.float() for g in gs] for gs in grads])
    for p32, p64 in zip(params32, params64):
        torch.testing.assert_close(p32.detach().double(), p64.detach(), rtol=1e-4, atol=1e-5)


def test_parameter_without_gradient_is_left_untouched() -> None:
    params = _make_params(4)
    opt = _optimizer(
        params, {**DEFAULTS, "grafting_config": AdamPreconditionerConfig(), "momentum": 0.5}
    )
    grads = _grad_sequence(4, 3)
    _run(opt, params, grads[:2])
    frozen = params[2].detach().clone()
    frozen_state = {k: v.clone() for k, v in flat_state(opt.state_dict())[2].items()}
    for p, g in zip(params, grads[2]):
        p.grad = g.clone()
    params[2].grad = None
    other = params[0].detach().clone()
    opt.step()
    assert torch.equal(params[2].detach(), frozen)
    for key, value in flat_state(opt.state_dict())[2].items():
        # The step is the group's (one tensor aliased under every parameter): it moves on.
        assert torch.equal(value, frozen_state[key] + (key == "step")), key
    assert not torch.equal(params[0].detach(), other)


@pytest.mark.parametrize("averaging", [False, True])
def test_a_group_without_any_gradient_counts_the_step_and_moves_nothing(averaging: bool) -> None:
    """As in the reference library, a group whose gradients are all None still counts the step:
    its bias corrections and root schedule go by that count. Nothing else of it moves (state but
    the step, parameters). Checked against the dense reference stepped only at the steps with
    gradients, with the step count running on; the other group steps throughout."""
    h = {**DEFAULTS, **CASES["beta2_ema"], "precondition_frequency": 2}
    params = _make_params(5)
    grads = _grad_sequence(5, 6)
    idle = {2, 3}  # the steps at which the second group (params[4:]) has no gradient
    expected = [p.detach().clone() for p in params]
    ref_blocks = _reference_block_lists(params, h)
    for t, step_grads in enumerate(grads, start=1):
        for index, g in enumerate(step_grads):
            if index >= 4 and t in idle:
                continue
            w_blocks = reference_blocks(expected[index], MAX_DIM)
            for block, wb, gb in zip(ref_blocks[index], w_blocks, reference_blocks(g, MAX_DIM)):
                wb.copy_(torch.from_numpy(block.step(t, gb.numpy(), wb.numpy().copy())))

    groups = [{"params": params[:4]}, {"params": params[4:]}]
    if averaging:
        # Schedule-Free with a constant lr and r = 0: mu_x = 1 - 1/t, so its sum of lr^r is the
        # step count; the group keeps it running while idle. Only the step count is compared.
        groups[1]["iterate_averaging_config"] = ScheduleFreeConfig(eval_coeff_lr_power=0.0)
    opt = _optimizer(groups, h)  # type: ignore[arg-type]
    for t, step_grads in enumerate(grads, start=1):
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        if t in idle:
            for p in params[4:]:
                p.grad = None
            before = flat_state(opt.state_dict())
            idle_params = [p.detach().clone() for p in params[4:]]
        opt.step()
        if t in idle:
            after = flat_state(opt.state_dict())
            for index in range(4, len(params)):
                for key, value in after[index].items():
                    moved = 1.0 if key in ("step", "lr_sum") else 0.0
                    assert torch.equal(value, before[index][key] + moved), (index, key)
            assert all(torch.equal(p.detach(), q) for p, q in zip(params[4:], idle_params))
    assert group_step(opt, 0) == group_step(opt, 1) == len(grads)
    if not averaging:
        for p, e in zip(params, expected):
            relative = torch.linalg.vector_norm(p.detach() - e) / torch.linalg.vector_norm(e)
            assert relative.item() < 1e-9, tuple(p.shape)


def test_a_first_step_without_any_gradient_still_starts_the_averaged_iterate() -> None:
    """Primal averaging's z is the parameters at the first step, counted or idle: after an idle
    first step (the reference takes z at construction) it holds them, and the next step
    averages towards them."""
    params = _make_params(6)[:1]  # (6, 5): one block
    opt = _optimizer(params, DEFAULTS, iterate_averaging_config=ScheduleFreeConfig())
    start = params[0].detach().clone()
    opt.step()
    assert group_step(opt) == 1
    assert torch.equal(params[0].detach(), start)
    assert torch.equal(flat_state(opt.state_dict())[0]["block_0.weight_buffer"], start)


def test_per_group_overrides() -> None:
    """Each group steps with its own lr and blocking, checked against the dense reference."""
    gen = torch.Generator().manual_seed(6)
    a = torch.nn.Parameter(torch.randn(3, 3, generator=gen, dtype=torch.float64))
    b = torch.nn.Parameter(torch.randn(10, generator=gen, dtype=torch.float64))
    config = RootInvShampooPreconditionerConfig(factor_matrix_dtype=torch.float64)
    opt = DistributedShampoo(
        [{"params": [a]}, {"params": [b], "lr": 0.5, "max_preconditioner_dim": math.inf}],
        lr=0.1,
        betas=(0.9, 1.0),
        epsilon=1e-3,
        max_preconditioner_dim=4,
        preconditioner_config=config,
    )
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[1]["lr"] == 0.5
    assert opt.param_groups[1]["max_preconditioner_dim"] == math.inf
    h = {**DEFAULTS, "betas": (0.9, 1.0), "epsilon": 1e-3}
    # Group 0: one (3, 3) block (3 * 3 > 4 does not merge). Group 1: one (10,) block under its
    # max dim inf (the default 4 would cut it into 4, 4, 2).
    references = [
        (a, [ReferenceBlock((3, 3), {**h, "lr": 0.1})]),
        (b, [ReferenceBlock((10,), {**h, "lr": 0.5})]),
    ]
    expected = [a.detach().clone(), b.detach().clone()]
    for t in range(1, 4):
        grads = [
            torch.randn(3, 3, generator=gen, dtype=torch.float64),
            torch.randn(10, generator=gen, dtype=torch.float64),
        ]
        for (param, blocks), g, e in zip(references, grads, expected):
            param.grad = g.clone()
            e.copy_(torch.from_numpy(blocks[0].step(t, g.numpy(), e.numpy().copy())))
        opt.step()
    for param, e in zip((a, b), expected):
        torch.testing.assert_close(param.detach(), e, rtol=1e-10, atol=1e-12)
    assert group_step(opt, 1) == 3
    assert "block_1" not in opt.state[b]


def test_nonfinite_gradient_raises_naming_the_parameter_and_changes_nothing() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = DistributedShampoo(
        model.named_parameters(), lr=0.1, grafting_config=AdamPreconditionerConfig()
    )
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {
        i: {k: v.clone() for k, v in s.items()} for i, s in flat_state(opt.state_dict()).items()
    }
    model.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    model[1].weight.grad[0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"'1\.weight'"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    for i, s in flat_state(opt.state_dict()).items():
        for k, v in s.items():
            assert torch.equal(v, state_before[i][k]), k
    assert group_step(opt, 0) == 1


def test_nonfinite_gradient_skip_policy_skips_the_step() -> None:
    w = torch.nn.Parameter(torch.ones(3, 3))
    opt = DistributedShampoo([w], lr=0.1, nonfinite_grad_policy="skip")
    w.grad = torch.full((3, 3), float("inf"))
    opt.step()
    assert torch.equal(w.detach(), torch.ones(3, 3))
    assert group_step(opt, 0) == 0


def test_finite_gradients_whose_float32_sum_overflows_still_step() -> None:
    """The finiteness check sums a CPU float32 bucket in float32 first: entries near float32's
    max overflow that sum, and the float64 sum then tells them from a NaN or Inf entry."""
    big = torch.finfo(torch.float32).max / 2
    w = torch.nn.Parameter(torch.ones(3, 3))
    opt = DistributedShampoo([w], lr=0.1, nonfinite_grad_policy="skip")
    w.grad = torch.full((3, 3), big)
    assert not torch.isfinite(w.grad.sum())
    opt.step()
    assert group_step(opt, 0) == 1
    w.grad = torch.full((3, 3), big)
    w.grad[1, 2] = float("inf")
    with pytest.raises(NonFiniteGradientError, match="non-finite gradient"):
        DistributedShampoo([w], lr=0.1).step()


def test_hyperparameters_changed_between_steps_match_the_reference() -> None:
    """lr, betas, epsilon, momentum, weight decay and the schedule changed between steps (momentum
    and the filtered gradient start from zero) match the reference run with the same schedule.
    The group's -1 sentinels were resolved when it was added (beta3 0.0, start 1), so the later
    phases set beta3 and start_preconditioning_step themselves."""
    phases = [
        (range(1, 4), dict(betas=(0.0, 1.0))),
        (
            range(4, 7),
            dict(
                betas=(0.9, 0.95), beta3=0.9, momentum=0.5, weight_decay=0.1, lr=0.02, epsilon=1e-2
            ),
        ),
        (
            range(7, 11),
            dict(
                betas=(0.8, 0.95),
                beta3=0.5,
                weight_decay_type=WeightDecayType.L2,
                precondition_frequency=2,
                start_preconditioning_step=2,
                lr=0.03,
                use_nesterov=True,
            ),
        ),
    ]
    h = {**DEFAULTS, "grafting_config": AdamPreconditionerConfig(beta2=0.99, epsilon=1e-8)}
    params = _make_params(7)
    grads = _grad_sequence(7, STEPS)
    expected = [p.detach().clone() for p in params]
    ref_blocks = _reference_block_lists(params, h)
    opt = _optimizer(params, h)
    for steps, changes in phases:
        h.update(changes)  # the reference blocks read h at every step
        opt.param_groups[0].update(changes)
        for t in steps:
            for index, g in enumerate(grads[t - 1]):
                w_blocks = reference_blocks(expected[index], MAX_DIM)
                for block, wb, gb in zip(ref_blocks[index], w_blocks, reference_blocks(g, MAX_DIM)):
                    wb.copy_(torch.from_numpy(block.step(t, gb.numpy(), wb.numpy().copy())))
            _run(opt, params, [grads[t - 1]])
    for p, e in zip(params, expected):
        relative = (torch.linalg.vector_norm(p.detach() - e) / torch.linalg.vector_norm(e)).item()
        assert relative < 1e-9, (tuple(p.shape), relative)
    keys = flat_state(opt.state_dict())[0]
    assert "block_0.momentum_buffer" in keys and "block_0.filtered_grad" in keys
