"""Configs of the matrix functions behind the preconditioners: roots, eigenbases, orthogonalization.

``RootInvConfig`` solvers compute ``(A + eps I)^(-e)`` (root-inverse Shampoo),
``EigendecompositionConfig`` solvers an eigenbasis (eigenvalue-corrected Shampoo),
``OrthogonalizationConfig`` maps ``G = U S V^T`` to ``U V^T`` (spectral descent); the
``RankDeficientStabilityConfig`` of a decomposition says how numerically-zero eigenvalues are
treated. Every config validates its fields in ``__post_init__`` (``ValueError`` naming the field).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanoshampoo import validation
from nanoshampoo.optim.shampoo.config_checks import (
    FLOAT_DTYPES,
    check_bool,
    check_int,
    check_optional_tolerance,
    check_rule,
    refuse,
)
from nanoshampoo.optim.shampoo.utils.abstract_dataclass import AbstractDataclass


def _check_rank_deficient_stability_config(value: object) -> None:
    if not isinstance(value, RankDeficientStabilityConfig):
        raise ValueError(
            "rank_deficient_stability_config must be a PerturbationConfig or PseudoInverseConfig, "
            f"got {value!r}"
        )


def _check_unit_tolerance(value: object) -> None:
    check_rule(
        "tolerance",
        f"Invalid tolerance value: {value}.",
        value,
        "Must be in the interval [0.0, 1.0].",
        lambda tolerance: 0.0 <= tolerance <= 1.0,
    )


def _check_device_name(name: str, value: object) -> None:
    """``""`` (no device) or a name ``torch.device`` parses (``"cpu"``, ``"cuda:1"``)."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a device name string, got {value!r}")
    if value:
        try:
            torch.device(value)
        except RuntimeError:
            raise ValueError(
                f"{name} must be '' or a device name like 'cpu', got {value!r}"
            ) from None


# ---------------------------------------------------------------------------------------------
# Rank-deficient factors
# ---------------------------------------------------------------------------------------------


@dataclass(init=False)
class RankDeficientStabilityConfig(AbstractDataclass):
    """Base of the ways a root or eigenbasis computation treats a rank-deficient factor.

    Kronecker factors are often singular (a vector block, a wide block ``n > m``, the first
    steps), and in float32 their numerically-zero eigenvalues are rounding noise of size
    ``~ n * u * lambda_max`` (``u`` the unit roundoff), of either sign.
    """


@dataclass(kw_only=True)
class PerturbationConfig(RankDeficientStabilityConfig):
    """Regularize: ``(A + eps I)^(-e)`` with the spectrum made at least ``eps``.

    ``lambda <- lambda - min(lambda_min, 0) + eps``: the shift by the smallest eigenvalue comes
    first and ``eps`` is added after it, so a float32 ``lambda_min`` far below ``-eps`` cannot
    round the shifted minimum to 0 (whose root is inf).

    Args:
        perturb_before_computation: form ``A + eps I`` before the decomposition (True, the
            well-known library's default) or add ``eps`` to the eigenvalues after it (False).
            Equal in exact arithmetic.
        eigenvalue_floor_rtol: eigenvalues below ``rtol * lambda_max`` are raised to it before
            ``eps`` is added: they are indistinguishable from rounding noise, and their huge
            ``eps^(-e)`` weight would amplify the noise that the gradient has in those directions.
            None (default): ``sqrt(n) * finfo(dtype).eps`` for an ``n x n`` factor, ``dtype``
            the less precise of the decomposition's and the root's (chosen by measurement, see
            ``bench/shampoo_fp32_accuracy.py``). ``0.0``: no floor (the plain shift, the float32
            baseline).
    """

    perturb_before_computation: bool = True
    eigenvalue_floor_rtol: float | None = None

    def __post_init__(self) -> None:
        check_bool("perturb_before_computation", self.perturb_before_computation)
        check_optional_tolerance("eigenvalue_floor_rtol", self.eigenvalue_floor_rtol)


DefaultPerturbationConfig = PerturbationConfig()


