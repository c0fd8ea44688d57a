"""nanoshampoo compare: planning and reuse, the leaderboard's statistics, diverged runs, the CLI.

A fake trainer (a launcher that writes the JSONL log the real trainer would) stands in for
training; the statistics are recomputed here with numpy/scipy from the same numbers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import scipy.stats

import nanoshampoo.cli as cli
from nanoshampoo.cli import main
from nanoshampoo.evidence import compare, leaderboard
from nanoshampoo.evidence.compare import (
    CompareConfig,
    Setup,
    parse_setups,
    resolve_train_config,
    run_compare,
    run_identity,
)
from nanoshampoo.evidence.leaderboard import build_leaderboard
from nanoshampoo.evidence.repeat import fresh_run_id

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = (0, 25, 50, 75, 100)
# Validation loss above the final loss at each of STEPS: the curves fall, then flatten.
OFFSETS = (6.0, 1.0, 0.3, 0.05, 0.0)
FINALS = {
    "adamw": (4.00, 4.03, 4.05),
    "shampoo": (3.96, 3.99, 3.97),
    "soap": (3.90, 3.92, 3.95),
}
MS_PER_STEP = {"adamw": 10.0, "shampoo": 13.0, "soap": 16.0}
PEAK_MIB = {"adamw": 100.0, "shampoo": 120.0, "soap": 150.0}


def fake_resolve(argv: Sequence[str]) -> dict[str, Any]:
    """Flags as a config dict: ``--num-iterations 100`` -> ``{"num_iterations": "100"}``."""
    assert len(argv) % 2 == 0, argv
    return {argv[i].lstrip("-").replace("-", "_"): argv[i + 1] for i in range(0, len(argv), 2)}


def curve(setup: str, seed: int) -> list[tuple[int, float, float]]:
    """(step, val loss, train time ms) of the fake run ``setup``/``seed``."""
    final = FINALS[setup][seed]
    ms = MS_PER_STEP[setup] * (1 + 0.01 * seed)
    return [(step, final + offset, step * ms) for step, offset in zip(STEPS, OFFSETS)]


class FakeTrainer:
    """A launcher that writes the log of ``curve(setup, seed)``; ``diverge`` maps
    ``(setup, seed)`` to the step where that run diverges, ``crash`` lists runs that die."""

    def __init__(
        self,
        diverge: dict[tuple[str, int], int] | None = None,
        crash: set[tuple[str, int]] | None = None,
    ) -> None:
        self.diverge = diverge or {}
        self.crash = crash or set()
        self.launched: list[list[str]] = []

    def __call__(self, command: list[str], output: Path) -> int:
        self.launched.append(command)
        out_dir = Path(_flag(command, "--out-dir"))
        run_id, seed, setup = (
            _flag(command, "--run-id"),
            int(_flag(command, "--seed")),
            out_dir.name,
        )
        output.write_text(f"training {run_id}\n")
        records: list[dict[str, Any]] = [
            {
                "kind": "config",
                "run_id": run_id,
                "seed": seed,
                "preset": _flag(command, "--preset"),
                "optimizer": setup,
                "world_size": 1,
                "config": {},
            }
        ]
        diverge_at = self.diverge.get((setup, seed))
        for step, loss, time_ms in curve(setup, seed):
            if (setup, seed) in self.crash and step > 50:
                output.write_text("Traceback ...\nRuntimeError: worker died\n")
                (out_dir / f"{run_id}.jsonl").write_text(
                    "".join(json.dumps(r) + "\n" for r in records)
                )
                return 1
            if diverge_at is not None and step >= diverge_at:
                records.append(
                    {
                        "kind": "diverged",
                        "step": diverge_at,
                        "total_steps": 100,
                        "reason": "loss is nan",
                        "train_time_ms": time_ms,
                    }
                )
                break
            records.append(
                {
                    "kind": "val",
                    "step": step,
                    "total_steps": 100,
                    "val_loss": loss,
                    "train_time_ms": time_ms,
                    "step_avg_ms": time_ms / max(step, 1),
                }
            )
        else:
            records.append(
                {
                    "kind": "final",
                    "step": 100,
                    "total_steps": 100,
                    "val_loss": loss,
                    "train_time_ms": time_ms,
                    "step_avg_ms": time_ms / 100,
                    "peak_memory_mib": PEAK_MIB[setup],
                }
            )
        (out_dir / f"{run_id}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return 1 if diverge_at is not None else 0


def _flag(command: list[str], flag: str) -> str:
    return command[len(command) - 1 - command[::-1].index(flag) + 1]


def _config(tmp_path: Path, **overrides: Any) -> CompareConfig:
    fields: dict[str, Any] = dict(
        setups=parse_setups("adamw,shampoo,soap"),
        seeds=3,
        out_dir=tmp_path / "cmp",
        train_args=("--num-iterations", "100"),
    )
    fields.update(overrides)
    return CompareConfig(**fields)


def _run(config: CompareConfig, trainer: FakeTrainer) -> tuple[dict[str, Any], list[str]]:
    lines: list[str] = []
    groups = run_compare(config, resolve=fake_resolve, launch=trainer, say=lines.append)
    return groups, lines


def crossing_step(setup: str, seed: int, target: float) -> float | None:
    """Where the fake curve reaches ``target``: np.interp on the bracketing segment, reversed
    so that the loss increases."""
    points = curve(setup, seed)
    for (s0, l0, _), (s1, l1, _) in zip(points, points[1:]):
        if l1 <= target < l0:
            return float(np.interp(target, [l1, l0], [s1, s0]))
    return None


def test_leaderboard_statistics_match_numpy_and_scipy(tmp_path: Path) -> None:
    config = _config(tmp_path)
    groups, _ = _run(config, FakeTrainer())
    board = build_leaderboard(groups, config)
    target = float(np.mean(FINALS["adamw"]))
    assert board.target == pytest.approx(target) and board.baseline == "adamw"
    rows = {row.setup: row for row in board.rows}
    base_steps = [crossing_step("adamw", s, target) for s in range(3)]
    base_reached = [s for s in base_steps if s is not None]
    for setup, finals in FINALS.items():
        row = rows[setup]
        steps = [crossing_step(setup, seed, target) for seed in range(3)]
        reached = [s for s in steps if s is not None]
        times = [
            s * MS_PER_STEP[setup] * (1 + 0.01 * seed) / 1000
            for seed, s in enumerate(steps)
            if s is not None
        ]
        assert row.reached == len(reached) and row.runs == 3 and row.diverged == 0
        assert row.steps_to_target.mean == pytest.approx(np.mean(reached))
        if len(reached) >= 2:
            assert row.steps_to_target.std == pytest.approx(np.std(reached, ddof=1))
        assert row.steps_ratio == pytest.approx(np.mean(reached) / np.mean(base_reached))
        assert row.time_to_target_s.mean == pytest.approx(np.mean(times))
        assert row.final_val_loss.mean == pytest.approx(np.mean(finals))
        assert row.final_val_loss.std == pytest.approx(np.std(finals, ddof=1))
        assert row.target_p == pytest.approx(
            scipy.stats.ttest_1samp(finals, target, alternative="less").pvalue
        )
        welch = scipy.stats.ttest_ind(finals, FINALS["adamw"], equal_var=False).pvalue
        assert row.welch_p == (None if setup == "adamw" else pytest.approx(welch))
        ms = [MS_PER_STEP[setup] * (1 + 0.01 * seed) for seed in range(3)]
        assert row.step_avg_ms.mean == pytest.approx(np.mean(ms))
        assert row.peak_memory_mib.mean == pytest.approx(PEAK_MIB[setup])
    # The auto target is the baseline mean: its mean final loss sits on it (t = 0, p = 0.5),
    # and only the baseline runs that end at or below their mean reach it.
    assert rows["adamw"].target_p == pytest.approx(0.5)
    assert rows["adamw"].reached == 1 and rows["soap"].reached == 3


def test_steps_to_target_is_interpolated_between_validations(tmp_path: Path) -> None:
    # Target 4.5 for soap seed 0 (losses 9.9, 4.9, 4.2, 3.95, 3.9 at steps 0..100 by 25):
    # reached between step 25 (4.9) and 50 (4.2), at 25 + 25 * 0.4/0.7, not at step 50.
    config = _config(tmp_path, setups=(Setup("soap", "tiny-soap"),), seeds=1, target=4.5)
    groups, _ = _run(config, FakeTrainer())
    [row] = build_leaderboard(groups, config).rows
    assert row.steps_to_target.mean == pytest.approx(25 + 25 * (4.9 - 4.5) / (4.9 - 4.2))
    assert row.time_to_target_s.mean == pytest.approx(row.steps_to_target.mean * 16.0 / 1000)
    assert row.steps_to_target.mean % 25 != 0


def test_second_invocation_reuses_every_ended_run(tmp_path: Path) -> None:
    config = _config(tmp_path)
    trainer = FakeTrainer(diverge={("soap", 1): 50})
    first, lines = _run(config, trainer)
    assert len(trainer.launched) == 9
    assert lines[0].endswith("0 reused, 9 to train, in " + str(config.out_dir))
    assert sum(line.startswith("[compare] start") for line in lines) == 9
    assert sum(line.startswith("[compare] finished") for line in lines) == 9
    logs = {p: p.read_bytes() for p in config.out_dir.rglob("*") if p.is_file()}

    again = FakeTrainer()
    second, lines = _run(config, again)
    assert again.launched == []  # the diverged run is an ended run too: reused, not retrained
    assert lines[0].endswith("9 reused, 0 to train, in " + str(config.out_dir))
    assert sum(line.startswith("[compare] reused") for line in lines) == 9
    assert {k: [r.path for r in v] for k, v in second.items()} == {
        k: [r.path for r in v] for k, v in first.items()
    }
    assert {p: p.read_bytes() for p in config.out_dir.rglob("*") if p.is_file()} == logs

    # Other train flags are other runs: all retrained, beside the old ones, which stay as they were.
    changed = FakeTrainer()
    _run(_config(tmp_path, train_args=("--num-iterations", "200")), changed)
    assert len(changed.launched) == 9
    assert all(p.read_bytes() == data for p, data in logs.items())


def test_more_seeds_train_only_the_new_ones(tmp_path: Path) -> None:
    _run(_config(tmp_path, seeds=2), FakeTrainer())
    trainer = FakeTrainer()
    groups, _ = _run(_config(tmp_path, seeds=3), trainer)
    assert sorted(
        (Path(_flag(c, "--out-dir")).name, _flag(c, "--seed")) for c in trainer.launched
    ) == [("adamw", "2"), ("shampoo", "2"), ("soap", "2")]
    assert [r.seed for r in groups["adamw"]] == [0, 1, 2]


def test_a_crashed_run_stops_compare_and_is_retrained_under_a_new_id(tmp_path: Path) -> None:
    config = _config(tmp_path, setups=parse_setups("adamw"), seeds=2)
    with pytest.raises(RuntimeError) as info:
        _run(config, FakeTrainer(crash={("adamw", 1)}))
    message = str(info.value)
    assert "adamw seed 1 failed (exit status 1): RuntimeError: worker died" in message
    assert "\n" not in message and ".out" in message
    crashed = {p: p.read_bytes() for p in (config.out_dir / "adamw").glob("adamw-s1-*")}

    trainer = FakeTrainer()
    groups, _ = _run(config, trainer)
    [command] = trainer.launched
    run_id = _flag(command, "--run-id")
    assert run_id.endswith("-2") and all(run_id not in p.name for p in crashed)
    assert all(p.read_bytes() == data for p, data in crashed.items())
    assert groups["adamw"][1].run_id == run_id


def test_diverged_runs_are_counted_marked_and_left_out_of_the_means(tmp_path: Path) -> None:
    config = _config(tmp_path)
    groups, lines = _run(config, FakeTrainer(diverge={("soap", 1): 50}))
    [finished] = [line for line in lines if line.startswith("[compare] finished soap seed 1 ")]
    assert finished.endswith(": diverged at step 50/100: loss is nan")
    board = build_leaderboard(groups, config)
    soap = next(row for row in board.rows if row.setup == "soap")
    finished = [FINALS["soap"][0], FINALS["soap"][2]]
    assert (soap.runs, soap.diverged, soap.reached) == (3, 1, 2)
    assert soap.final_val_loss.n == 2
    assert soap.final_val_loss.mean == pytest.approx(np.mean(finished))
    assert soap.welch_p == pytest.approx(
        scipy.stats.ttest_ind(finished, FINALS["adamw"], equal_var=False).pvalue
    )
    assert soap.target_p == pytest.approx(
        scipy.stats.ttest_1samp(finished, board.target, alternative="less").pvalue
    )
    [diverged] = [run for run in board.runs if run.diverged_step is not None]
    assert (diverged.setup, diverged.seed, diverged.steps_to_target) == ("soap", 1, None)
    markdown = leaderboard.format_leaderboard(board)
    assert "| 3 (1 diverged †) |" in markdown
    assert "diverged † at step 50: loss is nan" in markdown


def test_auto_target_needs_a_finished_baseline_run(tmp_path: Path) -> None:
    config = _config(tmp_path, setups=parse_setups("adamw,soap"), seeds=1)
    groups, _ = _run(config, FakeTrainer(diverge={("adamw", 0): 25}))
    with pytest.raises(ValueError, match="target: every run of the baseline 'adamw' diverged"):
        build_leaderboard(groups, config)
    given = build_leaderboard(
        groups, _config(tmp_path, setups=parse_setups("adamw,soap"), seeds=1, target=4.0)
    )
    assert given.target == 4.0 and given.target_rule == "given"
    adamw = given.rows[0]
    assert adamw.final_val_loss.mean is None and adamw.reached == 0 and adamw.steps_ratio is None


def test_baseline_option_picks_the_reference_row(tmp_path: Path) -> None:
    config = _config(tmp_path, baseline="soap")
    groups, _ = _run(config, FakeTrainer())
    board = build_leaderboard(groups, config)
    assert board.target == pytest.approx(np.mean(FINALS["soap"]))
    assert next(r for r in board.rows if r.setup == "soap").welch_p is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(setups=()), "setups"),
        (dict(setups=parse_setups("adamw,adamw")), r"setups: \['adamw'\] given twice"),
        (dict(setups=(Setup("a/b", "tiny-adamw"),)), "setups: 'a/b' is not a plain name"),
        (dict(seeds=0), "seeds"),
        (dict(seed0=-1), "seed0"),
        (dict(nproc=0), "nproc"),
        (dict(baseline="muon"), "baseline: 'muon' is not one of the setups"),
        (dict(target=math.nan), "target"),
        (dict(train_args=("--seed", "3")), "'--seed' is set by compare"),
        (dict(train_args=("--preset=tiny-adamw",)), "'--preset=tiny-adamw' is set by compare"),
        (dict(train_args=("--resume", "x")), "'--resume' is set by compare"),
        (dict(train_args=("--optimizer", "adamw")), "'--optimizer' is set by compare"),
    ],
)
def test_invalid_compare_config_names_the_field(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, **overrides)


def test_parse_setups() -> None:
    assert parse_setups("adamw, mine=gpt2-124m-adamw,x=p/q.toml") == (
        Setup("adamw", "tiny-adamw"),
        Setup("mine", "gpt2-124m-adamw"),
        Setup("x", "p/q.toml"),
    )
    with pytest.raises(ValueError, match="setups: 'x=' names no preset"):
        parse_setups("x=")


def test_fresh_run_id_never_takes_a_used_name(tmp_path: Path) -> None:
    assert fresh_run_id(tmp_path, "a-s0-x") == "a-s0-x"
    (tmp_path / "a-s0-x.out").write_text("")
    (tmp_path / "a-s0-x-2.ckpt").mkdir()
    assert fresh_run_id(tmp_path, "a-s0-x") == "a-s0-x-3"


def test_real_resolver_reads_flags_like_the_trainer() -> None:
    spaced = resolve_train_config(
        ["--preset", "tiny-adamw", "--num-iterations", "20", "--seed", "1"]
    )
    joined = resolve_train_config(
        [
            "--num-iterations=20",
            "--preset=tiny-adamw",
            "--seed=1",
            "--progress",
            "false",
            "--out-dir",
            "elsewhere",
            "--save-final-checkpoint",
            "false",
        ]
    )
    assert spaced["optimizer"] == "adamw" and spaced["num_iterations"] == 20
    assert run_identity(spaced, 1) == run_identity(joined, 1) != run_identity(spaced, 2)
    with pytest.raises(ValueError, match="^train flags: unrecognized arguments: --bogus"):
        resolve_train_config(["--bogus"])
    with pytest.raises(ValueError, match="^train flags: .*num_iterations"):
        resolve_train_config(["--num-iterations", "0"])


def test_cli_writes_the_leaderboard_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = FakeTrainer(diverge={("shampoo", 2): 75})
    monkeypatch.setattr(
        cli, "run_compare", lambda config: run_compare(config, resolve=fake_resolve, launch=trainer)
    )
    out = tmp_path / "cmp"
    argv = [
        "compare",
        "--setups",
        "adamw,shampoo",
        "--seeds",
        "3",
        "--out-dir",
        str(out),
        "--",
        "--num-iterations",
        "100",
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "[compare] 6 runs (2 setups x 3 seeds): 0 reused, 6 to train" in text
    assert "| adamw (baseline) |" in text and f"wrote {out / 'leaderboard.md'}" in text
    data = json.loads((out / "leaderboard.json").read_text())
    assert data["baseline"] == "adamw" and data["train_args"] == ["--num-iterations", "100"]
    assert data["target"] == pytest.approx(np.mean(FINALS["adamw"]))
    shampoo = data["rows"][1]
    assert (shampoo["runs"], shampoo["diverged"]) == (3, 1)
    assert shampoo["final_val_loss"]["mean"] == pytest.approx(np.mean(FINALS["shampoo"][:2]))
    diverged = [run for run in data["runs"] if run["diverged_step"] is not None]
    assert [(r["setup"], r["seed"], r["final_val_loss"]) for r in diverged] == [
        ("shampoo", 2, None)
    ]
    assert (out / "leaderboard.md").read_text().startswith("# Leaderboard: adamw, shampoo")
    for name in ("loss_vs_step.png", "loss_vs_time.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    assert main(argv) == 0
    assert "6 reused, 0 to train" in capsys.readouterr().out and len(trainer.launched) == 6


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seeds", "many"], "argument --seeds: invalid int value: 'many'"),
        (["--target", "low"], "target: expected auto or a number, got 'low'"),
        (
            ["--setups", "adamw,nosuchsetup"],
            "setup 'nosuchsetup': train flags: unknown preset 'tiny-nosuchsetup'",
        ),
        (["--setups", "adamw", "--", "--preset", "tiny-adamw"], "'--preset' is set by compare"),
        (
            ["--setups", "adamw", "--", "--no-such-flag", "1"],
            "unrecognized arguments: --no-such-flag 1",
        ),
        (["--setups", "adamw", "--baseline", "sgd"], "baseline: 'sgd' is not one of the setups"),
        (["--step-fractions", "0.7,half"], "step-fractions: expected numbers separated by commas"),
        (["--step-fractions", "1.2"], "step-fractions: each must be in (0.0, 1.0), got 1.2"),
    ],
)
def test_cli_user_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    try:
        status = main(["compare", "--out-dir", str(tmp_path / "cmp"), *args])
    except SystemExit as exc:  # argparse's own errors exit from the parser
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2
    assert (
        err.count("\n") == 1 and err.startswith("nanoshampoo compare: error: ") and message in err
    )
    assert not (tmp_path / "cmp").exists()  # nothing was started or written


def test_cli_refuses_an_out_dir_that_is_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    assert main(["compare", "--out-dir", str(tmp_path / "file")]) == 2
    assert (
        capsys.readouterr().err
        == f"nanoshampoo compare: error: out-dir: {tmp_path / 'file'} exists and is not a "
        "directory\n"
    )


@pytest.mark.slow
def test_real_runs_then_reuse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two real 2-step runs (adamw, shampoo) on the embedded corpus; a second call trains
    nothing."""
    argv = [
        "compare",
        "--setups",
        "adamw,shampoo",
        "--seeds",
        "1",
        "--out-dir",
        str(tmp_path / "cmp"),
        "--",
        "--num-iterations",
        "2",
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
        "--save-final-checkpoint",
        "false",
    ]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert "0 reused, 2 to train" in first and first.count("[compare] finished") == 2
    data = json.loads((tmp_path / "cmp" / "leaderboard.json").read_text())
    assert [row["setup"] for row in data["rows"]] == ["adamw", "shampoo"]
    assert all(math.isfinite(row["final_val_loss"]["mean"]) for row in data["rows"])
    assert main(argv) == 0
    assert "2 reused, 0 to train" in capsys.readouterr().out


