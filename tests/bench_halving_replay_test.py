"""``bench/halving_replay.py``: successive halving replayed on a full grid's records keeps the
trials, picks the point and counts the steps that synchronous halving does when it trains."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
from bench_scripts_test import load_script

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "nanoshampoo" / "evidence" / "tests") not in sys.path:  # tune_fixtures
    sys.path.insert(0, str(ROOT / "nanoshampoo" / "evidence" / "tests"))

from tune_fixtures import fake_command, fake_resolve  # noqa: E402

from nanoshampoo.evidence.compare import Setup  # noqa: E402
from nanoshampoo.evidence.tune import TuneConfig, parse_search, tune  # noqa: E402
from nanoshampoo.train.branches import fork_step  # noqa: E402

replay_bench = load_script("halving_replay.py")
grid_bench = load_script("pruning_vs_grid.py")


def trial(number: int, value: float, *rungs: float) -> dict[str, Any]:
    steps = (16, 32, 64)
    return {
        "number": number,
        "state": "complete",
        "params": {"lr": str(number)},
        "value": value,
        "rungs": {str(s): v for s, v in zip(steps, rungs)},
    }


def test_a_flip_after_the_first_rung_prunes_the_grids_best() -> None:
    # Trial 4 is best at the end but last at 16 steps; trials 0-3 lead the first rung.
    trials = [
        trial(0, 4.90, 6.0, 5.5, 5.20),
        trial(1, 4.95, 6.1, 5.4, 5.10),
        trial(2, 4.85, 6.2, 5.6, 5.00),
        trial(3, 4.99, 6.3, 5.3, 5.30),
        trial(4, 4.70, 6.9, 5.0, 4.90),
    ]
    at = replay_bench.replay(trials, [16, 32, 64], eta=2)
    assert at == [[0, 1, 2, 3, 4], [0, 1], [1], [1]]
    forks, steps = [5, 10, 19], [16, 32, 64]
    # 5 x 16 + 2 x ((10 - 5) + (32 - 10)) + 1 x ((19 - 10) + (64 - 19)) + 1 x (128 - 19)
    assert replay_bench.halved_steps(at, forks, steps, 128) == 80 + 54 + 54 + 109
    result = replay_bench.cell_result(
        {"study": "s.x", "size": "s", "setup": "x", "trials": trials}, 0.01, (0.125, 0.25, 0.5),
        128, forks,
    )  # fmt: skip
    assert result["grid_best"] == {"lr": "4"} and result["pick"] == {"lr": "1"}
    assert result["gap"] == pytest.approx(0.25) and not result["within_noise"]
    assert result["compute_share"] == pytest.approx(297 / 640)
    assert result["kept"] == [5, 2, 1, 1]


def test_a_grid_that_was_halved_cannot_be_replayed() -> None:
    pruned = [trial(0, 4.9, 6.0, 5.5, 5.2), trial(1, 4.8, 6.1, 5.4, 5.1) | {"state": "pruned"}]
    with pytest.raises(SystemExit, match="s.x: trials that did not complete"):
        replay_bench.cell_result(
            {"study": "s.x", "size": "s", "setup": "x", "trials": pruned}, 0.01, (0.5,), 8, [3]
        )


def test_a_failed_trial_that_ran_again_is_replayed_as_its_retry() -> None:
    trials = [trial(0, 4.90, 6.0, 5.5, 5.2), trial(1, 4.80, 6.1, 5.4, 5.1)]
    killed = trial(1, 0.0) | {"state": "fail", "value": None, "rungs": {}}
    retried = [trials[0], killed, trial(2, 4.80, 6.1, 5.4, 5.1) | {"params": {"lr": "1"}}]
    cells = [
        replay_bench.cell_result(
            {"study": "s.x", "size": "s", "setup": "x", "trials": grid},
            0.01,
            (0.125, 0.25, 0.5),
            128,
            [5, 10, 19],
        )  # fmt: skip
        for grid in (trials, retried)
    ]
    assert cells[0] == cells[1]
    alone = [trials[0], killed | {"params": {"lr": "9"}}]
    with pytest.raises(SystemExit, match="s.x: trials that did not complete"):
        replay_bench.cell_result(
            {"study": "s.x", "size": "s", "setup": "x", "trials": alone}, 0.01, (0.5,), 8, [3]
        )


def test_the_replay_is_what_synchronous_halving_trains(tmp_path: Path) -> None:
    lrs = "muon.lr=0.002,0.005,0.01,0.02,0.04,0.1,0.3"
    results = {}
    for halving in ("off", "sync"):
        config = TuneConfig(
            Setup("muon", "tiny-muon"),
            (parse_search(lrs),),
            out_dir=tmp_path / halving,
            train_args=("--num-iterations", "16"),
            rungs=(0.25, 0.5),
            halving=halving,
            poll_s=0.02,
        )
        results[halving] = tune(config, fake_resolve, fake_command, lambda line: None)
    grid = sorted(results["off"].trials, key=lambda t: t.number)
    records = [
        {"number": t.number, "state": t.state, "params": t.params, "value": t.value,
         "rungs": {str(s): v for s, v in t.rungs.items()}}
        for t in grid
    ]  # fmt: skip
    at = replay_bench.replay(records, [4, 8], eta=2)
    halved = results["sync"]
    assert grid[at[-1][0]].params == halved.best_values
    # The trials that reached each rung: those whose run recorded that rung's branch.
    for k, steps in enumerate((4, 8)):
        reached = {t.params["muon.lr"] for t in halved.trials if steps in t.rungs}
        assert reached == {grid[i].params["muon.lr"] for i in at[k]}
    forks = [fork_step(s, 16, 0.5, 0) for s in (4, 8)]
    counted = grid_bench.study_steps(tmp_path / "sync")
    assert replay_bench.halved_steps(at, forks, [4, 8], 16) == counted


def test_a_tunes_grid_replays_from_its_tuning_json(tmp_path: Path) -> None:
    # A `tune --halving off --rungs ... --confirm-seeds 3` grid: its tuning.json is a cell whose
    # noise is the std of the confirming seeds' finals, and whose replay is the study's.
    config = TuneConfig(
        Setup("muon", "tiny-muon"),
        (parse_search("muon.lr=0.002,0.01,0.04,0.3"),),
        out_dir=tmp_path,
        train_args=("--num-iterations", "16"),
        rungs=(0.25, 0.5),
        halving="off",
        confirm_seeds=3,
        poll_s=0.02,
    )
    result = tune(config, fake_resolve, fake_command, lambda line: None)
    tuning = json.loads((tmp_path / "tuning.json").read_text())
    cell = replay_bench.tuning_cell(tuning, tmp_path / "tuning.json")
    assert cell.noise == pytest.approx(statistics.stdev(result.confirm_finals), abs=1e-12)
    assert cell.preset == "tiny-muon" and cell.tune["size"] == "tiny"
    replayed = replay_bench.measure([cell], [(0.25, 0.5)], grids=True)
    measured = replayed["results"][0]
    assert [t["value"] for t in replayed["grids"][0]["trials"]] == [
        t.value for t in sorted(result.trials, key=lambda t: t.number)
    ]
    records = sorted(cell.tune["trials"], key=lambda t: t["number"])
    at = replay_bench.replay(records, [4, 8], eta=2)
    assert measured["kept"] == [len(a) for a in at] and measured["num_iterations"] == 16
    best = min(result.trials, key=lambda t: (t.value, t.number))
    assert measured["grid_best"] == best.params
    with pytest.raises(SystemExit, match="tuning.json: the noise needs"):
        replay_bench.tuning_cell(tuning | {"confirm_finals": [4.0]}, tmp_path / "tuning.json")
