"""Configs of the distributors: who computes which block and how results travel between ranks.

Every config validates its fields in ``__post_init__`` (``ValueError`` naming the field).
"""

from __future__ import annotations

import enum
import math
from dataclasses import KW_ONLY, dataclass, field

import torch

from nanoshampoo import validation
from nanoshampoo.optim.shampoo.config_checks import FLOAT_DTYPES, check_rule, refuse
from nanoshampoo.optim.shampoo.utils.abstract_dataclass import AbstractDataclass
from nanoshampoo.optim.shampoo.utils.load_balancing_utils import LoadBalancingConfig


@dataclass(init=False)
class DistributedConfig(AbstractDataclass):
    """Base of the configs choosing who computes which block and how results travel.

    Args:
        target_parameter_dimensionality (keyword only): how far a parameter's dims are merged
            before it is cut into blocks. Size-1 dims are dropped, then adjacent dims are merged
            from the back while the product stays ``<= max_preconditioner_dim`` and more than
            this many dims remain: ``1`` (default) merges as far as the threshold allows (a
            ``(4, 3, 5)`` weight becomes one 60-vector under threshold 64: full-matrix AdaGrad
            on it), ``2`` keeps at least two dims (spectral descent needs matrices), and
            ``math.inf`` merges nothing and keeps the shape as it is. Only with
            ``max_preconditioner_dim=math.inf`` is every tensor of more dims guaranteed to end
            with exactly this many. An int >= 1 or ``math.inf``.
    """

    _: KW_ONLY
    target_parameter_dimensionality: int | float = 1

    def __post_init__(self) -> None:
        target = self.target_parameter_dimensionality
        prefix = f"Invalid self.target_parameter_dimensionality={target!r} value."
        if not (validation.is_int(target) or (validation.is_real(target) and target == math.inf)):
            raise refuse(
                "target_parameter_dimensionality", f"{prefix} Must be an integer or math.inf."
            )
        if target < 1:
            raise refuse("target_parameter_dimensionality", f"{prefix} Must be >= 1.")


def _check_num_trainers_per_group(trainers: object) -> None:
    """-1 (the whole world, or replicate dim) or an int >= 1."""
    if not (validation.is_int(trainers) and trainers == -1):
        validation.check_int("num_trainers_per_group (-1: all ranks)", trainers, at_least=1)


