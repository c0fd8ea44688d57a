"""A lean ``nn.Module``-like base for optimizer internals: nested state save and lenient load.

Optimizer components (accumulators, preconditioners, quantized state) keep their tensors as
plain attributes, possibly inside dicts, lists, tuples and sets, and possibly inside other
``OptimizerModule``s. :meth:`OptimizerModule.state_dict` walks all of that and returns a nested
dict; :meth:`OptimizerModule.load_state_dict` writes a saved dict back **in place**, so that
tensors other code holds references to (views, lists of blocks) see the restored values.

Both follow the reference Distributed Shampoo library: a nested module's entry is kept even
when it holds nothing (``{}``), and loading restores what matches and skips the rest (keys
absent from the saved dict, extra saved keys, and values of the wrong kind, the last with a
logged warning), so that a checkpoint of a slightly different configuration still loads.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping
from copy import deepcopy
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from nanoshampoo.validation import is_int

logger = logging.getLogger(__name__)

_CONTAINERS = (dict, list, tuple, set)


class OptimizerModule:
    """Base class for optimizer components whose state is their tensor attributes.

    Subclasses need no ``super().__init__()`` call: the state is whatever is in ``vars(self)``,
    except the attribute names a subclass lists in ``non_state_attributes`` (structure such as
    block descriptions or caches, which is rebuilt rather than saved).

    State layout (nested dicts, loadable with ``torch.load(weights_only=True)``):

    - a tensor attribute ``x`` becomes ``{"x": tensor}``;
    - a nested ``OptimizerModule`` becomes its own ``state_dict()``, kept even when empty;
    - dicts keep their keys; lists, tuples and sets become dicts keyed by position ``0, 1, ...``;
      a container that stores nothing (empty, or only non-tensors) is dropped;
    - non-tensor values (ints, floats, strings, ``None``, configs) are stored only when
      ``store_non_tensors=True``.

    Example:
        >>> class Accumulator(OptimizerModule):
        ...     def __init__(self) -> None:
        ...         self.sums = [torch.zeros(2), torch.zeros(3)]
        ...         self.steps = 0
        ...         self.extra = OptimizerModule()
        >>> acc = Accumulator()
        >>> acc.state_dict()
        {'sums': {0: tensor([0., 0.]), 1: tensor([0., 0., 0.])}, 'extra': {}}
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
        """Load what matches in ``state_dict`` into this module, in place.

        Walks the module's own entries (as the reference library does):

        - tensors are copied into the existing tensors (``old.detach().copy_(new)``, converting
          the dtype); nested modules recurse; lists and dicts are updated in place, tuples and
          sets are rebuilt;
        - an entry the saved dict lacks is left as it is, except an element of a list, tuple or
          set, whose absence raises ``KeyError`` (the sequence's length is part of the state);
        - saved entries the module does not have are ignored;
        - a saved value of the wrong kind (a number where a tensor is, a tensor where a dict
          is, a non-tensor leaf of another type) is skipped with a logged warning;
        - container keys that arrive as strings (``"0"``, as after PyTorch's optimizer state
          flattening or a JSON round trip) are matched to the int keys they stand for;
        - non-tensor leaves are restored with ``deepcopy`` when ``store_non_tensors=True``;
          otherwise they are left untouched.

        Args:
            state_dict: a dict in the layout :meth:`state_dict` produces.
            store_non_tensors: whether non-tensor leaves are restored.

        Raises:
            KeyError: an element of a list, tuple or set is missing; the message names its path.
            ValueError: a tensor arrives with another shape (a silent broadcast would corrupt
                the state).

        Both errors are raised before anything is written.
        """
        for write in (False, True):  # check everything first: a failed load changes nothing
            _Loader(store_non_tensors, write).module(self, state_dict, "")


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
        return value.state_dict(keep_vars=keep_vars, store_non_tensors=store_non_tensors)
    if isinstance(value, _CONTAINERS):
        saved = {}
        for key, item in _items(value).items():
            entry = _save(item, keep_vars, store_non_tensors)
            if entry is not _SKIP:
                saved[key] = entry
        return saved if saved else _SKIP
    return value if store_non_tensors else _SKIP


