"""Read training runs back from their speedrun ``.txt`` logs or ``.jsonl`` metric files.

Two formats describe the same run (the trainer writes both):

* ``<run_id>.txt`` -- the modded-nanogpt speedrun log: the full source of the training code,
  then lines ``step:N/M val_loss:X train_time:Yms step_avg:Zms`` (and ``train_loss`` lines),
  then ``peak memory allocated: X MiB reserved: Y MiB``. Logs of the original
  modded-nanogpt records parse as well.
* ``<run_id>.jsonl`` -- one JSON object per line with ``"kind"`` in ``config``, ``train``,
  ``val``, ``final``; it also carries the seed, preset, optimizer and world size.

Both are reduced to a :class:`RunRecord`. A run must be complete: its last validation is at
the last step (``N == M``; for JSONL, a ``final`` record exists), because the final loss and
train time of a crashed run are not comparable with finished ones.

Example:
    >>> run = read_run("logs/adam/adam_seed0.jsonl")  # doctest: +SKIP
    >>> run.final_val_loss, run.train_time_ms  # doctest: +SKIP
    (3.2775, 140909.0)
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RUN_SUFFIXES = (".jsonl", ".txt")

_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|nan|inf|-inf"
_VAL_LINE = re.compile(
    rf"^step:(?P<step>\d+)/(?P<total>\d+) val_loss:(?P<loss>{_NUMBER}) "
    rf"train_time:(?P<time>{_NUMBER})ms step_avg:(?P<avg>{_NUMBER})ms"
)
_PEAK_LINE = re.compile(rf"^peak memory allocated: (?P<alloc>{_NUMBER}) MiB")


class LogFormatError(ValueError):
    """A run log that cannot be read; the message names the file and what is wrong."""


@dataclass(frozen=True)
class ValPoint:
    """One validation measurement: the loss after ``step`` optimizer steps."""

    step: int
    val_loss: float
    train_time_ms: float


@dataclass(frozen=True)
class RunRecord:
    """Everything the statistics need about one finished run.

    ``curve`` is sorted by step, one point per step; its last point is the final validation
    (``curve[-1].step == total_steps``). Metadata that only JSONL carries is ``None`` for
    ``.txt`` logs.
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

    @property
    def final_val_loss(self) -> float:
        return self.curve[-1].val_loss


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
    try:
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
    for line in _read_text(path).splitlines():
        if match := _VAL_LINE.match(line):
            step, total = int(match["step"]), int(match["total"])
            if total_steps is not None and total != total_steps:
                raise LogFormatError(
                    f"{path}: inconsistent total steps ({total_steps} then {total}) in {line!r}"
                )
            total_steps = total
            points[step] = ValPoint(step, float(match["loss"]), float(match["time"]))
            if step == total:
                step_avg_ms = float(match["avg"])
        elif match := _PEAK_LINE.match(line):
            peak = float(match["alloc"])
    if total_steps is None:
        raise LogFormatError(
            f"{path}: no validation lines 'step:N/M val_loss:X train_time:Yms step_avg:Zms'"
        )
    curve = _checked_curve(path, points, total_steps)
    return RunRecord(
        path=path,
        run_id=path.stem,
        total_steps=total_steps,
        curve=curve,
        train_time_ms=curve[-1].train_time_ms,
        step_avg_ms=step_avg_ms,
        peak_memory_mib=peak,
    )


def _read_jsonl(path: Path) -> RunRecord:
    config: dict[str, Any] = {}
    points: dict[int, ValPoint] = {}
    final: dict[str, Any] | None = None
    for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LogFormatError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or "kind" not in record:
            raise LogFormatError(f"{path}:{lineno}: expected an object with a 'kind' field")
        kind = record["kind"]
        if kind == "config":
            config = record
        elif kind in ("val", "final"):
            point = ValPoint(
                step=int(_field(path, lineno, record, "step")),
                val_loss=float(_field(path, lineno, record, "val_loss")),
                train_time_ms=float(_field(path, lineno, record, "train_time_ms")),
            )
            points[point.step] = point
            if kind == "final":
                final = record
    if final is None:
        raise LogFormatError(f"{path}: no 'final' record (the run did not finish)")
    total_steps = int(_field(path, None, final, "total_steps"))
    curve = _checked_curve(path, points, total_steps)
    seed = config.get("seed")
    world_size = config.get("world_size")
    return RunRecord(
        path=path,
        run_id=str(config.get("run_id", path.stem)),
        total_steps=total_steps,
        curve=curve,
        train_time_ms=float(_field(path, None, final, "train_time_ms")),
        step_avg_ms=float(_field(path, None, final, "step_avg_ms")),
        seed=None if seed is None else int(seed),
        preset=config.get("preset"),
        optimizer=config.get("optimizer"),
        world_size=None if world_size is None else int(world_size),
        peak_memory_mib=final.get("peak_memory_mib"),
        config=dict(config.get("config") or {}),
    )


def _field(path: Path, lineno: int | None, record: dict[str, Any], name: str) -> Any:
    if name not in record or record[name] is None:
        where = f"{path}:{lineno}" if lineno is not None else str(path)
        raise LogFormatError(f"{where}: {record.get('kind')!r} record lacks field {name!r}")
    return record[name]


def _checked_curve(path: Path, points: dict[int, ValPoint], total_steps: int) -> tuple[ValPoint, ...]:
    curve = tuple(points[step] for step in sorted(points))
    if curve[-1].step != total_steps:
        raise LogFormatError(
            f"{path}: incomplete run, last validation at step {curve[-1].step} of {total_steps}"
        )
    return curve
