"""Configs of the preconditioners: diagonal (also grafting), Shampoo and SOAP.

Each names the preconditioner a group uses (``preconditioner_config``) or grafts onto
(``grafting_config``); the matrix functions they need are configured by
:mod:`~nanoshampoo.optim.shampoo.preconditioner.matrix_functions_types`, the spectral and sign
descent configs live in :mod:`~nanoshampoo.optim.shampoo.preconditioner.descent_types`. Every config
validates
its fields in ``__post_init__`` (``ValueError`` naming the field).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from nanoshampoo import validation
from nanoshampoo.optim.shampoo.config_checks import (
    FLOAT_DTYPES,
    check_bool,
    check_ema_storage_dtype,
    check_int,
    check_rule,
    refuse,
)
from nanoshampoo.optim.shampoo.preconditioner.matrix_functions_types import (
    CoupledNewtonConfig,
    EigenConfig,
    EigendecompositionConfig,
    EighEigendecompositionConfig,
    PerturbationConfig,
    QREigendecompositionConfig,
    RootInvConfig,
)
from nanoshampoo.optim.shampoo.utils.abstract_dataclass import AbstractDataclass

# ---------------------------------------------------------------------------------------------
# Diagonal preconditioners (also the grafting configs)
# ---------------------------------------------------------------------------------------------


def _check_diagonal_epsilon(epsilon: object) -> None:
    # The reference's rule (> 0); an infinite epsilon would divide every update to zero.
    check_rule(
        "epsilon",
        f"Invalid epsilon value: {epsilon}.",
        epsilon,
        "Must be > 0.0.",
        lambda eps: eps > 0.0,
    )


@dataclass(init=False)
class PreconditionerConfig(AbstractDataclass):
    """Base of every ``preconditioner_config`` / ``grafting_config``."""


@dataclass
class SGDPreconditionerConfig(PreconditionerConfig):
    """Identity preconditioner: the search direction is the (filtered) gradient."""


@dataclass(kw_only=True)
class AdaGradPreconditionerConfig(PreconditionerConfig):
    """Diagonal AdaGrad: ``V <- V + G^2``, ``P = G / (sqrt(V) + epsilon)``.

    The base of the diagonal family, as in the well-known library: RMSprop is AdaGrad with an
    EMA, Adam is RMSprop with bias correction, so ``isinstance(AdamPreconditionerConfig(),
    AdaGradPreconditionerConfig)`` holds. Code that dispatches on them tests the subclasses first.

    Args:
        epsilon: added to ``sqrt(V)``; > 0.
        second_moment_dtype: storage dtype of ``V``; None: the block's computation dtype. A
            sum rounded to a narrow dtype stalls, so only float32/float64 are accepted here.
    """

    epsilon: float = 1e-10
    second_moment_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        _check_diagonal_epsilon(self.epsilon)
        check_ema_storage_dtype("second_moment_dtype", self.second_moment_dtype, 0.0, "1 - beta2")


@dataclass(kw_only=True)
class RMSpropPreconditionerConfig(AdaGradPreconditionerConfig):
    """Diagonal RMSprop: ``V <- b2 V + (1 - b2) G^2``, ``P = G / (sqrt(V) + epsilon)``.

    No bias correction of ``V`` (that is what distinguishes it from Adam).

    Args:
        beta2: EMA factor of the second moment, in (0, 1].
        epsilon: added to ``sqrt(V)``; > 0.
        drop_weighting_factor_on_gsquare: ``V <- b2 V + G^2`` (a discounted sum, not an
            average) and no bias correction, also for Adam (inherited).
        second_moment_dtype: storage dtype of ``V``; None: the block's computation dtype.
            A narrow dtype needs ``1 - beta2 >= finfo(dtype).eps`` (bfloat16: beta2 <= 0.992).
    """

    beta2: float = 0.99
    drop_weighting_factor_on_gsquare: bool = False

    def __post_init__(self) -> None:
        _check_diagonal_epsilon(self.epsilon)
        check_rule(
            "beta2",
            f"Invalid grafting beta2 parameter: {self.beta2}.",
            self.beta2,
            "Must be in (0.0, 1.0].",
            lambda beta2: 0.0 < beta2 <= 1.0,
        )
        check_bool("drop_weighting_factor_on_gsquare", self.drop_weighting_factor_on_gsquare)
        check_ema_storage_dtype(
            "second_moment_dtype", self.second_moment_dtype, 1.0 - self.beta2, "1 - beta2"
        )


@dataclass(kw_only=True)
class AdamPreconditionerConfig(RMSpropPreconditionerConfig):
    """Diagonal Adam: ``V <- b2 V + (1 - b2) G^2``, ``P = G / (sqrt(V / (1 - b2^t)) + epsilon)``.

    Args:
        beta2: EMA factor of the second moment, in (0, 1].
        epsilon: added to the bias-corrected ``sqrt(V)``; > 0.
        second_moment_dtype: storage dtype of ``V``; None: the block's computation dtype.
            A narrow dtype needs ``1 - beta2 >= finfo(dtype).eps`` (bfloat16: beta2 <= 0.992).
    """

    beta2: float = 0.999


GRAFTING_CONFIG_TYPES = (
    SGDPreconditionerConfig,
    AdaGradPreconditionerConfig,
    RMSpropPreconditionerConfig,
    AdamPreconditionerConfig,
)


# ---------------------------------------------------------------------------------------------
# Shampoo
# ---------------------------------------------------------------------------------------------


def _check_num_tolerated(count: object) -> None:
    check_rule(
        "num_tolerated_failed_amortized_computations",
        f"Invalid num_tolerated_failed_amortized_computations value: {count}.",
        count,
        "Must be >= 0.",
        lambda n: n >= 0,
        integer=True,
    )


def _at_least_zero(exponent: object) -> bool:
    return validation.is_real(exponent) and exponent >= 0


def _check_orders(name: str, override: dict[object, object]) -> None:
    """The reference's rule for the keys of ``inverse_exponent_override`` and
    ``ignored_basis_change_dims``: block orders, ints >= 0."""
    if bad := [order for order in override if not (validation.is_int(order) and order >= 0)]:
        raise refuse(
            name, f"Invalid orders in self.{name}={override!r}: {bad}. All orders must be >= 0."
        )


@dataclass(init=False, kw_only=True)
class BaseShampooPreconditionerConfig(PreconditionerConfig):
    """Base of the Kronecker-factored preconditioners: classic Shampoo (a root of each factor,
    :class:`ClassicShampooPreconditionerConfig`) and eigenvalue-corrected Shampoo (an EMA of the
    squared gradient in the factors' eigenbasis,
    :class:`EigenvalueCorrectedShampooPreconditionerConfig`).

    Args:
        drop_weighting_factor_on_gsquare: update the statistics by ``F <- b2 F + G G^T`` (and
            SOAP's ``D <- b2 D + R(G)^2``) instead of ``b2 F + (1 - b2) G G^T``; the sum is then
            not an average, so there is no ``beta2`` bias correction (``bc2 = 1``).
        use_trace_scaling: before each amortized computation, scale the bias-corrected factor
            by ``max(tr F, eps)^(-trace_scaling_exponent)`` (``eps`` the group's epsilon, or the
            dtype's smallest normal number when it is 0), so that factors of every size and
            scale meet the ridge ``eps`` at a similar relative level (arXiv 2506.03595).
        trace_scaling_exponent: in ``(0, 1]`` when ``use_trace_scaling``; 0.5 is ``1/sqrt(tr F)``.
    """

    drop_weighting_factor_on_gsquare: bool = False
    use_trace_scaling: bool = False
    trace_scaling_exponent: float = 0.5

    def __post_init__(self) -> None:
        check_bool("drop_weighting_factor_on_gsquare", self.drop_weighting_factor_on_gsquare)
        check_bool("use_trace_scaling", self.use_trace_scaling)
        exponent = self.trace_scaling_exponent
        if self.use_trace_scaling:
            check_rule(
                "trace_scaling_exponent",
                f"Invalid trace_scaling_exponent value: {exponent}.",
                exponent,
                "Must be in (0.0, 1.0] when use_trace_scaling=True.",
                lambda e: 0.0 < e <= 1.0,
            )
        elif not validation.is_real(exponent):
            # Unused without use_trace_scaling: any number (even NaN) passes, as before.
            raise ValueError(f"trace_scaling_exponent must be a float, got {exponent!r}")

    def statistics_weight(self, beta2: float) -> float:
        """``w`` of ``F <- b2 F + w G G^T``: 1 for a sum (``beta2 = 1`` or dropped), else
        ``1 - b2``."""
        return 1.0 if beta2 == 1.0 or self.drop_weighting_factor_on_gsquare else 1.0 - beta2


@dataclass(init=False, kw_only=True)
class ClassicShampooPreconditionerConfig(BaseShampooPreconditionerConfig):
    """Fields shared by the classic Shampoo preconditioners (a root of each factor matrix).

    Args:
        amortized_computation_config: root solver (``EigenConfig``, ``WarmStartedEigenConfig``
            or ``CoupledNewtonConfig``).
        factor_matrix_dtype: storage dtype of the factor matrices (a float dtype).
        inv_factor_matrix_dtype: storage dtype of the roots (the inverse factor matrices);
            None: the block's computation dtype. A narrower dtype (e.g. ``torch.bfloat16``)
            halves their memory; they are cast to the block dtype when applied, and the root's
            eigenvalue floor is relative to the least precise of this and the factor dtype.
        precondition_dtype: dtype of the preconditioning GEMMs ``X_1 x_1 ... X_k x_k G`` (for a
            matrix ``X_L G X_R``); None (default): the block's dtype. ``torch.bfloat16``: each
            step the gradient and the roots are rounded into preallocated bfloat16 buffers, the
            products are bfloat16 matmuls, and their result, rounded to bfloat16, is written
            back into the search direction in the block dtype. The roots and factors stay in
            their storage dtypes (``inv_factor_matrix_dtype``, ``factor_matrix_dtype``) and the
            root computation is unchanged: only the products round, by about ``2^-8`` relative
            per GEMM. It pays where bfloat16 matmuls beat float32 ones: CUDA, or a CPU with
            avx512_bf16 or AMX (elsewhere it is slower). TF32 for float32 GEMMs on CUDA is
            torch's global ``torch.backends.cuda.matmul.allow_tf32``, not this field. Cost and
            accuracy: docs/results/shampoo-step.md "bf16 preconditioning GEMMs".
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
        use_symmetric_packing: keep each (symmetric) factor matrix packed (default, as in the
            reference library): below 512 its upper triangle, half its bytes, unpacked for each
            use; from 512 on the tiles on and above the diagonal of the tiled update, updated
            in place (a third to a quarter more than the triangle, still well under ``n^2``).
            The update and the roots are the same numbers as unpacked. The state dict holds
            ``factor_matrices`` as ``n (n + 1) / 2`` vectors in ``torch.triu_indices`` order,
            the reference's layout, either way. The roots
            (``inv_factor_matrices``) stay full ``n x n`` matrices here. Measured cost on the
            GPT-small bench: docs/results/shampoo-state.md "Which bf16 state costs loss?".
        pack_factor_matrices: deprecated alias of ``use_symmetric_packing`` (None: not given);
            a bool given here sets ``use_symmetric_packing``, with a ``DeprecationWarning``.
    """

    amortized_computation_config: RootInvConfig = field(default_factory=EigenConfig)
    factor_matrix_dtype: torch.dtype = torch.float32
    inverse_exponent_override: dict[int, float | dict[int, float]] = field(default_factory=dict)
    num_tolerated_failed_amortized_computations: int = 3
    inv_factor_matrix_dtype: torch.dtype | None = None
    precondition_dtype: torch.dtype | None = None
    large_factor_dim: int = 0
    large_factor_frequency_multiplier: int = 1
    use_symmetric_packing: bool = True
    pack_factor_matrices: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._validate_amortized_computation_config()
        if self.factor_matrix_dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"factor_matrix_dtype must be one of {FLOAT_DTYPES}, got "
                f"{self.factor_matrix_dtype!r}"
            )
        if (
            self.inv_factor_matrix_dtype is not None
            and self.inv_factor_matrix_dtype not in FLOAT_DTYPES
        ):
            raise ValueError(
                f"inv_factor_matrix_dtype must be None or one of {FLOAT_DTYPES}, got "
                f"{self.inv_factor_matrix_dtype!r}"
            )
        if self.precondition_dtype is not None and self.precondition_dtype != torch.bfloat16:
            raise ValueError(
                "precondition_dtype must be None or torch.bfloat16, got "
                f"{self.precondition_dtype!r}"
            )
        _check_num_tolerated(self.num_tolerated_failed_amortized_computations)
        self._validate_inverse_exponent_override()
        check_int("large_factor_dim", self.large_factor_dim, minimum=0)
        check_int(
            "large_factor_frequency_multiplier", self.large_factor_frequency_multiplier, minimum=1
        )
        if self.pack_factor_matrices is not None:
            check_bool("pack_factor_matrices", self.pack_factor_matrices)
            warnings.warn(
                "pack_factor_matrices is deprecated: use use_symmetric_packing (the reference "
                "library's name; same meaning, upper triangles)",
                DeprecationWarning,
                stacklevel=3,
            )
            self.use_symmetric_packing = self.pack_factor_matrices
        check_bool("use_symmetric_packing", self.use_symmetric_packing)

    def _validate_amortized_computation_config(self) -> None:
        if not isinstance(self.amortized_computation_config, RootInvConfig):
            raise ValueError(
                "amortized_computation_config must be an EigenConfig, WarmStartedEigenConfig, "
                "CoupledNewtonConfig or CoupledHigherOrderConfig, got "
                f"{self.amortized_computation_config!r}"
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
        _check_orders(name, override)
        coupled = isinstance(self.amortized_computation_config, CoupledNewtonConfig)
        for order, value in override.items():
            where = f"self.inverse_exponent_override[{order}]={value}"
            if isinstance(value, dict):
                last_dim = max(order - 1, 0)
                if bad := [d for d in value if not (validation.is_int(d) and 0 <= d <= last_dim)]:
                    raise refuse(
                        name,
                        f"Invalid dimensions in {where}: {bad}. All dimensions must be within "
                        f"[0, {last_dim}].",
                    )
                if bad := [e for e in value.values() if not _at_least_zero(e)]:
                    raise refuse(
                        name,
                        f"Invalid override value in {where}: {bad}. All overrides must be >= 0.",
                    )
            elif not _at_least_zero(value):
                raise refuse(
                    name, f"Invalid override value in {where}: {value}. All overrides must be >= 0."
                )
            per_dim = value if isinstance(value, dict) else {None: value}
            for exponent in per_dim.values():
                validation.check_float(f"{name}[{order}] exponents", exponent, at_least=0.0)
                if (
                    coupled
                    and exponent > 0.0
                    and abs(1.0 / exponent - round(1.0 / exponent)) > 1e-9
                ):
                    raise ValueError(
                        f"{name}[{order}] exponent {exponent!r}: CoupledNewtonConfig needs "
                        "1 / exponent to be an integer root order"
                    )

    def inverse_exponent(self, order: int, dim: int) -> float:
        """The root exponent ``e`` of dim ``dim`` of an order-``order`` block (``1/(2k)``
        default)."""
        value = self.inverse_exponent_override.get(order, {})
        if isinstance(value, dict):
            return float(value.get(dim, 1.0 / (2 * order)))
        return float(value)


# The name this project used before it followed the well-known library's; kept for old scripts.
ShampooPreconditionerConfig = ClassicShampooPreconditionerConfig


@dataclass(kw_only=True)
class RootInvShampooPreconditionerConfig(ClassicShampooPreconditionerConfig):
    """Classic Shampoo: the search direction of a block is ``X_1 x_1 ... X_k x_k G``.

    ``X_i = (F_i / bc2 + eps I)^(-e_i)``, recomputed every ``precondition_frequency`` steps.
    Fields: see :class:`ClassicShampooPreconditionerConfig`.
    """


DefaultShampooConfig = RootInvShampooPreconditionerConfig()


# ---------------------------------------------------------------------------------------------
# Eigenvalue-corrected Shampoo (SOAP)
# ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class EigenvalueCorrectedShampooPreconditionerConfig(BaseShampooPreconditionerConfig):
    """Eigenvalue-corrected Shampoo (SOAP): Adam's second moment in the factors' eigenbasis.

    Per block of order ``k`` with factors ``F_i`` (updated like Shampoo's) and their eigenbases
    ``Q_i`` (recomputed on the amortized schedule; identity before the first computation):
    rotate ``R(X) = X x_1 Q_1^T ... x_k Q_k^T``; every step
    ``D <- b2 D + w R(G)^2`` (the corrected eigenvalues, in the basis in force for this step's
    search direction); ``P = R^-1(R(Gbar) / ((D / bc2)^e + eps))`` with ``e = 1/2`` by default.

    Until the first eigenbasis (the start step) ``Q_i = I``: without grafting the step is then
    diagonal Adam (AdaGrad with ``betas[1] = 1``) on ``D``, and ``D`` is carried into the first
    eigenbasis as the reference library carries it: coordinate ``j`` to the eigenvector of the
    ``j``-th smallest eigenvalue. With grafting the grafting method steps alone before the
    start step.

    Epsilon is added after the bias correction, as in Adam and the reference library.
    nikhilvyas/SOAP adds it before (``sqrt(D) + eps``, with ``sqrt(bc2)`` folded into the step
    size), i.e. ``eps / sqrt(bc2)`` here: to reproduce its steps pass that epsilon. Measured in
    ``docs/results/soap-parity.md`` (one step from the same state: 1.3e-4 relative with
    gradient entries ~1e-4, 5.1e-6 with its placement).

    Args:
        amortized_computation_config: eigenbasis solver (``EighEigendecompositionConfig`` or
            ``QREigendecompositionConfig``). Its ``rank_deficient_stability_config`` must be a
            ``PerturbationConfig`` (a ``PseudoInverseConfig`` is refused, as the reference
            library refuses it: ``epsilon`` is added to the corrected eigenvalues). It acts
            twice: eigenvectors of numerically-zero factor eigenvalues (tolerance as for
            root-inverse Shampoo) get a canonical basis of their span, so the rotation does not
            depend on rounding; and corrected eigenvalues below ``rtol * max(D / bc2)`` of their
            block (``rtol`` = ``eigenvalue_floor_rtol``, default ``finfo(dtype).eps``: below
            float32's resolution of ``D``) are raised to it. A zero ``eigenvalue_floor_rtol``
            turns both off (the plain algorithm).
        num_tolerated_failed_amortized_computations: consecutive failed eigenbasis computations of
            one factor that are tolerated (the previous basis is kept); one more raises.
        factor_matrix_dtype: storage dtype of the factor matrices.
        ignored_basis_change_dims: ``{order: [dims]}``: those dims of blocks of that order are not
            rotated (no factor is kept), like a zero exponent in root-inverse Shampoo.
        inverse_exponent_override: ``{order: e}`` with ``e > 0``: the exponent applied to the
            corrected eigenvalues of blocks of that order (default ``1/2``, Adam's square root).
        factor_matrix_eigenvectors_dtype: storage dtype of the eigenbases.
        corrected_eigenvalues_dtype: storage dtype of the corrected eigenvalues.
        use_symmetric_packing: the factors packed as root-inverse Shampoo's (upper
            triangles, or from 512 on upper tiles), on by default as in the reference
            library. The eigh bases are the same numbers packed or not; the QR refresh
            multiplies by the symmetrized factor, which can rotate a degenerate
            (rank-deficient) eigenspace differently in the last bits, so packed and unpacked
            runs can differ slightly.
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
    use_symmetric_packing: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool("use_symmetric_packing", self.use_symmetric_packing)
        if not isinstance(self.amortized_computation_config, EigendecompositionConfig):
            raise ValueError(
                "amortized_computation_config must be an EighEigendecompositionConfig or "
                f"QREigendecompositionConfig, got {self.amortized_computation_config!r}"
            )
        stability = self.amortized_computation_config.rank_deficient_stability_config
        if not isinstance(stability, PerturbationConfig):
            raise refuse(
                "amortized_computation_config",
                f"{type(stability).__name__} is an invalid rank_deficient_stability_config for "
                f"{type(self).__name__}. Please use an instance of PerturbationConfig instead.",
                "(its eigenvalue_floor_rtol floors the corrected eigenvalues)",
            )
        _check_num_tolerated(self.num_tolerated_failed_amortized_computations)
        for name in (
            "factor_matrix_dtype",
            "factor_matrix_eigenvectors_dtype",
            "corrected_eigenvalues_dtype",
        ):
            if getattr(self, name) not in FLOAT_DTYPES:
                raise ValueError(
                    f"{name} must be one of {FLOAT_DTYPES}, got {getattr(self, name)!r}"
                )
        self._validate_ignored_basis_change_dims()
        override = self.inverse_exponent_override
        name = "inverse_exponent_override"
        if not isinstance(override, dict):
            raise ValueError(f"{name} must be a dict, got {override!r}")
        _check_orders(name, override)
        for order, exponent in override.items():
            check_rule(
                name,
                f"Invalid override value in self.inverse_exponent_override[order]={exponent}:",
                exponent,
                f"{exponent}. All overrides must be > 0.",
                lambda e: e > 0,
            )

    def _validate_ignored_basis_change_dims(self) -> None:
        name = "ignored_basis_change_dims"
        ignored = self.ignored_basis_change_dims
        if not isinstance(ignored, dict):
            raise ValueError(f"{name} must be a dict, got {ignored!r}")
        _check_orders(name, ignored)
        for order, dims in ignored.items():
            if not isinstance(dims, (list, tuple)):
                raise ValueError(f"{name}[{order}] must be a list of dims, got {dims!r}")
            # The reference's sentences name the entry "[order]" literally.
            where = f"self.ignored_basis_change_dims[order]={dims!r}"
            last_dim = max(order - 1, 0)
            if bad := [d for d in dims if not (validation.is_int(d) and 0 <= d <= last_dim)]:
                raise refuse(
                    name,
                    f"Invalid dimensions in {where}: {bad}. All dimensions must be within "
                    f"[0, {last_dim}].",
                )
            if len(set(dims)) != len(dims):
                raise refuse(
                    name,
                    f"Invalid ignored dimensions in {where}. Duplicate dimensions found in "
                    f"{dims}. All dimensions must be unique.",
                )

    def corrected_eigenvalue_exponent(self, order: int) -> float:
        """The exponent ``e`` of ``(D / bc2)^e`` for an order-``order`` block (default ``1/2``)."""
        return float(self.inverse_exponent_override.get(order, 0.5))

    def rotates(self, order: int, dim: int) -> bool:
        """Whether dim ``dim`` of an order-``order`` block is rotated into its factor's
        eigenbasis."""
        return dim not in self.ignored_basis_change_dims.get(order, ())


DefaultEigenvalueCorrectedShampooConfig = EigenvalueCorrectedShampooPreconditionerConfig()
DefaultSOAPConfig = EigenvalueCorrectedShampooPreconditionerConfig(
    amortized_computation_config=QREigendecompositionConfig()
)
