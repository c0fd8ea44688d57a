"""The AdamW update of one tensor, in place: the math of DistAdam's step, apart from its
communication and its checks.

Per tensor ``p`` with gradient ``g`` at step ``t`` (1-based, this step included)::

    p *= 1 - lr * wd
    m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g
    p -= lr * sqrt(1 - beta2**t) / (1 - beta1**t) * m / (sqrt(v) + eps)

This is torch's AdamW except where ``eps`` enters: here it is added to ``sqrt(v)`` before the
bias correction, torch adds it after; the two differ only where ``sqrt(v)`` is comparable to
``eps``. A complex tensor is updated as its real view (``torch.view_as_real``: real and
imaginary parts are independent coordinates, each with its own second moment), which is what
``torch.optim.AdamW`` does.

Example:
    >>> p, g = torch.ones(2), torch.tensor([1.0, -1.0])
    >>> m, v = torch.zeros(2), torch.zeros(2)
    >>> adamw_update_(p, g, m, v, step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
    ...               weight_decay=0.0)
    >>> p
    tensor([0.9000, 1.1000])
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def adamw_update_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One decoupled-weight-decay Adam step, in place on ``param``, ``exp_avg``, ``exp_avg_sq``.

    All four tensors have the same shape and dtype; ``step`` is the 1-based count including this
    step. Complex tensors are updated through their real views, as ``torch.optim.AdamW`` does.
    """
    if param.is_complex():
        param, grad, exp_avg, exp_avg_sq = (
            real_view(t) for t in (param, grad, exp_avg, exp_avg_sq)
        )
    if weight_decay != 0.0:
        param.mul_(1.0 - lr * weight_decay)
    exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    step_size = lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
    denom = exp_avg_sq.sqrt().add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def real_view(tensor: Tensor) -> Tensor:
    """``tensor`` itself if real, else its ``(..., 2)`` real view (same storage)."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor
