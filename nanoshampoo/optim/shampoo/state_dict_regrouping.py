"""A saved state dict of named parameters mapped onto another grouping of the same parameters.

A state dict keys the state by the parameter's position in the optimizer's groups, as
``torch.optim`` does, so it loads only into the same grouping. The grouping changes when
``num_sub_groups`` does (``param_group_split.py`` packs a group's parameters into sub-groups,
largest first), although the parameters and every block's state stay the same. When the
parameters are named (``DistributedShampoo(model.named_parameters(), ...)``: every group and
its state dict carry ``param_names``), the names say which saved entry is which parameter, and
:func:`regroup_by_param_names` re-keys the saved dict onto the optimizer's groups. This is the
reference library's promise for a resume across ``num_sub_groups`` (there through
``torch.distributed.checkpoint``'s parameter-keyed optimizer state dicts).

Nothing here changes the optimizer; :meth:`DistributedShampoo.load_state_dict` then checks the
re-keyed dict as any other.

A ``torch.distributed.checkpoint`` keys its entries by position too, and loads into a template
of the saved grouping: re-key a fresh optimizer's state dict onto that grouping (the
:func:`split_param_groups` of the saved ``num_sub_groups``), load, then load the result::

    group = {"params": list(model.named_parameters()), "distributed_config": saved_config}
    saved = split_param_groups([group])
    template = {"optim": regroup_by_param_names(optimizer.state_dict(), saved)}
    dcp.load(template, checkpoint_id=path)
    optimizer.load_state_dict(template["optim"])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# Entries aligned to a group's parameters: a regrouped group gets its own (the optimizer's
# ``owner_ranks`` stays at the load, state_dict_loading.py).
_MEMBERSHIP = ("params", "param_names", "owner_ranks")


def _names(groups: object) -> list[list[str]] | None:
    """Per group, its parameter names; None unless every group names each of its parameters."""
    if not isinstance(groups, Sequence):
        return None
    names = []
    for group in groups:
        if not isinstance(group, Mapping):
            return None
        group_names, params = group.get("param_names"), group.get("params")
        if not isinstance(params, Sequence):
            return None
        if group_names is None and all(isinstance(p, tuple) and len(p) == 2 for p in params):
            group_names = [name for name, _ in params]  # (name, tensor) pairs, as given to torch
        if not isinstance(group_names, Sequence) or isinstance(group_names, str):
            return None
        if len(group_names) != len(params):
            return None
        names.append(list(group_names))
    return names


def regroup_by_param_names(
    state_dict: Mapping[str, Any], param_groups: Sequence[Mapping[str, Any]]
) -> Mapping[str, Any]:
    """``state_dict`` re-keyed onto ``param_groups`` by parameter name (or unchanged).

    ``param_groups``: group dicts naming their parameters by ``param_names`` or by
    ``(name, tensor)`` pairs in ``params``. Unchanged when a side does not name every
    parameter, when both group the names alike, or when the names differ but the groups have
    the same sizes (matched by position then, as torch matches them).
    Otherwise every parameter takes the state saved under its name, and every group the saved
    entries (hyperparameters, ``step``...) of the saved groups its parameters come from.

    Raises:
        ValueError: the names are not the same set on both sides and the group sizes differ
            (naming the differences); or a group gathers parameters from saved groups whose
            entries differ (naming the group and the entries): one group has one set of
            hyperparameters and one step.
    """
    saved_groups = state_dict["param_groups"]
    saved_names, our_names = _names(saved_groups), _names(param_groups)
    if saved_names is None or our_names is None or saved_names == our_names:
        return state_dict
    where: dict[str, tuple[int, Any]] = {}
    for position, (group, names) in enumerate(zip(saved_groups, saved_names)):
        where.update((name, (position, index)) for name, index in zip(names, group["params"]))
    missing = sorted({n for names in our_names for n in names} - where.keys())
    extra = sorted(where.keys() - {n for names in our_names for n in names})
    if (missing or extra) and [len(n) for n in saved_names] == [len(n) for n in our_names]:
        return state_dict  # renamed parameters, grouped alike: matched by position, as torch does
    if missing or extra:
        raise ValueError(
            f"state_dict param_names differ from the optimizer's: missing {missing[:4]}, "
            f"unexpected {extra[:4]}"
        )
    saved_state = state_dict["state"]
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    first = 0
    for index, names in enumerate(our_names):
        sources = sorted({where[name][0] for name in names})
        entries = [
            {k: v for k, v in saved_groups[s].items() if k not in _MEMBERSHIP} for s in sources
        ]
        differing = sorted(
            {
                k
                for e in entries[1:]
                for k in e.keys() | entries[0].keys()
                if e.get(k) != entries[0].get(k)
            }
        )
        if differing:
            raise ValueError(
                f"param_groups[{index}] takes parameters from saved param groups {sources}, whose "
                f"entries {differing} differ"
            )
        positions = list(range(first, first + len(names)))
        groups.append(
            {**(entries[0] if entries else {}), "params": positions, "param_names": names}
        )
        for name, position in zip(names, positions):
            saved_index = where[name][1]
            if saved_index in saved_state:
                state[position] = saved_state[saved_index]
        first += len(names)
    return {**state_dict, "state": state, "param_groups": groups}
