"""Classic (root-inverse) Shampoo: one Kronecker factor per block dim, batched by factor size.

For a block ``G`` of order ``k``, factor ``i`` is ``F_i <- b2 F_i + w G_(i) G_(i)^T`` (see
:mod:`kronecker_factors`). Its root is ``X_i = (F_i / bc2 + eps I)^(-e_i)`` and the search
direction is ``X_1 x_1 ... X_k x_k G`` (``x_i`` multiplies along dim ``i``). For a matrix
block: ``X_L G X_R``.

Layout: factors are pooled by ``(size, block dtype)``; each pool has a matching ``(N, n, n)``
stack of roots (in the block dtype), so all roots of one size are one batched ``eigh`` call.
A failed root computation keeps the previous root and is counted; more than
``num_tolerated_failed_amortized_computations`` consecutive failures raise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanoshampoo.optim.shampoo.preconditioner.kronecker_factors import (
    KroneckerFactors,
    keep_previous_where_failed,
    multiply_along_dim,
    solve_dtype,
)
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
        self._factors = KroneckerFactors(self._buckets, config.factor_matrix_dtype, self._pool_key)
        root_dtype = solve_dtype(config.factor_matrix_dtype)
        # Roots per pool: (N, n, n) in the block dtype, identity until first computed; and the
        # (N,) exponent of each factor.
        self._roots = {
            (size, dtype): torch.eye(size, dtype=dtype, device=pool.factors.device).repeat(
                len(pool.labels), 1, 1
            )
            for (size, dtype), pool in self._factors.pools.items()
        }
        self._exponents = {
            key: torch.tensor(
                [config.inverse_exponent(order, dim) for order, dim in pool.positions],
                dtype=root_dtype,
                device=pool.factors.device,
            )
            for key, pool in self._factors.pools.items()
        }
        # Output buffers of the matrix fast path, allocated once.
        self._outputs = [bucket.zeros() for bucket in self._buckets]
        self._scratch = [
            bucket.zeros() if len(bucket.shape) == 2 else None for bucket in self._buckets
        ]

    def _pool_key(self, bucket: BlockBucket, dim: int) -> tuple[int, torch.dtype] | None:
        """Factors pool by size and block dtype (the dtype of their roots); exponent 0: none."""
        if self._config.inverse_exponent(len(bucket.shape), dim) == 0.0:
            return None
        return (bucket.shape[dim], bucket.dtype)

    def update_statistics(self, grads: Sequence[torch.Tensor], step: int) -> None:
        self._factors.update(grads, self._beta2)

    def amortized_computation(self, step: int) -> None:
        """Recompute every root; failed ones keep their previous value (see the module doc)."""
        bias_correction = 1.0 - self._beta2**step if self._use_bias_correction else 1.0
        solver = self._config.amortized_computation_config
        root_dtype = solve_dtype(self._config.factor_matrix_dtype)
        for key, pool in self._factors.pools.items():
            matrices = pool.factors.to(root_dtype) / bias_correction
            exponents = self._exponents[key]
            if isinstance(solver, EigenConfig):
                roots, ok = eigh_inverse_root(
                    matrices,
                    exponents,
                    self._epsilon,
                    solver.retry_double_precision,
                    solver.rank_deficient_stability_config,
                    root_dtype=key[1],
                )
            elif isinstance(solver, CoupledNewtonConfig):
                roots, ok = self._coupled_newton_roots(matrices, exponents, solver, key[1])
            else:
                raise TypeError(f"unsupported amortized_computation_config {solver!r}")
            keep_previous_where_failed(self._roots[key], roots, ok)
            self._factors.count_failures(
                pool,
                ok,
                self._config.num_tolerated_failed_amortized_computations,
                computation="Shampoo root computation",
                kept="root",
            )

    def _coupled_newton_roots(
        self,
        matrices: torch.Tensor,
        exponents: torch.Tensor,
        solver: CoupledNewtonConfig,
        root_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        roots = torch.empty_like(matrices)
        ok = torch.empty(matrices.shape[0], dtype=torch.bool, device=matrices.device)
        orders = torch.round(1.0 / exponents).to(torch.int64)
        for order in orders.unique().tolist():
            index = (orders == order).nonzero().squeeze(1)
            roots[index], ok[index] = coupled_newton_inverse_root(
                matrices[index],
                int(order),
                self._epsilon,
                solver.max_iterations,
                solver.tolerance,
                root_dtype=root_dtype,
            )
        return roots, ok

    def precondition(self, grads: Sequence[torch.Tensor], step: int) -> list[torch.Tensor]:
        slots = self._factors.slots
        for index, (bucket, bucket_slots, grad) in enumerate(zip(self._buckets, slots, grads)):
            count = bucket.num_blocks
            roots = [
                None if slot is None else KroneckerFactors.rows(slot, count, self._roots)
                for slot in bucket_slots
            ]
            out = self._outputs[index]
            if len(bucket.shape) == 2:
                self._precondition_matrices(grad, roots[0], roots[1], self._scratch[index], out)
            elif len(bucket.shape) == 1 and roots[0] is not None:
                torch.bmm(roots[0], grad.unsqueeze(-1), out=out.unsqueeze(-1))
            else:
                result = grad
                for dim, root in enumerate(roots):
                    if root is not None:
                        result = multiply_along_dim(root, result, dim)
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
        for dim, slot in enumerate(self._factors.slots[bucket_index]):
            if slot is None:
                continue
            pool = self._factors.pools[slot.pool_key]
            row = slot.offset + position
            factors[dim] = pool.factors[row]
            roots[dim] = self._roots[slot.pool_key][row]
            failures[dim] = pool.failure_counts[row]
        return BlockStateView(
            factor_matrices=factors, inv_factor_matrices=roots, failure_counts=failures
        )
