"""The ``ROUND_ROBIN`` owner map (``owner_ranks``) under FSDP2 and HSDP, on gloo.

Specification, float32 at the recipe's epsilon 1e-12, after ``STEPS`` steps, FSDP2 at world
sizes 2 and 4 and HSDP on a 2 x 2 mesh:

- the map ``split_param_groups`` attaches, a map the user gives, and a group added without one
  (its distributor computes the map, the same as the split's, and writes it into the group) all
  end at the parameters of single-device Shampoo in one process, bit for bit;
- the map decides who computes: the parameters whose blocks a shard rank holds state for are
  exactly those the map gives it (over the replicas under HSDP);
- a ``state_dict()`` saved through ``torch.save`` and loaded with ``weights_only=True`` into a
  fresh optimizer continues bit for bit as the uninterrupted run, also when the saved groups
  carry no map (a checkpoint from before the maps) or another map (another world size): the
  optimizer keeps its own;
- a bad map (length, range, type, under another strategy, changed after construction) is
  refused in one line naming ``owner_ranks``, on every rank alike (no rank hangs).

The split's map itself is checked against a slow longest-first loop in
``param_group_split_test.py``.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from num_sub_groups_distributed_test import (  # the neighbouring test module
    RESUME_AT,
    STEPS,
    make_optimizer,
    params_model,
    single_device_params,
    train,
)

from nanoshampoo.optim.shampoo import (
    DistributedConfig,
    FSDPParamAssignmentStrategy,
    FullyShardDistributedConfig,
    HybridShardDistributedConfig,
    SingleDeviceDistributedConfig,
)
from nanoshampoo.optim.shampoo.config_checks import error_field
from nanoshampoo.optim.shampoo.param_group_split import split_param_groups
from nanoshampoo.optim.shampoo.shampoo_types import OWNER_RANKS
from nanoshampoo.optim.shampoo.state_dict_layout import is_block_key
from nanoshampoo.testing.distributed import run_on_gloo

ROUND_ROBIN = FSDPParamAssignmentStrategy.ROUND_ROBIN
FIRST = 3  # the "added" case: a constructor group of the first FIRST params, then the rest


def given_map(num_params: int, shard_size: int) -> list[int]:
    """A valid map unlike the balanced one: ``(3i + 1) mod shard_size``."""
    return [(3 * i + 1) % shard_size for i in range(num_params)]


def single_device_added(steps: int) -> list[torch.Tensor]:
    """One process: the first FIRST params in the constructor's group, the rest added."""
    model = params_model()
    params = list(model.parameters())
    optimizer = make_optimizer(params[:FIRST], SingleDeviceDistributedConfig())
    optimizer.add_param_group({"params": params[FIRST:]})
    train(model, optimizer, range(steps))
    return [p.detach().clone() for p in model.parameters()]


# ----- the spawned side ------------------------------------------------------------------------


def config_for(mesh: Any, strategy: FSDPParamAssignmentStrategy = ROUND_ROBIN) -> DistributedConfig:
    if mesh.ndim == 2:
        return HybridShardDistributedConfig(device_mesh=mesh, param_assignment_strategy=strategy)
    return FullyShardDistributedConfig(param_assignment_strategy=strategy)


