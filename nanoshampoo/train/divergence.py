"""Divergence checks of a training run: a NaN/Inf loss, gradient, parameter or validation loss
stops the run with :class:`~nanoshampoo.train.outcomes.TrainingDiverged`, the same verdict on
every rank.

Example:
    >>> import torch
    >>> from nanoshampoo.train.distributed import DistributedContext
    >>> model = torch.nn.Linear(2, 1)
    >>> ctx = DistributedContext(rank=0, world_size=1, device=torch.device("cpu"),
    ...                          owns_process_group=False)
    >>> guard = DivergenceGuard(model, list(model.parameters()), ctx)
    >>> guard.check_validation(step=0, val_loss=float("nan"))
    Traceback (most recent call last):
    ...
    nanoshampoo.train.outcomes.TrainingDiverged: validation loss is nan
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from nanoshampoo.train.distributed import DistributedContext, any_rank_true, local_tensor
from nanoshampoo.train.outcomes import TrainingDiverged


class DivergenceGuard:
    """Checks one model's training numbers; raises :class:`TrainingDiverged` on every rank.

    ``checked_params``: the parameters whose gradients the trainer checks after backward. The
    optimizer setup leaves out parameters whose optimizer checks its own (DistAdam: their
    reduce-scatter may still be reading them; its ``step`` raises ``NonFiniteGradientError``
    on every rank, nothing changed).
    """

    def __init__(
        self, model: nn.Module, checked_params: Sequence[nn.Parameter], ctx: DistributedContext
    ) -> None:
        self.model = model
        self.checked_params = list(checked_params)
        self.ctx = ctx

    def check_step(self, step: int, loss: torch.Tensor) -> None:
        """The step's loss (0-dim) and every checked gradient, in one fused pass: the norm of
        every gradient (NaN/Inf propagate into it), then one host sync for the verdict. Sharded
        (DTensor) gradients are this rank's own, hence the vote across ranks."""
        grads = [local_tensor(p.grad) for p in self.checked_params if p.grad is not None]
        norms = torch._foreach_norm(grads) if grads else []
        finite = torch.stack([loss.float(), *norms]).isfinite().all()
        if not any_rank_true(not bool(finite.item()), self.ctx):
            return
        if bool(torch.isfinite(loss)):
            raise TrainingDiverged(step, "non-finite gradient" + self.culprit(gradients=True))
        culprit = self.culprit(gradients=False) or self.culprit(gradients=True)
        raise TrainingDiverged(
            step,
            f"train loss is {loss.item()}"
            + (culprit or "; parameters and gradients finite on this rank"),
        )

    def check_validation(self, step: int, val_loss: float) -> None:
        """A non-finite validation loss (already the mean over ranks) stops the run."""
        if not math.isfinite(val_loss):
            raise TrainingDiverged(
                step, f"validation loss is {val_loss}" + self.culprit(gradients=False)
            )

    def check_parameters(self, step: int) -> None:
        """Every parameter finite (before a checkpoint: none is written after a divergence)."""
        finite = all(bool(torch.isfinite(local_tensor(p)).all()) for p in self.model.parameters())
        if any_rank_true(not finite, self.ctx):
            raise TrainingDiverged(
                step, "non-finite parameter before the checkpoint" + self.culprit(gradients=False)
            )

    def non_finite_gradient(self, step: int, error: Exception) -> TrainingDiverged:
        """The verdict for an optimizer's own non-finite-gradient check (DistAdam's)."""
        return TrainingDiverged(
            step, "non-finite gradient" + (self.culprit(gradients=True) or f" ({error})")
        )

    def culprit(self, gradients: bool) -> str:
        """``"; first non-finite parameter: NAME"`` (or gradient), ``""`` if all are finite."""
        for name, p in self.model.named_parameters():
            tensor = p.grad if gradients else p
            if tensor is not None and not bool(torch.isfinite(local_tensor(tensor)).all()):
                return f"; first non-finite {'gradient' if gradients else 'parameter'}: {name}"
        return ""
