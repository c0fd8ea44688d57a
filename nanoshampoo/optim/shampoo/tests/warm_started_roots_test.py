"""``WarmStartedEigenConfig``: inverse roots from eigenvectors warm-started at the previous ones.

Specification (``matrix_roots.warm_started_eigh_inverse_root``): the root is the ``eigh`` root's
spectral function applied to ``diag(Q^T A Q)`` in the basis ``Q``, accepted when the estimated
root error is at most ``tolerance`` (after up to ``max_iterations`` QR iterations), otherwise a
full ``eigh``; the first solve of a factor is always a full ``eigh``. References are float64
``eigh`` roots written from the equations.
"""

from __future__ import annotations

import io
from typing import Any

# The neighbouring test module (pytest puts its dir on sys.path).
import float32_recipe_test as recipe
import numpy as np
import pytest
import torch
from flat_shampoo_state import flat_state

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DistributedShampoo,
    EigenConfig,
    PseudoInverseConfig,
    RootInvShampooPreconditionerConfig,
    WarmStartedEigenConfig,
)
from nanoshampoo.optim.shampoo.preconditioner.matrix_roots import (
    DefaultPerturbationConfig,
    eigh_inverse_root,
    root_error_estimate,
    warm_started_eigh_inverse_root,
)

torch.set_num_threads(1)

EPSILON = 1e-12


def plain_root(a: np.ndarray, exponent: float, epsilon: float = EPSILON) -> np.ndarray:
    """``(A + eps I)^(-e)`` in float64 (spectrum shifted up to ``eps`` where rounding made it
    lower)."""
    mu, q = np.linalg.eigh(a)
    lam = mu - min(mu.min(), 0.0) + epsilon
    return (q * lam ** (-exponent)) @ q.T


def relative(got: torch.Tensor, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.double().numpy() - want) / np.linalg.norm(want))


def direction_error(got: torch.Tensor, want: np.ndarray, factor: np.ndarray) -> float:
    """``sqrt(E||(X - X*) g||^2 / E||X* g||^2)`` for ``g ~ N(0, F)``: the relative error of the
    search directions of gradients distributed like the factor (what the check estimates)."""
    delta = got.double().numpy() - want
    return float(np.sqrt(np.trace(delta @ factor @ delta) / np.trace(want @ factor @ want)))


def slowly_changing_factors(
    size: int, columns: int, steps: int, seed: int = 0
) -> list[torch.Tensor]:
    """Bias-corrected ``F_t = 0.95 F_(t-1) + 0.05 G G^T`` (float64), ``G`` Gaussian plus a
    rank-4 drift, so the spectrum has a few large and a bulk of small eigenvalues."""
    gen = torch.Generator().manual_seed(seed)
    drift = torch.randn(size, 4, generator=gen, dtype=torch.float64)
    factor = torch.zeros(size, size, dtype=torch.float64)
    factors = []
    for t in range(1, steps + 1):
        g = 0.3 * torch.randn(size, columns, generator=gen, dtype=torch.float64)
        g += drift @ torch.randn(4, columns, generator=gen, dtype=torch.float64)
        factor = 0.95 * factor + 0.05 * g @ g.T
        factors.append(factor / (1 - 0.95**t))
    return factors


@pytest.mark.parametrize("lag", [1, 3, 10])
def test_error_estimate_matches_the_actual_root_error_in_float64(lag: int) -> None:
    """The check's justification: from the eigenvectors of ``lag`` steps ago (the warm start of
    a root every ``lag`` steps), the estimate is within 15 % of the actual relative error of
    the root against the exact float64 one (it is first order: the rotation of the bulk is
    small, the large eigenvectors barely move)."""
    size, exponent = 40, 0.25
    factors = slowly_changing_factors(size, 80, 20)
    a = factors[-1]
    exact = plain_root(a.numpy(), 0.25, 0.0)
    basis = torch.linalg.eigh(factors[-1 - lag])[1].flip(-1)
    exponents = torch.tensor([exponent], dtype=torch.float64)
    roots, _, _, fell_back = warm_started_eigh_inverse_root(
        a[None],
        exponents,
        0.0,
        basis[None],
        torch.tensor([True]),
        max_iterations=0,
        tolerance=float("inf"),
    )
    assert not fell_back.any()
    actual = direction_error(roots[0], exact, a.numpy())
    projected = basis.T @ a @ basis
    order = projected.diagonal().argsort(descending=True)
    projected = projected[order][:, order]
    estimate = float(
        root_error_estimate(projected[None], projected.diagonal().pow(-exponent)[None], exponents)
    )
    assert 0.85 * actual <= estimate <= 1.15 * actual, (estimate, actual)
    assert actual > 1e-3  # the stale basis did make a measurable error


