"""Classic (root-inverse) Shampoo: one Kronecker factor per block dim, batched by factor size.

For a block ``G`` of order ``k`` with dims ``n_1..n_k``, factor ``i`` is
``F_i <- b2 F_i + w G_(i) G_(i)^T`` where ``G_(i)`` is ``G`` unfolded along dim ``i``
(``n_i x prod(other dims)``) and ``w = 1`` if ``b2 == 1`` else ``1 - b2``. Its root is
``X_i = (F_i / bc2 + eps I)^(-e_i)`` and the search direction is ``X_1 x_1 ... X_k x_k G``
(``x_i`` multiplies along dim ``i``). For a matrix block: ``X_L G X_R``.

Layout, chosen for speed: all factors of one size ``n`` (over every block and dim of the
group) live in one stacked ``(N, n, n)`` tensor, a *factor pool*. A bucket's factors for one
dim are a contiguous slice of a pool, so statistics are one ``baddbmm_`` per bucket and dim,
and all roots of one size are one batched ``eigh`` call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from nanoshampoo.optim.shampoo.preconditioner.matrix_roots import (
    coupled_newton_inverse_root,
    eigh_inverse_root,
)
from nanoshampoo.optim.shampoo.preconditioner.preconditioner import (
    BlockBucket,
    BlockStateView,
    Preconditioner,
)
from nanoshampoo.optim.shampoo.shampoo_types import (
    CoupledNewtonConfig,
    EigenConfig,
    ShampooPreconditionerConfig,
)

logger = logging.getLogger(__name__)


@dataclass
class _FactorPool:
    """All factors of one size ``n`` (and one root dtype) of a parameter group.

    ``factors`` ``(N, n, n)`` in the factor dtype; ``roots`` ``(N, n, n)`` in the computation
    dtype (identity until the first root computation); ``exponents`` ``(N,)``;
    ``failure_counts`` ``(N,)`` int64, consecutive failed root computations; ``labels`` name
    each factor (block label and dim) for error messages.
    """

    factors: torch.Tensor
    roots: torch.Tensor
    exponents: torch.Tensor
    failure_counts: torch.Tensor
    labels: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _FactorSlot:
    """Where the factors of one dim of one bucket live: ``pool[key][offset:offset + B]``."""

    pool_key: tuple[int, torch.dtype]
    offset: int


class ShampooPreconditioner(Preconditioner):
    """Root-inverse Shampoo over the buckets of one parameter group.

    Args:
        buckets: the group's block buckets.
        config: a Shampoo config (root solver, factor dtype, exponents, failure tolerance).
        beta2: EMA factor of the factors, in (0, 1]; ``1`` accumulates (AdaGrad-like).
        epsilon: ridge added before the root.
        use_bias_correction: divide factors by ``1 - b2^t`` before the root (when ``b2 < 1``).

    Example:
        >>> from nanoshampoo.optim.shampoo.shampoo_types import DefaultShampooConfig
        >>> bucket = BlockBucket((3, 2), torch.float32, torch.device("cpu"), ("w block_0",))
        >>> shampoo = ShampooPreconditioner([bucket], DefaultShampooConfig, 1.0, 1e-12, True)
        >>> g = torch.randn(1, 3, 2)
        >>> shampoo.update_statistics([g], step=1)
        >>> shampoo.amortized_computation(step=1)
        >>> shampoo.precondition([g], step=1)[0].shape
        torch.Size([1, 3, 2])
    """

    name = "shampoo"

    def __init__(
        self,
        buckets: Sequence[BlockBucket],
        config: ShampooPreconditionerConfig,
        beta2: float,
        epsilon: float,
        use_bias_correction: bool,
    ) -> None:
        super().__init__(buckets)
        self._config = config
        self._beta2 = beta2
        self._epsilon = epsilon
        self._use_bias_correction = use_bias_correction and beta2 < 1.0
        self._slots, self._pools = self._allocate_pools(config)
        # Output buffers of the matrix fast path, allocated once.
        self._outputs = [bucket.zeros() for bucket in self._buckets]
        self._scratch = [
            bucket.zeros() if len(bucket.shape) == 2 else None for bucket in self._buckets
        ]

    def _allocate_pools(
        self, config: ShampooPreconditionerConfig
    ) -> tuple[list[list[_FactorSlot | None]], dict[tuple[int, torch.dtype], _FactorPool]]:
        plan: dict[tuple[int, torch.dtype], list[tuple[str, float]]] = {}
        slots: list[list[_FactorSlot | None]] = []
        for bucket in self._buckets:
            order = len(bucket.shape)
            bucket_slots: list[_FactorSlot | None] = []
            for dim, size in enumerate(bucket.shape):
                exponent = config.inverse_exponent(order, dim)
                if exponent == 0.0:
                    bucket_slots.append(None)
                    continue
                key = (size, bucket.dtype)
                entries = plan.setdefault(key, [])
                bucket_slots.append(_FactorSlot(key, len(entries)))
                entries.extend((f"{label} dim {dim}", exponent) for label in bucket.block_labels)
            slots.append(bucket_slots)
        device = self._buckets[0].device if self._buckets else torch.device("cpu")
        pools = {}
        for (size, dtype), entries in plan.items():
            count = len(entries)
            root_dtype = self._root_dtype()
            pools[(size, dtype)] = _FactorPool(
                factors=torch.zeros(count, size, size, dtype=config.factor_matrix_dtype, device=device),
                roots=torch.eye(size, dtype=dtype, device=device).repeat(count, 1, 1),
                exponents=torch.tensor([e for _, e in entries], dtype=root_dtype, device=device),
                failure_counts=torch.zeros(count, dtype=torch.int64, device=device),
                labels=[label for label, _ in entries],
            )
        return slots, pools

    def _root_dtype(self) -> torch.dtype:
        """Roots are solved in at least float32 (``eigh`` has no half-precision kernels)."""
        return torch.promote_types(self._config.factor_matrix_dtype, torch.float32)

    def _factor_slice(self, slot: _FactorSlot, count: int) -> torch.Tensor:
        return self._pools[slot.pool_key].factors[slot.offset : slot.offset + count]

    def _root_slice(self, slot: _FactorSlot, count: int) -> torch.Tensor:
        return self._pools[slot.pool_key].roots[slot.offset : slot.offset + count]

    def update_statistics(self, grads: Sequence[torch.Tensor], step: int) -> None:
        weight = 1.0 if self._beta2 == 1.0 else 1.0 - self._beta2
        factor_dtype = self._config.factor_matrix_dtype
        for bucket, bucket_slots, grad in zip(self._buckets, self._slots, grads):
            grad = grad.to(factor_dtype)
            count = bucket.num_blocks
            for dim, slot in enumerate(bucket_slots):
                if slot is None:
                    continue
                unfolded = self._unfold(grad, dim)
                self._factor_slice(slot, count).baddbmm_(
                    unfolded, unfolded.mT, beta=self._beta2, alpha=weight
                )

    @staticmethod
    def _unfold(grad: torch.Tensor, dim: int) -> torch.Tensor:
        """``(B, n_dim, prod(other dims))``: a view for the first and the last dim."""
        count, size = grad.shape[0], grad.shape[dim + 1]
        if dim + 2 == grad.dim():
            return grad.reshape(count, -1, size).mT
        return grad.movedim(dim + 1, 1).reshape(count, size, -1)

    def amortized_computation(self, step: int) -> None:
        """Recompute every root; failed ones keep their previous value (see the module doc)."""
        bias_correction = 1.0 - self._beta2**step if self._use_bias_correction else 1.0
        solver = self._config.amortized_computation_config
        for pool in self._pools.values():
            matrices = pool.factors.to(self._root_dtype()) / bias_correction
            if isinstance(solver, EigenConfig):
                roots, ok = eigh_inverse_root(
                    matrices, pool.exponents, self._epsilon, solver.retry_double_precision
                )
            elif isinstance(solver, CoupledNewtonConfig):
                roots, ok = self._coupled_newton_roots(matrices, pool.exponents, solver)
            else:
                raise TypeError(f"unsupported amortized_computation_config {solver!r}")
            pool.roots.copy_(torch.where(ok.view(-1, 1, 1), roots.to(pool.roots.dtype), pool.roots))
            pool.failure_counts.add_(1).masked_fill_(ok, 0)
            if not bool(ok.all()):
                self._report_failures(pool, ok)

    def _coupled_newton_roots(
        self, matrices: torch.Tensor, exponents: torch.Tensor, solver: CoupledNewtonConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        roots = torch.empty_like(matrices)
        ok = torch.empty(matrices.shape[0], dtype=torch.bool, device=matrices.device)
        orders = torch.round(1.0 / exponents).to(torch.int64)
        for order in orders.unique().tolist():
            index = (orders == order).nonzero().squeeze(1)
            roots[index], ok[index] = coupled_newton_inverse_root(
                matrices[index], int(order), self._epsilon, solver.max_iterations, solver.tolerance
            )
        return roots, ok

    def _report_failures(self, pool: _FactorPool, ok: torch.Tensor) -> None:
        tolerated = self._config.num_tolerated_failed_amortized_computations
        counts = pool.failure_counts.tolist()
        for index in (~ok).nonzero().squeeze(1).tolist():
            if counts[index] > tolerated:
                raise RuntimeError(
                    f"Shampoo root computation failed for {pool.labels[index]} "
                    f"{counts[index]} consecutive times, more than "
                    f"num_tolerated_failed_amortized_computations={tolerated}; the factor matrix "
                    "is probably non-finite (check the gradients and the loss)"
                )
            logger.warning(
                "Shampoo root computation failed for %s (%d consecutive); keeping the previous root",
                pool.labels[index],
                counts[index],
            )

    def precondition(self, grads: Sequence[torch.Tensor], step: int) -> list[torch.Tensor]:
        for index, (bucket, bucket_slots, grad) in enumerate(zip(self._buckets, self._slots, grads)):
            count = bucket.num_blocks
            roots = [None if s is None else self._root_slice(s, count) for s in bucket_slots]
            out = self._outputs[index]
            if len(bucket.shape) == 2:
                self._precondition_matrices(grad, roots[0], roots[1], self._scratch[index], out)
            elif len(bucket.shape) == 1 and roots[0] is not None:
                torch.bmm(roots[0], grad.unsqueeze(-1), out=out.unsqueeze(-1))
            else:
                result = grad
                for dim, root in enumerate(roots):
                    if root is not None:
                        moved = result.movedim(dim + 1, 1)
                        product = root @ moved.reshape(count, bucket.shape[dim], -1)
                        result = product.view(moved.shape).movedim(1, dim + 1)
                out.copy_(result)
        return self._outputs

    @staticmethod
    def _precondition_matrices(
        grad: torch.Tensor,
        left: torch.Tensor | None,
        right: torch.Tensor | None,
        scratch: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """``out = X_L G X_R`` for stacked matrices, either root possibly absent (identity)."""
        if left is not None and right is not None:
            torch.bmm(torch.bmm(left, grad, out=scratch), right, out=out)
        elif left is not None:
            torch.bmm(left, grad, out=out)
        elif right is not None:
            torch.bmm(grad, right, out=out)
        else:
            out.copy_(grad)

    def block_state(self, bucket_index: int, position: int) -> BlockStateView:
        factors: dict[int, torch.Tensor] = {}
        roots: dict[int, torch.Tensor] = {}
        failures: dict[int, torch.Tensor] = {}
        for dim, slot in enumerate(self._slots[bucket_index]):
            if slot is None:
                continue
            pool = self._pools[slot.pool_key]
            row = slot.offset + position
            factors[dim] = pool.factors[row]
            roots[dim] = pool.roots[row]
            failures[dim] = pool.failure_counts[row]
        return BlockStateView(
            factor_matrices=factors, inv_factor_matrices=roots, failure_counts=failures
        )
