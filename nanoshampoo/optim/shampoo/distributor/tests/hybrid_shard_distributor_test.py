"""Shampoo on HSDP parameters (``fully_shard`` on a replicate x shard mesh), on gloo.

Specification, on a 2 x 2 mesh and on a 1 x 2 mesh (one replica: the replicate group is each
rank alone): with the shard-group strategy ``ROUND_ROBIN`` or ``REPLICATE`` the result equals
single-device Shampoo on the unsharded parameters; with ``DEFAULT`` it equals single-device
Shampoo on the shards of a 2-way split (the shard dim's size) as separate parameters; both
``communicate_params`` settings; float32, <= 1e-5 relative. The work of a shard is split over
the two replicas (optimizer state per rank below the ``fully_shard`` figure at 2 shards); with
one replica each rank holds exactly the ``fully_shard`` figure.
"""

from __future__ import annotations

import re
from typing import Any
from unittest.mock import MagicMock

import pytest
import torch

# The neighbouring test module (pytest puts its dir on sys.path).
from fully_shard_distributor_test import (
    STEPS,
    assert_close,
    full_params,
    make_optimizer,
    params_model,
    reference_default,
    reference_lossless,
    train,
)

from nanoshampoo.optim.shampoo import (
    DistributedShampoo,
    FSDPParamAssignmentStrategy,
    FullyShardDistributedConfig,
    HybridShardDistributedConfig,
)
from nanoshampoo.optim.shampoo.config_checks import error_field
from nanoshampoo.testing.distributed import run_on_gloo

REPLICAS, SHARDS = 2, 2
CASES = [
    (strategy, communicate)
    for strategy in (
        FSDPParamAssignmentStrategy.DEFAULT,
        FSDPParamAssignmentStrategy.ROUND_ROBIN,
        FSDPParamAssignmentStrategy.REPLICATE,
    )
    for communicate in (False, True)
]


def run_case(mesh: Any, config: Any) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    model = params_model()
    fully_shard(model, mesh=mesh)
    optimizer = make_optimizer(list(model.parameters()), config)
    train(model, optimizer, range(STEPS))
    return {"params": full_params(model), "state_bytes": optimizer.optimizer_state_bytes()}


def body(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    hsdp_mesh = init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))
    results = {
        f"{strategy.name}-{communicate}": run_case(
            hsdp_mesh,
            HybridShardDistributedConfig(
                device_mesh=hsdp_mesh,
                param_assignment_strategy=strategy,
                communicate_params=communicate,
            ),
        )
        for strategy, communicate in CASES
    }
    # The same shard split without replicas: fully_shard over the shard dim's groups only.
    shard_mesh = hsdp_mesh["shard"]
    results["fsdp"] = run_case(
        shard_mesh,
        FullyShardDistributedConfig(
            param_assignment_strategy=FSDPParamAssignmentStrategy.ROUND_ROBIN
        ),
    )
    # One replica: the 4 ranks as a 2 x 1 x 2 mesh, whose last two dims are a 1 x 2 HSDP mesh
    # (ranks 0, 1 form one, ranks 2, 3 another; both train the same model). The replicate group
    # is then every rank alone, while the world has 4 ranks.
    one_replica = init_device_mesh(
        "cpu", (2, 1, SHARDS), mesh_dim_names=("outer", "replicate", "shard")
    )["replicate", "shard"]
    for strategy, communicate in CASES:
        results[f"1x2-{strategy.name}-{communicate}"] = run_case(
            one_replica,
            HybridShardDistributedConfig(
                device_mesh=one_replica,
                param_assignment_strategy=strategy,
                communicate_params=communicate,
            ),
        )
    # An invalid replica count is refused before any collective, so no rank hangs.
    try:
        run_case(hsdp_mesh, HybridShardDistributedConfig(num_trainers_per_group=3))
    except ValueError as error:
        results["invalid_trainers"] = str(error)
    return results


