"""``split_param_groups``: the reference library's ``num_sub_groups`` split of FSDP2/HSDP groups.

A group whose ``distributed_config`` is a :class:`FullyShardDistributedConfig` or
:class:`HybridShardDistributedConfig` with ``num_sub_groups = n > 1`` becomes up to ``n``
groups over the same parameters; every other group passes through as the same object. The
reference library does this in its optimizer's constructor so that each sub-group gets its own
distributor (and NCCL communicator) whose exchanges overlap on CUDA streams;
:class:`DistributedShampoo` does it at the same point. Here the sub-groups step one after
another, so the split buys no overlap; it is done for parity: the same ``param_groups`` as the
reference's for the same script, and so the same grouping in the state dicts.

The numbers do not change: the lossless strategies (``REPLICATE``, ``ROUND_ROBIN``, the only
ones ``num_sub_groups > 1`` is accepted with) compute every block exactly as one device does,
whichever group holds it, and every sub-group keeps all of the group's other entries.

How the parameters are divided (the reference's documented rule): greedy longest-first bin
packing on ``numel`` (:func:`greedy_bin_pack`: largest first, equal sizes in decreasing
position, each to the lightest sub-group, ties to the lower one), so the sub-groups hold about
equal element counts; within a sub-group the parameters are in placing order (largest first).
Sub-groups left empty (zero-size parameters can leave one) are dropped. Each sub-group gets a
shallow copy of the config (its own object, equal fields) and, if the group names its
parameters (``param_names``, or ``(name, tensor)`` pairs in ``params``), its parameters'
names in the same order.

The owner map (``OWNER_RANKS = "owner_ranks"``, as in the reference library): every group
under ``ROUND_ROBIN``, split or not, gets the shard rank that computes each of its parameters,
a list aligned to its ``params``, which its distributor reads. The owners are chosen greedily,
longest first by the cost model of the config's ``load_balancing_config`` (default: bytes),
sub-group after sub-group with each rank's load carried from one to the next
(:func:`owner_ranks_by_bucket`): so every sub-group reaches every shard rank when it can, and
the whole group's load is balanced. The owner space is the shard group: the mesh's shard dim
under HSDP (the config's mesh, else the parameters'), the parameters' mesh under FSDP2, else
the world size; without a process group (nor mesh) no map is attached and the distributor
computes the same one. A map the group already carries is kept, cut with its parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from nanoshampoo.optim.shampoo.config_checks import field_error
from nanoshampoo.optim.shampoo.distributor.distributor_types import (
    FSDPParamAssignmentStrategy,
    FullyShardDistributedConfig,
    HybridShardDistributedConfig,
    check_hsdp_device_mesh,
)
from nanoshampoo.optim.shampoo.shampoo_types import OWNER_RANKS
from nanoshampoo.optim.shampoo.utils.shampoo_utils import greedy_bin_pack, owner_ranks_by_bucket

__all__ = ["split_constructor_params", "split_param_groups"]


def split_param_groups(param_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The groups with every FSDP2/HSDP group of ``num_sub_groups > 1`` replaced by its sub-groups.

    Args:
        param_groups: param group dicts (``"params"``: a tensor, or a list or tuple of tensors
            or of ``(name, tensor)`` pairs; ``"distributed_config"``); groups without such a
            config, or with another entry that torch would refuse (a set of parameters), pass
            through unchanged for ``add_param_group`` to judge.

    Returns:
        A new list: the untouched groups (the same dict objects); in place of each unsplit
        ``ROUND_ROBIN`` group, a new dict with its owner map (``owner_ranks``) added; in place
        of each split group, its sub-groups (new dicts, with their owner maps under
        ``ROUND_ROBIN``) in sub-group order.

    Raises:
        ValueError: naming ``num_sub_groups``, when it exceeds the group's parameter count
            divided by the shard size (``device_mesh.size(1)`` under HSDP, 1 under FSDP2), or
            when, under HSDP, the packing leaves a sub-group with fewer parameters than the
            shard size (one parameter much larger than the rest). The reference refuses both
            as degenerate sub-groups; nothing is returned half split. Naming ``owner_ranks``,
            when a group's own map is not a list or tuple of one entry per parameter.

    Example:
        >>> from nanoshampoo.optim.shampoo import FSDPParamAssignmentStrategy
        >>> config = FullyShardDistributedConfig(
        ...     param_assignment_strategy=FSDPParamAssignmentStrategy.REPLICATE, num_sub_groups=2)
        >>> params = [torch.zeros(n) for n in (5, 3, 3, 1)]
        >>> group = {"params": params, "distributed_config": config, "lr": 0.1}
        >>> groups = split_param_groups([group])
        >>> [([p.numel() for p in g["params"]], g["lr"]) for g in groups]
        [([5, 1], 0.1), ([3, 3], 0.1)]
    """
    result: list[dict[str, Any]] = []
    for group in param_groups:
        config = group.get("distributed_config")
        params = _param_list(group.get("params"))
        if params is None:
            result.append(group)
        elif _should_split(config):
            result.extend(_sub_groups(group, params, config))
        elif _is_round_robin(config) and group.get(OWNER_RANKS) is None:
            owners = _owner_ranks(config, [params])
            result.append(group if owners is None else {**group, OWNER_RANKS: owners[0]})
        else:
            result.append(group)
    return result


