"""The reference library's optimizer state-dict layout, and the mapping to and from ours.

The reference Distributed Shampoo (facebookresearch/optimizers) saves, per parameter index,
nested dicts of its blocks plus the parameter's step; its param groups have no ``step``::

    state[i] = {"block_j": {"shampoo": {"factor_matrices": {d: F}, "inv_factor_matrices": {d: R}},
                            "adagrad": V, "filtered_grad": M, "momentum_buffer": B},
                "step": tensor(t, dtype=int64)}

Ours keeps flat keys ``"block_j.<path>"`` and the step in the group. Within a block the names
map as :data:`REFERENCE_NAMES` says; the factors are packed alike (``use_symmetric_packing``:
the row-major upper triangle, ``n (n + 1) / 2`` values). What differs, and how it is mapped:

- ``inv_factor_matrices``: the reference packs the roots too; ours keeps them full. From the
  reference: unpacked (exact). To the reference: the upper triangle (exact for a symmetric root;
  an eigh root's two triangles can differ in the last bit, and the lower one is dropped).
- ``failure_counts`` (ours: consecutive failed root computations per factor) are not in the
  reference's state: from it they start at 0, to it they are dropped.
- ``step`` and, under primal averaging (GPA, Schedule-Free), ``lr_sum`` (the sum of
  ``lr^r``) and ``train_mode``: the reference keeps each as one tensor per group aliased under
  every parameter (``state[i]["lr_sum"]``...); the values must agree within a group (they always
  do there) and become the group's entries, and ours are written to every parameter. The
  averaged ``z`` is ``weight_buffer`` in a block in both.
- Anything else (SOAP's eigenbases, warm-started eigenvectors, quantized or FSDP ``DEFAULT``
  shard blocks) is not mapped: an entry without a counterpart is refused on load by the usual
  key check, naming it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nanoshampoo.optim.shampoo.state_dict_trees import flatten_tree, is_plain_value
from nanoshampoo.optim.shampoo.utils.shampoo_utils import (
    pack_upper_triangular,
    unpack_upper_triangular,
)

# Our block-relative state names -> the reference's.
REFERENCE_NAMES = {"grafting.second_moment": "adagrad", "momentum": "momentum_buffer"}
_OURS = {reference: ours for ours, reference in REFERENCE_NAMES.items()}
_ROOTS = "shampoo.inv_factor_matrices."
_FAILURES = "shampoo.failure_counts."

# The per-group scalars the reference saves under every parameter, in its dtypes (its lr_sum
# is float32: ours, a Python float, is rounded to it on the way there).
GROUP_SCALARS = {"step": torch.int64, "lr_sum": torch.float32, "train_mode": torch.bool}

# One entry of ``expected``: flat key -> (shape, dtype) of a block-state tensor.
Expected = Mapping[int, Mapping[str, tuple[torch.Size, torch.dtype]]]


def is_reference_layout(state_dict: Mapping[str, Any]) -> bool:
    """Whether ``state_dict`` is laid out as the reference library saves it: groups without
    ``step``, and parameter states holding a ``step`` (and the other :data:`GROUP_SCALARS`)
    beside nested ``block_<j>`` dicts."""
    groups, state = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(groups, Sequence) or not isinstance(state, Mapping) or not state:
        return False
    if any(not isinstance(g, Mapping) or "step" in g for g in groups):
        return False
    entries = [e for e in state.values() if isinstance(e, Mapping) and e]
    return bool(entries) and all(
        "step" in e and all(
            k in GROUP_SCALARS or (str(k).startswith("block_") and isinstance(v, Mapping)) for k, v in e.items()
        )
        for e in entries
    )


def _block_key(flat: str) -> tuple[str, str]:
    block, _, rest = flat.partition(".")
    return block, rest


def from_reference_layout(
    state_dict: Mapping[str, Any], group_params: Sequence[Sequence[int]], expected: Expected
) -> dict[str, Any]:
    """The reference's ``state_dict`` in our layout (changes nothing; raises ``ValueError``).

    ``group_params``: per group, its parameter indices; ``expected``: per parameter index, the
    flat keys our blocks hold with their shapes and dtypes (which roots to unpack and which
    failure counts to start at zero).
    """
    # The reference's groups also hold its config objects (and its enum): ours stay.
    groups = [{k: v for k, v in g.items() if is_plain_value(v)} for g in state_dict["param_groups"]]
    state: dict[int, dict[str, Any]] = {}
    scalars: dict[int, dict[str, Any]] = {}
    for index, entries in state_dict["state"].items():
        flat = flatten_tree({k: v for k, v in entries.items() if k not in GROUP_SCALARS})
        scalars[int(index)] = {
            k: torch.as_tensor(v).item() for k, v in entries.items() if k in GROUP_SCALARS
        }
        if "step" in scalars[int(index)]:  # torch.optim's own steps are float tensors
            scalars[int(index)]["step"] = int(scalars[int(index)]["step"])
        mapped: dict[str, Any] = {}
        for key, value in flat.items():
            block, rest = _block_key(key)
            mapped[f"{block}.{_OURS.get(rest, rest)}"] = value
        for key, (shape, dtype) in expected.get(int(index), {}).items():
            value = mapped.get(key)
            packed_root = (
                isinstance(value, torch.Tensor) and value.dim() == 1 and len(shape) == 2
                and value.numel() == shape[0] * (shape[0] + 1) // 2
            )
            # A root of another size stays as it is, for the shape check to refuse it by name.
            if _ROOTS in key and packed_root:
                mapped[key] = unpack_upper_triangular(value, shape[0])
            elif _FAILURES in key and key not in mapped:
                mapped[key] = torch.zeros(shape, dtype=dtype)
        state[int(index)] = mapped
    for position, (group, params) in enumerate(zip(groups, group_params)):
        group["step"] = 0
        for name in GROUP_SCALARS:
            values = {scalars[i][name] for i in params if name in scalars.get(i, {})}
            if len(values) > 1:
                raise ValueError(
                    f"state_dict (reference layout): the parameters of param_groups[{position}] "
                    f"have different {name} values {sorted(values)}; one group has one {name}"
                )
            if values:
                group[name] = values.pop()
    return {"state": state, "param_groups": groups}


def to_reference_layout(state_dict: Mapping[str, Any], packed_roots: Sequence[bool]) -> dict[str, Any]:
    """Our ``state_dict()`` in the reference's layout (new containers, tensors shared except
    packed roots). ``packed_roots``: per group, whether its roots are saved packed (the
    reference packs them with ``use_symmetric_packing``)."""
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    for group, packed in zip(state_dict["param_groups"], packed_roots):
        saved = {
            name: torch.tensor(group[name], dtype=dtype)
            for name, dtype in GROUP_SCALARS.items() if name in group
        }
        groups.append({k: v for k, v in group.items() if k not in GROUP_SCALARS})
        for index in group["params"]:
            nested: dict[str, Any] = {}
            for key, value in state_dict["state"].get(index, {}).items():
                block, rest = _block_key(key)
                if rest.startswith(_FAILURES):
                    continue
                if rest.startswith(_ROOTS) and packed and value.dim() == 2:
                    value = pack_upper_triangular(value)
                node = nested.setdefault(block, {})
                *parents, leaf = REFERENCE_NAMES.get(rest, rest).split(".")
                for part in parents:
                    node = node.setdefault(int(part) if part.isdigit() else part, {})
                node[int(leaf) if leaf.isdigit() else leaf] = value
            # One tensor per group under every parameter, as the reference aliases them.
            nested.update(saved)
            state[index] = nested
    return {"state": state, "param_groups": groups}


def check_distributed_shampoo_layout(state_dict: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` for the state dict of another optimizer (``torch.optim.Adam``,
    ``DistAdam``...): every group of ours carries its ``step``, and every state entry is keyed
    ``block_<j>.<path>``; theirs keep a per-parameter ``step`` and entries such as ``exp_avg``."""
    groups, state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(groups, Sequence) or not isinstance(state, Mapping):
        raise ValueError("state_dict['param_groups'] must be a list and state_dict['state'] a mapping")
    foreign = [
        f"param_groups[{i}] has no 'step'" for i, group in enumerate(groups)
        if not isinstance(group, Mapping) or "step" not in group
    ] + [
        f"state[{index!r}] has keys {sorted(map(str, entries))[:3]}" for index, entries in state.items()
        if not isinstance(entries, Mapping) or not all(str(key).startswith("block_") for key in entries)
    ]
    if foreign:
        raise ValueError(
            "state_dict is from another optimizer, not DistributedShampoo: "
            f"{'; '.join(foreign[:2])} (DistributedShampoo groups carry 'step', its state is keyed "
            "'block_<j>')"
        )
