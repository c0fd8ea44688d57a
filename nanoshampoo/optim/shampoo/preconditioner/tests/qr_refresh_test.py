"""The QR refresh against slow explicit float64 formulas: the one-product off-diagonal ratio,
stacked_qr against torch.linalg.qr, qr_eigenbasis against an explicit loop, and
keep_previous_where_failed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from nanoshampoo.optim.shampoo.preconditioner.eigenbasis import (
    off_diagonal_ratio,
    qr_eigenbasis,
    sorted_qr_eigenbasis,
)
from nanoshampoo.optim.shampoo.preconditioner.factor_matrix_ops import keep_previous_where_failed
from nanoshampoo.optim.shampoo.preconditioner.parallel_eigh import MIN_PARALLEL_SIZE, stacked_qr


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def psd(count: int, size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(count, size, size, generator=gen, dtype=torch.float64)
    return g @ g.mT / size


def orthonormal(count: int, size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(count, size, size, generator=gen, dtype=torch.float64)).Q


def explicit_ratio(a: torch.Tensor, q: torch.Tensor) -> float:
    b = q.T @ a @ q
    total = torch.linalg.matrix_norm(b).item()
    return (
        0.0
        if total == 0.0
        else torch.linalg.matrix_norm(b - torch.diag(b.diagonal())).item() / total
    )


def test_one_product_ratio_equals_explicit_projection() -> None:
    a, q = psd(3, 40, seed=0), orthonormal(3, 40, seed=1)
    # Near an eigenbasis too (small ratio: relative agreement matters there).
    near = torch.linalg.qr(torch.linalg.eigh(a)[1] + 1e-4 * orthonormal(3, 40, seed=2)).Q
    for basis in (q, near):
        ratios = off_diagonal_ratio(a, basis)
        for i in range(3):
            expected = explicit_ratio(a[i], basis[i])
            assert ratios[i].item() == pytest.approx(expected, rel=1e-10, abs=1e-14)
    assert 0.5 < off_diagonal_ratio(a, q).min().item()
    assert off_diagonal_ratio(a, near).max().item() < 1e-2


def test_zero_and_exactly_diagonal_matrices_have_ratio_zero() -> None:
    eye = torch.eye(5).expand(2, 5, 5)
    assert off_diagonal_ratio(torch.zeros(2, 5, 5), eye).tolist() == [0.0, 0.0]
    diagonal = torch.diag(torch.tensor([1.0, 3.0, 2.0, 0.0, 5.0])).expand(2, 5, 5)
    assert off_diagonal_ratio(diagonal, eye).tolist() == [0.0, 0.0]
    bases, ok = qr_eigenbasis(diagonal, eye, max_iterations=3, tolerance=0.0)
    assert ok.all() and torch.equal(bases, eye)  # converged at tolerance 0: left unchanged


@pytest.mark.parametrize("width", [1, 2])
def test_stacked_qr_matches_linalg_qr(width: int, threads: None) -> None:
    torch.set_num_threads(2)
    stack = psd(4, MIN_PARALLEL_SIZE + 3, seed=3) @ orthonormal(4, MIN_PARALLEL_SIZE + 3, seed=4)
    q, r_diagonal = stacked_qr(stack, width)
    reference = torch.linalg.qr(stack)
    assert (q - reference.Q).abs().max().item() < 1e-12  # same signs
    expected = reference.R.diagonal(dim1=-2, dim2=-1)
    assert ((r_diagonal - expected).abs() / expected.abs().max()).max().item() < 1e-12
    assert torch.get_num_threads() == 2


def test_stacked_qr_split_equals_batched(threads: None) -> None:
    torch.set_num_threads(2)
    # Well conditioned (an ill-conditioned matrix's last Q columns are rounding-sensitive).
    stack = psd(3, MIN_PARALLEL_SIZE, seed=5) + torch.eye(MIN_PARALLEL_SIZE, dtype=torch.float64)
    for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 1e-4)):
        split, batched = stacked_qr(stack.to(dtype), 2), stacked_qr(stack.to(dtype), 1)
        assert (split[0] - batched[0]).abs().max().item() < tolerance
        assert torch.allclose(split[1], batched[1], rtol=tolerance, atol=0.0)


def explicit_refresh(
    a: torch.Tensor, q: torch.Tensor, iterations: int, tolerance: float
) -> torch.Tensor:
    for _ in range(iterations):
        if explicit_ratio(a, q) <= tolerance:
            break
        q = torch.linalg.qr(a @ q).Q
    return q


@pytest.mark.parametrize("tolerance", [0.0, 0.05])
def test_qr_eigenbasis_matches_explicit_loop(tolerance: float) -> None:
    a = psd(4, 24, seed=6)
    start = torch.linalg.eigh(a)[1].flip(-1)
    # Two matrices start near their eigenbasis (converged at 0.05), two far from it.
    start[2:] = orthonormal(2, 24, seed=7)
    start[:2] = torch.linalg.qr(start[:2] + 1e-3 * orthonormal(2, 24, seed=8)).Q
    bases, ok = qr_eigenbasis(a, start, max_iterations=3, tolerance=tolerance)
    assert ok.all()
    for i in range(4):
        expected = explicit_refresh(a[i], start[i], 3, tolerance)
        assert (bases[i] - expected).abs().max().item() < 1e-10
    if tolerance > 0:
        assert torch.equal(bases[:2], start[:2])


def test_sorted_qr_eigenbasis_matches_explicit_loop() -> None:
    a = psd(3, 20, seed=9)
    start = orthonormal(3, 20, seed=10)
    bases, ok = sorted_qr_eigenbasis(a, start, max_iterations=2, tolerance=0.0)
    assert ok.all()
    for i in range(3):
        q = explicit_refresh(a[i], start[i], 2, 0.0)
        order = torch.argsort((q.T @ a[i] @ q).diagonal(), stable=True)
        assert (bases[i] - q[:, order].flip(-1)).abs().max().item() < 1e-10


def test_non_finite_input_keeps_previous_basis() -> None:
    a = psd(2, 12, seed=11)
    a[1, 3, 4] = float("nan")
    start = orthonormal(2, 12, seed=12)
    for refresh in (qr_eigenbasis, sorted_qr_eigenbasis):
        bases, ok = refresh(a, start, max_iterations=2, tolerance=0.01)
        assert not ok[1]  # a solver error fails the whole batch, a NaN result this one only
        kept = start.clone()
        keep_previous_where_failed(kept, bases, ok)
        assert torch.equal(kept[1], start[1])
        if ok[0]:
            assert torch.equal(kept[0], bases[0])


@pytest.mark.parametrize("mask", [[True, True, True], [False, False, False], [True, False, True]])
def test_keep_previous_where_failed(mask: list[bool]) -> None:
    previous = torch.arange(3 * 4, dtype=torch.float32).view(3, 2, 2)
    computed = -torch.arange(3 * 4, dtype=torch.float64).view(3, 2, 2) - 1.0
    ok = torch.tensor(mask)
    expected = torch.stack([computed[i].float() if mask[i] else previous[i] for i in range(3)])
    storage = previous.data_ptr()
    keep_previous_where_failed(previous, computed, ok)
    assert torch.equal(previous, expected) and previous.data_ptr() == storage


def test_finite_flags_each_matrix_with_a_nan_or_an_infinity() -> None:
    from nanoshampoo.optim.shampoo.preconditioner.eigenbasis import _finite

    bases = torch.linalg.qr(torch.randn(5, 6, 6, dtype=torch.float64)).Q
    bases[1, 2, 3] = float("nan")
    bases[2, 0, 0] = float("inf")
    bases[3, 5, 1], bases[3, 4, 4] = float("inf"), float("-inf")
    assert _finite(bases).tolist() == [True, False, False, False, True]
