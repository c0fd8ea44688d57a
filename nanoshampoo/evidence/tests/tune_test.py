"""nanoshampoo tune on Optuna: a grid runs every point once, TPE over ranges, successive halving
that sees only decay branches, a finished study read back without training, kwargs entries,
the files it writes, and compare --tune.

The trainer is ``fake_trainer.py`` (a real subprocess, launched and followed as the real one
is), whose losses are known in closed form (``tune_fixtures.fake_loss``).
"""

from __future__ import annotations

import io
import itertools
import json
import math
import tomllib
import wsgiref.util
from pathlib import Path
from typing import Any

import optuna
import pytest
from tune_fixtures import fake_command, fake_loss, fake_resolve

from nanoshampoo.cli import main
from nanoshampoo.evidence.compare import Setup, resolve_train_config
from nanoshampoo.evidence.logs import read_run
from nanoshampoo.evidence.tune import TuneConfig, TuneSession, parse_search, tune
from nanoshampoo.evidence.tune_report import TrialResult, TuneResult, edge_keys


def config(tmp_path: Path, *searches: str, **overrides: Any) -> TuneConfig:
    fields: dict[str, Any] = dict(
        setup=Setup("muon", "tiny-muon"),
        searches=tuple(parse_search(s) for s in searches or ("muon.lr=0.005,0.01,0.02,0.04",)),
        out_dir=tmp_path / "tune",
        train_args=("--num-iterations", "8"),
        seeds=1,
        poll_s=0.02,
    )
    fields.update(overrides)
    return TuneConfig(**fields)


def run(config: TuneConfig, lines: list[str] | None = None) -> TuneResult:
    return tune(config, fake_resolve, fake_command, (lines if lines is not None else []).append)