@pytest.fixture(scope="module")
def world4() -> list[dict[str, Any]]:
    return run_on_gloo(body, REPLICAS * SHARDS)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy, communicate", CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_hsdp_2x2_equals_single_device(
    world4: list[dict[str, Any]], strategy: FSDPParamAssignmentStrategy, communicate: bool
) -> None:
    lossy = strategy == FSDPParamAssignmentStrategy.DEFAULT
    want = reference_default(SHARDS, STEPS) if lossy else reference_lossless(STEPS)
    for result in world4:
        assert_close(result[f"{strategy.name}-{communicate}"]["params"], want)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy, communicate", CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_hsdp_one_replica_equals_single_device(
    world4: list[dict[str, Any]], strategy: FSDPParamAssignmentStrategy, communicate: bool
) -> None:
    lossy = strategy == FSDPParamAssignmentStrategy.DEFAULT
    want = reference_default(SHARDS, STEPS) if lossy else reference_lossless(STEPS)
    for result in world4:
        assert_close(result[f"1x2-{strategy.name}-{communicate}"]["params"], want)


@pytest.mark.slow
@pytest.mark.distributed
def test_hsdp_one_replica_holds_the_fully_shard_state(world4: list[dict[str, Any]]) -> None:
    for result in world4:
        assert result["1x2-ROUND_ROBIN-False"]["state_bytes"] == result["fsdp"]["state_bytes"]


@pytest.mark.slow
@pytest.mark.distributed
def test_hsdp_splits_the_shard_work_over_the_replicas(world4: list[dict[str, Any]]) -> None:
    model = params_model()
    from nanoshampoo.optim.shampoo import SingleDeviceDistributedConfig

    single = make_optimizer(
        list(model.parameters()), SingleDeviceDistributedConfig()
    ).optimizer_state_bytes()
    hsdp = [r["ROUND_ROBIN-False"]["state_bytes"] for r in world4]
    fsdp = [r["fsdp"]["state_bytes"] for r in world4]
    # Ranks (0, s) and (1, s) hold disjoint halves of what rank s holds without replicas.
    for s in range(SHARDS):
        assert hsdp[s] + hsdp[SHARDS + s] == fsdp[s] == fsdp[SHARDS + s]
    assert sum(hsdp) == single and max(hsdp) < max(fsdp)


@pytest.mark.slow
@pytest.mark.distributed
def test_num_trainers_per_group_other_than_the_replicas_is_refused(
    world4: list[dict[str, Any]],
) -> None:
    for result in world4:
        assert result["invalid_trainers"].startswith(
            "num_trainers_per_group must be -1 or the replicate"
        )


@pytest.mark.parametrize("mesh", ["mesh", MagicMock(), "1-D"])
@pytest.mark.parametrize("sub_groups", [1, 2])
def test_an_unusable_mesh_is_accepted_by_the_config_and_refused_by_the_optimizer(
    mesh: Any, sub_groups: int
) -> None:
    """As in the reference, the config takes any ``device_mesh`` (a stand-in serves
    ``split_param_groups``); building the optimizer refuses one the distributor cannot use, in
    one line naming the field, before anything is split or built. Also for a group added later,
    which the distributor itself checks."""
    if mesh == "1-D":
        from torch.distributed.device_mesh import DeviceMesh

        mesh = MagicMock(spec=DeviceMesh, ndim=1)
    config = HybridShardDistributedConfig(
        device_mesh=mesh,
        param_assignment_strategy=FSDPParamAssignmentStrategy.REPLICATE,
        num_sub_groups=sub_groups,
    )
    assert config.device_mesh is mesh
    params = [torch.nn.Parameter(torch.zeros(4, 4)) for _ in range(4)]
    got = "a 1-D DeviceMesh" if getattr(mesh, "ndim", None) == 1 else f"a {type(mesh).__name__}"
    want = (
        "device_mesh must be None or a 2-D DeviceMesh (replicate x shard) to build "
        f"HybridShardDistributedConfig's distributor, got {got}"
    )
    with pytest.raises(ValueError) as refused:
        DistributedShampoo(params, distributed_config=config)
    assert (str(refused.value), error_field(refused.value)) == (want, "device_mesh")
    optimizer = DistributedShampoo(params[:1])
    with pytest.raises(ValueError) as refused:
        optimizer.add_param_group({"params": params[1:], "distributed_config": config})
    assert (str(refused.value), error_field(refused.value)) == (want, "device_mesh")
    assert len(optimizer.param_groups) == 1


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"communication_dtype": torch.int8}, "communication_dtype"),
        ({"num_trainers_per_group": 0}, "num_trainers_per_group"),
        ({"communicate_params": None}, "communicate_params"),
        ({"param_assignment_strategy": 2}, "param_assignment_strategy"),
    ],
)
def test_invalid_config_raises_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as info:
        HybridShardDistributedConfig(**kwargs)
    assert re.match(field, error_field(info.value)), str(info.value)
