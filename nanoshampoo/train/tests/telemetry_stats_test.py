"""Every telemetry statistic against a float64 computation written from its definition."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nanoshampoo.train.telemetry_stats import (
    orthogonality_error,
    rms,
    singular_value_range,
    spectrum_health,
    spread,
    top_singular_value,
)


def matrix_with_singular_values(values: list[float], rows: int, cols: int) -> torch.Tensor:
    """``U diag(values) V^T`` with random orthonormal ``U``, ``V`` (float64)."""
    generator = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(rows, len(values), generator=generator, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, len(values), generator=generator, dtype=torch.float64))
    return u @ torch.diag(torch.tensor(values, dtype=torch.float64)) @ v.T


def test_rms_is_the_root_mean_square_of_every_entry() -> None:
    x = torch.randn(7, 5, generator=torch.Generator().manual_seed(1))
    expected = math.sqrt(sum(float(v) ** 2 for v in x.double().flatten()) / x.numel())
    assert rms(x) == pytest.approx(expected, rel=1e-12)
    assert rms(torch.zeros(0)) == 0.0


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (8, 3, 4)])
def test_top_singular_value_converges_to_sigma_max_in_float32(shape: tuple[int, ...]) -> None:
    rows, cols = shape[0], math.prod(shape[1:])
    k = min(rows, cols)
    values = [3.0, 1.5] + [1.0 / (i + 2) for i in range(k - 2)]
    m = matrix_with_singular_values(values, rows, cols).reshape(shape)
    expected = float(np.linalg.svd(m.reshape(rows, cols).numpy(), compute_uv=False)[0])
    assert top_singular_value(m.float(), iterations=8) == pytest.approx(expected, rel=1e-4)


def test_top_singular_value_is_a_lower_bound_without_a_gap() -> None:
    m = torch.randn(40, 30, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    sigma = float(np.linalg.svd(m.numpy(), compute_uv=False)[0])
    estimate = top_singular_value(m, iterations=3)
    assert 0.8 * sigma < estimate <= sigma * (1 + 1e-12)
    assert top_singular_value(torch.zeros(4, 3)) == 0.0


def reference_spectrum(eigenvalues: list[float], epsilon: float) -> tuple[float, float, float]:
    values = [max(v, 0.0) for v in eigenvalues]
    low, high = min(values) + epsilon, max(values) + epsilon
    total = sum(values)
    entropy = -sum(v / total * math.log(v / total) for v in values if v > 0.0)
    below = sum(1 for v in values if v < epsilon) / len(values)
    return high / low, math.exp(entropy), below


@pytest.mark.parametrize(
    ("eigenvalues", "epsilon"),
    [
        ([4.0, 1.0, 0.25, 0.0625], 1e-12),
        ([2.0, 2.0, 2.0], 1e-8),
        ([5.0, 1e-9, -3e-10, 0.0], 1e-8),  # rank one with rounding noise: the ridge decides
        ([1e3, 1e-2, 1e-13], 1e-12),
    ],
)
def test_spectrum_health_against_its_definition(eigenvalues: list[float], epsilon: float) -> None:
    got = spectrum_health(torch.tensor(eigenvalues, dtype=torch.float32), epsilon)
    # The statistic reads float32 eigenvalues (the factor dtype): compare at that rounding.
    rounded = [float(v) for v in torch.tensor(eigenvalues, dtype=torch.float32)]
    assert got == pytest.approx(reference_spectrum(rounded, epsilon), rel=1e-9)


def test_spectrum_health_of_a_factor_matches_eigvalsh_in_float64() -> None:
    g = torch.randn(6, 20, generator=torch.Generator().manual_seed(3))
    factor = g @ g.T
    values = torch.linalg.eigvalsh(factor.double())
    expected = reference_spectrum(values.tolist(), 1e-12)
    got = spectrum_health(torch.linalg.eigvalsh(factor), 1e-12)
    assert got == pytest.approx(expected, rel=1e-4)


def test_spectrum_health_edge_cases() -> None:
    assert spectrum_health(torch.zeros(3), 0.0)[0] == math.inf
    assert spectrum_health(torch.zeros(3), 1e-6) == (1.0, 0.0, 1.0)
    assert all(math.isnan(v) for v in spectrum_health(torch.tensor([1.0, math.nan]), 1e-6))


@pytest.mark.parametrize("shape", [(12, 5), (5, 12)])
def test_orthogonality_error_against_its_definition(shape: tuple[int, int]) -> None:
    u = torch.randn(*shape, generator=torch.Generator().manual_seed(4))
    m = u.double().numpy()
    n = min(shape)
    gram = m.T @ m if shape[0] >= shape[1] else m @ m.T
    expected = np.linalg.norm(gram - np.eye(n), "fro") / math.sqrt(n)
    assert orthogonality_error(u) == pytest.approx(expected, rel=1e-6)
    q, _ = torch.linalg.qr(torch.randn(12, 5, dtype=torch.float64))
    assert orthogonality_error(q if shape[0] >= shape[1] else q.T) < 1e-12


def test_singular_value_range_against_float64_svd() -> None:
    m = matrix_with_singular_values([1.2, 1.0, 0.9, 0.7], 9, 4)
    low, high = singular_value_range(m.float())
    assert (low, high) == pytest.approx((0.7, 1.2), rel=1e-5)


def test_spread_is_max_over_lower_median_of_the_square_roots() -> None:
    v = torch.tensor([[4.0, 1.0], [9.0, 16.0], [0.25, 1.0]])
    roots = sorted(math.sqrt(x) for x in v.flatten().tolist())
    expected = roots[-1] / roots[(len(roots) - 1) // 2]
    assert spread(v) == pytest.approx(expected, rel=1e-12)
    assert spread(torch.zeros(4)) == math.inf
