"""``block_health``: the views of the optimizer's state against float64 references written from
the equations (the factors from the gradients fed, ``U V^T`` from an SVD)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DistributedShampoo,
    EigenvalueCorrectedShampooPreconditionerConfig,
    SpectralDescentPreconditionerConfig,
    SVDOrthogonalizationConfig,
)
from nanoshampoo.optim.shampoo.health import block_health

BETA2 = 0.95


def gradients(steps: int, shape: tuple[int, int]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(*shape, generator=generator) for _ in range(steps)]


def reference_factors(grads: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """``F = sum_i (1 - b2) b2^(t - i) G_i G_i^T / (1 - b2^t)`` (left) and the right one."""
    t = len(grads)
    left = sum(
        (1 - BETA2) * BETA2 ** (t - i) * (g.double().numpy() @ g.double().numpy().T)
        for i, g in enumerate(grads, start=1)
    )
    right = sum(
        (1 - BETA2) * BETA2 ** (t - i) * (g.double().numpy().T @ g.double().numpy())
        for i, g in enumerate(grads, start=1)
    )
    correction = 1 - BETA2**t
    return left / correction, right / correction


def step_through(
    opt: torch.optim.Optimizer, w: torch.nn.Parameter, grads: list[torch.Tensor]
) -> None:
    for g in grads:
        w.grad = g.clone()
        opt.step()


def test_shampoo_spectra_and_graft_ratio_match_float64() -> None:
    w = torch.nn.Parameter(torch.zeros(6, 6))
    opt = DistributedShampoo(
        [w],
        lr=0.01,
        betas=(0.9, BETA2),
        epsilon=1e-12,
        max_preconditioner_dim=8,
        precondition_frequency=1,
        start_preconditioning_step=1,
        grafting_config=AdamPreconditionerConfig(beta2=BETA2, epsilon=1e-10),
    )
    grads = gradients(1, (6, 6))
    step_through(opt, w, grads)
    (view,) = block_health(opt)
    left, right = reference_factors(grads)
    for factor, reference in zip(view.factors, (left, right)):
        np.testing.assert_allclose(
            factor.eigenvalues.numpy(), np.linalg.eigvalsh(reference), rtol=1e-5
        )
        assert factor.failures == 0 and factor.off_diagonal is None
    # Step 1: the filtered gradient is G; with full-rank factors L^(-1/4) G R^(-1/4) = U V^T,
    # whose norm is sqrt(6); Adam's step-1 direction is G / (|G| + eps), norm ~ sqrt(36).
    g = grads[0].double().numpy()
    u, _, vt = np.linalg.svd(g)
    adam = g / (np.abs(g) + 1e-10)
    expected = np.linalg.norm(u @ vt) / np.linalg.norm(adam)
    assert view.graft_ratio == pytest.approx(expected, rel=1e-4)
    assert view.epsilon == 1e-12 and view.step == 1 and view.block == "block_0"


def test_soap_off_diagonal_is_that_of_the_basis_in_force() -> None:
    w = torch.nn.Parameter(torch.zeros(5, 7))
    opt = DistributedShampoo(
        [w],
        lr=0.01,
        betas=(0.9, BETA2),
        epsilon=1e-8,
        max_preconditioner_dim=8,
        precondition_frequency=3,
        preconditioner_config=EigenvalueCorrectedShampooPreconditionerConfig(),
    )
    grads = gradients(4, (5, 7))  # the basis of step 3, one step of statistics later
    step_through(opt, w, grads)
    (view,) = block_health(opt)
    state = opt.state[w]["block_0"]["shampoo"]
    for dim, (factor, reference) in enumerate(zip(view.factors, reference_factors(grads))):
        q = state.factor_matrices_eigenvectors[dim].double().numpy()
        rotated = q.T @ reference @ q
        off = rotated - np.diag(np.diag(rotated))
        expected = np.linalg.norm(off) / np.linalg.norm(rotated)
        assert factor.off_diagonal == pytest.approx(expected, rel=1e-4)
        assert 0.0 < factor.off_diagonal < 1.0
        np.testing.assert_allclose(
            factor.eigenvalues.numpy(), np.linalg.eigvalsh(reference), rtol=1e-5, atol=1e-7
        )


def test_spectral_descent_direction_is_u_vt_of_the_filtered_gradient() -> None:
    w = torch.nn.Parameter(torch.zeros(4, 9))
    opt = DistributedShampoo(
        [w],
        lr=0.01,
        betas=(0.95, 1.0),
        beta3=0.95**2,
        max_preconditioner_dim=64,
        precondition_frequency=1,
        use_bias_correction=False,
        preconditioner_config=SpectralDescentPreconditionerConfig(
            orthogonalization_config=SVDOrthogonalizationConfig(
                scale_by_dims_fn=lambda d_in, d_out: 3.0
            )
        ),
    )
    grads = gradients(1, (4, 9))
    step_through(opt, w, grads)
    (view,) = block_health(opt)
    u, _, vt = np.linalg.svd(grads[0].double().numpy(), full_matrices=False)
    assert view.direction is not None and view.factors == []
    np.testing.assert_allclose(view.direction.double().numpy(), u @ vt, atol=1e-5)


def test_no_view_before_the_first_step() -> None:
    w = torch.nn.Parameter(torch.zeros(4, 4))
    assert block_health(DistributedShampoo([w], lr=0.1)) == []
