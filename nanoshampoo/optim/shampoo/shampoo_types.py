"""Configuration types of Distributed Shampoo: preconditioners, root solvers, distributors.

Every config is a small dataclass validated in ``__post_init__``: a bad value raises
``ValueError`` whose message starts with the field name. Names and defaults follow the
well-known PyTorch Distributed Shampoo library, so scripts port by changing the import line.

Example:
    >>> config = RootInvShampooPreconditionerConfig(
    ...     amortized_computation_config=EigenConfig(),
    ...     factor_matrix_dtype=torch.float64,
    ...     inverse_exponent_override={1: 0.25},  # vectors: (A + eps I)^(-1/4) instead of -1/2
    ... )
    >>> AdamPreconditionerConfig(beta2=2.0)
    Traceback (most recent call last):
    ...
    ValueError: beta2 must be in (0.0, 1.0], got 2.0
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanoshampoo.optim.errors import NonFiniteGradientError  # noqa: F401 - re-exported
from nanoshampoo.optim.shampoo.utils.abstract_dataclass import AbstractDataclass

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class WeightDecayType(enum.Enum):
    """Where weight decay enters the step.

    ``L2``: ``G <- G + wd * W`` before statistics and preconditioning (classic L2 penalty).
    ``DECOUPLED``: ``P <- P + wd * W`` after preconditioning, scaled by lr with the update (AdamW).
    """

    L2 = enum.auto()
    DECOUPLED = enum.auto()


def _check_open_closed_unit(name: str, value: float, low_open: bool, high_open: bool) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` lies in the given unit interval."""
    low_ok = value > 0.0 if low_open else value >= 0.0
    high_ok = value < 1.0 if high_open else value <= 1.0
    if not (isinstance(value, (int, float)) and low_ok and high_ok):
        interval = f"{'(' if low_open else '['}0.0, 1.0{')' if high_open else ']'}"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and value > 0.0):
        raise ValueError(f"{name} must be > 0.0, got {value!r}")


