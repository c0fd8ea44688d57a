"""The leaderboard's rules: track 3's verdicts, the same-step check, and the seeds a
p < 0.05 result would need, on the fake runs of ``compare_test``."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
from compare_test import FINALS, FakeTrainer, ScheduleTrainer, _config, _run, fake_resolve

from nanoshampoo.evidence import leaderboard
from nanoshampoo.evidence.compare import run_compare
from nanoshampoo.evidence.leaderboard import build_leaderboard


def test_track3_rule_names_itself_and_gives_both_verdicts(tmp_path: Path) -> None:
    config = _config(tmp_path, rule="track3")
    groups, _ = _run(config, FakeTrainer())
    board = build_leaderboard(groups, config)
    target = float(np.mean(FINALS["adamw"]))
    rows = {row.setup: row for row in board.rows}
    for setup, finals in FINALS.items():
        row = rows[setup]
        assert row.steps == 100 and row.record is not None
        assert row.record.statistic == pytest.approx((target - np.mean(finals)) * math.sqrt(3))
        assert row.record.passed == (row.record.statistic >= 0.004)
    # shampoo: (4.026667 - 3.973333) * sqrt(3) = 0.092376; pairwise / sqrt(2/3) = 0.065320.
    assert rows["shampoo"].record.statistic == pytest.approx(0.0923760, rel=1e-5)
    assert rows["shampoo"].pairwise.statistic == pytest.approx(0.0653197, rel=1e-5)
    assert rows["shampoo"].pairwise.credit == 0.0 and rows["shampoo"].pairwise.passed
    assert rows["adamw"].pairwise is None and not rows["adamw"].record.passed
    text = leaderboard.format_leaderboard(board)
    assert "Rule: **track3:" in text and "## Track-3 verdicts" in text
    cells = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in text.splitlines()
        if line.startswith("|")
    ]
    assert ["shampoo", "100", "3", "0.09238"] in [row[:4] for row in cells]
    welch_board = build_leaderboard(groups, _config(tmp_path))
    assert "Rule: **welch:" in leaderboard.format_leaderboard(welch_board)
    assert all(row.record is None for row in welch_board.rows)


def test_every_row_says_how_many_seeds_p_below_005_would_need(tmp_path: Path) -> None:
    config = _config(tmp_path)
    groups, _ = _run(config, FakeTrainer())
    rows = {row.setup: row for row in build_leaderboard(groups, config).rows}
    assert rows["adamw"].seeds_needed is None  # the baseline itself
    for setup in ("shampoo", "soap"):
        gap = np.mean(FINALS[setup]) - np.mean(FINALS["adamw"])
        stds = np.std(FINALS[setup], ddof=1), np.std(FINALS["adamw"], ddof=1)
        n = rows[setup].seeds_needed

        def p(k: int) -> float:
            return scipy.stats.ttest_ind_from_stats(
                gap, stds[0], k, 0.0, stds[1], k, equal_var=False
            ).pvalue

        assert n is not None and p(n) < 0.05 and (n == 2 or p(n - 1) >= 0.05)


def test_track3_credits_a_shorter_schedule_in_the_pairwise_rule(tmp_path: Path) -> None:
    config = _config(tmp_path, step_fractions=(0.7,), rule="track3")
    groups = run_compare(
        config, resolve=fake_resolve, launch=ScheduleTrainer(), say=lambda line: None
    )
    rows = {row.setup: row for row in build_leaderboard(groups, config).rows}
    short = rows["soap@0.7"]
    assert short.steps == 70 and short.pairwise.credit == pytest.approx(0.0045 * 30 / 100)
    expected = (np.mean(FINALS["adamw"]) - (np.mean(FINALS["soap"]) + 0.03 - 0.00135)) / math.sqrt(
        2 / 3
    )
    assert short.pairwise.statistic == pytest.approx(expected)


def test_track3_refuses_seeds_that_stopped_at_different_steps(tmp_path: Path) -> None:
    config = _config(tmp_path, rule="track3")
    groups, _ = _run(config, FakeTrainer())
    runs = list(groups["soap"])
    runs[1] = dataclasses.replace(runs[1], total_steps=90)
    groups = {**groups, "soap": runs}
    # The report refuses a group of mixed lengths under either rule, before the rule sees it.
    for rule_config in (config, _config(tmp_path)):
        with pytest.raises(
            ValueError,
            match=r"group 'soap' mixes runs of different lengths "
            r"\(90 steps: .*; 100 steps: ",
        ):
            build_leaderboard(groups, rule_config)


def test_an_unknown_rule_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rule: must be one of"):
        _config(tmp_path, rule="ttest")


def write_ended_run(directory: Path, config: dict[str, object]) -> Path:
    """A compare manifest and a finished JSONL log, run id ``old``, of ``config``."""
    directory.mkdir()
    (directory / "old.compare.json").write_text(json.dumps({"config": config, "nproc": 1}))
    records = [
        {"kind": "config", "run_id": "old", "seed": 0, "world_size": 1, "config": config},
        {
            "kind": "final",
            "step": 300,
            "total_steps": 300,
            "val_loss": 4.3,
            "train_time_ms": 1.0,
            "step_avg_ms": 1.0,
            "peak_memory_mib": 1.0,
        },
    ]
    (directory / "old.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


@pytest.mark.parametrize(
    "old_key, new_key, value, why",
    [
        ("muon_lr", "muon.lr", 0.02, "muon_lr is now muon.lr"),
        ("distributor", "distributor.kind", "auto", "distributor is now distributor.kind"),
        ("compile", "compile", False, 'compile False is now "false"'),
    ],
)
def test_a_run_logged_in_an_old_spelling_is_not_reused_and_one_line_says_why(
    old_key: str,
    new_key: str,
    value: object,
    why: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from nanoshampoo.evidence.compare import find_reusable, resolve_train_config

    resolved = resolve_train_config(["--preset", "tiny-muon", "--seed", "0", "--compile", "false"])
    same = find_reusable(write_ended_run(tmp_path / "now", resolved), resolved, 1)
    assert same is not None and same.run_id == "old"  # the same run in today's spelling is
    old = {k: v for k, v in resolved.items() if k != new_key} | {old_key: value}
    directory = write_ended_run(tmp_path / "before", old)
    capsys.readouterr()
    assert find_reusable(directory, resolved, 1, compare_defaults()) is None
    assert capsys.readouterr().err == (
        f"[compare] not reusing {directory / 'old.compare.json'}: it spells the config as "
        f"before ({why}); training it again\n"
    )


def compare_defaults() -> dict[str, object]:
    from nanoshampoo.evidence.compare import train_config_defaults

    return train_config_defaults()
