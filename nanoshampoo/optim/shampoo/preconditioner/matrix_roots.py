"""Batched inverse roots ``X = (A + eps I)^(-e)`` of stacks of symmetric PSD matrices.

Pure math on tensors: no optimizer state, no communication. Each function takes a stack
``A`` of shape ``(N, n, n)`` and returns ``(roots, ok)``: ``roots`` ``(N, n, n)`` and a bool
mask ``ok`` ``(N,)`` that is False for matrices whose computation failed (solver error or
non-finite result); callers keep their previous root for those. The roots from an
eigendecomposition (:func:`eigh_inverse_root`, :func:`warm_started_eigh_inverse_root`) are
exactly symmetric (:func:`~factor_matrix_ops.symmetric_product`); the iterations' are not.

Example:
    >>> A = torch.eye(3).expand(2, 3, 3) * 16.0
    >>> roots, ok = eigh_inverse_root(A, torch.tensor([0.25, 0.5]), epsilon=0.0)
    >>> roots[0, 0, 0].item(), roots[1, 0, 0].item(), ok.tolist()
    (0.5, 0.25, [True, True])
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from nanoshampoo.optim.shampoo.preconditioner.factor_matrix_ops import symmetric_product
from nanoshampoo.optim.shampoo.preconditioner.parallel_eigh import stacked_eigh
from nanoshampoo.optim.shampoo.shampoo_types import (
    DefaultPerturbationConfig,
    PerturbationConfig,
    PseudoInverseConfig,
    RankDeficientStabilityConfig,
)


def _eigh_or_none(matrices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    try:
        return stacked_eigh(matrices)
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


def all_finite(matrices: torch.Tensor) -> torch.Tensor:
    """``(N,)`` bool: whether each matrix of a stack ``(N, ...)`` is finite, from one sum per
    matrix (one read pass, where ``isfinite(x).all()`` makes four). A NaN or Inf entry makes the
    sum non-finite; only an overflow of the sum of finite entries reads as non-finite too,
    which fails a root whose entries near ``float max / numel`` are no usable root anyway."""
    return torch.isfinite(matrices.sum(dim=tuple(range(1, matrices.dim()))))


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
    overwrite_input: bool = False,
    out: torch.Tensor | None = None,
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
        overwrite_input: ``matrices`` is the caller's temporary: the ridge is added to its
            diagonal in place (the same numbers as ``A + eps I``, without a copy of the stack).
        out: the caller's stored roots ``(N, n, n)``, or None. When ``out`` is on the CPU
            with the decomposition (its shape and dtype) and every root is sure to succeed
            before it is formed, the roots are written straight into ``out`` and ``out`` is
            returned: no new stack and no copy into place. Otherwise ``out`` is left alone.
            Sure to succeed: the decomposition succeeded and ``Q`` and ``w`` are finite with
            ``max |w| < float max / 2``, since an entry of ``Q diag(w) Q^T`` with orthonormal
            ``Q`` is at most ``max |w|`` in magnitude (so ``ok`` is what the check of the
            formed roots would give).

    Returns:
        ``(roots (N, n, n), ok (N,) bool)``; ``roots[i]`` is garbage where ``ok[i]`` is False
        (never so for ``out``, which is returned only when every ``ok`` holds).
        The roots are exactly symmetric (:func:`~factor_matrix_ops.symmetric_product`).
    """
    perturbed = isinstance(stability, PerturbationConfig) and stability.perturb_before_computation
    if perturbed and epsilon > 0.0:
        if overwrite_input:
            matrices.diagonal(dim1=-2, dim2=-1).add_(epsilon)
        else:
            matrices = matrices + epsilon * torch.eye(
                matrices.shape[-1], dtype=matrices.dtype, device=matrices.device
            )
    evals, evecs, ok = robust_eigh(matrices, retry_double_precision)
    noise_dtype = least_precise_dtype(matrices.dtype, root_dtype or matrices.dtype)
    weights = inverse_root_spectrum(
        evals, exponents, epsilon, stability, matrices.shape[-1], perturbed, noise_dtype
    )
    if (
        out is not None
        and out.device == evecs.device
        and out.device.type == "cpu"  # (elsewhere the check below would synchronize)
        and out.dtype == evecs.dtype
        and out.shape == evecs.shape
    ):
        bound = torch.finfo(weights.dtype).max / 2
        sure = ok & all_finite(evecs) & (weights.abs().amax(dim=-1) < bound)
        if bool(sure.all()):
            return symmetric_product(evecs * weights.unsqueeze(-2), evecs, out=out), sure
    roots = symmetric_product(evecs * weights.unsqueeze(-2), evecs)
    return roots, ok & all_finite(roots)


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
    z = (root_order + 1) / (
        2.0 * torch.linalg.matrix_norm(ridged).clamp(min=torch.finfo(ridged.dtype).tiny)
    )
    z = z.view(-1, 1, 1)
    roots = z.pow(1.0 / root_order) * identity
    m = z * ridged
    for _ in range(max_iterations):
        if (m - identity).abs().amax() <= tolerance:
            break
        step = ((root_order + 1) * identity - m) / root_order
        roots = roots @ step
        m = torch.linalg.matrix_power(step, root_order) @ m
    return roots, all_finite(roots)