def check_ema_storage_dtype(name: str, dtype: object, weight: float, weight_name: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``dtype`` (None or a float dtype) can hold an
    EMA ``V <- (1 - w) V + w X`` whose new-sample weight is ``weight``.

    Rounding to storage every step stalls the EMA when ``w < finfo(dtype).eps``: the change
    ``w (X - V)`` is then below half an ulp of ``V`` unless ``X`` is far from ``V`` (bfloat16:
    ``w >= 2^-7``, i.e. ``beta <= 0.992``). ``weight = 0`` means an accumulating sum
    (AdaGrad), which stalls too once ``t > 1 / eps``. Only dtypes narrower than float32 are
    checked.
    """
    if dtype is None:
        return
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be None or one of {FLOAT_DTYPES}, got {dtype!r}")
    eps = torch.finfo(dtype).eps
    # float32/float64 storage is what the computation uses anyway: never refused.
    if eps > torch.finfo(torch.float32).eps and not weight >= eps:
        raise ValueError(
            f"{name} {dtype} cannot hold this EMA: {weight_name} {weight!r} must be >= "
            f"finfo({dtype}).eps = {eps} (each step's change would round away)"
        )


# ---------------------------------------------------------------------------------------------
# Preconditioners (the simple ones are also grafting configs)
# ---------------------------------------------------------------------------------------------


@dataclass(init=False)
class PreconditionerConfig(AbstractDataclass):
    """Base of every ``preconditioner_config`` / ``grafting_config``."""


@dataclass
class SGDPreconditionerConfig(PreconditionerConfig):
    """Identity preconditioner: the search direction is the (filtered) gradient."""


@dataclass
class AdaGradPreconditionerConfig(PreconditionerConfig):
    """Diagonal AdaGrad: ``V <- V + G^2``, ``P = G / (sqrt(V) + epsilon)``.

    Args:
        epsilon: added to ``sqrt(V)``; > 0.
        second_moment_dtype: storage dtype of ``V``; None: the block's computation dtype. A
            sum rounded to a narrow dtype stalls, so only float32/float64 are accepted here.
    """

    epsilon: float = 1e-10
    second_moment_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        _check_positive("epsilon", self.epsilon)
        check_ema_storage_dtype("second_moment_dtype", self.second_moment_dtype, 0.0, "1 - beta2")


@dataclass
class RMSpropPreconditionerConfig(PreconditionerConfig):
    """Diagonal RMSprop: ``V <- b2 V + (1 - b2) G^2``, ``P = G / (sqrt(V) + epsilon)``.

    No bias correction of ``V`` (that is what distinguishes it from Adam).

    Args:
        beta2: EMA factor of the second moment, in (0, 1].
        epsilon: added to ``sqrt(V)``; > 0.
        second_moment_dtype: storage dtype of ``V``; None: the block's computation dtype.
            A narrow dtype needs ``1 - beta2 >= finfo(dtype).eps`` (bfloat16: beta2 <= 0.992).
    """

    beta2: float = 0.99
    epsilon: float = 1e-10
    second_moment_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        _check_open_closed_unit("beta2", self.beta2, low_open=True, high_open=False)
        _check_positive("epsilon", self.epsilon)
        check_ema_storage_dtype(
            "second_moment_dtype", self.second_moment_dtype, 1.0 - self.beta2, "1 - beta2"
        )


@dataclass
class AdamPreconditionerConfig(PreconditionerConfig):
    """Diagonal Adam: ``V <- b2 V + (1 - b2) G^2``, ``P = G / (sqrt(V / (1 - b2^t)) + epsilon)``.

    Args:
        beta2: EMA factor of the second moment, in (0, 1].
        epsilon: added to the bias-corrected ``sqrt(V)``; > 0.
        second_moment_dtype: storage dtype of ``V``; None: the block's computation dtype.
            A narrow dtype needs ``1 - beta2 >= finfo(dtype).eps`` (bfloat16: beta2 <= 0.992).
    """

    beta2: float = 0.999
    epsilon: float = 1e-10
    second_moment_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        _check_open_closed_unit("beta2", self.beta2, low_open=True, high_open=False)
        _check_positive("epsilon", self.epsilon)
        check_ema_storage_dtype(
            "second_moment_dtype", self.second_moment_dtype, 1.0 - self.beta2, "1 - beta2"
        )


GRAFTING_CONFIG_TYPES = (
    SGDPreconditionerConfig,
    AdaGradPreconditionerConfig,
    RMSpropPreconditionerConfig,
    AdamPreconditionerConfig,
)


# ---------------------------------------------------------------------------------------------
# Amortized root computations
# ---------------------------------------------------------------------------------------------


def _check_optional_tolerance(name: str, value: object, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not (
        isinstance(value, (int, float)) and math.isfinite(value) and value >= 0.0
    ):
        expected = "a finite float >= 0" + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _check_rank_deficient_stability_config(value: object) -> None:
    if not isinstance(value, RankDeficientStabilityConfig):
        raise ValueError(
            "rank_deficient_stability_config must be a PerturbationConfig or PseudoInverseConfig, "
            f"got {value!r}"
        )


@dataclass(init=False)
class AmortizedComputationConfig(AbstractDataclass):
    """Base of the configs of the expensive, amortized computation of a preconditioner."""


@dataclass(init=False)
class RankDeficientStabilityConfig(AbstractDataclass):
    """Base of the ways a root or eigenbasis computation treats a rank-deficient factor.

    Kronecker factors are often singular (a vector block, a wide block ``n > m``, the first
    steps), and in float32 their numerically-zero eigenvalues are rounding noise of size
    ``~ n * u * lambda_max`` (``u`` the unit roundoff), of either sign.
    """


@dataclass
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
        if not isinstance(self.perturb_before_computation, bool):
            raise ValueError(
                "perturb_before_computation must be a bool, got "
                f"{self.perturb_before_computation!r}"
            )
        _check_optional_tolerance("eigenvalue_floor_rtol", self.eigenvalue_floor_rtol)


DefaultPerturbationConfig = PerturbationConfig()


@dataclass
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
        _check_optional_tolerance("rank_atol", self.rank_atol, allow_none=False)
        _check_optional_tolerance("rank_rtol", self.rank_rtol)


@dataclass(init=False)
class RootInvConfig(AmortizedComputationConfig):
    """Base of the solvers of ``X = (A + eps I)^(-e)`` for a symmetric PSD ``A``."""


@dataclass
class EigenConfig(RootInvConfig):
    """Root by symmetric eigendecomposition (``torch.linalg.eigh``, batched by size).

    ``A`` is PSD in exact arithmetic, but rounding makes its tiny eigenvalues noise of either
    sign; ``rank_deficient_stability_config`` says how they are treated.

    Args:
        retry_double_precision: when ``eigh`` fails in the factor's precision, retry in float64.
        rank_deficient_stability_config: ``PerturbationConfig`` (default) or
            ``PseudoInverseConfig`` (then the optimizer's ``epsilon`` must be 0).
    """

    retry_double_precision: bool = True
    rank_deficient_stability_config: RankDeficientStabilityConfig = field(
        default_factory=PerturbationConfig
    )

    def __post_init__(self) -> None:
        if not isinstance(self.retry_double_precision, bool):
            raise ValueError(
                f"retry_double_precision must be a bool, got {self.retry_double_precision!r}"
            )
        _check_rank_deficient_stability_config(self.rank_deficient_stability_config)


@dataclass
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
        if isinstance(self.max_iterations, bool) or not isinstance(self.max_iterations, int):
            raise ValueError(f"max_iterations must be an int >= 1, got {self.max_iterations!r}")
        if self.max_iterations < 1:
            raise ValueError(f"max_iterations must be an int >= 1, got {self.max_iterations!r}")
        if not (isinstance(self.tolerance, (int, float)) and self.tolerance >= 0.0):
            raise ValueError(f"tolerance must be >= 0.0, got {self.tolerance!r}")


@dataclass
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
        if isinstance(self.max_iterations, bool) or not isinstance(self.max_iterations, int) or (
            self.max_iterations < 0
        ):
            raise ValueError(f"max_iterations must be an int >= 0, got {self.max_iterations!r}")
        _check_optional_tolerance("tolerance", self.tolerance, allow_none=False)
        if not isinstance(self.retry_double_precision, bool):
            raise ValueError(
                f"retry_double_precision must be a bool, got {self.retry_double_precision!r}"
            )
        _check_rank_deficient_stability_config(self.rank_deficient_stability_config)


DefaultEigenConfig = EigenConfig()


# ---------------------------------------------------------------------------------------------
# Shampoo
# ---------------------------------------------------------------------------------------------


@dataclass(init=False)
class ShampooPreconditionerConfig(PreconditionerConfig):
    """Fields shared by the Kronecker-factored (Shampoo) preconditioners.

    Args:
        amortized_computation_config: root solver (``EigenConfig``, ``WarmStartedEigenConfig``
            or ``CoupledNewtonConfig``).
        factor_matrix_dtype: storage dtype of the factor matrices (a float dtype).
        inv_factor_matrix_dtype: storage dtype of the roots (the inverse factor matrices);
            None: the block's computation dtype. A narrower dtype (e.g. ``torch.bfloat16``)
            halves their memory; they are cast to the block dtype when applied, and the root's
            eigenvalue floor is relative to the least precise of this and the factor dtype.
        inverse_exponent_override: ``{order: e}`` or ``{order: {dim: e}}``; the root of dim ``dim``
            of a block of order ``order`` becomes ``(A + eps I)^(-e)``. ``e = 0`` leaves that dim
            unpreconditioned (no factor is kept). Unlisted dims use ``1 / (2 * order)``.
        num_tolerated_failed_amortized_computations: consecutive failed root computations of one
            factor that are tolerated (the previous root is kept); one more raises.
        large_factor_dim: factors of at least this size get their root less often (0: off, the
            default). An int >= 0.
        large_factor_frequency_multiplier: those factors' roots are recomputed every
            ``precondition_frequency * multiplier`` steps (at steps that are multiples of it,
            and at the first preconditioned step with all the others); with ``amortize_roots``
            they are spread over ``precondition_frequency * multiplier`` shares instead of
            ``precondition_frequency``. An int >= 1; 1: the plain schedule.
        pack_factor_matrices: keep only the lower triangle of each (symmetric) factor matrix,
            half the factors' bytes, unpacked to full matrices for each use; the update and the
            roots are the same numbers (``eigh`` reads one triangle). The state dict then holds
            ``factor_matrices`` as ``n (n + 1) / 2`` vectors in ``torch.tril_indices`` order.
            Measured cost on the GPT-small bench: README "Performance of a Shampoo step".
    """

    amortized_computation_config: RootInvConfig = field(default_factory=EigenConfig)
    factor_matrix_dtype: torch.dtype = torch.float32
    inverse_exponent_override: dict[int, float | dict[int, float]] = field(default_factory=dict)
    num_tolerated_failed_amortized_computations: int = 3
    inv_factor_matrix_dtype: torch.dtype | None = None
    large_factor_dim: int = 0
    large_factor_frequency_multiplier: int = 1
    pack_factor_matrices: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.amortized_computation_config, RootInvConfig):
            raise ValueError(
                "amortized_computation_config must be an EigenConfig, WarmStartedEigenConfig or "
                "CoupledNewtonConfig, got "
                f"{self.amortized_computation_config!r}"
            )
        if self.factor_matrix_dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"factor_matrix_dtype must be one of {FLOAT_DTYPES}, got {self.factor_matrix_dtype!r}"
            )
        if self.inv_factor_matrix_dtype is not None and self.inv_factor_matrix_dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"inv_factor_matrix_dtype must be None or one of {FLOAT_DTYPES}, got "
                f"{self.inv_factor_matrix_dtype!r}"
            )
        tolerated = self.num_tolerated_failed_amortized_computations
        if isinstance(tolerated, bool) or not isinstance(tolerated, int) or tolerated < 0:
            raise ValueError(
                f"num_tolerated_failed_amortized_computations must be an int >= 0, got {tolerated!r}"
            )
        self._validate_inverse_exponent_override()
        for name, minimum in (("large_factor_dim", 0), ("large_factor_frequency_multiplier", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        if not isinstance(self.pack_factor_matrices, bool):
            raise ValueError(
                f"pack_factor_matrices must be a bool, got {self.pack_factor_matrices!r}"
            )

    def large_factor_schedule(self) -> tuple[int, int]:
        """``(large_factor_dim, multiplier)``, or ``(0, 1)`` when either leaves it off."""
        if self.large_factor_dim == 0 or self.large_factor_frequency_multiplier == 1:
            return 0, 1
        return self.large_factor_dim, self.large_factor_frequency_multiplier

    def _validate_inverse_exponent_override(self) -> None:
        override = self.inverse_exponent_override
        name = "inverse_exponent_override"
        if not isinstance(override, dict):
            raise ValueError(f"{name} must be a dict, got {override!r}")
        coupled = isinstance(self.amortized_computation_config, CoupledNewtonConfig)
        for order, value in override.items():
            if isinstance(order, bool) or not isinstance(order, int) or order < 1:
                raise ValueError(f"{name} keys must be block orders (ints >= 1), got {order!r}")
            per_dim = value if isinstance(value, dict) else {None: value}
            for dim, exponent in per_dim.items():
                if dim is not None and (
                    isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < order
                ):
                    raise ValueError(
                        f"{name}[{order}] keys must be dims in [0, {order}), got {dim!r}"
                    )
                if isinstance(exponent, bool) or not isinstance(exponent, (int, float)):
                    raise ValueError(f"{name}[{order}] exponents must be floats, got {exponent!r}")
                if not (exponent >= 0.0 and math.isfinite(exponent)):
                    raise ValueError(
                        f"{name}[{order}] exponents must be finite and >= 0, got {exponent!r}"
                    )
                if coupled and exponent > 0.0 and abs(1.0 / exponent - round(1.0 / exponent)) > 1e-9:
                    raise ValueError(
                        f"{name}[{order}] exponent {exponent!r}: CoupledNewtonConfig needs "
                        "1 / exponent to be an integer root order"
                    )

    def inverse_exponent(self, order: int, dim: int) -> float:
        """The root exponent ``e`` of dim ``dim`` of an order-``order`` block (``1/(2k)`` default)."""
        value = self.inverse_exponent_override.get(order, {})
        if isinstance(value, dict):
            return float(value.get(dim, 1.0 / (2 * order)))
        return float(value)


@dataclass
class RootInvShampooPreconditionerConfig(ShampooPreconditionerConfig):
    """Classic Shampoo: the search direction of a block is ``X_1 x_1 ... X_k x_k G``.

    ``X_i = (F_i / bc2 + eps I)^(-e_i)``, recomputed every ``precondition_frequency`` steps.
    Fields: see :class:`ShampooPreconditionerConfig`.
    """


DefaultShampooConfig = RootInvShampooPreconditionerConfig()


# ---------------------------------------------------------------------------------------------
# Eigenbasis computations (eigenvalue-corrected Shampoo)
# ---------------------------------------------------------------------------------------------


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(init=False)
class EigendecompositionConfig(AmortizedComputationConfig):
    """Base of the solvers of the eigenbasis (eigenvectors) of a symmetric PSD factor matrix."""


@dataclass
class EighEigendecompositionConfig(EigendecompositionConfig):
    """Eigenbasis by ``torch.linalg.eigh`` (batched by size) at every recomputation.

    Args:
        retry_double_precision: when ``eigh`` fails in the factor's precision, retry in float64.
        rank_deficient_stability_config: ``PerturbationConfig`` (default) or
            ``PseudoInverseConfig`` (then the optimizer's ``epsilon`` must be 0); see
            :class:`EigenvalueCorrectedShampooPreconditionerConfig` for what each does there.
    """

    retry_double_precision: bool = True
    rank_deficient_stability_config: RankDeficientStabilityConfig = field(
        default_factory=PerturbationConfig
    )

    def __post_init__(self) -> None:
        _check_bool("retry_double_precision", self.retry_double_precision)
        _check_rank_deficient_stability_config(self.rank_deficient_stability_config)


@dataclass
class QREigendecompositionConfig(EigendecompositionConfig):
    """Eigenbasis by QR (orthogonal) iterations warm-started from the previous eigenbasis.

    The first computation of a factor (no previous basis yet) is a full ``eigh``; later ones
    run ``Q <- qr(F Q)`` while ``||B - diag(B)||_F > tolerance * ||B||_F`` with ``B = Q^T F Q``,
    at most ``max_iterations`` times (zero iterations when the previous basis is still good).
    Only for :class:`EigenvalueCorrectedShampooPreconditionerConfig`: root-inverse Shampoo
    needs eigenvalues as well, so its ``amortized_computation_config`` is a ``RootInvConfig``
    (its warm-started counterpart: :class:`WarmStartedEigenConfig`).

    Args:
        max_iterations: iteration cap per recomputation, >= 1.
        tolerance: relative off-diagonal mass accepted as converged, in [0, 1].
        retry_double_precision: the first (``eigh``) computation retries in float64 on failure.
        rank_deficient_stability_config: as for :class:`EighEigendecompositionConfig`.
    """

    max_iterations: int = 1
    tolerance: float = 0.01
    retry_double_precision: bool = True
    rank_deficient_stability_config: RankDeficientStabilityConfig = field(
        default_factory=PerturbationConfig
    )

    def __post_init__(self) -> None:
        _check_int("max_iterations", self.max_iterations, minimum=1)
        if isinstance(self.tolerance, bool) or not (
            isinstance(self.tolerance, (int, float)) and 0.0 <= self.tolerance <= 1.0
        ):
            raise ValueError(f"tolerance must be in [0.0, 1.0], got {self.tolerance!r}")
        _check_bool("retry_double_precision", self.retry_double_precision)
        _check_rank_deficient_stability_config(self.rank_deficient_stability_config)


DefaultEigendecompositionConfig = EighEigendecompositionConfig()


@dataclass
class EigenvalueCorrectedShampooPreconditionerConfig(PreconditionerConfig):
    """Eigenvalue-corrected Shampoo (SOAP): Adam's second moment in the factors' eigenbasis.

    Per block of order ``k`` with factors ``F_i`` (updated like Shampoo's) and their eigenbases
    ``Q_i`` (recomputed on the amortized schedule; identity before the first computation):
    rotate ``R(X) = X x_1 Q_1^T ... x_k Q_k^T``; every step
    ``D <- b2 D + w R(G)^2`` (the corrected eigenvalues, in the basis in force for this step's
    search direction); ``P = R^-1(R(Gbar) / ((D / bc2)^e + eps))`` with ``e = 1/2`` by default.

    Args:
        amortized_computation_config: eigenbasis solver (``EighEigendecompositionConfig`` or
            ``QREigendecompositionConfig``). Its ``rank_deficient_stability_config`` acts twice:
            eigenvectors of numerically-zero factor eigenvalues (tolerance as for root-inverse
            Shampoo) get a canonical basis of their span, so the rotation does not depend on
            rounding; and corrected eigenvalues below ``rtol * max(D / bc2)`` of their block
            (``rtol`` = ``eigenvalue_floor_rtol``, default ``finfo(dtype).eps``: below float32's
            resolution of ``D``) are raised to it (``PerturbationConfig``) or their coordinates
            get a zero update (``PseudoInverseConfig``, ``rank_rtol`` with the same default).
            A zero ``eigenvalue_floor_rtol`` turns both off (the plain algorithm).
        num_tolerated_failed_amortized_computations: consecutive failed eigenbasis computations of
            one factor that are tolerated (the previous basis is kept); one more raises.
        factor_matrix_dtype: storage dtype of the factor matrices.
        ignored_basis_change_dims: ``{order: [dims]}``: those dims of blocks of that order are not
            rotated (no factor is kept), like a zero exponent in root-inverse Shampoo.
        inverse_exponent_override: ``{order: e}`` with ``e > 0``: the exponent applied to the
            corrected eigenvalues of blocks of that order (default ``1/2``, Adam's square root).
        factor_matrix_eigenvectors_dtype: storage dtype of the eigenbases.
        corrected_eigenvalues_dtype: storage dtype of the corrected eigenvalues.
    """

    amortized_computation_config: EigendecompositionConfig = field(
        default_factory=EighEigendecompositionConfig
    )
    num_tolerated_failed_amortized_computations: int = 3
    factor_matrix_dtype: torch.dtype = torch.float32
    ignored_basis_change_dims: dict[int, list[int]] = field(default_factory=dict)
    inverse_exponent_override: dict[int, float] = field(default_factory=dict)
    factor_matrix_eigenvectors_dtype: torch.dtype = torch.float32
    corrected_eigenvalues_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not isinstance(self.amortized_computation_config, EigendecompositionConfig):
            raise ValueError(
                "amortized_computation_config must be an EighEigendecompositionConfig or "
                f"QREigendecompositionConfig, got {self.amortized_computation_config!r}"
            )
        _check_int(
            "num_tolerated_failed_amortized_computations",
            self.num_tolerated_failed_amortized_computations,
            minimum=0,
        )
        for name in ("factor_matrix_dtype", "factor_matrix_eigenvectors_dtype", "corrected_eigenvalues_dtype"):
            if getattr(self, name) not in FLOAT_DTYPES:
                raise ValueError(f"{name} must be one of {FLOAT_DTYPES}, got {getattr(self, name)!r}")
        self._validate_ignored_basis_change_dims()
        override = self.inverse_exponent_override
        if not isinstance(override, dict):
            raise ValueError(f"inverse_exponent_override must be a dict, got {override!r}")
        for order, exponent in override.items():
            _check_int("inverse_exponent_override keys", order, minimum=0)
            if isinstance(exponent, bool) or not (
                isinstance(exponent, (int, float)) and exponent > 0.0 and math.isfinite(exponent)
            ):
                raise ValueError(
                    f"inverse_exponent_override[{order}] must be a finite float > 0, got {exponent!r}"
                )

    def _validate_ignored_basis_change_dims(self) -> None:
        name = "ignored_basis_change_dims"
        ignored = self.ignored_basis_change_dims
        if not isinstance(ignored, dict):
            raise ValueError(f"{name} must be a dict, got {ignored!r}")
        for order, dims in ignored.items():
            _check_int(f"{name} keys", order, minimum=0)
            if not isinstance(dims, (list, tuple)):
                raise ValueError(f"{name}[{order}] must be a list of dims, got {dims!r}")
            for dim in dims:
                if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim <= max(order - 1, 0):
                    raise ValueError(
                        f"{name}[{order}] dims must be ints in [0, {max(order - 1, 0)}], got {dim!r}"
                    )
            if len(set(dims)) != len(dims):
                raise ValueError(f"{name}[{order}] has duplicate dims: {dims!r}")

    def corrected_eigenvalue_exponent(self, order: int) -> float:
        """The exponent ``e`` of ``(D / bc2)^e`` for an order-``order`` block (default ``1/2``)."""
        return float(self.inverse_exponent_override.get(order, 0.5))

    def rotates(self, order: int, dim: int) -> bool:
        """Whether dim ``dim`` of an order-``order`` block is rotated into its factor's eigenbasis."""
        return dim not in self.ignored_basis_change_dims.get(order, ())


DefaultEigenvalueCorrectedShampooConfig = EigenvalueCorrectedShampooPreconditionerConfig()
DefaultSOAPConfig = EigenvalueCorrectedShampooPreconditionerConfig(
    amortized_computation_config=QREigendecompositionConfig()
)


# ---------------------------------------------------------------------------------------------
# Spectral descent (Muon)
# ---------------------------------------------------------------------------------------------


def _unit_scale_by_dims(d_in: int, d_out: int) -> float:
    """The default ``scale_by_dims_fn``: no scaling."""
    return 1.0


@dataclass(init=False)
class OrthogonalizationConfig(AbstractDataclass):
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


@dataclass
class SVDOrthogonalizationConfig(OrthogonalizationConfig):
    """Exact ``U V^T`` from a reduced SVD (slow on GPU; the reference for Newton-Schulz).

    Args:
        scale_by_nuclear_norm: multiply by ``sum(S)`` (the steepest-descent step under the
            spectral norm) instead of returning the unit-spectral-norm ``U V^T``.
    """

    scale_by_nuclear_norm: bool = False

    def __post_init__(self) -> None:
        self._check_scale_by_dims_fn()
        _check_bool("scale_by_nuclear_norm", self.scale_by_nuclear_norm)


@dataclass
class NewtonSchulzOrthogonalizationConfig(OrthogonalizationConfig):
    """Approximate ``U V^T`` by the quintic Newton-Schulz iteration (matmuls only).

    ``X_0 = G / ||G||_F``, then ``num_iterations`` times ``X <- a X + b (X X^T) X + c (X X^T)^2 X``
    (on the wide orientation, so ``X X^T`` is the smaller Gram matrix). The default Muon
    coefficients do not converge to 1: they push every singular value into roughly
    ``[0.7, 1.2]`` fast, which is what training needs.

    Args:
        num_iterations: iterations, >= 1.
        coefficients: ``(a, b, c)`` of the quintic polynomial.
        compute_dtype: dtype of the iteration's matmuls; None (automatic): bfloat16 for
            float32 blocks where bf16 matmuls are fast (CUDA with bf16, or a CPU whose probe
            finds them faster), else the block dtype. See ``resolve_newton_schulz_dtype``.
    """

    num_iterations: int = 5
    coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    compute_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        self._check_scale_by_dims_fn()
        _check_int("num_iterations", self.num_iterations, minimum=1)
        if self.compute_dtype is not None and self.compute_dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"compute_dtype must be None or one of {FLOAT_DTYPES}, got {self.compute_dtype!r}"
            )
        coefficients = self.coefficients
        if not (
            isinstance(coefficients, (tuple, list))
            and len(coefficients) == 3
            and all(
                isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)
                for c in coefficients
            )
        ):
            raise ValueError(f"coefficients must be three finite floats (a, b, c), got {coefficients!r}")
        self.coefficients = tuple(float(c) for c in coefficients)


DefaultNewtonSchulzOrthogonalizationConfig = NewtonSchulzOrthogonalizationConfig()


@dataclass
class SpectralDescentPreconditionerConfig(PreconditionerConfig):
    """Spectral descent (Muon): the search direction of a 2-D block is ``orth(Gbar) ~ U V^T``.

    For blocks of >= 2 dims: a ``(d0, d1, ..., dk)`` block is orthogonalized as the
    ``(d0, d1 * ... * dk)`` matrix (as the reference library's merge to 2 dims does). A vector
    block (choose ``max_preconditioner_dim``, or put vectors in another param group) makes the
    optimizer raise ``ValueError`` naming ``preconditioner_config``. Stateless.

    Args:
        orthogonalization_config: ``NewtonSchulzOrthogonalizationConfig`` (default) or
            ``SVDOrthogonalizationConfig``.
    """

    orthogonalization_config: OrthogonalizationConfig = field(
        default_factory=NewtonSchulzOrthogonalizationConfig
    )

    def __post_init__(self) -> None:
        if not isinstance(self.orthogonalization_config, OrthogonalizationConfig):
            raise ValueError(
                "orthogonalization_config must be a NewtonSchulzOrthogonalizationConfig or "
                f"SVDOrthogonalizationConfig, got {self.orthogonalization_config!r}"
            )


DefaultSpectralDescentPreconditionerConfig = SpectralDescentPreconditionerConfig()


# ---------------------------------------------------------------------------------------------
# Distributors
# ---------------------------------------------------------------------------------------------


@dataclass(init=False)
class DistributedConfig(AbstractDataclass):
    """Base of the configs choosing who computes which block and how results travel."""


@dataclass
class SingleDeviceDistributedConfig(DistributedConfig):
    """Every process computes every block (single GPU, CPU, or replicated work under DDP)."""


@dataclass
class DDPDistributedConfig(DistributedConfig):
    """ZeRO-1-style DDP: blocks are assigned to ranks; results are exchanged by collectives.

    Args:
        communication_dtype: dtype the updates (or parameters) travel in; a float dtype.
        num_trainers_per_group: ranks sharing the blocks of one group; ``-1`` = world size.
        communicate_params: send updated parameters instead of updates ``-lr * P``.
    """

    communication_dtype: torch.dtype = torch.float32
    num_trainers_per_group: int = -1
    communicate_params: bool = False

    def __post_init__(self) -> None:
        if self.communication_dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"communication_dtype must be one of {FLOAT_DTYPES}, got {self.communication_dtype!r}"
            )
        trainers = self.num_trainers_per_group
        if isinstance(trainers, bool) or not isinstance(trainers, int) or not (
            trainers == -1 or trainers >= 1
        ):
            raise ValueError(f"num_trainers_per_group must be -1 or an int >= 1, got {trainers!r}")
        if not isinstance(self.communicate_params, bool):
            raise ValueError(f"communicate_params must be a bool, got {self.communicate_params!r}")


DefaultSingleDeviceDistributedConfig = SingleDeviceDistributedConfig()


# ---------------------------------------------------------------------------------------------
# Distributors of sharded parameters (FSDP2 ``fully_shard`` and HSDP)
# ---------------------------------------------------------------------------------------------


class FSDPParamAssignmentStrategy(enum.Enum):
    """Which rank computes the Shampoo update of a ``fully_shard`` parameter.

    ``DEFAULT`` (lossy, no communication): every rank preconditions the blocks of its own local
    shard; a block never crosses a shard boundary, so the blocking (and the preconditioner)
    differs from single-device Shampoo wherever a parameter's dim 0 is split.
    ``ROUND_ROBIN`` (lossless): every parameter has one owner rank (load balanced); owners
    receive the full gradient by one ``all_to_all`` per step and send the updated shards back.
    ``REPLICATE`` (lossless, the baseline): all gradients are gathered on every rank and every
    rank computes every block.
    """

    DEFAULT = enum.auto()
    ROUND_ROBIN = enum.auto()
    REPLICATE = enum.auto()


def _check_sharded_exchange_fields(
    config: FullyShardDistributedConfig | HybridShardDistributedConfig,
) -> None:
    if config.communication_dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"communication_dtype must be one of {FLOAT_DTYPES}, got {config.communication_dtype!r}"
        )
    if not isinstance(config.communicate_params, bool):
        raise ValueError(f"communicate_params must be a bool, got {config.communicate_params!r}")


@dataclass
class FullyShardDistributedConfig(DistributedConfig):
    """Shampoo on parameters wrapped by ``torch.distributed.fsdp.fully_shard`` (FSDP2).

    The parameters are ``DTensor``s sharded on dim 0 over a 1-D device mesh; so are their
    gradients (already reduce-scattered by FSDP). See :class:`FSDPParamAssignmentStrategy`.

    Args:
        param_assignment_strategy: who computes which parameter's update.
        communication_dtype: dtype the updates (or updated parameters) travel in from an owner
            back to the shards (``ROUND_ROBIN``); gradients always travel in the parameters'
            dtype. A float dtype.
        communicate_params: send updated parameters instead of updates ``-lr * P`` (as in
            :class:`DDPDistributedConfig`).
    """

    param_assignment_strategy: FSDPParamAssignmentStrategy = FSDPParamAssignmentStrategy.DEFAULT
    communication_dtype: torch.dtype = torch.float32
    communicate_params: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.param_assignment_strategy, FSDPParamAssignmentStrategy):
            raise ValueError(
                "param_assignment_strategy must be an FSDPParamAssignmentStrategy, got "
                f"{self.param_assignment_strategy!r}"
            )
        _check_sharded_exchange_fields(self)


