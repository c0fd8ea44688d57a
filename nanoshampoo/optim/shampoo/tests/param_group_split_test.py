"""``split_param_groups`` (the ``num_sub_groups`` split) and the constructor's use of it.

The packing and the ``ROUND_ROBIN`` owner map are checked against slow, obvious longest-first
loops written here; the multi-process behaviour (the split changes no number, checkpoints load
across it) is in ``num_sub_groups_distributed_test.py``, the distributors' use of the owner map
in ``distributor/tests/owner_ranks_test.py``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from nanoshampoo.optim.shampoo import (
    DDPDistributedConfig,
    FSDPParamAssignmentStrategy,
    FullyShardDistributedConfig,
    HybridShardDistributedConfig,
    SingleDeviceDistributedConfig,
)
from nanoshampoo.optim.shampoo.config_checks import error_field
from nanoshampoo.optim.shampoo.param_group_split import split_constructor_params, split_param_groups
from nanoshampoo.optim.shampoo.shampoo_types import OWNER_RANKS

LOSSLESS = FSDPParamAssignmentStrategy.REPLICATE


class FakeMesh:
    """What the split reads of a 2-D device mesh: its rank and the shard dim's size."""

    ndim = 2

    def __init__(self, shard_size: int) -> None:
        self._shard_size = shard_size

    def size(self, dim: int) -> int:
        return self._shard_size if dim == 1 else 2


def fsdp(
    sub_groups: int, strategy: FSDPParamAssignmentStrategy = LOSSLESS
) -> FullyShardDistributedConfig:
    return FullyShardDistributedConfig(
        param_assignment_strategy=strategy, num_sub_groups=sub_groups
    )


def hsdp(
    sub_groups: int, shard_size: int, strategy: FSDPParamAssignmentStrategy = LOSSLESS
) -> HybridShardDistributedConfig:
    return HybridShardDistributedConfig(
        device_mesh=FakeMesh(shard_size),
        param_assignment_strategy=strategy,
        num_sub_groups=sub_groups,
    )


def tensors(numels: list[int]) -> list[torch.Tensor]:
    return [torch.zeros(n) for n in numels]


def reference_packing(numels: list[int], bins: int) -> list[list[int]]:
    """Longest first: each index, largest numel first (equal numels: later index first), to
    the bin of least total so far (ties: the lower bin); empty bins dropped."""
    order = sorted(range(len(numels)), key=lambda i: (numels[i], i), reverse=True)
    totals, members = [0] * bins, [[] for _ in range(bins)]
    for i in order:
        lightest = min(range(bins), key=lambda b: (totals[b], b))
        totals[lightest] += numels[i]
        members[lightest].append(i)
    return [m for m in members if m]


def positions(groups: list[dict[str, Any]], params: list[torch.Tensor]) -> list[list[int]]:
    where = {id(p): i for i, p in enumerate(params)}
    return [[where[id(p)] for p in group["params"]] for group in groups]


@pytest.mark.parametrize(
    "numels, sub_groups",
    [
        ([5, 3, 3, 1], 2),
        ([48, 35, 36, 36, 3, 12, 5, 36], 3),
        ([7, 7, 7, 7, 7], 4),  # equal sizes: later positions first
        ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 3),
        ([100, 1, 1], 3),
        ([4, 4], 2),  # a short group: one parameter each
    ],
)
def test_params_are_packed_largest_first_into_the_lightest_sub_group(
    numels: list[int], sub_groups: int
) -> None:
    params = tensors(numels)
    groups = split_param_groups([{"params": params, "distributed_config": fsdp(sub_groups)}])
    assert positions(groups, params) == reference_packing(numels, sub_groups)
    assert sorted(i for group in positions(groups, params) for i in group) == list(
        range(len(numels))
    )
    loads = [sum(p.numel() for p in group["params"]) for group in groups]
    assert max(loads) - min(loads) <= max(numels)


