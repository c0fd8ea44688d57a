"""The gloo spawning helper itself: results come back per rank, failures carry the traceback."""

import pytest
import torch
import torch.distributed as dist

from nanoshampoo.testing.distributed import run_on_gloo


def _sum_of_ranks(rank: int, world_size: int) -> torch.Tensor:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t


def _fails_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_result_reaches_every_rank(world_size: int) -> None:
    results = run_on_gloo(_sum_of_ranks, world_size)
    expected = world_size * (world_size + 1) / 2
    assert [r.item() for r in results] == [expected] * world_size


@pytest.mark.distributed
def test_failure_on_one_rank_is_reported_with_its_traceback() -> None:
    with pytest.raises(RuntimeError, match="boom on rank one"):
        run_on_gloo(_fails_on_rank_one, 2)
