"""Spectral descent (Muon) against float64 SVD references; configs; state round trip."""

from __future__ import annotations

import io
import re
from typing import Any

import numpy as np
import pytest
import torch

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DistributedShampoo,
    NewtonSchulzOrthogonalizationConfig,
    SpectralDescentPreconditionerConfig,
    SVDOrthogonalizationConfig,
)
from nanoshampoo.optim.shampoo.config_checks import error_field
from nanoshampoo.optim.shampoo.preconditioner.spectral_descent_preconditioner import (
    newton_schulz_orthogonalize,
)

torch.set_num_threads(1)

MAX_DIM = 8
MUON = (3.4445, -4.7750, 2.0315)


def muon_scale(d_in: int, d_out: int) -> float:
    return max(1.0, d_out / d_in) ** 0.5


def numpy_polar(g: np.ndarray) -> np.ndarray:
    u, _, vt = np.linalg.svd(g, full_matrices=False)
    return u @ vt


def _one_step_direction(
    params: list[torch.nn.Parameter],
    config: SpectralDescentPreconditionerConfig,
    grads: list[torch.Tensor],
) -> list[torch.Tensor]:
    """``-(W_1 - W_0)`` of one step with lr 1, no filtering, no grafting: the direction ``P``."""
    opt = DistributedShampoo(
        params,
        lr=1.0,
        betas=(0.0, 1.0),
        max_preconditioner_dim=MAX_DIM,
        preconditioner_config=config,
    )
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    return [b - p.detach() for b, p in zip(before, params)]


def test_svd_mode_equals_u_vt_per_block() -> None:
    gen = torch.Generator().manual_seed(0)
    # (16, 5) -> two (8, 5) blocks in one bucket; (6, 5) and (3, 7) (wide) are their own buckets.
    shapes = [(16, 5), (6, 5), (3, 7)]
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in shapes
    ]
    grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    config = SpectralDescentPreconditionerConfig(
        orthogonalization_config=SVDOrthogonalizationConfig()
    )
    directions = _one_step_direction(params, config, grads)
    for g, direction in zip(grads, directions):
        expected = np.concatenate(
            [numpy_polar(block) for block in np.split(g.numpy(), range(8, g.shape[0], 8))]
        )
        np.testing.assert_allclose(direction.numpy(), expected, rtol=0, atol=1e-12)