def sharded_model(mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = params_model()
    fully_shard(model, mesh=mesh)
    return model


def full_params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def owned(optimizer: Any) -> list[int]:
    """The parameter indices whose blocks this rank holds state for."""
    state = optimizer.state_dict()["state"]
    return sorted(i for i, entries in state.items() if any(is_block_key(k) for k in entries))


def run_with(mesh: Any, given: tuple[int, ...] | None) -> dict[str, Any]:
    model = sharded_model(mesh)
    group: dict[str, Any] = {"params": list(model.parameters())}
    if given is not None:
        group[OWNER_RANKS] = given
    optimizer = make_optimizer([group], config_for(mesh))
    train(model, optimizer, range(STEPS))
    return {
        "map": list(optimizer.param_groups[0][OWNER_RANKS]),
        "owned": owned(optimizer),
        "params": full_params(model),
    }


def run_added(mesh: Any) -> dict[str, Any]:
    model = sharded_model(mesh)
    params = list(model.parameters())
    optimizer = make_optimizer(params[:FIRST], config_for(mesh))
    optimizer.add_param_group({"params": params[FIRST:]})
    split = split_param_groups([{"params": params[FIRST:], "distributed_config": config_for(mesh)}])
    train(model, optimizer, range(STEPS))
    return {
        "maps": [list(g[OWNER_RANKS]) for g in optimizer.param_groups],
        "split_map": split[0][OWNER_RANKS],
        "params": full_params(model),
    }


def round_trip(mesh: Any) -> dict[str, Any]:
    """Save at RESUME_AT through torch.save; load variants into fresh optimizers; train on."""
    model = sharded_model(mesh)
    optimizer = make_optimizer(list(model.parameters()), config_for(mesh))
    train(model, optimizer, range(RESUME_AT))
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    saved_values = [p.to_local().detach().clone() for p in model.parameters()]
    own_map = list(optimizer.param_groups[0][OWNER_RANKS])
    train(model, optimizer, range(RESUME_AT, STEPS))
    results: dict[str, Any] = {"uninterrupted": full_params(model), "own_map": own_map}
    for variant in ("as saved", "no map", "another map"):
        with torch.no_grad():
            for p, value in zip(model.parameters(), saved_values, strict=True):
                p.to_local().copy_(value)
        fresh = make_optimizer(list(model.parameters()), config_for(mesh))
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        assert saved["param_groups"][0][OWNER_RANKS] == own_map
        if variant == "no map":
            del saved["param_groups"][0][OWNER_RANKS]
        elif variant == "another map":
            saved["param_groups"][0][OWNER_RANKS] = [0] * len(own_map)
        fresh.load_state_dict(saved)
        loaded_map = list(fresh.param_groups[0][OWNER_RANKS])
        train(model, fresh, range(RESUME_AT, STEPS))
        results[variant] = {"map": loaded_map, "params": full_params(model)}
    return results


def refusals(mesh: Any) -> dict[str, tuple[str, str]]:
    """Per bad map, the error's field and message (every rank raises the same)."""
    shard_size = mesh.size(mesh.ndim - 1)
    model = sharded_model(mesh)
    params = list(model.parameters())
    n = len(params)
    cases: dict[str, tuple[list[Any], DistributedConfig]] = {
        "length": ([0] * (n - 1), config_for(mesh)),
        "range": ([0] * (n - 1) + [shard_size], config_for(mesh)),
        "negative": ([-1] + [0] * (n - 1), config_for(mesh)),
        "type": ([True] * n, config_for(mesh)),
        "replicate": ([0] * n, config_for(mesh, FSDPParamAssignmentStrategy.REPLICATE)),
    }
    found: dict[str, tuple[str, str]] = {}
    for name, (owner_ranks, config) in cases.items():
        try:
            make_optimizer([{"params": params, OWNER_RANKS: owner_ranks}], config)
        except ValueError as error:
            found[name] = (error_field(error), str(error))
    optimizer = make_optimizer(params, config_for(mesh))
    optimizer.param_groups[0][OWNER_RANKS] = given_map(n, shard_size)
    model.zero_grad()
    model(0).backward()
    try:
        optimizer.step()
    except ValueError as error:
        found["changed"] = (error_field(error), str(error))
    return found


def body(rank: int, world: int, mesh_shapes: list[tuple[int, ...]]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    results: dict[str, Any] = {}
    for shape in mesh_shapes:
        names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        shard_size = shape[-1]
        n = len(list(params_model().parameters()))
        results[shape] = {
            "shard_rank": mesh.get_local_rank(len(shape) - 1),
            "split": run_with(mesh, None),
            # A tuple: the group keeps it as given, and the step's check compares entries.
            "given": run_with(mesh, tuple(given_map(n, shard_size))),
            "added": run_added(mesh),
            "round trip": round_trip(mesh),
            "refusals": refusals(mesh),
        }
    return results


@pytest.fixture(scope="module")
def world2() -> list[dict[str, Any]]:
    return run_on_gloo(body, 2, [(2,)])


@pytest.fixture(scope="module")
def world4() -> list[dict[str, Any]]:
    return run_on_gloo(body, 4, [(4,), (2, 2)])


MESHES = [("world2", (2,)), ("world4", (4,)), ("world4", (2, 2))]
IDS = ["fsdp-2", "fsdp-4", "hsdp-2x2"]


def results_for(fixture: str, shape: tuple[int, ...], request: pytest.FixtureRequest) -> list[Any]:
    return [result[shape] for result in request.getfixturevalue(fixture)]


def assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32 and torch.equal(g, w)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("fixture, shape", MESHES, ids=IDS)
def test_split_given_and_computed_maps_step_as_one_device(
    fixture: str, shape: tuple[int, ...], request: pytest.FixtureRequest
) -> None:
    want = single_device_params(STEPS)
    want_added = single_device_added(STEPS)
    n = len(want)
    for result in results_for(fixture, shape, request):
        assert result["given"]["map"] == given_map(n, shape[-1]) != result["split"]["map"]
        assert_equal(result["split"]["params"], want)
        assert_equal(result["given"]["params"], want)
        added = result["added"]
        # The added group's map, computed by its distributor, is the split's for those params.
        assert added["maps"][1] == added["split_map"]
        assert [len(m) for m in added["maps"]] == [FIRST, n - FIRST]
        assert_equal(added["params"], want_added)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("fixture, shape", MESHES, ids=IDS)
@pytest.mark.parametrize("case", ["split", "given"])
def test_each_shard_rank_computes_the_params_the_map_gives_it(
    fixture: str, shape: tuple[int, ...], case: str, request: pytest.FixtureRequest
) -> None:
    results = results_for(fixture, shape, request)
    owner_map = results[0][case]["map"]
    for shard_rank in range(shape[-1]):
        held = {i for r in results if r["shard_rank"] == shard_rank for i in r[case]["owned"]}
        assert held == {i for i, owner in enumerate(owner_map) if owner == shard_rank}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("fixture, shape", MESHES, ids=IDS)
@pytest.mark.parametrize("variant", ["as saved", "no map", "another map"])
def test_state_dict_round_trip_continues_exactly(
    fixture: str, shape: tuple[int, ...], variant: str, request: pytest.FixtureRequest
) -> None:
    for result in results_for(fixture, shape, request):
        trip = result["round trip"]
        assert trip[variant]["map"] == trip["own_map"]  # the optimizer keeps its own map
        assert_equal(trip[variant]["params"], trip["uninterrupted"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("fixture, shape", MESHES, ids=IDS)
def test_bad_maps_are_refused_in_one_line_naming_owner_ranks(
    fixture: str, shape: tuple[int, ...], request: pytest.FixtureRequest
) -> None:
    shard_size = shape[-1]
    expected = {
        "length": "owner_ranks has 7 entries for the group's 8 params",
        "range": f"owner_ranks[7]={shard_size} is not a shard rank: it must be an int in "
        f"[0, {shard_size})",
        "negative": "owner_ranks[0]=-1 is not a shard rank",
        "type": "owner_ranks[0]=True is not a shard rank",
        "replicate": "owner_ranks is read under param_assignment_strategy=ROUND_ROBIN only, "
        "got REPLICATE",
        "changed": "owner_ranks cannot change after the group is added",
    }
    for result in results_for(fixture, shape, request):
        found = result["refusals"]
        assert found.keys() == expected.keys()
        for name, start in expected.items():
            field, message = found[name]
            assert field == "owner_ranks" and "\n" not in message, name
            assert message.startswith(start), (name, message)


@pytest.mark.parametrize(
    "config", [SingleDeviceDistributedConfig(), None], ids=["single-device", "default"]
)
def test_a_map_outside_fsdp2_and_hsdp_is_refused_naming_owner_ranks(config: Any) -> None:
    model = params_model()
    group: dict[str, Any] = {"params": list(model.parameters()), OWNER_RANKS: [0] * 8}
    if config is not None:
        group["distributed_config"] = config
    with pytest.raises(ValueError, match="^owner_ranks is read under FullyShard") as info:
        make_optimizer([group], SingleDeviceDistributedConfig())
    assert error_field(info.value) == "owner_ranks"
