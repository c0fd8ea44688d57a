"""One training run of a tuning trial: a trainer subprocess whose decay branches feed a pruner.

A trial trains its point at each of its seeds; the first seed's run also trains the rungs'
decay branches (``--decay-branches F,...``: the trainer forks the run and decays each fork to
its end at ``F`` x the budget, writing ``{"kind": "branch", "fraction": F, "steps": N_b,
"val_loss": x, ...}`` to the run's JSONL once that branch is complete). :func:`train_seed`
launches the trainer, follows its JSONL while it runs and hands every branch record to
``on_branch``; when that says stop, the trainer's process group is killed and the run's
manifest renamed ``RUN_ID.pruned.json``: the run stays on disk (without a ``final`` record, unless
the trainer was quicker than the poll) and is never reused as a finished run. A value a pruner
sees is therefore always a complete decayed run, never a loss read mid-schedule.

Runs are ``compare`` runs (a manifest beside the logs, the same run ids): a seed whose run
already ended in the trial's directory with the same effective config is read back, its
branches replayed to ``on_branch``, and not trained again.

Synchronous halving (``tune_halving``) trains a run in segments: the trainer pauses itself at a
rung (``--pause-at-step``: a checkpoint and a ``paused`` record, exit 0), and
:func:`continue_seed` resumes the same run id from its latest checkpoint (its logs are appended
to, every branch so far replayed to ``on_branch``). A ``SeedResult`` says where a run paused.

The trainer is started in its own session (so the kill reaches every process of a
``torchrun`` launch) and, on Linux, with a parent-death signal, so it does not outlive a worker
that was killed.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from nanoshampoo.evidence.compare import (
    MANIFEST_SUFFIX,
    PlannedRun,
    find_reusable,
    last_output_line,
    write_manifest,
)
from nanoshampoo.evidence.logs import LogFormatError, RunRecord, read_run
from nanoshampoo.evidence.repeat import fresh_run_id, train_command
from nanoshampoo.evidence.trainer_process import spawn_trainer, stop_trainer

# (trainer flags, run id, out dir) -> the command line that trains them.
TrainCommand = Callable[[Sequence[str], str, Path], list[str]]
# A stopped run's manifest is renamed to this, so that it is never reused.
PRUNED_SUFFIX = ".pruned.json"
# Seconds between two reads of a running trainer's JSONL.
POLL_S = 1.0


def trainer_command(nproc: int) -> TrainCommand:
    """``python -m nanoshampoo.train`` (``torchrun`` with ``nproc`` processes when > 1)."""
    return partial(train_command, nproc=nproc)


def branch_flags(rungs: Sequence[float]) -> tuple[str, ...]:
    """The trainer flags that make a run also train the decay branches at ``rungs``
    (fractions of its steps); none without rungs. The one place tune asks for branches."""
    return ("--decay-branches", ",".join(f"{f:g}" for f in rungs)) if rungs else ()


@dataclass(frozen=True)
class Branch:
    """A decay branch's result: the run decayed to its end at ``steps`` (``fraction`` of the
    budget). ``val_loss`` is ``inf`` for a branch that diverged or ended non-finite."""

    fraction: float
    steps: int
    val_loss: float


def parse_branch(record: Mapping[str, Any]) -> Branch:
    """A ``{"kind": "branch", ...}`` record (``ValueError`` when a field is missing)."""
    try:
        loss = float(record["val_loss"])  # "nan", "inf" and numbers alike
        steps, fraction = int(record["steps"]), float(record["fraction"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"branch record {dict(record)!r}: {exc}") from None
    diverged = "diverged" in record or not math.isfinite(loss)
    return Branch(fraction, steps, math.inf if diverged else loss)


@dataclass(frozen=True)
class SeedResult:
    """What one seed's run gave: its ended run (``None`` when it was stopped), the branches it
    reported, whether ``on_branch`` stopped it, and whether it was an earlier run reused."""

    seed: int
    run: RunRecord | None
    branches: tuple[Branch, ...]
    stopped: bool
    reused: bool
    log: Path
    # The checkpoint a run paused at (``--pause-at-step``); None when it ended or was stopped.
    paused: Path | None = None

    @property
    def run_id(self) -> str:
        return self.log.stem

    @property
    def final(self) -> float:
        """The final validation loss; NaN when the run diverged or was stopped."""
        return math.nan if self.run is None else self.run.final_val_loss


def _records(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The complete JSONL lines of ``path`` after byte ``offset``, and the offset after them
    (a line still being written waits for the next read)."""
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    records = []
    for line in data[:end].splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # not ours to judge: read_run reports a damaged log at the end
        if isinstance(record, dict):
            records.append(record)
    return records, offset + end


def _branches(records: Sequence[Mapping[str, Any]]) -> Iterator[Branch]:
    return (parse_branch(r) for r in records if r.get("kind") == "branch")


