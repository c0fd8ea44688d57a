"""TensorBoard scalars of a run (``--tensorboard DIR``): train and validation loss, each
optimizer param group's learning rate, and every telemetry statistic per layer.

Rank 0 writes ``DIR/<run_id>/`` with ``torch.utils.tensorboard.SummaryWriter``; the
``tensorboard`` package is an optional extra (``pip install 'nanoshampoo[tensorboard]'``), and
without it the run refuses to start with one line saying so. Tags: ``loss/train``,
``loss/val``, ``lr/<optimizer index>.<group index>``, ``telemetry/<statistic>/<layer>``;
the x axis is the optimizer step.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nanoshampoo.errors import UserError

INSTALL_HINT = (
    "--tensorboard needs the tensorboard package: pip install 'nanoshampoo[tensorboard]' "
    "(or pip install tensorboard)"
)


def check_tensorboard_installed() -> None:
    """``UserError`` (one line, how to install it) when ``tensorboard`` cannot be imported."""
    if importlib.util.find_spec("tensorboard") is None:
        raise UserError(INSTALL_HINT)


class TensorBoardScalars:
    """Scalars of one run under ``directory / run_id`` (only where ``enabled``: rank 0)."""

    def __init__(self, directory: str, run_id: str, enabled: bool) -> None:
        check_tensorboard_installed()
        self._writer: Any = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(Path(directory) / run_id))

    def train(self, step: int, loss: float, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        if self._writer is None:
            return
        self._writer.add_scalar("loss/train", loss, step)
        for index, opt in enumerate(optimizers):
            for number, group in enumerate(opt.param_groups):
                self._writer.add_scalar(f"lr/{index}.{number}", float(group["lr"]), step)

    def val(self, step: int, loss: float) -> None:
        if self._writer is not None:
            self._writer.add_scalar("loss/val", loss, step)

    def telemetry(self, records: Sequence[dict[str, Any]]) -> None:
        """Every finite numeric statistic of the records (``train/telemetry.py``)."""
        if self._writer is None:
            return
        for record in records:
            for key, value in record.items():
                if key in ("kind", "step", "layer") or not isinstance(value, (int, float)):
                    continue
                if math.isfinite(value):
                    self._writer.add_scalar(
                        f"telemetry/{key}/{record['layer']}", value, record["step"]
                    )

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
