"""Runs are never lost and every user error is one line: run ids, logs, divergence, start-up
checks, damaged checkpoints, and fault injection (kill -9 mid-checkpoint, a rank that dies)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from trainer_test import VOCAB, read_jsonl, tiny_config

from nanoshampoo.data.shards import write_shard
from nanoshampoo.evidence.logs import read_run
from nanoshampoo.train.checkpoint import read_checkpoint
from nanoshampoo.train.cli import main as cli_main
from nanoshampoo.train.config import TrainConfig, UserError
from nanoshampoo.train.run_log import RunLog, logged_source
from nanoshampoo.train.setups.adam import AdamConfig
from nanoshampoo.train.trainer import Trainer, TrainingDiverged

REPO = Path(__file__).resolve().parents[3]


def flags(cfg: TrainConfig, **overrides: Any) -> list[str]:
    """The command line that builds ``cfg`` with ``overrides`` (every field spelled out)."""
    fields = {**cfg.to_dict(), **overrides}
    argv = []
    for name, value in fields.items():
        if name == "preset":
            continue
        if name in ("profile_steps", "decay_branches"):
            value = ",".join(map(str, value))  # type: ignore[arg-type]
        argv += [
            "--" + name.replace("_", "-"),
            str(value).lower() if isinstance(value, bool) else str(value),
        ]
    return argv


def test_two_runs_started_in_the_same_second_get_different_ids(
    shards: dict[str, str], tmp_path: Path
) -> None:
    first = Trainer(tiny_config(shards, tmp_path, run_id=""))
    second = Trainer(tiny_config(shards, tmp_path, run_id=""))
    assert first.run_id != second.run_id
    assert first.log.jsonl_path != second.log.jsonl_path


def test_a_run_never_overwrites_an_existing_log(shards: dict[str, str], tmp_path: Path) -> None:
    done = Trainer(tiny_config(shards, tmp_path, num_iterations=1, val_every=0)).run()
    text, jsonl = done.text_log.read_text(), done.jsonl_log.read_text()
    with pytest.raises(UserError, match="--run-id run: .*run.txt already exists"):
        Trainer(tiny_config(shards, tmp_path, num_iterations=1))
    assert (done.text_log.read_text(), done.jsonl_log.read_text()) == (text, jsonl)


@pytest.mark.slow
def test_resume_appends_to_the_original_logs(shards: dict[str, str], tmp_path: Path) -> None:
    cfg = dict(run_id="", num_iterations=4, val_every=2, checkpoint_every=2)
    full = Trainer(tiny_config(shards, tmp_path, **cfg)).run()
    text, jsonl = full.text_log.read_text(), full.jsonl_log.read_text()
    checkpoint = tmp_path / f"{full.run_id}.ckpt" / "step_000002"
    # As if the run had stopped after step 2: a resume never replaces a later checkpoint.
    shutil.rmtree(tmp_path / f"{full.run_id}.ckpt" / "step_000004")
    resumed = Trainer(tiny_config(shards, tmp_path, resume=str(checkpoint), **cfg)).run()

    assert resumed.run_id == full.run_id
    assert full.text_log.read_text().startswith(text)
    assert full.jsonl_log.read_text().startswith(jsonl)
    appended = [json.loads(line) for line in full.jsonl_log.read_text()[len(jsonl) :].splitlines()]
    assert appended[0]["kind"] == "config"
    assert appended[0]["resumed_from"] == {
        "checkpoint": str(checkpoint),
        "run_id": full.run_id,
        "step": 2,
    }
    vals = {r["step"]: r["val_loss"] for r in read_jsonl(full.jsonl_log) if r["kind"] == "val"}
    assert [(r["step"], r["val_loss"]) for r in appended if r["kind"] == "val"] == [
        (2, vals[2]),
        (4, vals[4]),
    ]
    assert read_run(full.jsonl_log).final_val_loss == resumed.final_val_loss == full.final_val_loss


def test_jsonl_writes_nonfinite_floats_as_strings(tmp_path: Path) -> None:
    log = RunLog(str(tmp_path), "r", enabled=True)
    log.start({"kind": "config", "run_id": "r", "config": {"embed_lr": math.inf}}, "env")
    log.val(3, 10, math.nan, 1.0)
    log.train(3, 10, -math.inf, 1.0, 5.0, 0.01)
    records = [
        json.loads(line, parse_constant=pytest.fail)
        for line in (tmp_path / "r.jsonl").read_text().splitlines()
    ]
    assert records[0]["config"]["embed_lr"] == "inf"
    assert records[1]["val_loss"] == "nan" and records[2]["train_loss"] == "-inf"


@pytest.mark.parametrize(
    "checkpoint_every, reason",
    [
        (0, "train loss is nan; first non-finite parameter: embed.weight"),
        (1, "non-finite parameter before the checkpoint; first non-finite parameter: embed.weight"),
    ],
)
def test_nonfinite_run_stops_naming_step_and_parameter_and_keeps_the_good_checkpoint(
    checkpoint_every: int,
    reason: str,
    shards: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    good = Trainer(
        tiny_config(
            shards,
            tmp_path,
            run_id="good",
            num_iterations=2,
            val_every=0,
            save_final_checkpoint=True,
        )
    ).run()
    assert good.last_checkpoint is not None
    argv = flags(
        tiny_config(shards, tmp_path, run_id="bad", num_iterations=6, val_every=0),
        resume=str(good.last_checkpoint),
        checkpoint_every=checkpoint_every,
    )
    # The config refuses an inf lr: give the built optimizer one behind the config's back.
    monkeypatch.setattr(
        AdamConfig,
        "lrs",
        lambda self: {"embed": math.inf, "head": self.head_lr, "scalar": self.scalar_lr},
    )
    # Step 2 (the first after the resume) makes the embedding inf; step 3 notices.
    assert cli_main(argv) == 3
    err = capsys.readouterr().err.strip()
    assert err == f"python -m nanoshampoo.train: diverged at step 3: {reason}"
    records = read_jsonl(tmp_path / "bad.jsonl")
    assert records[-1] == {
        "kind": "diverged",
        "step": 3,
        "total_steps": 6,
        "reason": reason,
        "train_time_ms": records[-1]["train_time_ms"],
    }
    assert "final" not in {r["kind"] for r in records}
    assert (tmp_path / "bad.txt").read_text().splitlines()[-1] == f"diverged at step:3/6: {reason}"
    assert not (tmp_path / "bad.ckpt" / "step_000003").exists()
    kept = read_checkpoint(good.last_checkpoint, rank=0, world_size=1)
    assert all(torch.isfinite(t).all() for t in kept.shared["model"].values())


def test_trainer_raises_training_diverged_for_an_inf_learning_rate(
    shards: dict[str, str], tmp_path: Path
) -> None:
    trainer = Trainer(tiny_config(shards, tmp_path, optimizer="adamw", val_every=0))
    # The config refuses an inf lr: set it on the built optimizer.
    for group in trainer.setup.optimizers[0].param_groups:
        group["peak_lr"] = math.inf
    with pytest.raises(TrainingDiverged, match="train loss is nan"):
        trainer.run()


@pytest.fixture
def bad_shards(tmp_path: Path) -> dict[str, str]:
    root = tmp_path / "bad"
    tokens = np.arange(4000) % VOCAB
    write_shard(root / "ok_train_000001.bin", tokens)
    write_shard(root / "ok_val_000000.bin", tokens[:2000])
    write_shard(root / "big_val_000000.bin", np.where(tokens[:2000] == 7, VOCAB + 6, tokens[:2000]))
    return {
        "train": str(root / "ok_train_*.bin"),
        "val": str(root / "ok_val_*.bin"),
        "big_val": str(root / "big_val_*.bin"),
        "missing": str(root / "nothing_*.bin"),
    }


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(val_files="missing"), "--val-files: no shard files match .*nothing_"),
        (dict(val_tokens=128 * 16), r"--val-tokens: val_tokens=2048 exceeds"),
        (
            dict(val_files="big_val"),
            f"--val-files .*big_val_000000.bin: holds token id {VOCAB + 6}",
        ),
        (dict(resume="missing"), "--resume .*nothing_"),
    ],
)
def test_startup_checks_fail_before_any_step(
    overrides: dict[str, str], message: str, bad_shards: dict[str, str], tmp_path: Path
) -> None:
    fields: dict[str, Any] = dict(
        train_files=bad_shards["train"], val_files=bad_shards["val"], val_every=0
    )
    fields.update(
        {k: bad_shards.get(v, v) if isinstance(v, str) else v for k, v in overrides.items()}
    )
    with pytest.raises(UserError, match=message):
        Trainer(tiny_config({}, tmp_path / "out", **fields))
    assert not (tmp_path / "out" / "run.jsonl").exists()


@pytest.fixture(scope="module")
def checkpoint(shards: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    result = Trainer(
        tiny_config(
            shards,
            out,
            optimizer="adamw",
            num_iterations=1,
            val_every=0,
            save_final_checkpoint=True,
        )
    ).run()
    assert result.last_checkpoint is not None
    return result.last_checkpoint


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_damaged_checkpoint_is_a_one_line_error(
    damage: str,
    checkpoint: Path,
    shards: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    broken = tmp_path / "step_000001"
    broken.mkdir()
    data = (checkpoint / "rank0.pt").read_bytes()
    (broken / "rank0.pt").write_bytes(
        {"empty": b"", "truncated": data[: len(data) // 2], "garbage": b"\x80\x02not a pickle"}[
            damage
        ]
    )
    argv = flags(tiny_config(shards, tmp_path, optimizer="adamw"), resume=str(broken))
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert f"{broken / 'rank0.pt'} is not a readable checkpoint" in err
    assert "weights_only" not in err and "Traceback" not in err


def test_out_dir_that_is_a_file_is_a_one_line_error(
    shards: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert cli_main(flags(tiny_config(shards, not_a_dir))) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        f"python -m nanoshampoo.train: error: --out-dir {not_a_dir}: is a file, not a directory"
    )


# A training process whose checkpoint write of step FAULT_STEP on rank FAULT_RANK misbehaves:
# "hang" writes half a file, signals through FAULT_MARKER and sleeps (the test kills it);
# "die" kills its own process in the middle of the write.
FAULTY_TRAINER = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from nanoshampoo.train import checkpoint
    write = checkpoint._write_record

    def faulty_write(record, path):
        if (record["step"] == int(os.environ["FAULT_STEP"])
                and os.environ.get("RANK", "0") == os.environ["FAULT_RANK"]):
            path.write_bytes(b"half a checkpoint")
            if os.environ["FAULT"] == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            Path(os.environ["FAULT_MARKER"]).write_text("writing")
            time.sleep(120)
        write(record, path)

    checkpoint._write_record = faulty_write
    from nanoshampoo.train.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def faulty_env(**extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "NANOSHAMPOO_KEEP_MALLOC": "1",
        "OMP_NUM_THREADS": "1",
    }
    env.update(extra)
    return env


@pytest.mark.slow
def test_kill_9_during_a_checkpoint_write_keeps_the_previous_checkpoint(
    shards: dict[str, str], tmp_path: Path
) -> None:
    marker = tmp_path / "marker"
    cfg = tiny_config(
        shards,
        tmp_path,
        optimizer="adamw",
        run_id="killed",
        num_iterations=6,
        checkpoint_every=2,
        val_every=0,
    )
    process = subprocess.Popen(
        [sys.executable, "-c", FAULTY_TRAINER, *flags(cfg)],
        cwd=tmp_path,
        env=faulty_env(FAULT="hang", FAULT_STEP="4", FAULT_RANK="0", FAULT_MARKER=str(marker)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert process.poll() is None, process.stderr.read().decode()  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the run never reached the step-4 checkpoint"
        time.sleep(0.1)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)

    checkpoints = tmp_path / "killed.ckpt"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000002", "step_000004.partial"]
    assert read_checkpoint(checkpoints / "step_000002", rank=0, world_size=1).step == 2
    # The log holds the source of what ran: AdamW needs no Shampoo code.
    source = logged_source(tmp_path / "killed.txt")
    headers = [line for line in source.splitlines() if line.startswith("# ===== ")]
    assert "# ===== nanoshampoo/train/trainer.py =====" in headers
    assert not [h for h in headers if "/optim/shampoo/" in h]

    uninterrupted = Trainer(
        tiny_config(
            shards, tmp_path, optimizer="adamw", run_id="full", num_iterations=6, val_every=0
        )
    ).run()
    resumed = Trainer(
        tiny_config(
            shards,
            tmp_path,
            optimizer="adamw",
            run_id="resumed",
            num_iterations=6,
            val_every=0,
            resume=str(checkpoints / "step_000002"),
        )
    ).run()

    def train_losses(path: Path) -> dict[int, float]:
        return {r["step"]: r["train_loss"] for r in read_jsonl(path) if r["kind"] == "train"}

    after = train_losses(resumed.jsonl_log)
    assert sorted(after) == [3, 4, 5, 6]
    assert after == {s: train_losses(uninterrupted.jsonl_log)[s] for s in after}
    assert resumed.final_val_loss == uninterrupted.final_val_loss


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.distributed
def test_when_one_rank_dies_the_other_fails_within_the_timeout(
    shards: dict[str, str], tmp_path: Path
) -> None:
    cfg = tiny_config(
        shards,
        tmp_path,
        optimizer="adamw",
        run_id="two",
        num_iterations=6,
        checkpoint_every=2,
        val_every=0,
        dist_timeout_s=20.0,
    )
    port = str(_free_port())
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", FAULTY_TRAINER, *flags(cfg)],
            cwd=tmp_path,
            env=faulty_env(
                FAULT="die",
                FAULT_STEP="4",
                FAULT_RANK="1",
                FAULT_MARKER="",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="2",
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for rank in range(2)
    ]
    start = time.monotonic()
    codes = [p.wait(timeout=180) for p in processes]
    survivor_err = processes[0].stderr.read().decode()  # type: ignore[union-attr]
    assert codes[1] == -signal.SIGKILL
    assert codes[0] != 0, "the surviving rank must fail, not finish or hang"
    assert "RuntimeError" in survivor_err  # the failed collective, with its traceback
    checkpoints = tmp_path / "two.ckpt"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000002", "step_000004.partial"]
    assert sorted(p.name for p in (checkpoints / "step_000002").iterdir()) == [
        "rank0.pt",
        "rank1.pt",
    ]
    assert time.monotonic() - start < 150


@pytest.mark.parametrize("optimizer", ["adamw", "shampoo-distadam"])
def test_a_nonfinite_gradient_with_a_finite_loss_stops_the_run_naming_it(
    optimizer: str, shards: dict[str, str], tmp_path: Path
) -> None:
    """The head's gradient turns NaN at the first step; the loss stays finite. Under AdamW the
    trainer's own check finds it; under DistAdam (which owns the head there, and whose
    reduce-scatter may still read the gradient) DistAdam's check does, before Shampoo steps."""
    trainer = Trainer(tiny_config(shards, tmp_path, optimizer=optimizer, val_every=0))
    head = trainer.model.lm_head.weight
    distadam_owned = optimizer.endswith("distadam")
    assert any(p is head for p in trainer.guard.checked_params) != distadam_owned
    matrices = [p.detach().clone() for p in trainer.setup.groups["matrix"]]
    head.register_hook(lambda grad: torch.full_like(grad, math.nan))
    with pytest.raises(TrainingDiverged) as caught:
        trainer.run()
    assert (caught.value.step, caught.value.reason) == (
        0,
        "non-finite gradient; first non-finite gradient: lm_head.weight",
    )
    assert all(torch.equal(p, q) for p, q in zip(trainer.setup.groups["matrix"], matrices))
