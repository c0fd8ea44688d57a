"""The optimizer's state layout: the reference library's nested per-parameter dicts.

``optimizer.state[p]`` and ``state_dict()["state"][i]`` hold, per parameter, one dict per
local block and the group's scalars, aliased under every parameter of the group (one tensor per
group, as the reference library keeps them)::

    state[i] = {"block_j": {"shampoo": {"factor_matrices": {d: F}, "inv_factor_matrices": {d: R}},
                            "adagrad": V, "filtered_grad": M, "momentum_buffer": B,
                            "weight_buffer": z},
                "step": tensor(t, int64),                      # every group
                "lr_sum": tensor(float32), "train_mode": tensor(bool)}   # primal averaging

Live (``optimizer.state``) the preconditioner's entry is an ``OptimizerModule`` of views into the
stacked state; ``state_dict()`` turns it into nested dicts (:func:`saved_state`). Names map from
the blocks' own (:data:`SAVED_NAMES`): grafting's (and a diagonal main preconditioner's) second
moment is ``adagrad``, momentum is ``momentum_buffer``; a block with both a diagonal main
preconditioner and grafting keeps grafting under ``grafting``. What differs from the reference:

- ``inv_factor_matrices`` are kept full and exactly symmetric; with ``use_symmetric_packing``
  they are saved packed (the upper triangle, lossless) and unpacked on load.
- Packed ``factor_matrices`` of size 512 and more live by tiles (``TiledPacking``, updated in
  place), not as one triangle: they are saved in the triangle's layout (:func:`saved_factor`)
  and converted back on load, so a state dict holds the same numbers either way.
- ``failure_counts`` (consecutive failed root computations) are not saved, as in the
  reference: a loaded optimizer counts from 0 (a checkpoint that holds them still loads them).
- ``lr_sum`` is a float32 CPU tensor, as the reference's, but Schedule-Free sums ``lr^r`` in
  float64 (a float32 sum drifts: see :data:`LR_SUM_EXACT`); where float32 does not hold the
  sum exactly, the group also saves it as ``"lr_sum_float64"``, so a resume continues bit for
  bit. A loaded ``lr_sum`` of either dtype is taken as it is.
- SOAP's bases and corrected eigenvalues ``D``: both libraries pair coordinate ``j`` with the
  eigenvector of the ``j``-th smallest eigenvalue; the reference stores its bases ascending,
  ours descending (coordinate ``j`` is column ``n - 1 - j``). A state dict holds them as the
  reference does: each computed basis with its columns, and ``D`` along its dim, reversed
  (:func:`reorder_soap_bases`; an identity basis not yet computed is the same in both).
- SOAP (and eigendecomposed Shampoo) keep ``eigenvectors_computed`` per factor (QR refreshes
  warm-start only from computed bases). The reference has no such entry, and a load without it
  takes ``step >= start_preconditioning_step``: a block's flags are saved only where they
  differ from that (a failed or not yet due computation), so a state dict is the reference's
  wherever it can be and a resume is bit for bit wherever it is not.

``param_groups`` are the groups' entries, config objects included, except the entries only this
optimizer has (:data:`EXTENSION_DEFAULTS`), which are left out where they hold their defaults,
so that a group of the reference's options saves as the reference's does.

Checkpoints of this optimizer's earlier flat layout (``"block_j.<path>"`` keys, the step in the
group) are converted on load by :func:`from_flat_layout`.
"""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from nanoshampoo.optim.shampoo.preconditioner.preconditioner import BlockStateView
from nanoshampoo.optim.shampoo.shampoo_types import LR_SUM, STEP, TRAIN_MODE
from nanoshampoo.optim.shampoo.utils.optimizer_modules import OptimizerModule
from nanoshampoo.optim.shampoo.utils.shampoo_utils import pack_upper_triangular

