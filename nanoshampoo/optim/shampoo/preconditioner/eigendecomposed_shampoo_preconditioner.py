"""Eigendecomposed Shampoo: classic Shampoo that caches ``(Q, lambda)`` of each factor, not its
root.

On the amortized schedule each factor ``A = F_i / bc2`` (``+ eps I`` when the perturbation
config says so, exactly as :func:`matrix_roots.eigh_inverse_root` does) is decomposed,
``A = Q diag(lambda) Q^T`` with ``lambda`` ascending, and both are kept (block state
``factor_matrices_eigenvectors``, ``factor_matrices_eigenvalues``; before the first
decomposition ``Q = I``, ``lambda = 1``, so the root is ``I``). Whenever a root is needed (every
step's search direction, and KL-Shampoo's factor update) it is rebuilt,
``X_i = Q diag(w(lambda)) Q^T`` with ``w`` the spectral function of root-inverse Shampoo
(:func:`matrix_roots.inverse_root_spectrum`: shift, floor, ridge and power ``-e_i``, or the
pseudo-inverse), so the steps are root-inverse Shampoo's (``EigenConfig``) up to rounding.

Rebuilding costs one ``(B, n, n)`` matmul per factor and step; what it buys is that
``epsilon`` and the exponents are applied to the cached spectrum, so they may change without a
new decomposition, and the state holds the spectrum for inspection. Layout, failures and
schedule are root-inverse Shampoo's (:mod:`shampoo_preconditioner`).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from nanoshampoo.optim.shampoo.preconditioner.eigenbasis import (
    eigh_eigenbasis,
    off_diagonal_ratio,
    qr_eigenbasis,
)
from nanoshampoo.optim.shampoo.preconditioner.factor_matrix_ops import keep_previous_where_failed
from nanoshampoo.optim.shampoo.preconditioner.kronecker_factors import KroneckerFactors
from nanoshampoo.optim.shampoo.preconditioner.matrix_roots import (
    inverse_root_spectrum,
    least_precise_dtype,
)
from nanoshampoo.optim.shampoo.preconditioner.shampoo_preconditioner import (
    ShampooPreconditioner,
)
from nanoshampoo.optim.shampoo.shampoo_types import (
    EigendecomposedShampooPreconditionerConfig,
    EighEigendecompositionConfig,
    PerturbationConfig,
    QREigendecompositionConfig,
)


class EigendecomposedShampooPreconditioner(ShampooPreconditioner):
    """Eigendecomposed (and eigendecomposed KL-) Shampoo over the buckets of one group.

    Args: as :class:`ShampooPreconditioner`, with an
    :class:`EigendecomposedShampooPreconditionerConfig`.

    Example: the spectra are block state; for ``G = [[2, 0], [0, 1], [0, 0]]``, ``R = G^T G =
    diag(4, 1)`` and ``L = diag(4, 1, 0)``, so ``L^(-1/4) G R^(-1/4)`` is ``G`` with its nonzero
    entries scaled to 1.

        >>> from nanoshampoo.optim.shampoo.preconditioner.preconditioner import BlockBucket
        >>> from nanoshampoo.optim.shampoo.shampoo_types import (
        ...     EigendecomposedShampooPreconditionerConfig)
        >>> bucket = BlockBucket((3, 2), torch.float32, torch.device("cpu"), ("w block_0",))
        >>> shampoo = EigendecomposedShampooPreconditioner(
        ...     [bucket], EigendecomposedShampooPreconditionerConfig(), 1.0, 1e-12, True)
        >>> g = torch.tensor([[[2.0, 0.0], [0.0, 1.0], [0.0, 0.0]]])
        >>> shampoo.update_statistics([g], step=1)
        >>> shampoo.amortized_computation(step=1)
        >>> shampoo.block_state(0, 0).factor_matrices_eigenvalues[1]
        tensor([1., 4.])
        >>> shampoo.precondition([g], step=1)[0].round(decimals=5).abs()
        tensor([[[1., 0.],
                 [0., 1.],
                 [0., 0.]]])
    """

    computation = "eigendecomposed Shampoo: the factor eigendecomposition"
    kept = "eigendecomposition"
    result_state_name = "factor_matrices_eigenvectors"
    extra_dim_state_names = ("factor_matrices_eigenvalues",)
    _config: EigendecomposedShampooPreconditionerConfig

    def _allocate_state(self) -> None:
        super()._allocate_state()
        config = self._config
        stability = config.amortized_computation_config.rank_deficient_stability_config
        self._stability = stability
        self._perturbed = (
            isinstance(stability, PerturbationConfig) and stability.perturb_before_computation
        )
        # Per pool: (N, n) eigenvalues, ascending (1 until computed), and (N,) "computed once".
        self._eigenvalues = {
            key: torch.ones(
                len(pool.labels),
                pool.size,
                dtype=config.factor_matrix_eigenvalues_dtype,
                device=pool.factors.device,
            )
            for key, pool in self._factors.pools.items()
        }
        self._computed = self._pool_flags()

    def _result_dtype(self, key: Hashable) -> torch.dtype:
        return self._config.factor_matrix_eigenvectors_dtype

    def _keep(self, previous: torch.Tensor, results: torch.Tensor, ok: torch.Tensor) -> None:
        """The bases are stored as solved: the symmetric part that root-inverse Shampoo's
        :meth:`ShampooPreconditioner._keep` takes is for roots, and a basis is not symmetric."""
        keep_previous_where_failed(previous, results, ok)

    def _solve(
        self, key: Hashable, matrices: torch.Tensor, rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eigenvectors ``(M, n, n)`` (ascending eigenvalues) of the factors; their eigenvalues
        are stored here (previous ones kept where the decomposition failed)."""
        if self._perturbed and self._epsilon > 0.0:
            identity = torch.eye(matrices.shape[-1], dtype=matrices.dtype, device=matrices.device)
            matrices = matrices + self._epsilon * identity
        bases, ok = self._descending_bases(key, matrices, rows)
        # Eigenvalues of the basis (exact for eigh up to rounding; the estimate of a QR-iterated
        # or kept basis), then ascending order as inverse_root_spectrum reads them.
        values = (bases.mT @ matrices @ bases).diagonal(dim1=-2, dim2=-1)
        order = values.argsort(dim=-1)
        values = values.gather(-1, order)
        bases = bases.gather(-1, order.unsqueeze(-2).expand_as(bases))
        ok = ok & torch.isfinite(values).all(dim=-1) & torch.isfinite(bases).flatten(1).all(dim=-1)
        stored, computed = self._eigenvalues[key], self._computed[key]
        previous = stored if rows is None else stored.index_select(0, rows)
        kept = torch.where(ok.unsqueeze(-1), values.to(stored.dtype), previous)
        if rows is None:
            stored.copy_(kept)
        else:
            stored.index_copy_(0, rows, kept)
        self._mark_computed(computed, rows, ok)
        return bases, ok

    def _descending_bases(
        self, key: Hashable, matrices: torch.Tensor, rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eigenbases in descending order by the configured solver: ``eigh`` (a factor already
        decomposed keeps its basis while within a nonzero ``tolerance``), or QR iterations from
        the previous basis (a full ``eigh`` for a factor never decomposed)."""
        solver = self._config.amortized_computation_config
        previous, computed = self._results[key].flip(-1), self._computed[key]
        if rows is not None:
            previous, computed = previous[rows], computed[rows]
        previous = previous.to(matrices.dtype)
        if isinstance(solver, QREigendecompositionConfig):
            bases, ok = qr_eigenbasis(matrices, previous, solver.max_iterations, solver.tolerance)
            fresh = ~computed
        elif isinstance(solver, EighEigendecompositionConfig):
            bases, ok = previous, torch.ones_like(computed)
            fresh = torch.ones_like(computed)
            if solver.tolerance > 0.0:
                fresh = ~computed | (off_diagonal_ratio(matrices, previous) > solver.tolerance)
        else:
            raise TypeError(f"unsupported amortized_computation_config {solver!r}")
        index = fresh.nonzero().squeeze(1)
        if index.numel() > 0:
            device = getattr(solver, "eigendecomposition_offload_device", "") or matrices.device
            new, new_ok = eigh_eigenbasis(matrices[index].to(device), solver.retry_double_precision)
            bases = bases.index_copy(0, index, new.to(matrices.device))
            ok = ok.index_copy(0, index, new_ok.to(matrices.device))
        return bases, ok

    def _bucket_roots(self, bucket_index: int) -> list[torch.Tensor | None]:
        """Per dim, ``Q diag(w(lambda)) Q^T`` of the bucket's factors, in the block dtype."""
        bucket = self._buckets[bucket_index]
        count = bucket.num_blocks
        roots: list[torch.Tensor | None] = []
        for slot in self._factors.slots[bucket_index]:
            if slot is None:
                roots.append(None)
                continue
            bases = KroneckerFactors.rows(slot, count, self._results).to(self._solve_dtype)
            values = KroneckerFactors.rows(slot, count, self._eigenvalues).to(self._solve_dtype)
            exponents = KroneckerFactors.rows(slot, count, self._exponents)
            # The floor follows every dtype the spectrum and basis pass through (as the root's).
            noise = least_precise_dtype(
                least_precise_dtype(bucket.dtype, self._config.factor_matrix_dtype),
                least_precise_dtype(
                    self._config.factor_matrix_eigenvectors_dtype,
                    self._config.factor_matrix_eigenvalues_dtype,
                ),
            )
            weights = inverse_root_spectrum(
                values,
                exponents,
                self._epsilon,
                self._stability,
                bases.shape[-1],
                self._perturbed,
                noise,
            )
            roots.append(((bases * weights.unsqueeze(-2)) @ bases.mT).to(bucket.dtype))
        return roots

    def _extra_dim_state(self, key: Hashable, row: int) -> dict[str, torch.Tensor]:
        return {"factor_matrices_eigenvalues": self._eigenvalues[key][row]}
