"""Checkpoints that resume a run exactly: model, optimizers, data position, step, clock, RNG.

Layout: ``<out_dir>/<run_id>.ckpt/step_NNNNNN/rank{r}.pt``, one file per rank, each written
atomically (:func:`nanoshampoo.io_utils.atomic_output`). ``rank0.pt`` also holds the
model weights (identical on every rank) and the run id; every rank holds its own optimizer
state (sharded optimizers such as DistAdam and the DDP Shampoo distributor keep different state
per rank), loader position and RNG state. Files load with ``torch.load(weights_only=True)``.

A checkpoint is all ranks' files or nothing: every rank writes into ``step_NNNNNN.partial``,
and once all have written (a barrier), rank 0 renames it to ``step_NNNNNN``
(:func:`publish_checkpoint`). A run killed mid-write leaves at most a ``.partial`` directory,
which nothing loads; the previous checkpoint is untouched.

Example:
    >>> path = checkpoint_path("runs", "r1", step=100)  # runs/r1.ckpt/step_000100
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanoshampoo.io_utils import atomic_output
from nanoshampoo.train.config import UserError

FORMAT_VERSION = 1
PARTIAL_SUFFIX = ".partial"


def checkpoint_path(out_dir: str, run_id: str, step: int) -> Path:
    return Path(out_dir) / f"{run_id}.ckpt" / f"step_{step:06d}"


def partial_path(directory: Path) -> Path:
    """Where the ranks write ``directory``'s files before :func:`publish_checkpoint`."""
    return directory.with_name(directory.name + PARTIAL_SUFFIX)


def save_checkpoint(
    directory: Path,
    rank: int,
    world_size: int,
    step: int,
    train_time_ms: float,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    loader: Any,
    run_id: str,
) -> None:
    """Write this rank's ``rank{rank}.pt`` under ``partial_path(directory)`` (created if needed).

    The checkpoint exists at ``directory`` only after every rank has saved and rank 0 has
    called :func:`publish_checkpoint`.
    """
    record: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "run_id": run_id,
        "step": step,
        "world_size": world_size,
        "train_time_ms": train_time_ms,
        "optimizers": [opt.state_dict() for opt in optimizers],
        "loader": loader.state_dict(),
        "cpu_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }
    if rank == 0:
        record["model"] = model.state_dict()
    with atomic_output(partial_path(directory) / f"rank{rank}.pt") as tmp:
        _write_record(record, tmp)


def _write_record(record: dict[str, Any], path: Path) -> None:
    torch.save(record, path)


def publish_checkpoint(directory: Path) -> None:
    """Rank 0, after every rank saved: move the complete ``.partial`` directory to ``directory``.

    An existing checkpoint of the same step (a resumed run passing it again) is replaced; it is
    moved aside first, so some complete version exists at every moment.
    """
    staged = partial_path(directory)
    if directory.exists():
        old = directory.with_name(directory.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        directory.rename(old)
        staged.rename(directory)
        shutil.rmtree(old)
    else:
        staged.rename(directory)


@dataclass
class CheckpointRecords:
    """The loaded files of one rank: its own, and rank 0's (the model weights)."""

    directory: Path
    own: dict[str, Any]
    shared: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.own["step"])

    @property
    def run_id(self) -> str:
        """The run that wrote it (checkpoints without the field: from ``<run_id>.ckpt``)."""
        return str(self.shared.get("run_id") or self.directory.parent.name.removesuffix(".ckpt"))


def read_checkpoint(directory: Path, rank: int, world_size: int) -> CheckpointRecords:
    """Load and check this rank's checkpoint files; ``UserError`` naming the file if unusable."""
    if not directory.is_dir():
        raise UserError(f"--resume {directory}: no such checkpoint directory")
    own = _load(directory / f"rank{rank}.pt")
    shared = own if rank == 0 else _load(directory / "rank0.pt")
    if own.get("format_version") != FORMAT_VERSION:
        raise UserError(f"--resume {directory}: unsupported checkpoint format "
                        f"{own.get('format_version')}")
    if own["world_size"] != world_size:
        raise UserError(
            f"--resume {directory}: checkpoint was written by {own['world_size']} ranks, "
            f"this run has {world_size}"
        )
    return CheckpointRecords(directory, own, shared)


def restore_checkpoint(
    records: CheckpointRecords,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    loader: Any,
) -> tuple[int, float]:
    """Restore everything ``save_checkpoint`` wrote; return ``(step, train_time_ms)``."""
    own, directory = records.own, records.directory
    if len(own["optimizers"]) != len(optimizers):
        raise UserError(
            f"--resume {directory}: checkpoint holds {len(own['optimizers'])} optimizers, the "
            f"run builds {len(optimizers)} (different optimizer setup?)"
        )
    try:
        model.load_state_dict(records.shared["model"])
        for opt, state in zip(optimizers, own["optimizers"]):
            opt.load_state_dict(state)
    except (KeyError, ValueError, RuntimeError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"--resume {directory}: does not fit this run's model or optimizer "
                        f"setup ({first_line})") from exc
    loader.load_state_dict(own["loader"])
    torch.set_rng_state(own["cpu_rng"])
    if own["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(own["cuda_rng"])
    return records.step, float(own["train_time_ms"])


def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"--resume: checkpoint file {path} does not exist")
    try:
        record = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure to unpickle means a damaged file
        # The exception's own text may suggest weights_only=False: wrong advice for a damaged
        # file, and unsafe. Name the file and the failure's type only.
        raise UserError(f"--resume: {path} is not a readable checkpoint (empty, truncated or "
                        f"corrupt: {type(exc).__name__})") from exc
    if not isinstance(record, dict) or "step" not in record:
        raise UserError(f"--resume: {path} is not a nanoshampoo training checkpoint")
    return record
