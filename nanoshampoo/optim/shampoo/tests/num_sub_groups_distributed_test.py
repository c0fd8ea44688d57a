"""``num_sub_groups`` on FSDP2 and HSDP parameters, on gloo: the split changes no number.

Specification, float32 at the recipe's epsilon 1e-12, after ``STEPS`` steps:

- FSDP2 at world size 2 and HSDP on a 2 x 2 mesh, both lossless strategies: the optimizer has
  the sub-groups of :func:`split_param_groups` as its ``param_groups`` (with ``num_sub_groups``
  2 and 3), and its parameters equal, bit for bit, those of ``num_sub_groups=1`` and of
  single-device Shampoo on the unsharded parameters in one process;
- the optimizer state per parameter is the same whichever sub-group holds the parameter (the
  union over ranks, matched by parameter);
- a ``torch.distributed.checkpoint`` saved at one ``num_sub_groups`` loads at another (through
  :func:`regroup_by_param_names`, both strategies) and the run continues bit for bit as if
  uninterrupted.

The parameters: 1-D/2-D/3-D shapes, blocks split at ``MAX_DIM``, numels chosen so that the HSDP
sub-groups hold at least the shard size's 2 parameters each. One spawn per mesh runs every case.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from param_group_split_test import (
    FakeMesh,  # the neighbouring test module (pytest puts its dir on sys.path)
)

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    ClassicMomentumConfig,
    DistributedConfig,
    DistributedShampoo,
    FSDPParamAssignmentStrategy,
    FullyShardDistributedConfig,
    HybridShardDistributedConfig,
    SingleDeviceDistributedConfig,
)
from nanoshampoo.optim.shampoo.param_group_split import split_param_groups
from nanoshampoo.optim.shampoo.state_dict_regrouping import regroup_by_param_names
from nanoshampoo.optim.shampoo.state_dict_trees import flatten_tree
from nanoshampoo.testing.distributed import run_on_gloo
from nanoshampoo.testing.toy_models import ParamsModel

SHAPES = ((8, 6), (7, 5), (6, 2, 3), (9, 4), (3,), (2, 6), (5,), (12, 3))
MAX_DIM = 4
STEPS, RESUME_AT = 5, 3
SUB_GROUPS = (1, 2, 3)
STRATEGIES = (FSDPParamAssignmentStrategy.ROUND_ROBIN, FSDPParamAssignmentStrategy.REPLICATE)


def params_model(seed: int = 0) -> ParamsModel:
    """Parameters of ``SHAPES`` and a smooth, non-quadratic loss of them, new each step."""
    return ParamsModel(SHAPES, seed)


def make_optimizer(params: list[torch.Tensor], config: DistributedConfig) -> DistributedShampoo:
    return DistributedShampoo(
        params,
        lr=0.05,
        betas=(0.9, 0.99),
        epsilon=1e-12,
        weight_decay=0.01,
        max_preconditioner_dim=MAX_DIM,
        precondition_frequency=2,
        iterate_averaging_config=ClassicMomentumConfig(momentum=0.5),
        grafting_config=AdamPreconditionerConfig(beta2=0.99, epsilon=1e-8),
        distributed_config=config,
    )


def train(model: ParamsModel, optimizer: DistributedShampoo, steps: range) -> None:
    """The same loss on every rank, so FSDP's averaged gradient is the single-device one."""
    for step in steps:
        model.zero_grad()
        model(step).backward()
        optimizer.step()


def single_device_params(steps: int) -> list[torch.Tensor]:
    model = params_model()
    train(
        model,
        make_optimizer(list(model.parameters()), SingleDeviceDistributedConfig()),
        range(steps),
    )
    return [p.detach().clone() for p in model.parameters()]


# ----- the spawned side ------------------------------------------------------------------------


def config_for(
    mesh: Any, strategy: FSDPParamAssignmentStrategy, sub_groups: int
) -> DistributedConfig:
    if mesh.ndim == 2:
        return HybridShardDistributedConfig(
            device_mesh=mesh, param_assignment_strategy=strategy, num_sub_groups=sub_groups
        )
    return FullyShardDistributedConfig(
        param_assignment_strategy=strategy, num_sub_groups=sub_groups
    )


def sharded_run(mesh: Any, config: DistributedConfig) -> tuple[ParamsModel, DistributedShampoo]:
    """A ``fully_shard`` model and its optimizer over the named parameters."""
    from torch.distributed.fsdp import fully_shard

    model = params_model()
    fully_shard(model, mesh=mesh)
    return model, make_optimizer(list(model.named_parameters()), config)


def state_by_param(
    model: ParamsModel, optimizer: DistributedShampoo
) -> dict[int, dict[str, torch.Tensor]]:
    """This rank's block state keyed by the parameter's position in ``model.parameters()``."""
    position = {id(p): i for i, p in enumerate(model.parameters())}
    optimizer_params = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        position[id(optimizer_params[index])]: {
            k: v.clone() for k, v in flatten_tree(entries).items()
        }
        for index, entries in optimizer.state_dict()["state"].items()
    }


def run_case(mesh: Any, strategy: FSDPParamAssignmentStrategy, sub_groups: int) -> dict[str, Any]:
    model, optimizer = sharded_run(mesh, config_for(mesh, strategy, sub_groups))
    train(model, optimizer, range(STEPS))
    position = {id(p): i for i, p in enumerate(model.parameters())}
    return {
        "params": [p.full_tensor().detach().clone() for p in model.parameters()],
        "groups": [[position[id(p)] for p in group["params"]] for group in optimizer.param_groups],
        "state": state_by_param(model, optimizer),
    }


