"""A toy model for optimizer tests: parameters of given shapes and a smooth, non-quadratic loss
of them that changes with the step (so every step sees a new gradient).

Example:
    >>> model = ParamsModel([(3, 2), (4,)], seed=0)
    >>> [tuple(p.shape) for p in model.params]
    [(3, 2), (4,)]
    >>> bool(model(step=1) == model(step=1)), bool(model(step=1) == model(step=2))
    (True, False)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ParamsModel(torch.nn.Module):
    """Float32 parameters of ``shapes`` (``randn`` from ``seed``); ``forward(step)`` is
    ``sum(tanh(p) * W + 0.1 * p^2 * |W|)`` over the parameters, with ``W ~ randn`` drawn from
    ``loss_seed + step``: the same loss on every rank at a given step."""

    def __init__(
        self, shapes: Sequence[Sequence[int]], seed: int = 0, loss_seed: int = 1000
    ) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.loss_seed = loss_seed
        self.params = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(tuple(shape), generator=generator)) for shape in shapes
        )

    def forward(self, step: int | torch.Tensor) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.loss_seed + int(step))
        loss = torch.zeros(())
        for p in self.params:
            weights = torch.randn(p.shape, generator=generator)
            loss = loss + (torch.tanh(p) * weights).sum() + 0.1 * (p * p * weights.abs()).sum()
        return loss
