"""Loading a state dict through torch's own ``Optimizer.load_state_dict``: the hooks and checks.

torch's ``load_state_dict`` runs the load pre-hooks, maps the saved parameter ids (indices, or
FQNs from ``torch.distributed.checkpoint``) to the parameters by position, casts every floating
tensor to its parameter's dtype and device, hands the result to ``__setstate__``, and runs the
post-hooks. DistributedShampoo takes part at each point:

1. load pre-hook (:func:`prepare_load`): checks the dict's form, converts this optimizer's
   earlier flat layout (``state_dict_layout.from_flat_layout``), re-keys named parameters onto
   another grouping (``state_dict_regrouping.py``), and remembers the caller's train/eval mode
   and the saved tensors as they were before torch's cast (:class:`PendingLoad`);
2. ``__setstate__``: :func:`plan_load` checks everything and changes nothing; then
   :func:`apply_load` writes. A tensor whose dtype torch's cast changed (a float64 factor under
   float32 parameters, a bfloat16 parameter's float32 state, an earlier float64 ``lr_sum``) is
   taken from the saved original, so a resume is not rounded, and a group's float64 sum
   (``state_dict_layout.LR_SUM_EXACT``) replaces its float32 ``lr_sum`` while it rounds to it;
3. load post-hook: each group goes back to the caller's train/eval mode (primal averaging moves
   the parameters, as ``train()`` / ``eval()`` do), as in the reference library.

The checks (all before anything is written): the number of groups and of their parameters;
each group's entries, validated like the constructor's, with the entries fixed at construction
(``max_preconditioner_dim``...) equal to the optimizer's; each group's scalars (``step``, and
under primal averaging ``lr_sum`` and ``train_mode``), equal under every parameter of the group;
and every local block: exactly the entries the block has under the loaded hyperparameters
(momentum and filtered gradient only where in use), each a finite tensor of the block state's
shape and dtype (roots packed or full). ``failure_counts`` may be absent (they start at 0) and so
may SOAP's ``eigenvectors_computed`` (filled with ``step >= start_preconditioning_step``).
Another library's config objects of our class names (the reference's) load as ours
(:func:`as_our_config`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from nanoshampoo.optim.shampoo.group_runtime import GroupRuntime
from nanoshampoo.optim.shampoo.group_validation import FIXED_GROUP_KEYS, Hyperparameters
from nanoshampoo.optim.shampoo.shampoo_types import (
    CHECKPOINT_GLOBALS,
    DISTRIBUTED_CONFIG,
    LR_SUM,
    OWNER_RANKS,
    PARAMS,
    STEP,
    TRAIN_MODE,
)
from nanoshampoo.optim.shampoo.state_dict_layout import (
    BASES,
    EIGENVECTORS_COMPUTED,
    EXTENSION_DEFAULTS,
    FACTORS,
    FAILURE_COUNTS,
    GROUP_SCALARS,
    LR_SUM_EXACT,
    ROOTS,
    as_float32,
    from_flat_layout,
    is_block_key,
    is_flat_layout,
    loaded_factor,
    reorder_soap_bases,
    saved_key,
)
from nanoshampoo.optim.shampoo.state_dict_regrouping import regroup_by_param_names
from nanoshampoo.optim.shampoo.state_dict_trees import flatten_tree
from nanoshampoo.optim.shampoo.utils.shampoo_utils import unpack_upper_triangular
from nanoshampoo.validation import check_bool, check_float, check_int


@dataclass
class PendingLoad:
    """What the pre-hook keeps for ``__setstate__`` and the post-hook.

    ``originals``: per parameter index (position in the optimizer's groups), its saved state
    entry before torch's cast; ``train_modes``: per group, the mode before the load.
    """

    originals: dict[int, Mapping[Any, Any]]
    train_modes: list[bool]


@dataclass
class GroupLoad:
    """One group's checked load: its entries, their hyperparameters, its scalars, and per local
    block the tensors to copy, keyed by our flat block-state keys (roots unpacked)."""

    entries: dict[str, Any]
    hyperparameters: Hyperparameters
    step: int
    averaging: tuple[float, bool] | None
    blocks: list[dict[str, torch.Tensor]]


def prepare_load(state_dict: Any, param_groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The load pre-hook's dict: checked for form, in the nested layout, keyed by position onto
    ``param_groups`` where the parameters are named. Raises ``ValueError`` for a dict that is not
    an optimizer state dict or is another optimizer's (``torch.optim.Adam``, ``DistAdam``...)."""
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= state_dict.keys():
        raise ValueError("state_dict must be a mapping with 'state' and 'param_groups'")
    groups, state = state_dict["param_groups"], state_dict["state"]
    if (
        not isinstance(state, Mapping)
        or not isinstance(groups, Sequence)
        or not all(isinstance(g, Mapping) and isinstance(g.get(PARAMS), Sequence) for g in groups)
    ):
        raise ValueError(
            "state_dict['state'] must be a mapping and state_dict['param_groups'] a list of "
            "dicts with 'params'"
        )
    if any(not isinstance(entry, Mapping) for entry in state.values()):
        raise ValueError("state_dict['state'] must map parameters to dicts of their state")
    if is_flat_layout(state_dict):
        state_dict = from_flat_layout(state_dict)
    _check_not_foreign(state_dict["state"])
    return dict(regroup_by_param_names(state_dict, param_groups))


def _check_not_foreign(state: Mapping[Any, Mapping[Any, Any]]) -> None:
    """``ValueError`` for another optimizer's state: entries beside the scalars, none a block."""
    keys = {str(key) for entry in state.values() for key in entry}
    others = sorted(keys - set(GROUP_SCALARS))
    if others and not any(is_block_key(key) for key in others):
        raise ValueError(
            f"state_dict is from another optimizer, not DistributedShampoo: its state has keys "
            f"{others[:3]} (DistributedShampoo's state holds 'block_<j>' dicts and 'step')"
        )


def originals_by_position(
    state_dict: Mapping[str, Any], param_groups: Sequence[Mapping[str, Any]]
) -> dict[int, Mapping[Any, Any]]:
    """Per parameter index, the saved entry torch will map to it (saved ids matched by position,
    as torch's ``load_state_dict`` matches them)."""
    saved_ids = list(chain.from_iterable(g[PARAMS] for g in state_dict["param_groups"]))
    count = sum(len(g[PARAMS]) for g in param_groups)
    return {
        position: state_dict["state"][key]
        for position, key in enumerate(saved_ids[:count])
        if key in state_dict["state"]
    }


def _exact(value: Any, original: Any) -> Any:
    """``original`` where ``value`` is torch's cast of it to another dtype, else ``value``."""
    if (
        isinstance(value, torch.Tensor)
        and isinstance(original, torch.Tensor)
        and original.dtype != value.dtype
        and original.shape == value.shape
        and torch.equal(original.to(device=value.device, dtype=value.dtype), value)
    ):
        return original
    return value


def plan_load(
    runtimes: Sequence[GroupRuntime],
    param_groups: Sequence[Mapping[str, Any]],
    loaded_groups: Sequence[Mapping[str, Any]],
    loaded_state: Mapping[Any, Any],
    index_of: Callable[[Any], int | None],
    originals: Mapping[int, Mapping[Any, Any]],
) -> list[GroupLoad]:
    """Check a load (torch's ``__setstate__`` argument) against the optimizer; change nothing.

    ``index_of``: a state key (a parameter, or an index) to its parameter index, None if it is
    not one. Raises ``ValueError`` (a malformed group, scalar or tensor) or ``KeyError`` (a
    missing or unexpected entry).
    """
    if len(loaded_groups) != len(param_groups):
        raise ValueError(
            f"state_dict has {len(loaded_groups)} param groups, the optimizer has "
            f"{len(param_groups)}"
        )
    state: dict[int, Mapping[Any, Any]] = {}
    for key, entry in loaded_state.items():
        index = index_of(key)
        if index is None:
            raise KeyError(
                f"state_dict['state'] has an entry {key!r} for no parameter of the optimizer"
            )
        state[index] = entry
    unexpected = {(i, str(k)) for i, entry in state.items() for k in entry}
    plans, first = [], 0
    for g, (runtime, group, loaded) in enumerate(zip(runtimes, param_groups, loaded_groups)):
        where = f"state_dict param_groups[{g}]"
        indices = range(first, first + len(group[PARAMS]))
        first += len(group[PARAMS])
        if len(loaded.get(PARAMS, ())) != len(indices):
            raise ValueError(
                f"{where} has {len(loaded.get(PARAMS, ()))} params, the optimizer's group has "
                f"{len(indices)}"
            )
        try:
            entries = _completed_entries(loaded, group, where)
            hyperparameters = runtime.plan(entries)
        except ValueError as error:
            message = str(error)
            raise ValueError(
                message if message.startswith(where) else f"{where}: {message}"
            ) from None
        averaging = hyperparameters.primal_averaging is not None
        scalars = _group_scalars(state, originals, indices, averaging, g)
        unexpected -= {(i, name) for i in indices for name in GROUP_SCALARS if name in scalars[1]}
        blocks = []
        for local_index, info in enumerate(runtime.block_infos):
            index, block_name = info.composable_block_ids
            unexpected.discard((index, block_name))
            blocks.append(
                _block_load(
                    runtime,
                    local_index,
                    hyperparameters,
                    state.get(index, {}).get(block_name),
                    originals.get(index, {}).get(block_name),
                    scalars[0],
                    index,
                )
            )
        step, found = scalars
        lr_sum_and_mode = (_lr_sum(found[LR_SUM], loaded), found[TRAIN_MODE]) if averaging else None
        plans.append(GroupLoad(entries, hyperparameters, step, lr_sum_and_mode, blocks))
    if unexpected:
        raise KeyError(
            f"unexpected state in state_dict: {sorted(f'{i}.{k}' for i, k in unexpected)[:4]}"
        )
    return plans


def _lr_sum(saved: float, group: Mapping[str, Any]) -> float:
    """The group's Schedule-Free sum: its float64 value (:data:`LR_SUM_EXACT`) where the group
    carries one that rounds to the saved ``lr_sum``, else the saved ``lr_sum``."""
    exact = group.get(LR_SUM_EXACT)
    if isinstance(exact, float) and as_float32(exact) == saved:
        return exact
    return saved


_OURS_BY_NAME = {value.__name__: value for value in CHECKPOINT_GLOBALS if isinstance(value, type)}


def _is_foreign(value: Any) -> bool:
    """Whether ``value`` is another library's object of one of our config class names."""
    ours = _OURS_BY_NAME.get(type(value).__name__)
    return ours is not None and not isinstance(value, ours)


def as_our_config(value: Any, where: str) -> Any:
    """``value`` as this library's config when it is another library's of the same class name
    (the reference library's configs and ``WeightDecayType`` share our names and fields), so
    that its state dicts load here; anything else is returned as it is.

    Raises ``ValueError`` naming the field when the other config sets a field this library's
    class lacks to a value other than that field's default (it would be dropped).
    """
    if not _is_foreign(value):
        return value
    cls = type(value)
    ours = _OURS_BY_NAME[cls.__name__]
    if isinstance(value, enum.Enum) and issubclass(ours, enum.Enum):
        return ours[value.name]
    if not dataclasses.is_dataclass(value):
        return value
    known = {f.name for f in dataclasses.fields(ours) if f.init}
    kwargs = {}
    for field in (f for f in dataclasses.fields(value) if f.init):
        item = getattr(value, field.name)
        if field.name in known:
            kwargs[field.name] = as_our_config(item, f"{where}.{field.name}")
        elif item != _field_default(field):
            raise ValueError(
                f"{where}: {cls.__name__}.{field.name}={item!r} has no counterpart in this "
                f"library's {cls.__name__}"
            )
    return ours(**kwargs)


def _field_default(field: dataclasses.Field[Any]) -> Any:
    """A dataclass field's default (its factory's value), or ``MISSING``."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _completed_entries(
    loaded: Mapping[str, Any], group: Mapping[str, Any], where: str
) -> dict[str, Any]:
    """The loaded group's entries, with the ones it lacks: an extension entry takes its default
    (a saved group leaves it out there), any other the optimizer's current value; lists where
    the optimizer holds tuples (``betas`` after a JSON round trip) become tuples, and another
    library's config objects this library's (:func:`as_our_config`). The optimizer's own entry
    stays for ``distributed_config`` and ``owner_ranks`` (a checkpoint may come from another
    distributor or world size, or from before groups carried an owner map; the owners decide
    no number) and for another library's config at an entry fixed at construction (it describes how
    that library built the group, in its own defaults: its ``inv_factor_matrix_dtype=float32``
    is our ``None`` for float32 blocks); the blocks' state is then checked one by one."""
    entries = {
        k: group[k]
        if k in FIXED_GROUP_KEYS and _is_foreign(v)
        else as_our_config(v, f"{where}[{k!r}]")
        for k, v in loaded.items()
        if k not in (PARAMS, DISTRIBUTED_CONFIG, OWNER_RANKS, LR_SUM_EXACT)
    }
    for key, value in group.items():
        if key == PARAMS:
            continue
        if key not in entries:
            entries[key] = EXTENSION_DEFAULTS.get(key, value)
        elif isinstance(entries[key], list) and isinstance(value, tuple):
            entries[key] = tuple(entries[key])
    entries[PARAMS] = group[PARAMS]
    return entries


