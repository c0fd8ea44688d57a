"""How a training run ends: :class:`TrainResult` when it finishes, :class:`TrainingDiverged`
when it stops on a non-finite value (``nanoshampoo.train.trainer`` raises and returns them;
the command line turns the exception into its exit status)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class TrainingDiverged(RuntimeError):
    """The loss, a gradient or a parameter became NaN/Inf; ``step`` optimizer steps were done."""

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(reason)
        self.step = step
        self.reason = reason


@dataclass
class TrainResult:
    run_id: str
    final_val_loss: float
    text_log: Path
    jsonl_log: Path
    last_checkpoint: Path | None
