"""Sign descent: ``P = sign(Gbar) * scale_fn(Gbar)`` per block (signSGD; Lion with the filter)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanoshampoo.optim.shampoo.preconditioner.descent_types import (
    SignDescentPreconditionerConfig,
    unit_scale,
)
from nanoshampoo.optim.shampoo.preconditioner.preconditioner import (
    BlockBucket,
    Preconditioner,
)


class SignDescentPreconditioner(Preconditioner):
    """Elementwise sign of each block's (filtered) gradient, times the block's ``scale_fn``.

    Stateless. ``sign(0) = 0``, so a zero gradient entry takes no step. The default scale (1.0)
    is one ``sign`` kernel per bucket; any other ``scale_fn`` is called once per block, on that
    block's gradient (``bucket.shape``), and its result (a float, or a tensor broadcastable to
    the block) multiplies that block's signs.

    Example:
        >>> bucket = BlockBucket((3,), torch.float32, torch.device("cpu"), ("b",))
        >>> l1 = SignDescentPreconditionerConfig(scale_fn=lambda g: g.abs().sum())
        >>> grad = torch.tensor([[2.0, -1.0, 0.0]])
        >>> SignDescentPreconditioner([bucket], l1).precondition([grad], 1)
        [tensor([[ 3., -3.,  0.]])]
    """

    name = "sign_descent"

    def __init__(
        self, buckets: Sequence[BlockBucket], config: SignDescentPreconditionerConfig
    ) -> None:
        super().__init__(buckets)
        self._scale_fn = config.scale_fn
        self._outputs = [bucket.zeros() for bucket in self._buckets]

    def update_statistics(self, grads: Sequence[torch.Tensor], step: int) -> None:
        """Nothing to accumulate."""

    def precondition(self, grads: Sequence[torch.Tensor], step: int) -> list[torch.Tensor]:
        for grad, out in zip(grads, self._outputs):
            torch.sign(grad, out=out)
            if self._scale_fn is not unit_scale:
                for block_grad, block_out in zip(grad, out):
                    block_out.mul_(self._scale_fn(block_grad))
        return self._outputs