def test_error_estimate_ignores_mixing_inside_the_floored_null_space() -> None:
    """Two directions floored to the same weight: any basis of their span gives the same root."""
    projected = torch.tensor(
        [[[4.0, 0.0, 0.0], [0.0, 1e-20, 1e-20], [0.0, 1e-20, 2e-20]]], dtype=torch.float64
    )
    weights = torch.tensor([[0.5, 1e3, 1e3]], dtype=torch.float64)
    assert (
        float(root_error_estimate(projected, weights, torch.tensor([0.5], dtype=torch.float64)))
        == 0.0
    )


@pytest.mark.parametrize("exponent", [0.25, 0.5])
def test_slowly_changing_float32_factors_stay_within_the_tolerance(exponent: float) -> None:
    """b = 0.95, a root every step from last step's eigenvectors (no QR iteration allowed):
    each accepted root is within 1.25 x tolerance of the float64 eigh root (the estimate is first
    order), each fallback is a float32 eigh root. An accepted basis is not refreshed, so the
    error drifts up to the tolerance and falls back (measured: 25 of 29 warm solves accepted
    at e = 1/4, 16 at e = 1/2; the first steps move the bias-corrected factor by ~1/t)."""
    size, tolerance = 48, 0.05
    factors = slowly_changing_factors(size, 96, 30)
    bases = torch.eye(size).expand(1, size, size)
    warm = torch.tensor([False])
    exponents = torch.tensor([exponent])
    accepted = 0
    for t, factor in enumerate(factors, start=1):
        roots, bases, ok, fell_back = warm_started_eigh_inverse_root(
            factor.float()[None], exponents, EPSILON, bases, warm, 0, tolerance
        )
        assert bool(ok.all())
        error = direction_error(roots[0], plain_root(factor.numpy(), exponent), factor.numpy())
        if warm.item() and not fell_back.item():
            accepted += 1
            assert error <= 1.25 * tolerance, (t, error)
        else:
            assert error < 1e-3, (t, error)  # a full float32 eigh
        warm = torch.tensor([True])
    assert accepted >= 14, accepted


def test_qr_iterations_lower_the_error_before_falling_back() -> None:
    """A tolerance just below the error of the stale basis: no iteration falls back, a few QR
    iterations reach it without the eigh."""
    factors = slowly_changing_factors(32, 64, 12)
    old = torch.linalg.eigh(factors[1])[1].flip(-1).float()[None]
    new, exponents, warm = factors[-1].float()[None], torch.tensor([0.25]), torch.tensor([True])
    want = plain_root(factors[-1].numpy(), 0.25)
    stale, _, _, _ = warm_started_eigh_inverse_root(new, exponents, EPSILON, old, warm, 0, 1.0)
    tolerance = 0.9 * direction_error(stale[0], want, factors[-1].numpy())
    _, _, _, fell_back = warm_started_eigh_inverse_root(
        new, exponents, EPSILON, old, warm, 0, tolerance
    )
    assert fell_back.item()
    roots, _, ok, fell_back = warm_started_eigh_inverse_root(
        new, exponents, EPSILON, old, warm, 8, tolerance
    )
    assert ok.item() and not fell_back.item()
    assert direction_error(roots[0], want, factors[-1].numpy()) <= 1.25 * tolerance


