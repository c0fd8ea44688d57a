"""Checks of a state dict before :meth:`DistributedShampoo.load_state_dict` writes anything.

Everything here reads the optimizer's groups and runtimes and the saved dict, and changes
nothing: the groups' merged entries and hyperparameters (:func:`plan_loaded_groups`), and every
block state's keys, shapes, dtypes and finiteness (:func:`check_loaded_block_states`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nanoshampoo.optim.shampoo.group_runtime import GroupRuntime
from nanoshampoo.optim.shampoo.group_validation import Hyperparameters
from nanoshampoo.validation import check_bool, check_float, check_int


def group_param_indices(param_groups: Sequence[Mapping[str, Any]]) -> list[list[int]]:
    """Per group, the optimizer-wide indices of its parameters."""
    first, indices = 0, []
    for group in param_groups:
        indices.append(list(range(first, first + len(group["params"]))))
        first += len(group["params"])
    return indices


def expected_state(runtimes: Sequence[GroupRuntime]) -> dict[int, dict[str, tuple[torch.Size, torch.dtype]]]:
    """Per parameter index, every flat block-state key this rank holds, with its shape and dtype."""
    expected: dict[int, dict[str, tuple[torch.Size, torch.dtype]]] = {}
    for runtime in runtimes:
        for local_index, info in enumerate(runtime.block_infos):
            entries = runtime.expected_block_state(local_index, runtime.hyperparameters)
            expected.setdefault(info.composable_block_ids[0], {}).update(entries)
    return expected


def plan_loaded_groups(
    saved_groups: Sequence[Mapping[str, Any]], param_groups: Sequence[Mapping[str, Any]],
    runtimes: Sequence[GroupRuntime],
) -> list[tuple[dict[str, Any], Hyperparameters, int, tuple[float, bool] | None]]:
    """Per group: the merged entries, their hyperparameters, the step and, under primal
    averaging, ``(lr_sum, train_mode)`` (changes nothing)."""
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"state_dict has {len(saved_groups)} param groups, the optimizer has {len(param_groups)}"
        )
    plans: list[tuple[dict[str, Any], Hyperparameters, int, tuple[float, bool] | None]] = []
    for index, (saved, group, runtime) in enumerate(zip(saved_groups, param_groups, runtimes)):
        where = f"state_dict param_groups[{index}]"
        if len(saved.get("params", ())) != len(group["params"]):
            raise ValueError(
                f"{where} has {len(saved.get('params', ()))} params, the optimizer's group has "
                f"{len(group['params'])}"
            )
        step = check_int(f"{where}['step']", saved.get("step"), at_least=0)
        merged = dict(group)
        for key, value in saved.items():
            if key not in ("params", "step", "lr_sum", "train_mode") and key in group:
                merged[key] = tuple(value) if isinstance(value, list) and isinstance(group[key], tuple) else value
        try:
            hyperparameters = runtime.plan(merged)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        averaging = None
        if hyperparameters.primal_averaging is not None:
            averaging = loaded_averaging_state(saved, where)
        plans.append((merged, hyperparameters, step, averaging))
    return plans


def check_loaded_block_states(
    runtimes: Sequence[GroupRuntime], saved_state: Mapping[int, Mapping[str, Any]], plans: Sequence[Hyperparameters]
) -> None:
    """Raise unless ``saved_state`` holds exactly the block states of ``plans``, each a
    tensor of the expected shape and dtype (``KeyError`` for a missing or extra key)."""
    unexpected = {index: set(entries) for index, entries in saved_state.items()}
    for runtime, hyperparameters in zip(runtimes, plans):
        for local_index, info in enumerate(runtime.block_infos):
            param_index = info.composable_block_ids[0]
            entries = saved_state.get(param_index, {})
            for key, (shape, dtype) in runtime.expected_block_state(local_index, hyperparameters).items():
                if key not in entries:
                    raise KeyError(f"missing block state {param_index}.{key} in state_dict")
                value = entries[key]
                if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(
                    torch.isfinite(value).all()
                ):
                    raise ValueError(
                        f"state_dict block state {param_index}.{key} holds NaN or Inf: a step "
                        "from it would turn the parameters non-finite"
                    )
                if not isinstance(value, torch.Tensor) or value.shape != shape or value.dtype != dtype:
                    got = (
                        f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                        else type(value).__name__
                    )
                    raise ValueError(
                        f"state_dict block state {param_index}.{key} must be a {dtype} tensor of "
                        f"shape {tuple(shape)}, got {got}"
                    )
                unexpected[param_index].discard(key)
    leftover = sorted(f"{index}.{key}" for index, keys in unexpected.items() for key in keys)
    if leftover:
        raise KeyError(f"unexpected block state in state_dict: {leftover}")


def loaded_averaging_state(saved: Mapping[str, Any], where: str) -> tuple[float, bool]:
    """``(lr_sum, train_mode)`` of a saved primal-averaging group; ``ValueError`` if malformed."""
    lr_sum = check_float(f"{where}['lr_sum']", saved.get("lr_sum"), at_least=0.0)
    train_mode = check_bool(f"{where}['train_mode']", saved.get("train_mode"))
    return float(lr_sum), train_mode
