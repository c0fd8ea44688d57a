"""Read training runs back from their speedrun ``.txt`` logs or ``.jsonl`` metric files.

Two formats describe the same run (the trainer writes both):

* ``<run_id>.txt`` -- the modded-nanogpt speedrun log: the full source of the training code
  (or one line naming the file beside the runs that holds it:
  ``nanoshampoo.train.run_log.logged_source`` reads either), then lines ``step:N/M val_loss:X
  train_time:Yms step_avg:Zms`` (and ``train_loss`` lines),
  then ``peak memory allocated: X MiB reserved: Y MiB``. Logs of the original
  modded-nanogpt records parse as well.
* ``<run_id>.jsonl`` -- one JSON object per line with ``"kind"`` in ``config``, ``train``,
  ``val``, ``final``, ``diverged``; it also carries the seed, preset, optimizer and world size,
  and (trainers since MFU was logged) the run's model FLOPs utilisation in its ``final`` record.

Both are reduced to a :class:`RunRecord`. A run must have ended, one of two ways:

* finished: its last validation is at the last step (``N == M``; for JSONL, a ``final``
  record exists);
* diverged: the trainer stopped it on a non-finite loss or gradient (JSONL: a ``diverged``
  record ``{"step": N, "total_steps": M, "reason": ..., "train_time_ms": T}`` and no
  ``final``; text: a line ``diverged at step:N/M: <reason>``). A log that finished with a
  non-finite final validation loss (what the trainer wrote before it stopped diverged runs)
  is read as diverged at its first non-finite validation.

A run that ended neither way (crashed, killed, still running, or paused by ``--pause-at-step``:
JSONL ``paused`` record ``{"step": N, "total_steps": M, "checkpoint": PATH}``) is refused,
because its final loss and train time are not comparable with finished ones. So is a run that
failed (JSONL: a ``failed`` record ``{"step": N, "total_steps": M, "reason": ...}``; text: a
line ``failed after step:N/M: <reason>``): the refusal says that it failed, where and why.

A resumed run appends to its logs (JSONL: a new ``config`` record; text: a ``resumed from``
line); the last record per step counts, and the last segment decides whether the run ended.

A run trained with decay branches (``--decay-branches``, ``train/branches.py``) also holds one
``branch`` record (text: a ``branch:`` line) per completed branch: the separate run of fewer
steps that forked from it where its cooldown starts. They are read into
:attr:`RunRecord.branches`, keyed by the branch's length, the last record per length counting,
from every segment (a resume keeps the branches recorded before it); they never enter the
run's own curve.

Non-finite numbers are read in every spelling a log may hold: the JSON strings ``"nan"``,
``"inf"``, ``"-inf"`` (the trainer's contract), ``null`` (older trainers wrote NaN as null)
and the bare ``NaN``/``Infinity`` tokens that Python's ``json`` writes by default.

Example:
    >>> run = read_run("logs/adam/adam_seed0.jsonl")  # doctest: +SKIP
    >>> run.final_val_loss, run.train_time_ms  # doctest: +SKIP
    (3.2775, 140909.0)
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanoshampoo.errors import UserError
from nanoshampoo.validation import is_int, is_real

RUN_SUFFIXES = (".jsonl", ".txt")

_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|nan|inf|-inf"
_VAL_LINE = re.compile(
    rf"^step:(?P<step>\d+)/(?P<total>\d+) val_loss:(?P<loss>{_NUMBER}) "
    rf"train_time:(?P<time>{_NUMBER})ms step_avg:(?P<avg>{_NUMBER})ms"
)
_TRAIN_LINE = re.compile(
    rf"^step:(?P<step>\d+)/(?P<total>\d+) train_loss:(?:{_NUMBER}) train_time:(?P<time>{_NUMBER})ms"
)
_PEAK_LINE = re.compile(rf"^peak memory allocated: (?P<alloc>{_NUMBER}) MiB")
_RESUMED_PREFIX = "resumed from "
_DIVERGED_LINE = re.compile(r"^diverged at step:(?P<step>\d+)/(?P<total>\d+): (?P<reason>.*)$")
_FAILED_LINE = re.compile(r"^failed after step:(?P<step>\d+)/(?P<total>\d+): (?P<reason>.*)$")
_BRANCH_LINE = re.compile(
    rf"^branch:(?P<fraction>{_NUMBER}) step:(?P<steps>\d+)/\d+ val_loss:(?P<loss>{_NUMBER}) "
    rf"train_time:(?P<time>{_NUMBER})ms step_avg:(?:{_NUMBER})ms "
    r"\(forked at step (?P<fork>\d+)\)$"
)
_BRANCH_DIVERGED_LINE = re.compile(
    rf"^branch:(?P<fraction>{_NUMBER}) diverged at step:(?P<step>\d+)/(?P<steps>\d+): "
    r"(?P<reason>.*) \(forked at step (?P<fork>\d+)\)$"
)
# JSON strings that stand for non-finite floats (the trainer's contract writes the first three).
_NON_FINITE = {
    "nan": math.nan,
    "inf": math.inf,
    "-inf": -math.inf,
    "+inf": math.inf,
    "infinity": math.inf,
    "-infinity": -math.inf,
}


class LogFormatError(UserError):
    """A run log that cannot be read; the message names the file and what is wrong."""


@dataclass(frozen=True)
class ValPoint:
    """One validation measurement: the loss after ``step`` optimizer steps."""

    step: int
    val_loss: float
    train_time_ms: float


@dataclass(frozen=True)
class BranchResult:
    """A decay branch of a run: the run of ``steps`` steps (``fraction`` of the main run's) that
    forked from it after ``fork_step`` steps and was validated at ``steps``.

    ``train_time_ms`` is the training time that separate run would have had (the main run's up
    to the fork plus the branch's own steps; NaN for a diverged branch read from a text log,
    which does not state it); ``tokens`` its training tokens (``None`` from a text log). A
    diverged branch has ``diverged_reason`` set and ``val_loss`` NaN; the main run went on.
    """

    fraction: float
    steps: int
    fork_step: int
    val_loss: float
    train_time_ms: float
    tokens: int | None = None
    diverged_reason: str | None = None

    @property
    def diverged(self) -> bool:
        return self.diverged_reason is not None


@dataclass(frozen=True)
class RunRecord:
    """Everything the statistics need about one ended run.

    ``curve`` is sorted by step, one point per step. For a finished run (``diverged_step is
    None``) its last point is the final validation (``curve[-1].step == total_steps``) and
    every loss is finite. A diverged run's curve holds the validations logged before it
    stopped (possibly none, possibly non-finite ones); its ``train_time_ms`` is the training
    time until it stopped. Metadata that only JSONL carries is ``None`` for ``.txt`` logs.
    """

    path: Path
    run_id: str
    total_steps: int
    curve: tuple[ValPoint, ...]
    train_time_ms: float
    step_avg_ms: float
    seed: int | None = None
    preset: str | None = None
    optimizer: str | None = None
    world_size: int | None = None
    peak_memory_mib: float | None = None
    config: dict[str, Any] = field(default_factory=dict)
    # The step at which the trainer stopped a diverged run, and its message; None if finished.
    diverged_step: int | None = None
    diverged_reason: str = ""
    # The final record's MFU (a fraction: the run's matmul FLOPs / its training time / the
    # probed peak, ``train/throughput.py``); None for text logs, diverged runs and JSONL logs
    # of trainers that did not write it.
    mfu: float | None = None
    # The run's decay branches by their length in steps (none without --decay-branches).
    branches: dict[int, BranchResult] = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        return self.diverged_step is not None

    @property
    def final_val_loss(self) -> float:
        """The last validation loss of a finished run; NaN for a diverged run."""
        return math.nan if self.diverged else self.curve[-1].val_loss

    def final_losses_by_steps(self) -> dict[int, float]:
        """The final validation loss of every budget this run trained, by its steps, ascending:
        each decay branch's and the run's own at ``total_steps``; NaN where one diverged."""
        losses = {steps: branch.val_loss for steps, branch in self.branches.items()}
        losses[self.total_steps] = self.final_val_loss
        return dict(sorted(losses.items()))


def read_run(path: str | Path) -> RunRecord:
    """Read one run from a ``.txt`` speedrun log or a ``.jsonl`` metrics file."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    if path.suffix == ".txt":
        return _read_txt(path)
    raise LogFormatError(f"{path}: unknown run log type (expected .txt or .jsonl)")


def find_run_files(directory: str | Path) -> list[Path]:
    """The run logs directly inside ``directory``, one per run id, sorted by name.

    When a run has both ``<id>.jsonl`` and ``<id>.txt`` the JSONL file is used, since it
    carries the seed and config as well.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise LogFormatError(f"{directory}: not a directory")
    by_stem: dict[str, Path] = {}
    for suffix in reversed(RUN_SUFFIXES):  # .txt first, so .jsonl overrides it
        for path in directory.glob(f"*{suffix}"):
            if path.is_file():
                by_stem[path.stem] = path
    return [by_stem[stem] for stem in sorted(by_stem)]


def _read_text(path: Path) -> str:
    """The file's text; only a regular file is read (a FIFO or device would block or never end)."""
    try:
        if path.exists() and not path.is_file():
            raise LogFormatError(f"{path}: not a regular file (a run log is a plain file)")
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LogFormatError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LogFormatError(f"{path}: cannot read ({exc})") from exc


def _read_txt(path: Path) -> RunRecord:
    points: dict[int, ValPoint] = {}
    total_steps: int | None = None
    step_avg_ms = math.nan
    peak: float | None = None
    last_time = (0, 0.0)  # (step, train_time_ms) of the latest step line, for diverged runs
    diverged: re.Match[str] | None = None
    branches: dict[int, BranchResult] = {}

    def check_total(total: int, line: str) -> None:
        nonlocal total_steps
        if total_steps is not None and total != total_steps:
            raise LogFormatError(
                f"{path}: inconsistent total steps ({total_steps} then {total}) in {line!r}"
            )
        total_steps = total

    lines = _read_text(path).splitlines()
    _refuse_failed_text(path, lines)
    for line in lines:
        if match := _VAL_LINE.match(line):
            step, total = int(match["step"]), int(match["total"])
            check_total(total, line)
            points[step] = ValPoint(step, float(match["loss"]), float(match["time"]))
            last_time = max(last_time, (step, float(match["time"])))
            if step == total:
                step_avg_ms = float(match["avg"])
        elif match := _TRAIN_LINE.match(line):
            check_total(int(match["total"]), line)
            last_time = max(last_time, (int(match["step"]), float(match["time"])))
        elif match := _DIVERGED_LINE.match(line):
            check_total(int(match["total"]), line)
            diverged = match
        elif line.startswith(_RESUMED_PREFIX):
            diverged = None  # the run went on from a checkpoint: its new segment decides
        elif match := _BRANCH_LINE.match(line):
            branches[int(match["steps"])] = BranchResult(
                float(match["fraction"]),
                int(match["steps"]),
                int(match["fork"]),
                float(match["loss"]),
                float(match["time"]),
            )
        elif match := _BRANCH_DIVERGED_LINE.match(line):
            branches[int(match["steps"])] = BranchResult(
                float(match["fraction"]),
                int(match["steps"]),
                int(match["fork"]),
                math.nan,
                math.nan,
                diverged_reason=f"at step {match['step']}: {match['reason']}",
            )
        elif match := _PEAK_LINE.match(line):
            peak = float(match["alloc"])
    if total_steps is None:
        raise LogFormatError(
            f"{path}: no validation lines 'step:N/M val_loss:X train_time:Yms step_avg:Zms'"
        )
    common = dict(
        path=path,
        run_id=path.stem,
        total_steps=total_steps,
        peak_memory_mib=peak,
        branches=dict(sorted(branches.items())),
    )
    if diverged is not None:
        step, train_time_ms = last_time
        return RunRecord(
            **common,
            curve=_sorted_curve(points),
            train_time_ms=train_time_ms,
            step_avg_ms=train_time_ms / max(step, 1),
            diverged_step=int(diverged["step"]),
            diverged_reason=diverged["reason"],
        )
    curve = _checked_curve(path, points, total_steps)
    return _mark_non_finite(
        RunRecord(
            **common, curve=curve, train_time_ms=curve[-1].train_time_ms, step_avg_ms=step_avg_ms
        )
    )


def _refuse_failed_text(path: Path, lines: list[str]) -> None:
    """The refusal of a text log whose last segment (after its last ``resumed from`` line)
    records that the run failed."""
    for line in reversed(lines):
        if line.startswith(_RESUMED_PREFIX):
            return
        if match := _FAILED_LINE.match(line):
            raise _failed_run(path, int(match["step"]), int(match["total"]), match["reason"])


def _scan_jsonl(
    path: Path,
    branches: dict[int, BranchResult],
) -> tuple[dict[str, Any], dict[int, ValPoint], dict[str, Any] | None, dict[str, Any] | None]:
    """The last segment's ``(config, val points, final, diverged)`` records, each checked
    (``diverged`` may be the segment's ``failed`` record); every segment's decay branches go
    into ``branches``."""
    config: dict[str, Any] = {}
    points: dict[int, ValPoint] = {}
    final: dict[str, Any] | None = None
    diverged: dict[str, Any] | None = None
    for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        record = _json_record(path, lineno, line)
        kind = record["kind"]
        if kind == "config":
            # A resume appends a new config record: the run's state is its last segment's.
            config, final, diverged = record, None, None
        elif kind in ("val", "final"):
            point = ValPoint(
                step=_integer(path, lineno, record, "step"),
                val_loss=_number(path, lineno, record, "val_loss"),
                train_time_ms=_number(path, lineno, record, "train_time_ms"),
            )
            points[point.step] = point
            if kind == "final":
                final = record
        elif kind == "diverged":
            for name in ("step", "total_steps"):
                _integer(path, lineno, record, name)
            _number(path, lineno, record, "train_time_ms")
            diverged = record
        elif kind == "failed":
            for name in ("step", "total_steps"):
                _integer(path, lineno, record, name)
            diverged = record  # read as the run's end; _read_jsonl refuses it as failed
        elif kind == "branch":
            branch = _branch(path, lineno, record)
            branches[branch.steps] = branch
        elif kind == "paused":  # read as the segment's end; _read_jsonl says how to go on
            diverged = record
    return config, points, final, diverged


def _failed_run(path: Path, step: int, total_steps: int, reason: str) -> LogFormatError:
    """The refusal of a run whose trainer recorded that it failed (``RunLog.failed``)."""
    return LogFormatError(f"{path}: the run failed after step {step} of {total_steps}: {reason}")


def _branch(path: Path, lineno: int, record: dict[str, Any]) -> BranchResult:
    """A ``branch`` record, checked (``train/run_log.py``'s ``RunLog.branch`` writes it)."""
    reason = record.get("diverged")
    if reason is not None and not isinstance(reason, str):
        raise LogFormatError(
            f"{path}:{lineno}: 'branch' field 'diverged' is not a text: {reason!r}"
        )
    return BranchResult(
        fraction=_number(path, lineno, record, "fraction"),
        steps=_integer(path, lineno, record, "steps"),
        fork_step=_integer(path, lineno, record, "fork_step"),
        val_loss=_number(path, lineno, record, "val_loss"),
        train_time_ms=_number(path, lineno, record, "train_time_ms"),
        tokens=_integer(path, lineno, record, "tokens"),
        diverged_reason=reason,
    )


def _read_jsonl(path: Path) -> RunRecord:
    branches: dict[int, BranchResult] = {}
    config, points, final, diverged = _scan_jsonl(path, branches)
    if diverged is not None and diverged["kind"] == "failed":
        raise _failed_run(
            path, diverged["step"], diverged["total_steps"], str(diverged.get("reason", ""))
        )
    if diverged is not None and diverged["kind"] == "paused":
        raise LogFormatError(
            f"{path}: the run is paused at step {diverged.get('step')} of "
            f"{diverged.get('total_steps')} (--resume {diverged.get('checkpoint')} continues it)"
        )
    peak = None if final is None else final.get("peak_memory_mib")
    if not isinstance(config.get("config") or {}, dict):
        raise LogFormatError(f"{path}: the config record's 'config' is not an object")
    common = dict(
        path=path,
        run_id=str(config.get("run_id", path.stem)),
        seed=_optional_integer(path, config, "seed"),
        preset=config.get("preset"),
        optimizer=config.get("optimizer"),
        world_size=_optional_integer(path, config, "world_size"),
        peak_memory_mib=None if peak is None else _number(path, None, final, "peak_memory_mib"),
        config=dict(config.get("config") or {}),
        branches=dict(sorted(branches.items())),
    )
    # A diverged record wins over a final one in the same segment: the contract never writes
    # both, and a run that diverged is not a finished result whatever else its log says.
    if diverged is not None:
        step = int(diverged["step"])
        train_time_ms = _number(path, None, diverged, "train_time_ms")
        return RunRecord(
            **common,
            total_steps=int(diverged["total_steps"]),
            curve=_sorted_curve(points),
            train_time_ms=train_time_ms,
            step_avg_ms=train_time_ms / max(step, 1),
            diverged_step=step,
            diverged_reason=str(diverged.get("reason", "")),
        )
    if final is None:
        raise LogFormatError(f"{path}: no 'final' or 'diverged' record (the run did not finish)")
    total_steps = _integer(path, None, final, "total_steps")
    return _mark_non_finite(
        RunRecord(
            **common,
            total_steps=total_steps,
            curve=_checked_curve(path, points, total_steps),
            train_time_ms=_number(path, None, final, "train_time_ms"),
            step_avg_ms=_number(path, None, final, "step_avg_ms"),
            mfu=_number(path, None, final, "mfu") if "mfu" in final else None,
        )
    )


def _json_record(path: Path, lineno: int, line: str) -> dict[str, Any]:
    """One JSONL line as an object with a ``kind``; ``LogFormatError`` naming the line if not."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise LogFormatError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
    except RecursionError:
        raise LogFormatError(
            f"{path}:{lineno}: JSON nested too deeply to be a run log record"
        ) from None
    if not isinstance(record, dict) or "kind" not in record:
        raise LogFormatError(f"{path}:{lineno}: expected an object with a 'kind' field")
    return record


def _field(path: Path, lineno: int | None, record: dict[str, Any], name: str) -> Any:
    if name not in record:
        raise LogFormatError(
            f"{_where(path, lineno)}: {record.get('kind')!r} record lacks field {name!r}"
        )
    return record[name]


def _where(path: Path, lineno: int | None) -> str:
    return f"{path}:{lineno}" if lineno is not None else str(path)


def _number(path: Path, lineno: int | None, record: dict[str, Any], name: str) -> float:
    """A float field; ``null`` and the strings "nan"/"inf"/"-inf" are non-finite values."""
    value = _field(path, lineno, record, name)
    if value is None:
        return math.nan
    if isinstance(value, str) and value.strip().lower() in _NON_FINITE:
        return _NON_FINITE[value.strip().lower()]
    if not is_real(value):
        raise LogFormatError(
            f"{_where(path, lineno)}: {record.get('kind')!r} field {name!r} is not a number: "
            f"{value!r}"
        )
    return float(value)


def _integer(path: Path, lineno: int | None, record: dict[str, Any], name: str) -> int:
    value = _field(path, lineno, record, name)
    if not is_int(value):
        raise LogFormatError(
            f"{_where(path, lineno)}: {record.get('kind')!r} field {name!r} is not an integer: "
            f"{value!r}"
        )
    return value


def _optional_integer(path: Path, record: dict[str, Any], name: str) -> int | None:
    return None if record.get(name) is None else _integer(path, None, record, name)


def _sorted_curve(points: dict[int, ValPoint]) -> tuple[ValPoint, ...]:
    return tuple(points[step] for step in sorted(points))


def _mark_non_finite(run: RunRecord) -> RunRecord:
    """A finished run with a non-finite validation loss diverged at the first such point."""
    bad = next((p for p in run.curve if not math.isfinite(p.val_loss)), None)
    if bad is None:
        return run
    return dataclasses.replace(
        run,
        diverged_step=bad.step,
        diverged_reason=f"validation loss {bad.val_loss} at step {bad.step}",
    )


def _checked_curve(
    path: Path, points: dict[int, ValPoint], total_steps: int
) -> tuple[ValPoint, ...]:
    curve = _sorted_curve(points)
    if not curve or curve[-1].step != total_steps:
        raise LogFormatError(
            f"{path}: incomplete run, last validation at step "
            f"{curve[-1].step if curve else 'none'} of {total_steps}"
        )
    return curve
