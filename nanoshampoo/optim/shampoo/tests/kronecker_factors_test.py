"""Kronecker factor statistics and failure counting shared by Shampoo and SOAP."""

from __future__ import annotations

import logging

import pytest
import torch

from nanoshampoo.optim.shampoo.preconditioner.kronecker_factors import (
    KroneckerFactors,
    multiply_along_dim,
)
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


def test_failures_are_counted_warned_and_raised_past_the_tolerance(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bucket = BlockBucket((2,), torch.float32, torch.device("cpu"), ("b block_0", "b block_1"))
    stats = KroneckerFactors([bucket], torch.float32, lambda b, dim: b.shape[dim])
    pool = stats.pools[2]
    failed_first = torch.tensor([False, True])
    with caplog.at_level(logging.WARNING):
        stats.count_failures(pool, failed_first, 1, "root computation", "root")
    assert pool.failure_counts.tolist() == [1, 0]
    assert "failed for b block_0 dim 0 (1 consecutive); keeping the previous root" in caplog.text
    stats.count_failures(pool, torch.tensor([True, True]), 1, "root computation", "root")
    assert pool.failure_counts.tolist() == [0, 0]
    stats.count_failures(pool, failed_first, 1, "root computation", "root")
    with pytest.raises(RuntimeError, match=r"^root computation failed for b block_0 dim 0 2 "):
        stats.count_failures(pool, failed_first, 1, "root computation", "root")


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