def manifests(out_dir: Path, kind: str = "*") -> list[dict[str, Any]]:
    """What every run that tune started was asked for (one manifest per launched run; kind
    ``compare`` for the runs that may be reused, ``pruned`` for those stopped)."""
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob(f"trials/*/*/*.{kind}.json"))]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def records(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def study_of(result: TuneResult, out_dir: Path) -> optuna.Study:
    return optuna.load_study(study_name=result.study, storage=f"sqlite:///{out_dir}/study.db")


def test_a_grid_trains_every_point_once_at_the_same_budget_and_picks_the_best(
    tmp_path: Path,
) -> None:
    lrs, wds = ("0.005", "0.01", "0.02", "0.04"), ("0.0", "0.1")
    result = run(
        config(
            tmp_path,
            f"muon.lr={','.join(lrs)}",
            f"muon.weight_decay={','.join(wds)}",
            confirm_seeds=2,
        )
    )
    points = sorted((t.params["muon.lr"], t.params["muon.weight_decay"]) for t in result.trials)
    assert points == sorted(itertools.product(lrs, wds))  # every point, none twice
    assert {t.state for t in result.trials} == {"complete"}
    for trial in result.trials:
        lr, wd = float(trial.params["muon.lr"]), float(trial.params["muon.weight_decay"])
        assert trial.value == fake_loss(lr, wd, 0) and trial.finals == (fake_loss(lr, wd, 0),)
        assert trial.rungs == {}
    runs = manifests(tmp_path / "tune")
    assert len(runs) == 8 + 1  # the grid at seed 0, then the best point's seed 1
    assert {flag(r["argv"], "--num-iterations") for r in runs} == {"8"}
    assert result.best_values == {"muon.lr": "0.02", "muon.weight_decay": "0.1"}
    assert result.best_value == fake_loss(0.02, 0.1, 0)
    assert result.edge_warnings == (
        "muon.weight_decay = 0.1 is on the edge of the values tried: "
        "the optimum may lie beyond it; widen the search",
    )
    assert result.confirm_finals == (fake_loss(0.02, 0.1, 0), fake_loss(0.02, 0.1, 1))
    # Each confirming seed's own log: seed 0 the best trial's run, seed 1 the confirmation's.
    confirmed = [read_run(log) for log in result.confirm_logs]
    assert [(r.seed, r.final_val_loss) for r in confirmed] == [
        (0, fake_loss(0.02, 0.1, 0)),
        (1, fake_loss(0.02, 0.1, 1)),
    ]
    values = [fake_loss(float(lr), float(wd), 0) for lr, wd in itertools.product(lrs, wds)]
    within = sum(v <= 1.01 * min(values) for v in values)
    assert (result.tunability.within, result.tunability.trials) == (within, 8) and within == 2
    preset = tomllib.loads(Path(result.preset_file).read_text())
    assert preset == {"extends": "tiny-muon", "muon": {"lr": 0.02, "weight_decay": 0.1}}
    data = json.loads((tmp_path / "tune" / "tuning.json").read_text())
    assert data["best"] == result.best and len(data["trials"]) == 8
    assert data["tunability"] == {"trials": 8, "within": 2, "best": min(values), "tolerance": 0.01}
    best_row = next(
        line
        for line in (tmp_path / "tune" / "tuning.md").read_text().splitlines()
        if "(best)" in line
    )
    assert "| complete | 0.02    | 0.1               | 4.0000" in best_row
    assert (
        "Tunability: 2 of 8 trials (25 %) are within 1 % of the best"
        in (tmp_path / "tune" / "tuning.md").read_text()
    )


@pytest.mark.parametrize(
    "searches, best, expected",
    [
        # A numeric grid's edges are its smallest and largest values, in any order given.
        (["muon.lr=0.001,0.004,0.002"], {"muon.lr": "0.004"}, ["muon.lr"]),
        (["muon.lr=0.02,0.005,0.04"], {"muon.lr": "0.02"}, []),
        (["muon.lr=0.02,0.005,0.04"], {"muon.lr": "0.005"}, ["muon.lr"]),
        # A grid of names has no edge; a single value is no search.
        (["shampoo.root_method=eigh,warm-qr"], None, []),
        (["muon.lr=0.01"], {"muon.lr": "0.01"}, []),
        # A range: the smallest or largest sample of the trials.
        (["muon.lr=log:0.001:0.1"], {"muon.lr": "0.05"}, []),
        (["muon.lr=log:0.001:0.1"], {"muon.lr": "0.09"}, ["muon.lr"]),
    ],
)
def test_the_edge_is_the_smallest_or_largest_number_tried(
    searches: list[str], best: dict[str, str] | None, expected: list[str]
) -> None:
    parsed = [parse_search(text) for text in searches]
    if best is None:
        best = {parsed[0].key: parsed[0].values[0]}
    samples = ("0.002", "0.05", "0.09")
    trials = [
        TrialResult(i, f"t{i:03d}", "complete", {s.key: v for s in parsed}, 1.0)
        for i, v in enumerate(samples if parsed[0].is_range else parsed[0].values)
    ]
    best_trial = TrialResult(99, "t099", "complete", best, 0.5)
    assert edge_keys(parsed, [*trials, best_trial], best_trial) == expected


def test_a_best_value_on_the_grids_edge_is_warned_about(tmp_path: Path) -> None:
    result = run(config(tmp_path, "muon.lr=0.001,0.002,0.004"))
    assert result.best_values == {"muon.lr": "0.004"}
    assert result.edge_warnings == (
        "muon.lr = 0.004 is on the edge of the values tried: the "
        "optimum may lie beyond it; widen the search",
    )
    assert "**Warning**: muon.lr = 0.004" in (tmp_path / "tune" / "tuning.md").read_text()


def test_a_finished_study_is_read_back_and_nothing_trains(tmp_path: Path) -> None:
    first = run(config(tmp_path))
    launched = len(manifests(tmp_path / "tune"))
    lines: list[str] = []
    again = run(config(tmp_path), lines)
    assert len(manifests(tmp_path / "tune")) == launched == 4
    assert lines == [
        f"[tune] muon: study {first.study} in sqlite:///{tmp_path}/tune/study.db: 4 "
        "trials (grid 4), 1 seed(s) each: 4 complete, 0 pruned, 0 failed, "
        "0 running, 0 queued, 0 to run"
    ]
    assert again == first


def test_a_grown_grid_is_a_new_study_that_reuses_the_ended_runs(tmp_path: Path) -> None:
    first = run(config(tmp_path, "muon.lr=0.01,0.02"))
    lines: list[str] = []
    grown = run(config(tmp_path, "muon.lr=0.01,0.02,0.04"), lines)
    assert grown.study != first.study
    new = manifests(tmp_path / "tune")[2:]
    assert [flag(r["argv"], "--muon.lr") for r in manifests(tmp_path / "tune")].count("0.04") == 1
    assert len(new) == 1 and sum(line.startswith("[tune] reused") for line in lines) == 2


def test_a_named_study_made_by_another_command_is_refused_before_anything_trains(
    tmp_path: Path,
) -> None:
    first = run(config(tmp_path, "muon.lr=0.01,0.02", study="mine"))
    launched = manifests(tmp_path / "tune")
    changed = config(tmp_path, "muon.lr=0.01,0.02,0.04", study="mine")
    message = (
        f"--study mine: sqlite:///{tmp_path}/tune/study.db holds a study of this name made by "
        "another command (its preset, train flags, search, rungs or seeds differ); give a new "
        "--study name or --out-dir"
    )
    session = TuneSession(changed, fake_resolve, fake_command, lambda line: None)
    with pytest.raises(ValueError) as error:
        session.check_store()  # reads the store, creates nothing
    assert str(error.value) == message
    with pytest.raises(ValueError) as error:
        run(changed)
    assert str(error.value) == message
    assert manifests(tmp_path / "tune") == launched  # nothing trained, nothing mixed in
    stored = study_of(first, tmp_path / "tune")
    assert stored.user_attrs["definition"] == config(tmp_path, "muon.lr=0.01,0.02").definition
    assert len(stored.trials) == 2
    # The same command again reads its study back.
    assert run(config(tmp_path, "muon.lr=0.01,0.02", study="mine")) == first


def test_check_store_creates_no_store(tmp_path: Path) -> None:
    session = TuneSession(config(tmp_path), fake_resolve, fake_command, lambda line: None)
    session.check_store()
    assert not (tmp_path / "tune").exists()


def test_ranges_are_searched_by_tpe_reproducibly(tmp_path: Path) -> None:
    searches = ("muon.lr=log:0.001:0.1", "muon.weight_decay=log:0.01:1")
    a = run(config(tmp_path / "a", *searches, trials=5))
    b = run(config(tmp_path / "b", *searches, trials=5))
    assert len(a.trials) == 5 and {t.state for t in a.trials} == {"complete"}
    for trial in a.trials:
        lr, wd = float(trial.params["muon.lr"]), float(trial.params["muon.weight_decay"])
        assert 0.001 <= lr <= 0.1 and 0.01 <= wd <= 1
        assert trial.value == fake_loss(lr, wd, 0)  # the sampled value is the value trained
    assert [t.params for t in a.trials] == [t.params for t in b.trials]  # seeded per trial
    assert len({t.params["muon.lr"] for t in a.trials}) == 5


def test_the_trials_of_a_narrow_range_keep_names_of_their_own(tmp_path: Path) -> None:
    # Before: names from the values rounded to 4 digits, so these were "setups given twice".
    result = run(config(tmp_path, "muon.lr=log:0.02:0.0200001", trials=3))
    assert sorted(t.name for t in result.trials) == ["t000", "t001", "t002"]
    assert {t.state for t in result.trials} == {"complete"}
    assert len({t.params["muon.lr"] for t in result.trials}) == 3


def successive_halving(branch_values: list[list[float]], eta: int) -> list[int]:
    """The rungs each trial passes, trials in order, by the rule written out: at a rung, a
    trial goes on when its value is at most the ``max(1, n // eta)``-th smallest of the n
    values recorded there so far (its own included)."""
    seen: list[list[float]] = [[] for _ in branch_values[0]]
    passed = []
    for values in branch_values:
        rung = 0
        for rung, value in enumerate(values):
            seen[rung].append(value)
            if value > sorted(seen[rung])[max(1, len(seen[rung]) // eta) - 1]:
                break
        else:
            rung = len(values)
        passed.append(rung)
    return passed


def test_asynchronous_halving_prunes_on_decay_branches_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "0.15")  # slow enough to be stopped mid-run
    lrs = ("0.002", "0.005", "0.01", "0.02", "0.04", "0.1")
    result = run(config(tmp_path, f"muon.lr={','.join(lrs)}", rungs=(0.25, 0.5), halving="async"))
    trials = sorted(result.trials, key=lambda t: t.number)
    fractions = {2: 0.25, 4: 0.5}  # 8 steps: the branches end at 2 and 4 steps
    expected = successive_halving(
        [
            [fake_loss(float(t.params["muon.lr"]), 0.0, 0, f) for f in fractions.values()]
            for t in trials
        ],
        eta=2,
    )
    for trial, passed in zip(trials, expected):
        lr = float(trial.params["muon.lr"])
        # Every value the pruner saw is a branch's: its steps and its closed-form loss.
        assert trial.rungs == {
            s: fake_loss(lr, 0.0, 0, f) for s, f in list(fractions.items())[: min(passed + 1, 2)]
        }
        assert trial.state == ("complete" if passed == 2 else "pruned")
        (run_manifest,) = [
            m
            for m in manifests(tmp_path / "tune")
            if flag(m["argv"], "--muon.lr") == trial.params["muon.lr"]
        ]
        assert flag(run_manifest["argv"], "--decay-branches") == "0.25,0.5"
        log = (
            tmp_path
            / "tune"
            / "trials"
            / result.study
            / trial.name
            / f"{Path(run_manifest['command'][-3]).name}.jsonl"
        )
        kinds = [r["kind"] for r in records(log)]
        assert ("final" in kinds) == (trial.state == "complete")  # a pruned run was stopped
        pruned = [m["argv"] for m in manifests(tmp_path / "tune", "pruned")]
        assert (run_manifest["argv"] in pruned) == (trial.state == "pruned")
    assert expected.count(2) < len(lrs) and result.best_values == {"muon.lr": "0.02"}
    # The same command again: the study is read back; the pruned trials stay pruned.
    launched = len(manifests(tmp_path / "tune"))
    assert (
        run(config(tmp_path, f"muon.lr={','.join(lrs)}", rungs=(0.25, 0.5), halving="async"))
        == result
    )
    assert len(manifests(tmp_path / "tune")) == launched
    # Another study of the same runs reuses the finished ones and trains the pruned again.
    other = run(
        config(
            tmp_path, f"muon.lr={','.join(lrs)}", rungs=(0.25, 0.5), halving="async", study="other"
        )
    )
    assert len(manifests(tmp_path / "tune")) - launched == expected.count(0) + expected.count(1)
    assert [t.state for t in sorted(other.trials, key=lambda t: t.number)] == [
        t.state for t in trials
    ]


def test_halving_off_trains_every_point_to_its_end_with_every_branch(tmp_path: Path) -> None:
    lrs = ("0.002", "0.01", "0.03", "0.1")
    # Rungs that no halving could use (not geometric): with halving off they are only branches.
    lines: list[str] = []
    result = run(
        config(tmp_path, f"muon.lr={','.join(lrs)}", rungs=(0.25, 0.75), halving="off"), lines
    )
    assert {t.state for t in result.trials} == {"complete"} and len(result.trials) == len(lrs)
    for trial in result.trials:
        lr = float(trial.params["muon.lr"])
        assert trial.rungs == {2: fake_loss(lr, 0.0, 0, 0.25), 6: fake_loss(lr, 0.0, 0, 0.75)}
        assert trial.value == fake_loss(lr, 0.0, 0, 1.0)
    assert not manifests(tmp_path / "tune", "pruned")
    assert all(
        flag(m["argv"], "--decay-branches") == "0.25,0.75" for m in manifests(tmp_path / "tune")
    )
    assert any("rungs 0.25,0.75 (decay branches recorded, no halving)" in line for line in lines)
    best = min(lrs, key=lambda lr: fake_loss(float(lr), 0.0, 0, 1.0))
    assert result.best_values == {"muon.lr": best}
    with pytest.raises(ValueError, match="rungs"):
        config(tmp_path, "muon.lr=0.01,0.02", rungs=(0.25, 0.75), halving="sync")


def test_synchronous_halving_continues_the_best_of_each_rung_from_its_pause(
    tmp_path: Path,
) -> None:
    lrs = ("0.002", "0.005", "0.01", "0.02", "0.04", "0.1")
    lines: list[str] = []
    result = run(config(tmp_path, f"muon.lr={','.join(lrs)}", rungs=(0.25, 0.5)), lines)
    # 8 steps, cooldown 0.5: the rungs' branches of 2 and 4 steps fork at steps 2 and 3.
    rung = {lr: [fake_loss(float(lr), 0.0, 0, f) for f in (0.25, 0.5)] for lr in lrs}
    first = sorted(lrs, key=lambda lr: rung[lr][0])[:3]  # 6 trials, eta 2: the best 3 go on
    second = sorted(first, key=lambda lr: rung[lr][1])[:1]  # then the best 1 of those 3
    assert len(result.trials) == len(lrs)  # one row per point: its last segment
    for trial in result.trials:
        lr = trial.params["muon.lr"]
        passed = 2 if lr in second else 1 if lr in first else 0
        assert trial.rungs == dict(list(zip((2, 4), rung[lr]))[: passed + 1])
        assert trial.state == ("complete" if passed == 2 else "pruned")
        if passed < 2:
            assert trial.note.startswith(f"paused at rung {(2, 4)[passed]} steps, not continued")
        # One run per point, in the trial's own directory: trained once, paused at each rung
        # it reached, resumed from its checkpoint there.
        (log,) = (tmp_path / "tune" / "trials" / result.study / trial.name).glob("*.jsonl")
        kinds = [r["kind"] for r in records(log)]
        assert kinds.count("config") == passed + 1
        assert kinds.count("paused") == min(passed + 1, 2)
        assert [r["steps"] for r in records(log) if r["kind"] == "branch"] == [2, 4][: passed + 1]
        assert (kinds[-1] == "final") == (passed == 2)
    assert result.best_values == {"muon.lr": second[0]} == {"muon.lr": "0.02"}
    # Training: 6 runs to step 2, 3 on to step 3, 1 on to step 8 (the branches' own cooldowns
    # beside them), where the grid trains 6 x 8 steps.
    assert len(manifests(tmp_path / "tune")) == len(lrs)
    assert sum("[tune] continue" in line for line in lines) == 3 + 1
    assert sum("[tune] promote" in line for line in lines) == 2
    # The same command again: the study is read back and nothing trains.
    outputs = sorted((tmp_path / "tune").rglob("*.out"))
    assert run(config(tmp_path, f"muon.lr={','.join(lrs)}", rungs=(0.25, 0.5))) == result
    assert sorted((tmp_path / "tune").rglob("*.out")) == outputs


def test_a_trial_whose_seeds_all_diverged_fails_and_is_no_candidate(tmp_path: Path) -> None:
    result = run(config(tmp_path, "muon.lr=0.02,1.5", seeds=2))
    diverged = next(t for t in result.trials if t.params["muon.lr"] == "1.5")
    assert diverged.state == "failed" and diverged.note == "every seed diverged"
    assert diverged.value is None and all(math.isnan(f) for f in diverged.finals)
    assert result.best_values == {"muon.lr": "0.02"}
    data = json.loads((tmp_path / "tune" / "tuning.json").read_text())
    assert next(t for t in data["trials"] if t["params"]["muon.lr"] == "1.5")["value"] is None


def test_a_crashed_trainer_stops_the_worker_and_its_trial_runs_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CRASH", "1")
    with pytest.raises(
        RuntimeError, match=r"muon t00\d .* seed 0 failed \(exit status 1\).*output"
    ):
        run(config(tmp_path, "muon.lr=0.01,0.02"))
    monkeypatch.delenv("FAKE_CRASH")
    result = run(config(tmp_path, "muon.lr=0.01,0.02"))
    complete = sorted(t.params["muon.lr"] for t in result.trials if t.state == "complete")
    assert complete == ["0.01", "0.02"]
    (crashed,) = [t for t in result.trials if t.state == "failed"]
    assert crashed.note == "no result (its worker stopped); retried as trial 1"


def test_a_kwargs_entry_is_searched_and_the_other_entries_stay(tmp_path: Path) -> None:
    """``custom.matrix_kwargs.lr`` through the real trainer's parser: every trial passes the
    setup's whole dict with its lr replaced, and the tuned preset holds the merged dict."""
    preset = tmp_path / "sgd.toml"
    preset.write_text(
        'extends = "tiny-adamw"\noptimizer = "custom"\n\n[custom]\n'
        'matrix_optimizer = "torch.optim:SGD"\n'
        "matrix_kwargs = {lr = 0.05, momentum = 0.9}\n"
    )
    cfg = config(
        tmp_path, "custom.matrix_kwargs.lr=0.01,0.02,0.04", setup=Setup("sgd", str(preset))
    )
    result = tune(cfg, resolve_train_config, fake_command, lambda line: None)
    passed = [
        json.loads(flag(m["argv"], "--custom.matrix-kwargs")) for m in manifests(tmp_path / "tune")
    ]
    assert sorted(passed, key=lambda d: d["lr"]) == [
        {"lr": lr, "momentum": 0.9} for lr in (0.01, 0.02, 0.04)
    ]
    assert result.best_values == {"custom.matrix_kwargs.lr": "0.02"}
    tuned = tomllib.loads(Path(result.preset_file).read_text())
    assert tuned["custom"] == {"matrix_kwargs": {"lr": 0.02, "momentum": 0.9}}


def test_the_dashboard_opens_the_study(tmp_path: Path) -> None:
    dashboard = pytest.importorskip(
        "optuna_dashboard", reason="the `dashboard` extra (in dev) is not installed"
    )
    result = run(config(tmp_path, "muon.lr=0.01,0.02"))
    app = dashboard.wsgi(f"sqlite:///{tmp_path}/tune/study.db")
    environ: dict[str, Any] = {"PATH_INFO": "/api/studies", "wsgi.errors": io.StringIO()}
    wsgiref.util.setup_testing_defaults(environ)
    status: list[str] = []
    body = b"".join(app(environ, lambda code, headers, *exc_info: status.append(code)))
    studies = json.loads(body)["study_summaries"]
    assert status == ["200 OK"] and result.study in [s["study_name"] for s in studies]


def test_compare_tune_needs_an_equal_budget_for_every_setup(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    head = ["compare", "--setups", "adamw,muon", "--out-dir", str(tmp_path / "c")]
    tail = ["--", "--num-iterations", "2"]
    unequal = ["--tune", "adamw:adamw.lr=0.001,0.003", "--tune", "muon:muon.lr=0.01,0.02,0.04"]
    assert main([*head, *unequal, *tail]) == 2
    assert "same number of trials" in capsys.readouterr().err
    assert main([*head, "--tune", "muon:muon.lr=0.01,0.02", *tail]) == 2
    assert "give every compared setup" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()  # refused before anything trained


@pytest.mark.slow
def test_compare_tune_on_a_tiny_budget_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Real runs: AdamW and Muon tuned over two lrs each, then compared at the tuned presets."""
    out = tmp_path / "c"
    argv = [
        "compare",
        "--setups",
        "adamw,muon",
        "--seeds",
        "2",
        "--out-dir",
        str(out),
        "--rule",
        "track3",
        "--tune",
        "adamw:adamw.lr=0.003,0.01",
        "--tune",
        "muon:muon.lr=0.01,0.03",
        "--",
        "--num-iterations",
        "3",
        "--val-every",
        "1",
        "--val-tokens",
        "256",
        "--batch-size",
        "2",
        "--seq-len",
        "64",
        "--autocast",
        "off",
        "--threads",
        "1",
        "--compile",
        "false",
        "--progress",
        "false",
    ]
    assert main(argv) == 0
    board = json.loads((out / "leaderboard.json").read_text())
    assert board["rule"] == "track3"
    presets = [row["preset"] for row in board["rows"]]
    assert presets == [str(out / "tune" / s / f"tuned-{s}.toml") for s in ("adamw", "muon")]
    for setup in ("adamw", "muon"):
        tuning = json.loads((out / "tune" / setup / "tuning.json").read_text())
        best = min(
            (t for t in tuning["trials"] if t["state"] == "complete"), key=lambda t: t["value"]
        )
        assert tuning["best_number"] == best["number"] and len(tuning["trials"]) == 2
        preset = tomllib.loads((out / "tune" / setup / f"tuned-{setup}.toml").read_text())
        assert preset[setup]["lr"] == float(best["params"][f"{setup}.lr"])
        # Seed 0 at the tuned point is the best trial's run, seed 1 the tune's confirmation (the
        # same config): the comparison reuses both and trains nothing of its own.
        trial_logs = list((out / "tune" / setup / "trials").glob(f"*/{best['name']}/*.jsonl"))
        assert len(trial_logs) == 2 and not list((out / setup).glob("*.jsonl"))
        assert tuning["confirm_finals"][0] == best["finals"][0]
        row = next(r for r in board["rows"] if r["setup"] == setup)
        assert row["final_val_loss"]["mean"] == pytest.approx(sum(tuning["confirm_finals"]) / 2)
    summary = (out / "tuning.md").read_text()
    for setup in ("adamw", "muon"):
        tuning = json.loads((out / "tune" / setup / "tuning.json").read_text())
        line = next(x for x in summary.splitlines() if x.startswith(f"| {setup} "))
        for trial in tuning["trials"]:
            assert f"{trial['params'][f'{setup}.lr']}: {trial['value']:.4f}" in line
        assert f"{setup}.lr = {tuning['best_values'][f'{setup}.lr']}" in line
