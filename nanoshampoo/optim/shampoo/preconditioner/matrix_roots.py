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

import math

import torch

from nanoshampoo.optim.shampoo.shampoo_types import (
    DefaultPerturbationConfig,
    PerturbationConfig,
    PseudoInverseConfig,
    RankDeficientStabilityConfig,
)


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


def least_precise_dtype(first: torch.dtype, second: torch.dtype) -> torch.dtype:
    """The dtype with the larger machine epsilon."""
    return first if torch.finfo(first).eps >= torch.finfo(second).eps else second


def default_rank_rtol(size: int, dtype: torch.dtype) -> float:
    """``n * finfo(dtype).eps``: the rank tolerance of ``torch.linalg.matrix_rank`` for an
    ``n x n`` matrix in ``dtype`` (the default ``rank_rtol`` of ``PseudoInverseConfig``)."""
    return size * torch.finfo(dtype).eps


def default_floor_rtol(size: int, dtype: torch.dtype) -> float:
    """``sqrt(n) * finfo(dtype).eps``: the default ``eigenvalue_floor_rtol`` (relative to
    ``lambda_max``) of an ``n x n`` factor whose root is computed or applied in ``dtype``.

    Chosen by measurement among ``1e-7``, ``1e-6``, ``n eps`` and ``sqrt(n) eps`` (see
    ``bench/shampoo_fp32_accuracy.py``): ``sqrt(n) eps`` had the smallest float32-vs-float64
    parameter error; ``n eps`` over-damps the larger factors.
    """
    return math.sqrt(size) * torch.finfo(dtype).eps


def numerical_zero_tolerance(
    top: torch.Tensor, stability: RankDeficientStabilityConfig, size: int, noise_dtype: torch.dtype
) -> torch.Tensor:
    """Eigenvalues ``<=`` this are rounding noise under ``stability``; ``top`` ``(N, 1)`` is
    ``lambda_max`` (clamped at 0). Perturbation: ``eigenvalue_floor_rtol * lambda_max``;
    pseudo-inverse: ``max(rank_atol, rank_rtol * lambda_max)``. Returns ``(N, 1)``."""
    if isinstance(stability, PseudoInverseConfig):
        rtol = stability.rank_rtol
        if rtol is None:
            rtol = default_rank_rtol(size, noise_dtype)
        return torch.clamp(top * rtol, min=stability.rank_atol)
    if isinstance(stability, PerturbationConfig):
        rtol = stability.eigenvalue_floor_rtol
        return top * (default_floor_rtol(size, noise_dtype) if rtol is None else rtol)
    raise TypeError(f"unsupported rank_deficient_stability_config {stability!r}")


def inverse_root_spectrum(
    evals: torch.Tensor,
    exponents: torch.Tensor,
    epsilon: float,
    stability: RankDeficientStabilityConfig,
    size: int,
    perturbed: bool,
    noise_dtype: torch.dtype,
) -> torch.Tensor:
    """The weights ``w_j`` of ``X = Q diag(w) Q^T`` from the eigenvalues ``mu`` of ``A``.

    Args:
        evals: ``(N, n)`` eigenvalues, ascending (from ``eigh``).
        exponents: ``(N,)`` exponents ``e > 0``.
        epsilon: ridge ``eps >= 0``.
        stability: ``PerturbationConfig``: ``lambda = max(mu - min(mu_min, 0), f mu_max) + eps``
            with ``f`` its ``eigenvalue_floor_rtol``; the shift comes first, so in float32 a
            ``mu_min`` far below ``-eps`` cannot round the smallest ``lambda`` to 0. When
            ``perturbed`` (``eps I`` already added to ``A``), ``eps`` is only added where the
            shifted spectrum's minimum is below it. ``PseudoInverseConfig``: ``w = 0`` where
            ``mu <= max(rank_atol, rank_rtol * mu_max)``, else ``(mu + eps)^(-e)``.
        size: ``n``, for the default relative tolerances.
        perturbed: whether ``evals`` are those of ``A + eps I``.
        noise_dtype: the least precise dtype the root passes through (decomposition or
            storage); the default tolerances are relative to its ``eps``.

    Returns:
        ``(N, n)`` weights, finite wherever ``evals`` are (and ``eps > 0`` or a pseudo-inverse).
    """
    power = -exponents.unsqueeze(-1)
    top = evals[..., -1:].clamp(min=0.0)
    tolerance = numerical_zero_tolerance(top, stability, size, noise_dtype)
    if isinstance(stability, PseudoInverseConfig):
        kept = evals > tolerance
        # Dropped directions get base 1 so that pow stays finite before the mask zeroes it.
        base = torch.where(kept, evals + epsilon, torch.ones_like(evals))
        return torch.where(kept, base.pow(power), torch.zeros_like(evals))
    floor = tolerance
    if perturbed:
        lowest = evals[..., :1]
        shifted = torch.where(lowest < epsilon, (evals - lowest) + epsilon, evals)
        return torch.maximum(shifted, floor).pow(power)
    shifted = evals - evals[..., :1].clamp(max=0.0)
    return (torch.maximum(shifted, floor) + epsilon).pow(power)


