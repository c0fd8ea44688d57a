"""nanoshampoo tune: grids and random trials, equal budgets, reuse, the files it writes, and
compare --tune."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any

import pytest
from compare_test import _flag, fake_resolve

from nanoshampoo.cli import main
from nanoshampoo.evidence.compare import Setup
from nanoshampoo.evidence.tune import TuneConfig, parse_search, trial_points, tune


# The fake loss: a parabola in log10(lr) with its minimum at lr = 0.02, plus 0.001 per seed.
def fake_loss(lr: float, seed: int) -> float:
    return 4.0 + (math.log10(lr) - math.log10(0.02)) ** 2 + 0.001 * seed


class LrTrainer:
    """A launcher whose run ends at ``fake_loss(--muon.lr, --seed)``."""

    def __init__(self) -> None:
        self.launched: list[list[str]] = []

    def __call__(self, command: list[str], output: Path) -> int:
        self.launched.append(command)
        out_dir, run_id = Path(_flag(command, "--out-dir")), _flag(command, "--run-id")
        seed, steps = int(_flag(command, "--seed")), int(_flag(command, "--num-iterations"))
        lr = float(_flag(command, "--muon.lr")) if "--muon.lr" in command else 0.05
        output.write_text("ok\n")
        records: list[dict[str, Any]] = [
            {"kind": "config", "run_id": run_id, "seed": seed, "world_size": 1, "config": {}},
            {"kind": "final", "step": steps, "total_steps": steps, "val_loss": fake_loss(lr, seed),
             "train_time_ms": 10.0 * steps, "step_avg_ms": 10.0, "peak_memory_mib": 1.0}]
        (out_dir / f"{run_id}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return 0


def typed_resolve(argv: list[str]) -> dict[str, Any]:
    resolved = fake_resolve(argv)
    return {("muon.lr" if k == "muon.lr" else k): (float(v) if k == "muon.lr" else v)
            for k, v in resolved.items()}


def config(tmp_path: Path, search: str = "muon.lr=0.005,0.01,0.02,0.04", **overrides: Any
           ) -> TuneConfig:
    fields: dict[str, Any] = dict(setup=Setup("muon", "tiny-muon"),
                                  searches=(parse_search(search),), out_dir=tmp_path / "tune",
                                  train_args=("--num-iterations", "50"), seeds=2)
    fields.update(overrides)
    return TuneConfig(**fields)


def test_a_grid_trains_every_point_at_the_same_budget_and_picks_the_best(tmp_path: Path) -> None:
    trainer = LrTrainer()
    result = tune(config(tmp_path, confirm_seeds=3), typed_resolve, trainer, lambda line: None)
    assert [t.name for t in result.trials] == ["lr0.005", "lr0.01", "lr0.02", "lr0.04"]
    assert {_flag(c, "--num-iterations") for c in trainer.launched} == {"50"}
    for trial in result.trials:
        lr = float(trial.values["muon.lr"])
        assert trial.finals == (fake_loss(lr, 0), fake_loss(lr, 1))
        assert trial.score == pytest.approx((fake_loss(lr, 0) + fake_loss(lr, 1)) / 2)
    assert result.best == "lr0.02" and result.edge_warnings == ()
    # The confirmation reuses the two seeds and trains one more.
    assert result.confirm_finals == tuple(fake_loss(0.02, s) for s in range(3))
    assert len(trainer.launched) == 4 * 2 + 1
    preset = tomllib.loads(Path(result.preset_file).read_text())
    assert preset == {"extends": "tiny-muon", "muon": {"lr": 0.02}}
    files = {p.name for p in (tmp_path / "tune").iterdir()}
    assert {"tuning.md", "tuning.json", "tuned-muon.toml", "trials"} <= files
    data = json.loads((tmp_path / "tune" / "tuning.json").read_text())
    assert data["best"] == "lr0.02" and len(data["trials"]) == 4
    assert "| lr0.02 (best) | 0.02    | 4.0000, 4.0010          | 4.0005 |" in (
        tmp_path / "tune" / "tuning.md").read_text()


def test_a_best_value_on_the_grids_edge_is_warned_about(tmp_path: Path) -> None:
    result = tune(config(tmp_path, search="muon.lr=0.001,0.002,0.004"), typed_resolve,
                  LrTrainer(), lambda line: None)
    assert result.best == "lr0.004"
    assert result.edge_warnings == ("muon.lr = 0.004 is on the edge of the values tried: the "
                                    "optimum may lie beyond it; widen the search",)
    assert "**Warning**: muon.lr = 0.004" in (tmp_path / "tune" / "tuning.md").read_text()


def test_a_second_tune_reuses_every_finished_trial(tmp_path: Path) -> None:
    tune(config(tmp_path), typed_resolve, LrTrainer(), lambda line: None)
    again = LrTrainer()
    tune(config(tmp_path, search="muon.lr=0.005,0.01,0.02,0.04,0.08"), typed_resolve, again,
         lambda line: None)
    assert [_flag(c, "--muon.lr") for c in again.launched] == ["0.08", "0.08"]


def test_random_trials_are_log_uniform_in_the_range() -> None:
    points = trial_points([parse_search("muon.lr=log:0.001:0.1")], trials=200, sample_seed=3)
    logs = [math.log10(float(p.values["muon.lr"])) for p in points]
    assert all(-3 <= x <= -1 for x in logs)
    # Log-uniform: about half the points below the geometric middle 0.01.
    assert 70 < sum(x < -2 for x in logs) < 130
    assert points == trial_points([parse_search("muon.lr=log:0.001:0.1")], 200, 3)


@pytest.mark.parametrize("search, trials, message", [
    ("num_iterations=10,20", None, "sets the budget"),
    ("muon.lr", None, "expected KEY="),
    ("--muon.lr=0.1", None, "a field name"),
    ("muon.lr=log:0.1:0.01", 3, "0 < LO < HI"),
    ("muon.lr=log:0.01:0.1", None, "needs --trials"),
    ("muon.lr=0.1,0.1", None, "repeated"),
    ("muon.lr=0.1,0.2", 4, "a grid runs every point"),
])
def test_bad_searches_are_refused(search: str, trials: int | None, message: str,
                                  tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        config(tmp_path, search=search, trials=trials)


def test_compare_tune_needs_an_equal_budget_for_every_setup(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    head = ["compare", "--setups", "adamw,muon", "--out-dir", str(tmp_path / "c")]
    tail = ["--", "--num-iterations", "2"]
    unequal = ["--tune", "adamw:adamw.lr=0.001,0.003", "--tune", "muon:muon.lr=0.01,0.02,0.04"]
    assert main([*head, *unequal, *tail]) == 2
    assert "same number of trials" in capsys.readouterr().err
    assert main([*head, "--tune", "muon:muon.lr=0.01,0.02", *tail]) == 2
    assert "give every compared setup" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()  # refused before anything trained


@pytest.mark.slow
def test_compare_tune_on_a_tiny_budget_end_to_end(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Real runs: AdamW and Muon tuned over two lrs each, then compared at the tuned presets."""
    out = tmp_path / "c"
    argv = ["compare", "--setups", "adamw,muon", "--seeds", "2", "--out-dir", str(out),
            "--rule", "track3", "--tune", "adamw:adamw.lr=0.003,0.01",
            "--tune", "muon:muon.lr=0.01,0.03", "--",
            "--num-iterations", "3", "--val-every", "1", "--val-tokens", "256", "--batch-size", "2",
            "--seq-len", "64", "--autocast", "off", "--threads", "1"]
    assert main(argv) == 0
    board = json.loads((out / "leaderboard.json").read_text())
    assert board["rule"] == "track3"
    presets = [row["preset"] for row in board["rows"]]
    assert presets == [str(out / "tune" / s / f"tuned-{s}.toml") for s in ("adamw", "muon")]
    for setup, key in (("adamw", "adamw"), ("muon", "muon")):
        tuning = json.loads((out / "tune" / setup / "tuning.json").read_text())
        best = min(tuning["trials"], key=lambda t: t["score"])
        preset = tomllib.loads((out / "tune" / setup / f"tuned-{setup}.toml").read_text())
        assert preset[key]["lr"] == float(best["values"][f"{key}.lr"])
        # Seed 0 at the tuned point is the best trial's run (the same config): reused, and only
        # seed 1 trained for the comparison.
        trial_logs = sorted((out / "tune" / setup / "trials" / best["name"]).glob("*.jsonl"))
        assert len(trial_logs) == 1 and len(list((out / setup).glob("*.jsonl"))) == 1
        row = next(r for r in board["rows"] if r["setup"] == setup)
        assert row["final_val_loss"]["mean"] == pytest.approx(
            (best["finals"][0] + json.loads(next((out / setup).glob("*.jsonl")).read_text()
                                            .splitlines()[-1])["val_loss"]) / 2)
    assert all(row["seeds_needed"] is None or row["seeds_needed"] >= 2 for row in board["rows"])
    summary = (out / "tuning.md").read_text()
    for setup in ("adamw", "muon"):
        tuning = json.loads((out / "tune" / setup / "tuning.json").read_text())
        line = next(x for x in summary.splitlines() if x.startswith(f"| {setup} "))
        for trial in tuning["trials"]:
            assert f"{trial['values'][f'{setup}.lr']}: {trial['score']:.4f}" in line
        assert f"{setup}.lr = {tuning['best_values'][f'{setup}.lr']}" in line
