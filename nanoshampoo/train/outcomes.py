"""How a training run ends: :class:`TrainResult` when it finishes, :class:`TrainingDiverged`
when it stops on a non-finite value, :class:`OptimizerStepFailed` when a user's optimizer
raises in its step (``nanoshampoo.train.trainer`` raises and returns them; the command line
turns the exception into its exit status)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoshampoo.errors import UserError

# Optimizers from these packages are the project's or torch's: an exception in their step is
# a bug there and keeps its traceback. Any other optimizer is a user's (``custom`` setup).
_OWN_PACKAGES = ("nanoshampoo", "torch")


class TrainingDiverged(RuntimeError):
    """The loss, a gradient or a parameter became NaN/Inf; ``step`` optimizer steps were done."""

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(reason)
        self.step = step
        self.reason = reason


def last_line(exc: BaseException) -> str:
    """``ValueError: <the message's last line>``, as a traceback ends (a message of several
    lines keeps only its last, after the exception's type)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1]}" if lines else type(exc).__name__


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """``module.Class``, or ``Class (path/to/file.py)`` for a class loaded from a file."""
    cls = type(optimizer)
    module = sys.modules.get(cls.__module__)
    if cls.__module__.startswith("nanoshampoo_custom_"):  # setups/custom.py's file modules
        return f"{cls.__qualname__} ({getattr(module, '__file__', cls.__module__)})"
    return f"{cls.__module__}.{cls.__qualname__}"


def is_users_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s class comes from outside the project and torch."""
    return type(optimizer).__module__.split(".", 1)[0] not in _OWN_PACKAGES


class OptimizerStepFailed(UserError):
    """A user's optimizer raised in its ``step()``, the run's ``step``-th (1-based) optimizer
    step; the message is one line: the optimizer, the step, the exception's last line."""

    def __init__(self, optimizer: torch.optim.Optimizer, step: int, error: BaseException) -> None:
        super().__init__(
            f"optimizer {optimizer_name(optimizer)} raised in step {step}: {last_line(error)}"
        )
        self.step = step


@dataclass
class TrainResult:
    run_id: str
    final_val_loss: float
    text_log: Path
    jsonl_log: Path
    last_checkpoint: Path | None
    # The step a ``--pause-at-step`` run stopped at (its final_val_loss is NaN); None otherwise.
    paused_at: int | None = None