def test_svd_mode_scales_by_nuclear_norm_and_dims_and_maps_zero_to_zero() -> None:
    gen = torch.Generator().manual_seed(1)
    params = [
        torch.nn.Parameter(torch.randn(6, 3, generator=gen, dtype=torch.float64)) for _ in range(2)
    ]
    grads = [
        torch.randn(6, 3, generator=gen, dtype=torch.float64),
        torch.zeros(6, 3, dtype=torch.float64),
    ]
    method = SVDOrthogonalizationConfig(scale_by_nuclear_norm=True, scale_by_dims_fn=muon_scale)
    directions = _one_step_direction(params, SpectralDescentPreconditionerConfig(method), grads)
    g = grads[0].numpy()
    expected = numpy_polar(g) * np.linalg.svd(g, compute_uv=False).sum() * np.sqrt(6 / 3)
    np.testing.assert_allclose(directions[0].numpy(), expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(directions[1], torch.zeros(6, 3, dtype=torch.float64))


def _reference_newton_schulz_singular_values(
    s: np.ndarray, frobenius: float, steps: int
) -> np.ndarray:
    """The iteration is an odd matrix polynomial: it maps each singular value by the scalar one.

    The implementation divides by ``||G||_F + 1e-7`` (the 1e-7 keeps zero blocks zero).
    """
    a, b, c = MUON
    x = s / (frobenius + 1e-7)
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return x


@pytest.mark.parametrize("shape", [(16, 32), (32, 16), (24, 24)])
def test_newton_schulz_maps_singular_values_by_the_scalar_polynomial(
    shape: tuple[int, int],
) -> None:
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(3, *shape, generator=gen, dtype=torch.float64)
    out = newton_schulz_orthogonalize(g, MUON, 5)
    for block, result in zip(g.numpy(), out.numpy()):
        u, s, vt = np.linalg.svd(block, full_matrices=False)
        predicted = _reference_newton_schulz_singular_values(s, np.linalg.norm(block), 5)
        np.testing.assert_allclose(result, (u * predicted) @ vt, rtol=0, atol=1e-10)


def test_newton_schulz_band_and_direction() -> None:
    """Five Muon steps put normalized singular values from [1e-2, 1] into [0.68, 1.14].

    The band is the image of [1e-2, 1] under the 5-fold polynomial (measured on a 2e5-point
    grid: min 0.6818, max 1.1344); a random Gaussian matrix's normalized singular values lie in
    that interval (checked below), so its output singular values must lie in the band.
    """
    grid = np.geomspace(1e-2, 1.0, 200_001)
    image = _reference_newton_schulz_singular_values(grid, 1.0 - 1e-7, 5)
    assert 0.68 < image.min() < 0.6819 and 1.134 < image.max() < 1.14

    gen = torch.Generator().manual_seed(3)
    g = torch.randn(4, 32, 48, generator=gen, dtype=torch.float64)
    normalized = torch.linalg.svdvals(g) / torch.linalg.matrix_norm(g).unsqueeze(-1)
    assert normalized.min() >= 1e-2
    out = newton_schulz_orthogonalize(g, MUON, 5)
    singular_values = torch.linalg.svdvals(out)
    assert singular_values.min() >= 0.68 and singular_values.max() <= 1.14
    polar = torch.from_numpy(np.stack([numpy_polar(block) for block in g.numpy()]))
    cosine = (out * polar).sum(dim=(-2, -1)) / (
        torch.linalg.matrix_norm(out) * torch.linalg.matrix_norm(polar)
    )
    assert cosine.min() > 0.98, cosine


def test_newton_schulz_through_the_optimizer_matches_the_function() -> None:
    gen = torch.Generator().manual_seed(4)
    w = torch.nn.Parameter(torch.randn(16, 6, generator=gen, dtype=torch.float64))
    g = torch.randn(16, 6, generator=gen, dtype=torch.float64)
    config = SpectralDescentPreconditionerConfig(
        NewtonSchulzOrthogonalizationConfig(num_iterations=3, scale_by_dims_fn=muon_scale)
    )
    (direction,) = _one_step_direction([w], config, [g])
    blocks = g.view(2, 8, 6)  # max_preconditioner_dim 8: two (8, 6) blocks, one batched call
    expected = newton_schulz_orthogonalize(blocks, MUON, 3).reshape(16, 6) * muon_scale(6, 8)
    torch.testing.assert_close(direction, expected, rtol=0, atol=1e-14)


def test_vector_blocks_are_rejected_naming_the_field() -> None:
    model = torch.nn.Linear(4, 3)  # weight (3, 4) stays 2-D with max dim 8; bias (3,) is 1-D
    with pytest.raises(
        ValueError, match=r"^preconditioner_config: .*blocks of >= 2 dims.*'bias'.*shape \(3,\)"
    ):
        DistributedShampoo(
            model.named_parameters(),
            max_preconditioner_dim=MAX_DIM,
            preconditioner_config=SpectralDescentPreconditionerConfig(),
        )
    # Spectral descent merges only down to matrices (target_parameter_dimensionality 2, as in
    # the reference library): under the default max_preconditioner_dim (3 * 4 <= 1024) the
    # weight stays a (3, 4) block instead of merging into a vector.
    optimizer = DistributedShampoo(
        [model.weight], preconditioner_config=SpectralDescentPreconditionerConfig()
    )
    assert [tuple(b.shape) for b in optimizer._runtimes[0].distributor.local_blocked_params] == [
        (3, 4)
    ]


@pytest.mark.parametrize(
    ("factory", "field"),
    [
        (lambda: NewtonSchulzOrthogonalizationConfig(num_iterations=0), "num_iterations"),
        (lambda: NewtonSchulzOrthogonalizationConfig(coefficients=(1.0, 2.0)), "coefficients"),
        (
            lambda: NewtonSchulzOrthogonalizationConfig(coefficients=(1.0, float("nan"), 0.0)),
            "coefficients",
        ),
        (lambda: NewtonSchulzOrthogonalizationConfig(scale_by_dims_fn=2.0), "scale_by_dims_fn"),
        (lambda: NewtonSchulzOrthogonalizationConfig(compute_dtype=torch.int32), "compute_dtype"),
        (lambda: SVDOrthogonalizationConfig(scale_by_nuclear_norm="yes"), "scale_by_nuclear_norm"),
        (
            lambda: SpectralDescentPreconditionerConfig(
                orthogonalization_config=AdamPreconditionerConfig()
            ),
            "orthogonalization_config",
        ),
    ],
)
def test_invalid_configs_name_the_field(factory: Any, field: str) -> None:
    with pytest.raises(ValueError) as info:
        factory()
    assert re.match(field, error_field(info.value)), str(info.value)


def test_state_dict_round_trip_and_bit_exact_resume() -> None:
    gen = torch.Generator().manual_seed(5)
    shapes = [(12, 6), (6, 6)]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(6)]
    initial = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]

    def build(weights: list[torch.Tensor]) -> tuple[list[torch.nn.Parameter], DistributedShampoo]:
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        return params, DistributedShampoo(
            params,
            lr=0.02,
            betas=(0.95, 0.99),
            momentum=0.5,
            use_nesterov=True,
            weight_decay=0.01,
            max_preconditioner_dim=MAX_DIM,
            grafting_config=AdamPreconditionerConfig(),
            preconditioner_config=SpectralDescentPreconditionerConfig(),
        )

    def run(
        params: list[torch.nn.Parameter], opt: DistributedShampoo, steps: list[list[torch.Tensor]]
    ) -> None:
        for step_grads in steps:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()

    params, opt = build(initial)
    run(params, opt, grads[:3])
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    snapshot = [p.detach().clone() for p in params]
    run(params, opt, grads[3:])
    assert not any("spectral" in key for key in opt.state_dict()["state"][0])  # stateless

    resumed, opt2 = build(snapshot)
    buffer.seek(0)
    opt2.load_state_dict(torch.load(buffer, weights_only=True))
    run(resumed, opt2, grads[3:])
    for a, b in zip(params, resumed):
        assert torch.equal(a.detach(), b.detach())
