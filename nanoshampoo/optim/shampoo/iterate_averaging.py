"""The maths of iterate averaging (configs in
:mod:`~nanoshampoo.optim.shampoo.iterate_averaging_types`).

Every function takes per-bucket lists of stacked block tensors (``(B, *block_shape)``, the
bucket's computation dtype) and updates them in place with ``torch._foreach_*`` kernels; the
group runtime decides when they run (steps 7-8 of the step order in
:mod:`~nanoshampoo.optim.shampoo.distributed_shampoo`).

Primal averaging (GPA, Schedule-Free) keeps ``z`` per block and the parameters ``W`` hold ``y``
(train mode) or ``x`` (eval mode), with ``y = mu_y x + (1 - mu_y) z``. Its step never needs
``x``: eliminating it gives the update of ``y`` from ``y``, the old ``z`` and the step ``-lr P``::

    y_{t+1} - y_t = (1 - mu_x) (z_t - y_t) - (1 - mu_x mu_y) lr P

Example:
    >>> z, y, step = [torch.tensor([1.0])], [torch.tensor([0.0])], [torch.tensor([-0.5])]
    >>> primal_averaging_step_(step, z, y, eval_interp_coeff=0.5, train_interp_coeff=1.0)
    >>> z[0].item(), step[0].item()   # z moved by the step; y by 0.5 (1 - 0) - 0.5 * 0.5
    (0.5, 0.25)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanoshampoo.optim.shampoo.iterate_averaging_types import (
    ClassicMomentumConfig,
    GeneralizedPrimalAveragingConfig,
    ScheduleFreeConfig,
)


def classic_momentum_(
    directions: Sequence[torch.Tensor],
    momentum: Sequence[torch.Tensor],
    config: ClassicMomentumConfig,
) -> None:
    """``M <- mu M + (1 - d) P``, then ``P <- M``, or with Nesterov ``P <- (1 - d) P + mu M``.

    ``momentum`` may be stored in a narrower dtype than ``directions`` (``momentum_dtype``).
    """
    mu, keep = config.momentum, 1.0 - config.dampening
    torch._foreach_mul_(momentum, mu)
    torch._foreach_add_(momentum, directions, alpha=keep)
    if config.use_nesterov:
        if keep != 1.0:
            torch._foreach_mul_(directions, keep)
        torch._foreach_add_(directions, momentum, alpha=mu)
    else:
        torch._foreach_copy_(directions, momentum)


def interp_coeffs(
    config: GeneralizedPrimalAveragingConfig | ScheduleFreeConfig, lr: float, lr_power_sum: float
) -> tuple[float, float, float]:
    """``(mu_x, mu_y, new lr_power_sum)`` for a step at ``lr``.

    GPA: its constants; the sum is returned unchanged. Schedule-Free: the sum grows by
    ``lr^r`` and ``mu_x = 1 - lr^r / sum`` (1 while the sum is 0: every lr so far was 0).
    """
    if isinstance(config, GeneralizedPrimalAveragingConfig):
        return config.eval_interp_coeff, config.train_interp_coeff, lr_power_sum
    weight = lr**config.eval_coeff_lr_power
    total = lr_power_sum + weight
    mu_x = 1.0 - weight / total if total > 0.0 else 1.0
    return mu_x, config.train_interp_coeff, total


def shrink_(z: Sequence[torch.Tensor], factor: float) -> None:
    """Decoupled weight decay under primal averaging: ``z <- factor z`` (``1 - lr wd``).

    It applies to ``z`` and not to ``P``: a decay term in ``P`` would reach ``y`` a second time
    through the averaging.
    """
    torch._foreach_mul_(z, factor)


def primal_averaging_step_(
    steps: Sequence[torch.Tensor],
    z: Sequence[torch.Tensor],
    y: Sequence[torch.Tensor],
    eval_interp_coeff: float,
    train_interp_coeff: float,
) -> None:
    """One GPA step: ``z <- z + step``, and ``steps`` becomes the update of ``y``.

    Args:
        steps: ``-lr P`` per bucket; on return ``(1 - mu_x)(z_old - y) - (1 - mu_x mu_y) lr P``.
        z: the ``z`` sequence, updated in place.
        y: copies of the parameters (the ``y`` sequence); overwritten (with ``y - z_old``).
        eval_interp_coeff: ``mu_x``; train_interp_coeff: ``mu_y``.
    """
    torch._foreach_sub_(y, z)
    torch._foreach_add_(z, steps)
    torch._foreach_mul_(steps, 1.0 - eval_interp_coeff * train_interp_coeff)
    torch._foreach_add_(steps, y, alpha=-(1.0 - eval_interp_coeff))


def mode_switch_updates_(
    out: Sequence[torch.Tensor],
    z: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    train_interp_coeff: float,
    to_train: bool,
) -> None:
    """``out <- c (z - params)``: the change of the parameters on a train/eval switch.

    ``x -> y`` (``to_train``) is ``c = 1 - mu_y``; ``y -> x`` is ``c = 1 - 1 / mu_y``, the inverse
    map, from ``y = mu_y x + (1 - mu_y) z``.
    """
    coeff = 1.0 - train_interp_coeff if to_train else 1.0 - 1.0 / train_interp_coeff
    torch._foreach_copy_(out, z)
    torch._foreach_sub_(out, params)
    torch._foreach_mul_(out, coeff)