# Our block-state entry names -> the saved (reference) names.
SAVED_NAMES = {"grafting": "adagrad", "momentum": "momentum_buffer"}
# Entries of a diagonal (AdaGrad-family) preconditioner: saved as their one tensor.
_DIAGONAL = ("second_moment",)
# Per-factor entries that a loaded checkpoint may lack: not saved / not in the reference's.
FAILURE_COUNTS, EIGENVECTORS_COMPUTED = "failure_counts", "eigenvectors_computed"
ROOTS = "inv_factor_matrices"
FACTORS = "factor_matrices"
BASES, CORRECTED = "factor_matrices_eigenvectors", "corrected_eigenvalues"
# The group scalars, with their dtypes (the reference's).
GROUP_SCALARS = {STEP: torch.int64, LR_SUM: torch.float32, TRAIN_MODE: torch.bool}
# A saved group's Schedule-Free sum of lr^r as a Python float, where float32 does not hold it:
# the runtime sums in float64, because a float32 sum drifts (over 3,000 steps of the trainer's
# schedule, lr 0.006 then a linear cooldown, r = 2: 8e-6 relative in 1 - mu_x;
# iterate_averaging_test.py). It is used only while it rounds to the saved ``lr_sum`` (a dict
# whose ``lr_sum`` was changed since, or that another library saved back, loads its ``lr_sum``).
LR_SUM_EXACT = "lr_sum_float64"
# Group entries only this optimizer has, with their defaults: left out of a saved group that
# holds the default, filled in with it when a loaded group lacks them.
EXTENSION_DEFAULTS: dict[str, Any] = {
    "amortize_roots": False,
    "momentum_dtype": None,
    "momentum": 0.0,
    "dampening": 0.0,
    "use_nesterov": False,
}


def saved_names(names: Iterable[str]) -> dict[str, str]:
    """Per entry name of a block's state, the name it is saved (and shown live) under."""
    names = list(names)
    mapping = {name: SAVED_NAMES.get(name, name) for name in names}
    if "adagrad" in names and "grafting" in names:
        mapping["grafting"] = "grafting"  # a diagonal main preconditioner holds "adagrad"
    return mapping


def live_block_state(view: BlockStateView) -> dict[str, Any]:
    """The dict shown at ``optimizer.state[p]["block_j"]``: the block's entries (views into
    the stacked state) under their saved names; a diagonal preconditioner's entry is its tensor."""
    entries = vars(view)
    live: dict[str, Any] = {}
    for name, saved in saved_names(entries).items():
        value = entries[name]
        if isinstance(value, OptimizerModule) and tuple(vars(value)) == _DIAGONAL:
            value = value.second_moment
        live[saved] = value
    return live


def saved_key(flat_key: str, names: Iterable[str]) -> str:
    """Our flat block-state key (``block_j.grafting.second_moment``) as its saved flat key
    (``block_j.adagrad``); ``names``: the block's entry names."""
    block, _, rest = flat_key.partition(".")
    entry, _, path = rest.partition(".")
    saved = saved_names(names).get(entry, entry)
    if path in _DIAGONAL:
        return f"{block}.{saved}"
    return f"{block}.{saved}.{path}" if path else f"{block}.{saved}"


class GroupScalars:
    """One group's step (and, under primal averaging, ``lr_sum`` and ``train_mode``): CPU
    tensors that every parameter's state aliases, kept equal to the group's runtime."""

    def __init__(self, averaging: bool) -> None:
        names = GROUP_SCALARS if averaging else {STEP: torch.int64}
        self.tensors = {name: torch.zeros((), dtype=dtype) for name, dtype in names.items()}
        if averaging:
            self.tensors[TRAIN_MODE].fill_(True)

    def read_into(self, runtime: Any) -> None:
        """The runtime's step (and ``lr_sum``) from the tensors, which a user may have written;
        the float64 sum stays while the float32 tensor still holds it rounded."""
        runtime.step = int(self.tensors[STEP])
        if LR_SUM in self.tensors:
            written = float(self.tensors[LR_SUM])
            if written != as_float32(runtime.lr_power_sum):
                runtime.lr_power_sum = written

    def write_from(self, runtime: Any) -> None:
        self.tensors[STEP].fill_(runtime.step)
        if LR_SUM in self.tensors:
            self.tensors[LR_SUM].fill_(runtime.lr_power_sum)
            self.tensors[TRAIN_MODE].fill_(runtime.train_mode)


def as_float32(value: float) -> float:
    """``value`` rounded to float32 (what an ``lr_sum`` tensor holds)."""
    return float(torch.tensor(value, dtype=torch.float32))


def reorder_soap_bases(shampoo: Any, computed_by_default: bool) -> Any:
    """SOAP's block state (``shampoo``, nested) with the columns of each computed basis, and
    ``D`` along that basis's dim, reversed: from our descending order to the reference's
    ascending one, and back (its own inverse). ``computed_by_default``: whether a basis is
    computed where the state has no ``eigenvectors_computed`` (the reference's). Anything but a
    SOAP state is returned as it is."""
    if not (
        isinstance(shampoo, Mapping)
        and isinstance(shampoo.get(CORRECTED), torch.Tensor)
        and isinstance(shampoo.get(BASES), Mapping)
    ):
        return shampoo
    flags = shampoo.get(EIGENVECTORS_COMPUTED, {})
    bases, corrected = dict(shampoo[BASES]), shampoo[CORRECTED]
    for dim, basis in shampoo[BASES].items():
        flag = (
            flags.get(dim, computed_by_default)
            if isinstance(flags, Mapping)
            else computed_by_default
        )
        if (
            bool(flag)
            and isinstance(basis, torch.Tensor)
            and basis.dim() == 2
            and int(dim) < corrected.dim()
        ):
            bases[dim], corrected = basis.flip(-1), corrected.flip(int(dim))
    return {**shampoo, BASES: bases, CORRECTED: corrected}