def test_an_abrupt_change_falls_back_to_eigh_and_equals_it() -> None:
    gen = torch.Generator().manual_seed(3)
    size = 24
    first, second = (torch.randn(size, 2 * size, generator=gen) for _ in range(2))
    previous = torch.linalg.eigh(first @ first.T)[1].flip(-1)[None]
    stack = (second @ second.T)[None]
    exponents = torch.tensor([0.25])
    roots, bases, ok, fell_back = warm_started_eigh_inverse_root(
        stack, exponents, EPSILON, previous, torch.tensor([True]), 1, 0.05
    )
    assert fell_back.item() and ok.item()
    want, _ = eigh_inverse_root(stack, exponents, EPSILON)
    torch.testing.assert_close(roots, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    evals = torch.diagonal(bases[0].T @ stack[0] @ bases[0])
    assert bool((evals[:-1] >= evals[1:]).all())  # stored descending


def test_first_solve_and_missing_basis_use_eigh() -> None:
    gen = torch.Generator().manual_seed(4)
    g = torch.randn(2, 10, 20, generator=gen)
    stack = g @ g.mT
    exponents = torch.tensor([0.25, 0.5])
    garbage = torch.full((2, 10, 10), torch.nan)
    roots, _, ok, fell_back = warm_started_eigh_inverse_root(
        stack, exponents, EPSILON, garbage, torch.tensor([False, False]), 1, 0.05
    )
    want, _ = eigh_inverse_root(stack, exponents, EPSILON)
    assert ok.all() and not fell_back.any()  # a first solve is not a fallback
    torch.testing.assert_close(roots, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


def _optimizer(
    params: list[torch.nn.Parameter], solver: Any, frequency: int = 1
) -> DistributedShampoo:
    return DistributedShampoo(
        params,
        lr=0.01,
        betas=(0.9, 0.95),
        epsilon=EPSILON,
        max_preconditioner_dim=64,
        precondition_frequency=frequency,
        start_preconditioning_step=frequency,
        grafting_config=AdamPreconditionerConfig(beta2=0.95, epsilon=1e-8),
        preconditioner_config=RootInvShampooPreconditionerConfig(
            amortized_computation_config=solver
        ),
    )


@pytest.mark.parametrize("case", sorted(recipe.CASES))
def test_rank_deficient_float32_factors_stay_within_the_issue_9_bound(case: str) -> None:
    """The float32 recipe cases (epsilon 1e-12, a root every step) against float64: with a
    tolerance below the bound the run stays within it; with the default tolerance it stays
    finite and within a few tolerances (each step's direction may err by up to one)."""
    want = recipe.reference(case, "shampoo")
    tight = recipe.run_float32(case, recipe.shampoo_config(WarmStartedEigenConfig(tolerance=1e-4)))
    assert recipe.relative_error(tight, want) < recipe.SHAMPOO_BOUND
    default = recipe.run_float32(case, recipe.shampoo_config(WarmStartedEigenConfig()))
    assert np.isfinite(default).all()
    assert recipe.relative_error(default, want) < 2 * WarmStartedEigenConfig().tolerance


def test_pseudo_inverse_warm_roots_stay_finite_on_rank_one_gradients() -> None:
    """Rank-1 factors in float32 with epsilon 0: the null space is dropped, roots stay finite,
    and the repeated gradient keeps the basis exact (no fallback)."""
    gen = torch.Generator().manual_seed(5)
    param = torch.nn.Parameter(torch.zeros(32, 16))
    rank_one = torch.outer(torch.randn(32, generator=gen), torch.randn(16, generator=gen))
    solver = WarmStartedEigenConfig(rank_deficient_stability_config=PseudoInverseConfig())
    opt = DistributedShampoo(
        [param],
        lr=0.01,
        betas=(0.0, 0.95),
        epsilon=0.0,
        max_preconditioner_dim=64,
        precondition_frequency=1,
        start_preconditioning_step=1,
        preconditioner_config=RootInvShampooPreconditionerConfig(
            amortized_computation_config=solver
        ),
    )
    for _ in range(5):
        param.grad = rank_one.clone()
        opt.step()
    assert torch.isfinite(param).all()
    warm, fell_back = opt._runtimes[0].preconditioner.warm_start_counts()
    assert (warm, fell_back) == (8, 0)


def test_pseudo_inverse_with_a_tight_tolerance_follows_the_eigh_run() -> None:
    """Wide blocks (rank-deficient factors) with epsilon 0: the warm-started pseudo-inverse run
    with a tight tolerance stays within the issue-9 bound of the eigh pseudo-inverse run."""

    def run(solver: Any) -> torch.Tensor:
        gen = torch.Generator().manual_seed(8)
        param = torch.nn.Parameter(torch.zeros(8, 64))
        opt = DistributedShampoo(
            [param],
            lr=1.0,
            betas=(0.0, 0.999),
            epsilon=0.0,
            max_preconditioner_dim=64,
            precondition_frequency=1,
            start_preconditioning_step=1,
            preconditioner_config=RootInvShampooPreconditionerConfig(
                amortized_computation_config=solver
            ),
        )
        for _ in range(6):
            param.grad = torch.randn(8, 64, generator=gen)
            opt.step()
        return param.detach().clone()

    stability = PseudoInverseConfig()
    want = run(EigenConfig(rank_deficient_stability_config=stability))
    got = run(WarmStartedEigenConfig(tolerance=1e-4, rank_deficient_stability_config=stability))
    assert torch.isfinite(got).all()
    assert float((got - want).norm() / want.norm()) < recipe.SHAMPOO_BOUND


def _train(
    solver: Any, steps: int, frequency: int = 1
) -> tuple[list[torch.nn.Parameter], DistributedShampoo]:
    gen = torch.Generator().manual_seed(6)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(40, 24), (24,), (3, 8, 5)]
    ]
    opt = _optimizer(params, solver, frequency)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


