"""bench/train_mfu.py: per-step times and the vocab size read back from a run's logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts_test import load_script


@pytest.fixture(scope="module")
def train_mfu():
    return load_script("train_mfu.py")


def write_logs(tmp_path: Path, steps: list[int], times_ms: list[float]) -> tuple[Path, Path]:
    jsonl, text = tmp_path / "run.jsonl", tmp_path / "run.txt"
    records = [
        {
            "kind": "config",
            "threads": 2,
            "autocast": "off",
            "config": {"model": "tiny", "seq_len": 128, "batch_size": 16},
        }
    ]
    records += [{"kind": "train", "step": s, "train_time_ms": t} for s, t in zip(steps, times_ms)]
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    text.write_text("source...\npython 3.11 torch 2.13 parameters 10 vocab_size 4096 train x\n")
    return jsonl, text


def test_step_times_are_differences_of_the_cumulative_train_time(train_mfu, tmp_path: Path) -> None:
    config, times, vocab = train_mfu.read_run(
        *write_logs(tmp_path, [1, 2, 3], [100.0, 350.0, 450.0])
    )
    assert config["threads"] == 2 and vocab == 4096
    assert times == pytest.approx([0.25, 0.1])


def test_logs_not_written_every_step_are_refused(train_mfu, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--log-every 1"):
        train_mfu.read_run(*write_logs(tmp_path, [5, 10], [100.0, 200.0]))
