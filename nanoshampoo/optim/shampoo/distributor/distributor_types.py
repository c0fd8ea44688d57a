"""Configs of the distributors: who computes which block and how results travel between ranks.

Every config validates its fields in ``__post_init__`` (``ValueError`` naming the field).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from nanoshampoo.optim.shampoo.config_checks import FLOAT_DTYPES
from nanoshampoo.optim.shampoo.utils.abstract_dataclass import AbstractDataclass

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



# ---------------------------------------------------------------------------------------------
# Names of the well-known library for torch's deprecated FSDP1 wrapper: accepted, not built
# ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class FSDPDistributedConfig(DistributedConfig):
    """The well-known library's config for parameters wrapped by torch's deprecated FSDP1
    (``FullyShardedDataParallel``). Accepted so that a script written for that library imports
    and builds its configs; building an optimizer with it raises ``UnsupportedConfigError`` (a
    ``NotImplementedError``) that names the replacement: wrap the model with FSDP2's
    ``fully_shard`` and use :class:`FullyShardDistributedConfig`.

    Args:
        param_to_metadata: the FSDP1 parameter metadata (unused).
    """

    param_to_metadata: dict[object, object] = field(default_factory=dict)


@dataclass(kw_only=True)
class HSDPDistributedConfig(FSDPDistributedConfig):
    """The well-known library's config for HSDP over FSDP1; refused like
    :class:`FSDPDistributedConfig`, the replacement being :class:`HybridShardDistributedConfig`.

    Args:
        param_to_metadata: the FSDP1 parameter metadata (unused).
        device_mesh: the 2-D device mesh (unused).
        communication_dtype, num_trainers_per_group, communicate_params: as for
            :class:`DDPDistributedConfig` (unused).
    """

    device_mesh: object | None = None
    communication_dtype: torch.dtype = torch.float32
    num_trainers_per_group: int = -1
    communicate_params: bool = False
