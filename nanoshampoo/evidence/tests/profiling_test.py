"""StepProfiler records exactly the chosen steps; a real 2-rank gloo trace is analyzed."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from nanoshampoo.evidence.profiling import StepProfiler
from nanoshampoo.evidence.traces import analyze_paths
from nanoshampoo.testing.distributed import run_on_gloo


def _recorded_steps(path: Path) -> list[str]:
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))


@pytest.mark.parametrize(("steps", "first"), [([0, 1], 0), ([3, 4], 0), ([6], 5)])
def test_records_only_the_chosen_steps(tmp_path: Path, steps: list[int], first: int) -> None:
    with StepProfiler(tmp_path, steps, rank=2) as profiler:
        for step in range(first, 8):
            profiler.step(step)
            torch.ones(8) * 2
    assert _recorded_steps(tmp_path / "rank2.json.gz") == [f"ProfilerStep#{s}" for s in steps]


def test_invalid_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="consecutive"):
        StepProfiler(tmp_path, [5, 10])
    with pytest.raises(ValueError, match="steps"):
        StepProfiler(tmp_path, [])
    with StepProfiler(tmp_path, [3]) as profiler:
        profiler.step(0)
        with pytest.raises(ValueError, match="step_index"):
            profiler.step(2)


def _gloo_job(rank: int, world_size: int, out_dir: str) -> int:
    from nanoshampoo.optim.collectives import (
        all_gather_into_tensor,
        reduce_scatter_tensor,
        wait_work,
    )

    x = torch.randn(128, 128)
    grad = torch.randn(64 * 1024)
    shard = torch.empty(grad.numel() // world_size)
    with StepProfiler(out_dir, [1, 2], rank=rank) as profiler:
        for step in range(3):
            profiler.step(step)
            y = x @ x
            work = reduce_scatter_tensor(shard, grad, async_op=True)
            y = y @ x  # compute while the reduce-scatter is in flight
            wait_work(work)
            all_gather_into_tensor(grad, shard)
    return int(y.shape[0])


@pytest.mark.distributed
@pytest.mark.slow
def test_real_gloo_trace_has_communication(tmp_path: Path) -> None:
    run_on_gloo(_gloo_job, 2, str(tmp_path))
    stats = analyze_paths([tmp_path])
    assert [s.rank for s in stats] == [0, 1]
    for s in stats:
        assert s.device == "cpu" and s.steps == 2
        assert s.communication_ms > 0 and s.computation_ms > 0
        assert 0 <= s.overlap_ms <= min(s.communication_ms, s.computation_ms)
        assert any(name.startswith("gloo:") for name in s.by_collective)
        assert any(name.startswith("c10d::") for name in s.by_collective)