def _saved_tree(value: Any, packed: bool, implied_computed: bool) -> Any:
    """A live entry as saved; ``implied_computed``: what a load infers for its bases'
    ``eigenvectors_computed`` flags (``step >= start_preconditioning_step``)."""
    if isinstance(value, OptimizerModule):
        value = value.state_dict()
    if not isinstance(value, Mapping):
        return value
    tree = {
        k: _saved_tree(v, packed, implied_computed) for k, v in value.items() if k != FAILURE_COUNTS
    }
    results = tree.get(ROOTS, tree.get(BASES))
    if isinstance(tree.get(FACTORS), Mapping) and isinstance(results, Mapping):
        tree[FACTORS] = {
            d: saved_factor(f, results[d].shape[-1]) if d in results else f
            for d, f in tree[FACTORS].items()
        }
    if packed and isinstance(tree.get(ROOTS), Mapping):
        tree[ROOTS] = {
            d: pack_upper_triangular(r) if r.dim() == 2 else r for d, r in tree[ROOTS].items()
        }
    tree = reorder_soap_bases(tree, computed_by_default=False)
    flags = tree.get(EIGENVECTORS_COMPUTED)
    if isinstance(flags, Mapping) and all(bool(f) == implied_computed for f in flags.values()):
        del tree[EIGENVECTORS_COMPUTED]
    return tree


def tiled_storage(size: int, numel: int) -> bool:
    """Whether a flat factor of ``numel`` elements is the tiled storage of an ``size x size``
    factor (``TiledPacking``)."""
    # Imported here: a run without Kronecker factors (Muon, AdaGrad) never loads the module.
    from nanoshampoo.optim.shampoo.preconditioner.factor_matrix_ops import (
        tiled_storage_size,
        tiles_pack,
    )

    return tiles_pack(size) and numel == tiled_storage_size(size)


def saved_factor(factor: torch.Tensor, size: int) -> torch.Tensor:
    """A live factor as a state dict keeps it: a tiled one (``TiledPacking``, flat) in the
    packed triangle's layout (a new tensor), any other as it is. ``size`` is its ``n``."""
    from nanoshampoo.optim.shampoo.preconditioner.factor_matrix_ops import tiled_packing

    if factor.dim() != 1 or not tiled_storage(size, factor.numel()):
        return factor
    return tiled_packing(size, factor.device).to_reference(factor.unsqueeze(0)).squeeze(0)


def loaded_factor(value: torch.Tensor, size: int, numel: int) -> torch.Tensor:
    """A saved packed factor for a live tiled one of ``numel`` elements (``size x size``): in
    the tiled layout (a new tensor); anything else as it is (the caller checks the shape)."""
    from nanoshampoo.optim.shampoo.preconditioner.factor_matrix_ops import (
        SymmetricPacking,
        tiled_packing,
    )

    if (
        value.dim() != 1
        or value.numel() != SymmetricPacking.packed_size(size)
        or not tiled_storage(size, numel)
    ):
        return value

    return tiled_packing(size, value.device).from_reference(value.unsqueeze(0)).squeeze(0)


def saved_state(
    state_dict: dict[str, Any], packed_roots: Sequence[bool], lr_sums: Sequence[float | None]
) -> None:
    """``state_dict()``'s post-hook, in place: live state to nested dicts (roots packed in the
    groups whose built config packs, ``packed_roots[g]``), the groups without the extension
    entries that hold their defaults, and with :data:`LR_SUM_EXACT` where float32 does not hold
    the group's float64 sum ``lr_sums[g]`` (None: no primal averaging)."""
    packed: dict[Any, bool] = {}
    start: dict[Any, float] = {}
    for group, packs, lr_sum in zip(state_dict["param_groups"], packed_roots, lr_sums):
        packed.update((index, packs) for index in group["params"])
        start.update((index, group["start_preconditioning_step"]) for index in group["params"])
        if lr_sum is not None and as_float32(lr_sum) != lr_sum:
            group[LR_SUM_EXACT] = lr_sum
        for key, default in EXTENSION_DEFAULTS.items():
            if key in group and group[key] == default and type(group[key]) is type(default):
                del group[key]
    state_dict["state"] = {
        index: {
            k: _saved_tree(
                v, packed.get(index, False), int(entry.get(STEP, 0)) >= start.get(index, math.inf)
            )
            for k, v in entry.items()
        }
        for index, entry in state_dict["state"].items()
    }