def test_group_options_are_kept_and_the_config_copied() -> None:
    params, config, betas = tensors([6, 5, 4]), fsdp(2), (0.9, 0.99)
    group = {
        "params": params,
        "distributed_config": config,
        "lr": 0.1,
        "betas": betas,
        "epsilon": 1e-12,
    }
    before = dict(group)
    subs = split_param_groups([group])
    assert len(subs) == 2
    for sub in subs:
        assert sub.keys() == group.keys()
        assert sub["lr"] == 0.1 and sub["betas"] is betas and sub["epsilon"] == 1e-12
        assert sub["distributed_config"] == config and sub["distributed_config"] is not config
    assert subs[0]["distributed_config"] is not subs[1]["distributed_config"]
    assert group == before and group["params"] is params  # the given group is left as it was


@pytest.mark.parametrize(
    "config",
    [
        None,
        SingleDeviceDistributedConfig(),
        DDPDistributedConfig(),
        fsdp(1),
        FullyShardDistributedConfig(num_sub_groups=1),  # DEFAULT strategy
        HybridShardDistributedConfig(param_assignment_strategy=LOSSLESS),
    ],
    ids=lambda c: type(c).__name__,
)
def test_groups_that_do_not_split_pass_through_as_the_same_object(config: object) -> None:
    group: dict[str, Any] = {"params": tensors([3, 2, 1])}
    if config is not None:
        group["distributed_config"] = config
    result = split_param_groups([group])
    assert len(result) == 1 and result[0] is group


def test_params_torch_would_refuse_pass_through_for_torch_to_refuse() -> None:
    group = {"params": set(tensors([3, 2])), "distributed_config": fsdp(2)}
    assert split_param_groups([group])[0] is group


def test_a_single_tensor_is_a_group_of_one_and_cannot_be_split() -> None:
    with pytest.raises(ValueError, match="^num_sub_groups=2 is too large for 1 params"):
        split_param_groups([{"params": torch.zeros(3), "distributed_config": fsdp(2)}])


def test_names_follow_their_parameters() -> None:
    params = tensors([1, 9, 5, 4])
    names = ["a", "b", "c", "d"]
    by_key = split_param_groups(
        [{"params": params, "param_names": names, "distributed_config": fsdp(2)}]
    )
    pairs = split_param_groups(
        [{"params": list(zip(names, params)), "distributed_config": fsdp(2)}]
    )
    assert [g["param_names"] for g in by_key] == [["b", "a"], ["c", "d"]]
    assert [[name for name, _ in g["params"]] for g in pairs] == [["b", "a"], ["c", "d"]]
    for group in by_key:
        assert [names[i] for i in positions([group], params)[0]] == group["param_names"]


def test_sub_groups_left_empty_are_dropped() -> None:
    params = tensors([0, 0, 0])  # zero-size parameters never make a sub-group heavier
    groups = split_param_groups([{"params": params, "distributed_config": fsdp(2)}])
    assert positions(groups, params) == [[2, 1, 0]]


def test_untouched_and_split_groups_keep_their_order() -> None:
    first, second, third = tensors([2]), tensors([4, 3, 2]), tensors([1, 1])
    plain = {"params": first}
    kept = {"params": third, "distributed_config": fsdp(1)}
    result = split_param_groups([plain, {"params": second, "distributed_config": fsdp(2)}, kept])
    assert result[0] is plain and result[-1] is kept
    assert [len(g["params"]) for g in result[1:-1]] == [1, 2]


