"""Batched eigenbases of stacks of symmetric PSD matrices: full ``eigh``, or warm-started QR.

Pure math on tensors. Both functions take a stack ``A`` of shape ``(N, n, n)`` and return
``(bases, ok)``: ``bases`` ``(N, n, n)`` with orthonormal columns (eigenvectors, ordered by
*descending* eigenvalue) and a bool mask ``ok`` ``(N,)``, False where the computation failed
(solver error or non-finite result); callers keep their previous basis for those.

Why descending: the warm-started QR (orthogonal) iteration ``Q <- qr(A Q)`` has the eigenbasis
in descending order as its only stable fixed point. Starting it from a descending basis keeps
every column on "its" eigenvector, so state kept per eigen-direction (the corrected eigenvalues
of eigenvalue-corrected Shampoo) stays attached to the same direction across recomputations
(:func:`qr_eigenbasis`). :func:`sorted_qr_eigenbasis` is the well-known library's refresh
instead: the iteration on the ascending order, then a sort; it returns descending bases too.

Example:
    >>> A = torch.diag(torch.tensor([1.0, 3.0, 2.0])).expand(2, 3, 3)
    >>> bases, ok = eigh_eigenbasis(A)
    >>> bases[0].abs().argmax(dim=0).tolist(), ok.tolist()
    ([1, 2, 0], [True, True])
    >>> bases, converged = qr_eigenbasis(A, bases, max_iterations=1, tolerance=0.01)
    >>> bases[0].abs().argmax(dim=0).tolist()
    [1, 2, 0]
"""

from __future__ import annotations

import torch

from nanoshampoo.optim.shampoo.preconditioner.matrix_roots import (
    numerical_zero_tolerance,
    robust_eigh,
)
from nanoshampoo.optim.shampoo.preconditioner.parallel_eigh import stacked_qr
from nanoshampoo.optim.shampoo.shampoo_types import (
    PerturbationConfig,
    QREigendecompositionConfig,
    RankDeficientStabilityConfig,
)


def _finite(bases: torch.Tensor) -> torch.Tensor:
    """``(N,)`` bool: every entry of ``bases[i]`` is finite.

    By the sum of each matrix: NaN and +-Inf make it non-finite (Inf - Inf is NaN), and the
    sum of an orthonormal basis (entries in [-1, 1]) cannot overflow; one read of the stack
    instead of ``isfinite``'s four full-size passes (100 ms per refresh of two 3072-factors).
    A non-orthonormal result whose sum overflows counts as failed, as it should."""
    return torch.isfinite(bases.sum(dim=(-2, -1)))


