"""Overlap analysis on hand-built Chrome traces with known intervals."""

from __future__ import annotations

from pathlib import Path

import pytest
from evidence_fixtures import write_trace, x_event

from nanoshampoo.evidence.traces import TraceFormatError, analyze_paths, analyze_trace

MAIN, GLOO = 10, 20


def _cpu_events() -> list[dict]:
    """A gloo-style step (times in us); expected figures are worked out in the tests."""
    return [
        x_event("ProfilerStep#3", 0, 1000, MAIN, cat="user_annotation"),
        # Backward wrapper: not compute itself; the aten ops inside are.
        x_event("autograd::engine::evaluate_function: MmBackward0", 0, 400, MAIN),
        x_event("aten::mm", 0, 300, MAIN),
        x_event("aten::add", 50, 100, MAIN),  # nested in aten::mm: counted once
        # A hook launches a reduce-scatter at 300..350, staging copy inside is not compute.
        x_event("c10d::_reduce_scatter_base_", 300, 350, MAIN),
        x_event("aten::clone", 310, 340, MAIN),
        x_event("aten::mul", 350, 600, MAIN),
        # A blocking functional wait 700..800 with an aten op inside: not compute.
        x_event("_c10d_functional::wait_tensor", 700, 800, MAIN),
        x_event("aten::copy_", 710, 720, MAIN),
        x_event("aten::div", 800, 900, MAIN),
        # The collective itself on the gloo worker thread, with its own aten ops.
        x_event("gloo:all_reduce", 400, 780, GLOO, cat="user_annotation"),
        x_event("aten::copy_", 400, 450, GLOO),
    ]


def test_cpu_gloo_trace_figures(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "rank1.json.gz",
        _cpu_events(),
        rank=None,
        thread_names={GLOO: "thread 20 (pt_gloo_runloop)"},
    )
    stats = analyze_trace(path)
    # compute = [0,300) U [350,600) U [800,900) = 650; comm = [300,350) U [400,800) = 450.
    assert (stats.device, stats.rank, stats.steps) == ("cpu", 1, 1)
    assert stats.computation_ms == pytest.approx(0.650)
    assert stats.communication_ms == pytest.approx(0.450)
    assert stats.overlap_ms == pytest.approx(0.200)  # [400, 600)
    assert stats.exposed_communication_ms == pytest.approx(0.250)
    assert stats.overlap_pct == pytest.approx(100 * 200 / 450)
    assert stats.window_ms == pytest.approx(1.0)
    assert stats.by_collective["gloo:all_reduce"] == pytest.approx((0.380, 0.180))


def test_cuda_trace_uses_kernels_on_all_streams(tmp_path: Path) -> None:
    events = [
        x_event("aten::mm", 0, 1000, MAIN),  # CPU side is ignored for CUDA traces
        x_event("sm90_xmma_gemm", 0, 100, 7, cat="kernel", pid=0),
        x_event("triton_poi_fused", 80, 200, 7, cat="kernel", pid=0),
        x_event("Memcpy DtoD", 200, 500, 7, cat="gpu_memcpy", pid=0),
        x_event("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 150, 400, 21, cat="kernel", pid=0),
        x_event("ncclDevKernel_AllGather_RING_LL", 390, 450, 25, cat="kernel", pid=0),
        x_event("elementwise_kernel", 420, 430, 25, cat="kernel", pid=0),
    ]
    stats = analyze_trace(write_trace(tmp_path / "trace.json", events, rank=3))
    # compute = [0,200) U [420,430) = 210; comm = [150,450) = 300; overlap = 50 + 10.
    assert (stats.device, stats.rank) == ("cuda", 3)
    assert stats.computation_ms == pytest.approx(0.210)
    assert stats.communication_ms == pytest.approx(0.300)
    assert stats.overlap_ms == pytest.approx(0.060)
    assert stats.exposed_communication_ms == pytest.approx(0.240)
    assert stats.overlap_pct == pytest.approx(20.0)


def test_trace_without_communication(tmp_path: Path) -> None:
    stats = analyze_trace(write_trace(tmp_path / "rank0.json", [x_event("aten::mm", 0, 10, MAIN)]))
    assert stats.communication_ms == 0.0 and stats.overlap_pct is None


def test_directory_of_ranks_sorted_by_rank(tmp_path: Path) -> None:
    for rank in (1, 0, 10):
        write_trace(tmp_path / f"rank{rank}.json.gz", _cpu_events())
    assert [s.rank for s in analyze_paths([tmp_path])] == [0, 1, 10]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.json", b"", "not a readable JSON trace"),
        ("notrace.json", b'{"foo": 1}', "no 'traceEvents'"),
        ("noevents.json", b'{"traceEvents": []}', "no complete"),
        (
            "badts.json",
            b'{"traceEvents": [{"ph": "X", "name": "a", "ts": "x", "dur": 1}]}',
            "numeric 'ts'",
        ),
        ("corrupt.json.gz", b"not gzip", "not a readable JSON trace"),
    ],
)
def test_malformed_traces_name_the_file(
    tmp_path: Path, name: str, content: bytes, message: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(TraceFormatError, match=message) as info:
        analyze_trace(path)
    assert str(path) in str(info.value)


def test_empty_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="no trace files"):
        analyze_paths([tmp_path])
