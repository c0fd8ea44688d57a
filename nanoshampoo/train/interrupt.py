"""Ctrl-C during training: say where the run stopped and how to continue it.

The trainer turns a ``KeyboardInterrupt`` in its step loop into :class:`TrainingInterrupted`
(still a ``KeyboardInterrupt``, so code that catches those keeps working), carrying the steps
done and the run's last checkpoint. The command line prints :func:`interrupted_message` and exits
with status 130 (128 + SIGINT, the shell's convention). The logs are already on disk; the
``--resume`` command it prints continues the run from that checkpoint.

Example:
    >>> exc = TrainingInterrupted(7, 300, Path("runs/r.ckpt/step_000005"))
    >>> print(interrupted_message(exc, "python -m nanoshampoo.train", ["--seed", "1"]))
    interrupted after step 7 of 300; last checkpoint: runs/r.ckpt/step_000005
    continue with: python -m nanoshampoo.train --seed 1 --resume runs/r.ckpt/step_000005
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

EXIT_INTERRUPTED = 130


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a run after ``step`` of ``total`` steps; ``checkpoint`` is its last one."""

    def __init__(self, step: int, total: int, checkpoint: Path | None) -> None:
        super().__init__(f"interrupted after step {step} of {total}")
        self.step = step
        self.total = total
        self.checkpoint = checkpoint


def interrupted_message(exc: TrainingInterrupted, prog: str, argv: Sequence[str]) -> str:
    """Where the run stopped, its last checkpoint, and the command that continues it."""
    head = f"interrupted after step {exc.step} of {exc.total}"
    if exc.checkpoint is None:
        return (
            f"{head}; no checkpoint was written (--checkpoint-every N keeps some), so the "
            "run cannot be continued"
        )
    args = _without_resume(list(argv)) + ["--resume", str(exc.checkpoint)]
    return f"{head}; last checkpoint: {exc.checkpoint}\ncontinue with: {prog} {shlex.join(args)}"


def _without_resume(argv: list[str]) -> list[str]:
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            kept.append(arg)
    return kept
