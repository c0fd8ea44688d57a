"""bench/step_breakdown.py: the phases of a profiled step, on a hand-built trace whose
answer is worked out below, and on the trace of a real (tiny) training run."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from bench_scripts_test import load_script


@pytest.fixture(scope="module")
def breakdown() -> ModuleType:
    return load_script("step_breakdown.py")


def x(name: str, start_ms: float, end_ms: float, tid: int = 1) -> dict[str, Any]:
    return {
        "ph": "X",
        "name": name,
        "ts": 1000 * start_ms,
        "dur": 1000 * (end_ms - start_ms),
        "pid": 1,
        "tid": tid,
    }


def hand_built_trace(b: ModuleType) -> dict[str, Any]:
    bwd = b.BACKWARD_PREFIX
    step = [
        x("ProfilerStep#7", 0, 1000),
        x(b.DATA, 10, 20),
        x("aten::slice", 11, 12),
        x(b.FORWARD, 20, 400),
        x("aten::embedding", 22, 30),
        x("aten::linear", 30, 60),
        x("aten::addmm", 31, 59),
        x("aten::scaled_dot_product_attention", 60, 80),
        x("aten::_flash", 62, 78),
        x("aten::linear", 100, 130),
        x("aten::linear", 300, 340),  # the head: the last linear
        x("aten::add", 340, 350),
        x("aten::cross_entropy_loss", 350, 390),
        x(bwd + "NllLossBackward0", 400, 420),
        x(bwd + "DivBackward0", 420, 450),
        x(bwd + "MmBackward0", 450, 500),  # the head's gradient: the first linear node
        x(bwd + "ScaledDotProductFlashAttentionForCpuBackward0", 500, 560),
        x("aten::_flash_backward", 505, 555),
        x(bwd + "AddmmBackward0", 560, 600),
        x(bwd + "MulBackward0", 600, 610),
        x("Optimizer.step#AdamW.step", 700, 900),
        x("aten::_foreach_add_", 710, 890),
        x("Optimizer.zero_grad#AdamW.zero_grad", 900, 905),
        x("aten::linear", 100, 900, tid=2),  # another thread: not the step's
    ]
    second = [
        x("ProfilerStep#8", 1000, 1500),
        x(b.FORWARD, 1000, 1100),
        x("aten::linear", 1050, 1060),
    ]
    return {"traceEvents": [*step, *second, {"ph": "i", "name": "marker", "ts": 5}]}


def test_hand_built_trace_phases(breakdown: ModuleType) -> None:
    steps, ms = breakdown.trace_breakdown(hand_built_trace(breakdown))
    # Step 7, then step 8 (a forward of 100 ms, one linear: the head, 10 ms; the rest idle).
    expected_7 = {
        "data": 10,
        "forward": 380,
        "backward": 210,
        "optimizer step": 200,
        "zero_grad": 5,
        "rest": 195,
        "forward: attention": 20,
        "forward: block linears": 60,
        "forward: head": 40,
        "forward: softcap + loss": 50,
        "forward: other": 210,
        "backward: attention": 60,
        "backward: block linears": 40,
        "backward: head": 50,
        "backward: softcap + loss": 50,
        "backward: other": 10,
    }
    expected_8 = dict.fromkeys(expected_7, 0.0)
    expected_8.update({"forward": 100, "rest": 400, "forward: head": 10, "forward: other": 90})
    assert steps == 2
    assert ms == pytest.approx({k: (expected_7[k] + expected_8[k]) / 2 for k in expected_7})
    assert set(ms) == {*breakdown.PHASES, *breakdown.SPLITS}


def test_a_backward_without_linear_nodes_is_all_other(breakdown: ModuleType) -> None:
    # A compiled model's backward: one node, no linear among them to mark the head.
    trace = {
        "traceEvents": [
            x("ProfilerStep#0", 0, 100),
            x(breakdown.BACKWARD_PREFIX + "CompiledFunctionBackward", 10, 60),
        ]
    }
    _, ms = breakdown.trace_breakdown(trace)
    assert ms["backward"] == ms["backward: other"] == 50
    assert ms["backward: head"] == ms["backward: softcap + loss"] == 0


def test_union_counts_overlaps_once(breakdown: ModuleType) -> None:
    assert breakdown.union_ms([(0, 1000), (500, 1500), (3000, 4000), (3100, 3200)]) == 2.5
    assert breakdown.union_ms([]) == 0.0


def test_trace_without_profiled_steps_is_refused(breakdown: ModuleType) -> None:
    with pytest.raises(ValueError, match="no ProfilerStep"):
        breakdown.trace_breakdown({"traceEvents": [x("aten::mm", 0, 1)]})


@pytest.mark.parametrize("text", ["2-5", "9-7", "x"])
def test_bad_windows_are_refused(breakdown: ModuleType, text: str) -> None:
    with pytest.raises(ValueError):
        breakdown.main(["--profile-steps", text])


@pytest.mark.slow
def test_real_tiny_run_breaks_down_into_its_phases(breakdown: ModuleType, tmp_path: Path) -> None:
    args = ["--threads", "1", "--seq-len", "32", "--batch-size", "4", "--val-tokens", "128"]
    result = breakdown.profile_preset("tiny-shampoo", 8, range(4, 7), args, tmp_path)
    ms = result["ms"]
    assert result["steps"] == 3 and result["unprofiled_step_ms"] > 0
    assert result["profiled_step_ms"] == pytest.approx(sum(ms[p] for p in breakdown.PHASES))
    assert ms["optimizer step"] > 0
    for phase in ("forward", "backward"):
        parts = [ms[f"{phase}: {part}"] for part in breakdown.PARTS]
        assert min(parts) > 0 and sum(parts) == pytest.approx(ms[phase]), phase
    table = breakdown.format_table([result])
    assert "| softcap + loss" not in table and "| forward: softcap + loss |" in table
