"""Kronecker factor statistics and failure counting shared by Shampoo and SOAP."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from nanoshampoo.optim.shampoo.preconditioner.factor_matrix_ops import (
    SYMMETRIC_PART_TILE,
    SYMMETRIC_PART_TILED_MIN_SIZE,
    TILED_UPDATE_MIN_SIZE,
    multiply_along_dim,
    symmetric_part,
    symmetric_product,
    symmetric_rank_update_,
)
from nanoshampoo.optim.shampoo.preconditioner.kronecker_factors import KroneckerFactors
from nanoshampoo.optim.shampoo.preconditioner.preconditioner import BlockBucket

torch.set_num_threads(1)


def _reference_factor(grads: list[torch.Tensor], dim: int, beta2: float) -> torch.Tensor:
    """``F <- b2 F + w G_(dim) G_(dim)^T`` by explicit unfolding, one block, float64."""
    size = grads[0].shape[dim]
    factor = torch.zeros(size, size, dtype=torch.float64)
    weight = 1.0 if beta2 == 1.0 else 1.0 - beta2
    for grad in grads:
        unfolded = grad.movedim(dim, 0).reshape(size, -1)
        factor = beta2 * factor + weight * unfolded @ unfolded.T
    return factor


@pytest.mark.parametrize("beta2", [1.0, 0.9])
def test_factors_of_every_dim_match_explicit_unfolding(beta2: float) -> None:
    buckets = [
        BlockBucket((3, 4, 2), torch.float64, torch.device("cpu"), ("a block_0", "a block_1")),
        BlockBucket((4, 3), torch.float64, torch.device("cpu"), ("b block_0",)),
    ]
    stats = KroneckerFactors(buckets, torch.float64, lambda bucket, dim: bucket.shape[dim])
    gen = torch.Generator().manual_seed(0)
    steps = [
        [torch.randn(b.stacked_shape, dtype=torch.float64, generator=gen) for b in buckets]
        for _ in range(3)
    ]
    for grads in steps:
        stats.update(grads, beta2)
    assert sorted(stats.pools) == [2, 3, 4]
    for index, bucket in enumerate(buckets):
        for dim in range(len(bucket.shape)):
            slot = stats.slots[index][dim]
            factors = {key: pool.factors for key, pool in stats.pools.items()}
            rows = KroneckerFactors.rows(slot, bucket.num_blocks, factors)
            for block in range(bucket.num_blocks):
                expected = _reference_factor([g[index][block] for g in steps], dim, beta2)
                torch.testing.assert_close(rows[block], expected, rtol=1e-12, atol=1e-12)
                label = stats.pools[slot.pool_key].labels[slot.offset + block]
                assert label == f"{bucket.block_labels[block]} dim {dim}"


def test_dims_without_a_key_get_no_factor() -> None:
    bucket = BlockBucket((3, 5), torch.float32, torch.device("cpu"), ("w block_0",))
    stats = KroneckerFactors(
        [bucket], torch.float32, lambda b, dim: None if dim == 1 else b.shape[dim]
    )
    assert stats.slots == [[stats.slots[0][0], None]]
    assert list(stats.pools) == [3]


@pytest.mark.parametrize("rows", [None, torch.tensor([0, 2])])
def test_failures_are_counted_warned_and_raised_past_the_tolerance(
    caplog: pytest.LogCaptureFixture, rows: torch.Tensor | None
) -> None:
    labels = ("b block_0", "b block_1", "b block_2")
    bucket = BlockBucket((2,), torch.float32, torch.device("cpu"), labels)
    stats = KroneckerFactors([bucket], torch.float32, lambda b, dim: b.shape[dim])
    pool = stats.pools[2]
    # Row 0 fails, row 2 succeeds; row 1 is solved only when all rows are.
    failed_first = (
        torch.tensor([False, True]) if rows is not None else torch.tensor([False, True, True])
    )
    all_ok = torch.ones_like(failed_first)

    def solve(ok: torch.Tensor) -> None:
        stats.record_outcome(pool, rows, ok)
        stats.check_failures([(pool, rows, ok)], 1, "root computation", "root")

    with caplog.at_level(logging.WARNING):
        solve(failed_first)
    assert pool.failure_counts.tolist() == [1, 0, 0]
    assert "failed for b block_0 dim 0 (1 consecutive); keeping the previous root" in caplog.text
    solve(all_ok)
    assert pool.failure_counts.tolist() == [0, 0, 0]
    solve(failed_first)
    with pytest.raises(RuntimeError, match=r"^root computation failed for b block_0 dim 0 2 "):
        solve(failed_first)
    assert pool.failure_counts.tolist() == [2, 0, 0]


def test_symmetric_rank_update_matches_the_dense_product() -> None:
    gen = torch.Generator().manual_seed(3)
    unfolded = torch.randn(2, 1100, 40, dtype=torch.float64, generator=gen)
    start = torch.randn(2, 1100, 1100, dtype=torch.float64, generator=gen)
    start = start + start.mT
    expected = 0.9 * start + 0.1 * unfolded @ unfolded.mT
    result = symmetric_rank_update_(start.clone(), unfolded, 0.9, 0.1)
    torch.testing.assert_close(result, expected, rtol=1e-12, atol=1e-12)
    # 4 tiles of 275 rows: each tile below the diagonal is the copy of its mirror.
    assert torch.equal(result[:, 275:, :275], result[:, :275, 275:].mT)
    assert torch.equal(result[:, 825:, 550:825], result[:, 550:825, 825:].mT)


@pytest.mark.parametrize("size", [40, TILED_UPDATE_MIN_SIZE + 90])
def test_symmetric_product_is_exactly_symmetric_and_the_root_product(size: int) -> None:
    """``Q diag(w) Q^T`` in float32, against the float64 product of the same float32 operands:
    within float32 rounding, exactly symmetric; untiled (the smaller size) the symmetric part
    of the full product, bit for bit; tiled, each tile below the diagonal the copy of its
    mirror (two tiles of 301 rows)."""
    gen = torch.Generator().manual_seed(5)
    q = torch.linalg.qr(torch.randn(2, size, size, dtype=torch.float64, generator=gen)).Q.float()
    w = torch.rand(2, size, generator=gen, dtype=torch.float64).float() * 10 + 0.1
    left = q * w.unsqueeze(-2)
    result = symmetric_product(left, q)
    expected = left.double() @ q.double().mT
    torch.testing.assert_close(result.double(), expected, rtol=0.0, atol=1e-5 * 10)
    assert torch.equal(result, result.mT)
    if size < TILED_UPDATE_MIN_SIZE:
        full = left @ q.mT
        assert torch.equal(result, symmetric_part(full, out=torch.empty_like(full)))
    else:
        assert torch.equal(result[:, 301:, :301], result[:, :301, 301:].mT)


@pytest.mark.parametrize("size", [5, SYMMETRIC_PART_TILED_MIN_SIZE + SYMMETRIC_PART_TILE // 3])
def test_symmetric_part_is_the_halved_sum_with_the_transpose(size: int) -> None:
    """Untiled and tiled (the larger size, its last tiles partial): ``(X + X^T) / 2`` of the
    float64 reference, rounded once, i.e. the float32 sum halved, bit for bit."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, size, size, generator=gen)
    out = torch.full_like(x, float("nan"))
    assert symmetric_part(x, out=out) is out
    expected = ((x.double() + x.double().mT) / 2).float()
    assert torch.equal(out, expected)
    assert torch.equal(out, out.mT)