@dataclass(kw_only=True)
class PseudoInverseConfig(RankDeficientStabilityConfig):
    """Pseudo-inverse: eigen-directions whose eigenvalue is numerically zero get weight 0.

    An eigenvalue counts as zero when ``lambda <= max(rank_atol, rtol * lambda_max)`` (the rule
    of ``torch.linalg.matrix_rank``); the others get ``lambda^(-e)``. The optimizer's
    ``epsilon`` must then be 0. Only for eigendecompositions (``EigenConfig`` and the
    eigenbasis configs); the coupled Newton iteration needs a nonsingular matrix.

    Args:
        rank_atol: absolute tolerance, finite and >= 0.
        rank_rtol: relative tolerance, finite and >= 0; None: ``n * finfo(dtype).eps``, ``dtype``
            the less precise of the decomposition's and the result's.
    """

    rank_atol: float = 0.0
    rank_rtol: float | None = None

    def __post_init__(self) -> None:
        check_optional_tolerance("rank_atol", self.rank_atol, allow_none=False)
        check_optional_tolerance("rank_rtol", self.rank_rtol)


# ---------------------------------------------------------------------------------------------
# Eigenbases (eigenvalue-corrected Shampoo)
# ---------------------------------------------------------------------------------------------


@dataclass(init=False)
class MatrixFunctionConfig(AbstractDataclass):
    """Base of the configs of a matrix function: a root, an eigenbasis or an orthogonalization.

    These are the expensive, amortized computations of a preconditioner.
    """


# The name this project used before it followed the well-known library's; kept for old scripts.
AmortizedComputationConfig = MatrixFunctionConfig


@dataclass(init=False)
class EigendecompositionConfig(MatrixFunctionConfig):
    """Base of the solvers of the eigenbasis (eigenvectors) of a symmetric PSD factor matrix."""


@dataclass(kw_only=True)
class EighEigendecompositionConfig(EigendecompositionConfig):
    """Eigenbasis by ``torch.linalg.eigh`` (batched by size) at every recomputation.

    Args:
        retry_double_precision: when ``eigh`` fails in the factor's precision, retry in float64.
        rank_deficient_stability_config: ``PerturbationConfig`` (default) or
            ``PseudoInverseConfig`` (then the optimizer's ``epsilon`` must be 0); see
            :class:`EigenvalueCorrectedShampooPreconditionerConfig` for what each does there.
        tolerance: in [0, 1]. A factor whose previous eigenbasis ``Q`` still satisfies
            ``||B - diag(B)||_F <= tolerance * ||B||_F`` with ``B = Q^T A Q`` (the relative error
            ``||A - Q diag(B) Q^T||_F / ||A||_F`` of ``Q`` as an eigenbasis of ``A``) keeps ``Q``
            and skips its ``eigh``: an adaptive recomputation frequency. 0 (default): every
            scheduled recomputation is an ``eigh``. The first decomposition of a factor is always
            a full ``eigh`` (the well-known library tests the identity basis first).
        eigendecomposition_offload_device: device the ``eigh`` runs on, e.g. ``"cpu"``; the
            results come back to the factor's device and dtype. ``""`` (default): the factor's
            own device.
    """

    retry_double_precision: bool = True
    rank_deficient_stability_config: RankDeficientStabilityConfig = field(
        default_factory=PerturbationConfig
    )
    tolerance: float = 0.0
    eigendecomposition_offload_device: str = ""

    def __post_init__(self) -> None:
        check_bool("retry_double_precision", self.retry_double_precision)
        _check_rank_deficient_stability_config(self.rank_deficient_stability_config)
        _check_unit_tolerance(self.tolerance)
        _check_device_name(
            "eigendecomposition_offload_device", self.eigendecomposition_offload_device
        )