def _is_round_robin(config: object) -> bool:
    return (
        isinstance(config, (FullyShardDistributedConfig, HybridShardDistributedConfig))
        and config.param_assignment_strategy == FSDPParamAssignmentStrategy.ROUND_ROBIN
    )


def _owner_space(
    config: FullyShardDistributedConfig | HybridShardDistributedConfig, params: list[Any]
) -> int | None:
    """The ranks that may own a parameter: the shard group's size (see the module doc), or
    None when neither a mesh nor a process group says it."""
    if isinstance(config, HybridShardDistributedConfig):
        mesh = config.device_mesh
        if mesh is None and params:
            mesh = getattr(_tensor(params[0]), "device_mesh", None)
        return None if mesh is None else int(mesh.size(1))
    mesh = getattr(_tensor(params[0]), "device_mesh", None) if params else None
    if mesh is not None:
        return int(mesh.size(0))
    if not dist.is_available():
        return None
    try:
        return int(dist.get_world_size())
    except (ValueError, RuntimeError):  # no default process group
        return None


def _owner_ranks(
    config: FullyShardDistributedConfig | HybridShardDistributedConfig,
    buckets: list[list[Any]],
) -> list[list[int]] | None:
    """Per bucket (a sub-group's ``params`` entries), its parameters' owners with the load
    carried over the buckets (:func:`owner_ranks_by_bucket`); None without an owner space."""
    entries = [p for bucket in buckets for p in bucket]
    if not all(isinstance(_tensor(p), torch.Tensor) for p in entries):
        return None  # add_param_group refuses such params, in torch's words
    size = _owner_space(config, entries)
    if size is None:
        return None
    tensors = [[_tensor(p) for p in bucket] for bucket in buckets]
    return owner_ranks_by_bucket(tensors, size, config.load_balancing_config)


def _should_split(config: object) -> bool:
    return (
        isinstance(config, (FullyShardDistributedConfig, HybridShardDistributedConfig))
        and config.num_sub_groups > 1
    )


def _param_list(params: object) -> list[Any] | None:
    """The group's parameters as a list; None for what ``add_param_group`` must refuse."""
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, (list, tuple)):
        return list(params)
    return None


def _tensor(entry: Any) -> torch.Tensor:
    """A ``params`` entry's tensor: the entry, or the tensor of a ``(name, tensor)`` pair."""
    return entry[1] if isinstance(entry, tuple) and len(entry) == 2 else entry


