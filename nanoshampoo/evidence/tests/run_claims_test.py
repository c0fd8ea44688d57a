"""No run trains twice: a run claimed by another command (or process) is skipped, waited for and
reused; a claim dies with its holder; two real ``compare`` commands into one out dir, and a
re-run after ``compare`` was killed, train every run exactly once."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from compare_test import FINALS, FakeTrainer, fake_resolve

from nanoshampoo.evidence.compare import CompareConfig, parse_setups, plan_runs, run_compare
from nanoshampoo.evidence.run_claims import RunClaim, claim_path

REPO = Path(__file__).resolve().parents[3]
# Holds a claim on argv[1], says so, then sleeps until it is killed.
HOLDER = """
import sys, time
from pathlib import Path
from nanoshampoo.evidence.run_claims import RunClaim
assert RunClaim(Path(sys.argv[1])).try_take()
print("held", flush=True)
time.sleep(120)
"""


def test_a_claim_is_exclusive_and_names_its_holder(tmp_path: Path) -> None:
    path = tmp_path / "setup" / ".run.claim"
    first, second = RunClaim(path), RunClaim(path)
    assert first.try_take()
    assert not second.try_take() and not second.held
    assert second.holder().startswith(f"pid {os.getpid()} on {socket.gethostname()} since ")
    first.release()
    assert second.try_take()
    second.release()


def test_a_claim_dies_with_its_holder(tmp_path: Path) -> None:
    path = tmp_path / ".run.claim"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        claim = RunClaim(path)
        assert not claim.try_take()
        assert claim.holder().startswith(f"pid {holder.pid} on ")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert claim.try_take(), "a SIGKILLed holder's claim must be free at once"
    claim.release()


def _config(out_dir: Path, setups: str = "adamw,shampoo") -> CompareConfig:
    return CompareConfig(
        setups=parse_setups(setups),
        seeds=1,
        out_dir=out_dir,
        train_args=("--num-iterations", "100"),
    )


@pytest.mark.parametrize("other_finishes", [True, False])
def test_a_claimed_run_is_skipped_then_waited_for_and_reused_or_trained(
    tmp_path: Path, other_finishes: bool
) -> None:
    """The test holds adamw seed 0's claim as another command would. compare trains shampoo
    first, then waits; on the wait, the other command trains adamw (or gives up without a log)
    and releases. compare reuses its run (or trains it itself), never trains it twice."""
    config = _config(tmp_path / "cmp")
    held_plan = plan_runs(config, fake_resolve, defaults={})[0]
    assert held_plan.label == "adamw seed 0"
    other = RunClaim(claim_path(held_plan.directory, held_plan.base_run_id))
    assert other.try_take()
    trainer, other_trainer = FakeTrainer(), FakeTrainer()
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        if line.startswith("[compare] waiting"):
            other.release()
            if other_finishes:  # the other command, which claims and trains adamw here
                run_compare(_config(config.out_dir, "adamw"), fake_resolve, other_trainer, print)

    groups = run_compare(config, fake_resolve, trainer, say)
    trained = [Path(command[command.index("--out-dir") + 1]).name for command in trainer.launched]
    by_other = [Path(c[c.index("--out-dir") + 1]).name for c in other_trainer.launched]
    assert (trained, by_other) == (
        (["shampoo"], ["adamw"]) if other_finishes else (["shampoo", "adamw"], [])
    )
    assert lines[1].startswith(f"[compare] skipped  adamw seed 0 for now: pid {os.getpid()} on ")
    assert lines[1].endswith("is training it; back to it after the others")
    waited = next(i for i, line in enumerate(lines) if line.startswith("[compare] waiting"))
    assert lines[waited].startswith(f"[compare] waiting  for adamw seed 0: pid {os.getpid()} on ")
    if other_finishes:
        assert lines[waited + 1 :] == [
            f"[compare] reused   adamw seed 0: final val_loss 4.0000 "
            f"({groups['adamw'][0].path}), trained meanwhile by another command"
        ]
    else:
        assert lines[waited + 1].startswith("[compare] start    adamw seed 0 (1/2)")
        assert lines[waited + 2].startswith("[compare] finished adamw seed 0")
    assert [run.final_val_loss for run in groups["adamw"]] == [FINALS["adamw"][0]]
    assert len(list((tmp_path / "cmp" / "adamw").glob("*.jsonl"))) == 1
    assert not other.held and RunClaim(other.path).try_take()  # compare released it


TINY = [
    "--model",
    "gpt-0.2m",
    "--num-iterations",
    "3",
    "--val-every",
    "0",
    "--val-tokens",
    "256",
    "--batch-size",
    "2",
    "--seq-len",
    "64",
    "--threads",
    "1",
    "--compile",
    "false",
    "--autocast",
    "off",
    "--progress",
    "false",
    "--save-final-checkpoint",
    "false",
]


def _compare(out_dir: Path, seeds: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "nanoshampoo",
        "compare",
        "--setups",
        "adamw",
        "--seeds",
        str(seeds),
        "--out-dir",
        str(out_dir),
        "--",
        *TINY,
        *extra,
    ]


def _trainers_started(setup_dir: Path) -> list[str]:
    """The run ids whose JSONL log a trainer began (its first record is the config)."""
    started = []
    for log in sorted(setup_dir.glob("*.jsonl")):
        first = log.read_text().splitlines()[:1]
        if first and json.loads(first[0])["kind"] == "config":
            started.append(log.stem)
    return started


@pytest.mark.slow
def test_two_compare_commands_into_one_out_dir_train_every_run_once(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    commands = [
        subprocess.Popen(
            _compare(out, 2), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    try:
        outputs = [command.communicate(timeout=500)[0] for command in commands]
    finally:
        for command in commands:  # a timed-out test leaves no compare behind
            if command.poll() is None:
                command.kill()
                command.wait()
    assert [command.returncode for command in commands] == [0, 0], outputs
    assert len(_trainers_started(out / "adamw")) == 2, outputs  # one trainer per seed
    for output in outputs:  # each command's leaderboard has both seeds
        assert re.search(r"\| adamw \(baseline\) \| tiny-adamw *\| 2 *\|", output), output
    joined = "\n".join(outputs)
    assert joined.count("[compare] finished adamw seed") == 2, joined
    # Whatever the timing, each command reused the run it did not train, and said so.
    assert joined.count("[compare] reused   adamw seed") == 2, joined


@pytest.mark.slow
def test_a_rerun_after_compare_was_killed_trains_the_run_once(tmp_path: Path) -> None:
    """compare is SIGKILLed once it has claimed the run and launched its trainer; a re-run at
    once takes the claim over (its holder is dead) and trains the run, and the killed
    command's trainer, which died with it, never writes a log."""
    out = tmp_path / "cmp"
    killed = subprocess.Popen(
        _compare(out, 1), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 300
        while not list((out / "adamw").glob("*.out")):  # the trainer was launched
            assert killed.poll() is None and time.monotonic() < deadline, "no trainer launched"
            time.sleep(0.05)
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    rerun = subprocess.run(
        _compare(out, 1), cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "0 reused, 1 to train" in rerun.stdout
    assert "skipped" not in rerun.stdout and "waiting" not in rerun.stdout
    (line,) = [line for line in rerun.stdout.splitlines() if "[compare] start" in line]
    run_id = line.split(": run ", 1)[1].split(",", 1)[0]
    time.sleep(2.0)  # a surviving orphan would be writing its log by now
    assert _trainers_started(out / "adamw") == [run_id]
