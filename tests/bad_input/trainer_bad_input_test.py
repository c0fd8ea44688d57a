"""Bad input to ``python -m nanoshampoo.train``: the run, checkpoint and path surface.

Every case: exit status 2 (130 for Ctrl-C), one line naming the flag or file, and nothing that
existed on disk changed."""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from bad_input_fixtures import (
    EXIT_USER_ERROR,
    one_error_line,
    snapshot,
    train_argv,
    write_token_shards,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoshampoo.train.cli import PROG, main
from nanoshampoo.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_token_shards(tmp_path_factory.mktemp("shards"))


@pytest.fixture(scope="module")
def checkpoint(shards: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A good 2-step checkpoint of ``T``: ``<out>/R.ckpt/step_000002``."""
    out = tmp_path_factory.mktemp("run")
    assert main(train_argv(shards, out)) == 0
    return out / "R.ckpt" / "step_000002"


def test_a_run_never_replaces_an_existing_checkpoint(
    checkpoint: Path, shards: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    shutil.copytree(checkpoint.parent, out / "R.ckpt")  # the run's logs were moved away
    before = snapshot(tmp_path)
    assert main(train_argv(shards, out)) == EXIT_USER_ERROR
    one_error_line(capsys, PROG, "--run-id R", "step_000002")
    assert snapshot(tmp_path) == before


def test_a_resume_into_its_own_run_id_never_replaces_a_later_checkpoint(
    shards: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(train_argv(shards, tmp_path, checkpoint_every=1)) == 0
    capsys.readouterr()
    before = snapshot(tmp_path)
    argv = train_argv(shards, tmp_path, resume=tmp_path / "R.ckpt" / "step_000001")
    assert main(argv) == EXIT_USER_ERROR
    one_error_line(capsys, PROG, "--run-id R", "step_000002")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "out_dir, names",
    [
        ("{tmp}/file/out", ["--out-dir", "is a file"]),
        ("{tmp}/file", ["--out-dir", "not a directory"]),
        ("/proc/x", ["--out-dir", "/proc/x"]),
        ("/sys/x", ["--out-dir", "/sys/x", "Permission denied"]),  # unwritable even for root
        ("{tmp}/" + "d" * 300, ["--out-dir", "exceeds"]),
    ],
)
def test_an_out_dir_that_cannot_be_written_is_one_line(
    out_dir: str,
    names: list[str],
    shards: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "file").write_text("x")
    before = snapshot(tmp_path)
    assert main(train_argv(shards, Path(out_dir.format(tmp=tmp_path)))) == EXIT_USER_ERROR
    one_error_line(capsys, PROG, *names)
    assert snapshot(tmp_path) == before


# linux/capability.h and linux/prctl.h
CAP_DAC_OVERRIDE = 1
PR_CAPBSET_DROP = 24
REPO = Path(__file__).resolve().parents[2]


def _trainer_env() -> dict[str, str]:
    """The environment of a real trainer process of this checkout: one thread, no re-exec."""
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "NANOSHAMPOO_KEEP_MALLOC": "1",
        "OMP_NUM_THREADS": "1",
    }


def _without_the_permission_override() -> None:
    """``preexec_fn`` of a child of root: drop CAP_DAC_OVERRIDE from its bounding set, so that
    after the exec the permission bits refuse it a write as they refuse any other user."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE)")


@pytest.mark.slow  # a trainer process
def test_an_unwritable_out_dir_is_one_line(shards: dict[str, str], tmp_path: Path) -> None:
    """A directory without write permission (0o555), in a real trainer process. Root writes
    anywhere through CAP_DAC_OVERRIDE, so under root (as CI runs) the process runs without it."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    done = subprocess.run(
        [sys.executable, "-m", "nanoshampoo.train", *train_argv(shards, locked / "out")],
        env=_trainer_env(),
        capture_output=True,
        text=True,
        preexec_fn=_without_the_permission_override if os.geteuid() == 0 else None,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == EXIT_USER_ERROR and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{PROG}: error: --out-dir "), lines[0]
    assert "Permission denied" in lines[0], lines[0]
    assert not any(locked.iterdir())


def test_a_300_character_run_id_is_one_line(
    shards: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(train_argv(shards, tmp_path / "out", run_id="r" * 300)) == EXIT_USER_ERROR
    one_error_line(capsys, PROG, "--run-id", "too long")
    assert not any((tmp_path / "out").glob("r*"))


def _damaged(checkpoint: Path, tmp_path: Path, change: Any) -> Path:
    """A copy of ``checkpoint`` whose ``rank0.pt`` record went through ``change(record)``."""
    copy = tmp_path / "damaged" / "step_000002"
    shutil.copytree(checkpoint, copy)
    record = torch.load(copy / "rank0.pt", weights_only=True)
    change(record)
    torch.save(record, copy / "rank0.pt")
    return copy


@pytest.mark.parametrize(
    "change, names",
    [
        (lambda r: r.pop("loader"), ["'loader'", "missing"]),
        (lambda r: r.update(step="abc"), ["'step'", "'abc'"]),
        (lambda r: r.update(optimizers="x"), ["'optimizers'", "'x'"]),
        (lambda r: r.update(train_time_ms=float("nan")), ["'train_time_ms'"]),
        (
            lambda r: r["loader"].update(shard_names=["other_000001.bin"]),
            ["shard_names", "other_000001.bin"],
        ),
        (lambda r: r.update(model={}), ["does not fit"]),
        (lambda r: r.update(optimizers=[{"state": {}, "param_groups": []}]), ["does not fit"]),
    ],
)
def test_a_hand_made_checkpoint_is_one_line_naming_the_file(
    change: Any,
    names: list[str],
    checkpoint: Path,
    shards: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    damaged = _damaged(checkpoint, tmp_path, change)
    before = snapshot(tmp_path)
    assert main(train_argv(shards, tmp_path / "out", run_id="S", resume=damaged)) == 2
    one_error_line(capsys, PROG, "--resume", str(damaged), *names)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("flags", [dict(batch_size=8), dict(seq_len=16)])
def test_resuming_with_another_batch_layout_is_one_line(
    flags: dict[str, int],
    checkpoint: Path,
    shards: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = train_argv(shards, tmp_path / "out", run_id="S", resume=checkpoint, **flags)
    assert main(argv) == EXIT_USER_ERROR
    one_error_line(
        capsys, PROG, "--resume", str(checkpoint), "--batch-size", "--seq-len", "tokens_per_step"
    )
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_resuming_on_other_shards_is_one_line(
    checkpoint: Path, shards: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = write_token_shards(tmp_path / "other")
    renamed = Path(other["train"]).parent / "syn_train_000007.bin"
    Path(other["train"].replace("*", "000001")).rename(renamed)
    argv = train_argv(other, tmp_path / "out", run_id="S", resume=checkpoint)
    before = snapshot(tmp_path)
    assert main(argv) == EXIT_USER_ERROR
    one_error_line(capsys, PROG, "--resume", "shard_names", "syn_train_000007.bin")
    assert snapshot(tmp_path) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_device_cuda_without_a_gpu_is_one_line(
    shards: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(train_argv(shards, tmp_path / "out", device="cuda")) == EXIT_USER_ERROR
    one_error_line(capsys, PROG, "--device cuda")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("timeout", ["inf", "1e300"])
def test_an_unusable_dist_timeout_is_one_line(
    timeout: str, shards: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(train_argv(shards, tmp_path / "out", dist_timeout_s=timeout)) == 2
    one_error_line(capsys, PROG, "--dist-timeout-s")
    assert not (tmp_path / "out").exists()


def test_a_model_too_big_for_memory_is_refused_with_the_estimate(
    shards: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(train_argv(shards, tmp_path / "out", vocab_size=1_000_000_000)) == 2
    line = one_error_line(capsys, PROG, "--vocab-size 1000000000", "GiB", "available")
    assert "parameters" in line
    assert not any((tmp_path / "out").glob("R*"))


def test_ctrl_c_prints_the_step_the_checkpoint_and_the_resume_command(
    shards: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    train_step = Trainer._train_step

    def interrupted_at_step_3(
        self: Trainer, step: int, schedule_steps: int, *rest: bool
    ) -> torch.Tensor:
        if step == 3:
            raise KeyboardInterrupt
        return train_step(self, step, schedule_steps, *rest)

    argv = train_argv(shards, tmp_path, num_iterations=6, checkpoint_every=2)
    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "_train_step", interrupted_at_step_3)
        assert main(argv) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    checkpoint = tmp_path / "R.ckpt" / "step_000002"
    assert f"interrupted after step 3 of 6; last checkpoint: {checkpoint}" in err
    command = err.strip().splitlines()[-1]
    assert command.startswith(f"continue with: {PROG} ")
    resume_argv = shlex.split(command.removeprefix(f"continue with: {PROG} "))
    assert resume_argv[-2:] == ["--resume", str(checkpoint)]
    assert main(resume_argv) == 0  # continues the same run id, appending to its logs
    assert (tmp_path / "R.ckpt" / "step_000006").is_dir()
    assert '"kind": "final"' in (tmp_path / "R.jsonl").read_text()


FIELDS = [
    "step",
    "world_size",
    "train_time_ms",
    "loader",
    "optimizers",
    "model",
    "cpu_rng",
    "cuda_rng",
    "run_id",
    "format_version",
]


@settings(
    max_examples=12,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    field=st.sampled_from(FIELDS),
    value=st.one_of(
        st.none(),
        st.integers(-2, 3),
        st.floats(),
        st.text(max_size=4),
        st.lists(st.integers(0, 3), max_size=2),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    ),
)
def test_any_corrupted_checkpoint_field_is_one_line_or_loads(
    field: str,
    value: Any,
    checkpoint: Path,
    shards: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    tmp = tmp_path_factory.mktemp("corrupt")
    damaged = _damaged(checkpoint, tmp, lambda r: r.__setitem__(field, value))
    before = snapshot(tmp)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(
            train_argv(
                shards, tmp / "out", run_id="S", resume=damaged, save_final_checkpoint="false"
            )
        )
    assert status in (0, EXIT_USER_ERROR), err.getvalue()
    if status == EXIT_USER_ERROR:
        lines = err.getvalue().strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{PROG}: error: --resume"), lines
        assert str(damaged) in lines[0]
    after = snapshot(tmp)
    assert {k: v for k, v in after.items() if not k.startswith("out")} == before


def _with_the_default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow  # a trainer process
def test_a_real_sigint_exits_130_with_the_resume_command(
    shards: dict[str, str], tmp_path: Path
) -> None:
    """The signal itself, in a real ``python -m nanoshampoo.train`` process, which starts with
    SIGINT at its default action as a shell's foreground job does: a process started in the
    background inherits SIGINT ignored (so would pytest's, started so), Python then installs no
    handler, and the run trained on through the signal. No wait here has a deadline of its own:
    on a loaded machine the start alone can take minutes, and only the suite's timeout bounds
    the test."""
    # Eager: a run this long would compile under --compile auto, and the test is about SIGINT.
    argv = train_argv(
        shards, tmp_path, num_iterations=100_000, checkpoint_every=1, log_every=1, compile="false"
    )
    # Its stderr goes to a file, not a pipe: reading a pipe waits for every process that holds
    # it, this one's children included, and a file is there to read whenever it is needed.
    err_path = tmp_path / "trainer.err"
    with err_path.open("w") as err_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "nanoshampoo.train", *argv],
            env=_trainer_env(),
            stdout=subprocess.DEVNULL,
            stderr=err_file,
            preexec_fn=_with_the_default_sigint,
        )
    log = tmp_path / "R.jsonl"
    while '"step": 3,' not in (log.read_text() if log.exists() else ""):
        assert process.poll() is None, err_path.read_text()
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    process.wait()
    err = err_path.read_text()
    assert process.returncode == 130, err
    assert "Traceback" not in err
    assert f"{PROG}: interrupted after step " in err
    resume = err.strip().splitlines()[-1]
    checkpoint = Path(resume.rsplit("--resume ", 1)[1])
    assert resume.startswith(f"continue with: {PROG} ")
    assert checkpoint.parent == tmp_path / "R.ckpt"
    assert checkpoint.is_dir() and checkpoint == max((tmp_path / "R.ckpt").glob("step_??????"))


def _nan_first_weight(record: dict[str, Any]) -> None:
    next(iter(record["model"].values())).view(-1)[0] = float("nan")


def _inf_first_moment(record: dict[str, Any]) -> None:
    state = next(iter(record["optimizers"][0]["state"].values()))
    state["exp_avg_sq"].view(-1)[-1] = float("inf")


@pytest.mark.parametrize(
    "damage, names",
    [
        (_nan_first_weight, ["rank0.pt", "model[", "NaN or Inf"]),
        (_inf_first_moment, ["rank0.pt", "optimizers[0]", "exp_avg_sq", "NaN or Inf"]),
        (lambda r: r.__setitem__("run_id", "../escaped"), ["rank0.pt", "'run_id'", "../escaped"]),
        (lambda r: r.__setitem__("run_id", "x" * 300), ["rank0.pt", "'run_id'", "too long"]),
        (
            lambda r: r.__setitem__("cpu_rng", torch.zeros(3, dtype=torch.uint8)),
            ["rank0.pt", "'cpu_rng'"],
        ),
    ],
    ids=["nan-weight", "inf-moment", "run-id-escapes", "run-id-too-long", "rng-size"],
)
def test_a_damaged_checkpoint_is_refused_before_anything_is_written(
    damage: Any,
    names: list[str],
    checkpoint: Path,
    shards: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Before: NaN weights or moments loaded and the run diverged after starting its log; a
    # run_id "../escaped" named the resumed run's logs outside --out-dir (no --run-id given);
    # a wrong-size RNG state was a RuntimeError traceback.
    ckpt = tmp_path / "ckpt" / "step_000002"
    shutil.copytree(checkpoint, ckpt)
    record = torch.load(ckpt / "rank0.pt", weights_only=True)
    damage(record)
    torch.save(record, ckpt / "rank0.pt")
    before = snapshot(tmp_path)
    argv = train_argv(shards, tmp_path / "out", run_id="", num_iterations=4, resume=ckpt)
    assert main(argv) == EXIT_USER_ERROR
    one_error_line(capsys, PROG, "--resume", *names)
    assert snapshot(tmp_path) == before
