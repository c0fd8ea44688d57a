"""Save and restore nested optimizer state that mixes ``OptimizerModule``s, dicts and tensors."""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from copy import deepcopy
from typing import Any

import torch

from nanoshampoo.optim.shampoo.utils.optimizer_modules import OptimizerModule

logger = logging.getLogger(__name__)


def extract_state_dict_content(input_dict: Mapping[Any, Any]) -> dict[Any, Any]:
    """A copy of ``input_dict`` with every ``OptimizerModule`` replaced by its ``state_dict()``.

    Recurses into nested dicts (any ``Mapping``); every other value (tensors, numbers, lists) is
    kept as it is (tensors are not copied). Modules are saved with the defaults of
    :meth:`OptimizerModule.state_dict` (tensors only, detached).

    Example:
        >>> class Acc(OptimizerModule):
        ...     def __init__(self) -> None:
        ...         self.sum = torch.zeros(2)
        >>> extract_state_dict_content({"acc": Acc(), "step": 3})
        {'acc': {'sum': tensor([0., 0.])}, 'step': 3}
    """
    return {
        key: value.state_dict()
        if isinstance(value, OptimizerModule)
        else extract_state_dict_content(value)
        if isinstance(value, Mapping)
        else value
        for key, value in input_dict.items()
    }


def update_param_state_dict_object(
    current_param_state_dict: MutableMapping[Any, Any],
    param_state_dict_to_load: Mapping[Any, Any],
    enable_missing_key_check: bool = True,
) -> None:
    """Load ``param_state_dict_to_load`` into ``current_param_state_dict`` in place.

    For every key of the **current** dict (as the reference library walks it), by the kind of
    the current value:

    - dict: recurse;
    - an object with ``load_state_dict`` (``OptimizerModule``, ``nn.Module``): call it;
    - tensor: ``current.detach().copy_(loaded)`` (shapes must match);
    - anything else: replaced by ``deepcopy(loaded)``.

    Keys of the loaded dict that the current dict lacks are ignored.

    Args:
        current_param_state_dict: the live state, updated in place.
        param_state_dict_to_load: the saved state (e.g. from :func:`extract_state_dict_content`).
        enable_missing_key_check: when true, a current key that the loaded dict lacks raises
            ``KeyError``; when false it is logged as a warning and that entry is left as it is.

    Raises:
        KeyError: a current key is missing from the loaded state (with the check on).
        ValueError: a tensor of another shape, or a non-mapping where a dict is expected.

    Example:
        >>> live = {"sum": torch.zeros(2), "step": 0}
        >>> update_param_state_dict_object(live, {"sum": torch.ones(2), "step": 5, "extra": 1})
        >>> live["sum"], live["step"]
        (tensor([1., 1.]), 5)
    """
    for key, current in current_param_state_dict.items():
        if key not in param_state_dict_to_load:
            message = (
                f"Key {key} not found in state dict to load. "
                f"Loaded keys: {sorted(map(str, param_state_dict_to_load))}"
            )
            if enable_missing_key_check:
                raise KeyError(message)
            logger.warning(f"{message} Keeping the current value.")
            continue
        loaded = param_state_dict_to_load[key]
        if isinstance(current, dict):
            if not isinstance(loaded, Mapping):
                raise ValueError(
                    f"state {key!r}: expected a mapping to load into a dict, "
                    f"got {type(loaded).__name__}"
                )
            update_param_state_dict_object(current, loaded, enable_missing_key_check)
        elif hasattr(current, "load_state_dict"):
            current.load_state_dict(loaded)
        elif isinstance(current, torch.Tensor):
            _copy_into(current, loaded, key)
        else:
            current_param_state_dict[key] = deepcopy(loaded)


def _copy_into(current: torch.Tensor, loaded: Any, key: Any) -> None:
    if not isinstance(loaded, torch.Tensor) or loaded.shape != current.shape:
        got = tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else type(loaded).__name__
        raise ValueError(
            f"state {key!r}: expected a tensor of shape {tuple(current.shape)}, got {got}"
        )
    current.detach().copy_(loaded)