def _group_scalars(
    state: Mapping[int, Mapping[Any, Any]],
    originals: Mapping[int, Mapping[Any, Any]],
    indices: range,
    averaging: bool,
    g: int,
) -> tuple[int, dict[str, Any]]:
    """``(step, {name: value})`` of group ``g``, from every parameter that carries them."""
    names = tuple(GROUP_SCALARS) if averaging else (STEP,)
    found: dict[str, Any] = {}
    for name in names:
        values = {}
        for i in indices:
            if name in state.get(i, {}):
                value = _exact(state[i][name], originals.get(i, {}).get(name))
                values[i] = _scalar_value(name, value, f"state_dict state[{i}]['{name}']")
        if indices and not values:
            raise KeyError(f"missing state {indices[0]}.{name} in state_dict (param_groups[{g}])")
        if len(set(values.values())) > 1:
            raise ValueError(
                f"state_dict: the parameters of param_groups[{g}] hold different {name} values "
                f"{sorted(set(values.values()))}; the {name} is one tensor aliased across "
                "parameters sharing a group"
            )
        found[name] = next(iter(values.values()), 0 if name == STEP else None)
    return found[STEP], found


def _scalar_value(name: str, value: Any, where: str) -> Any:
    """The Python value of a saved group scalar (a 0-dim tensor or a number), checked."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{where} must hold one value, got shape {tuple(value.shape)}")
        value = value.item()
    if name == STEP:
        if isinstance(value, float) and value.is_integer():  # torch.optim's steps are floats
            value = int(value)
        return check_int(where, value, at_least=0)
    if name == LR_SUM:
        return float(check_float(where, value, at_least=0.0))
    return check_bool(where, value)


def _block_load(
    runtime: GroupRuntime,
    local_index: int,
    hyperparameters: Hyperparameters,
    saved: Any,
    original: Any,
    step: int,
    index: int,
) -> dict[str, torch.Tensor]:
    """The checked tensors of one local block, keyed by our flat keys (changes nothing)."""
    _, block_name = runtime.block_infos[local_index].composable_block_ids
    if not isinstance(saved, Mapping):
        raise KeyError(f"missing block state {index}.{block_name} in state_dict")
    computed = step >= hyperparameters.start_preconditioning_step
    received = flatten_tree(_ours_soap_order(saved, computed), block_name)
    exact = (
        flatten_tree(_ours_soap_order(original, computed), block_name)
        if isinstance(original, Mapping)
        else {}
    )
    expected = runtime.expected_block_state(local_index, hyperparameters)
    names = {key.split(".")[1] for key in expected}
    values: dict[str, torch.Tensor] = {}
    for key, (shape, dtype) in expected.items():
        name = saved_key(key, names)
        where = f"state_dict block state {index}.{name}"
        if name not in received:
            if f".{FAILURE_COUNTS}." in name:
                values[key] = torch.zeros(shape, dtype=dtype)
                continue
            if f".{EIGENVECTORS_COMPUTED}." in name:
                values[key] = torch.full(shape, computed, dtype=dtype)
                continue
            raise KeyError(f"missing block state {index}.{name} in state_dict")
        value = _exact(received.pop(name), exact.get(name))
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"{where} must be a {dtype} tensor of shape {tuple(shape)}, got "
                f"{type(value).__name__}"
            )
        if (
            f".{ROOTS}." in name
            and len(shape) == 2
            and value.dim() == 1
            and value.numel() == shape[0] * (shape[0] + 1) // 2
        ):
            value = unpack_upper_triangular(value, shape[0])
        if key.split(".")[-2] == FACTORS and len(shape) == 1:
            result_shapes = [expected.get(_sibling(key, name)) for name in (ROOTS, BASES)]
            sizes = [s[0][-1] for s in result_shapes if s is not None]
            if sizes:
                value = loaded_factor(value, sizes[0], shape[0])
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ValueError(
                f"{where} holds NaN or Inf: a step from it would turn the parameters non-finite"
            )
        if value.shape != shape or value.dtype != dtype:
            raise ValueError(
                f"{where} must be a {dtype} tensor of shape {tuple(shape)}, got {value.dtype} "
                f"{tuple(value.shape)}"
            )
        values[key] = value
    if received:
        raise KeyError(
            f"unexpected block state in state_dict: {sorted(f'{index}.{k}' for k in received)[:4]}"
        )
    return values


def _sibling(key: str, name: str) -> str:
    """``key`` (``block_j.<module>.<entry>.<dim>``) with its entry renamed ``name``."""
    parts = key.split(".")
    return ".".join([*parts[:-2], name, parts[-1]])


def _ours_soap_order(block: Mapping[Any, Any], computed_by_default: bool) -> Mapping[Any, Any]:
    """A saved block with SOAP's bases and ``D`` in our (descending) order."""
    shampoo = block.get("shampoo")
    reordered = reorder_soap_bases(shampoo, computed_by_default)
    return block if reordered is shampoo else {**block, "shampoo": reordered}


def apply_load(
    runtimes: Sequence[GroupRuntime],
    param_groups: Sequence[dict[str, Any]],
    plans: Sequence[GroupLoad],
    register: Callable[[int], None],
) -> None:
    """Write checked loads: each group's entries (in place), hyperparameters, scalars and block
    tensors; ``register(g)`` re-registers group ``g``'s live state after its runtime rebuilt it."""
    for g, (runtime, group, plan) in enumerate(zip(runtimes, param_groups, plans)):
        group.clear()
        group.update(plan.entries)
        runtime.configure(plan.hyperparameters)
        runtime.step = plan.step
        if plan.averaging is not None:
            runtime.lr_power_sum, runtime.train_mode = plan.averaging
        for local_index, values in enumerate(plan.blocks):
            _, block_name = runtime.block_infos[local_index].composable_block_ids
            targets = flatten_tree(runtime.block_states[local_index].state_dict(), block_name)
            for key, target in targets.items():
                target.copy_(values[key])
        runtime.preconditioner.forget_filtered()
        register(g)