def _check_load_balancing_config(
    config: DDPDistributedConfig | FullyShardDistributedConfig,
) -> None:
    if not isinstance(config.load_balancing_config, LoadBalancingConfig):
        raise ValueError(
            "load_balancing_config must be a LoadBalancingConfig, got "
            f"{config.load_balancing_config!r}"
        )


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
        load_balancing_config: the cost model ``distribute_buffer_sizes`` balances when it
            assigns blocks to ranks (default: aligned bytes; ``PolynomialComputationalCostModel``
            balances the ``n^3`` root work instead).
    """

    communication_dtype: torch.dtype = torch.float32
    num_trainers_per_group: int = -1
    communicate_params: bool = False
    load_balancing_config: LoadBalancingConfig = field(default_factory=LoadBalancingConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_load_balancing_config(self)
        if self.communication_dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"communication_dtype must be one of {FLOAT_DTYPES}, got "
                f"{self.communication_dtype!r}"
            )
        _check_num_trainers_per_group(self.num_trainers_per_group)
        validation.check_bool("communicate_params", self.communicate_params)


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
    sub_groups = config.num_sub_groups
    check_rule(
        "num_sub_groups",
        f"Invalid self.num_sub_groups={sub_groups!r}.",
        sub_groups,
        "Must be >= 1.",
        lambda count: count >= 1,
        integer=True,
    )
    strategy = config.param_assignment_strategy
    if sub_groups > 1 and strategy == FSDPParamAssignmentStrategy.DEFAULT:
        raise refuse(
            "num_sub_groups",
            "num_sub_groups > 1 requires param_assignment_strategy != DEFAULT (REPLICATE or "
            "ROUND_ROBIN); only the lossless FSDP/HSDP distributors support param-group "
            f"splitting. Got self.num_sub_groups={sub_groups!r}, "
            f"self.param_assignment_strategy={strategy!r}.",
        )
    _check_load_balancing_config(config)
    if config.communication_dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"communication_dtype must be one of {FLOAT_DTYPES}, got {config.communication_dtype!r}"
        )
    validation.check_bool("communicate_params", config.communicate_params)


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
        num_sub_groups: an int >= 1 (> 1 only with a lossless strategy): the optimizer's
            constructor splits a group of this config into this many sub-groups of about equal
            element counts, each with its own distributor, as the reference library does
            (``param_group_split.split_param_groups``). The reference overlaps the sub-groups'
            exchanges on CUDA streams; here they step one after another. The numbers are those
            of one group.
        load_balancing_config: the cost model ``ROUND_ROBIN`` balances when it assigns whole
            parameters to owner ranks (default: aligned bytes); unused by the other strategies.
    """

    param_assignment_strategy: FSDPParamAssignmentStrategy = FSDPParamAssignmentStrategy.DEFAULT
    communication_dtype: torch.dtype = torch.float32
    communicate_params: bool = False
    num_sub_groups: int = 1
    load_balancing_config: LoadBalancingConfig = field(default_factory=LoadBalancingConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
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
            ``None``: the parameters' own mesh. Not checked here, as in the reference library
            (``split_param_groups`` reads only its ``size(1)``, so a stand-in serves it); the
            optimizer refuses anything else before it splits or builds the group
            (:func:`check_hsdp_device_mesh`).
        communication_dtype: dtype the updates (or parameters) travel in; a float dtype.
        num_trainers_per_group: replicas sharing the blocks; ``-1`` = all replicas (the only
            other accepted value is the replicate dim's size).
        communicate_params: send updated parameters instead of updates ``-lr * P``.
        param_assignment_strategy: the strategy within a replica (shard dim).
        num_sub_groups: as in :class:`FullyShardDistributedConfig`.
        load_balancing_config: the cost model of both assignments: owners within a replica
            (``ROUND_ROBIN``) and work blocks over the replicas.
    """

    device_mesh: object | None = None
    communication_dtype: torch.dtype = torch.float32
    num_trainers_per_group: int = -1
    communicate_params: bool = False
    param_assignment_strategy: FSDPParamAssignmentStrategy = FSDPParamAssignmentStrategy.DEFAULT
    num_sub_groups: int = 1
    load_balancing_config: LoadBalancingConfig = field(default_factory=LoadBalancingConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        # The reference's order: num_sub_groups (its parent's rule) first.
        _check_sharded_exchange_fields(self)
        _check_num_trainers_per_group(self.num_trainers_per_group)
        if not isinstance(self.param_assignment_strategy, FSDPParamAssignmentStrategy):
            raise ValueError(
                "param_assignment_strategy must be an FSDPParamAssignmentStrategy, got "
                f"{self.param_assignment_strategy!r}"
            )


def check_hsdp_device_mesh(config: HybridShardDistributedConfig) -> None:
    """Refuse a ``device_mesh`` the HSDP distributor cannot use: anything but None or a 2-D
    ``DeviceMesh`` (``ValueError`` naming ``device_mesh``, one line). Called by the optimizer
    before it splits or builds the group, so nothing has been touched yet."""
    mesh = config.device_mesh
    if mesh is None:
        return
    is_mesh = False
    try:
        from torch.distributed.device_mesh import DeviceMesh

        is_mesh = isinstance(mesh, DeviceMesh)
    except ImportError:  # a torch built without torch.distributed: no mesh is usable
        pass
    if is_mesh and mesh.ndim == 2:
        return
    got = f"a {mesh.ndim}-D DeviceMesh" if is_mesh else f"a {type(mesh).__name__}"
    raise refuse(
        "device_mesh",
        f"device_mesh must be None or a 2-D DeviceMesh (replicate x shard) to build "
        f"HybridShardDistributedConfig's distributor, got {got}",
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
        communication_dtype, num_trainers_per_group, communicate_params,
            load_balancing_config: as for :class:`DDPDistributedConfig` (unused).
    """

    device_mesh: object | None = None
    communication_dtype: torch.dtype = torch.float32
    num_trainers_per_group: int = -1
    communicate_params: bool = False
    load_balancing_config: LoadBalancingConfig = field(default_factory=LoadBalancingConfig)
