"""Learning-rate schedule of the speedrun: constant, then a linear cooldown to zero, with an
optional linear warmup over the first steps (off in the speedrun's recipe).

Example:
    >>> lr_multiplier(step=0, total_steps=100, cooldown_frac=0.7)
    1.0
    >>> lr_multiplier(step=65, total_steps=100, cooldown_frac=0.7)
    0.5
    >>> lr_multiplier(step=1, total_steps=100, cooldown_frac=0.7, warmup_steps=4)
    0.5
"""

from __future__ import annotations

import torch


def lr_multiplier(
    step: int, total_steps: int, cooldown_frac: float, warmup_steps: int = 0
) -> float:
    """Factor in [0, 1] applied to every peak learning rate at optimizer step ``step``
    (0-based: the step about to be taken).

    With ``x = step / total_steps``: 1 while ``x < 1 - cooldown_frac``, then
    ``(1 - x) / cooldown_frac``, reaching 0 at ``step == total_steps``. With ``warmup_steps``
    ``W > 0`` that factor is capped by ``(step + 1) / W``: the first step takes ``1/W`` of the
    peak, step ``W - 1`` the full peak (the cap, not a product: a warmup that overlaps the
    cooldown takes the smaller of the two).
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0 <= step <= total_steps:
        raise ValueError(f"step must be in [0, {total_steps}], got {step}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    x = step / total_steps
    cool = 1.0 if cooldown_frac == 0 or x < 1 - cooldown_frac else (1 - x) / cooldown_frac
    if warmup_steps == 0:
        return cool
    return min(cool, (step + 1) / warmup_steps)


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