@dataclass(kw_only=True)
class QREigendecompositionConfig(EigendecompositionConfig):
    """Eigenbasis by QR (orthogonal) iterations warm-started from the previous eigenbasis.

    Each computation runs ``Q <- qr(F Q)`` while ``||B - diag(B)||_F > tolerance * ||B||_F``
    with ``B = Q^T F Q``, at most ``max_iterations`` times (zero iterations when the previous
    basis is still good). By default it is the well-known library's algorithm: the first
    computation of a factor starts from the identity, the iteration runs on the basis in
    ascending eigenvalue order, and every computation then re-sorts the columns by ascending
    ``q_j^T F q_j``; eigenvalue-corrected Shampoo keeps its corrected eigenvalues by position
    across the re-sort, as that library does. Only for
    :class:`EigenvalueCorrectedShampooPreconditionerConfig` and
    :class:`EigendecomposedShampooPreconditionerConfig`: root-inverse Shampoo needs eigenvalues
    as well, so its ``amortized_computation_config`` is a ``RootInvConfig`` (its warm-started
    counterpart: :class:`WarmStartedEigenConfig`).

    Args:
        max_iterations: iteration cap per recomputation, >= 1.
        tolerance: relative off-diagonal mass accepted as converged, in [0, 1]. 0 (default, the
            library's): every computation iterates.
        retry_double_precision: a full ``eigh`` (``keep_descending_order``) retries in float64
            on failure.
        rank_deficient_stability_config: as for :class:`EighEigendecompositionConfig`; a
            ``PerturbationConfig`` with ``perturb_before_computation`` iterates on
            ``F + epsilon I`` (the library's ridge; it leaves ``eigh`` bases unchanged).
        keep_descending_order: eigenvalue-corrected Shampoo only. True: this library's robust
            variant: the first basis of a factor is a full ``eigh``, and the iteration runs on
            the descending order, its stable fixed point, so every column stays on its
            eigenvector without re-sorting. One QR step from the identity is a poor first basis,
            and on the ascending order rounding noise in a rank-deficient factor's null columns
            leaks into the others (``docs/compat.md``). False (default): the library's.
    """

    max_iterations: int = 1
    tolerance: float = 0.0
    retry_double_precision: bool = True
    rank_deficient_stability_config: RankDeficientStabilityConfig = field(
        default_factory=PerturbationConfig
    )
    keep_descending_order: bool = False

    def __post_init__(self) -> None:
        check_int("max_iterations", self.max_iterations, minimum=1)
        _check_unit_tolerance(self.tolerance)
        check_bool("retry_double_precision", self.retry_double_precision)
        _check_rank_deficient_stability_config(self.rank_deficient_stability_config)
        check_bool("keep_descending_order", self.keep_descending_order)


DefaultEigendecompositionConfig = EighEigendecompositionConfig()


# ---------------------------------------------------------------------------------------------
# Roots (root-inverse Shampoo)
# ---------------------------------------------------------------------------------------------


@dataclass(init=False)
class RootInvConfig(MatrixFunctionConfig):
    """Base of the solvers of ``X = (A + eps I)^(-e)`` for a symmetric PSD ``A``."""


