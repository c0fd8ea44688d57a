"""Test helper: a ``DistributedShampoo`` state dict's per-parameter entries as flat keys.

``state_dict()["state"][i]`` nests each block's state (``{"block_0": {"shampoo":
{"factor_matrices": {0: F}}}, "step": t}``); the tests compare entries one tensor at a time, so
they read them as ``{"block_0.shampoo.factor_matrices.0": F, "step": t}``, cloned.
"""

from __future__ import annotations

from typing import Any

import torch

from nanoshampoo.optim.shampoo.state_dict_trees import flatten_tree


def flat_state(state_dict: dict[str, Any]) -> dict[Any, dict[str, torch.Tensor]]:
    """Per parameter index, its state as ``block_j.<path>`` (and ``step``...) keys, cloned."""
    return {
        index: {key: value.clone() for key, value in flatten_tree(entry).items()}
        for index, entry in state_dict["state"].items()
    }


def group_step(optimizer: torch.optim.Optimizer, group: int = 0) -> int:
    """The step of ``param_groups[group]`` (its first parameter's aliased ``step`` tensor)."""
    return int(optimizer.state[optimizer.param_groups[group]["params"][0]]["step"])


def assert_same_flat_state(
    got: dict[Any, dict[str, torch.Tensor]], want: dict[Any, dict[str, torch.Tensor]]
) -> None:
    """Same parameters, same keys, every tensor bit-identical (dtype included)."""
    assert got.keys() == want.keys()
    for index, entries in want.items():
        assert got[index].keys() == entries.keys(), index
        for key, value in entries.items():
            assert got[index][key].dtype == value.dtype and torch.equal(got[index][key], value), (
                index,
                key,
            )
