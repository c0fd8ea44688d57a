"""Read-only views of a ``DistributedShampoo``'s numerical state, one per local block.

For telemetry: what the optimizer already holds after a step, gathered per block so that a
caller can turn it into statistics. Under a DDP or FSDP distributor a rank sees only the
blocks it owns (their state lives there). Nothing here runs during a step, and reading
changes nothing.

- Kronecker-factored preconditioners (Shampoo, KL-Shampoo, SOAP, eigendecomposed Shampoo):
  per factor, the eigenvalues of the bias-corrected factor, the consecutive failed root or
  basis computations, and for those that keep an eigenbasis (SOAP, eigendecomposed) how far
  the basis in force is from diagonalizing the factor
  (:meth:`KroneckerFactoredPreconditioner.factor_health`).
- Grafted groups: the last step's ``||P_s|| / ||P_g||`` per block.
- Spectral descent: the last step's orthogonalized direction ``orth(G)`` per block.

Example:
    >>> from nanoshampoo.optim.shampoo import AdamPreconditionerConfig, DistributedShampoo
    >>> w = torch.nn.Parameter(torch.randn(4, 3))
    >>> opt = DistributedShampoo([w], lr=0.1, betas=(0.9, 0.99), epsilon=1e-12,
    ...                          max_preconditioner_dim=4,
    ...                          grafting_config=AdamPreconditionerConfig())
    >>> w.grad = torch.randn(4, 3)
    >>> opt.step()
    >>> [(view.block, len(view.factors), view.graft_ratio is not None)
    ...  for view in block_health(opt)]
    [('block_0', 2, True)]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoshampoo.optim.shampoo.distributed_shampoo import DistributedShampoo
from nanoshampoo.optim.shampoo.preconditioner.kronecker_factored_preconditioner import (
    FactorHealth,
    KroneckerFactoredPreconditioner,
)
from nanoshampoo.optim.shampoo.preconditioner.spectral_descent_preconditioner import (
    SpectralDescentPreconditioner,
)


@dataclass(frozen=True)
class FactorView:
    """One factor of one block: ``dim`` of the block, ``eigenvalues`` ``(n,)`` float64
    ascending (of ``F / bc2``), ``off_diagonal`` (float, or None without an eigenbasis),
    ``failures`` (consecutive failed computations)."""

    dim: int
    eigenvalues: torch.Tensor
    off_diagonal: float | None
    failures: int


@dataclass(frozen=True)
class BlockView:
    """One local block: its parameter (the optimizer's tensor), its name within the parameter
    (``"block_0"``...), its shape, the group's ``epsilon`` and step count, its factors (empty
    for a preconditioner without), ``graft_ratio`` ``||P_s|| / ||P_g||`` of the last step (None:
    no grafting, or not grafted yet) and ``direction`` (spectral descent: ``orth(G)`` of the
    last step, ``(rows, cols)``; else None)."""

    param: torch.Tensor
    block: str
    shape: tuple[int, ...]
    epsilon: float
    step: int
    factors: list[FactorView]
    graft_ratio: float | None
    direction: torch.Tensor | None


def block_health(optimizer: DistributedShampoo) -> list[BlockView]:
    """A :class:`BlockView` per block this rank holds, in the optimizer's local block order."""
    views = []
    for runtime in optimizer._runtimes:
        if not runtime.block_infos or runtime.step == 0:
            continue
        preconditioner = runtime.preconditioner
        factors: list[list[FactorHealth | None]] = (
            preconditioner.factor_health(runtime.step)
            if isinstance(preconditioner, KroneckerFactoredPreconditioner)
            else [[] for _ in runtime.buckets]
        )
        directions = (
            preconditioner.last_directions()
            if isinstance(preconditioner, SpectralDescentPreconditioner)
            else None
        )
        scales = runtime.graft_scales
        for k, members in enumerate(runtime.bucket_members):
            for position, local in enumerate(members):
                info = runtime.block_infos[local]
                factor_views = [
                    FactorView(
                        dim=dim,
                        eigenvalues=health.eigenvalues[position],
                        off_diagonal=None
                        if health.off_diagonal is None
                        else float(health.off_diagonal[position]),
                        failures=int(health.failures[position]),
                    )
                    for dim, health in enumerate(factors[k])
                    if health is not None
                ]
                graft = None
                if scales:
                    scale = float(scales[k][position])
                    graft = 1.0 / scale if scale > 0.0 else float("inf")
                views.append(
                    BlockView(
                        param=info.param,
                        block=info.composable_block_ids[1],
                        shape=tuple(runtime.buckets[k].shape),
                        epsilon=runtime.hyperparameters.epsilon,
                        step=runtime.step,
                        factors=factor_views,
                        graft_ratio=graft,
                        direction=None if directions is None else directions[k][position],
                    )
                )
    return views
