"""Batched eigenbases of stacks of symmetric PSD matrices: full ``eigh``, or warm-started QR.

Pure math on tensors. Both functions take a stack ``A`` of shape ``(N, n, n)`` and return
``(bases, ok)``: ``bases`` ``(N, n, n)`` with orthonormal columns (eigenvectors, ordered by
*descending* eigenvalue) and a bool mask ``ok`` ``(N,)``, False where the computation failed
(solver error or non-finite result); callers keep their previous basis for those.

Why descending: the warm-started QR (orthogonal) iteration ``Q <- qr(A Q)`` has the eigenbasis
in descending order as its only stable fixed point. Starting it from a descending basis keeps
every column on "its" eigenvector, so state kept per eigen-direction (the corrected eigenvalues
of eigenvalue-corrected Shampoo) stays attached to the same direction across recomputations.

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

from nanoshampoo.optim.shampoo.preconditioner.matrix_roots import robust_eigh


def _finite(matrices: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(matrices).flatten(1).all(dim=1)


def eigh_eigenbasis(
    matrices: torch.Tensor, retry_double_precision: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvectors of each matrix of a stack by one batched ``eigh``, descending order.

    Args:
        matrices: ``(N, n, n)`` symmetric, float32 or float64.
        retry_double_precision: retry a failed decomposition in float64.

    Returns:
        ``(bases (N, n, n), ok (N,) bool)``; ``bases[i]`` is garbage where ``ok[i]`` is False.
    """
    _, evecs, ok = robust_eigh(matrices, retry_double_precision)
    bases = evecs.flip(-1)
    return bases, ok & _finite(bases)


def off_diagonal_ratio(matrices: torch.Tensor, bases: torch.Tensor) -> torch.Tensor:
    """``||B - diag(B)||_F / ||B||_F`` with ``B = Q^T A Q``, per matrix: ``(N,)``.

    It is also ``||A - Q diag(B) Q^T||_F / ||A||_F``: the relative error of ``Q`` as an
    eigenbasis of ``A``. A zero matrix has ratio 0 (every basis is an eigenbasis).
    """
    projected = bases.mT @ matrices @ bases
    total = torch.linalg.matrix_norm(projected)
    off = torch.linalg.matrix_norm(projected - torch.diag_embed(projected.diagonal(dim1=-2, dim2=-1)))
    return torch.where(total > 0.0, off / total.clamp(min=torch.finfo(total.dtype).tiny), 0.0)


def qr_eigenbasis(
    matrices: torch.Tensor, previous: torch.Tensor, max_iterations: int, tolerance: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Refine ``previous`` bases by at most ``max_iterations`` QR (orthogonal) iterations.

    Per matrix: while ``off_diagonal_ratio(A, Q) > tolerance``, ``Q <- qr(A Q).Q``. Matrices
    already within the tolerance keep their basis unchanged (no iteration is spent on them).
    Cost per iteration: two batched matmuls and one batched QR, no ``eigh``.

    Args:
        matrices: ``(N, n, n)`` symmetric PSD, float32 or float64.
        previous: ``(N, n, n)`` orthonormal starting bases (same dtype/device), ideally the
            last eigenbasis in descending eigenvalue order.
        max_iterations: iteration cap, >= 1.
        tolerance: convergence threshold on the off-diagonal ratio, in [0, 1].

    Returns:
        ``(bases (N, n, n), ok (N,) bool)``; ``ok`` is False where the result is not finite.
    """
    bases = previous
    for _ in range(max_iterations):
        converged = off_diagonal_ratio(matrices, bases) <= tolerance
        if bool(converged.all()):
            break
        try:
            refined = torch.linalg.qr(matrices @ bases).Q
        except RuntimeError:  # LinAlgError on non-finite input: every matrix of the batch fails
            return previous, torch.zeros_like(converged)
        bases = torch.where(converged.view(-1, 1, 1), bases, refined)
    return bases, _finite(bases)