def resume_across(
    mesh: Any, strategy: FSDPParamAssignmentStrategy, saved_at: int, loaded_at: int, checkpoint: str
) -> list[torch.Tensor]:
    """Train at ``saved_at`` sub-groups, save a DCP checkpoint, load it at ``loaded_at``, train
    on."""
    import torch.distributed.checkpoint as dcp

    model, optimizer = sharded_run(mesh, config_for(mesh, strategy, saved_at))
    train(model, optimizer, range(RESUME_AT))
    dcp.save({"optim": optimizer.state_dict()}, checkpoint_id=checkpoint)
    resumed = make_optimizer(list(model.named_parameters()), config_for(mesh, strategy, loaded_at))
    assert len(resumed.param_groups) == loaded_at
    saved_layout = split_param_groups(
        [
            {
                "params": list(model.named_parameters()),
                "distributed_config": config_for(mesh, strategy, saved_at),
            }
        ]
    )
    template = {"optim": regroup_by_param_names(resumed.state_dict(), saved_layout)}
    dcp.load(template, checkpoint_id=checkpoint)
    resumed.load_state_dict(template["optim"])
    train(model, resumed, range(RESUME_AT, STEPS))
    return [p.full_tensor().detach().clone() for p in model.parameters()]


RESUMES = [
    (FSDPParamAssignmentStrategy.ROUND_ROBIN, 1, 2),
    (FSDPParamAssignmentStrategy.REPLICATE, 3, 1),
]


def body(rank: int, world: int, mesh_shape: tuple[int, ...], checkpoints: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    results: dict[str, Any] = {
        f"{strategy.name}-{n}": run_case(mesh, strategy, n)
        for strategy in STRATEGIES
        for n in SUB_GROUPS
    }
    for strategy, saved_at, loaded_at in RESUMES:
        key = f"{strategy.name} {saved_at}->{loaded_at}"
        results[key] = resume_across(mesh, strategy, saved_at, loaded_at, f"{checkpoints}/{key}")
    return results


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_on_gloo(body, 2, (2,), str(tmp_path_factory.mktemp("fsdp_sub_groups")))


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_on_gloo(body, 4, (2, 2), str(tmp_path_factory.mktemp("hsdp_sub_groups")))


def expected_groups(sub_groups: int, shard_size: int) -> list[list[int]]:
    """The split of the model's parameters by :func:`split_param_groups`, as positions."""
    params = list(params_model().parameters())
    config = (
        FullyShardDistributedConfig(
            param_assignment_strategy=FSDPParamAssignmentStrategy.REPLICATE,
            num_sub_groups=sub_groups,
        )
        if shard_size == 1
        else HybridShardDistributedConfig(
            device_mesh=FakeMesh(shard_size),
            param_assignment_strategy=FSDPParamAssignmentStrategy.REPLICATE,
            num_sub_groups=sub_groups,
        )
    )
    position = {id(p): i for i, p in enumerate(params)}
    groups = split_param_groups([{"params": params, "distributed_config": config}])
    return [[position[id(p)] for p in group["params"]] for group in groups]


MESHES = [("fsdp", 1), ("hsdp", 2)]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mesh, shard_size", MESHES)
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
@pytest.mark.parametrize("sub_groups", SUB_GROUPS)
def test_sub_groups_step_exactly_as_one_group_and_one_device(
    mesh: str,
    shard_size: int,
    strategy: FSDPParamAssignmentStrategy,
    sub_groups: int,
    request: pytest.FixtureRequest,
) -> None:
    want = single_device_params(STEPS)
    for result in request.getfixturevalue(mesh):
        case = result[f"{strategy.name}-{sub_groups}"]
        assert case["groups"] == expected_groups(sub_groups, shard_size)
        assert len(case["groups"]) == sub_groups
        for got, one_group, single in zip(
            case["params"], result[f"{strategy.name}-1"]["params"], want, strict=True
        ):
            assert got.dtype == torch.float32
            assert torch.equal(got, one_group)
            assert torch.equal(got, single)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mesh", ["fsdp", "hsdp"])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_state_per_parameter_does_not_depend_on_the_split(
    mesh: str, strategy: FSDPParamAssignmentStrategy, request: pytest.FixtureRequest
) -> None:
    def union(sub_groups: int) -> dict[int, dict[str, torch.Tensor]]:
        merged: dict[int, dict[str, torch.Tensor]] = {}
        for result in request.getfixturevalue(mesh):
            for index, entries in result[f"{strategy.name}-{sub_groups}"]["state"].items():
                merged.setdefault(index, {}).update(entries)
        return merged

    one = union(1)
    assert sorted(one) == list(range(len(SHAPES)))
    for sub_groups in SUB_GROUPS[1:]:
        split = union(sub_groups)
        assert split.keys() == one.keys()
        for index, entries in one.items():
            assert split[index].keys() == entries.keys()
            for key, value in entries.items():
                assert torch.equal(split[index][key], value), (sub_groups, index, key)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mesh", ["fsdp", "hsdp"])
@pytest.mark.parametrize(
    "strategy, saved_at, loaded_at", RESUMES, ids=lambda v: getattr(v, "name", str(v))
)
def test_checkpoint_loads_across_num_sub_groups(
    mesh: str,
    strategy: FSDPParamAssignmentStrategy,
    saved_at: int,
    loaded_at: int,
    request: pytest.FixtureRequest,
) -> None:
    results = request.getfixturevalue(mesh)
    uninterrupted = results[0][f"{strategy.name}-{saved_at}"]["params"]
    for result in results:
        for got, want in zip(
            result[f"{strategy.name} {saved_at}->{loaded_at}"], uninterrupted, strict=True
        ):
            assert torch.equal(got, want)
