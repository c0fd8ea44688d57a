"""``CoupledHigherOrderConfig``: the coupled iteration of order ``k`` against a float64 eigh root.

The equation: ``X = (A + delta I)^(-q/p)`` for ``1/e = p/q``, ``delta = max(rel l, abs) +
sqrt(n) eps_dtype l`` with ``l = ||A||_inf``; checked per matrix against float64 ``eigh``, in the
optimizer against the float64 Shampoo loop, and on rank-deficient float32 factors with no ridge
asked for (the float32 noise term alone keeps it converging).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch

from nanoshampoo.optim.shampoo import (
    CoupledHigherOrderConfig,
    DistributedShampoo,
    RootInvShampooPreconditionerConfig,
)
from nanoshampoo.optim.shampoo.config_checks import error_field
from nanoshampoo.optim.shampoo.preconditioner.matrix_roots import (
    coupled_higher_order_inverse_root,
    higher_order_coefficients,
)
from nanoshampoo.testing.shampoo_reference import run_reference

torch.set_num_threads(1)


def _eigh_root(a: np.ndarray, power: float) -> np.ndarray:
    lam, q = np.linalg.eigh(a)
    return (q * lam ** (-power)) @ q.T


def test_coefficients_are_the_taylor_series_of_the_inverse_root() -> None:
    """``(1 - x)^(-1/p) = sum_i b_i x^i``: compared at x = 0.1 to 12 terms."""
    for p in (1, 2, 4, 5):
        b = higher_order_coefficients(p, 12)
        assert b[:2] == [1.0, 1.0 / p]
        assert abs(sum(c * 0.1**i for i, c in enumerate(b)) - 0.9 ** (-1.0 / p)) < 1e-8


@pytest.mark.parametrize("order", [2, 3, 5])
@pytest.mark.parametrize("root", [Fraction(2), Fraction(4), Fraction(6), Fraction(5, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_the_float64_eigh_root_of_the_ridged_matrix(
    order: int, root: Fraction, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(order)
    g = torch.randn(4, 12, 30, generator=gen, dtype=torch.float64)
    a = g @ g.mT
    rel, absolute = 1e-6, 1e-4
    roots, ok = coupled_higher_order_inverse_root(
        a.to(dtype), root, rel, absolute, 100, 1e-10, order
    )
    assert ok.all()
    bound = torch.linalg.matrix_norm(a, ord=torch.inf)
    for index in range(a.shape[0]):
        l = bound[index].item()
        delta = max(rel * l, absolute) + math.sqrt(12) * torch.finfo(dtype).eps * l
        expected = _eigh_root(a[index].numpy() + delta * np.eye(12), float(1 / root))
        error = np.linalg.norm(roots[index].double().numpy() - expected) / np.linalg.norm(expected)
        assert error < (1e-5 if dtype == torch.float32 else 1e-10)


def test_rank_deficient_float32_without_a_ridge_converges() -> None:
    """Rank 2 of 16, no ridge asked for: the float32 noise ridge alone; within 1 % of float64."""
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(3, 16, 2, generator=gen)
    a = g @ g.mT
    roots, ok = coupled_higher_order_inverse_root(a, Fraction(4), 0.0, 0.0, 100, 1e-8, 3)
    assert ok.all() and torch.isfinite(roots).all()
    bound = torch.linalg.matrix_norm(a.double(), ord=torch.inf)
    for index in range(3):
        delta = 4.0 * torch.finfo(torch.float32).eps * bound[index].item()
        expected = _eigh_root(a[index].double().numpy() + delta * np.eye(16), 0.25)
        assert (
            np.linalg.norm(roots[index].double().numpy() - expected) / np.linalg.norm(expected)
            < 1e-2
        )


def test_a_non_finite_matrix_is_reported_failed() -> None:
    a = torch.eye(4).repeat(2, 1, 1)
    a[1, 0, 0] = torch.nan
    _, ok = coupled_higher_order_inverse_root(a, Fraction(2), 0.0, 1e-6, 50, 1e-8, 3)
    assert ok.tolist() == [True, False]


@pytest.mark.parametrize("shape", [(6, 5), (3, 4, 5)])
def test_optimizer_matches_the_float64_shampoo_loop(shape: tuple[int, ...]) -> None:
    """With ``abs_epsilon = eps`` the ridge is the loop's ``eps`` (the float64 noise term is
    1e-15 relative), and the group's epsilon is not used."""
    solver = CoupledHigherOrderConfig(rel_epsilon=0.0, abs_epsilon=1e-6, tolerance=1e-12, order=3)
    config = RootInvShampooPreconditionerConfig(
        amortized_computation_config=solver, factor_matrix_dtype=torch.float64
    )
    gen = torch.Generator().manual_seed(2)
    param = torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64))
    initial = param.detach().numpy().copy()
    grads = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(6)]
    opt = DistributedShampoo(
        [param],
        lr=0.05,
        betas=(0.9, 0.95),
        epsilon=1e-12,
        max_preconditioner_dim=8,
        precondition_frequency=2,
        preconditioner_config=config,
    )
    for g in grads:
        param.grad = g.clone()
        opt.step()
    expected = run_reference(
        initial,
        [g.numpy() for g in grads],
        lr=0.05,
        betas=(0.9, 0.95),
        epsilon=1e-6,
        frequency=2,
        start=2,
    )
    assert np.linalg.norm(param.detach().numpy() - expected) / np.linalg.norm(expected) < 1e-8


def test_optimizer_float32_rank_deficient_at_epsilon_1e_12_never_fails() -> None:
    solver = CoupledHigherOrderConfig(rel_epsilon=0.0, abs_epsilon=0.0)
    config = RootInvShampooPreconditionerConfig(
        amortized_computation_config=solver, num_tolerated_failed_amortized_computations=0
    )
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(6, 5), (7,), (2, 8)]]
    opt = DistributedShampoo(
        params, lr=0.01, epsilon=1e-12, max_preconditioner_dim=8, preconditioner_config=config
    )
    for _ in range(15):
        for p in params:
            g = torch.randn(p.shape, generator=gen)
            p.grad = (
                torch.outer(g.flatten()[:1], g.flatten()).reshape(p.shape)
                if p.dim() == 1
                else g[:1].expand_as(g).clone()
            )
        opt.step()
        assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(rel_epsilon=-1.0, abs_epsilon=0.0), "rel_epsilon"),
        (dict(rel_epsilon=0.0, abs_epsilon=math.inf), "abs_epsilon"),
        (dict(rel_epsilon=0.0, abs_epsilon=0.0, order=1), "order"),
        (dict(rel_epsilon=0.0, abs_epsilon=0.0, max_iterations=0), "max_iterations"),
        (dict(rel_epsilon=0.0, abs_epsilon=0.0, tolerance=-1e-3), "tolerance"),
        (dict(rel_epsilon=0.0, abs_epsilon=0.0, disable_tf32="yes"), "disable_tf32"),
    ],
)
def test_invalid_config_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as info:
        CoupledHigherOrderConfig(**kwargs)
    assert re.match(field, error_field(info.value)), str(info.value)
