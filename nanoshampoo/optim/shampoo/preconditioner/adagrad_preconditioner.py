"""Diagonal second-moment preconditioners: AdaGrad, RMSprop and Adam (one implementation)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanoshampoo.optim.shampoo.preconditioner.preconditioner import (
    BlockBucket,
    BlockStateView,
    Preconditioner,
)


class AdaGradPreconditioner(Preconditioner):
    """``V <- b2 V + w G^2`` (``w = 1`` if ``b2 == 1`` else ``1 - b2``);
    ``P = G / (sqrt(V / bc) + eps)``.

    ``drop_weighting_factor``: ``w = 1`` for any ``b2`` and no bias correction (RMSprop/Adam's
    ``drop_weighting_factor_on_gsquare``).

    AdaGrad is ``b2 = 1``; RMSprop is ``b2 < 1`` without bias correction; Adam is ``b2 < 1``
    with ``bc = 1 - b2^t``. ``V`` lives in one stacked tensor per bucket, in ``state_dtype``
    (default: the computation dtype); a narrower ``V`` is updated in the computation dtype and
    rounded once per step.

    Example:
        >>> bucket = BlockBucket((2,), torch.float32, torch.device("cpu"), ("b",))
        >>> adam = AdaGradPreconditioner([bucket], beta2=0.5, epsilon=0.0, use_bias_correction=True)
        >>> adam.update_statistics([torch.tensor([[2.0, -3.0]])], step=1)
        >>> adam.precondition([torch.tensor([[2.0, -3.0]])], step=1)
        [tensor([[ 1., -1.]])]
    """

    name = "adagrad"

    def __init__(
        self,
        buckets: Sequence[BlockBucket],
        beta2: float,
        epsilon: float,
        use_bias_correction: bool,
        state_dtype: torch.dtype | None = None,
        drop_weighting_factor: bool = False,
    ) -> None:
        super().__init__(buckets)
        self._beta2 = beta2
        self._epsilon = epsilon
        # Dropping the weighting factor makes V a discounted sum: no bias correction then.
        self._weight = 1.0 if beta2 == 1.0 or drop_weighting_factor else 1.0 - beta2
        self._use_bias_correction = (
            use_bias_correction and beta2 < 1.0 and not drop_weighting_factor
        )
        self._second_moments = [
            torch.zeros(b.stacked_shape, dtype=state_dtype or b.dtype, device=b.device)
            for b in self._buckets
        ]
        self._outputs = [bucket.zeros() for bucket in self._buckets]
        self._narrow = any(v.dtype != b.dtype for v, b in zip(self._second_moments, self._buckets))

    def update_statistics(self, grads: Sequence[torch.Tensor], step: int) -> None:
        if not self._second_moments:
            return
        # A narrower V is updated in the outputs (computation dtype) and rounded once.
        moments = self._outputs if self._narrow else self._second_moments
        if self._narrow:
            torch._foreach_copy_(moments, self._second_moments)
        if self._beta2 == 1.0:
            torch._foreach_addcmul_(moments, list(grads), list(grads))
        else:
            torch._foreach_mul_(moments, self._beta2)
            torch._foreach_addcmul_(moments, list(grads), list(grads), value=self._weight)
        if self._narrow:
            torch._foreach_copy_(self._second_moments, moments)

    def precondition(self, grads: Sequence[torch.Tensor], step: int) -> list[torch.Tensor]:
        bias_correction = 1.0 - self._beta2**step if self._use_bias_correction else 1.0
        for second_moment, grad, out in zip(self._second_moments, grads, self._outputs):
            if self._narrow:
                out.copy_(second_moment).div_(bias_correction)
            else:
                torch.div(second_moment, bias_correction, out=out)
            out.sqrt_().add_(self._epsilon)
            torch.div(grad, out, out=out)
        return self._outputs

    def block_state(self, bucket_index: int, position: int) -> BlockStateView:
        return BlockStateView(second_moment=self._second_moments[bucket_index][position])