@pytest.mark.parametrize(
    "config, numels, message",
    [
        (
            fsdp(4),
            [3, 2, 1],
            "num_sub_groups=4 is too large for 3 params with shard_group_size=1: ",
        ),
        (fsdp(2), [], "num_sub_groups=2 is too large for 0 params"),
        (
            hsdp(3, 2),
            [5, 4, 3, 2, 1],
            "num_sub_groups=3 is too large for 5 params with shard_group_size=2: ",
        ),
        (
            hsdp(2, 2),
            [100, 1, 1, 1],
            "HSDP sub-group 0 got 1 params after greedy bin-packing, fewer than shard_size=2. ",
        ),
    ],
)
def test_degenerate_sub_groups_raise_naming_num_sub_groups(
    config: object, numels: list[int], message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        split_param_groups(
            [
                {"params": tensors([4]), "distributed_config": fsdp(1)},
                {"params": tensors(numels), "distributed_config": config},
            ]
        )


def test_hsdp_with_enough_params_per_shard_rank_splits() -> None:
    params = tensors([48, 35, 36, 36, 3, 12, 5, 36])
    groups = split_param_groups([{"params": params, "distributed_config": hsdp(3, 2)}])
    assert positions(groups, params) == reference_packing([p.numel() for p in params], 3)
    assert min(len(g["params"]) for g in groups) >= 2


# ----- the constructor's params argument -------------------------------------------------------


def test_constructor_params_split_by_the_default_config() -> None:
    params = tensors([3, 2, 2])
    groups = split_constructor_params(params, fsdp(2))
    assert positions(groups, params) == [[0], [2, 1]]
    assert all(g["distributed_config"] == fsdp(2) for g in groups)


def test_constructor_groups_use_their_own_config_before_the_default() -> None:
    own, inherits = (
        {"params": tensors([3, 2]), "distributed_config": fsdp(1)},
        {"params": tensors([3, 2])},
    )
    result = split_constructor_params([own, inherits], fsdp(2))
    assert result[0] is own
    assert [len(g["params"]) for g in result[1:]] == [1, 1]
    assert "distributed_config" not in inherits  # the user's dict is not changed


def test_constructor_params_without_a_split_are_returned_as_given() -> None:
    params = tensors([3, 2])
    assert split_constructor_params(params, SingleDeviceDistributedConfig()) is params
    groups = [{"params": params}]
    result = split_constructor_params(groups, fsdp(1))
    assert result == groups and result[0] is groups[0]
    assert split_constructor_params([], fsdp(2)) == []


# ----- the ROUND_ROBIN owner map ---------------------------------------------------------------

ROUND_ROBIN = FSDPParamAssignmentStrategy.ROUND_ROBIN


@pytest.fixture
def world_size(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Sets the world size the split reads under FSDP2 (no process group in this process)."""

    def set_size(size: int) -> None:
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: size)

    return set_size


def reference_owners(buckets: list[list[torch.Tensor]], ranks: int) -> list[list[int]]:
    """Longest first with the load carried over the buckets: per bucket, each tensor, largest
    byte count (rounded up to 64 bytes) first (equal: the earlier position first), to the rank
    of least total bytes so far over all buckets (ties: the lower rank)."""
    totals = [0] * ranks
    result = []
    for bucket in buckets:
        sizes = [64 * math.ceil(t.numel() * t.element_size() / 64) for t in bucket]
        owners = [-1] * len(bucket)
        for i in sorted(range(len(bucket)), key=lambda i: (-sizes[i], i)):
            lightest = min(range(ranks), key=lambda r: (totals[r], r))
            totals[lightest] += sizes[i]
            owners[i] = lightest
        result.append(owners)
    return result


OWNER_CASES = [
    ([1000, 10, 10, 10, 1000, 10, 10, 10], 1, 4),
    ([1, 100, 1, 100], 2, 2),
    ([48, 35, 36, 36, 3, 12, 5, 36, 70, 1, 0, 17], 3, 3),
    ([300, 20, 20, 20, 20, 20, 20, 20, 20], 2, 4),
    ([1000, 500], 1, 4),  # fewer params than ranks: two ranks own nothing
    ([7] * 9, 3, 2),
]
# HSDP refuses a sub-group of fewer params than shard ranks: the cases it splits.
HSDP_CASES = [OWNER_CASES[i] for i in (0, 1, 4, 5)]


@pytest.mark.parametrize(
    "numels, sub_groups, ranks, mesh",
    [(*case, "fsdp") for case in OWNER_CASES] + [(*case, "hsdp") for case in HSDP_CASES],
)
def test_round_robin_owner_map_is_longest_first_with_the_load_carried(
    numels: list[int], sub_groups: int, ranks: int, mesh: str, world_size: Any
) -> None:
    params = tensors(numels)
    if mesh == "fsdp":
        world_size(ranks)
        config: object = fsdp(sub_groups, ROUND_ROBIN)
    else:
        world_size(99)  # HSDP reads the mesh's shard dim, never the world size
        config = hsdp(sub_groups, ranks, ROUND_ROBIN)
    groups = split_param_groups([{"params": params, "distributed_config": config}])
    assert [len(g[OWNER_RANKS]) for g in groups] == [len(g["params"]) for g in groups]
    assert [g[OWNER_RANKS] for g in groups] == reference_owners(
        [g["params"] for g in groups], ranks
    )
    loads = [0] * ranks
    for group in groups:
        for p, r in zip(group["params"], group[OWNER_RANKS], strict=True):
            loads[r] += 64 * math.ceil(p.numel() * 4 / 64)
    assert max(loads) - min(loads) <= 64 * math.ceil(max(numels) * 4 / 64)


def test_every_sub_group_reaches_every_rank_and_the_whole_load_is_balanced(
    world_size: Any,
) -> None:
    # One map sliced per sub-group would give each sub-group's params, in placing order, the
    # ranks of one residue class; the carried load gives every sub-group every rank here.
    world_size(2)
    numels = [1, 100, 1, 100]
    groups = split_param_groups(
        [{"params": tensors(numels), "distributed_config": fsdp(2, ROUND_ROBIN)}]
    )
    loads = [0, 0]
    for group in groups:
        assert sorted(set(group[OWNER_RANKS])) == [0, 1]
        for p, r in zip(group["params"], group[OWNER_RANKS], strict=True):
            loads[r] += p.numel()
    assert loads == [101, 101]


def test_an_unsplit_round_robin_group_gets_its_map_in_a_new_dict(world_size: Any) -> None:
    world_size(4)
    params = tensors([1000, 10, 10, 10, 1000, 10, 10, 10])
    group = {"params": params, "distributed_config": fsdp(1, ROUND_ROBIN), "lr": 0.1}
    (result,) = split_param_groups([group])
    assert result is not group and OWNER_RANKS not in group
    assert result["params"] is params and result["lr"] == 0.1
    # The two large params (4032 bytes each; the rest 64), which a positional i % 4 would
    # both give rank 0, go to ranks 0 and 1; the small ones fill ranks 2 and 3.
    assert result[OWNER_RANKS] == [0, 2, 3, 2, 1, 3, 2, 3]


def test_a_map_the_group_carries_is_kept_and_cut_with_its_params(world_size: Any) -> None:
    world_size(2)
    params = tensors([1, 9, 5, 4])
    unsplit = {"params": params, "distributed_config": fsdp(1, ROUND_ROBIN), OWNER_RANKS: [1] * 4}
    assert split_param_groups([unsplit])[0] is unsplit
    given = [0, 1, 1, 0]
    subs = split_param_groups(
        [{"params": params, "distributed_config": fsdp(2, ROUND_ROBIN), OWNER_RANKS: given}]
    )
    for sub, indices in zip(subs, positions(subs, params), strict=True):
        assert sub[OWNER_RANKS] == [given[i] for i in indices]


@pytest.mark.parametrize("given", [[0, 1], 3, "0,1,0"])
def test_a_carried_map_not_one_entry_per_param_is_refused_naming_owner_ranks(
    given: object, world_size: Any
) -> None:
    world_size(2)
    group = {"params": tensors([3, 2, 1]), "distributed_config": fsdp(2, ROUND_ROBIN)}
    group[OWNER_RANKS] = given
    with pytest.raises(
        ValueError, match="^owner_ranks must be a list of one owner rank per"
    ) as info:
        split_param_groups([group])
    assert error_field(info.value) == "owner_ranks"


def test_params_torch_would_refuse_get_no_map(world_size: Any) -> None:
    world_size(2)
    group = {"params": [1.0, torch.zeros(2)], "distributed_config": fsdp(1, ROUND_ROBIN)}
    assert split_param_groups([group])[0] is group  # for add_param_group to refuse


def test_no_map_without_a_process_group_or_mesh_nor_under_other_strategies(
    world_size: Any,
) -> None:
    group = {"params": tensors([3, 2, 1]), "distributed_config": fsdp(1, ROUND_ROBIN)}
    assert split_param_groups([group])[0] is group  # no world size: the distributor computes it
    world_size(2)
    for config in (fsdp(1), fsdp(2), FullyShardDistributedConfig(), DDPDistributedConfig()):
        for sub in split_param_groups(
            [{"params": tensors([3, 2, 1]), "distributed_config": config}]
        ):
            assert OWNER_RANKS not in sub
