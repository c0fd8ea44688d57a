"""Batched inverse roots ``X = (A + eps I)^(-e)`` of stacks of symmetric PSD matrices.

Pure math on tensors: no optimizer state, no communication. Each function takes a stack
``A`` of shape ``(N, n, n)`` and returns ``(roots, ok)``: ``roots`` ``(N, n, n)`` and a bool
mask ``ok`` ``(N,)`` that is False for matrices whose computation failed (solver error or
non-finite result); callers keep their previous root for those.

Example:
    >>> A = torch.eye(3).expand(2, 3, 3) * 16.0
    >>> roots, ok = eigh_inverse_root(A, torch.tensor([0.25, 0.5]), epsilon=0.0)
    >>> roots[0, 0, 0].item(), roots[1, 0, 0].item(), ok.tolist()
    (0.5, 0.25, [True, True])
"""

from __future__ import annotations

import torch


def _eigh_or_none(matrices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    try:
        return torch.linalg.eigh(matrices)
    except RuntimeError:  # torch.linalg.LinAlgError (no convergence, NaN input) is a RuntimeError
        return None


def robust_eigh(
    matrices: torch.Tensor, retry_double_precision: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``eigh`` of a stack with fallbacks; returns ``(eigenvalues, eigenvectors, ok)``.

    ``matrices`` ``(N, n, n)`` symmetric, float32 or float64; returns eigenvalues ``(N, n)``
    in ascending order, eigenvectors ``(N, n, n)`` (columns) in the input dtype, ``ok`` ``(N,)``
    bool. Shared by the inverse roots here and the eigenbases of :mod:`eigenbasis`.

    One batched call first. If it raises, retry the batch in float64 (when asked), and if that
    raises too, decompose matrix by matrix so one bad matrix does not fail the others; failed
    matrices get NaN eigenpairs and ``ok = False``.
    """
    ok = torch.ones(matrices.shape[0], dtype=torch.bool, device=matrices.device)
    result = _eigh_or_none(matrices)
    if result is None and retry_double_precision and matrices.dtype != torch.float64:
        result = _eigh_or_none(matrices.double())
        if result is not None:
            result = (result[0].to(matrices.dtype), result[1].to(matrices.dtype))
    if result is not None:
        return result[0], result[1], ok
    evals = torch.full(matrices.shape[:-1], torch.nan, dtype=matrices.dtype, device=matrices.device)
    evecs = torch.full_like(matrices, torch.nan)
    for index, matrix in enumerate(matrices):
        single = _eigh_or_none(matrix)
        if single is None and retry_double_precision and matrix.dtype != torch.float64:
            single = _eigh_or_none(matrix.double())
        if single is None:
            ok[index] = False
            continue
        evals[index].copy_(single[0])
        evecs[index].copy_(single[1])
    return evals, evecs, ok


def eigh_inverse_root(
    matrices: torch.Tensor,
    exponents: torch.Tensor,
    epsilon: float,
    retry_double_precision: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A + eps I)^(-e)`` for each matrix of a stack, by one batched eigendecomposition.

    With ``A = Q diag(mu) Q^T``: ``lambda = mu + eps``; if ``min(lambda) < eps`` the spectrum is
    shifted up so that its minimum equals ``eps`` (rounding can make a PSD matrix's smallest
    eigenvalues slightly negative); then ``X = Q diag(lambda^(-e)) Q^T``.

    Args:
        matrices: ``(N, n, n)`` symmetric, float32 or float64.
        exponents: ``(N,)`` exponents ``e > 0``, same dtype/device as ``matrices``.
        epsilon: ridge ``eps >= 0``.
        retry_double_precision: retry a failed decomposition in float64.

    Returns:
        ``(roots (N, n, n), ok (N,) bool)``; ``roots[i]`` is garbage where ``ok[i]`` is False.
    """
    evals, evecs, ok = robust_eigh(matrices, retry_double_precision)
    evals = evals + epsilon
    shift = (epsilon - evals.amin(dim=-1, keepdim=True)).clamp_(min=0.0)
    evals.add_(shift)
    scaled = evecs * evals.pow(-exponents.unsqueeze(-1)).unsqueeze(-2)
    roots = scaled @ evecs.mT
    return roots, ok & torch.isfinite(roots).all(dim=-1).all(dim=-1)


def coupled_newton_inverse_root(
    matrices: torch.Tensor,
    root_order: int,
    epsilon: float,
    max_iterations: int,
    tolerance: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A + eps I)^(-1/p)`` for each matrix of a stack by the coupled Newton iteration.

    Keeps ``M_k = X_k^p (A + eps I)``: starting from ``X_0 = z^(1/p) I``, ``M_0 = z (A + eps I)``
    with ``z = (p + 1) / (2 ||A + eps I||_F)``, iterate ``T = ((p + 1) I - M) / p``,
    ``X <- X T``, ``M <- T^p M`` until ``max |M - I| <= tolerance`` for every matrix, or
    ``max_iterations``. Then ``X -> (A + eps I)^(-1/p)``.

    Args:
        matrices: ``(N, n, n)`` symmetric PSD, float32 or float64.
        root_order: integer ``p >= 1``.
        epsilon: ridge ``eps >= 0``.
        max_iterations: iteration cap.
        tolerance: convergence threshold on ``max |M - I|``.

    Returns:
        ``(roots (N, n, n), ok (N,) bool)``; ``ok`` is False where the result is not finite.
    """
    n = matrices.shape[-1]
    identity = torch.eye(n, dtype=matrices.dtype, device=matrices.device)
    ridged = matrices + epsilon * identity
    z = (root_order + 1) / (2.0 * torch.linalg.matrix_norm(ridged).clamp(min=torch.finfo(ridged.dtype).tiny))
    z = z.view(-1, 1, 1)
    roots = z.pow(1.0 / root_order) * identity
    m = z * ridged
    for _ in range(max_iterations):
        if (m - identity).abs().amax() <= tolerance:
            break
        step = ((root_order + 1) * identity - m) / root_order
        roots = roots @ step
        m = torch.linalg.matrix_power(step, root_order) @ m
    return roots, torch.isfinite(roots).all(dim=-1).all(dim=-1)
