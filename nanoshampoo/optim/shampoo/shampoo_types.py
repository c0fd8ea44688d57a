"""Configuration types of Distributed Shampoo: every public config name, from one module.

The configs live beside the code they configure and are re-exported here:
``preconditioner/preconditioner_types.py`` (preconditioners and grafting),
``preconditioner/shampoo_variant_types.py`` (eigendecomposed Shampoo, KL-Shampoo),
``preconditioner/matrix_functions_types.py`` (roots, eigenbases, orthogonalization, rank-deficient
factors), ``distributor/distributor_types.py`` (distributors), ``iterate_averaging_types.py``
(momentum, GPA, Schedule-Free), ``config_checks.py`` (the field checks and
``UnsupportedConfigError``); this module holds the optimizer-wide types (``WeightDecayType``).

Every config is a small dataclass validated in ``__post_init__``: a bad value raises
``ValueError`` whose message starts with the field name. Names and defaults follow the
well-known PyTorch Distributed Shampoo library, so scripts port by changing the import line.

Example:
    >>> import torch
    >>> config = RootInvShampooPreconditionerConfig(
    ...     amortized_computation_config=EigenConfig(),
    ...     factor_matrix_dtype=torch.float64,
    ...     inverse_exponent_override={1: 0.25},  # vectors: (A + eps I)^(-1/4) instead of -1/2
    ... )
    >>> AdamPreconditionerConfig(beta2=2.0)
    Traceback (most recent call last):
    ...
    ValueError: Invalid grafting beta2 parameter: 2.0. Must be in (0.0, 1.0].
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from typing import Any

import torch

from nanoshampoo.optim.errors import NonFiniteGradientError
from nanoshampoo.optim.shampoo.config_checks import (
    FLOAT_DTYPES,
    UnsupportedConfigError,
    check_ema_storage_dtype,
)
from nanoshampoo.optim.shampoo.distributor.distributor_types import (
    DDPDistributedConfig,
    DefaultSingleDeviceDistributedConfig,
    DistributedConfig,
    FSDPDistributedConfig,
    FSDPParamAssignmentStrategy,
    FullyShardDistributedConfig,
    HSDPDistributedConfig,
    HybridShardDistributedConfig,
    SingleDeviceDistributedConfig,
)
from nanoshampoo.optim.shampoo.iterate_averaging_types import (
    ClassicMomentumConfig,
    GeneralizedPrimalAveragingConfig,
    IterateAveragingConfig,
    ScheduleFreeConfig,
)
from nanoshampoo.optim.shampoo.preconditioner.descent_types import (
    DefaultSignDescentPreconditionerConfig,
    DefaultSpectralDescentPreconditionerConfig,
    SignDescentPreconditionerConfig,
    SpectralDescentPreconditionerConfig,
    unit_scale,
)
from nanoshampoo.optim.shampoo.preconditioner.matrix_functions_types import (
    AmortizedComputationConfig,
    CoupledHigherOrderConfig,
    CoupledNewtonConfig,
    DefaultEigenConfig,
    DefaultEigendecompositionConfig,
    DefaultNewtonSchulzOrthogonalizationConfig,
    DefaultPerturbationConfig,
    EigenConfig,
    EigendecompositionConfig,
    EighEigendecompositionConfig,
    MatrixFunctionConfig,
    NewtonSchulzOrthogonalizationConfig,
    OrthogonalizationConfig,
    PerturbationConfig,
    PseudoInverseConfig,
    QREigendecompositionConfig,
    RankDeficientStabilityConfig,
    RootInvConfig,
    SVDOrthogonalizationConfig,
    WarmStartedEigenConfig,
    _unit_scale_by_dims,
)
from nanoshampoo.optim.shampoo.preconditioner.preconditioner_types import (
    GRAFTING_CONFIG_TYPES,
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    BaseShampooPreconditionerConfig,
    ClassicShampooPreconditionerConfig,
    DefaultEigenvalueCorrectedShampooConfig,
    DefaultShampooConfig,
    DefaultSOAPConfig,
    EigenvalueCorrectedShampooPreconditionerConfig,
    PreconditionerConfig,
    RMSpropPreconditionerConfig,
    RootInvShampooPreconditionerConfig,
    SGDPreconditionerConfig,
    ShampooPreconditionerConfig,
)
from nanoshampoo.optim.shampoo.preconditioner.shampoo_variant_types import (
    EigendecomposedKLShampooPreconditionerConfig,
    EigendecomposedShampooPreconditionerConfig,
    RootInvKLShampooPreconditionerConfig,
)
from nanoshampoo.optim.shampoo.runtime_types import (
    ConcurrencyConfig,
    DefaultConcurrencyConfig,
    DefaultShampooRuntimeConfig,
    ShampooPT2CompileConfig,
    ShampooRuntimeConfig,
)
from nanoshampoo.optim.shampoo.utils.load_balancing_utils import (
    AlignedMemoryCostModel,
    LoadBalancingConfig,
    PolynomialComputationalCostModel,
)

# Keys of a param group and of a parameter's state, spelled as the reference library exports them.
DISTRIBUTED_CONFIG = "distributed_config"
LR_SUM = "lr_sum"
# A ROUND_ROBIN FSDP2/HSDP group's owner map: the shard rank that computes each of its params.
OWNER_RANKS = "owner_ranks"
PARAMS = "params"
STEP = "step"
TRAIN_MODE = "train_mode"

__all__ = [
    "DISTRIBUTED_CONFIG",
    "LR_SUM",
    "OWNER_RANKS",
    "PARAMS",
    "STEP",
    "TRAIN_MODE",
    "AdaGradPreconditionerConfig",
    "AdamPreconditionerConfig",
    "AmortizedComputationConfig",
    "BaseShampooPreconditionerConfig",
    "ClassicMomentumConfig",
    "ClassicShampooPreconditionerConfig",
    "ConcurrencyConfig",
    "CoupledHigherOrderConfig",
    "CoupledNewtonConfig",
    "DDPDistributedConfig",
    "DefaultConcurrencyConfig",
    "DefaultEigenConfig",
    "DefaultEigendecompositionConfig",
    "DefaultEigenvalueCorrectedShampooConfig",
    "DefaultNewtonSchulzOrthogonalizationConfig",
    "DefaultPerturbationConfig",
    "DefaultSOAPConfig",
    "DefaultShampooConfig",
    "DefaultShampooRuntimeConfig",
    "DefaultSignDescentPreconditionerConfig",
    "DefaultSingleDeviceDistributedConfig",
    "DefaultSpectralDescentPreconditionerConfig",
    "DistributedConfig",
    "EigenConfig",
    "EigendecomposedKLShampooPreconditionerConfig",
    "EigendecomposedShampooPreconditionerConfig",
    "EigendecompositionConfig",
    "EigenvalueCorrectedShampooPreconditionerConfig",
    "EighEigendecompositionConfig",
    "FLOAT_DTYPES",
    "FSDPDistributedConfig",
    "FSDPParamAssignmentStrategy",
    "FullyShardDistributedConfig",
    "GRAFTING_CONFIG_TYPES",
    "GeneralizedPrimalAveragingConfig",
    "HSDPDistributedConfig",
    "HybridShardDistributedConfig",
    "IterateAveragingConfig",
    "LoadBalancingConfig",
    "MatrixFunctionConfig",
    "NewtonSchulzOrthogonalizationConfig",
    "NonFiniteGradientError",
    "OrthogonalizationConfig",
    "PerturbationConfig",
    "PreconditionerConfig",
    "PseudoInverseConfig",
    "QREigendecompositionConfig",
    "RMSpropPreconditionerConfig",
    "RankDeficientStabilityConfig",
    "RootInvConfig",
    "RootInvKLShampooPreconditionerConfig",
    "RootInvShampooPreconditionerConfig",
    "SGDPreconditionerConfig",
    "SVDOrthogonalizationConfig",
    "ScheduleFreeConfig",
    "ShampooPT2CompileConfig",
    "ShampooPreconditionerConfig",
    "ShampooRuntimeConfig",
    "SignDescentPreconditionerConfig",
    "SingleDeviceDistributedConfig",
    "SpectralDescentPreconditionerConfig",
    "UnsupportedConfigError",
    "WarmStartedEigenConfig",
    "WeightDecayType",
    "check_ema_storage_dtype",
]


@enum.unique
class WeightDecayType(enum.Enum):
    """Where weight decay enters the step (values are the names, as in the well-known library).

    ``L2``: ``G <- G + wd * W`` before statistics and preconditioning (classic L2 penalty).
    ``DECOUPLED``: ``P <- P + wd * W`` after preconditioning, scaled by lr with the update (AdamW).
    ``CORRECTED``: ``P <- P + wd * lr / peak_lr * W``: so ``W`` shrinks by ``lr^2 / peak_lr * wd``
    per step (Defazio 2025: a steady ``||g|| / ||w||`` for normalized layers under Adam).
    ``INDEPENDENT``: ``P <- P + wd / peak_lr * W``: ``W`` shrinks by ``lr / peak_lr * wd``, so
    ``wd`` is the shrinkage at the peak lr, independent of the lr's size.

    ``peak_lr`` is a param group entry, by default the group's ``lr`` when it is added.
    """

    L2 = "L2"
    DECOUPLED = "DECOUPLED"
    CORRECTED = "CORRECTED"
    INDEPENDENT = "INDEPENDENT"


def _checkpoint_globals() -> list[Any]:
    """Everything a saved param group may reference by name: every config class and enum
    exported here, the cost models inside ``LoadBalancingConfig``, and the default functions
    of the descent configs."""
    exported = [globals()[name] for name in __all__]
    types = [
        value
        for value in exported
        if inspect.isclass(value)
        and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum))
    ]
    return [
        *types,
        AlignedMemoryCostModel,
        PolynomialComputationalCostModel,
        unit_scale,
        _unit_scale_by_dims,
    ]


# ``state_dict()["param_groups"]`` holds these configs (as the reference library's does), so a
# checkpoint loads with ``torch.load(weights_only=True)`` once this module is imported. A config
# type or function of a user's own must be registered the same way.
CHECKPOINT_GLOBALS = _checkpoint_globals()
torch.serialization.add_safe_globals(CHECKPOINT_GLOBALS)
