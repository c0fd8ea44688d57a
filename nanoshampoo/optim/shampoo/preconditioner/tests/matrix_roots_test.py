"""Inverse roots and eigenbases of rank-deficient factors: spectrum rules and configs."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch

from nanoshampoo.optim.shampoo import (
    CoupledNewtonConfig,
    EigenConfig,
    EighEigendecompositionConfig,
    PerturbationConfig,
    PseudoInverseConfig,
    QREigendecompositionConfig,
)
from nanoshampoo.optim.shampoo.config_checks import error_field
from nanoshampoo.optim.shampoo.preconditioner.eigenbasis import (
    canonical_null_space_basis,
    eigh_eigenbasis,
)
from nanoshampoo.optim.shampoo.preconditioner.matrix_roots import (
    all_finite,
    coupled_newton_inverse_root,
    eigh_inverse_root,
)

torch.set_num_threads(1)

PLAIN = PerturbationConfig(eigenvalue_floor_rtol=0.0)


def _rank_deficient_float32(n: int = 48, rank: int = 1, scale: float = 5000.0) -> torch.Tensor:
    """A float32 ``G G^T`` of the given rank, norm ``~scale``: its zero eigenvalues come out of
    ``eigh`` as rounding noise of size ``~1e-4``, far below ``-1e-12``."""
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(n, rank, generator=gen) * (scale / n) ** 0.5
    return (g @ g.T)[None]


@pytest.mark.parametrize("perturb_before", [True, False])
def test_plain_shift_is_finite_when_lambda_min_is_far_below_minus_epsilon(
    perturb_before: bool,
) -> None:
    factor = _rank_deficient_float32()
    assert float(torch.linalg.eigvalsh(factor).min()) < -1e-9  # the case that used to give inf
    stability = PerturbationConfig(
        perturb_before_computation=perturb_before, eigenvalue_floor_rtol=0.0
    )
    roots, ok = eigh_inverse_root(factor, torch.tensor([0.5]), 1e-12, stability=stability)
    assert bool(ok.all()) and bool(torch.isfinite(roots).all())


def _numpy_root(a: np.ndarray, exponent: float, rule: str, eps: float, tol: float) -> np.ndarray:
    """Float64 reference of the documented spectrum rules."""
    mu, q = np.linalg.eigh(a)
    if rule == "pinv":
        kept = mu > tol  # the dropped eigenvalues may be exactly 0: never raise them to -e
        w = np.zeros_like(mu)
        w[kept] = np.abs(mu[kept] + eps) ** (-exponent)
    else:  # floor: max(mu - min(mu_min, 0), tol) + eps
        w = (np.maximum(mu - min(mu.min(), 0.0), tol) + eps) ** (-exponent)
    return (q * w) @ q.T


@pytest.mark.parametrize("rule", ["floor", "pinv"])
def test_spectrum_rules_match_the_float64_formula(rule: str) -> None:
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(2, 6, 3, generator=gen, dtype=torch.float64)
    factors = g @ g.mT  # rank 3 of 6
    rtol = 1e-6
    stability = (
        PseudoInverseConfig(rank_rtol=rtol)
        if rule == "pinv"
        else PerturbationConfig(perturb_before_computation=False, eigenvalue_floor_rtol=rtol)
    )
    eps = 0.0 if rule == "pinv" else 1e-12
    roots, ok = eigh_inverse_root(
        factors, torch.tensor([0.25, 0.5], dtype=torch.float64), eps, stability=stability
    )
    assert bool(ok.all())
    for index, exponent in enumerate((0.25, 0.5)):
        a = factors[index].numpy()
        expected = _numpy_root(a, exponent, rule, eps, rtol * np.linalg.eigvalsh(a).max())
        np.testing.assert_allclose(
            roots[index].numpy(), expected, rtol=1e-7, atol=1e-7 * np.abs(expected).max()
        )


def test_pseudo_inverse_drops_the_null_space() -> None:
    factor = _rank_deficient_float32(n=8, rank=2, scale=4.0)
    roots, ok = eigh_inverse_root(factor, torch.tensor([0.5]), 0.0, stability=PseudoInverseConfig())
    evals, evecs = torch.linalg.eigh(factor[0].double())
    null = evecs[:, :6].float()  # the 6 numerically-zero directions
    assert bool(ok.all())
    assert float((roots[0] @ null).abs().max()) < 1e-6 * float(roots.abs().max())


def test_coupled_newton_converges_on_a_rank_one_float32_factor() -> None:
    factor = _rank_deficient_float32()
    roots, ok = coupled_newton_inverse_root(factor, 2, 1e-12, 100, 1e-6)
    assert bool(ok.all())
    # On the range (the gradient direction) the root is lambda^(-1/2).
    v = torch.linalg.eigh(factor[0].double())[1][:, -1]
    lam = float(v @ factor[0].double() @ v)
    assert abs(float(v @ roots[0].double() @ v) * lam**0.5 - 1.0) < 1e-3


def test_canonical_null_space_basis_depends_only_on_the_span() -> None:
    gen = torch.Generator().manual_seed(1)
    basis = torch.linalg.qr(torch.randn(6, 6, generator=gen, dtype=torch.float64)).Q
    null = torch.tensor([False, False, True, True, True, False])
    # Another basis of the same null span: rotate the null columns among themselves.
    mix = torch.linalg.qr(torch.randn(3, 3, generator=gen, dtype=torch.float64)).Q
    other = basis.clone()
    other[:, null] = basis[:, null] @ mix
    first, ok_first = canonical_null_space_basis(basis[None], null[None])
    second, ok_second = canonical_null_space_basis(other[None], null[None])
    assert bool(ok_first.all() and ok_second.all())
    # Same columns up to sign; the non-null columns stay where they were (up to sign).
    torch.testing.assert_close(first.abs(), second.abs())
    torch.testing.assert_close(first[0][:, ~null].abs(), basis[:, ~null].abs())
    torch.testing.assert_close(first[0].mT @ first[0], torch.eye(6, dtype=torch.float64))
    # The null columns still span the null space.
    projector = basis[:, null] @ basis[:, null].T
    torch.testing.assert_close(projector @ first[0][:, null], first[0][:, null])


def test_eigh_eigenbasis_of_float32_and_float64_factors_agree_on_the_null_space() -> None:
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(16, 3, generator=gen, dtype=torch.float64)
    factor = g @ g.T
    stability = PerturbationConfig()
    bases64, _ = eigh_eigenbasis(factor[None], stability=stability)
    bases32, _ = eigh_eigenbasis(factor.float()[None], stability=stability)
    # Column by column (up to sign), not only the span: what SOAP needs.
    cosines = (bases64[0].mT @ bases32[0].double()).diagonal().abs()
    assert float(cosines.min()) > 1 - 1e-3


@pytest.mark.parametrize(
    ("factory", "field"),
    [
        (
            lambda: EigenConfig(rank_deficient_stability_config="perturb"),
            "rank_deficient_stability_config",
        ),
        (
            lambda: EighEigendecompositionConfig(rank_deficient_stability_config=None),
            "rank_deficient_stability_config",
        ),
        (
            lambda: QREigendecompositionConfig(rank_deficient_stability_config=1),
            "rank_deficient_stability_config",
        ),
        (lambda: PerturbationConfig(perturb_before_computation=1), "perturb_before_computation"),
        (lambda: PerturbationConfig(eigenvalue_floor_rtol=-1.0), "eigenvalue_floor_rtol"),
        (lambda: PseudoInverseConfig(rank_atol=float("inf")), "rank_atol"),
        (lambda: PseudoInverseConfig(rank_rtol=float("nan")), "rank_rtol"),
    ],
)
def test_invalid_stability_configs_name_the_field(factory: Any, field: str) -> None:
    with pytest.raises(ValueError) as info:
        factory()
    assert re.match(field, error_field(info.value)), str(info.value)


def test_coupled_newton_has_no_pseudo_inverse_field() -> None:
    assert not hasattr(CoupledNewtonConfig(), "rank_deficient_stability_config")


def test_all_finite_flags_each_matrix_with_a_nan_or_an_inf() -> None:
    stack = torch.ones(5, 3, 4)
    stack[1, 2, 0] = float("nan")
    stack[2, 0, 3] = float("inf")
    stack[3, 1, 1] = float("-inf")
    stack[4, 0, 0], stack[4, 0, 1] = float("inf"), float("-inf")  # inf - inf: NaN, still caught
    assert all_finite(stack).tolist() == [True, False, False, False, False]
    big = torch.full((1, 2, 2), torch.finfo(torch.float32).max)
    assert all_finite(big).tolist() == [False]  # the sum overflows: counted as a failure


@pytest.mark.parametrize("size", [40, 600])
def test_eigh_inverse_root_into_the_stored_roots_gives_the_same_bits(size: int) -> None:
    """``out``: when every root is sure to succeed (``Q`` and ``w`` finite, ``max |w|`` below
    half float max), the roots are written into ``out`` and it is returned, the same bits as a
    new stack (untiled 40, tiled 600); otherwise ``out`` keeps what it held and the roots come
    back in a new stack, with the same ``ok`` as without ``out``."""
    gen = torch.Generator().manual_seed(size)
    g = torch.randn(3, size, size // 2, generator=gen)
    stack = g @ g.mT / size
    stack = (stack + stack.mT) / 2
    exponents = torch.full((3,), 0.25)
    expected, ok = eigh_inverse_root(stack, exponents, 1e-3)
    assert ok.all()
    out = torch.full_like(stack, 7.0)
    roots, ok_out = eigh_inverse_root(stack, exponents, 1e-3, out=out)
    assert roots is out and torch.equal(out, expected) and torch.equal(ok_out, ok)
    # A NaN matrix fails: nothing is written over the stored roots.
    broken = stack.clone()
    broken[1, 0, 0] = float("nan")
    without, ok_without = eigh_inverse_root(broken, exponents, 1e-3)
    out = torch.full_like(stack, 7.0)
    roots, ok_out = eigh_inverse_root(broken, exponents, 1e-3, out=out)
    assert roots is not out and bool((out == 7.0).all())
    assert torch.equal(ok_out, ok_without) and ok_out.tolist() == [True, False, True]
    assert torch.equal(roots[ok_out], without[ok_out])
    # A weight near float max (exponent 40 of eigenvalues near 0.1): not sure, so not in place.
    huge = torch.full((3,), 40.0)
    reference, ok_huge = eigh_inverse_root(stack / stack.amax() * 0.1, huge, 0.0)
    out = torch.full_like(stack, 7.0)
    roots, ok_out = eigh_inverse_root(stack / stack.amax() * 0.1, huge, 0.0, out=out)
    assert roots is not out and bool((out == 7.0).all()) and torch.equal(ok_out, ok_huge)


def test_eigh_inverse_root_overwriting_its_input_gives_the_same_roots() -> None:
    """``overwrite_input`` adds the ridge to the caller's diagonal in place: the same bits as the
    copy ``A + eps I``, whichever layout the (exactly symmetric) stack has."""
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(3, 40, 20, generator=gen)
    stack = g @ g.mT / 20
    stack = (stack + stack.mT) / 2
    exponents = torch.full((3,), 0.25)
    expected, ok = eigh_inverse_root(stack, exponents, 1e-3)
    for given in (stack.clone(), stack.clone().mT):
        roots, ok_inplace = eigh_inverse_root(given, exponents, 1e-3, overwrite_input=True)
        assert torch.equal(roots, expected) and torch.equal(ok_inplace, ok)
        assert torch.equal(given, stack + 1e-3 * torch.eye(40))
    # The ridge (1e-3) lies far above the noise floor: the roots are (A + eps I)^(-1/4), to the
    # float32 rounding of the null-space eigenvalues (near eps, weighted eps^(-1/4) ~ 5.6).
    evals, evecs = torch.linalg.eigh(stack.double() + 1e-3 * torch.eye(40, dtype=torch.float64))
    root64 = (evecs * evals.pow(-0.25).unsqueeze(-2)) @ evecs.mT
    error = (expected.double() - root64).abs().amax() / root64.abs().amax()
    assert error.item() < 5e-4
