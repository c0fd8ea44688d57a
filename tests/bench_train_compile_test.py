"""bench/train_compile.py: step times from a run's log, the steady step and warm-up, and the
payback of the compile cost, against figures worked out by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import pytest
from bench_scripts_test import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("train_compile.py")


def write_log(path: Path, cumulative_ms: list[float], mfu: float = 0.05) -> Path:
    records = [
        {
            "kind": "config",
            "run_id": "run",
            "mfu": {"flops_per_step": 2e9, "peak_flops_per_second": 1e11},
        }
    ]
    records += [
        {"kind": "train", "step": i + 1, "train_time_ms": t} for i, t in enumerate(cumulative_ms)
    ]
    records.append({"kind": "final", "step": len(cumulative_ms), "mfu": mfu})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_step_times_are_differences_of_the_cumulative_time(
    bench: ModuleType, tmp_path: Path
) -> None:
    times, mfu, mfu_of_1s = bench.step_times_s(
        write_log(tmp_path / "run.jsonl", [3000.0, 3500.0, 3900.0], 0.07)
    )
    assert times == pytest.approx([3.0, 0.5, 0.4]) and mfu == 0.07 and mfu_of_1s == 0.02


def test_a_log_not_written_every_step_is_refused(bench: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    path.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {"kind": "train", "step": 10, "train_time_ms": 1.0},
                {"kind": "final", "mfu": 0.1},
            ]
        )
    )
    with pytest.raises(ValueError, match="--log-every 1"):
        bench.step_times_s(path)


def test_steady_step_and_warm_up(bench: ModuleType) -> None:
    # Steady: median of [0.2, 0.3, 0.25] = 0.25 s; warm-up: 30 + 0.5 - 2 * 0.25 = 30 s.
    assert bench.run_figures([30.0, 0.5, 0.2, 0.3, 0.25], skip=2) == pytest.approx(
        {"step_ms": 250.0, "warm_s": 30.0}
    )
    with pytest.raises(ValueError, match="--skip 5"):
        bench.run_figures([1.0, 2.0], skip=5)


def test_payback_of_the_compile_cost(bench: ModuleType) -> None:
    runs = {
        "eager": [
            {"step_ms": 400.0, "warm_s": 1.0, "wall_s": 20.0},
            {"step_ms": 500.0, "warm_s": 3.0, "wall_s": 30.0},
        ],
        "compiled": [{"step_ms": 200.0, "warm_s": 31.0, "wall_s": 60.0}],
    }
    out = bench.summarize(runs, pays_at=300)
    # Eager medians: 450 ms, 2 s warm-up. Saves 0.25 s a step; costs 29 s: paid after 116 steps.
    assert out["speedup"] == pytest.approx(2.25)
    assert out["compile_cost_s"] == pytest.approx(29.0)
    assert out["payback_steps"] == pytest.approx(116.0)
    assert out["eager_train_s_at_300"] == pytest.approx(300 * 0.45 + 2.0)
    assert out["compiled_train_s_at_300"] == pytest.approx(300 * 0.2 + 31.0)
    slower = {"eager": runs["compiled"], "compiled": runs["eager"]}
    assert math.isinf(bench.summarize(slower, pays_at=300)["payback_steps"])


@pytest.fixture(scope="module")
def steps_bench() -> ModuleType:
    return load_script("train_compile_steps.py")


def test_alternating_order_pairs_every_step_with_a_neighbour(steps_bench: ModuleType) -> None:
    assert steps_bench.schedule(8) == [
        "eager",
        "compiled",
        "compiled",
        "eager",
        "eager",
        "compiled",
        "compiled",
        "eager",
    ]
    for bad in (3, 7):
        with pytest.raises(ValueError, match=f"--steps {bad}"):
            steps_bench.schedule(bad)


def test_alternating_figures(steps_bench: ModuleType) -> None:
    # Eager median 0.4 s; compiled median of [0.2, 0.3, 0.25] = 0.25 s; the first compiled
    # step 30.25 s costs 30 s, saving 0.15 s a step: paid back after 200 steps.
    out = steps_bench.figures({"eager": [0.5, 0.4, 0.3, 0.4], "compiled": [30.25, 0.2, 0.3, 0.25]})
    assert out == pytest.approx(
        {
            "eager_step_ms": 400.0,
            "compiled_step_ms": 250.0,
            "compiled_over_eager": 0.625,
            "compile_cost_s": 30.0,
            "payback_steps": 200.0,
        }
    )