def test_training_with_a_zero_tolerance_equals_eigh() -> None:
    """Tolerance 0 accepts no warm root (every solve is an eigh): the run equals EigenConfig."""
    warm_params, opt = _train(WarmStartedEigenConfig(tolerance=0.0, max_iterations=0), 6)
    eigh_params, _ = _train(EigenConfig(), 6)
    for a, b in zip(warm_params, eigh_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    warm, fell_back = opt._runtimes[0].preconditioner.warm_start_counts()
    assert warm == fell_back > 0


def test_eigenvectors_are_state_and_survive_a_checkpoint() -> None:
    params, opt = _train(WarmStartedEigenConfig(), 4)
    state = opt.state_dict()
    keys = [k for entries in flat_state(state).values() for k in entries]
    assert any(k.endswith("factor_matrices_eigenvectors.0") for k in keys)
    # Every basis is computed, as the step implies: the flags are left out, as the reference
    # has none; a load fills them in from the step.
    assert not any("eigenvectors_computed" in k for k in keys)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = _optimizer(fresh_params, WarmStartedEigenConfig())
    fresh.load_state_dict(loaded)
    # The same next steps from the restored state give the same parameters.
    gen = torch.Generator().manual_seed(9)
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(2)]
    for run_params, run_opt in ((params, opt), (fresh_params, fresh)):
        for step_grads in grads:
            for p, g in zip(run_params, step_grads):
                p.grad = g.clone()
            run_opt.step()
    for a, b in zip(params, fresh_params):
        assert torch.equal(a, b)


@pytest.mark.parametrize("breakage", ["missing", "dtype"])
def test_load_state_dict_validates_the_eigenvectors(breakage: str) -> None:
    _, opt = _train(WarmStartedEigenConfig(), 2)
    state = opt.state_dict()
    eigenvectors = state["state"][0]["block_0"]["shampoo"]["factor_matrices_eigenvectors"]
    key = "block_0.shampoo.factor_matrices_eigenvectors.0"
    before = eigenvectors[0].clone()
    if breakage == "missing":
        del eigenvectors[0]
        with pytest.raises(
            KeyError,
            match=r"missing block state 0\.block_0\.shampoo\.factor_matrices_eigenvectors\.0",
        ):
            opt.load_state_dict(state)
    else:
        eigenvectors[0] = eigenvectors[0].double()
        with pytest.raises(
            ValueError, match=r"0\.block_0\.shampoo\.factor_matrices_eigenvectors\.0 must be"
        ):
            opt.load_state_dict(state)
    live = flat_state(opt.state_dict())[0][key]
    assert torch.equal(live, before)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_iterations=-1), "max_iterations"),
        (dict(max_iterations=True), "max_iterations"),
        (dict(tolerance=-0.1), "tolerance"),
        (dict(tolerance=float("nan")), "tolerance"),
        (dict(retry_double_precision=1), "retry_double_precision"),
        (dict(rank_deficient_stability_config=None), "rank_deficient_stability_config"),
    ],
)
def test_invalid_fields_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        WarmStartedEigenConfig(**kwargs)


def test_default_perturbation_is_the_eigh_default() -> None:
    assert WarmStartedEigenConfig().rank_deficient_stability_config == DefaultPerturbationConfig


def test_a_nonfinite_factor_keeps_its_root_and_eigenvectors() -> None:
    """A NaN factor fails its warm solve and its eigh fallback: the previous root and
    eigenvectors stay, the failure is counted, the other factors are solved."""
    params, opt = _train(WarmStartedEigenConfig(), 3)
    shampoo = opt.state[params[0]]["block_0"]["shampoo"]
    root = shampoo.inv_factor_matrices[0].clone()
    vectors = shampoo.factor_matrices_eigenvectors[0].clone()
    other_root = shampoo.inv_factor_matrices[1].clone()
    shampoo.factor_matrices[0].view(-1)[0] = float("nan")  # entry (0, 0), packed or not
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert torch.equal(shampoo.inv_factor_matrices[0], root)
    assert torch.equal(shampoo.factor_matrices_eigenvectors[0], vectors)
    assert int(shampoo.failure_counts[0]) == 1 and int(shampoo.failure_counts[1]) == 0
    assert not torch.equal(shampoo.inv_factor_matrices[1], other_root)
    assert all(torch.isfinite(p).all() for p in params)
