"""Decay branches in the evidence tools: ``RunRecord.branches`` from JSONL and text logs (every
segment, the last record per length), the final loss at each budget in ``stats``, and the
``compare`` leaderboard's table of budgets (mean ± std over seeds, checked against numpy)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from compare_test import FakeTrainer, _config, _run

from nanoshampoo.evidence import leaderboard
from nanoshampoo.evidence.leaderboard import build_leaderboard
from nanoshampoo.evidence.logs import BranchResult, LogFormatError, read_run
from nanoshampoo.evidence.report import format_report
from nanoshampoo.evidence.stats import build_report

CONFIG = {
    "kind": "config",
    "run_id": "r",
    "seed": 0,
    "preset": "tiny",
    "optimizer": "adamw",
    "world_size": 1,
}


def _val(step: int, loss: float, time_ms: float, kind: str = "val") -> dict[str, Any]:
    record = {
        "kind": kind,
        "step": step,
        "total_steps": 100,
        "val_loss": loss,
        "train_time_ms": time_ms,
    }
    if kind == "final":
        record.update(step_avg_ms=time_ms / 100, peak_memory_mib=1.0)
    return record


def _branch(fraction: float, loss: float | str, **extra: Any) -> dict[str, Any]:
    steps = round(fraction * 100)
    return {
        "kind": "branch",
        "fraction": fraction,
        "steps": steps,
        "fork_step": steps // 2,
        "val_loss": loss,
        "train_time_ms": 10.0 * steps,
        "tokens": 512 * steps,
        **extra,
    }


def _write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_jsonl_branches_are_read_by_length_from_every_segment(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "r.jsonl",
        [
            CONFIG,
            _val(0, 7.0, 0.0),
            _branch(0.25, 5.5),
            _val(50, 5.0, 500.0),
            # The run stopped, resumed from step 40: the branch recorded before is kept, the one
            # made again replaces the first record of its length.
            _branch(0.5, 4.9),
            dict(CONFIG, resumed_from={"step": 40}),
            _branch(0.5, 4.8),
            _branch(0.75, "nan", diverged="at step 80: train loss is nan"),
            _val(100, 4.0, 1000.0, kind="final"),
        ],
    )
    run = read_run(path)
    assert list(run.branches) == [25, 50, 75]
    assert run.branches[25] == BranchResult(0.25, 25, 12, 5.5, 250.0, 12800)
    assert run.branches[50] == BranchResult(0.5, 50, 25, 4.8, 500.0, 25600)
    diverged = run.branches[75]
    assert (diverged.steps, diverged.fork_step, diverged.train_time_ms, diverged.tokens) == (
        75,
        37,
        750.0,
        38400,
    )
    assert diverged.diverged and diverged.diverged_reason == "at step 80: train loss is nan"
    assert math.isnan(diverged.val_loss) and not run.branches[50].diverged
    losses = run.final_losses_by_steps()
    assert list(losses) == [25, 50, 75, 100] and math.isnan(losses[75])
    assert (losses[25], losses[50], losses[100]) == (5.5, 4.8, 4.0)
    # The branches never enter the run's own curve.
    assert [p.step for p in run.curve] == [0, 50, 100]


def test_text_log_branch_lines_read_as_the_jsonl_does(tmp_path: Path) -> None:
    path = tmp_path / "r.txt"
    path.write_text(
        "source...\n"
        "step:0/100 val_loss:7.0000 train_time:0ms step_avg:0.00ms\n"
        "branch:0.25 step:25/25 val_loss:5.5000 train_time:250ms step_avg:10.00ms "
        "(forked at step 12)\n"
        "branch:0.5 diverged at step:30/50: train loss is nan (forked at step 25)\n"
        "step:100/100 val_loss:4.0000 train_time:1000ms step_avg:10.00ms\n"
    )
    run = read_run(path)
    assert run.branches[25] == BranchResult(0.25, 25, 12, 5.5, 250.0)
    diverged = run.branches[50]
    assert (diverged.fork_step, diverged.diverged_reason) == (25, "at step 30: train loss is nan")
    assert math.isnan(diverged.val_loss) and run.final_val_loss == 4.0


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("steps", 2.5, "'branch' field 'steps' is not an integer"),
        ("val_loss", "low", "'branch' field 'val_loss' is not a number"),
        ("diverged", 3, "'branch' field 'diverged' is not a text"),
    ],
)
def test_a_bad_branch_record_names_the_line(
    tmp_path: Path, field: str, value: Any, message: str
) -> None:
    path = _write(tmp_path / "b.jsonl", [CONFIG, dict(_branch(0.5, 4.0), **{field: value})])
    with pytest.raises(LogFormatError, match=message) as info:
        read_run(path)
    assert f"{path}:2" in str(info.value)


def test_stats_prints_the_final_loss_at_each_budget(tmp_path: Path) -> None:
    runs = []
    for seed, (a, b, final) in enumerate([(5.5, 4.8, 4.0), (5.7, 4.9, 4.1), (5.6, "nan", 4.3)]):
        path = _write(
            tmp_path / f"s{seed}.jsonl",
            [
                dict(CONFIG, seed=seed),
                _val(0, 7.0, 0.0),
                _branch(0.25, a),
                _branch(0.5, b, **({"diverged": "at step 30: x"} if b == "nan" else {})),
                _val(100, final, 1000.0, kind="final"),
            ],
        )
        runs.append(read_run(path))
    (group,) = build_report({"g": runs}).groups
    budgets = {b.steps: b for b in group.budgets}
    assert sorted(budgets) == [25, 50, 100]
    assert budgets[25].final_val_loss.mean == pytest.approx(np.mean([5.5, 5.7, 5.6]))
    assert budgets[25].final_val_loss.std == pytest.approx(np.std([5.5, 5.7, 5.6], ddof=1))
    assert (budgets[50].runs, budgets[50].diverged, budgets[50].final_val_loss.n) == (3, 1, 2)
    assert budgets[100].final_val_loss.mean == pytest.approx(np.mean([4.0, 4.1, 4.3]))
    text = format_report(build_report({"g": runs}))
    assert "final val loss at each budget (decay branches):" in text
    assert f"50     {np.mean([4.8, 4.9]):.4f} ± {np.std([4.8, 4.9], ddof=1):.4f}  3     1" in text
    # Runs without branches print no such table.
    (plain,) = build_report(
        {
            "g": [
                read_run(
                    _write(
                        tmp_path / "p.jsonl",
                        [CONFIG, _val(0, 7.0, 0.0), _val(100, 4.0, 1000.0, kind="final")],
                    )
                )
            ]
        }
    ).groups
    assert plain.budgets == ()


# The branch losses the trainer below records: (setup, seed) -> (25-step loss, 50-step loss).
BRANCH_LOSSES = {("adamw", s): (5.0 + 0.1 * s, 4.5 + 0.05 * s) for s in range(3)} | {
    ("shampoo", s): (4.9 - 0.02 * s, 4.4 + 0.01 * s) for s in range(3)
}


class BranchTrainer(FakeTrainer):
    """``FakeTrainer``'s runs with two decay branches recorded for the runs in
    ``BRANCH_LOSSES`` (soap's runs have none)."""

    def __call__(self, command: list[str], output: Path) -> int:
        code = super().__call__(command, output)
        out_dir = Path(command[command.index("--out-dir") + 1])
        log = out_dir / f"{command[command.index('--run-id') + 1]}.jsonl"
        key = (out_dir.name, int(command[command.index("--seed") + 1]))
        records = [json.loads(line) for line in log.read_text().splitlines()]
        if key in BRANCH_LOSSES:
            losses = BRANCH_LOSSES[key]
            records[-1:-1] = [_branch(b, loss) for b, loss in zip((0.25, 0.5), losses)]
        _write(log, records)
        return code


def test_compare_tables_the_final_loss_at_each_budget(tmp_path: Path) -> None:
    config = _config(tmp_path)
    groups, _ = _run(config, BranchTrainer())
    board = build_leaderboard(groups, config)
    text = leaderboard.format_leaderboard(board)
    assert "## Final val loss at each budget (decay branches)" in text
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 5 and cells[0] in ("adamw", "shampoo", "soap") and cells[1].isdigit():
            rows[(cells[0], cells[1])] = dict(zip(["setup", "steps", "loss", "runs", "div"], cells))
    assert sorted(rows) == [
        ("adamw", "100"),
        ("adamw", "25"),
        ("adamw", "50"),
        ("shampoo", "100"),
        ("shampoo", "25"),
        ("shampoo", "50"),
    ]
    for setup in ("adamw", "shampoo"):
        for index, steps in enumerate(("25", "50")):
            losses = [BRANCH_LOSSES[(setup, s)][index] for s in range(3)]
            assert rows[(setup, steps)]["loss"] == (
                f"{np.mean(losses):.4f} ± {np.std(losses, ddof=1):.4f}"
            )
        finals = [run.final_val_loss for run in groups[setup]]
        assert rows[(setup, "100")]["loss"] == (
            f"{np.mean(finals):.4f} ± {np.std(finals, ddof=1):.4f}"
        )
    assert board.rows[2].setup == "soap" and board.rows[2].budgets == ()  # its runs have none
    # Without branches in any run, no such section.
    plain_config = _config(tmp_path / "plain")
    plain_groups, _ = _run(plain_config, FakeTrainer())
    plain = leaderboard.format_leaderboard(build_leaderboard(plain_groups, plain_config))
    assert "decay branches" not in plain
