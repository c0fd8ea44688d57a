"""Configs of the classic Shampoo variants: eigendecomposed roots and KL-Shampoo.

Each is a :class:`ClassicShampooPreconditionerConfig` (same factors, exponents, dtypes and
schedule as root-inverse Shampoo) that changes what is cached or how the factors are updated;
re-exported by :mod:`~nanoshampoo.optim.shampoo.shampoo_types`. Implemented by
``shampoo_preconditioner.py`` and ``eigendecomposed_shampoo_preconditioner.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanoshampoo.optim.shampoo.config_checks import FLOAT_DTYPES
from nanoshampoo.optim.shampoo.preconditioner.matrix_functions_types import (
    EigendecompositionConfig,
    EighEigendecompositionConfig,
)
from nanoshampoo.optim.shampoo.preconditioner.preconditioner_types import (
    ClassicShampooPreconditionerConfig,
    RootInvShampooPreconditionerConfig,
)


@dataclass(kw_only=True)
class EigendecomposedShampooPreconditionerConfig(ClassicShampooPreconditionerConfig):
    """Classic Shampoo that caches each factor's eigendecomposition instead of its root.

    On the amortized schedule ``A = F_i / bc2`` (plus ``eps I`` with ``PerturbationConfig``'s
    ``perturb_before_computation``) is decomposed as ``Q diag(lambda) Q^T`` and ``Q``,
    ``lambda`` (ascending) are kept. Every step the root is rebuilt from them exactly as
    root-inverse Shampoo with ``EigenConfig`` builds it (same shift, ridge, eigenvalue floor or
    pseudo-inverse): ``X_i = Q diag(w(lambda)) Q^T``, so the two give the same steps up to
    rounding. Before the first decomposition ``Q = I``, ``lambda = 1``: ``X_i = I``. The
    search direction is ``X_1 x_1 ... X_k x_k G``. A failed decomposition keeps the previous
    one.

    Args:
        amortized_computation_config: ``EighEigendecompositionConfig`` (default; also
            ``EigenConfig``) or ``QREigendecompositionConfig`` (QR iterations from the last
            eigenvectors, the first decomposition of a factor a full ``eigh``); ``lambda`` of an
            iterated or kept basis is ``diag(Q^T A Q)``.
        factor_matrix_eigenvectors_dtype: storage dtype of ``Q``.
        factor_matrix_eigenvalues_dtype: storage dtype of ``lambda``.
        Others: see :class:`ClassicShampooPreconditionerConfig`; ``inv_factor_matrix_dtype``
        must stay None (no root is stored).
    """

    amortized_computation_config: EigendecompositionConfig = field(  # type: ignore[assignment]
        default_factory=EighEigendecompositionConfig
    )
    factor_matrix_eigenvectors_dtype: torch.dtype = torch.float32
    factor_matrix_eigenvalues_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("factor_matrix_eigenvectors_dtype", "factor_matrix_eigenvalues_dtype"):
            if getattr(self, name) not in FLOAT_DTYPES:
                raise ValueError(
                    f"{name} must be one of {FLOAT_DTYPES}, got {getattr(self, name)!r}"
                )
        if self.inv_factor_matrix_dtype is not None:
            raise ValueError(
                "inv_factor_matrix_dtype must be None for "
                "EigendecomposedShampooPreconditionerConfig "
                "(it stores eigenvectors and eigenvalues, see their dtypes), got "
                f"{self.inv_factor_matrix_dtype!r}"
            )

    def _validate_amortized_computation_config(self) -> None:
        if not isinstance(self.amortized_computation_config, EigendecompositionConfig):
            raise ValueError(
                "amortized_computation_config must be an EighEigendecompositionConfig or "
                f"QREigendecompositionConfig, got {self.amortized_computation_config!r}"
            )


_KL_UPDATE = """
    KL-Shampoo (Lin et al., arXiv 2509.03378, the simplified form of the well-known library:
    only the factor update changes, no per-factor eigenvalue correction). Factor ``i`` is
    updated from the gradient preconditioned along every other preconditioned dim by that
    factor's current root: ``H = G x_j X_j`` for all ``j != i``, ``F_i <- b2 F_i + w H_(i)
    H_(i)^T``. The roots ``X_j`` are those in force at the step (computed at the last
    amortized computation; the identity before the first), so the roots of a step's
    computation see its factors, and its factors the previous roots. For a matrix ``G`` this is
    ``L <- b2 L + w G X_R^2 G^T``, ``R <- b2 R + w G^T X_L^2 G``: with exponents 1/2
    (``inverse_exponent_override={2: 0.5}``) the other factor's inverse, as in the paper. A
    block with one factor (a 1-D parameter, or a tensor whose dims merge into one) has no other
    root: ``H = G``, so its steps are root-inverse Shampoo's.
"""


@dataclass(kw_only=True)
class RootInvKLShampooPreconditionerConfig(RootInvShampooPreconditionerConfig):
    __doc__ = (
        "KL-Shampoo with cached roots (as :class:`RootInvShampooPreconditionerConfig`).\n"
        + _KL_UPDATE
    )


@dataclass(kw_only=True)
class EigendecomposedKLShampooPreconditionerConfig(EigendecomposedShampooPreconditionerConfig):
    __doc__ = (
        "KL-Shampoo with cached eigendecompositions (as "
        ":class:`EigendecomposedShampooPreconditionerConfig`).\n" + _KL_UPDATE
    )


KL_SHAMPOO_CONFIG_TYPES = (
    RootInvKLShampooPreconditionerConfig,
    EigendecomposedKLShampooPreconditionerConfig,
)
