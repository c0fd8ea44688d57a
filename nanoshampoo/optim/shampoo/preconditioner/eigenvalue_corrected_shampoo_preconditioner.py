"""Eigenvalue-corrected Shampoo (SOAP): Adam's second moment in the eigenbasis of the factors.

For a block ``G`` of order ``k``, factor ``i`` is updated like Shampoo's,
``F_i <- b2 F_i + w G_(i) G_(i)^T`` (``w = 1`` if ``b2 == 1`` else ``1 - b2``; see
:mod:`kronecker_factors`), and on the
amortized schedule its eigenbasis ``Q_i`` (columns = eigenvectors, descending eigenvalues) is
recomputed; before the first computation ``Q_i = I``. With the rotation
``R(X) = X x_1 Q_1^T ... x_k Q_k^T`` (``x_i`` contracts dim ``i``; for a matrix
``Q_L^T X Q_R``), one step is:

1. ``update_statistics``: factors; corrected eigenvalues ``D <- b2 D + w R(G)^2`` (folded
   once the step's basis is known: after step 2, or in step 3).
2. ``amortized_computation`` (scheduled steps): new ``Q_i``; ``D`` of this step is then
   recomputed from its pre-step value with the new basis, so ``D`` always accumulates in the
   basis that this step's search direction uses.
3. ``precondition``: ``P = R^-1(R(Gbar) / ((D / bc2)^e + eps))``, ``bc2 = 1 - b2^t`` with bias
   correction (``b2 < 1``), ``e = 1/2`` by default (Adam in the rotated coordinates).

``R`` is linear, so when the optimizer says (``expect_filtered``) that ``Gbar`` is the running
average ``M_t = M_(t-1) + (1 - b1) (G_t - M_(t-1))`` (over a divisor), ``R(M_t)`` is
``R(M_(t-1))`` moved towards ``R(G_t)``, which step 1 has already computed: a matrix block
takes four products per step (``R(G)``, ``R^-1``) instead of six. ``R(M)`` is kept per bucket
while its bases stay the same and the steps follow one another; a new basis, a skipped or
unexplained step, or ``forget_filtered`` (a loaded state dict) rotate ``Gbar`` afresh. The
two agree to rounding (``soap_rotated_average_test.py``: 1e-12 in float64, 1e-5 in float32).

When a basis is recomputed the corrected eigenvalues are kept as they are, by position, as in
the reference library, which pairs coordinate ``j`` with the column of the ``j``-th smallest
eigenvalue (its ``eigh`` bases ascend, and its QR refresh re-sorts its columns so). Ours
descend, so the first basis of a factor receives ``D`` from the identity basis reversed along
that dim, and later ones pair column ``n - 1 - j`` with the same coordinate: ``eigh`` sorts, and
the default QR refresh (:func:`eigenbasis.sorted_qr_eigenbasis`) iterates and re-sorts as that
library does. With ``keep_descending_order`` the QR iteration runs on the descending order,
whose stable fixed point keeps every column on its eigen-direction without a sort
(``docs/results/soap-parity.md``, ``docs/compat.md``). A failed eigenbasis computation keeps
the previous basis and is counted; more than ``num_tolerated_failed_amortized_computations``
consecutive failures raise.

Layout, as in root-inverse Shampoo: all factors of one size share one ``(N, n, n)`` pool, with
a matching stack of eigenbases, so one batched ``eigh`` (or QR iteration) per size serves every
block; per-bucket tensors are stacked ``(B, *shape)``.

Rank-deficient factors in float32 (``epsilon=1e-12``). Two effects, each with its fix (the
``rank_deficient_stability_config`` of the solver):

- Rotated coordinates in a factor's null space hold rounding noise ``~u |G|``, and so does
  their ``D``: the plain rule gives them weight ``noise / (noise + eps) ~ 1`` where float64
  gives ``~1e-4``. Fix: floor ``D / bc2`` at ``eps_fp32 * max(D / bc2)`` per block.
- The eigenvectors of a null space are any basis of it, picked by rounding, and SOAP is not
  rotation invariant, so two runs whose factors differ by rounding drift apart. Fix: a
  canonical basis of the null space (:func:`eigenbasis.canonical_null_space_basis`).

Measured against float64: docs/results/float32-accuracy.md "SOAP: which float32 option".
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from nanoshampoo.optim.shampoo.preconditioner.eigenbasis import (
    eigh_eigenbasis,
    off_diagonal_ratio,
    sorted_qr_eigenbasis,
    warm_started_eigenbasis,
)
from nanoshampoo.optim.shampoo.preconditioner.factor_matrix_ops import (
    multiply_along_dim,
)
from nanoshampoo.optim.shampoo.preconditioner.kronecker_factored_preconditioner import (
    KroneckerFactoredPreconditioner,
)
from nanoshampoo.optim.shampoo.preconditioner.kronecker_factors import KroneckerFactors
from nanoshampoo.optim.shampoo.preconditioner.matrix_roots import least_precise_dtype
from nanoshampoo.optim.shampoo.preconditioner.preconditioner import BlockBucket, FilteredInput
from nanoshampoo.optim.shampoo.shampoo_types import (
    EigenvalueCorrectedShampooPreconditionerConfig,
    EighEigendecompositionConfig,
    PerturbationConfig,
    QREigendecompositionConfig,
)


class EigenvalueCorrectedShampooPreconditioner(KroneckerFactoredPreconditioner):
    """Eigenvalue-corrected Shampoo over the buckets of one parameter group.

    Args:
        buckets: the group's block buckets.
        config: solver, dtypes, ignored dims, exponent overrides, failure tolerance.
        beta2: EMA factor of the factors and the corrected eigenvalues, in (0, 1].
        epsilon: added to ``(D / bc2)^e``.
        use_bias_correction: divide ``D`` by ``1 - b2^t`` (when ``b2 < 1``).

    ``amortized_computation(step)`` uses the gradients given to ``update_statistics(step)`` of
    the same step (it re-folds them into ``D`` in the new basis).

    Example:
        >>> from nanoshampoo.optim.shampoo.shampoo_types import (
        ...     DefaultEigenvalueCorrectedShampooConfig)
        >>> bucket = BlockBucket((3, 2), torch.float32, torch.device("cpu"), ("w block_0",))
        >>> soap = EigenvalueCorrectedShampooPreconditioner(
        ...     [bucket], DefaultEigenvalueCorrectedShampooConfig, 0.999, 1e-8, True)
        >>> g = torch.randn(1, 3, 2)
        >>> soap.update_statistics([g], step=1)
        >>> soap.amortized_computation(step=1)
        >>> soap.precondition([g], step=1)[0].shape
        torch.Size([1, 3, 2])
    """

    computation = "eigenvalue-corrected Shampoo: the eigenbasis computation"
    kept = "basis"
    result_state_name = "factor_matrices_eigenvectors"
    extra_dim_state_names = ("eigenvectors_computed",)
    _config: EigenvalueCorrectedShampooPreconditionerConfig

    def _allocate_state(self) -> None:
        # num_shares -> per share, the buckets whose D is re-folded (see _share_buckets).
        self._buckets_by_share: dict[int, list[set[int]]] = {}
        # Per pool: (N,) bool "computed at least once" (QR warm-starts only from those).
        self._computed = self._pool_flags()
        eigenvalue_dtype = self._config.corrected_eigenvalues_dtype
        self._corrected = [
            torch.zeros(b.stacked_shape, dtype=eigenvalue_dtype, device=b.device)
            for b in self._buckets
        ]
        # This step's raw gradients and the pre-step corrected eigenvalues, kept so that a
        # basis recomputed later in the step can re-fold the step into D in the new basis.
        self._previous_corrected = [torch.zeros_like(d) for d in self._corrected]
        self._step_grads = [bucket.zeros() for bucket in self._buckets]
        self._rotated = [bucket.zeros() for bucket in self._buckets]
        self._outputs = [bucket.zeros() for bucket in self._buckets]
        # R(M) of the optimizer's running average per bucket (allocated on first use) and the
        # step it is for (-1: none); see the module doc.
        self._rotated_average: list[torch.Tensor | None] = [None] * len(self._buckets)
        self._average_step = [-1] * len(self._buckets)
        self._filtered: FilteredInput | None = None
        self._filtered_step = 0
        # Per bucket: this step's gradient is stashed but not yet folded into D.
        self._fold_pending = [False] * len(self._buckets)
        # Intermediate of the matrix fast path of _rotate, allocated once.
        self._scratch = [
            bucket.zeros() if len(bucket.shape) == 2 else None for bucket in self._buckets
        ]

    def _pool_key(self, bucket: BlockBucket, dim: int) -> int | None:
        """Factors pool by size (bases have one dtype); dims that are not rotated have none."""
        return bucket.shape[dim] if self._config.rotates(len(bucket.shape), dim) else None

    def _result_dtype(self, key: Hashable) -> torch.dtype:
        return self._config.factor_matrix_eigenvectors_dtype

    def _bucket_bases(self, bucket_index: int) -> list[torch.Tensor | None]:
        """Per dim, the bucket's ``(B, n, n)`` eigenbases in its dtype (None: not rotated)."""
        dtype = self._buckets[bucket_index].dtype
        return [None if b is None else b.to(dtype) for b in self._bucket_results(bucket_index)]

    def _rotate(
        self,
        index: int,
        x: torch.Tensor,
        bases: Sequence[torch.Tensor | None],
        into_eigenbasis: bool,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """``out = R(x)`` (``into_eigenbasis``) or ``R^-1(x)``, batched over bucket ``index``."""
        if len(bases) == 2 and bases[0] is not None and bases[1] is not None:
            left, right = bases
            scratch = self._scratch[index]
            if into_eigenbasis:
                return torch.matmul(torch.matmul(left.mT, x, out=scratch), right, out=out)
            return torch.matmul(torch.matmul(left, x, out=scratch), right.mT, out=out)
        result = x
        for dim, basis in enumerate(bases):
            if basis is not None:
                result = multiply_along_dim(basis.mT if into_eigenbasis else basis, result, dim)
        return out.copy_(result)

    def update_statistics(self, grads: Sequence[torch.Tensor], step: int) -> None:
        """Factors now; ``D`` of every bucket is folded later in the step, in the basis the
        step's direction uses: by ``amortized_computation`` where it gives the bucket a new
        basis, else by ``precondition`` or ``complete_statistics`` (so a refresh step rotates
        ``G`` once, in the new basis, not also in the old one)."""
        super().update_statistics(grads, step)
        for index, grad in enumerate(grads):
            self._step_grads[index].copy_(grad)
            self._previous_corrected[index].copy_(self._corrected[index])
            self._fold_pending[index] = True

    def complete_statistics(self) -> None:
        for index, pending in enumerate(self._fold_pending):
            if pending:
                self._fold_step_into_corrected_eigenvalues(index)

    def _fold_step_into_corrected_eigenvalues(self, index: int) -> None:
        """``D = b2 D_prev + w R(G)^2`` from the stashed pre-step ``D_prev`` and gradient
        (``w``: 1 for ``b2 == 1`` or a dropped weighting factor, else ``1 - b2``); leaves
        ``R(G)`` in ``self._rotated[index]``."""
        self._fold_pending[index] = False
        rotated = self._rotate(
            index, self._step_grads[index], self._bucket_bases(index), True, self._rotated[index]
        )
        corrected = self._corrected[index]
        if self._beta2 == 1.0:
            torch.addcmul(self._previous_corrected[index], rotated, rotated, out=corrected)
        else:
            torch.mul(self._previous_corrected[index], self._beta2, out=corrected)
            corrected.addcmul_(rotated, rotated, value=self._weight)

    def amortized_computation(
        self, step: int, share: int = 0, num_shares: int = 1, period: int | None = None
    ) -> None:
        """Recompute the eigenbases of the share (failed ones keep the previous basis), then
        re-fold ``D`` (reversed along the dims whose first basis this is)."""
        before = {key: computed.clone() for key, computed in self._computed.items()}
        super().amortized_computation(step, share, num_shares, period)
        first = {key: computed & ~before[key] for key, computed in self._computed.items()}
        for index in range(len(self._buckets)):
            # A bucket none of whose bases was in the share folds to the same D: skip it.
            if num_shares == 1 or index in self._share_buckets(num_shares)[share]:
                self._reverse_identity_basis_coordinates(index, first)
                self._fold_step_into_corrected_eigenvalues(index)
                self._average_step[index] = -1  # R(M) was in the old basis

    def expect_filtered(self, filtered: FilteredInput | None, step: int) -> None:
        self._filtered, self._filtered_step = filtered, step

    def forget_filtered(self) -> None:
        self._average_step = [-1] * len(self._buckets)

    def _rotate_input(
        self, index: int, grad: torch.Tensor, bases: Sequence[torch.Tensor | None], step: int
    ) -> torch.Tensor:
        """``R(grad)`` into ``self._rotated[index]``: from the kept ``R(M)`` and this step's
        ``R(G)`` (already there, from step 1) when the optimizer's promise allows it, else by
        rotating ``grad``; keeps ``R(M)`` for the next step whenever there is a promise."""
        filtered = self._filtered if self._filtered_step == step else None
        rotated = self._rotated[index]
        if filtered is None:
            self._average_step[index] = -1
            return self._rotate(index, grad, bases, True, rotated)
        if filtered.beta == 0.0:  # M_t = G_t: R(G_t) is what step 1 left in `rotated`
            return rotated if filtered.divisor == 1.0 else rotated.div_(filtered.divisor)
        average = self._rotated_average[index]
        if average is None:
            average = self._rotated_average[index] = torch.zeros_like(rotated)
        kept = self._average_step[index] == step - 1
        self._average_step[index] = step
        if kept:
            average.lerp_(rotated, 1.0 - filtered.beta)
            return torch.div(average, filtered.divisor, out=rotated)
        self._rotate(index, grad, bases, True, rotated)
        torch.mul(rotated, filtered.divisor, out=average)
        return rotated

    def _reverse_identity_basis_coordinates(
        self, index: int, first: dict[Hashable, torch.Tensor]
    ) -> None:
        """Reverse the pre-step ``D`` of bucket ``index`` along each dim whose basis was just
        computed for the first time (``first``: per pool, the rows).

        ``D`` accumulated in the identity basis is carried into the first eigenbasis by
        position. The reference library pairs coordinate ``j`` with the eigenvector of the
        ``j``-th smallest eigenvalue (``eigh``'s ascending order); our bases are descending, so
        coordinate ``j`` goes to column ``n - 1 - j``: the same pairing, the same steps.
        """
        bucket = self._buckets[index]
        previous = self._previous_corrected[index]
        for dim, slot in enumerate(self._factors.slots[index]):
            if slot is None:
                continue
            rows = KroneckerFactors.rows(slot, bucket.num_blocks, first)
            mask = rows.view(-1, *([1] * len(bucket.shape)))
            previous.copy_(torch.where(mask, previous.flip(dim + 1), previous))

    def _share_buckets(self, num_shares: int) -> list[set[int]]:
        """Per share, the buckets with a basis in it; computed on the host once per
        ``num_shares`` (so the step itself reads nothing back from the device)."""
        if num_shares not in self._buckets_by_share:
            shares = self.shares(num_shares)
            self._buckets_by_share = {num_shares: []}
            for rows in shares:
                solved = {(key, row) for key, tensor in rows.items() for row in tensor.tolist()}
                self._buckets_by_share[num_shares].append(
                    {
                        index
                        for index, bucket in enumerate(self._buckets)
                        for slot in self._factors.slots[index]
                        if slot is not None
                        and any(
                            (slot.pool_key, slot.offset + p) in solved
                            for p in range(bucket.num_blocks)
                        )
                    }
                )
        return self._buckets_by_share[num_shares]

    def _solve(
        self, key: Hashable, matrices: torch.Tensor, rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        solver = self._config.amortized_computation_config
        if isinstance(solver, EighEigendecompositionConfig):
            bases, ok = self._eigh_bases(key, matrices, rows, solver)
        elif isinstance(solver, QREigendecompositionConfig):
            bases, ok = self._warm_started_bases(key, matrices, rows, solver)
        else:
            raise TypeError(f"unsupported amortized_computation_config {solver!r}")
        self._mark_computed(self._computed[key], rows, ok)
        return bases, ok

    def _eigh_bases(
        self,
        key: Hashable,
        matrices: torch.Tensor,
        rows: torch.Tensor | None,
        solver: EighEigendecompositionConfig,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``eigh`` bases (on ``eigendecomposition_offload_device`` when set); with a nonzero
        ``tolerance`` an already-computed factor whose previous basis is within it keeps it."""
        stability = solver.rank_deficient_stability_config
        device = solver.eigendecomposition_offload_device or matrices.device
        if solver.tolerance == 0.0:
            bases, ok = eigh_eigenbasis(
                matrices.to(device), solver.retry_double_precision, stability
            )
            return bases.to(matrices.device), ok.to(matrices.device)
        previous, computed = self._results[key], self._computed[key]
        if rows is not None:
            previous, computed = previous[rows], computed[rows]
        bases = previous.to(matrices.dtype)
        ok = torch.ones_like(computed)
        kept = computed & (off_diagonal_ratio(matrices, bases) <= solver.tolerance)
        redo = (~kept).nonzero().squeeze(1)
        if redo.numel() > 0:
            fresh, fresh_ok = eigh_eigenbasis(
                matrices[redo].to(device), solver.retry_double_precision, stability
            )
            bases = bases.index_copy(0, redo, fresh.to(matrices.device))
            ok = ok.index_copy(0, redo, fresh_ok.to(matrices.device))
        return bases, ok

    def _warm_started_bases(
        self,
        size: Hashable,
        matrices: torch.Tensor,
        rows: torch.Tensor | None,
        solver: QREigendecompositionConfig,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """QR iterations from the previous basis. By default the well-known library's: from
        the identity for never-computed factors, on the ascending order, re-sorted, on the
        ridged ``F + eps I``; with ``keep_descending_order`` a full ``eigh`` for never-computed
        factors and the stable descending iteration for the others."""
        previous, computed = self._results[size], self._computed[size]
        if rows is not None:
            previous, computed = previous[rows], computed[rows]
        previous = previous.to(matrices.dtype)
        if solver.keep_descending_order:
            return warm_started_eigenbasis(matrices, previous, computed, solver)
        # The library's estimate is ascending: our stored (descending) bases reversed, and the
        # identity itself (not reversed) where no basis was computed yet.
        identity = torch.eye(matrices.shape[-1], dtype=matrices.dtype, device=matrices.device)
        start = torch.where(computed.view(-1, 1, 1), previous.flip(-1), identity)
        stability = solver.rank_deficient_stability_config
        # The ridge also lifts a null column's estimate to eps, so the canonical null basis then
        # applies only where eps is below rounding (float32 at 1e-12), where such columns are
        # noise; in float64 at 1e-8 the ridged iteration is deterministic and kept as computed.
        if isinstance(stability, PerturbationConfig) and stability.perturb_before_computation:
            matrices = matrices + self._epsilon * identity
        return sorted_qr_eigenbasis(
            matrices, start, solver.max_iterations, solver.tolerance, stability
        )

    def precondition(self, grads: Sequence[torch.Tensor], step: int) -> list[torch.Tensor]:
        bias_correction = self._bias_correction(step)
        stability = self._config.amortized_computation_config.rank_deficient_stability_config
        for index, (bucket, grad) in enumerate(zip(self._buckets, grads)):
            if self._fold_pending[index]:
                self._fold_step_into_corrected_eigenvalues(index)
            bases = self._bucket_bases(index)
            rotated = self._rotate_input(index, grad, bases, step)
            out = self._outputs[index]
            torch.div(self._corrected[index], bias_correction, out=out)
            noise = torch.finfo(least_precise_dtype(out.dtype, self._corrected[index].dtype)).eps
            top = out.amax(dim=tuple(range(1, out.dim())), keepdim=True)
            rotated_blocks = (
                self._rotated_blocks(index).to(out.dtype).view(-1, *([1] * (out.dim() - 1)))
            )
            # The config admits only a PerturbationConfig (as the reference library does).
            rtol = stability.eigenvalue_floor_rtol
            if rtol is None or rtol > 0.0:
                floor = top * (noise if rtol is None else rtol)
                torch.maximum(out, floor * rotated_blocks, out=out)
            exponent = self._config.corrected_eigenvalue_exponent(len(bucket.shape))
            if exponent == 0.5:
                out.sqrt_()  # correctly rounded, and faster than pow(0.5)
            else:
                out.pow_(exponent)
            out.add_(self._epsilon)
            torch.div(rotated, out, out=rotated)
            self._rotate(index, rotated, bases, False, out)
        return self._outputs

    def _rotated_blocks(self, bucket_index: int) -> torch.Tensor:
        """``(B,)`` bool, True for the blocks of the bucket with at least one computed eigenbasis.

        The others are still in the identity basis, where ``D`` is exactly the EMA of the
        squared gradient (no rotation puts rounding noise in it), so no floor is applied and
        the step is diagonal Adam/AdaGrad to rounding, as in the reference library.
        """
        bucket = self._buckets[bucket_index]
        rotated = torch.zeros(bucket.num_blocks, dtype=torch.bool, device=bucket.device)
        for slot in self._factors.slots[bucket_index]:
            if slot is not None:
                rotated |= KroneckerFactors.rows(slot, bucket.num_blocks, self._computed)
        return rotated

    def _extra_dim_state(self, key: Hashable, row: int) -> dict[str, torch.Tensor]:
        return {"eigenvectors_computed": self._computed[key][row]}

    def _extra_block_state(self, bucket_index: int, position: int) -> dict[str, torch.Tensor]:
        return {"corrected_eigenvalues": self._corrected[bucket_index][position]}