@dataclass
class HybridShardDistributedConfig(DistributedConfig):
    """Shampoo on HSDP parameters: ``fully_shard`` on a 2-D mesh (replicate x shard).

    Within a replica the parameters are handled as under :class:`FullyShardDistributedConfig`
    with ``param_assignment_strategy``; the resulting blocks are split over the replicas the way
    :class:`DDPDistributedConfig` splits them, and the results exchanged by ``all_to_all``.

    Args:
        device_mesh: the 2-D ``DeviceMesh`` of the parameters (dim 0 replicate, dim 1 shard);
            ``None``: the parameters' own mesh.
        communication_dtype: dtype the updates (or parameters) travel in; a float dtype.
        num_trainers_per_group: replicas sharing the blocks; ``-1`` = all replicas (the only
            other accepted value is the replicate dim's size).
        communicate_params: send updated parameters instead of updates ``-lr * P``.
        param_assignment_strategy: the strategy within a replica (shard dim).
    """

    device_mesh: object | None = None
    communication_dtype: torch.dtype = torch.float32
    num_trainers_per_group: int = -1
    communicate_params: bool = False
    param_assignment_strategy: FSDPParamAssignmentStrategy = FSDPParamAssignmentStrategy.DEFAULT

    def __post_init__(self) -> None:
        if self.device_mesh is not None and getattr(self.device_mesh, "ndim", None) != 2:
            raise ValueError(f"device_mesh must be None or a 2-D DeviceMesh, got {self.device_mesh!r}")
        _check_sharded_exchange_fields(self)
        trainers = self.num_trainers_per_group
        if isinstance(trainers, bool) or not isinstance(trainers, int) or not (
            trainers == -1 or trainers >= 1
        ):
            raise ValueError(f"num_trainers_per_group must be -1 or an int >= 1, got {trainers!r}")
        if not isinstance(self.param_assignment_strategy, FSDPParamAssignmentStrategy):
            raise ValueError(
                "param_assignment_strategy must be an FSDPParamAssignmentStrategy, got "
                f"{self.param_assignment_strategy!r}"
            )
