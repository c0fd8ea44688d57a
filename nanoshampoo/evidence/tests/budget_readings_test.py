"""The leaderboard's speedups off the baseline's fitted curve: runs whose decay branches follow a
known power law, with each setup a known multiple of the baseline's budget, read back as that
multiple (or as a bound beyond the fitted range), and the mid-run steps to target labelled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from compare_test import FakeTrainer, _config, _run

from nanoshampoo.evidence import budget_readings, leaderboard
from nanoshampoo.evidence.budget_readings import FITTED_SIZE
from nanoshampoo.evidence.leaderboard import build_leaderboard
from nanoshampoo.evidence.logs import read_run

# L(D) = A * D^-ALPHA + C in steps; each setup reaches the baseline's loss at SPEEDUP x D.
A, ALPHA, C = 6.0, 0.5, 3.0
SPEEDUP = {"adamw": 1.0, "shampoo": 1.5, "soap": 0.8}
FRACTIONS = (0.125, 0.25, 0.5)


def law(steps: float) -> float:
    return A * steps**-ALPHA + C


class CurveTrainer(FakeTrainer):
    """FakeTrainer's runs with branches at FRACTIONS of 100 steps and a final loss from ``law``
    at the setup's multiple of the budget, plus 1e-4 per seed (a spread for the intervals)."""

    def __call__(self, command: list[str], output: Path) -> int:
        code = super().__call__(command, output)
        out_dir = Path(command[command.index("--out-dir") + 1])
        log = out_dir / f"{command[command.index('--run-id') + 1]}.jsonl"
        setup, seed = out_dir.name, int(command[command.index("--seed") + 1])
        records = [json.loads(line) for line in log.read_text().splitlines()]
        loss = {
            steps: law(SPEEDUP[setup] * steps) + 1e-4 * seed
            for steps in (round(f * 100) for f in (*FRACTIONS, 1.0))
        }
        records[-1]["val_loss"] = loss[100]
        records[-1:-1] = [
            {
                "kind": "branch",
                "fraction": f,
                "steps": round(f * 100),
                "fork_step": round(f * 30),
                "val_loss": loss[round(f * 100)],
                "train_time_ms": 1.0,
                "tokens": 64 * round(f * 100),
            }
            for f in FRACTIONS
        ]
        log.write_text("".join(json.dumps(r) + "\n" for r in records))
        return code


def test_speedups_off_the_fitted_curve_are_the_known_multiples(tmp_path: Path) -> None:
    config = _config(tmp_path)
    groups, _ = _run(config, CurveTrainer())
    board = build_leaderboard(groups, config)
    assert board.fitted is not None and board.fitted_note == ""
    fit = board.fitted.fit(FITTED_SIZE)
    assert fit.tokens == (12, 25, 50, 100)
    # The seeds add 1e-4 on average: the floor moves by that, the shape not at all.
    assert (fit.alpha, fit.c) == (pytest.approx(ALPHA, rel=1e-6), pytest.approx(C + 1e-4, abs=1e-8))
    by_cell = {(s.setup, s.tokens): s for s in board.fitted.speedups}
    for steps in (12, 25, 50):  # 1.5 x steps <= 100: inside the fitted range
        assert by_cell[("shampoo", steps)].kind == "measured"
        assert by_cell[("shampoo", steps)].value == pytest.approx(1.5, rel=1e-4)
    # At 100 steps shampoo's loss is below the baseline's best measured one: only a bound.
    assert by_cell[("shampoo", 100)].kind == "above"
    assert by_cell[("shampoo", 100)].value == pytest.approx(1.0)
    for steps in (25, 50, 100):  # 0.8 x steps >= 12
        assert by_cell[("soap", steps)].value == pytest.approx(0.8, rel=1e-4)
    assert by_cell[("soap", 12)].kind == "below"  # 0.8 x 12 < 12: above the fitted range
    text = leaderboard.format_leaderboard(board)
    assert "## Speedup off adamw's fitted loss-versus-budget curve" in text
    assert "steps to target (mid-run)" in text
    section = text.split("## Speedup off adamw's fitted loss-versus-budget curve")[1]
    row = next(line for line in section.splitlines() if line.startswith("| shampoo "))
    assert "1.50×" in row and "> 1.00×" in row


def test_fewer_than_four_budgets_say_why_there_is_no_fit(tmp_path: Path) -> None:
    class TwoBranches(CurveTrainer):
        def __call__(self, command: list[str], output: Path) -> int:
            code = super().__call__(command, output)
            log = Path(command[command.index("--out-dir") + 1]) / (
                f"{command[command.index('--run-id') + 1]}.jsonl"
            )
            kept = [
                line for line in log.read_text().splitlines() if '"fraction": 0.125' not in line
            ]
            log.write_text("\n".join(kept) + "\n")
            return code

    config = _config(tmp_path)
    groups, _ = _run(config, TwoBranches())
    board = build_leaderboard(groups, config)
    assert board.fitted is None
    assert board.fitted_note.startswith("the baseline's runs give 3 budget(s); the fit needs 4")
    assert "No fit: the baseline's runs give 3 budget(s)" in leaderboard.format_leaderboard(board)


def test_the_model_scale_is_stated_from_the_runs_own_config(tmp_path: Path) -> None:
    config_record = {
        "kind": "config",
        "run_id": "r",
        "seed": 0,
        "preset": "tiny-adamw",
        "optimizer": "adamw",
        "world_size": 1,
        "config": {"model": "tiny", "batch_size": 16, "seq_len": 128},
    }
    final = {
        "kind": "final",
        "step": 300,
        "total_steps": 300,
        "val_loss": 4.3,
        "train_time_ms": 1.0,
        "step_avg_ms": 1.0,
        "peak_memory_mib": 1.0,
    }
    log = tmp_path / "r.jsonl"
    log.write_text(
        json.dumps(config_record)
        + "\n"
        + json.dumps(dict(final, kind="val"))
        + "\n"
        + json.dumps(final)
        + "\n"
    )
    # tiny: 4 blocks of 12 * 128^2 weights + biases and gains, plus the final norm (gpt_test).
    params = (
        4
        * (128 * 384 + 384 + 128 * 128 + 128 + 128 * 512 + 512 + 512 * 128 + 128 + 2 * 128 + 2 * 32)
        + 128
    )
    assert params == 792448
    assert budget_readings.model_scale([read_run(log)]) == (
        "model tiny: 792k non-embedding parameters; 300 steps x 2048 tokens = 614k tokens, "
        f"{300 * 2048 / params:.2g} per parameter"
    )
