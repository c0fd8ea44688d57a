"""The collective compat helpers: right values on gloo, no deprecation warnings, uniform waits."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from nanoshampoo.optim.collectives import (
    all_gather_into_tensor,
    reduce_scatter_tensor,
    wait_all,
    wait_work,
)
from nanoshampoo.testing.distributed import run_on_gloo

ROWS_PER_RANK = 3


def rank_input(rank: int, world_size: int) -> torch.Tensor:
    """(world_size * ROWS_PER_RANK, 2) float32 distinct per rank."""
    return torch.arange(world_size * ROWS_PER_RANK * 2.0).reshape(-1, 2) * (rank + 1)


def _collectives_body(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    warnings.simplefilter("error")  # a deprecation warning from torch fails the run
    out: dict[str, torch.Tensor] = {}
    data = rank_input(rank, world_size)

    avg = torch.empty(ROWS_PER_RANK, 2)
    wait_work(reduce_scatter_tensor(avg, data, async_op=True))  # gloo: Work without future
    out["avg"] = avg
    total = torch.empty(ROWS_PER_RANK, 2)
    assert reduce_scatter_tensor(total, data, op=dist.ReduceOp.SUM) is None
    out["sum"] = total

    # In-place gather: each rank's input is its own slice of the output.
    full = torch.full((world_size * ROWS_PER_RANK, 2), -1.0)
    full[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK] = rank + 10.0
    mine = full[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK]
    wait_all([all_gather_into_tensor(full, mine, async_op=True), None])
    out["gathered"] = full
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_reduce_scatter_and_all_gather_on_gloo() -> None:
    world_size = 2
    results = run_on_gloo(_collectives_body, world_size)
    stacked = torch.stack([rank_input(r, world_size) for r in range(world_size)])
    expected_sum = stacked.sum(dim=0)
    expected_gather = torch.cat(
        [torch.full((ROWS_PER_RANK, 2), r + 10.0) for r in range(world_size)]
    )
    for rank, result in enumerate(results):
        rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
        torch.testing.assert_close(result["avg"], expected_sum[rows] / world_size)
        torch.testing.assert_close(result["sum"], expected_sum[rows])
        assert torch.equal(result["gathered"], expected_gather)


class RecordingWork:
    """Stands in for ``torch.distributed.Work``: records the order of ``wait`` calls."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait(self) -> bool:
        self.log.append(self.name)
        return True

    def get_future(self) -> None:  # gloo's reduce-scatter Work has none: never call it
        raise RuntimeError("Work::getFuture not implemented")


def test_wait_work_waits_on_the_work_itself_and_skips_none() -> None:
    log: list[str] = []
    assert wait_work(RecordingWork("a", log)) is None
    assert wait_work(None) is None
    assert log == ["a"]


def test_wait_all_waits_on_each_work_once_in_order() -> None:
    log: list[str] = []
    works = [RecordingWork("first", log), None, RecordingWork("second", log), None]
    wait_all(works)
    assert log == ["first", "second"]
    wait_all(iter([RecordingWork("from a generator", log)]))
    assert log[-1] == "from a generator" and len(log) == 3