def canonical_null_space_basis(
    bases: torch.Tensor, null: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace the columns of ``bases`` flagged ``null`` by a basis fixed by their span alone.

    Any orthonormal basis of a (numerically) null eigenspace is an eigenbasis, and ``eigh``
    picks one from rounding noise, so a float32 and a float64 run (or two float64 runs 1e-12
    apart) rotate the gradient differently there. Eigenvalue-corrected Shampoo is not rotation
    invariant, so that choice changed parameters by 3.5 % after 5 steps. Here the null columns
    become the eigenvectors of ``diag(0, 1, ..., n-1)`` compressed onto their span, which depend
    on the span only (distinct eigenvalues, generically). Other columns keep their position; a
    column's sign may flip (harmless: the rotation is applied and undone).

    Args:
        bases: ``(N, n, n)`` orthonormal columns.
        null: ``(N, n)`` bool, the columns spanning the null space.

    Returns:
        ``(bases (N, n, n), ok (N,) bool)``; ``ok`` is False where the small ``eigh`` failed.
    """
    n = bases.shape[-1]
    # Null columns first, the others after them, both in their original order.
    order = torch.argsort((~null).to(torch.int8), dim=-1, stable=True)
    permuted = bases.gather(-1, order.unsqueeze(-2).expand_as(bases))
    # Only the first k columns (k: the widest null space of the stack) can rotate, so the eigh
    # is k x k, not n x n (GPT-small's 3072-factors of rank 768: 0.42x the cost).
    width = int(null.sum(dim=-1).max())
    head = permuted[..., :width]
    null_head = null.gather(-1, order)[..., :width]
    rows = torch.arange(n, dtype=bases.dtype, device=bases.device)
    compressed = head.mT @ (rows.unsqueeze(-1) * head)
    both = null_head.unsqueeze(-1) & null_head.unsqueeze(-2)
    # Other columns get distinct values above every null-block eigenvalue (< n): they stay put.
    positions = torch.arange(width, dtype=bases.dtype, device=bases.device)
    compressed = torch.where(both, compressed, 0.0) + torch.diag_embed(
        torch.where(null_head, 0.0, n + positions)
    )
    _, rotations, ok = robust_eigh(compressed, retry_double_precision=True)
    canonical = torch.cat([head @ rotations, permuted[..., width:]], dim=-1)
    return torch.empty_like(bases).scatter_(-1, order.unsqueeze(-2).expand_as(bases), canonical), ok


def _canonicalize_null_columns(
    bases: torch.Tensor,
    eigenvalues: torch.Tensor,
    stability: RankDeficientStabilityConfig | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`canonical_null_space_basis` for the columns whose eigenvalue is numerically zero
    under ``stability`` (None, or a zero floor: leave the basis as computed)."""
    ok = torch.ones(bases.shape[0], dtype=torch.bool, device=bases.device)
    if stability is None or (
        isinstance(stability, PerturbationConfig) and stability.eigenvalue_floor_rtol == 0.0
    ):
        return bases, ok
    top = eigenvalues.amax(dim=-1, keepdim=True).clamp(min=0.0)
    null = eigenvalues <= numerical_zero_tolerance(top, stability, bases.shape[-1], bases.dtype)
    if not bool(null.any()):  # full-rank factors (the common case) skip the extra eigh
        return bases, ok
    return canonical_null_space_basis(bases, null)


def eigh_eigenbasis(
    matrices: torch.Tensor,
    retry_double_precision: bool = True,
    stability: RankDeficientStabilityConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvectors of each matrix of a stack by one batched ``eigh``, descending order.

    Args:
        matrices: ``(N, n, n)`` symmetric, float32 or float64.
        retry_double_precision: retry a failed decomposition in float64.
        stability: when given, the numerically-null eigenvectors (tolerance of
            :func:`numerical_zero_tolerance`) get the canonical basis of
            :func:`canonical_null_space_basis`.

    Returns:
        ``(bases (N, n, n), ok (N,) bool)``; ``bases[i]`` is garbage where ``ok[i]`` is False.
    """
    evals, evecs, ok = robust_eigh(matrices, retry_double_precision)
    bases, canonical_ok = _canonicalize_null_columns(evecs, evals, stability)
    bases = bases.flip(-1)
    return bases, ok & canonical_ok & _finite(bases)


def off_diagonal_ratio(matrices: torch.Tensor, bases: torch.Tensor) -> torch.Tensor:
    """``||B - diag(B)||_F / ||B||_F`` with ``B = Q^T A Q``, per matrix: ``(N,)``.

    It is also ``||A - Q diag(B) Q^T||_F / ||A||_F``: the relative error of ``Q`` as an
    eigenbasis of ``A``. A zero matrix has ratio 0 (every basis is an eigenbasis). Computed
    from ``A Q`` alone (one product, see :func:`_residual_share`).
    """
    product = matrices @ bases
    return _residual_share(product, bases, _rayleigh_quotients(product, bases))


def _rayleigh_quotients(product: torch.Tensor, bases: torch.Tensor) -> torch.Tensor:
    """``diag(Q^T A Q)`` ``(N, n)`` from ``P = A Q``: the column dots ``q_j^T p_j``."""
    return (bases * product).sum(dim=-2)


def _residual_share(
    product: torch.Tensor, bases: torch.Tensor, quotients: torch.Tensor
) -> torch.Tensor:
    """:func:`off_diagonal_ratio` from ``P = A Q`` and ``d = diag(Q^T A Q)``, elementwise.

    ``Q^T`` is an isometry (``Q`` square orthonormal), so ``||Q^T A Q - diag(d)||_F =
    ||Q^T (P - Q diag(d))||_F = ||P - Q diag(d)||_F`` and ``||Q^T A Q||_F = ||P||_F``: no
    second product. Exactly-diagonal cases (a diagonal ``A`` in the identity basis) give an
    exactly zero residual, hence ratio 0. ``Q``'s rounding-level departure from orthonormality
    changes the ratio at that level only.
    """
    total = torch.linalg.matrix_norm(product)
    off = torch.linalg.matrix_norm(product - bases * quotients.unsqueeze(-2))
    # total == 0 (not total > 0): a NaN total gives a NaN ratio, never "converged", so a
    # non-finite factor reaches the QR and comes back not ok (it used to count as converged).
    return torch.where(total == 0.0, 0.0, off / total.clamp(min=torch.finfo(total.dtype).tiny))


def _orthogonal_iteration(
    matrices: torch.Tensor, bases: torch.Tensor, tolerance: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One step ``Q <- qr(A Q).Q`` of both QR refreshes, for the matrices of the stack whose
    ``off_diagonal_ratio(A, Q)`` is above ``tolerance`` (the others keep ``Q``).

    Returns ``(bases (N, n, n), d (N, n), converged (N,) bool, diag(R) (N, n) or None)``: ``d``
    the Rayleigh quotients of the *incoming* bases, ``diag(R)`` of the QR, None when every
    matrix had converged (no QR ran; ``bases`` is the input). Raises the QR's RuntimeError.
    """
    product = matrices @ bases
    quotients = _rayleigh_quotients(product, bases)
    converged = _residual_share(product, bases, quotients) <= tolerance
    if bool(converged.all()):
        return bases, quotients, converged, None
    refined, r_diagonal = stacked_qr(product)
    # The common case at a refresh: nothing converged, no (N, n, n) select needed.
    if bool(converged.any()):
        refined = torch.where(converged.view(-1, 1, 1), bases, refined)
    return refined, quotients, converged, r_diagonal


def _all_failed(matrices: torch.Tensor) -> torch.Tensor:
    """``ok`` ``(N,)`` all False, for a stack whose refresh raised."""
    return torch.zeros(matrices.shape[0], dtype=torch.bool, device=matrices.device)


def qr_eigenbasis(
    matrices: torch.Tensor,
    previous: torch.Tensor,
    max_iterations: int,
    tolerance: float,
    stability: RankDeficientStabilityConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Refine ``previous`` bases by at most ``max_iterations`` QR (orthogonal) iterations.

    Per matrix: while ``off_diagonal_ratio(A, Q) > tolerance``, ``Q <- qr(A Q).Q``. Matrices
    already within the tolerance keep their basis unchanged (no iteration is spent on them).
    Cost per iteration: one batched ``n^3`` product ``P = A Q`` (it serves both the ratio, by
    the elementwise identity of :func:`_residual_share`, and the QR) and one QR
    (:func:`stacked_qr`, split over the CPU threads), no ``eigh``; the eigenvalue estimates of
    the new basis for ``stability`` are ``|diag(R)|`` of that QR (``A Q = Q' R``), not another
    product. The reference SOAP's refresh does three products and the QR.

    Args:
        matrices: ``(N, n, n)`` symmetric PSD, float32 or float64.
        previous: ``(N, n, n)`` orthonormal starting bases (same dtype/device), ideally the
            last eigenbasis in descending eigenvalue order.
        max_iterations: iteration cap, >= 1.
        tolerance: convergence threshold on the off-diagonal ratio, in [0, 1].
        stability: as for :func:`eigh_eigenbasis`, with ``diag(Q^T A Q)`` (or ``|diag(R)|``
            after a QR step) as the eigenvalues (a QR step maps null columns to rounding noise,
            so they need it most).

    Returns:
        ``(bases (N, n, n), ok (N,) bool)``; ``ok`` is False where the result is not finite.
    """
    bases = previous
    for _ in range(max_iterations):
        try:
            bases, diagonal, converged, r_diagonal = _orthogonal_iteration(
                matrices, bases, tolerance
            )
        except RuntimeError:  # LinAlgError on non-finite input: every matrix of the batch fails
            return previous, _all_failed(matrices)
        if r_diagonal is None:
            estimates = diagonal
            break
        # A Q = Q' R: near an eigenbasis |r_jj| ~ lambda_j, the eigenvalue of column j of Q'.
        estimates = torch.where(converged.unsqueeze(-1), diagonal, r_diagonal.abs())
    bases, canonical_ok = _canonicalize_null_columns(bases, estimates, stability)
    return bases, canonical_ok & _finite(bases)


def sorted_qr_eigenbasis(
    matrices: torch.Tensor,
    previous: torch.Tensor,
    max_iterations: int,
    tolerance: float,
    stability: RankDeficientStabilityConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The well-known library's QR refresh: iterate on an *ascending* basis, then re-sort it.

    Per matrix: while ``off_diagonal_ratio(A, Q) > tolerance``, at most ``max_iterations``
    times, ``Q <- qr(A Q).Q`` (the same span as the library's ``Q <- Q qr(Q^T A Q).Q``); then
    the columns are stably sorted by ascending Rayleigh quotient ``q_j^T A q_j`` (also when no
    iteration ran), and the result is returned flipped, in this module's descending order. So
    column ``n - 1 - j`` of the result is the library's column ``j``, and state paired with
    columns by position (SOAP's corrected eigenvalues) is paired as the library pairs it. The
    iteration runs on the ascending order, where it is unstable (a column's error along a larger
    eigenvalue grows), as the library's does: :func:`qr_eigenbasis` iterates on the stable
    descending order instead.

    Args:
        matrices: ``(N, n, n)`` symmetric PSD, float32 or float64.
        previous: ``(N, n, n)`` orthonormal starting bases in *ascending* order (the identity
            for a factor without a basis yet, as in the library).
        max_iterations: iteration cap, >= 1.
        tolerance: convergence threshold on the off-diagonal ratio, in [0, 1].
        stability: as for :func:`eigh_eigenbasis`, with the sorted Rayleigh quotients as the
            eigenvalues.

    Returns:
        ``(bases (N, n, n) descending, ok (N,) bool)``; ``ok`` is False where the result is not
        finite.
    """
    bases, estimates = previous, None
    for _ in range(max_iterations):
        try:
            bases, quotients, _, r_diagonal = _orthogonal_iteration(matrices, bases, tolerance)
        except RuntimeError:  # LinAlgError on non-finite input: every matrix of the batch fails
            return previous.flip(-1), _all_failed(matrices)
        if r_diagonal is None:
            estimates = quotients
            break
    if estimates is None:  # the Rayleigh quotients of the new basis: one more product
        estimates = _rayleigh_quotients(matrices @ bases, bases)
    order = torch.argsort(estimates, dim=-1, stable=True)
    bases = bases.gather(-1, order.unsqueeze(-2).expand_as(bases)).flip(-1)
    bases, canonical_ok = _canonicalize_null_columns(
        bases, estimates.gather(-1, order).flip(-1), stability
    )
    return bases, canonical_ok & _finite(bases)


def warm_started_eigenbasis(
    matrices: torch.Tensor,
    previous: torch.Tensor,
    computed: torch.Tensor,
    solver: QREigendecompositionConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`qr_eigenbasis` from ``previous`` where ``computed`` ``(N,)`` is True, one batched
    :func:`eigh_eigenbasis` where it is False (no basis yet: the first refresh); each matrix
    gets exactly one of the two, so no QR result is computed to be thrown away.

    Returns ``(bases (N, n, n), ok (N,) bool)`` as the two functions do.
    """
    stability = solver.rank_deficient_stability_config
    fresh = (~computed).nonzero().squeeze(1)
    warm = computed.nonzero().squeeze(1)

    def from_eigh(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return eigh_eigenbasis(matrices[rows], solver.retry_double_precision, stability)

    def from_qr(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return qr_eigenbasis(
            matrices[rows], previous[rows], solver.max_iterations, solver.tolerance, stability
        )

    if warm.numel() == 0:
        return eigh_eigenbasis(matrices, solver.retry_double_precision, stability)
    if fresh.numel() == 0:
        return qr_eigenbasis(matrices, previous, solver.max_iterations, solver.tolerance, stability)
    bases = torch.empty_like(matrices)
    ok = torch.empty(matrices.shape[0], dtype=torch.bool, device=matrices.device)
    for rows, solve in ((fresh, from_eigh), (warm, from_qr)):
        rows_bases, rows_ok = solve(rows)
        bases[rows], ok[rows] = rows_bases, rows_ok
    return bases, ok