def train_seed(
    plan: PlannedRun,
    label: str,
    nproc: int,
    command: TrainCommand,
    on_branch: Callable[[Branch], bool],
    say: Callable[[str], None],
    defaults: Mapping[str, Any] | None = None,
    poll_s: float = POLL_S,
    reuse_from: Sequence[Path] = (),
) -> SeedResult:
    """Train (or reuse) ``plan``'s run; ``on_branch`` sees each branch, True stops the run.

    An ended run of the same config in ``plan.directory`` or one of ``reuse_from`` is reused.
    Raises ``RuntimeError`` naming the run (``label``) and its output when the trainer exits
    without a finished or diverged log (or fails after finishing).
    """
    reused = next(
        (
            run
            for directory in (plan.directory, *reuse_from)
            if (run := find_reusable(directory, plan.config, nproc, defaults))
        ),
        None,
    )
    if reused is not None:
        replayed: list[Branch] = []
        for branch in _branches(_records(reused.path, 0)[0]):
            replayed.append(branch)
            if on_branch(branch):
                return SeedResult(plan.seed, None, tuple(replayed), True, True, reused.path)
        return SeedResult(plan.seed, reused, tuple(replayed), False, True, reused.path)
    run_id = fresh_run_id(plan.directory, plan.base_run_id)
    argv = command(plan.argv, run_id, plan.directory)
    write_manifest(plan, run_id, argv, nproc)
    output = plan.directory / f"{run_id}.out"
    say(f"[tune] start    {label}: run {run_id}, output {output}")
    return _follow(plan, label, run_id, argv, output, on_branch, poll_s)


def continue_seed(
    plan: PlannedRun,
    label: str,
    run_id: str,
    target_step: int | None,
    command: TrainCommand,
    on_branch: Callable[[Branch], bool],
    say: Callable[[str], None],
    poll_s: float = POLL_S,
) -> SeedResult:
    """Resume run ``run_id`` of ``plan.directory`` (paused earlier) from its latest checkpoint
    with ``plan.argv`` (which says where it pauses next: ``target_step``, None for the end).

    Every branch its log holds is handed to ``on_branch``. When a trial
    that continued it died after its trainer reached ``target_step``, the run is not trained
    again: that checkpoint is the pause. Raises ``RuntimeError`` when the run has no checkpoint
    (its files were moved) or the trainer fails.
    """
    from nanoshampoo.train.checkpoint import latest_checkpoint  # imports torch

    checkpoint = latest_checkpoint(str(plan.directory), run_id)
    log = plan.directory / f"{run_id}.jsonl"
    if checkpoint is None:
        raise RuntimeError(
            f"{label}: run {run_id} has no checkpoint in {plan.directory} to continue from"
        )
    step = int(checkpoint.name[len("step_") :])
    if target_step is not None and step >= target_step:
        branches = tuple(_branches(_records(log, 0)[0]))
        for branch in branches:
            on_branch(branch)
        return SeedResult(plan.seed, None, branches, False, False, log, paused=checkpoint)
    # One output file per try from this checkpoint (a try that died keeps its own).
    output = plan.directory / f"{fresh_run_id(plan.directory, f'{run_id}.s{step:06d}')}.out"
    argv = command((*plan.argv, "--resume", str(checkpoint)), run_id, plan.directory)
    say(f"[tune] continue {label}: run {run_id} from step {step}, output {output}")
    return _follow(plan, label, run_id, argv, output, on_branch, poll_s)


def _follow(
    plan: PlannedRun,
    label: str,
    run_id: str,
    argv: list[str],
    output: Path,
    on_branch: Callable[[Branch], bool],
    poll_s: float,
) -> SeedResult:
    """Run the trainer ``argv``, hand each branch of its log to ``on_branch`` (True stops the
    run: see the module docstring), and say how the run ended."""
    log = plan.directory / f"{run_id}.jsonl"
    process = spawn_trainer(argv, output)
    seen: list[Branch] = []
    offset, stopped = 0, False
    paused: Path | None = None  # the checkpoint of a paused record ending the last segment
    try:
        while not stopped:
            ended = process.poll() is not None
            records, offset = _records(log, offset)
            for record in records:
                if record.get("kind") == "config":
                    paused = None  # a resume appends a new segment
                elif record.get("kind") == "paused" and isinstance(record.get("checkpoint"), str):
                    paused = Path(record["checkpoint"])
            for branch in _branches(records):
                seen.append(branch)
                if on_branch(branch):
                    stopped = True
                    break
            if ended:
                break
            try:  # returns as soon as the trainer exits: no run waits out a whole poll
                process.wait(poll_s)
            except subprocess.TimeoutExpired:
                pass
    finally:
        if process.poll() is None:
            stop_trainer(process)
    if stopped:
        # A trainer quicker than the poll may have finished before the kill: either way the
        # run is a pruned trial's, never one to reuse, and a run without a manifest never is.
        manifest = plan.directory / f"{run_id}{MANIFEST_SUFFIX}"
        manifest.rename(plan.directory / f"{run_id}{PRUNED_SUFFIX}")
        return SeedResult(plan.seed, None, tuple(seen), True, False, log)
    if paused is not None and process.returncode == 0:
        return SeedResult(plan.seed, None, tuple(seen), False, False, log, paused=paused)
    try:
        run = read_run(log)
    except LogFormatError as exc:
        raise RuntimeError(
            f"{label} failed (exit status {process.returncode}): "
            f"{last_output_line(output)}; log: {exc}; output: {output}"
        ) from None
    if process.returncode != 0 and not run.diverged:
        raise RuntimeError(
            f"{label} exited with status {process.returncode} after "
            f"finishing: {last_output_line(output)}; output: {output}"
        )
    return SeedResult(plan.seed, run, tuple(seen), False, False, log)
