"""Specification of ``nanoshampoo study``: a definition's checks, and one real study end to end
(the real trainer at a toy size) whose every figure is recomputed here from the runs' own logs."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from nanoshampoo.cli import main
from nanoshampoo.errors import UserError
from nanoshampoo.evidence.study import StudyPlan, stored_storage
from nanoshampoo.evidence.study_definition import load_definition, packaged_studies

TRAIN_ARGS = [
    "--num-iterations",
    "16",
    "--threads",
    "1",
    "--autocast",
    "off",
    "--compile",
    "false",
    "--progress",
    "false",
    "--save-final-checkpoint",
    "false",
    "--val-every",
    "0",
    "--batch-size",
    "4",
    "--seq-len",
    "32",
    "--val-tokens",
    "1024",
]


def definition_text(setups: str, budgets: str = "[0.125, 0.25, 0.5, 1.0]") -> str:
    return (
        f'baseline = "adamw"\nsizes = ["gpt-0.2m"]\nbudgets = {budgets}\nseeds = 2\n'
        f"train_args = {json.dumps(TRAIN_ARGS)}\n{setups}"
    )


SETUPS = (
    '[setups.adamw]\npreset = "tiny-adamw"\nsearch = ["adamw.lr=0.003,0.01"]\n'
    '[setups.muon]\npreset = "tiny-muon"\nsearch = ["muon.lr=0.01,0.03"]\n'
)


def test_the_packaged_studies_load_and_end_at_the_full_run() -> None:
    assert packaged_studies() == ["cpu", "gpt2"]
    for name in packaged_studies():
        definition = load_definition(name)
        assert definition.budgets[-1] == 1.0 and len(definition.budgets) >= 4
        assert definition.branches == definition.budgets[:-1]
        assert {s.name for s in definition.setups} >= {"adamw", "muon", "shampoo", "soap"}
    assert load_definition("cpu").halving == "off" and load_definition("gpt2").halving == "sync"


@pytest.mark.parametrize(
    "change, message",
    [
        (("budgets = [0.125, 0.25, 0.5, 1.0]", "budgets = [0.25, 0.5, 1.0]"), "at least 4"),
        (
            ("budgets = [0.125, 0.25, 0.5, 1.0]", "budgets = [0.125, 0.25, 0.5, 0.9]"),
            "ending at 1.0",
        ),
        (('baseline = "adamw"', 'baseline = "sgd"'), "baseline: 'sgd'"),
        (("seeds = 2", "seeds = 1"), "seeds: at least 2"),
        (
            ('preset = "tiny-muon"', 'preset = "tiny-muon"\nlr = 3'),
            "setups.muon: unknown keys ['lr']",
        ),
        (("seeds = 2", "seeds = 2\nseed = 3"), "unknown keys ['seed']"),
        (('search = ["muon.lr=0.01,0.03"]', "search = []"), "setups.muon.search"),
        (("seeds = 2", "seeds = [2"), "not valid TOML"),
        (("seeds = 2", 'seeds = 2\nhalving = "fast"'), "halving: 'fast' is not one of sync, async"),
    ],
)
def test_a_malformed_definition_is_one_line_naming_the_file_and_key(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(definition_text(SETUPS).replace(*change))
    with pytest.raises(UserError) as raised:
        load_definition(str(path))
    assert message in str(raised.value) and str(path) in str(raised.value)
    assert "\n" not in str(raised.value)


def test_an_unknown_study_names_the_packaged_ones() -> None:
    with pytest.raises(
        UserError, match=r"--study 'cpuu': no such study; packaged: \['cpu', 'gpt2'\]"
    ):
        load_definition("cpuu")


def test_a_bad_setup_fails_the_study_before_any_trial_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(definition_text(SETUPS.replace("muon.lr=0.01,0.03", "muon.lrr=0.01,0.03")))
    out = tmp_path / "out"
    assert main(["study", "--study", str(path), "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nanoshampoo study: error: study: size gpt-0.2m, setup muon:")
    assert "muon.lrr" in err and len(err.splitlines()) == 1
    assert not any(out.rglob("*.jsonl"))  # adamw, the first setup, trained nothing


def test_a_cells_study_is_named_by_size_setup_and_the_digest_of_its_tune(tmp_path: Path) -> None:
    path = tmp_path / "study.toml"
    path.write_text(definition_text(SETUPS))
    config = StudyPlan(load_definition(str(path)), tmp_path / "out").tune_config("gpt-0.2m", "muon")
    unnamed = dataclasses.replace(config, study="")
    assert config.study == f"gpt-0.2m.{unnamed.study_name}"
    assert unnamed.study_name == f"muon-{unnamed.definition[:10]}"
    # A changed grid is another study (its ended runs are reused by run, not by trial).
    path.write_text(definition_text(SETUPS.replace("muon.lr=0.01,0.03", "muon.lr=0.01,0.03,0.1")))
    grown = StudyPlan(load_definition(str(path)), tmp_path / "out").tune_config("gpt-0.2m", "muon")
    assert grown.study.startswith("gpt-0.2m.muon-") and grown.study != config.study


def test_geometric_rungs_are_required_of_the_budgets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "study.toml"
    path.write_text(definition_text(SETUPS, budgets="[0.25, 0.5, 0.75, 1.0]"))
    assert main(["study", "--study", str(path), "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "rungs" in err and len(err.strip().splitlines()) == 1


def test_a_sqlite_store_inside_the_out_dir_is_recorded_relative_to_it(tmp_path: Path) -> None:
    out = tmp_path / "study"
    inside = f"sqlite:///{(out / 'tiny' / 'adamw' / 'study.db').resolve()}"
    assert stored_storage(inside, out) == "tiny/adamw/study.db"
    outside = f"sqlite:///{(tmp_path / 'elsewhere.db').resolve()}"
    assert stored_storage(outside, out) == outside
    shared = "postgresql+psycopg://user:***@host:5432/db"
    assert stored_storage(shared, out) == shared


def _logged_losses(jsonl: Path) -> tuple[int, dict[int, float]]:
    """(seed, {steps: final val loss}) of a run, read from its JSONL the obvious way."""
    seed, losses = -1, {}
    for line in jsonl.read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "config":
            seed = record["seed"]
        elif record["kind"] == "branch":
            losses[record["steps"]] = float(record["val_loss"])
        elif record["kind"] == "final":
            losses[record["step"]] = float(record["val_loss"])
    return seed, losses


def _power_law(d: np.ndarray, a: float, alpha: float, c: float) -> np.ndarray:
    return a * d**-alpha + c


@pytest.mark.slow
def test_a_study_end_to_end_reports_what_its_runs_logged(tmp_path: Path) -> None:
    path = tmp_path / "study.toml"
    path.write_text(definition_text(SETUPS))
    out = tmp_path / "out"
    assert main(["study", "--study", str(path), "--out-dir", str(out), "--resamples", "200"]) == 0
    data = json.loads((out / "study.json").read_text())
    for name in ("study.md", "speedups.png", "baseline_fits.png", "performance_profile.png"):
        assert (out / name).stat().st_size > 0
    # Every observation is a seed run's logged branch or final loss, at steps x 4 x 32 tokens.
    logged: dict[tuple[str, int, int], float] = {}
    for tune in data["tunes"]:
        assert tune["storage"] == f"gpt-0.2m/{tune['setup']}/study.db"
        assert len(tune["runs"]) == 2
        for run in tune["runs"]:
            seed, losses = _logged_losses(Path(run))
            assert sorted(losses) == [2, 4, 8, 16]  # 0.125, 0.25, 0.5 and 1 of 16 steps
            for steps, loss in losses.items():
                logged[(tune["setup"], seed, steps * 128)] = loss
    observed = {(o["setup"], o["seed"], o["tokens"]): o["loss"] for o in data["observations"]}
    assert observed == logged and len(observed) == 2 * 2 * 4
    # Welch at each budget, from the logged losses with scipy.
    for entry in data["welch"]:
        tokens = entry["tokens"]
        base = [logged[("adamw", s, tokens)] for s in (0, 1)]
        cand = [logged[("muon", s, tokens)] for s in (0, 1)]
        expected = stats.ttest_ind(cand, base, equal_var=False).pvalue
        assert entry["comparison"]["p_value"] == pytest.approx(expected, rel=1e-9)
    # The baseline's fit goes through its mean losses up to the residuals it reports.
    fit = data["scaling"]["fits"][0]
    budgets = np.array(fit["tokens"], dtype=np.float64)
    means = np.array([np.mean([logged[("adamw", s, int(d))] for s in (0, 1)]) for d in budgets])
    curve = _power_law(budgets, fit["a"], fit["alpha"], fit["c"])
    assert np.allclose(means - curve, fit["residuals"], atol=1e-9)
    # Tunability counts each trial slot once; a pruned trial is not within 1 % of the best.
    for tune in data["tunes"]:
        values = [t["value"] for t in tune["trials"]]
        best = min(v for v in values if v is not None)
        within = sum(v is not None and v <= best * 1.01 for v in values)
        assert (tune["tunability"]["within"], tune["tunability"]["trials"]) == (within, 2)
    # A grid of two values has its best on an edge, and the report says what that means.
    assert [tune["on_edge"] for tune in data["tunes"]] == [["adamw.lr"], ["muon.lr"]]
    report = (out / "study.md").read_text()
    assert "| best on the search's edge |" in report
    assert "the baseline (adamw) is on an edge at gpt-0.2m, so every speedup there" in report
    # Run again: everything is read back from the store, nothing trains.
    before = sorted(out.rglob("*.jsonl"))
    assert main(["study", "--study", str(path), "--out-dir", str(out), "--resamples", "200"]) == 0
    assert sorted(out.rglob("*.jsonl")) == before
    assert json.loads((out / "study.json").read_text())["observations"] == data["observations"]
    assert all(math.isfinite(o["loss"]) for o in data["observations"])


def test_with_halving_off_the_report_gives_the_grids_best_point_at_every_budget() -> None:
    from types import SimpleNamespace

    from nanoshampoo.evidence.study import _budget_best_section

    def trial(number: int, lr: str, value: float, rungs: dict[int, float]) -> SimpleNamespace:
        return SimpleNamespace(
            number=number, name=f"t{number:03d}", state="complete",
            params={"adamw.lr": lr}, value=value, rungs=rungs,
        )  # fmt: skip

    trials = [
        trial(0, "0.001", 4.90, {16: 6.50, 32: 6.00}),  # best at 16 steps only
        trial(1, "0.002", 4.80, {16: 6.60, 32: 5.90}),  # the full budget's best
        trial(2, "0.004", 4.85, {16: 6.70, 32: 5.80}),  # best at 32 steps
    ]
    run = SimpleNamespace(final_losses_by_steps=lambda: {16: 6.6, 32: 5.9, 64: 4.8})
    cell = SimpleNamespace(
        size="tiny", setup="adamw", runs=[run],
        tune=SimpleNamespace(trials=trials, best_values={"adamw.lr": "0.002"}),
    )  # fmt: skip
    result = SimpleNamespace(
        plan=SimpleNamespace(definition=SimpleNamespace(halving="off")), cells=[cell]
    )
    lines = _budget_best_section(result)
    assert "| size | setup | 16 steps | 32 steps | 64 steps |" in [
        " ".join(line.split()) for line in lines
    ]
    (row,) = [line for line in lines if line.startswith("| tiny")]
    assert [c.strip() for c in row.strip("|").split("|")] == [
        "tiny", "adamw", "lr 0.001: 6.5000 *", "lr 0.004: 5.8000 *", "lr 0.002: 4.8000",
    ]  # fmt: skip
    assert "(2 of 3 cells)" in lines[-1]
    result.plan.definition.halving = "sync"  # pruned trials did not reach every budget
    assert _budget_best_section(result) == []
