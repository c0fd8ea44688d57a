"""The leaderboard's MFU column: the mean over seeds of each run's final MFU, read from the
``final`` record of its JSONL log (the trainer's format), "—" where the logs have none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from compare_test import FakeTrainer, _config, _run

from nanoshampoo.evidence import leaderboard
from nanoshampoo.evidence.leaderboard import build_leaderboard, write_leaderboard
from nanoshampoo.evidence.logs import read_run

# MFU (a fraction) of each (setup, seed) the trainer below writes; soap's logs predate MFU.
MFU = {
    ("adamw", 0): 0.071,
    ("adamw", 1): 0.069,
    ("adamw", 2): 0.0725,
    ("shampoo", 0): 0.057,
    ("shampoo", 1): 0.0561,
    ("shampoo", 2): 0.058,
}


class MfuTrainer(FakeTrainer):
    """``FakeTrainer``'s runs, with the ``mfu`` the trainer writes into the final record for
    the runs in ``mfu`` (the others are logs of a trainer from before MFU was logged)."""

    def __init__(self, mfu: dict[tuple[str, int], float], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mfu = mfu

    def __call__(self, command: list[str], output: Path) -> int:
        code = super().__call__(command, output)
        out_dir = Path(command[command.index("--out-dir") + 1])
        log = out_dir / f"{command[command.index('--run-id') + 1]}.jsonl"
        seed = int(command[command.index("--seed") + 1])
        records = [json.loads(line) for line in log.read_text().splitlines()]
        if records[-1]["kind"] == "final" and (out_dir.name, seed) in self.mfu:
            records[-1]["mfu"] = self.mfu[(out_dir.name, seed)]
        log.write_text("".join(json.dumps(r) + "\n" for r in records))
        return code


def _cells(text: str, header: str) -> dict[str, dict[str, str]]:
    """The rows of the Markdown table whose first header cell is ``header``, by first cell,
    each mapping column name to cell (the first table with that header)."""
    tables: list[list[list[str]]] = [[]]
    for line in text.splitlines():
        if line.startswith("|"):
            tables[-1].append([c.strip() for c in line.split("|")[1:-1]])
        elif tables[-1]:
            tables.append([])
    table = next(t for t in tables if t and t[0][0] == header)
    return {row[0]: dict(zip(table[0], row)) for row in table[2:]}


def test_each_row_averages_its_runs_final_mfu_and_marks_logs_without_one(tmp_path: Path) -> None:
    config = _config(tmp_path)
    groups, _ = _run(config, MfuTrainer(MFU))
    board = build_leaderboard(groups, config)
    rows = {row.setup: row for row in board.rows}
    for setup in ("adamw", "shampoo"):
        values = [MFU[(setup, seed)] for seed in range(3)]
        assert rows[setup].mfu.n == 3
        assert rows[setup].mfu.mean == pytest.approx(np.mean(values))
        assert rows[setup].mfu.std == pytest.approx(np.std(values, ddof=1))
    assert rows["soap"].mfu.n == 0 and rows["soap"].mfu.mean is None
    text = leaderboard.format_leaderboard(board)
    setups = _cells(text, "setup")
    assert setups["adamw (baseline)"]["MFU %"] == "7.08 ± 0.18"  # 7.0833, std 0.1756
    assert setups["shampoo"]["MFU %"] == "5.70 ± 0.10"  # 5.7033, std 0.0950
    assert setups["soap"]["MFU %"] == "—"
    by_run = {(row["setup"], row["seed"]): row["MFU %"] for row in _all_run_rows(text)}
    assert by_run[("adamw", "1")] == "6.90" and by_run[("soap", "2")] == "—"


def _all_run_rows(text: str) -> list[dict[str, str]]:
    runs = text.split("## Runs", 1)[1]
    lines = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in runs.splitlines()
        if line.startswith("|")
    ]
    return [dict(zip(lines[0], row)) for row in lines[2:]]


def test_a_setup_with_mfu_in_some_logs_only_says_how_many(tmp_path: Path) -> None:
    config = _config(tmp_path)
    some = {key: value for key, value in MFU.items() if key != ("shampoo", 1)}
    groups, _ = _run(config, MfuTrainer(some))
    row = {row.setup: row for row in build_leaderboard(groups, config).rows}["shampoo"]
    assert row.mfu.n == 2 and row.mfu.mean == pytest.approx((0.057 + 0.058) / 2)
    text = leaderboard.format_leaderboard(build_leaderboard(groups, config))
    assert _cells(text, "setup")["shampoo"]["MFU %"] == "5.75 ± 0.07 (2/3 runs)"


def test_diverged_runs_are_left_out_of_the_mfu(tmp_path: Path) -> None:
    config = _config(tmp_path)
    groups, _ = _run(config, MfuTrainer(MFU, diverge={("adamw", 2): 60}))
    row = {row.setup: row for row in build_leaderboard(groups, config).rows}["adamw"]
    assert row.mfu.n == 2 and row.mfu.mean == pytest.approx((0.071 + 0.069) / 2)
    text = leaderboard.format_leaderboard(build_leaderboard(groups, config))
    assert _cells(text, "setup")["adamw (baseline)"]["MFU %"] == "7.00 ± 0.14"


def test_leaderboard_json_carries_each_row_and_run_mfu(tmp_path: Path) -> None:
    config = _config(tmp_path)
    groups, _ = _run(config, MfuTrainer(MFU))
    board = build_leaderboard(groups, config)
    write_leaderboard(board, groups, config.out_dir)
    data = json.loads((config.out_dir / "leaderboard.json").read_text())
    rows = {row["setup"]: row for row in data["rows"]}
    assert rows["shampoo"]["mfu"]["mean"] == pytest.approx(np.mean([0.057, 0.0561, 0.058]))
    assert rows["soap"]["mfu"] == {"n": 0, "mean": None, "std": None}
    runs = {(run["setup"], run["seed"]): run["mfu"] for run in data["runs"]}
    assert runs[("adamw", 0)] == 0.071 and runs[("soap", 0)] is None


def test_read_run_takes_the_mfu_of_the_final_record_only(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    records = [
        {"kind": "config", "run_id": "run", "seed": 0, "config": {}},
        {
            "kind": "train",
            "step": 5,
            "total_steps": 10,
            "train_loss": 4.0,
            "train_time_ms": 50.0,
            "step_avg_ms": 10.0,
            "tokens_per_s": 1e4,
            "mfu": 0.5,
        },
        {
            "kind": "val",
            "step": 10,
            "total_steps": 10,
            "val_loss": 3.9,
            "train_time_ms": 100.0,
            "step_avg_ms": 10.0,
        },
        {
            "kind": "final",
            "step": 10,
            "total_steps": 10,
            "val_loss": 3.9,
            "train_time_ms": 100.0,
            "step_avg_ms": 10.0,
            "peak_memory_mib": 80.0,
        },
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert read_run(path).mfu is None  # a train record's MFU is one step's, not the run's
    records[-1]["mfu"] = 0.0625
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert read_run(path).mfu == 0.0625
    records[-1]["mfu"] = "fast"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ValueError, match=f"{path}.*'mfu' is not a number"):
        read_run(path)
