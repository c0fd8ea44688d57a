"""Distributed Shampoo: ``from nanoshampoo.optim.shampoo import DistributedShampoo``.

Public names and defaults follow the well-known PyTorch Distributed Shampoo library, so a
script written for it runs by changing its import line.

Example:
    >>> import torch
    >>> from nanoshampoo.optim.shampoo import AdamPreconditionerConfig, DistributedShampoo
    >>> model = torch.nn.Linear(16, 16)
    >>> optimizer = DistributedShampoo(
    ...     model.parameters(), lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12,
    ...     max_preconditioner_dim=8192, precondition_frequency=10,
    ...     grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8))
"""

from nanoshampoo.optim.shampoo.distributed_shampoo import DistributedShampoo
from nanoshampoo.optim.shampoo.shampoo_types import (
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    AmortizedComputationConfig,
    CoupledNewtonConfig,
    DDPDistributedConfig,
    DefaultEigenConfig,
    DefaultEigendecompositionConfig,
    DefaultEigenvalueCorrectedShampooConfig,
    DefaultNewtonSchulzOrthogonalizationConfig,
    DefaultPerturbationConfig,
    DefaultSOAPConfig,
    DefaultShampooConfig,
    DefaultSingleDeviceDistributedConfig,
    DefaultSpectralDescentPreconditionerConfig,
    DistributedConfig,
    EigenConfig,
    EigendecompositionConfig,
    EigenvalueCorrectedShampooPreconditionerConfig,
    EighEigendecompositionConfig,
    NewtonSchulzOrthogonalizationConfig,
    NonFiniteGradientError,
    OrthogonalizationConfig,
    PerturbationConfig,
    PreconditionerConfig,
    PseudoInverseConfig,
    QREigendecompositionConfig,
    RMSpropPreconditionerConfig,
    RankDeficientStabilityConfig,
    RootInvConfig,
    RootInvShampooPreconditionerConfig,
    SGDPreconditionerConfig,
    SVDOrthogonalizationConfig,
    ShampooPreconditionerConfig,
    SingleDeviceDistributedConfig,
    SpectralDescentPreconditionerConfig,
    WeightDecayType,
)

__all__ = [
    "AdaGradPreconditionerConfig",
    "AdamPreconditionerConfig",
    "AmortizedComputationConfig",
    "CoupledNewtonConfig",
    "DDPDistributedConfig",
    "DefaultEigenConfig",
    "DefaultEigendecompositionConfig",
    "DefaultEigenvalueCorrectedShampooConfig",
    "DefaultNewtonSchulzOrthogonalizationConfig",
    "DefaultPerturbationConfig",
    "DefaultSOAPConfig",
    "DefaultShampooConfig",
    "DefaultSingleDeviceDistributedConfig",
    "DefaultSpectralDescentPreconditionerConfig",
    "DistributedConfig",
    "DistributedShampoo",
    "EigenConfig",
    "EigendecompositionConfig",
    "EigenvalueCorrectedShampooPreconditionerConfig",
    "EighEigendecompositionConfig",
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
    "RootInvShampooPreconditionerConfig",
    "SGDPreconditionerConfig",
    "SVDOrthogonalizationConfig",
    "ShampooPreconditionerConfig",
    "SingleDeviceDistributedConfig",
    "SpectralDescentPreconditionerConfig",
    "WeightDecayType",
]
