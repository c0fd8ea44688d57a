"""The run's records: the speedrun text log and the JSONL event stream (rank 0 writes both).

``<out_dir>/<run_id>.txt`` starts with the source of the project's modules that the run
imported (from ``sys.modules``: trainer, model, the optimizer that ran, data; tests and
examples left out; each under a ``# ===== <path> =====`` header), then a line of ``=``, the
config and environment, another line of ``=``, then one line per event::

    step:100/300 val_loss:4.1234 train_time:5432ms step_avg:54.32ms
    step:101/300 train_loss:4.0917 train_time:5486ms step_avg:54.32ms
    peak memory allocated: 812 MiB reserved: 1024 MiB

or, for a run stopped by a non-finite loss, gradient or parameter, instead of the last line::

    diverged at step:57/300: <reason>

A run with decay branches (``train/branches.py``) writes one line per branch when it is done,
where it forked (its lines never start with ``step:``, so readers of the run's own steps skip
them)::

    branch:0.25 step:75/75 val_loss:4.5123 train_time:1234ms step_avg:16.45ms (forked at step 23)
    branch:0.5 diverged at step:97/150: <reason> (forked at step 45)

``<out_dir>/<run_id>.jsonl`` has one object per line, ``kind`` in ``config``, ``train``,
``val``, ``final``, ``diverged``, ``branch``, ``telemetry`` (fields in ``RunLog``'s methods;
``telemetry`` in ``train/telemetry.py``, its cadence in the ``config`` record's
``telemetry_every``). A diverged run
has a ``diverged`` record and no ``final`` one. A ``branch`` record is written only once its
branch is complete (validated, or diverged: a branch is a run of its own, and the main run goes
on). Non-finite floats anywhere in a record are written as
the strings ``"nan"``, ``"inf"``, ``"-inf"`` (JSON has no such numbers).

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

import json
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from nanoshampoo.io_utils import check_output_dir
from nanoshampoo.train.branches import Branch
from nanoshampoo.train.config import UserError

SEPARATOR = "=" * 100
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

    def __init__(self, out_dir: str, run_id: str, enabled: bool, append: bool = False) -> None:
        self.enabled = enabled
        self.append = append
        self.text_path = Path(out_dir) / f"{run_id}.txt"
        self.jsonl_path = Path(out_dir) / f"{run_id}.jsonl"

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
            header = [training_source(), SEPARATOR, config_line, environment, SEPARATOR]
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
    ) -> None:
        """``mfu``: model FLOPs utilisation of this run's average step (a fraction)."""
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
            }
        )

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
            with self.text_path.open("a") as f:
                f.write(line + "\n")

    def _json(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with self.jsonl_path.open("a") as f:
                f.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