def test_share_rows_cover_every_factor_once_balanced_by_cost() -> None:
    big = BlockBucket((8, 8), torch.float32, torch.device("cpu"), ("w block_0", "w block_1"))
    small = BlockBucket((4,), torch.float32, torch.device("cpu"), ("b block_0",) * 4)
    stats = KroneckerFactors([big, small], torch.float32, lambda b, dim: b.shape[dim])
    shares = stats.share_rows(3)
    solved = sorted(
        (key, row) for share in shares for key, rows in share.items() for row in rows.tolist()
    )
    assert solved == [(4, r) for r in range(4)] + [(8, r) for r in range(4)]
    # Four 8x8 factors (cost 512) and four 4x4 ones (64) over 3 shares: 2 + 1 + 1 big ones,
    # the small ones on the two lighter shares.
    costs = sorted(sum(key**3 * len(rows) for key, rows in share.items()) for share in shares)
    assert costs == [512 + 2 * 64, 512 + 2 * 64, 1024]
    again = stats.share_rows(3)  # deterministic
    assert all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        for a, b in zip(shares, again)
    )


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_multiply_along_dim_matches_einsum(dim: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64, generator=gen)
    size = x.shape[dim + 1]
    matrices = torch.randn(2, size, size, dtype=torch.float64, generator=gen)
    spec = {0: "bjk,bkyz->bjyz", 1: "bjk,bxkz->bxjz", 2: "bjk,bxyk->bxyj"}[dim]
    expected = torch.einsum(spec, matrices, x)
    result = multiply_along_dim(matrices, x, dim)
    torch.testing.assert_close(result, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["shampoo", "soap"])
def test_both_preconditioners_keep_results_where_the_solve_failed_and_count(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared solve loop: a failed factor keeps its result and is counted, the rest update."""
    from nanoshampoo.optim.shampoo.preconditioner import (
        eigenvalue_corrected_shampoo_preconditioner as eigenvalue_corrected,
    )
    from nanoshampoo.optim.shampoo.preconditioner.shampoo_preconditioner import (
        ShampooPreconditioner,
    )
    from nanoshampoo.optim.shampoo.shampoo_types import (
        DefaultEigenvalueCorrectedShampooConfig,
        DefaultShampooConfig,
    )

    bucket = BlockBucket((3,), torch.float32, torch.device("cpu"), ("v block_0", "w block_0"))
    if kind == "shampoo":
        preconditioner = ShampooPreconditioner([bucket], DefaultShampooConfig, 1.0, 1e-6, True)
        name = "inv_factor_matrices"
    else:
        preconditioner = eigenvalue_corrected.EigenvalueCorrectedShampooPreconditioner(
            [bucket], DefaultEigenvalueCorrectedShampooConfig, 1.0, 1e-6, True
        )
        name = "factor_matrices_eigenvectors"
    grads = torch.tensor([[1.0, 2.0, 3.0], [3.0, 0.0, 1.0]])
    preconditioner.update_statistics([grads], step=1)
    solve = type(preconditioner)._solve

    def fail_first(
        self: Any, key: Any, matrices: torch.Tensor, rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The first factor's solve fails for real (a NaN factor: a solver never writes over
        # the stored results in place unless every solve will succeed), and is reported failed.
        broken = matrices.clone()
        broken[0, 0, 0] = float("nan")
        results, ok = solve(self, key, broken, rows)
        return results, ok & torch.tensor([False, True])

    monkeypatch.setattr(type(preconditioner), "_solve", fail_first)
    preconditioner.amortized_computation(step=1)
    first, second = (preconditioner.block_state(0, position) for position in (0, 1))
    assert torch.equal(getattr(first, name)[0], torch.eye(3))  # kept: identity until computed
    assert not torch.equal(getattr(second, name)[0], torch.eye(3))
    assert [int(first.failure_counts[0]), int(second.failure_counts[0])] == [1, 0]
