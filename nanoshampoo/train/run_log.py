"""The run's records: the speedrun text log and the JSONL event stream (rank 0 writes both).

The source of the project's modules that the run imported (from ``sys.modules``: trainer,
model, the optimizer that ran, data; tests and examples left out; each under a
``# ===== <path> =====`` header) is stored once per distinct source, beside the runs, in
``<out_dir>/sources/<sha256>.source`` (created atomically, never overwritten: its name is its
content's hash), and ``<out_dir>/<run_id>.txt`` starts with one line that names it::

    # ===== source: sources/<sha256>.source =====

With ``embed_source`` (``--embed-source true``: the self-contained log a record submission
needs) the log starts with that source itself instead. Either way a line of ``=``, the config
and environment, another line of ``=`` follow, then one line per event
(:func:`logged_source` reads the source back from either form)::

    step:100/300 val_loss:4.1234 train_time:5432ms step_avg:54.32ms
    step:101/300 train_loss:4.0917 train_time:5486ms step_avg:54.32ms
    peak memory allocated: 812 MiB reserved: 1024 MiB

or, for a run stopped by a non-finite loss, gradient or parameter, instead of the last line::

    diverged at step:57/300: <reason>

or, for a run stopped by an exception (a user's optimizer raised, a checkpoint could not be
written), after the steps it completed::

    failed after step:57/300: <one line: what failed and why>

or, for a run stopped by ``--pause-at-step`` (it wrote the checkpoint of that step; a resume of
it appends the rest of the run)::

    paused at step:57/300; --resume <checkpoint> continues the run

A run with decay branches (``train/branches.py``) writes one line per branch when it is done,
where it forked (its lines never start with ``step:``, so readers of the run's own steps skip
them)::

    branch:0.25 step:75/75 val_loss:4.5123 train_time:1234ms step_avg:16.45ms (forked at step 23)
    branch:0.5 diverged at step:97/150: <reason> (forked at step 45)

``<out_dir>/<run_id>.jsonl`` has one object per line, ``kind`` in ``config``, ``train``,
``val``, ``final``, ``diverged``, ``failed``, ``paused``, ``branch``, ``telemetry`` (fields in
``RunLog``'s methods; ``telemetry`` in ``train/telemetry.py``, its cadence in the ``config``
record's ``telemetry_every``). A diverged run has a ``diverged`` record and no ``final`` one; a
failed run a ``failed`` one, a paused run a ``paused`` one. A ``branch`` record is written only
once its branch is complete (validated, or diverged: a branch is a run of its own, and the main
run goes on). Non-finite floats anywhere in a record are written as the strings ``"nan"``,
``"inf"``, ``"-inf"`` (JSON has no such numbers).

Files are never overwritten: a fresh run creates both files exclusively, and a resume that
continues the same run id appends (a second ``config`` record, with ``resumed_from``, then the
records from the resumed step on; readers keep the last record per step).

Example:
    >>> log = RunLog("runs", "demo", enabled=True)
    >>> log.start(config_record={"kind": "config", "run_id": "demo"}, environment="cpu")
    >>> log.val(step=0, total_steps=10, val_loss=6.9, train_time_ms=0.0)
    'step:0/10 val_loss:6.9000 train_time:0ms step_avg:0.00ms'
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from nanoshampoo.io_utils import check_output_dir
from nanoshampoo.train.branches import Branch
from nanoshampoo.train.config import UserError

SEPARATOR = "=" * 100
SOURCES_DIR = "sources"
# The first line of a log whose source is stored beside it (``store_source``).
_SOURCE_POINTER = re.compile(r"# ===== source: (sources/([0-9a-f]{64})\.source) =====")
# Source order in the log: the trainer first (a reader starts there), then what it drives.
_SOURCE_ORDER = ("nanoshampoo.train", "nanoshampoo.model", "nanoshampoo.optim", "nanoshampoo")
_NOT_RUN_CODE = {"tests", "examples", "testing"}


def training_source(modules: Mapping[str, ModuleType] | None = None) -> str:
    """The source of every ``nanoshampoo`` module in ``modules`` (default ``sys.modules``).

    Only imported modules appear: an AdamW run's log holds no Shampoo code. Test, example and
    test-helper modules are left out. Each file appears once, under its repository path.
    """
    modules = sys.modules if modules is None else modules
    chosen: dict[str, Path] = {}
    for name, module in list(modules.items()):
        file = getattr(module, "__file__", None)
        if not (name == "nanoshampoo" or name.startswith("nanoshampoo.")) or not file:
            continue
        if _NOT_RUN_CODE & set(name.split(".")) or not file.endswith(".py"):
            continue
        chosen[name] = Path(file)

    def order(name: str) -> tuple[int, str]:
        rank = next(
            i
            for i, prefix in enumerate(_SOURCE_ORDER)
            if name == prefix or name.startswith(prefix + ".")
        )
        return rank, name

    parts = []
    for name in sorted(chosen, key=order):
        path = chosen[name]
        rel = (
            Path(*name.split(".")[:-1], path.name)
            if path.name != "__init__.py"
            else Path(*name.split("."), "__init__.py")
        )
        parts.append(f"# ===== {rel.as_posix()} =====\n{path.read_text()}")
    return "\n".join(parts)


def store_source(out_dir: Path, source: str) -> str:
    """Store ``source`` as ``out_dir/sources/<sha256>.source`` unless it is there already; return
    that path relative to ``out_dir`` (what a log's first line names).

    The file appears whole or not at all (written aside, then hard-linked into place, which
    fails rather than replaces), so runs that start together store it once and never rewrite
    it. ``UserError`` if a file of that name holds other bytes (damaged: delete it).
    """
    data = source.encode()
    digest = hashlib.sha256(data).hexdigest()
    relative = f"{SOURCES_DIR}/{digest}.source"
    path = out_dir / relative
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{digest}.", suffix=".tmp")
        except OSError as exc:
            raise UserError(
                f"--out-dir: cannot store the run's source in {path.parent} ({exc})"
            ) from None
        try:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fd, 0o666 & ~umask)  # as a plain open() would (mkstemp makes it 0600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.link(tmp, path)
        except FileExistsError:
            pass  # another run stored the same source first
        finally:
            os.unlink(tmp)
    if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
        raise UserError(f"{path}: does not hold the source its name is the hash of; delete it")
    return relative


def logged_source(text_log: Path) -> str:
    """The source of the code a run's text log records: the file its first line names (checked
    against its hash), or the source embedded at its start (``embed_source``).

    ``UserError`` if the named file is missing or does not match its hash."""
    with text_log.open() as f:
        first = f.readline().rstrip("\n")
        pointer = _SOURCE_POINTER.fullmatch(first)
        if pointer is None:
            lines = [first]
            for line in f:
                if line.rstrip("\n") == SEPARATOR:
                    break
                lines.append(line.rstrip("\n"))
            return "\n".join(lines)
    path = text_log.parent / pointer.group(1)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{text_log}: its source {path} cannot be read ({exc.strerror})") from None
    if hashlib.sha256(data).hexdigest() != pointer.group(2):
        raise UserError(f"{path}: does not hold the source its name is the hash of")
    return data.decode()


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (also inside dicts and lists) as a string."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class RunLog:
    """Writes the text log and the JSONL; every method is a no-op when not ``enabled``.

    ``append``: continue the existing files of this run id (a resume of the same run);
    otherwise the files must not exist yet.
    """

    def __init__(
        self,
        out_dir: str,
        run_id: str,
        enabled: bool,
        append: bool = False,
        embed_source: bool = False,
    ) -> None:
        self.enabled = enabled
        self.append = append
        self.embed_source = embed_source
        self.text_path = Path(out_dir) / f"{run_id}.txt"
        self.jsonl_path = Path(out_dir) / f"{run_id}.jsonl"
        self.write_s = 0.0  # wall seconds spent writing both logs (the run's "logging" phase)

    def check_can_start(self) -> None:
        """``UserError`` if the logs cannot be written as asked (call before any training)."""
        if not self.enabled:
            return
        out_dir = self.text_path.parent
        check_output_dir(out_dir, "--out-dir")  # a file, under a file, unwritable, too long
        longest = len(os.fsencode(self.jsonl_path.name))
        limit = os.pathconf(out_dir if out_dir.is_dir() else out_dir.anchor or ".", "PC_NAME_MAX")
        if longest > limit:
            raise UserError(
                f"--run-id: {len(os.fsencode(self.text_path.stem))} bytes is too long "
                f"for a file name here ({self.jsonl_path.name[:20]}... exceeds "
                f"{limit} bytes)"
            )
        sources = out_dir / SOURCES_DIR
        if not self.embed_source and sources.exists() and not sources.is_dir():
            raise UserError(f"--out-dir: {sources} is a file; the runs' sources are stored there")
        if not self.append:
            for path in (self.text_path, self.jsonl_path):
                if path.exists():
                    raise UserError(
                        f"--run-id {self.text_path.stem}: {path} already exists; a run id names "
                        "one run (choose another, or --resume one of its checkpoints)"
                    )

    def start(self, config_record: dict[str, Any], environment: str) -> None:
        if not self.enabled:
            return
        self.check_can_start()
        self.text_path.parent.mkdir(parents=True, exist_ok=True)
        config_line = "config: " + json.dumps(json_safe(config_record))
        if self.append and self.text_path.exists():
            resumed = config_record.get("resumed_from") or {}
            lines = [
                SEPARATOR,
                f"resumed from {resumed.get('checkpoint')} at step {resumed.get('step')}",
                config_line,
                environment,
                SEPARATOR,
            ]
            with self.text_path.open("a") as f:
                f.write("\n".join(lines) + "\n")
        else:
            source = training_source()
            if not self.embed_source:
                stored = store_source(self.text_path.parent, source)
                source = f"# ===== source: {stored} ====="
            header = [source, SEPARATOR, config_line, environment, SEPARATOR]
            with self.text_path.open("x" if not self.append else "w") as f:
                f.write("\n".join(header) + "\n")
        if not (self.append and self.jsonl_path.exists()):
            self.jsonl_path.open("x" if not self.append else "w").close()
        self._json(config_record)

    def train(
        self,
        step: int,
        total_steps: int,
        train_loss: float,
        train_time_ms: float,
        tokens_per_s: float,
        mfu: float,
    ) -> None:
        """``mfu``: this step's model FLOPs utilisation (a fraction; ``train/throughput.py``)."""
        step_avg = train_time_ms / max(step, 1)
        self._line(
            f"step:{step}/{total_steps} train_loss:{train_loss:.4f} "
            f"train_time:{train_time_ms:.0f}ms step_avg:{step_avg:.2f}ms"
        )
        self._json(
            {
                "kind": "train",
                "step": step,
                "total_steps": total_steps,
                "train_loss": train_loss,
                "train_time_ms": train_time_ms,
                "step_avg_ms": step_avg,
                "tokens_per_s": tokens_per_s,
                "mfu": mfu,
            }
        )

    def val(self, step: int, total_steps: int, val_loss: float, train_time_ms: float) -> str:
        step_avg = train_time_ms / max(step, 1)
        line = (
            f"step:{step}/{total_steps} val_loss:{val_loss:.4f} "
            f"train_time:{train_time_ms:.0f}ms step_avg:{step_avg:.2f}ms"
        )
        self._line(line)
        self._json(
            {
                "kind": "val",
                "step": step,
                "total_steps": total_steps,
                "val_loss": val_loss,
                "train_time_ms": train_time_ms,
                "step_avg_ms": step_avg,
            }
        )
        return line

    def final(
        self,
        step: int,
        total_steps: int,
        val_loss: float,
        train_time_ms: float,
        peak_allocated_mib: float,
        peak_reserved_mib: float,
        mfu: float,
        phases_s: dict[str, float] | None = None,
    ) -> None:
        """``mfu``: model FLOPs utilisation of this run's average step (a fraction);
        ``phases_s``: wall seconds per phase of the run (``train/phases.py``), when timed."""
        self._line(
            f"peak memory allocated: {peak_allocated_mib:.0f} MiB "
            f"reserved: {peak_reserved_mib:.0f} MiB"
        )
        self._json(
            {
                "kind": "final",
                "step": step,
                "total_steps": total_steps,
                "val_loss": val_loss,
                "train_time_ms": train_time_ms,
                "step_avg_ms": train_time_ms / max(step, 1),
                "peak_memory_mib": peak_allocated_mib,
                "mfu": mfu,
                **({} if phases_s is None else {"phases_s": phases_s}),
            }
        )

    def paused(self, step: int, total_steps: int, checkpoint: Path) -> str:
        """The run stopped at ``--pause-at-step``: ``checkpoint`` (of ``step``) continues it."""
        line = f"paused at step:{step}/{total_steps}; --resume {checkpoint} continues the run"
        self._line(line)
        self._json(
            {
                "kind": "paused",
                "step": step,
                "total_steps": total_steps,
                "checkpoint": str(checkpoint),
            }
        )
        return line

    def telemetry(self, records: list[dict[str, Any]]) -> None:
        """Telemetry records (``train/telemetry.py``), JSONL only: one per block matrix."""
        for record in records:
            self._json(record)

    def diverged(self, step: int, total_steps: int, reason: str, train_time_ms: float) -> str:
        """Record that the run stopped at ``step`` (optimizer steps completed) for ``reason``."""
        line = f"diverged at step:{step}/{total_steps}: {reason}"
        self._line(line)
        self._json(
            {
                "kind": "diverged",
                "step": step,
                "total_steps": total_steps,
                "reason": reason,
                "train_time_ms": train_time_ms,
            }
        )
        return line

    def failed(self, step: int, total_steps: int, reason: str, train_time_ms: float) -> str:
        """Record that the run stopped on an exception after ``step`` completed optimizer
        steps; ``reason`` is one line. Readers refuse the run as failed
        (``evidence/logs.py``). A log that cannot be written any more (a full disk) is left
        as it is: the exception that stopped the run is what the user must see."""
        line = f"failed after step:{step}/{total_steps}: {reason}"
        record = {
            "kind": "failed",
            "step": step,
            "total_steps": total_steps,
            "reason": reason,
            "train_time_ms": train_time_ms,
        }
        try:
            self._line(line)
            self._json(record)
        except OSError:
            pass
        return line

    def branch(
        self,
        fraction: float,
        steps: int,
        fork_step: int,
        val_loss: float,
        train_time_ms: float,
        tokens: int,
        diverged: tuple[int, str] | None,
    ) -> str:
        """A completed decay branch: the run of ``steps`` steps that forked after ``fork_step``
        main steps. ``train_time_ms``: the main run's up to the fork plus the branch's own
        steps (a separate run's training time); ``tokens``: the budget, ``steps`` times the
        tokens per step; ``diverged``: ``(step, reason)`` when the branch stopped on a
        non-finite value (its ``val_loss`` is then NaN, written ``"nan"``)."""
        if diverged is None:
            line = (
                f"branch:{fraction:g} step:{steps}/{steps} val_loss:{val_loss:.4f} "
                f"train_time:{train_time_ms:.0f}ms step_avg:{train_time_ms / steps:.2f}ms "
                f"(forked at step {fork_step})"
            )
        else:
            line = (
                f"branch:{fraction:g} diverged at step:{diverged[0]}/{steps}: {diverged[1]} "
                f"(forked at step {fork_step})"
            )
        self._line(line)
        record = {
            "kind": "branch",
            "fraction": fraction,
            "steps": steps,
            "fork_step": fork_step,
            "val_loss": val_loss if diverged is None else math.nan,
            "train_time_ms": train_time_ms,
            "tokens": tokens,
        }
        if diverged is not None:
            record["diverged"] = f"at step {diverged[0]}: {diverged[1]}"
        self._json(record)
        return line

    def branch_not_made(self, branch: Branch, start_step: int) -> str:
        """A branch that a resumed run cannot make (its fork is before the resumed step)."""
        line = (
            f"branch:{branch.fraction:g} ({branch.steps} steps) not made: it forks at step "
            f"{branch.fork_step}, before step {start_step} where this run resumed"
        )
        self._line(line)
        return line

    def recorded_branch_steps(self) -> set[int]:
        """The lengths of the branches this run's JSONL already records (a resume appends)."""
        if not (self.enabled and self.append and self.jsonl_path.exists()):
            return set()
        steps = set()
        for line in self.jsonl_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a killed run: not a completed branch
            if (
                isinstance(record, dict)
                and record.get("kind") == "branch"
                and isinstance(record.get("steps"), int)
            ):
                steps.add(record["steps"])
        return steps

    def _line(self, line: str) -> None:
        if self.enabled:
            begin = time.perf_counter()
            _append(self.text_path, line + "\n")
            self.write_s += time.perf_counter() - begin

    def _json(self, record: dict[str, Any]) -> None:
        if self.enabled:
            begin = time.perf_counter()
            _append(self.jsonl_path, json.dumps(json_safe(record), allow_nan=False) + "\n")
            self.write_s += time.perf_counter() - begin


def _append(path: Path, text: str) -> None:
    """Append ``text`` to ``path``; an ``OSError`` (a full disk fails at the flush, where
    Python names no file) names ``path``."""
    try:
        with path.open("a") as f:
            f.write(text)
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