def loads_back(value: Any) -> bool:
    """Whether ``value`` survives ``torch.save`` and then ``torch.load(weights_only=True)``:
    pickled, and every function and class in it registered with
    ``torch.serialization.add_safe_globals`` (or one of torch's own allowed types)."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:  # any refusal, pickling's or the weights-only unpickler's
        return False
    return True


def unloadable_part(value: Any, where: str = "it") -> str | None:
    """What in ``value`` a checkpoint cannot hold, and what to do about it: ``torch.save``
    cannot pickle it (a lambda, a local function or class) or ``torch.load(weights_only=True)``
    refuses it (a function or class not registered with ``torch.serialization.add_safe_globals``);
    None when it loads back (:func:`loads_back`). Named by its path from ``where`` (``.field``,
    ``[i]``), the innermost part that fails.

    Example:
        >>> unloadable_part({"scale": lambda x: x}, "config")
        "config['scale'] is a lambda; use a named function, registered"
    """
    if loads_back(value):
        return None
    parts: Iterable[tuple[Any, str]] = ()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        parts = ((getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value))
    elif isinstance(value, (list, tuple)):
        parts = ((item, f"{where}[{i}]") for i, item in enumerate(value))
    elif isinstance(value, dict):
        parts = ((item, f"{where}[{key!r}]") for key, item in value.items())
    for item, path in parts:
        part = unloadable_part(item, path)
        if part is not None:
            return part
    if isinstance(value, types.FunctionType) and value.__name__ == "<lambda>":
        return f"{where} is a lambda; use a named function, registered"
    if callable(value) and not dataclasses.is_dataclass(value):
        name = f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', value)}"
        if "<locals>" in name:
            return f"{where} is {name}, local; define it at module level and register it"
        return f"{where} is {name}, not registered; register it"
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    if "<locals>" in kind or not _pickles(value):
        return f"{where} is a {kind}, which pickle cannot save"
    return f"{where} is a {kind}, a class not registered; register it"


def _pickles(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # whatever pickle raises for what it cannot save
        return False
    return True


def is_block_key(key: Any) -> bool:
    """Whether a state entry's key names a block: ``block_j``, or ``shard_r-block_j`` (FSDP2's
    ``DEFAULT`` assignment names the blocks of each rank's shard)."""
    return "block_" in str(key)


def is_flat_layout(state_dict: Mapping[str, Any]) -> bool:
    """Whether ``state_dict`` is this optimizer's earlier layout: groups carrying ``step``, or
    state entries keyed ``block_j.<path>``."""
    groups, state = state_dict["param_groups"], state_dict["state"]
    return any(isinstance(g, Mapping) and STEP in g for g in groups) or any(
        isinstance(entry, Mapping) and any(is_block_key(key) and "." in str(key) for key in entry)
        for entry in state.values()
    )


def from_flat_layout(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The earlier flat layout as the nested one (new containers, tensors shared): block keys
    nested under the saved names, roots kept full (the loader takes either), failure counts
    kept, and each group's ``step`` (``lr_sum``, ``train_mode``) as tensors under its params."""
    groups, state = [], {}
    for group in state_dict["param_groups"]:
        scalars = {  # its lr_sum was float64: kept so (the loader takes either)
            name: torch.tensor(group[name], dtype=torch.float64 if name == LR_SUM else dtype)
            for name, dtype in GROUP_SCALARS.items()
            if name in group
        }
        groups.append({k: v for k, v in group.items() if k not in GROUP_SCALARS})
        for index in group.get("params", ()):
            entries = state_dict["state"].get(index, {})
            nested: dict[Any, Any] = {}
            names_by_block: dict[str, set[str]] = {}
            for key in entries:
                block, _, rest = str(key).partition(".")
                names_by_block.setdefault(block, set()).add(rest.partition(".")[0])
            for key, value in entries.items():
                if not is_block_key(key):  # a scalar already under the parameter
                    nested[key] = value
                    continue
                names = names_by_block[str(key).partition(".")[0]]
                *parents, leaf = saved_key(str(key), names).split(".")
                node = nested
                for part in parents:
                    node = node.setdefault(int(part) if part.isdigit() else part, {})
                node[int(leaf) if leaf.isdigit() else leaf] = value
            state[index] = {**nested, **scalars}
    return {"state": state, "param_groups": groups}
