"""A lean ``nn.Module``-like base for optimizer internals: nested state save and strict load.

Optimizer components (accumulators, preconditioners, quantized state) keep their tensors as
plain attributes, possibly inside dicts, lists, tuples and sets, and possibly inside other
``OptimizerModule``s. :meth:`OptimizerModule.state_dict` walks all of that and returns a nested
dict; :meth:`OptimizerModule.load_state_dict` writes a saved dict back **in place**, so that
tensors other code holds references to (views, lists of blocks) see the restored values.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from copy import deepcopy
from typing import Any, ClassVar

import torch

_CONTAINERS = (dict, list, tuple, set)


class OptimizerModule:
    """Base class for optimizer components whose state is their tensor attributes.

    Subclasses need no ``super().__init__()`` call: the state is whatever is in ``vars(self)``,
    except the attribute names a subclass lists in ``non_state_attributes`` (structure such as
    block descriptions or caches, which is rebuilt rather than saved).

    State layout (nested dicts, loadable with ``torch.load(weights_only=True)``):

    - a tensor attribute ``x`` becomes ``{"x": tensor}``;
    - a nested ``OptimizerModule`` becomes its own ``state_dict()``;
    - dicts keep their keys; lists, tuples and sets become dicts keyed by position ``0, 1, ...``;
    - entries that contain no stored value (empty containers, modules without state) are
      dropped;
    - non-tensor values (ints, floats, strings, ``None``, configs) are stored only when
      ``store_non_tensors=True``.

    Example:
        >>> class Accumulator(OptimizerModule):
        ...     def __init__(self) -> None:
        ...         self.sums = [torch.zeros(2), torch.zeros(3)]
        ...         self.steps = 0
        >>> acc = Accumulator()
        >>> acc.state_dict()
        {'sums': {0: tensor([0., 0.]), 1: tensor([0., 0., 0.])}}
        >>> acc.state_dict(store_non_tensors=True)["steps"]
        0
        >>> acc.load_state_dict({"sums": {"0": torch.ones(2), "1": torch.ones(3)}})
        >>> acc.sums[0]
        tensor([1., 1.])
    """

    non_state_attributes: ClassVar[frozenset[str]] = frozenset()

    def state_dict(
        self,
        destination: dict[str, Any] | None = None,
        keep_vars: bool = False,
        store_non_tensors: bool = False,
    ) -> dict[str, Any]:
        """Return the module's state as a nested dict (layout in the class docstring).

        Args:
            destination: dict to write the entries into (and return); a new dict when ``None``.
            keep_vars: store the tensors themselves (with autograd history) instead of
                ``tensor.detach()``. Either way the stored tensors share storage with the module.
            store_non_tensors: also store non-tensor leaves (by reference, not copied).

        Returns:
            ``destination`` with one entry per attribute that holds stored state.
        """
        destination = {} if destination is None else destination
        for name, value in _state_attributes(self).items():
            entry = _save(value, keep_vars, store_non_tensors)
            if entry is not _SKIP:
                destination[name] = entry
        return destination

    def load_state_dict(
        self, state_dict: Mapping[Any, Any], store_non_tensors: bool = False
    ) -> None:
        """Load ``state_dict`` into this module in place, strictly.

        Tensors are copied into the existing tensors (``old.detach().copy_(new)``), nested
        modules recurse, lists and dicts are updated in place, tuples and sets are rebuilt.
        Container keys that arrive as strings (``"0"``, as after PyTorch's optimizer state
        flattening or a JSON round trip) are matched to the int keys they stand for. Non-tensor
        leaves are restored with ``deepcopy`` when ``store_non_tensors=True``; otherwise they are
        left untouched and any entry given for them is ignored.

        Args:
            state_dict: a dict in the layout :meth:`state_dict` produces.
            store_non_tensors: whether non-tensor leaves are expected and restored.

        Raises:
            KeyError: an entry the module has is missing, or an entry the module does not have is
                present; the message names the dotted path of the key.
            ValueError: a tensor arrives with another shape or dtype, or a value has the wrong
                kind (e.g. a tensor where a container is expected).
        """
        updated = _load_entries(_state_attributes(self), state_dict, "", store_non_tensors)
        for name, value in updated.items():
            setattr(self, name, value)


class _Skip:
    """Marker for "this value produces no state entry"."""


_SKIP = _Skip()


def _state_attributes(module: OptimizerModule) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if k not in module.non_state_attributes}


def _items(container: Any) -> Mapping[Hashable, Any]:
    """A container as a key -> value mapping: dicts as they are, sequences and sets by position."""
    return container if isinstance(container, dict) else dict(enumerate(container))


def _save(value: Any, keep_vars: bool, store_non_tensors: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return value if keep_vars else value.detach()
    if isinstance(value, OptimizerModule):
        nested = value.state_dict(keep_vars=keep_vars, store_non_tensors=store_non_tensors)
        return nested if nested else _SKIP
    if isinstance(value, _CONTAINERS):
        saved = {}
        for key, item in _items(value).items():
            entry = _save(item, keep_vars, store_non_tensors)
            if entry is not _SKIP:
                saved[key] = entry
        return saved if saved else _SKIP
    return value if store_non_tensors else _SKIP


def _has_entry(value: Any, store_non_tensors: bool) -> bool:
    """Whether ``_save(value, ...)`` stores something, without building it."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, OptimizerModule):
        return any(_has_entry(v, store_non_tensors) for v in _state_attributes(value).values())
    if isinstance(value, _CONTAINERS):
        return any(_has_entry(v, store_non_tensors) for v in _items(value).values())
    return store_non_tensors


