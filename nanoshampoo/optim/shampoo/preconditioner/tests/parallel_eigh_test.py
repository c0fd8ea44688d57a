"""stacked_eigh: a CPU stack split over the intra-op threads equals per-matrix eigh."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from nanoshampoo.optim.shampoo.preconditioner import parallel_eigh
from nanoshampoo.optim.shampoo.preconditioner.matrix_roots import (
    eigh_inverse_root,
    robust_eigh,
)
from nanoshampoo.optim.shampoo.preconditioner.parallel_eigh import (
    MIN_PARALLEL_SIZE,
    parallel_width,
    rows_over_threads,
    stacked_eigh,
)


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def spd_stack(count: int, size: int, rank: int, seed: int = 0) -> torch.Tensor:
    """``(count, size, size)`` float32 ``G G^T / rank`` with ``G`` ``(size, rank)``: rank-deficient
    when ``rank < size`` (as early Shampoo factors are)."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(count, size, rank, generator=gen, dtype=torch.float64)
    return (g @ g.mT / rank).float()


def test_width_follows_threads_count_and_size(threads: None) -> None:
    n = MIN_PARALLEL_SIZE
    torch.set_num_threads(2)
    assert parallel_width(torch.zeros(5, n, n)) == 2
    assert parallel_width(torch.zeros(1, n, n)) == 1
    assert parallel_width(torch.zeros(5, n - 1, n - 1)) == 1
    assert parallel_width(torch.zeros(n, n)) == 1  # unbatched
    torch.set_num_threads(3)
    assert parallel_width(torch.zeros(2, n, n)) == 2
    assert parallel_width(torch.zeros(7, n, n)) == 3
    torch.set_num_threads(1)
    assert parallel_width(torch.zeros(5, n, n)) == 1


def test_split_stack_is_the_single_threaded_eigh_of_each_chunk(threads: None) -> None:
    stack = spd_stack(5, MIN_PARALLEL_SIZE + 3, rank=40)
    torch.set_num_threads(2)
    evals, evecs = stacked_eigh(stack)
    again = stacked_eigh(stack.clone())
    assert torch.get_num_threads() == 2
    # Repeatable bit for bit, whichever worker ran which chunk.
    assert torch.equal(evals, again[0]) and torch.equal(evecs, again[1])
    torch.set_num_threads(1)
    chunks = [torch.linalg.eigh(chunk) for chunk in torch.tensor_split(stack, 2)]
    assert torch.equal(evals, torch.cat([c[0] for c in chunks]))
    assert torch.equal(evecs, torch.cat([c[1] for c in chunks]))
    # Column-major per matrix, as an unsplit eigh returns its eigenvectors.
    assert evecs.stride() == torch.linalg.eigh(stack)[1].stride()


def test_split_stack_against_float64_reference(threads: None) -> None:
    stack = spd_stack(6, MIN_PARALLEL_SIZE + 5, rank=200, seed=1)
    torch.set_num_threads(2)
    evals, evecs = stacked_eigh(stack)
    ref = torch.linalg.eigvalsh(stack.double())
    top = ref[:, -1:]
    assert torch.allclose(evals.double(), ref, atol=1e-5 * top.max().item(), rtol=0.0)
    rebuilt = (evecs.double() * evals.double().unsqueeze(-2)) @ evecs.double().mT
    assert torch.allclose(rebuilt, stack.double(), atol=1e-5 * top.max().item(), rtol=0.0)
    eye = torch.eye(stack.shape[-1], dtype=torch.float64)
    assert torch.allclose(evecs.double().mT @ evecs.double(), eye.expand_as(rebuilt), atol=1e-5)


def test_threads_restored_when_a_chunk_raises(
    threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = torch.linalg.eigh
    calls: list[int] = []

    def failing(chunk: torch.Tensor, out: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(torch.get_num_threads())
        if len(calls) == 2:
            raise torch.linalg.LinAlgError("no convergence")
        return real(chunk, out=out)

    monkeypatch.setattr(parallel_eigh.torch.linalg, "eigh", failing)
    torch.set_num_threads(2)
    with pytest.raises(torch.linalg.LinAlgError):
        stacked_eigh(spd_stack(4, MIN_PARALLEL_SIZE, rank=10))
    assert len(calls) == 2
    assert torch.get_num_threads() == 2


def test_robust_eigh_falls_back_per_matrix_through_the_split(
    threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One matrix that LAPACK rejects fails alone: the split batch raises, the per-matrix
    retry keeps the others (their values as a plain eigh gives them)."""
    stack = spd_stack(4, MIN_PARALLEL_SIZE, rank=30, seed=2)
    bad = stack[2].clone()
    real = torch.linalg.eigh

    def rejects_bad(chunk: torch.Tensor, out: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        rows = chunk if chunk.dim() == 3 else chunk.unsqueeze(0)
        if any(torch.equal(row, bad) for row in rows):
            raise torch.linalg.LinAlgError("no convergence")
        return real(chunk, out=out)

    monkeypatch.setattr(parallel_eigh.torch.linalg, "eigh", rejects_bad)
    torch.set_num_threads(2)
    evals, evecs, ok = robust_eigh(stack, retry_double_precision=False)
    assert ok.tolist() == [True, True, False, True]
    assert torch.isnan(evals[2]).all()
    for i in (0, 1, 3):  # decomposed one by one (unbatched: not split), at 2 threads
        assert torch.equal(evals[i], real(stack[i])[0])


def test_inverse_roots_same_with_one_or_two_threads(threads: None) -> None:
    """The roots of a split stack are the single-threaded roots (the matrix-by-matrix
    reconstruction aside, which is one batched GEMM either way: compared to rounding)."""
    stack = spd_stack(4, MIN_PARALLEL_SIZE + 8, rank=50, seed=3)
    exponents = torch.full((4,), 0.25)
    torch.set_num_threads(1)
    single, ok1 = eigh_inverse_root(stack, exponents, 1e-12)
    torch.set_num_threads(2)
    split, ok2 = eigh_inverse_root(stack, exponents, 1e-12)
    assert ok1.all() and ok2.all()
    scale = single.abs().amax(dim=(-2, -1), keepdim=True)
    assert ((split - single).abs() / scale).max().item() < 1e-5


def test_rows_over_threads_covers_every_row_once_on_one_thread_each(threads: None) -> None:
    """5 rows at 2 threads: slices [0, 3) and [3, 5), run by workers with one intra-op thread
    each; the caller's count comes back. One thread, or one row: one slice, run here."""
    seen: list[tuple[slice, int]] = []

    def work(rows: slice) -> None:
        seen.append((rows, torch.get_num_threads()))

    torch.set_num_threads(2)
    rows_over_threads(work, 5)
    assert sorted((r.start, r.stop, n) for r, n in seen) == [(0, 3, 1), (3, 5, 1)]
    assert torch.get_num_threads() == 2
    seen.clear()
    rows_over_threads(work, 1)
    assert seen == [(slice(0, 1), 2)]
    torch.set_num_threads(1)
    seen.clear()
    rows_over_threads(work, 5)
    assert seen == [(slice(0, 5), 1)]
