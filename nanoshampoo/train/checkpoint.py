"""Checkpoints that resume a run exactly: model, optimizers, data position, step, clock, RNG.

Layout: ``<out_dir>/<run_id>.ckpt/step_NNNNNN/rank{r}.pt``, one file per rank, each written
atomically (:func:`nanoshampoo.io_utils.atomic_output`). ``rank0.pt`` also holds the
model weights (identical on every rank); every rank holds its own optimizer state (sharded
optimizers such as DistAdam and the DDP Shampoo distributor keep different state per rank),
loader position and RNG state. Files load with ``torch.load(weights_only=True)``.

Example:
    >>> path = checkpoint_path("runs", "r1", step=100)  # runs/r1.ckpt/step_000100
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanoshampoo.io_utils import atomic_output

FORMAT_VERSION = 1


def checkpoint_path(out_dir: str, run_id: str, step: int) -> Path:
    return Path(out_dir) / f"{run_id}.ckpt" / f"step_{step:06d}"


def save_checkpoint(
    directory: Path,
    rank: int,
    world_size: int,
    step: int,
    train_time_ms: float,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    loader: Any,
) -> None:
    """Write this rank's ``rank{rank}.pt`` under ``directory`` (created if needed)."""
    record: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
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
    with atomic_output(directory / f"rank{rank}.pt") as tmp:
        torch.save(record, tmp)


def load_checkpoint(
    directory: Path,
    rank: int,
    world_size: int,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    loader: Any,
) -> tuple[int, float]:
    """Restore everything ``save_checkpoint`` wrote; return ``(step, train_time_ms)``."""
    own = _load(directory / f"rank{rank}.pt")
    shared = own if rank == 0 else _load(directory / "rank0.pt")
    if own.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{directory}: unsupported checkpoint format {own.get('format_version')}")
    if own["world_size"] != world_size:
        raise ValueError(
            f"{directory}: checkpoint was written by {own['world_size']} ranks, "
            f"this run has {world_size}"
        )
    if len(own["optimizers"]) != len(optimizers):
        raise ValueError(
            f"{directory}: checkpoint holds {len(own['optimizers'])} optimizers, the run "
            f"builds {len(optimizers)} (different optimizer setup?)"
        )
    model.load_state_dict(shared["model"])
    for opt, state in zip(optimizers, own["optimizers"]):
        opt.load_state_dict(state)
    loader.load_state_dict(own["loader"])
    torch.set_rng_state(own["cpu_rng"])
    if own["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(own["cuda_rng"])
    return int(own["step"]), float(own["train_time_ms"])


def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} does not exist")
    record = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(record, dict) or "step" not in record:
        raise ValueError(f"{path}: not a nanoshampoo training checkpoint")
    return record

