"""Learning-rate schedule of the speedrun: constant, then a linear cooldown to zero.

Example:
    >>> lr_multiplier(step=0, total_steps=100, cooldown_frac=0.7)
    1.0
    >>> lr_multiplier(step=65, total_steps=100, cooldown_frac=0.7)
    0.5
"""

from __future__ import annotations

import torch


def lr_multiplier(step: int, total_steps: int, cooldown_frac: float) -> float:
    """Factor in [0, 1] applied to every peak learning rate at optimizer step ``step``.

    With ``x = step / total_steps``: 1 while ``x < 1 - cooldown_frac``, then
    ``(1 - x) / cooldown_frac``, reaching 0 at ``step == total_steps``.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0 <= step <= total_steps:
        raise ValueError(f"step must be in [0, {total_steps}], got {step}")
    x = step / total_steps
    if cooldown_frac == 0 or x < 1 - cooldown_frac:
        return 1.0
    return (1 - x) / cooldown_frac


def remember_peak_lrs(optimizers: list[torch.optim.Optimizer]) -> None:
    """Store each param group's ``lr`` as its ``peak_lr`` (once; kept in the state dict)."""
    for opt in optimizers:
        for group in opt.param_groups:
            group.setdefault("peak_lr", group["lr"])


def apply_lr_multiplier(optimizers: list[torch.optim.Optimizer], multiplier: float) -> None:
    """Set every group's ``lr`` to ``peak_lr * multiplier``."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["peak_lr"] * multiplier
