"""The run's records: the speedrun text log and the JSONL event stream (rank 0 writes both).

``<out_dir>/<run_id>.txt`` starts with the full source of the training code that ran (every
module of ``nanoshampoo.train``, ``nanoshampoo.model`` and ``nanoshampoo.optim`` (the
optimizers under study), tests and examples left out, each under a
``# ===== <path> =====`` header), then a line of ``=``, the config and environment, another
line of ``=``, then one line per event::

    step:100/300 val_loss:4.1234 train_time:5432ms step_avg:54.32ms
    step:101/300 train_loss:4.0917 train_time:5486ms step_avg:54.32ms
    peak memory allocated: 812 MiB reserved: 1024 MiB

``<out_dir>/<run_id>.jsonl`` has one object per line, ``kind`` in ``config``, ``train``,
``val``, ``final`` (fields in ``RunLog``'s methods).

Example:
    >>> log = RunLog("runs", "demo", enabled=True)
    >>> log.start(config_record={"kind": "config", "run_id": "demo"}, environment="cpu")
    >>> log.val(step=0, total_steps=10, val_loss=6.9, train_time_ms=0.0)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import nanoshampoo.model
import nanoshampoo.optim
import nanoshampoo.train

SEPARATOR = "=" * 100


def training_source() -> str:
    """The source of every ``.py`` file of the trainer, model and optimizer packages, concatenated.

    Test and example modules are left out: they are not part of what ran.
    """
    parts = []
    for package in (nanoshampoo.train, nanoshampoo.model, nanoshampoo.optim):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            if {"tests", "gpu_tests", "examples"} & set(path.relative_to(root).parts):
                continue
            rel = Path(package.__name__.replace(".", "/")) / path.relative_to(root)
            parts.append(f"# ===== {rel.as_posix()} =====\n{path.read_text()}")
    return "\n".join(parts)


class RunLog:
    """Appends to the text log and the JSONL; every method is a no-op when not ``enabled``."""

    def __init__(self, out_dir: str, run_id: str, enabled: bool) -> None:
        self.enabled = enabled
        self.text_path = Path(out_dir) / f"{run_id}.txt"
        self.jsonl_path = Path(out_dir) / f"{run_id}.jsonl"

    def start(self, config_record: dict[str, Any], environment: str) -> None:
        if not self.enabled:
            return
        self.text_path.parent.mkdir(parents=True, exist_ok=True)
        header = [training_source(), SEPARATOR, "config: " + json.dumps(config_record),
                  environment, SEPARATOR]
        self.text_path.write_text("\n".join(header) + "\n")
        self.jsonl_path.write_text("")
        self._json(config_record)

    def train(self, step: int, total_steps: int, train_loss: float, train_time_ms: float,
              tokens_per_s: float) -> None:
        step_avg = train_time_ms / max(step, 1)
        self._line(f"step:{step}/{total_steps} train_loss:{train_loss:.4f} "
                   f"train_time:{train_time_ms:.0f}ms step_avg:{step_avg:.2f}ms")
        self._json({"kind": "train", "step": step, "total_steps": total_steps,
                    "train_loss": train_loss, "train_time_ms": train_time_ms,
                    "step_avg_ms": step_avg, "tokens_per_s": tokens_per_s})

    def val(self, step: int, total_steps: int, val_loss: float, train_time_ms: float) -> str:
        step_avg = train_time_ms / max(step, 1)
        line = (f"step:{step}/{total_steps} val_loss:{val_loss:.4f} "
                f"train_time:{train_time_ms:.0f}ms step_avg:{step_avg:.2f}ms")
        self._line(line)
        self._json({"kind": "val", "step": step, "total_steps": total_steps,
                    "val_loss": val_loss, "train_time_ms": train_time_ms,
                    "step_avg_ms": step_avg})
        return line

    def final(self, step: int, total_steps: int, val_loss: float, train_time_ms: float,
              peak_allocated_mib: float, peak_reserved_mib: float) -> None:
        self._line(f"peak memory allocated: {peak_allocated_mib:.0f} MiB "
                   f"reserved: {peak_reserved_mib:.0f} MiB")
        self._json({"kind": "final", "step": step, "total_steps": total_steps,
                    "val_loss": val_loss, "train_time_ms": train_time_ms,
                    "step_avg_ms": train_time_ms / max(step, 1),
                    "peak_memory_mib": peak_allocated_mib})

    def _line(self, line: str) -> None:
        if self.enabled:
            with self.text_path.open("a") as f:
                f.write(line + "\n")

    def _json(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        with self.jsonl_path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
