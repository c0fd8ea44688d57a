"""Checks of a run's machine-facing settings, made before anything is allocated or joined.

Each raises ``UserError`` naming the flag: a ``--device cuda`` without a GPU, a
``--dist-timeout-s`` that no process group accepts (``inf`` overflows ``timedelta``), and a model
that cannot fit in the memory there is (the lower-bound estimate of
``nanoshampoo.model.memory``, against the free GPU memory or the host's available memory).

Example:
    >>> check_dist_timeout(600.0)
    >>> check_dist_timeout(float("inf"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    nanoshampoo.errors.UserError: --dist-timeout-s inf: must be a finite number of seconds in ...
"""

from __future__ import annotations

import math
import os

import torch

from nanoshampoo.errors import UserError
from nanoshampoo.model.gpt import GPTConfig
from nanoshampoo.model.memory import training_memory_estimate
from nanoshampoo.validation import is_real

# One year: "wait forever" in practice, and far below what timedelta and c10d's int64
# milliseconds hold.
MAX_DIST_TIMEOUT_S = 365 * 24 * 3600


def check_device(device: str) -> None:
    """``--device cuda`` needs a GPU that torch can see."""
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError(
            "--device cuda: no CUDA GPU is available to torch "
            f"(torch {torch.__version__}); use --device cpu or auto"
        )


def check_dist_timeout(timeout_s: float) -> None:
    """The collective timeout must be a finite positive number of seconds, at most a year."""
    if not (
        is_real(timeout_s) and math.isfinite(timeout_s) and 0 < timeout_s <= MAX_DIST_TIMEOUT_S
    ):
        raise UserError(
            f"--dist-timeout-s {timeout_s}: must be a finite number of seconds in "
            f"(0, {MAX_DIST_TIMEOUT_S}]"
        )


def available_memory_bytes(device: torch.device) -> int:
    """Free memory of the GPU, or the host's available memory (``MemAvailable``) on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory(config: GPTConfig, local_batch: int, seq_len: int, device: torch.device) -> None:
    """Refuse a model whose training memory estimate exceeds what ``device`` has free."""
    estimate = training_memory_estimate(config, local_batch, seq_len)
    available = available_memory_bytes(device)
    if estimate.total_bytes > available:
        raise UserError(
            f"--vocab-size {config.vocab_size}, --model, --batch-size, --seq-len: training needs "
            f"at least {_gib(estimate.total_bytes)} ({estimate.parameters:,} parameters: "
            f"{_gib(estimate.parameter_bytes)}; logits: {_gib(estimate.logit_bytes)}), but "
            f"{device.type} has {_gib(available)} available"
        )


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"
