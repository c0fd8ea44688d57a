"""The identity preconditioner: the search direction is the gradient itself."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanoshampoo.optim.shampoo.preconditioner.preconditioner import Preconditioner


class SGDPreconditioner(Preconditioner):
    """``P = G``; no statistics, no state.

    Example:
        >>> from nanoshampoo.optim.shampoo.preconditioner.preconditioner import BlockBucket
        >>> bucket = BlockBucket((2,), torch.float32, torch.device("cpu"), ("b",))
        >>> SGDPreconditioner([bucket]).precondition([torch.ones(1, 2)], step=1)
        [tensor([[1., 1.]])]
    """

    name = "sgd"

    def update_statistics(self, grads: Sequence[torch.Tensor], step: int) -> None:
        """Nothing to accumulate."""

    def precondition(self, grads: Sequence[torch.Tensor], step: int) -> list[torch.Tensor]:
        return list(grads)
