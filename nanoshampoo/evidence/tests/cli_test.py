"""The nanoshampoo command through main(argv): stats, trace, repeat."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from evidence_fixtures import write_group, write_jsonl, write_trace, x_event

from nanoshampoo.cli import main
from nanoshampoo.errors import UserError
from nanoshampoo.evidence.repeat import RepeatConfig, run_repeats, seed_command

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_stats_table_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = write_group(
        tmp_path / "base", [3.2778, 3.2779, 3.2780, 3.2783], [141.654, 141.413, 141.467, 141.516]
    )
    hook = write_group(
        tmp_path / "hook",
        [3.2775, 3.2776, 3.2777, 3.2780, 3.2781],
        [140.909, 140.872, 140.743, 140.743, 140.747],
        fmt="txt",
    )
    out = tmp_path / "report.json"
    assert (
        main(["stats", str(base), str(hook), "--json", str(out), "--plot", str(tmp_path / "plots")])
        == 0
    )
    text = capsys.readouterr().out
    assert "track rule" in text and "Welch" in text and "train_time_s" in text
    report = json.loads(out.read_text())
    assert [g["name"] for g in report["groups"]] == [str(base), str(hook)]
    assert report["groups"][1]["train_time_s"]["mean"] == pytest.approx(140.8028)
    time_cmp = next(c for c in report["comparisons"] if c["metric"] == "train_time_s")
    assert time_cmp["difference"] == pytest.approx(140.8028 - 141.5125)
    for name in ("val_loss_curves.png", "ab_comparison.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == PNG_MAGIC
    # Written files get the usual permissions, not the owner-only 0o600 of a temporary file.
    mask = os.umask(0)
    os.umask(mask)
    for path in (out, tmp_path / "plots" / "ab_comparison.png"):
        assert path.stat().st_mode & 0o777 == 0o666 & ~mask


def test_stats_named_groups_and_group_by(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_group(tmp_path / "r", [3.27, 3.275], [10.0, 10.5])
    write_jsonl(tmp_path / "r" / "muon.jsonl", 3.26, 9.0, seed=0, optimizer="muon")
    assert (
        main(
            [
                "stats",
                "--group",
                f"everything={tmp_path}/r/*.jsonl",
                "--group-by",
                "optimizer",
                "--baseline",
                "optimizer=muon",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "== optimizer=adam (2 runs) ==" in text and "== optimizer=muon (1 runs) ==" in text


def test_stats_errors_name_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    assert main(["stats", str(bad)]) == 2
    assert f"{bad}:1: invalid JSON" in capsys.readouterr().err
    assert main(["stats"]) == 2


def test_trace_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = [
        x_event("aten::mm", 0, 100, 1),
        x_event("gloo:all_reduce", 50, 150, 2, cat="user_annotation"),
    ]
    write_trace(tmp_path / "rank0.json.gz", events, rank=0)
    out = tmp_path / "overlap.json"
    assert main(["trace", str(tmp_path), "--json", str(out)]) == 0
    assert "overlap_%" in capsys.readouterr().out
    [rank0] = json.loads(out.read_text())
    assert rank0["overlap_pct"] == pytest.approx(50.0)
    assert rank0["exposed_communication_ms"] == pytest.approx(0.05)


def test_repeat_commands() -> None:
    config = RepeatConfig(runs=2, out_dir=Path("runs/x"), seed0=3, nproc=2, name="hook")
    assert seed_command(config, 4, ["--preset", "tiny"]) == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "nanoshampoo.train",
        "--preset",
        "tiny",
        "--seed",
        "4",
        "--run-id",
        "hook_seed4",
        "--out-dir",
        "runs/x",
    ]
    with pytest.raises(ValueError, match="--seed"):
        seed_command(config, 4, ["--seed=1"])
    with pytest.raises(ValueError, match="runs"):
        RepeatConfig(runs=0, out_dir=Path("x"))


def test_repeat_runs_every_seed_and_stops_on_failure(tmp_path: Path) -> None:
    config = RepeatConfig(runs=3, out_dir=tmp_path, seed0=1)
    seen: list[list[str]] = []
    run_repeats(config, ["--preset", "tiny"], run=lambda cmd: seen.append(cmd) or 0)
    assert [cmd[cmd.index("--seed") + 1] for cmd in seen] == ["1", "2", "3"]
    with pytest.raises(UserError, match="seed 1 failed with exit status 3"):
        run_repeats(config, [], run=lambda cmd: 3)


def test_repeat_cli_reports_the_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_train(cmd: list[str]) -> int:
        run_id = cmd[cmd.index("--run-id") + 1]
        seed = int(cmd[cmd.index("--seed") + 1])
        write_jsonl(
            Path(cmd[cmd.index("--out-dir") + 1]) / f"{run_id}.jsonl",
            3.27 + 0.001 * seed,
            10.0,
            seed,
        )
        return 0

    import nanoshampoo.cli as cli

    monkeypatch.setattr(
        cli, "run_repeats", lambda config, args: run_repeats(config, args, run=fake_train)
    )
    assert (
        main(["repeat", "-n", "2", "--out-dir", str(tmp_path), "--", "--preset", "tiny-adamw"]) == 0
    )
    assert f"== {tmp_path} (2 runs) ==" in capsys.readouterr().out


def test_stats_reads_and_marks_diverged_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    group = write_group(tmp_path / "g", [3.27, 3.275], [10.0, 10.5])
    (group / "run_seed2.jsonl").write_text(
        '{"kind": "config", "run_id": "run_seed2", "seed": 2}\n'
        '{"kind": "val", "step": 0, "total_steps": 100, "val_loss": 9.0, "train_time_ms": 0.0}\n'
        '{"kind": "diverged", "step": 40, "total_steps": 100, "reason": "loss is nan", '
        '"train_time_ms": "nan"}\n'
    )
    (group / "run_seed3.jsonl").write_text(  # today's trainer: ran to the end, NaN written as null
        '{"kind": "config", "run_id": "run_seed3", "seed": 3}\n'
        '{"kind": "val", "step": 100, "total_steps": 100, "val_loss": null, "train_time_ms": 9.0}\n'
        '{"kind": "final", "step": 100, "total_steps": 100, "val_loss": null, "train_time_ms": 9.0,'
        ' "step_avg_ms": 0.09, "peak_memory_mib": 1.0}\n'
    )
    out = tmp_path / "report.json"
    assert (
        main(
            [
                "stats",
                str(group),
                "--target",
                "3.28",
                "--json",
                str(out),
                "--plot",
                str(tmp_path / "p"),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert f"== {group} (4 runs, 2 diverged) ==" in text
    assert "diverged at step 40" in text and "diverged at step 100" in text
    [report] = json.loads(out.read_text())["groups"]
    assert (report["finished"], report["diverged"], report["reached"]) == (2, 2, 2)
    assert report["final_val_loss"]["mean"] == pytest.approx(3.2725)
    assert [run["diverged_step"] for run in report["runs"]] == [None, None, 40, 100]
    assert (tmp_path / "p" / "val_loss_curves.png").read_bytes()[:8] == PNG_MAGIC


def test_repeat_keeps_diverged_seeds_and_never_reuses_a_run_id(tmp_path: Path) -> None:
    def fake_train(cmd: list[str]) -> int:
        run_id, seed = cmd[cmd.index("--run-id") + 1], int(cmd[cmd.index("--seed") + 1])
        log = tmp_path / f"{run_id}.jsonl"
        if seed == 1:  # diverges: the trainer logs it and exits non-zero
            log.write_text(
                '{"kind": "diverged", "step": 3, "total_steps": 100, "reason": "nan",'
                ' "train_time_ms": 1.0}\n'
            )
            return 1
        write_jsonl(log, 3.27, 10.0, seed)
        return 0

    config = RepeatConfig(runs=2, out_dir=tmp_path)
    first = run_repeats(config, [], run=fake_train)
    assert [p.name for p in first] == ["run_seed0.jsonl", "run_seed1.jsonl"]
    second = run_repeats(config, [], run=fake_train)
    assert [p.name for p in second] == ["run_seed0-2.jsonl", "run_seed1-2.jsonl"]
