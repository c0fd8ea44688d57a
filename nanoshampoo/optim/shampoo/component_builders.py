"""Builders of a parameter group's components: its preconditioner and its distributor.

Each maps a config (:mod:`~nanoshampoo.optim.shampoo.shampoo_types`) to the object that
implements it, importing that object's module only when a config needs it, so that a run imports
(and its log records the source of) only the modules it uses.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from nanoshampoo.optim.shampoo.config_checks import field_error
from nanoshampoo.optim.shampoo.distributor.distributor import Distributor
from nanoshampoo.optim.shampoo.preconditioner.preconditioner import (
    BlockBucket,
    Preconditioner,
)
from nanoshampoo.optim.shampoo.shampoo_types import (
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    DDPDistributedConfig,
    DistributedConfig,
    EigendecomposedShampooPreconditionerConfig,
    EigenvalueCorrectedShampooPreconditionerConfig,
    FSDPDistributedConfig,
    FullyShardDistributedConfig,
    HSDPDistributedConfig,
    HybridShardDistributedConfig,
    PreconditionerConfig,
    RMSpropPreconditionerConfig,
    SGDPreconditionerConfig,
    ShampooPreconditionerConfig,
    SignDescentPreconditionerConfig,
    SingleDeviceDistributedConfig,
    SpectralDescentPreconditionerConfig,
    UnsupportedConfigError,
)

# The well-known library's FSDP1 configs and the configs that replace them here.
_FSDP1_REPLACEMENTS = (
    (HSDPDistributedConfig, "HybridShardDistributedConfig"),
    (FSDPDistributedConfig, "FullyShardDistributedConfig"),
)

logger = logging.getLogger(__name__)


def _classic_shampoo(
    config: ShampooPreconditionerConfig,
    buckets: Sequence[BlockBucket],
    beta2: float,
    epsilon: float,
    use_bias_correction: bool,
) -> Preconditioner:
    """Root-inverse or eigendecomposed Shampoo, each also in its KL-Shampoo form."""
    if isinstance(config, EigendecomposedShampooPreconditionerConfig):
        from nanoshampoo.optim.shampoo.preconditioner import (
            eigendecomposed_shampoo_preconditioner as eigendecomposed,
        )

        return eigendecomposed.EigendecomposedShampooPreconditioner(
            buckets, config, beta2, epsilon, use_bias_correction
        )
    from nanoshampoo.optim.shampoo.preconditioner.shampoo_preconditioner import (
        ShampooPreconditioner,
    )

    return ShampooPreconditioner(buckets, config, beta2, epsilon, use_bias_correction)


def build_preconditioner(
    config: PreconditionerConfig,
    buckets: Sequence[BlockBucket],
    beta2: float,
    epsilon: float,
    use_bias_correction: bool,
) -> Preconditioner:
    """The preconditioner a config describes, over ``buckets``.

    ``beta2``/``epsilon``/``use_bias_correction`` are the group's and apply to both Shampoo
    kinds (root-inverse and eigenvalue-corrected); spectral and sign descent use none of them; the
    diagonal preconditioners carry their own ``beta2``/``epsilon`` and bias-correction rule
    (Adam corrects, RMSprop and AdaGrad do not). The module of each kind is imported when a
    config needs it, like the distributors' (:func:`build_distributor`).
    """
    if isinstance(config, ShampooPreconditionerConfig):
        return _classic_shampoo(config, buckets, beta2, epsilon, use_bias_correction)
    if isinstance(config, EigenvalueCorrectedShampooPreconditionerConfig):
        from nanoshampoo.optim.shampoo.preconditioner import (
            eigenvalue_corrected_shampoo_preconditioner as eigenvalue_corrected,
        )

        return eigenvalue_corrected.EigenvalueCorrectedShampooPreconditioner(
            buckets, config, beta2, epsilon, use_bias_correction
        )
    if isinstance(config, SpectralDescentPreconditionerConfig):
        from nanoshampoo.optim.shampoo.preconditioner.spectral_descent_preconditioner import (
            SpectralDescentPreconditioner,
        )

        return SpectralDescentPreconditioner(buckets, config)
    if isinstance(config, SignDescentPreconditionerConfig):
        from nanoshampoo.optim.shampoo.preconditioner.sign_descent_preconditioner import (
            SignDescentPreconditioner,
        )

        return SignDescentPreconditioner(buckets, config)
    if isinstance(config, SGDPreconditionerConfig):
        from nanoshampoo.optim.shampoo.preconditioner.sgd_preconditioner import (
            SGDPreconditioner,
        )

        return SGDPreconditioner(buckets)
    from nanoshampoo.optim.shampoo.preconditioner.adagrad_preconditioner import (
        AdaGradPreconditioner,
    )

    if isinstance(config, RMSpropPreconditionerConfig):  # Adam is an RMSprop with bias correction
        return AdaGradPreconditioner(
            buckets,
            config.beta2,
            config.epsilon,
            isinstance(config, AdamPreconditionerConfig),
            config.second_moment_dtype,
            drop_weighting_factor=config.drop_weighting_factor_on_gsquare,
        )
    if isinstance(config, AdaGradPreconditionerConfig):
        return AdaGradPreconditioner(
            buckets, 1.0, config.epsilon, False, config.second_moment_dtype
        )
    raise field_error(
        "preconditioner_config",
        f"preconditioner_config={config!r} not supported!",
        UnsupportedConfigError,
    )


def target_dimensionality(
    config: DistributedConfig, preconditioner_config: PreconditionerConfig
) -> int | float:
    """How far the group's small dims merge: the config's ``target_parameter_dimensionality``,
    except 2 under spectral descent, which orthogonalizes matrices (as the reference library
    does; it logs the override, and so does this, but leaves the user's config unchanged)."""
    target = config.target_parameter_dimensionality
    if isinstance(preconditioner_config, SpectralDescentPreconditionerConfig) and target != 2:
        # The reference's warning, word for word (it also writes 2 into the config object; this
        # library builds the group's blocks with 2 and leaves the caller's object as it was).
        logger.warning(
            f"param_group[DISTRIBUTED_CONFIG].target_parameter_dimensionality={target!r} is not "
            "equal to 2. Setting target_parameter_dimensionality to 2..."
        )
        logger.info(
            "SpectralDescentPreconditionerConfig: this group's blocks are matrices "
            "(target_parameter_dimensionality 2); the DistributedConfig object passed in is left "
            "unchanged."
        )
        return 2
    return target


def build_distributor(
    config: DistributedConfig,
    params: Sequence[torch.Tensor],
    max_preconditioner_dim: int | float,
    first_param_index: int,
    preconditioner_config: PreconditionerConfig,
    owner_ranks: Sequence[int] | None = None,
) -> Distributor:
    """The distributor a config describes, for one parameter group.

    One branch per kind of ``DistributedConfig``; a config class that subclasses another must
    be tested before its parent. Whatever is built here must implement :class:`Distributor`:
    the optimizer talks to it through that interface only. Each distributor module is imported
    here, when a config needs it: a run imports (and its log records the source of) only the
    one it uses. The blocks merge small dims up to :func:`target_dimensionality`.
    ``owner_ranks``: the group's ``ROUND_ROBIN`` owner map, read by the FSDP2 and HSDP
    distributors; any other distributor refuses one (naming ``owner_ranks``).
    """
    target = target_dimensionality(config, preconditioner_config)
    if target != config.target_parameter_dimensionality:
        config = dataclasses.replace(config, target_parameter_dimensionality=target)
    if owner_ranks is not None and isinstance(
        config, (SingleDeviceDistributedConfig, DDPDistributedConfig)
    ):
        raise field_error(
            "owner_ranks",
            "owner_ranks is read under FullyShardDistributedConfig and "
            f"HybridShardDistributedConfig (ROUND_ROBIN) only, got {type(config).__name__}: "
            "leave it out of the group",
        )
    if isinstance(config, SingleDeviceDistributedConfig):
        from nanoshampoo.optim.shampoo.distributor.single_device_distributor import (
            SingleDeviceDistributor,
        )

        return SingleDeviceDistributor(params, max_preconditioner_dim, first_param_index, target)
    if isinstance(config, DDPDistributedConfig):
        from nanoshampoo.optim.shampoo.distributor.ddp_distributor import DDPDistributor

        return DDPDistributor(params, max_preconditioner_dim, first_param_index, config)
    if isinstance(config, FullyShardDistributedConfig):
        from nanoshampoo.optim.shampoo.distributor.fully_shard_distributor import (
            FullyShardDistributor,
        )

        return FullyShardDistributor(
            params, max_preconditioner_dim, first_param_index, config, owner_ranks
        )
    if isinstance(config, HybridShardDistributedConfig):
        from nanoshampoo.optim.shampoo.distributor.hybrid_shard_distributor import (
            HybridShardDistributor,
        )

        return HybridShardDistributor(
            params, max_preconditioner_dim, first_param_index, config, owner_ranks
        )
    for fsdp1_config, replacement in _FSDP1_REPLACEMENTS:
        if isinstance(config, fsdp1_config):
            raise field_error(
                "distributed_config",
                f"distributed_config: {type(config).__name__} (torch's deprecated FSDP1 wrapper) "
                "is not supported; wrap the model with torch.distributed.fsdp.fully_shard (FSDP2) "
                f"and use {replacement}",
                UnsupportedConfigError,
            )
    raise field_error(
        "distributed_config",
        f"distributed_config={config!r} not supported!",
        UnsupportedConfigError,
    )