# A coupled iteration that ends with max |M - I| above this has not found the root. The
# residual recomputed as B X^p - I is not used: on a rank-deficient float32 factor it is ~0.11
# (rounding of X amplified by p and by the condition number ~1e6 of the ridged factor) while the
# root itself is within 0.7 % of the float64 one (coupled_higher_order_test.py).
_COUPLED_RESIDUAL_LIMIT = 0.1


def higher_order_coefficients(root_order: int, order: int) -> list[float]:
    """``b_0..b_(order-1)`` of the order-``order`` coupled iteration for the ``p``-th root:
    the Taylor coefficients of ``(1 - x)^(-1/p)``, ``b_i = prod_(j<i) (1 + j p) / (i! p^i)``."""
    coefficients, numerator, denominator = [1.0], 1.0, 1.0
    for i in range(1, order):
        numerator *= 1 + (i - 1) * root_order
        denominator *= i * root_order
        coefficients.append(numerator / denominator)
    return coefficients


def _taylor_step(m: torch.Tensor, coefficients: list[float]) -> torch.Tensor:
    """``T = sum_i b_i (I - M)^i`` by Horner's rule, for a stack ``M`` ``(N, n, n)``."""
    identity = torch.eye(m.shape[-1], dtype=m.dtype, device=m.device)
    base = identity - m
    step = base * coefficients[-1] + identity * coefficients[-2]
    for coefficient in reversed(coefficients[:-2]):
        step = identity * coefficient + step @ base
    return step