def eigh_inverse_root(
    matrices: torch.Tensor,
    exponents: torch.Tensor,
    epsilon: float,
    retry_double_precision: bool = True,
    stability: RankDeficientStabilityConfig = DefaultPerturbationConfig,
    root_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A + eps I)^(-e)`` for each matrix of a stack, by one batched eigendecomposition.

    With ``A = Q diag(mu) Q^T``: ``X = Q diag(w) Q^T``, ``w`` from :func:`inverse_root_spectrum`
    (perturbation with a noise floor, or pseudo-inverse, as ``stability`` says).

    Args:
        matrices: ``(N, n, n)`` symmetric, float32 or float64.
        exponents: ``(N,)`` exponents ``e > 0``, same dtype/device as ``matrices``.
        epsilon: ridge ``eps >= 0``.
        retry_double_precision: retry a failed decomposition in float64.
        stability: the rank-deficient stability config.
        root_dtype: the least precise dtype the factor or its root passes through (factor
            storage, root storage; default: the input's). A float32 root of a float64 factor
            amplifies its own rounding by its condition number, and a bfloat16 factor carries
            bfloat16 rounding into a float32 solve, so the default tolerances use this dtype.

    Returns:
        ``(roots (N, n, n), ok (N,) bool)``; ``roots[i]`` is garbage where ``ok[i]`` is False.
    """
    perturbed = isinstance(stability, PerturbationConfig) and stability.perturb_before_computation
    if perturbed and epsilon > 0.0:
        matrices = matrices + epsilon * torch.eye(
            matrices.shape[-1], dtype=matrices.dtype, device=matrices.device
        )
    evals, evecs, ok = robust_eigh(matrices, retry_double_precision)
    noise_dtype = least_precise_dtype(matrices.dtype, root_dtype or matrices.dtype)
    weights = inverse_root_spectrum(
        evals, exponents, epsilon, stability, matrices.shape[-1], perturbed, noise_dtype
    )
    roots = (evecs * weights.unsqueeze(-2)) @ evecs.mT
    return roots, ok & torch.isfinite(roots).all(dim=-1).all(dim=-1)


def coupled_newton_inverse_root(
    matrices: torch.Tensor,
    root_order: int,
    epsilon: float,
    max_iterations: int,
    tolerance: float,
    root_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A + delta I)^(-1/p)`` for each matrix of a stack by the coupled Newton iteration.

    The ridge is ``delta = eps + sqrt(n) * finfo(dtype).eps * ||A||_F`` (``dtype`` the less
    precise of the input's and ``root_dtype``): the same noise floor as the eigendecomposition
    roots' default, as a ridge since there is no spectrum to floor. Without it a rank-deficient
    float32 factor, whose null-space eigenvalues are rounding noise of either sign, makes the
    iteration diverge (a negative eigenvalue grows at every step) or stall far from converged.

    Keeps ``M_k = X_k^p (A + delta I)``: starting from ``X_0 = z^(1/p) I``,
    ``M_0 = z (A + delta I)`` with ``z = (p + 1) / (2 ||A + delta I||_F)``, iterate
    ``T = ((p + 1) I - M) / p``, ``X <- X T``, ``M <- T^p M`` until ``max |M - I| <= tolerance``
    for every matrix, or ``max_iterations``. Then ``X -> (A + delta I)^(-1/p)``.

    Args:
        matrices: ``(N, n, n)`` symmetric PSD, float32 or float64.
        root_order: integer ``p >= 1``.
        epsilon: ridge ``eps >= 0``.
        max_iterations: iteration cap.
        tolerance: convergence threshold on ``max |M - I|``.
        root_dtype: the least precise dtype the factor or its root passes through (default:
            the input's); see :func:`eigh_inverse_root`.

    Returns:
        ``(roots (N, n, n), ok (N,) bool)``; ``ok`` is False where the result is not finite.
    """
    n = matrices.shape[-1]
    identity = torch.eye(n, dtype=matrices.dtype, device=matrices.device)
    noise_dtype = least_precise_dtype(matrices.dtype, root_dtype or matrices.dtype)
    norms = torch.linalg.matrix_norm(matrices).view(-1, 1, 1)
    ridge = epsilon + default_floor_rtol(n, noise_dtype) * norms
    ridged = matrices + ridge * identity
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