# Final-loss penalty of a schedule shortened to n of the fake runs' 100 steps.
SHORT_PENALTY = {100: 0.0, 70: 0.03, 50: 0.10}


class ScheduleTrainer:
    """A launcher for ``--step-fractions``: setup ``S@f`` (directory name) ends at
    ``FINALS[S][seed] + SHORT_PENALTY[n]`` after its ``--num-iterations`` n steps."""

    def __init__(self) -> None:
        self.launched: list[list[str]] = []

    def __call__(self, command: list[str], output: Path) -> int:
        self.launched.append(command)
        out_dir = Path(_flag(command, "--out-dir"))
        run_id, seed = _flag(command, "--run-id"), int(_flag(command, "--seed"))
        steps = int(_flag(command, "--num-iterations"))
        final = FINALS[out_dir.name.split("@")[0]][seed] + SHORT_PENALTY[steps]
        output.write_text(f"training {run_id}\n")
        records = [
            {"kind": "config", "run_id": run_id, "seed": seed, "world_size": 1, "config": {}},
            {
                "kind": "val",
                "step": 0,
                "total_steps": steps,
                "val_loss": 9.0,
                "train_time_ms": 0.0,
                "step_avg_ms": 0.0,
            },
            {
                "kind": "final",
                "step": steps,
                "total_steps": steps,
                "val_loss": final,
                "train_time_ms": (10.0 + seed) * steps,
                "step_avg_ms": 10.0 + seed,
                "peak_memory_mib": 1.0 + seed,
            },
        ]
        (out_dir / f"{run_id}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return 0


def test_step_fractions_train_shorter_schedules_and_find_the_shortest_that_reaches(
    tmp_path: Path,
) -> None:
    config = _config(tmp_path, step_fractions=(0.5, 0.7))
    assert config.step_fractions == (0.7, 0.5)  # longest first
    trainer = ScheduleTrainer()
    groups = run_compare(config, resolve=fake_resolve, launch=trainer, say=lambda line: None)
    assert list(groups) == [
        "adamw",
        "shampoo",
        "shampoo@0.7",
        "shampoo@0.5",
        "soap",
        "soap@0.7",
        "soap@0.5",
    ]  # the baseline gets no variants
    launched = sorted(
        (Path(_flag(c, "--out-dir")).name, _flag(c, "--num-iterations")) for c in trainer.launched
    )
    assert launched == sorted(
        [(s, "100") for s in ("adamw", "shampoo", "soap") for _ in range(3)]
        + [
            (f"{s}@{f}", n)
            for s in ("shampoo", "soap")
            for f, n in (("0.7", "70"), ("0.5", "50"))
            for _ in range(3)
        ]
    )
    # A variant keeps its preset: only the schedule changes.
    assert {
        _flag(c, "--preset")
        for c in trainer.launched
        if Path(_flag(c, "--out-dir")).name.startswith("soap")
    } == {"tiny-soap"}

    board = build_leaderboard(groups, config)
    target = float(np.mean(FINALS["adamw"]))
    expected = {}
    for setup in ("shampoo", "soap"):
        for steps, fraction in ((100, 1.0), (70, 0.7), (50, 0.5)):
            finals = [f + SHORT_PENALTY[steps] for f in FINALS[setup]]
            p = scipy.stats.ttest_1samp(finals, target, alternative="less").pvalue
            expected[(setup, fraction)] = (steps, float(np.mean(finals)), p)
    got = {(r.setup, r.fraction): r for r in board.schedules}
    assert set(got) == set(expected)
    for key, (steps, mean, p) in expected.items():
        row = got[key]
        assert row.steps == steps and row.final_val_loss.mean == pytest.approx(mean)
        assert row.target_p == pytest.approx(p) and row.reaches == (p < 0.05)
    # The fixture's numbers: soap reaches at 0.7 but not 0.5; shampoo only at full length.
    assert [got[("soap", f)].reaches for f in (1.0, 0.7, 0.5)] == [True, True, False]
    assert [got[("shampoo", f)].reaches for f in (1.0, 0.7, 0.5)] == [True, False, False]
    shortest = leaderboard.shortest_schedules(board)
    assert shortest["soap"].fraction == 0.7 and shortest["shampoo"].fraction == 1.0

    text = leaderboard.format_leaderboard(board)
    assert "## Steps to the target by schedule length" in text
    cells = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in text.splitlines()
        if line.startswith("|")
    ]
    assert ["soap", "soap@0.7", "70 (0.70×)"] in [row[:3] for row in cells]
    assert f"- **soap**: reaches {target:.4f} in 0.70× adamw's steps (70; p = " in text
    data = json.loads(json.dumps(leaderboard.json_ready(board)))
    assert [(s["row"], s["steps"]) for s in data["schedules"]][:3] == [
        ("shampoo", 100),
        ("shampoo@0.7", 70),
        ("shampoo@0.5", 50),
    ]

    again = ScheduleTrainer()
    run_compare(config, resolve=fake_resolve, launch=again, say=lambda line: None)
    assert again.launched == []  # the shortened runs are reused like any other