def coupled_higher_order_inverse_root(
    matrices: torch.Tensor,
    root: Fraction,
    rel_epsilon: float,
    abs_epsilon: float,
    max_iterations: int,
    tolerance: float,
    order: int,
    root_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A + delta I)^(-q/p)`` for each matrix of a stack (``root = p / q``) by the coupled
    iteration of order ``order`` (``CoupledHigherOrderConfig``).

    ``delta = max(rel_epsilon l, abs_epsilon) + sqrt(n) finfo(dtype).eps l``, ``l = ||A||_inf``.
    With ``B = A + delta I`` and ``z = 1 / tr B``: ``X = z^(1/p) I``, ``M = z B`` (so
    ``M = X^p B`` throughout and the spectrum of ``M`` lies in (0, 1]); one Newton step
    ``T = (1 + 1/p) I - M / p`` first (it guarantees the higher order's convergence region),
    then ``T = sum_i b_i (I - M)^i`` (:func:`higher_order_coefficients`, Horner's rule), each
    followed by ``X <- X T``, ``M <- T^p M``, until ``max |M - I| <= tolerance``. A matrix
    whose error grows by more than 1.2x, or stalls below 1e-3, stops at the iterate before.

    Returns:
        ``(roots (N, n, n), ok (N,) bool)``; ``ok`` is False where the root is not finite or
        the iteration's residual ``max |M - I|`` (``M = X^p B``) ended above 0.1.
    """
    p, q, n = root.numerator, root.denominator, matrices.shape[-1]
    identity = torch.eye(n, dtype=matrices.dtype, device=matrices.device)
    noise_dtype = least_precise_dtype(matrices.dtype, root_dtype or matrices.dtype)
    bound = torch.linalg.matrix_norm(matrices, ord=torch.inf).view(-1, 1, 1)
    ridge = (
        torch.clamp(bound * rel_epsilon, min=abs_epsilon)
        + default_floor_rtol(n, noise_dtype) * bound
    )
    ridged = matrices + ridge * identity
    trace = ridged.diagonal(dim1=-2, dim2=-1).sum(-1).clamp(min=torch.finfo(ridged.dtype).tiny)
    z = (1.0 / trace).view(-1, 1, 1)
    roots, m = z.pow(1.0 / p) * identity, z * ridged

    def advance(step: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        nonlocal roots, m
        keep = active.view(-1, 1, 1)
        roots = torch.where(keep, roots @ step, roots)
        m = torch.where(keep, torch.linalg.matrix_power(step, p) @ m, m)
        return (m - identity).abs().amax(dim=(-2, -1))

    active = torch.ones(matrices.shape[0], dtype=torch.bool, device=matrices.device)
    error = advance(m * (-1.0 / p) + identity * (1.0 + 1.0 / p), active)
    b = higher_order_coefficients(p, order)
    for _ in range(max_iterations - 1):
        active = active & (error > tolerance)
        if not bool(active.any()):
            break
        previous = (roots, m)
        new_error = advance(_taylor_step(m, b), active)
        diverged = active & ((new_error > 1.2 * error) | ((new_error == error) & (error < 1e-3)))
        back = diverged.view(-1, 1, 1)
        roots, m = torch.where(back, previous[0], roots), torch.where(back, previous[1], m)
        active = active & ~diverged
        error = torch.where(active, new_error, error)
    if q > 1:
        roots = torch.linalg.matrix_power(roots, q)
    ok = all_finite(roots) & (error <= _COUPLED_RESIDUAL_LIMIT)
    return roots, ok


def _descending_weights(
    evals: torch.Tensor,
    exponents: torch.Tensor,
    epsilon: float,
    stability: RankDeficientStabilityConfig,
    perturbed: bool,
    noise_dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`inverse_root_spectrum` of eigenvalues in descending order (``(N, n)``)."""
    return inverse_root_spectrum(
        evals.flip(-1), exponents, epsilon, stability, evals.shape[-1], perturbed, noise_dtype
    ).flip(-1)


def root_error_estimate(
    projected: torch.Tensor,
    weights: torch.Tensor,
    exponents: torch.Tensor,
    pseudo_inverse: bool = False,
) -> torch.Tensor:
    """First-order relative error of the directions ``Q diag(w) Q^T g`` for gradients ``g``
    whose covariance is ``A``: ``(N,)``.

    ``projected`` ``(N, n, n)`` is ``B = Q^T A Q`` for an orthonormal ``Q``; ``weights``
    ``(N, n)`` are ``w_j = f(B_jj)``, ``f`` the spectral function of the root (shift, floor,
    ridge, power ``-e``; ``exponents`` ``(N,)``). In the basis ``Q``, ``A`` is ``diag(B) + O``
    with ``O`` the off-diagonal part, and to first order in ``O`` the root changes by
    ``E_ij = O_ij (f(B_ii) - f(B_jj)) / (B_ii - B_jj)`` (the Daleckii-Krein formula). The
    estimate is ``sqrt(sum_ij E_ij^2 d_j / sum_j w_j^2 d_j)`` with ``d = max(diag(B), 0)``:
    ``E||E g||^2 / E||X g||^2`` for ``g ~ N(0, A)``, i.e. the error where Shampoo's gradients
    are (a factor accumulates ``G G^T``). A plain Frobenius norm of ``E`` would be dominated by
    the huge weights of the numerical null space, where gradients have no mass, and would
    accept bases that misplace the directions that gradients do have.

    The divided difference is capped by ``e max(w_i, w_j)^(1 + 1/e)``, the largest ``|f'|`` on
    the interval (``f`` is convex and decreasing, and ``w^(-1/e)`` is the ridged, floored
    eigenvalue): this replaces ``0/0`` for equal diagonal entries and float32 cancellation for
    close ones. Directions that are all floored (the numerical null space) get a zero divided
    difference, so rounding noise mixing them costs nothing, as it should: the root is the same
    multiple of the identity there, whatever basis spans it. With ``pseudo_inverse`` (some
    ``w`` are 0) the jump from ``w > 0`` to ``w = 0`` is taken exactly (no cap).
    """
    diagonal = projected.diagonal(dim1=-2, dim2=-1)
    gap = (diagonal.unsqueeze(-1) - diagonal.unsqueeze(-2)).abs_()
    exponent = exponents.unsqueeze(-1)
    # max(w_i, w_j)^p = max(w_i^p, w_j^p) for w >= 0: n powers per matrix, not n^2.
    slope = exponent * weights.pow(1.0 + 1.0 / exponent)
    cap = torch.maximum(slope.unsqueeze(-1), slope.unsqueeze(-2))
    divided = (weights.unsqueeze(-1) - weights.unsqueeze(-2)).abs_().div_(gap)
    if pseudo_inverse:
        # A dropped direction (w = 0) next to a kept one is a jump: no cap, and 0/0 between
        # two dropped directions is 0.
        both_positive = (weights > 0.0).unsqueeze(-1) & (weights > 0.0).unsqueeze(-2)
        divided = torch.where(both_positive, torch.fmin(divided, cap), divided.nan_to_num_(nan=0.0))
    else:
        divided = torch.fmin(divided, cap)  # fmin: the cap replaces 0/0
    change = divided.mul_(projected)
    change.diagonal(dim1=-2, dim2=-1).zero_()  # E has no diagonal term
    if pseudo_inverse:
        change.nan_to_num_(nan=0.0)  # inf * 0: a jump where A has no coupling
    mass = diagonal.clamp(min=0.0)
    error = (change.square_() @ mass.unsqueeze(-1)).squeeze(-1).sum(dim=-1)
    total = (weights.square() * mass).sum(dim=-1)
    return torch.where(
        total > 0.0, error / total.clamp(min=torch.finfo(total.dtype).tiny), 0.0
    ).sqrt()


def warm_started_eigh_inverse_root(
    matrices: torch.Tensor,
    exponents: torch.Tensor,
    epsilon: float,
    previous_bases: torch.Tensor,
    warm: torch.Tensor,
    max_iterations: int,
    tolerance: float,
    retry_double_precision: bool = True,
    stability: RankDeficientStabilityConfig = DefaultPerturbationConfig,
    root_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(A + eps I)^(-e)`` per matrix from an eigenbasis warm-started at ``previous_bases``.

    The spectral function is :func:`eigh_inverse_root`'s (same shift, ridge, floor or
    pseudo-inverse); only the eigendecomposition differs. For a matrix with a previous basis
    (``warm``): ``B = Q^T A Q``, eigenvalues ``diag(B)``, and the root is accepted when
    :func:`root_error_estimate` is ``<= tolerance``; otherwise ``Q <- qr(A Q).Q`` and check
    again, at most ``max_iterations`` times (0: accept or fall back at once). Matrices without
    a previous basis, and those still above the tolerance, get a full batched ``eigh``.

    Bases are kept in descending eigenvalue order, the only stable fixed point of the QR
    (orthogonal) iteration, so a column stays on its eigenvector across recomputations.

    Args:
        matrices: ``(N, n, n)`` symmetric, float32 or float64.
        exponents: ``(N,)`` exponents ``e > 0``, same dtype/device as ``matrices``.
        epsilon: ridge ``eps >= 0``.
        previous_bases: ``(N, n, n)`` orthonormal columns, descending (ignored where not warm).
        warm: ``(N,)`` bool, whether ``previous_bases[i]`` is a basis to start from.
        max_iterations: QR iterations allowed before falling back to ``eigh``, >= 0.
        tolerance: accepted root error estimate, >= 0.
        retry_double_precision, stability, root_dtype: as for :func:`eigh_inverse_root`.

    Returns:
        ``(roots (N, n, n), bases (N, n, n) descending, ok (N,) bool, fell_back (N,) bool)``;
        ``fell_back`` marks the warm matrices that needed the full ``eigh``. The host reads one
        flag per QR iteration and one before the fallback, not one per matrix.
    """
    # Kept as one function: the warm-started solve reads as one algorithm (QR iterations with an
    # acceptance test, then the eigh fallback for the rest); its parts share every tensor.
    perturbed = isinstance(stability, PerturbationConfig) and stability.perturb_before_computation
    if perturbed and epsilon > 0.0:
        matrices = matrices + epsilon * torch.eye(
            matrices.shape[-1], dtype=matrices.dtype, device=matrices.device
        )
    noise_dtype = least_precise_dtype(matrices.dtype, root_dtype or matrices.dtype)
    bases = previous_bases.to(matrices.dtype)
    ok = torch.ones_like(warm)
    pseudo_inverse = isinstance(stability, PseudoInverseConfig)
    accepted = torch.zeros_like(warm)
    weights = torch.zeros(matrices.shape[:-1], dtype=matrices.dtype, device=matrices.device)
    # First solves only (nothing to start from): straight to eigh.
    if bool(warm.any()):
        for iteration in range(max_iterations + 1):
            product = matrices @ bases
            projected = bases.mT @ product
            diagonal = projected.diagonal(dim1=-2, dim2=-1)
            # Weights need the spectrum sorted; the estimate does not (it is elementwise).
            order = diagonal.argsort(dim=-1, descending=True)
            weights = _descending_weights(
                diagonal.gather(-1, order), exponents, epsilon, stability, perturbed, noise_dtype
            )
            unsorted = torch.empty_like(weights).scatter_(-1, order, weights)
            estimate = root_error_estimate(projected, unsorted, exponents, pseudo_inverse)
            accepted = warm & (estimate <= tolerance)
            if iteration == max_iterations or bool((accepted | ~warm).all()):
                break
            try:
                # From the basis sorted by descending Rayleigh quotient (see the docstring).
                refined = torch.linalg.qr(
                    product.gather(-1, order.unsqueeze(-2).expand_as(product))
                ).Q
            except RuntimeError:  # LinAlgError on non-finite input: leave those to the eigh below
                break
            bases = torch.where(accepted.view(-1, 1, 1), bases, refined)
        # Stored in descending order of the Rayleigh quotients, matching the sorted weights.
        bases = bases.gather(-1, order.unsqueeze(-2).expand_as(bases))
    solve = (~accepted).nonzero().squeeze(1)
    root_bases = bases
    if solve.numel() > 0:
        evals, evecs, solved_ok = robust_eigh(matrices[solve], retry_double_precision)
        # The root from the ascending eigh output, as eigh_inverse_root forms it (the same
        # rounding); the stored basis descending.
        ascending = inverse_root_spectrum(
            evals, exponents[solve], epsilon, stability, matrices.shape[-1], perturbed, noise_dtype
        )
        root_bases = bases.index_copy(0, solve, evecs)
        weights = weights.index_copy(0, solve, ascending)
        bases = bases.index_copy(0, solve, evecs.flip(-1))
        ok = ok.index_copy(0, solve, solved_ok)
    roots = symmetric_product(root_bases * weights.unsqueeze(-2), root_bases)
    return roots, bases, ok & all_finite(roots) & all_finite(bases), warm & ~accepted
