"""Classic (root-inverse) Shampoo: one Kronecker factor per block dim, batched by factor size.

For a block ``G`` of order ``k``, factor ``i`` is ``F_i <- b2 F_i + w G_(i) G_(i)^T`` (see
:mod:`kronecker_factors`). Its root is ``X_i = (F_i / bc2 + eps I)^(-e_i)`` and the search
direction is ``X_1 x_1 ... X_k x_k G`` (``x_i`` multiplies along dim ``i``). For a matrix
block: ``X_L G X_R``.

Layout: factors are pooled by ``(size, block dtype)``; each pool has a matching ``(N, n, n)``
stack of roots (in ``inv_factor_matrix_dtype``, by default the block dtype), so all roots of one
size are one batched ``eigh`` call.
With ``use_symmetric_packing`` (the default) the factors are packed (their upper triangles, or
from 512 on their upper tiles; the same numbers: :mod:`kronecker_factors`); the roots stay
full matrices, exactly symmetric (:meth:`ShampooPreconditioner._keep`), and a state dict holds
their upper triangles.
With ``precondition_dtype=torch.bfloat16`` the products run in bfloat16 buffers allocated once
per bucket (:class:`_GemmBuffers`: the rounded gradient, roots, ``X_L G`` and the product),
and the product is copied into the block-dtype output; roots and factors keep their dtypes.
A failed root computation keeps the previous root and is counted; more than
``num_tolerated_failed_amortized_computations`` consecutive failures raise.
KL-Shampoo (``RootInvKLShampooPreconditionerConfig``) differs only in the factor update: factor
``i`` accumulates ``G`` preconditioned along every other dim by the roots in force
(:meth:`ShampooPreconditioner.update_statistics`). ``CoupledHigherOrderConfig`` roots come from
:func:`matrix_roots.coupled_higher_order_inverse_root`, one batched call per exponent.
With ``WarmStartedEigenConfig`` each pool also keeps its factors' last eigenvectors (block
state ``factor_matrices_eigenvectors``, ``eigenvectors_computed``), and the roots start from
them (:func:`matrix_roots.warm_started_eigh_inverse_root`); :meth:`warm_start_counts` reads how
many warm solves fell back to ``eigh``.

Rank-deficient factors (vectors, wide blocks, the first steps) are the normal case. In float32
their null-space eigenvalues are rounding noise, and ``eps = 1e-12`` would weight the noise the
gradient has in those directions by ``eps^(-e)``; the default ``PerturbationConfig`` floors the
spectrum at ``sqrt(n) * eps * lambda_max`` (:mod:`matrix_roots`). The float32 options against
float64: docs/results/float32-accuracy.md "Root-inverse Shampoo: which float32 option"; the
error of bfloat16 storage: docs/results/shampoo-state.md "bf16 storage: the parameter error".
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch

from nanoshampoo.optim.shampoo.preconditioner.factor_matrix_ops import (
    keep_previous_where_failed,
    multiply_along_dim,
    symmetric_part,
)
from nanoshampoo.optim.shampoo.preconditioner.kronecker_factored_preconditioner import (
    KroneckerFactoredPreconditioner,
)
from nanoshampoo.optim.shampoo.preconditioner.matrix_roots import (
    coupled_higher_order_inverse_root,
    coupled_newton_inverse_root,
    eigh_inverse_root,
    least_precise_dtype,
    warm_started_eigh_inverse_root,
)
from nanoshampoo.optim.shampoo.preconditioner.preconditioner import BlockBucket
from nanoshampoo.optim.shampoo.preconditioner.shampoo_variant_types import (
    KL_SHAMPOO_CONFIG_TYPES,
)
from nanoshampoo.optim.shampoo.shampoo_types import (
    CoupledHigherOrderConfig,
    CoupledNewtonConfig,
    EigenConfig,
    ShampooPreconditionerConfig,
    WarmStartedEigenConfig,
)

# The solvers whose roots are exactly symmetric as computed (eigenvector products formed by
# factor_matrix_ops.symmetric_product).
_SYMMETRIC_ROOT_SOLVERS = (EigenConfig, WarmStartedEigenConfig)

# Exponents are floats (1/6 is not exact); the root 1 / e of CoupledHigherOrderConfig is the
# nearest fraction with at most this denominator (1/6 -> 6, 0.4 -> 5/2).
_MAX_ROOT_DENOMINATOR = 64


class ShampooPreconditioner(KroneckerFactoredPreconditioner):
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

    computation = "Shampoo root computation"
    kept = "root"
    result_state_name = "inv_factor_matrices"
    _config: ShampooPreconditionerConfig

    def _allocate_state(self) -> None:
        config = self._config
        self._kl = isinstance(config, KL_SHAMPOO_CONFIG_TYPES)
        # The (N,) exponent of each factor, per pool.
        self._exponents = {
            key: torch.tensor(
                [config.inverse_exponent(order, dim) for order, dim in pool.positions],
                dtype=self._solve_dtype,
                device=pool.factors.device,
            )
            for key, pool in self._factors.pools.items()
        }
        # WarmStartedEigenConfig: per pool, the (N, n, n) eigenvectors of the last root
        # (descending, solve dtype) and (N,) "computed at least once"; both are block state.
        # Counters (not state): warm-started solves and their eigh fallbacks, on the device.
        self._warm_solver = isinstance(config.amortized_computation_config, WarmStartedEigenConfig)
        self._eigenvectors: dict[Hashable, torch.Tensor] = {}
        self._eigenvectors_computed: dict[Hashable, torch.Tensor] = {}
        device = self._buckets[0].device if self._buckets else torch.device("cpu")
        self._warm_start_counts = torch.zeros(2, dtype=torch.int64, device=device)
        if self._warm_solver:
            self.extra_dim_state_names = ("factor_matrices_eigenvectors", "eigenvectors_computed")
            self._eigenvectors_computed = self._pool_flags()
            for key, pool in self._factors.pools.items():
                self._eigenvectors[key] = torch.eye(
                    pool.size, dtype=self._solve_dtype, device=pool.factors.device
                ).repeat(len(pool.labels), 1, 1)
        # Output buffers of the matrix fast path, allocated once; with precondition_dtype the
        # GEMMs run in its buffers instead (None where a bucket multiplies in its own dtype).
        self._outputs = [bucket.zeros() for bucket in self._buckets]
        self._gemm_buffers = [self._allocate_gemm_buffers(i) for i in range(len(self._buckets))]
        self._scratch = [
            bucket.zeros() if len(bucket.shape) == 2 and buffers is None else None
            for bucket, buffers in zip(self._buckets, self._gemm_buffers)
        ]

    def _allocate_gemm_buffers(self, bucket_index: int) -> _GemmBuffers | None:
        """The ``precondition_dtype`` buffers of a bucket; None when the GEMMs run in the block
        dtype (no such dtype, the block's own, or no root to apply)."""
        dtype = self._config.precondition_dtype
        bucket = self._buckets[bucket_index]
        slots = self._factors.slots[bucket_index]
        if dtype is None or dtype == bucket.dtype or all(slot is None for slot in slots):
            return None

        def stack(*shape: int) -> torch.Tensor:
            return torch.zeros(bucket.num_blocks, *shape, dtype=dtype, device=bucket.device)

        return _GemmBuffers(
            grad=stack(*bucket.shape),
            out=stack(*bucket.shape),
            scratch=stack(*bucket.shape) if len(bucket.shape) == 2 else None,
            roots=[None if slot is None else stack(n, n) for slot, n in zip(slots, bucket.shape)],
        )

    def _large_factor_schedule(self) -> tuple[int, int]:
        return self._config.large_factor_schedule()

    def _pool_key(self, bucket: BlockBucket, dim: int) -> tuple[int, torch.dtype] | None:
        """Factors pool by size and block dtype (the dtype of their roots); exponent 0: none."""
        if self._config.inverse_exponent(len(bucket.shape), dim) == 0.0:
            return None
        return (bucket.shape[dim], bucket.dtype)

    def _result_dtype(self, key: Hashable) -> torch.dtype:
        # Roots are applied to the block: by default they live in its dtype.
        return self._config.inv_factor_matrix_dtype or key[1]

    def _solver_reads_upper(self) -> bool:
        # eigh of a packed pool's transposed view reads the lower triangle of the view (below).
        return isinstance(self._config.amortized_computation_config, EigenConfig)

    def _solve(
        self, key: Hashable, matrices: torch.Tensor, rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The roots as the solver gives them, not yet symmetric: :meth:`_keep` stores their
        symmetric part."""
        solver = self._config.amortized_computation_config
        exponents = self._exponents[key] if rows is None else self._exponents[key][rows]
        # The floor follows the factor and block dtypes, not inv_factor_matrix_dtype: measured
        # (module docstring), a bfloat16 root floored at bfloat16's eps moved parameters 4x
        # further from the float32 run than one floored at float32's.
        precision = least_precise_dtype(key[1], self._config.factor_matrix_dtype)
        if isinstance(solver, EigenConfig):
            device = solver.eigendecomposition_offload_device or matrices.device
            if self._factors.pools[key].packed:
                # The transposed view lies in LAPACK's column-major layout, so eigh copies it
                # as it lies, not by a strided transpose (slow at n = 1024). eigh reads the
                # view's lower triangle, the matrices' upper one: all that
                # _solver_reads_upper asked to hold the factors.
                matrices = matrices.mT
            # Every row solved: the stored roots may be written in place (eigh_inverse_root
            # decides where that is safe).
            stored = self._results[key] if rows is None else None
            roots, ok = eigh_inverse_root(
                matrices.to(device),
                exponents.to(device),
                self._epsilon,
                solver.retry_double_precision,
                solver.rank_deficient_stability_config,
                root_dtype=precision,
                overwrite_input=True,  # the amortized computation's temporary (see _solve)
                out=stored,
            )
            return roots.to(matrices.device), ok.to(matrices.device)
        if isinstance(solver, WarmStartedEigenConfig):
            return self._warm_started_roots(key, matrices, rows, exponents, solver, precision)
        if isinstance(solver, CoupledNewtonConfig):
            return self._coupled_newton_roots(matrices, exponents, solver, precision)
        if isinstance(solver, CoupledHigherOrderConfig):
            return self._higher_order_roots(matrices, exponents, solver, precision)
        raise TypeError(f"unsupported amortized_computation_config {solver!r}")

    def _keep(self, previous: torch.Tensor, results: torch.Tensor, ok: torch.Tensor) -> None:
        """Stores the roots exactly symmetric, so that a checkpoint with
        ``use_symmetric_packing`` (the upper triangle) resumes bit for bit.

        The eigh solvers' roots are exactly symmetric as computed (:func:`symmetric_product`)
        and are stored as they are. The coupled iterations' differ from their
        transposes (a float32 coupled Newton iterate on a rank-deficient factor by about
        0.5 %): their symmetric part ``(X + X^T) / 2``, the nearest symmetric matrix, is
        stored; when every root succeeded (the common case) and the stored dtype is the
        solver's, it is summed straight into the stored roots: no temporary, no copy."""
        if results is previous:
            return  # written in place, every root succeeded (eigh_inverse_root's ``out``)
        if isinstance(self._config.amortized_computation_config, _SYMMETRIC_ROOT_SOLVERS):
            keep_previous_where_failed(previous, results, ok)
        elif previous.dtype == results.dtype and bool(ok.all()):
            symmetric_part(results, out=previous)
        else:
            symmetric = symmetric_part(results, out=torch.empty_like(results))
            keep_previous_where_failed(previous, symmetric, ok)

    def _warm_started_roots(
        self,
        key: Hashable,
        matrices: torch.Tensor,
        rows: torch.Tensor | None,
        exponents: torch.Tensor,
        solver: WarmStartedEigenConfig,
        root_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Roots from the previous eigenvectors of the solved rows; successful solves store
        their eigenvectors (failed ones keep the old, like the root) and count on the device."""
        eigenvectors, computed = self._eigenvectors[key], self._eigenvectors_computed[key]
        previous = eigenvectors if rows is None else eigenvectors.index_select(0, rows)
        warm = computed.clone() if rows is None else computed.index_select(0, rows)
        roots, bases, ok, fell_back = warm_started_eigh_inverse_root(
            matrices,
            exponents,
            self._epsilon,
            previous,
            warm,
            solver.max_iterations,
            solver.tolerance,
            solver.retry_double_precision,
            solver.rank_deficient_stability_config,
            root_dtype=root_dtype,
        )
        kept = torch.where(ok.view(-1, 1, 1), bases.to(previous.dtype), previous)
        if rows is None:
            eigenvectors.copy_(kept)
        else:
            eigenvectors.index_copy_(0, rows, kept)
        self._mark_computed(computed, rows, ok)
        self._warm_start_counts.add_(torch.stack([warm.sum(), fell_back.sum()]))
        return roots, ok

    def warm_start_counts(self) -> tuple[int, int]:
        """``(warm-started root solves, of which fell back to eigh)`` since construction (a
        host read; zeros unless the solver is ``WarmStartedEigenConfig``)."""
        warm, fell_back = self._warm_start_counts.tolist()
        return warm, fell_back

    def _extra_dim_state(self, key: Hashable, row: int) -> dict[str, torch.Tensor]:
        if not self._warm_solver:
            return {}
        return {
            "factor_matrices_eigenvectors": self._eigenvectors[key][row],
            "eigenvectors_computed": self._eigenvectors_computed[key][row],
        }

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

    def _higher_order_roots(
        self,
        matrices: torch.Tensor,
        exponents: torch.Tensor,
        solver: CoupledHigherOrderConfig,
        root_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One batched iteration per distinct exponent ``e`` (root ``1 / e`` as a fraction)."""
        roots = torch.empty_like(matrices)
        ok = torch.empty(matrices.shape[0], dtype=torch.bool, device=matrices.device)
        for exponent in exponents.unique().tolist():
            index = (exponents == exponent).nonzero().squeeze(1)
            roots[index], ok[index] = coupled_higher_order_inverse_root(
                matrices[index],
                Fraction(1.0 / exponent).limit_denominator(_MAX_ROOT_DENOMINATOR),
                solver.rel_epsilon,
                solver.abs_epsilon,
                solver.max_iterations,
                solver.tolerance,
                solver.order,
                root_dtype=root_dtype,
            )
        return roots, ok

    def _bucket_roots(self, bucket_index: int) -> list[torch.Tensor | None]:
        """Per dim, the bucket's ``(B, n, n)`` roots in its dtype (None: not preconditioned).

        Roots stored narrower than the block (``inv_factor_matrix_dtype``) are cast to it.
        """
        dtype = self._buckets[bucket_index].dtype
        return [None if r is None else r.to(dtype) for r in self._bucket_results(bucket_index)]

    def update_statistics(self, grads: Sequence[torch.Tensor], step: int) -> None:
        """Shampoo: the factors from ``G``. KL-Shampoo: factor ``i`` from ``G`` preconditioned
        along every other dim by the roots in force (:mod:`shampoo_variant_types`)."""
        if not self._kl:
            super().update_statistics(grads, step)
            return
        sources: list[list[torch.Tensor | None]] = []
        for index, grad in enumerate(grads):
            roots = self._bucket_roots(index)
            per_dim: list[torch.Tensor | None] = []
            for dim, own in enumerate(roots):
                source = None
                if own is not None:
                    source = grad
                    for other, root in enumerate(roots):
                        if other != dim and root is not None:
                            source = multiply_along_dim(root, source, other)
                per_dim.append(source)
            sources.append(per_dim)
        self._factors.update(sources, self._beta2, self._weight)

    def precondition(self, grads: Sequence[torch.Tensor], step: int) -> list[torch.Tensor]:
        """Per bucket ``X_1 x_1 ... X_k x_k G`` into the block-dtype outputs; with
        ``precondition_dtype`` the gradient and roots are first rounded into its buffers."""
        for index, grad in enumerate(grads):
            roots = self._bucket_roots(index)
            buffers = self._gemm_buffers[index]
            if buffers is None:
                self._apply_roots(grad, roots, self._scratch[index], self._outputs[index])
                continue
            gemm_roots = [
                None if root is None else buffer.copy_(root)
                for root, buffer in zip(roots, buffers.roots)
            ]
            self._apply_roots(buffers.grad.copy_(grad), gemm_roots, buffers.scratch, buffers.out)
            self._outputs[index].copy_(buffers.out)
        return self._outputs

    @classmethod
    def _apply_roots(
        cls,
        grad: torch.Tensor,
        roots: Sequence[torch.Tensor | None],
        scratch: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        """``out = X_1 x_1 ... X_k x_k G`` for stacked blocks ``grad`` ``(B, *shape)``, every
        tensor in one dtype; ``roots`` per dim ``(B, n, n)`` or None (identity); ``scratch`` a
        ``(B, *shape)`` buffer for matrix blocks (unused otherwise)."""
        if grad.dim() == 3:
            cls._precondition_matrices(grad, roots[0], roots[1], scratch, out)
        elif grad.dim() == 2 and roots[0] is not None:
            torch.bmm(roots[0], grad.unsqueeze(-1), out=out.unsqueeze(-1))
        else:
            result = grad
            for dim, root in enumerate(roots):
                if root is not None:
                    result = multiply_along_dim(root, result, dim)
            out.copy_(result)

    @staticmethod
    def _precondition_matrices(
        grad: torch.Tensor,
        left: torch.Tensor | None,
        right: torch.Tensor | None,
        scratch: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        """``out = X_L G X_R`` for stacked matrices, either root possibly absent (identity);
        ``X_L G`` goes to ``scratch`` (None: a new tensor)."""
        if left is not None and right is not None:
            torch.bmm(torch.bmm(left, grad, out=scratch), right, out=out)
        elif left is not None:
            torch.bmm(left, grad, out=out)
        elif right is not None:
            torch.bmm(grad, right, out=out)
        else:
            out.copy_(grad)


@dataclass
class _GemmBuffers:
    """One bucket's ``precondition_dtype`` buffers, allocated once: ``grad`` and ``out``
    ``(B, *shape)`` (the rounded gradient, the product), ``scratch`` ``(B, m, n)`` for matrix
    blocks (``X_L G``, else None), ``roots`` per dim ``(B, n, n)`` (None: no root)."""

    grad: torch.Tensor
    out: torch.Tensor
    scratch: torch.Tensor | None
    roots: list[torch.Tensor | None]