@pytest.mark.parametrize(
    ("fractions", "message"),
    [
        ((0.0,), "step-fractions: each must be in \\(0.0, 1.0\\), got 0.0"),
        ((1.0,), "got 1.0"),
        ((0.7, 1.5), "got 1.5"),
        ((0.7, 0.7), "repeats a fraction"),
    ],
)
def test_invalid_step_fractions_are_refused(
    tmp_path: Path, fractions: tuple[float, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, step_fractions=fractions)


def test_a_run_logged_before_a_config_field_existed_is_reused_at_that_fields_default(
    tmp_path: Path,
) -> None:
    config = _config(tmp_path, setups=parse_setups("adamw"), seeds=1)
    run_compare(config, resolve=fake_resolve, launch=FakeTrainer(), say=lambda line: None)
    # The trainer gains a field "new_knob" (default "off") after the run was made.
    with_field = lambda argv: {**fake_resolve(argv), "new_knob": "off"}  # noqa: E731
    [plan] = compare.plan_runs(config, with_field, defaults={"new_knob": "off"})
    assert plan.reused is not None
    # At another value it is another run; and without a known default nothing is assumed.
    changed = lambda argv: {**fake_resolve(argv), "new_knob": "on"}  # noqa: E731
    assert compare.plan_runs(config, changed, defaults={"new_knob": "off"})[0].reused is None
    assert compare.plan_runs(config, with_field, defaults={})[0].reused is None


def test_train_config_defaults_are_the_dataclass_defaults() -> None:
    from nanoshampoo.train.config import TrainConfig

    defaults = compare.train_config_defaults()
    assert {k: v for k, v in defaults.items() if k in TrainConfig().to_dict()} == json.loads(
        json.dumps(TrainConfig().to_dict())
    )
    # Every table's fields, not only those of the default setup's tables.
    assert defaults["muon.lr"] == 0.05 and defaults["custom.matrix_kwargs"] == {}