@dataclass(kw_only=True)
class EigenConfig(RootInvConfig, EighEigendecompositionConfig):
    """Root by symmetric eigendecomposition (``torch.linalg.eigh``, batched by size).

    ``A`` is PSD in exact arithmetic, but rounding makes its tiny eigenvalues noise of either
    sign; ``rank_deficient_stability_config`` says how they are treated. It is also an
    :class:`EighEigendecompositionConfig` (as in the well-known library), so it configures the
    eigenbasis of eigenvalue-corrected Shampoo as well.

    Args:
        retry_double_precision: when ``eigh`` fails in the factor's precision, retry in float64.
        rank_deficient_stability_config: ``PerturbationConfig`` (default) or
            ``PseudoInverseConfig`` (then the optimizer's ``epsilon`` must be 0).
        eigendecomposition_offload_device: as for :class:`EighEigendecompositionConfig`.
        tolerance: must be 0.0: a root needs the current eigenvalues, so the decomposition is
            never skipped (:class:`WarmStartedEigenConfig` reuses eigenvectors instead).
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tolerance != 0.0:
            raise refuse(
                "tolerance",
                f"Invalid tolerance value: {self.tolerance}. Must be 0.0 for "
                f"{type(self).__name__}.",
                "(a root needs the current eigenvalues; WarmStartedEigenConfig reuses "
                "eigenvectors)",
            )


@dataclass(kw_only=True)
class CoupledNewtonConfig(RootInvConfig):
    """Root by the coupled Newton iteration (matrix multiplications only; GPU friendly).

    Needs an integer root order ``p = 1 / e`` (true for the default exponents ``1 / (2k)``).
    Rank-deficient factors are handled by perturbation only (``A + eps I``, with ``eps`` at
    least the float32 noise level of ``A``): the iteration needs a nonsingular matrix, so
    there is no pseudo-inverse variant and no ``rank_deficient_stability_config`` field.

    Args:
        max_iterations: iteration cap, >= 1.
        tolerance: stop once ``max |M - I| <= tolerance``; >= 0.
    """

    max_iterations: int = 100
    tolerance: float = 1e-6

    def __post_init__(self) -> None:
        check_int("max_iterations", self.max_iterations, minimum=1)
        validation.check_float("tolerance", self.tolerance, at_least=0.0, finite=False)


@dataclass(kw_only=True)
class CoupledHigherOrderConfig(RootInvConfig):
    """Root by a coupled iteration of order ``order`` (Lakic's generalisation of coupled
    Newton; matrix multiplications only). ``order = 2`` is Newton's; higher orders take fewer
    iterations and more matmuls per iteration.

    The root ``(A + delta I)^(-e)`` for a rational ``1 / e = p / q`` (``q > 1``: the ``p``-th
    root is raised to the ``q``-th power). The ridge is ``delta = max(rel_epsilon * l, abs_epsilon)
    + sqrt(n) * finfo(dtype).eps * l`` with ``l = ||A||_inf`` (an upper bound of the largest
    eigenvalue); the optimizer's ``epsilon`` is not used, as in the well-known library, and the
    second term (the float32 noise floor also used by :class:`CoupledNewtonConfig`) keeps a
    rank-deficient float32 factor from stalling the iteration. A result whose iteration ends
    with ``max |M - I| > 0.1`` (``M = X^p (A + delta I)``, kept by the coupled recursion)
    counts as failed, and the previous root is kept.

    Args:
        rel_epsilon: ridge relative to ``||A||_inf``, >= 0.
        abs_epsilon: absolute ridge, >= 0.
        max_iterations: iteration cap, >= 1.
        tolerance: stop once ``max |M - I| <= tolerance``; >= 0.
        order: order of the iteration, an int >= 2.
        disable_tf32: accepted for the well-known library's scripts; the iteration here runs in
            the factor's dtype (tf32 is a CUDA matmul mode this library never turns on).
    """

    rel_epsilon: float
    abs_epsilon: float
    max_iterations: int = 100
    tolerance: float = 1e-8
    order: int = 3
    disable_tf32: bool = True

    def __post_init__(self) -> None:
        for name in ("rel_epsilon", "abs_epsilon", "tolerance"):
            validation.check_float(name, getattr(self, name), at_least=0.0)
        check_int("max_iterations", self.max_iterations, minimum=1)
        check_int("order", self.order, minimum=2)
        check_bool("disable_tf32", self.disable_tf32)


@dataclass(kw_only=True)
class WarmStartedEigenConfig(RootInvConfig):
    """Root from an eigendecomposition warm-started at the factor's previous eigenvectors.

    The root is :class:`EigenConfig`'s (same shift, ridge, eigenvalue floor or pseudo-inverse);
    only the eigendecomposition differs. The first one of a factor is a full ``eigh``; later
    ones start from the previous eigenvectors ``Q`` (kept in the optimizer state): eigenvalues
    ``diag(Q^T A Q)``, accepted when the estimated error of the root is at most ``tolerance``,
    else ``Q <- qr(A Q).Q`` and check again, at most ``max_iterations`` times, then a full
    ``eigh`` (the fallback). The estimate (``matrix_roots.root_error_estimate``) is the
    first-order (Daleckii-Krein) relative error of the search directions ``X g`` for gradients
    distributed like the factor, from the off-diagonal part of ``Q^T A Q``. An accepted basis
    is kept as it is, so the error drifts up to the tolerance, then falls back.

    Measured on float32 factors ``F <- 0.95 F + 0.05 G G^T`` (512 x 512, Gaussian gradients
    plus a rank-32 drift, steps 20 and 30), direction error against the float64 ``eigh`` root:
    from last step's basis 0.95-1.16 % (0.60-0.71 % after one QR iteration), from the basis of
    10 steps ago 2.7-3.6 % (1.7-2.1 % after one). The stale root that the default schedule
    applies between recomputations errs as much (lag 1: 0.97-1.19 %, lag 10: 3.0-4.3 %), so a
    root within a few percent at every recomputation is no worse than that schedule. The
    estimate was within 4 % of the actual error (``warm_started_roots_test.py``). On the 2-core
    EPYC (one thread, n = 768) a QR iteration costs more than an ``eigh`` (~100 vs ~72 ms);
    on a GPU it costs far less.

    Args:
        max_iterations: QR iterations before the ``eigh`` fallback, an int >= 0.
        tolerance: accepted relative root error estimate (Frobenius), finite and >= 0;
            0 falls back every time (an ``eigh`` root with extra work).
        retry_double_precision: when ``eigh`` fails in the factor's precision, retry in float64.
        rank_deficient_stability_config: as for :class:`EigenConfig`.
    """

    max_iterations: int = 1
    tolerance: float = 0.05
    retry_double_precision: bool = True
    rank_deficient_stability_config: RankDeficientStabilityConfig = field(
        default_factory=PerturbationConfig
    )

    def __post_init__(self) -> None:
        check_int("max_iterations", self.max_iterations, minimum=0)
        check_optional_tolerance("tolerance", self.tolerance, allow_none=False)
        check_bool("retry_double_precision", self.retry_double_precision)
        _check_rank_deficient_stability_config(self.rank_deficient_stability_config)


DefaultEigenConfig = EigenConfig()


# ---------------------------------------------------------------------------------------------
# Orthogonalization (spectral descent)
# ---------------------------------------------------------------------------------------------


def _unit_scale_by_dims(d_in: int, d_out: int) -> float:
    """The default ``scale_by_dims_fn``: no scaling."""
    return 1.0


@dataclass(init=False)
class OrthogonalizationConfig(MatrixFunctionConfig):
    """Base of the ways to map a matrix ``G = U S V^T`` to (approximately) ``U V^T``.

    Args:
        scale_by_dims_fn: ``f(d_in, d_out) -> float``; the result is multiplied by it, where a
            ``(rows, cols)`` block has ``d_out = rows`` and ``d_in = cols`` (``nn.Linear``
            weights). Muon's ``sqrt(max(1, d_out / d_in))`` is one choice. Use a named function
            (lambdas do not pickle).
    """

    scale_by_dims_fn: Callable[[int, int], float] = _unit_scale_by_dims

    def _check_scale_by_dims_fn(self) -> None:
        if not callable(self.scale_by_dims_fn):
            raise ValueError(f"scale_by_dims_fn must be callable, got {self.scale_by_dims_fn!r}")


@dataclass(kw_only=True)
class SVDOrthogonalizationConfig(OrthogonalizationConfig):
    """Exact ``U V^T`` from a reduced SVD (slow on GPU; the reference for Newton-Schulz).

    Args:
        scale_by_nuclear_norm: multiply by ``sum(S)`` (the steepest-descent step under the
            spectral norm) instead of returning the unit-spectral-norm ``U V^T``.
    """

    scale_by_nuclear_norm: bool = False

    def __post_init__(self) -> None:
        self._check_scale_by_dims_fn()
        check_bool("scale_by_nuclear_norm", self.scale_by_nuclear_norm)


@dataclass(kw_only=True)
class NewtonSchulzOrthogonalizationConfig(OrthogonalizationConfig):
    """Approximate ``U V^T`` by the quintic Newton-Schulz iteration (matmuls only).

    ``X_0 = G / ||G||_F``, then ``num_iterations`` times ``X <- a X + b (X X^T) X + c (X X^T)^2 X``
    (on the wide orientation, so ``X X^T`` is the smaller Gram matrix). The default Muon
    coefficients do not converge to 1: they push every singular value into roughly
    ``[0.7, 1.2]`` fast, which is what training needs.

    Args:
        num_iterations: iterations, >= 1.
        coefficients: ``(a, b, c)`` of the quintic polynomial.
        compute_dtype: dtype of the iteration's matmuls. None (default): the block's dtype, as
            the reference library computes it (same numbers). ``"auto"``: bfloat16 for float32
            blocks where bf16 matmuls are fast (CUDA with bf16, or a CPU whose probe finds them
            faster), else the block dtype; the trainer's Muon uses it. See
            ``resolve_newton_schulz_dtype``.
    """

    num_iterations: int = 5
    coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    compute_dtype: torch.dtype | str | None = None

    def __post_init__(self) -> None:
        self._check_scale_by_dims_fn()
        check_int("num_iterations", self.num_iterations, minimum=1)
        if not (
            self.compute_dtype is None
            or self.compute_dtype == "auto"
            or self.compute_dtype in FLOAT_DTYPES
        ):
            raise ValueError(
                f"compute_dtype must be None, 'auto' or one of {FLOAT_DTYPES}, got "
                f"{self.compute_dtype!r}"
            )
        coefficients = self.coefficients
        if not (
            isinstance(coefficients, (tuple, list))
            and len(coefficients) == 3
            and all(validation.is_real(c) and math.isfinite(c) for c in coefficients)
        ):
            raise ValueError(
                f"coefficients must be three finite floats (a, b, c), got {coefficients!r}"
            )
        self.coefficients = tuple(float(c) for c in coefficients)


DefaultNewtonSchulzOrthogonalizationConfig = NewtonSchulzOrthogonalizationConfig()