def _join(path: str, key: Hashable) -> str:
    return f"{path}.{key}" if path else str(key)


def _resolve_key(key: Hashable, old: Mapping[Hashable, Any]) -> Hashable | _Skip:
    """The key of ``old`` that a loaded ``key`` refers to; string digits map back to ints."""
    if key in old:
        return key
    if isinstance(key, str):
        try:
            as_int = int(key)
        except ValueError:
            return _SKIP
        if str(as_int) == key and as_int in old:
            return as_int
    return _SKIP


def _load_entries(
    old: Mapping[Hashable, Any], new: Any, path: str, store_non_tensors: bool
) -> dict[Hashable, Any]:
    """Match ``new``'s entries to ``old``'s keys strictly; return ``{old_key: loaded value}``."""
    if not isinstance(new, Mapping):
        raise ValueError(
            f"state at {path or '<root>'!r}: expected a mapping, got {type(new).__name__}"
        )
    matched: dict[Hashable, Any] = {}
    for key, new_value in new.items():
        old_key = _resolve_key(key, old)
        if old_key is _SKIP or old_key in matched:
            raise KeyError(
                f"unexpected key {_join(path, key)!r} in state_dict; "
                f"expected keys at {path or '<root>'!r}: {sorted(map(str, old))}"
            )
        old_value = old[old_key]
        if not _has_entry(old_value, store_non_tensors):
            if not isinstance(old_value, (torch.Tensor, OptimizerModule, *_CONTAINERS)):
                # A non-tensor leaf while non-tensors are not restored: ignore what was saved.
                continue
            raise KeyError(
                f"unexpected key {_join(path, key)!r} in state_dict: the module's value there "
                f"holds no state (empty {type(old_value).__name__})"
            )
        matched[old_key] = new_value
    missing = [k for k, v in old.items() if k not in matched and _has_entry(v, store_non_tensors)]
    if missing:
        raise KeyError(
            f"missing key(s) {[_join(path, k) for k in missing]} in state_dict; "
            f"got keys {sorted(map(str, new))} at {path or '<root>'!r}"
        )
    return {
        key: _load_value(old[key], new_value, _join(path, key), store_non_tensors)
        for key, new_value in matched.items()
    }


def _load_value(old: Any, new: Any, path: str, store_non_tensors: bool) -> Any:
    if isinstance(old, torch.Tensor):
        if not isinstance(new, torch.Tensor):
            raise ValueError(f"state at {path!r}: expected a tensor, got {type(new).__name__}")
        if old.shape != new.shape:
            raise ValueError(
                f"state at {path!r}: shape mismatch, module has {tuple(old.shape)}, "
                f"state_dict has {tuple(new.shape)}"
            )
        if old.dtype != new.dtype:
            raise ValueError(
                f"state at {path!r}: dtype mismatch, module has {old.dtype}, "
                f"state_dict has {new.dtype}"
            )
        old.detach().copy_(new)
        return old
    if isinstance(old, OptimizerModule):
        for name, value in _load_entries(
            _state_attributes(old), new, path, store_non_tensors
        ).items():
            setattr(old, name, value)
        return old
    if isinstance(old, dict):
        old.update(_load_entries(old, new, path, store_non_tensors))
        return old
    if isinstance(old, list):
        for index, value in _load_entries(_items(old), new, path, store_non_tensors).items():
            old[index] = value
        return old
    if isinstance(old, (tuple, set)):
        updated = _load_entries(_items(old), new, path, store_non_tensors)
        elements = [updated.get(i, item) for i, item in enumerate(old)]
        if hasattr(old, "_fields"):  # namedtuple: positional constructor
            return type(old)(*elements)
        return type(old)(elements)
    return deepcopy(new)