def _join(path: str, key: Hashable) -> str:
    return f"{path}.{key}" if path else str(key)


def _saved_key(key: Hashable, new: Mapping[Hashable, Any]) -> Hashable | _Skip:
    """The key of ``new`` that holds the entry for the module's ``key`` (ints may be strings)."""
    if key in new:
        return key
    if is_int(key) and str(key) in new:
        return str(key)
    return _SKIP


# Values whose saved entries are loaded even when non-tensors are not restored.
_STATEFUL = (torch.Tensor, OptimizerModule, *_CONTAINERS)


@dataclass(frozen=True)
class _Loader:
    """One pass of :meth:`OptimizerModule.load_state_dict` over the module tree.

    The first pass (``write=False``) only raises on what cannot be loaded; the second writes
    and warns about what it skips, so a failed load leaves the module untouched.
    """

    store_non_tensors: bool
    write: bool

    def module(self, module: OptimizerModule, new: Any, path: str) -> None:
        if not isinstance(new, Mapping):
            self.skip(path, "a mapping", new)
            return
        for name, value in self.entries(_state_attributes(module), new, path).items():
            if self.write:
                setattr(module, name, value)

    def entries(
        self, old: Mapping[Hashable, Any], new: Mapping[Hashable, Any], path: str
    ) -> dict[Hashable, Any]:
        """``{old_key: loaded value}`` for the keys of ``old`` that ``new`` has; others skipped."""
        loaded: dict[Hashable, Any] = {}
        for key, old_value in old.items():
            saved_key = _saved_key(key, new)
            if saved_key is not _SKIP:
                loaded[key] = self.value(old_value, new[saved_key], _join(path, key))
        return loaded

    def elements(self, old: Any, new: Mapping[Hashable, Any], path: str) -> list[Any]:
        """A sequence's elements after loading; each element that holds state must be saved."""
        elements = list(old)
        for index, old_value in enumerate(elements):
            if not (self.store_non_tensors or isinstance(old_value, _STATEFUL)):
                continue  # a non-tensor leaf while non-tensors are not restored
            saved_key = _saved_key(index, new)
            if saved_key is _SKIP:
                raise KeyError(
                    f"load_state_dict: missing element {_join(path, index)!r} in state_dict; "
                    f"got keys {sorted(map(str, new))} at {path or '<root>'!r}"
                )
            elements[index] = self.value(old_value, new[saved_key], _join(path, index))
        return elements

    def value(self, old: Any, new: Any, path: str) -> Any:
        if isinstance(old, torch.Tensor):
            return self.tensor(old, new, path)
        if isinstance(old, OptimizerModule):
            self.module(old, new, path)
            return old
        if isinstance(old, _CONTAINERS):
            return self.container(old, new, path)
        if not self.store_non_tensors:
            return old
        if type(old) is not type(new):
            self.skip(path, f"a {type(old).__name__}", new)
            return old
        return deepcopy(new) if self.write else old

    def tensor(self, old: torch.Tensor, new: Any, path: str) -> torch.Tensor:
        if not isinstance(new, torch.Tensor):
            self.skip(path, "a tensor", new)
        elif old.shape != new.shape:
            raise ValueError(
                f"load_state_dict: state at {path!r}: shape mismatch, module has "
                f"{tuple(old.shape)}, state_dict has {tuple(new.shape)}"
            )
        elif self.write:
            old.detach().copy_(new)
        return old

    def container(self, old: Any, new: Any, path: str) -> Any:
        if not isinstance(new, Mapping):
            self.skip(path, "a mapping", new)
            return old
        if isinstance(old, dict):
            loaded = self.entries(old, new, path)
            if self.write:
                old.update(loaded)
            return old
        elements = self.elements(old, new, path)
        if not self.write:
            return old
        if isinstance(old, list):
            old[:] = elements
            return old
        if hasattr(old, "_fields"):  # namedtuple: positional constructor
            return type(old)(*elements)
        return type(old)(elements)

    def skip(self, path: str, expected: str, new: Any) -> None:
        if self.write:
            logger.warning(
                f"load_state_dict: state at {path or '<root>'!r}: expected {expected}, got "
                f"{type(new).__name__}; keeping the current value"
            )
