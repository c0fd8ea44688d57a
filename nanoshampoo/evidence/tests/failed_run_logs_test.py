"""A run whose trainer recorded that it failed (``RunLog.failed``) is refused as failed, where
and why, by every reader; compare stops on it with one line saying so; a resume after the
failure is read as the run it became."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from compare_test import fake_resolve

from nanoshampoo.evidence.compare import CompareConfig, parse_setups, run_compare
from nanoshampoo.evidence.logs import LogFormatError, read_run

REASON = "optimizer Kron (shim.py) raised in step 2: PrecondInitError: all-zero gradient"
CONFIG = {"kind": "config", "run_id": "r", "seed": 0, "world_size": 1, "config": {}}
FAILED = {"kind": "failed", "step": 1, "total_steps": 4, "reason": REASON, "train_time_ms": 3.0}
FINAL = {
    "kind": "final",
    "step": 4,
    "total_steps": 4,
    "val_loss": 5.0,
    "train_time_ms": 9.0,
    "step_avg_ms": 2.25,
    "peak_memory_mib": 1.0,
}


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_failed_jsonl_log_is_refused_as_failed(tmp_path: Path) -> None:
    log = _jsonl(tmp_path / "r.jsonl", [CONFIG, FAILED])
    with pytest.raises(LogFormatError) as refused:
        read_run(log)
    assert str(refused.value) == f"{log}: the run failed after step 1 of 4: {REASON}"


def test_a_failed_text_log_is_refused_as_failed(tmp_path: Path) -> None:
    log = tmp_path / "r.txt"
    log.write_text(
        "step:0/4 val_loss:9.0000 train_time:0ms step_avg:0.00ms\n"
        f"failed after step:1/4: {REASON}\n"
    )
    with pytest.raises(LogFormatError) as refused:
        read_run(log)
    assert str(refused.value) == f"{log}: the run failed after step 1 of 4: {REASON}"


def test_a_run_resumed_after_it_failed_is_read_as_what_it_became(tmp_path: Path) -> None:
    log = _jsonl(tmp_path / "r.jsonl", [CONFIG, FAILED, CONFIG, FINAL])
    run = read_run(log)
    assert (run.final_val_loss, run.train_time_ms, run.diverged) == (5.0, 9.0, False)


def test_compare_stops_on_a_failed_run_with_one_line_saying_it_failed(tmp_path: Path) -> None:
    def failing_trainer(command: list[str], output: Path) -> int:
        out_dir = Path(command[command.index("--out-dir") + 1])
        run_id = command[command.index("--run-id") + 1]
        output.write_text(f"python -m nanoshampoo.train: error: {REASON}\n")
        _jsonl(out_dir / f"{run_id}.jsonl", [dict(CONFIG, run_id=run_id), FAILED])
        return 2

    config = CompareConfig(
        setups=parse_setups("adamw"),
        seeds=1,
        out_dir=tmp_path / "cmp",
        train_args=("--num-iterations", "4"),
    )
    with pytest.raises(RuntimeError) as stopped:
        run_compare(config, fake_resolve, failing_trainer, lambda line: None)
    (log,) = (tmp_path / "cmp" / "adamw").glob("*.jsonl")
    output = log.with_suffix(".out")
    assert str(stopped.value) == (
        f"adamw seed 0 failed (exit status 2): python -m nanoshampoo.train: error: {REASON}; "
        f"log: {log}: the run failed after step 1 of 4: {REASON}; output: {output}"
    )