def _shard_size(
    config: FullyShardDistributedConfig | HybridShardDistributedConfig, params: list[Any]
) -> int:
    """Ranks per shard group under HSDP (the config's mesh, else the parameters'); 1 under FSDP2."""
    if not isinstance(config, HybridShardDistributedConfig):
        return 1
    mesh = config.device_mesh
    if mesh is None and params:
        mesh = getattr(_tensor(params[0]), "device_mesh", None)
    return 1 if mesh is None else int(mesh.size(1))


def _sub_groups(
    group: dict[str, Any],
    params: list[Any],
    config: FullyShardDistributedConfig | HybridShardDistributedConfig,
) -> list[dict[str, Any]]:
    """Validate, then pack ``params`` into the sub-groups of ``group`` (see the module doc)."""
    wanted = config.num_sub_groups
    shard_size = _shard_size(config, params)
    most = max(1, len(params) // shard_size)
    # Both refusals start with the reference's facts, in its words, then say what to change.
    if wanted > most:
        raise ValueError(
            f"num_sub_groups={wanted} is too large for {len(params)} params with "
            f"shard_group_size={shard_size}: each sub-group needs at least {shard_size} params, "
            f"so at most {most} sub-groups"
        )
    names = group.get("param_names")
    bins, _ = greedy_bin_pack(range(len(params)), wanted, lambda i: _tensor(params[i]).numel())
    for i, b in enumerate(bins):
        if b and len(b) < shard_size:
            raise ValueError(
                f"HSDP sub-group {i} got {len(b)} params after greedy bin-packing, fewer than "
                f"shard_size={shard_size}. A parameter much larger than the rest leaves it short "
                f"(num_sub_groups={wanted}): use fewer sub-groups"
            )
    bins = [b for b in bins if b]
    given = group.get(OWNER_RANKS)
    if given is not None and (not isinstance(given, (list, tuple)) or len(given) != len(params)):
        got = f"{len(given)} entries" if isinstance(given, (list, tuple)) else type(given).__name__
        raise field_error(
            OWNER_RANKS,
            f"owner_ranks must be a list of one owner rank per parameter of the group "
            f"({len(params)} params), got {got}",
        )
    if given is not None:
        owners: list[list[Any]] | None = [[given[i] for i in indices] for indices in bins]
    elif _is_round_robin(config):
        owners = _owner_ranks(config, [[params[i] for i in indices] for indices in bins])
    else:
        owners = None
    others = {
        k: v
        for k, v in group.items()
        if k not in ("params", "param_names", "distributed_config", OWNER_RANKS)
    }
    subs = []
    for b, indices in enumerate(bins):
        sub = {
            **others,
            "params": [params[i] for i in indices],
            "distributed_config": copy.copy(config),
        }
        if names is not None:
            sub["param_names"] = [names[i] for i in indices]
        if owners is not None:
            sub[OWNER_RANKS] = owners[b]
        subs.append(sub)
    return subs


def split_constructor_params(params: list[Any], default_config: object) -> list[Any]:
    """``DistributedShampoo``'s ``params`` argument with :func:`split_param_groups` applied.

    The reference splits its groups after merging the constructor's defaults into them; here
    the split comes before torch builds the groups, so a group (or a plain list of tensors, one
    group) without its own ``distributed_config`` is split by ``default_config``. What is not
    split is returned as given (the user's own dicts, or the plain list).
    """
    if not params:
        return params
    is_groups = isinstance(params[0], dict)
    groups = params if is_groups else [{"params": params}]
    result: list[Any] = []
    for group in groups:
        resolved = (
            group
            if "distributed_config" in group
            else {**group, "distributed_config": default_config}
        )
        if isinstance(resolved["distributed_config"], HybridShardDistributedConfig):
            # The split reads the mesh's shard size: refuse an unusable mesh first (one line).
            check_hsdp_device_mesh(resolved["distributed_config"])
        split = split_param_groups([resolved])
        result.extend([group] if split[0] is resolved else split)
    if not is_groups and result[0] is groups[0]:
        return params
    return result
