"""``load_balancing_config`` and ``num_sub_groups`` on the distributed configs.

The cost model decides which rank owns which block (DDP, HSDP's replicas) or which parameter
(``ROUND_ROBIN``); it never changes the numbers. The assignments below are computed by hand
from the greedy rule of ``distribute_buffer_sizes`` (largest load first, to the least loaded
rank, ties to the lower rank), and a gloo run at world size 2 checks both the assignment and
that the parameters equal the single-device optimizer's.

Shapes (``max_preconditioner_dim`` 64, ``target_parameter_dimensionality`` 2, so each is one
block): bytes (aligned to 64) 256, 256, 1024, 192; cubic cost ``sum d^3`` 262144, 1024, 8192,
64000. Bytes: (16, 16) goes to rank 0, the rest to rank 1. Cubic: (64,) to rank 0, the rest to
rank 1.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DDPDistributedConfig,
    DistributedConfig,
    DistributedShampoo,
    FSDPParamAssignmentStrategy,
    FullyShardDistributedConfig,
    HybridShardDistributedConfig,
    LoadBalancingConfig,
    SingleDeviceDistributedConfig,
)
from nanoshampoo.optim.shampoo.distributor.fully_shard_plan import (
    ShardedParam,
    assign_owners,
    shard_row_ranges,
)
from nanoshampoo.optim.shampoo.utils.load_balancing_utils import (
    AlignedMemoryCostModel,
    PolynomialComputationalCostModel,
)
from nanoshampoo.testing.distributed import run_on_gloo

torch.set_num_threads(1)

SHAPES = [(64,), (8, 8), (16, 16), (40,)]
# Rank 0's parameters under each cost model (the hand computation in the module docstring).
RANK0_PARAMS = {"bytes": [2], "cubic": [0]}
COST_MODELS = {"bytes": AlignedMemoryCostModel(), "cubic": PolynomialComputationalCostModel()}
STEPS = 3
SHARDED = [DDPDistributedConfig, FullyShardDistributedConfig, HybridShardDistributedConfig]


@pytest.mark.parametrize("config_class", SHARDED)
def test_default_balances_aligned_bytes(config_class: type) -> None:
    config = config_class()
    assert config.load_balancing_config == LoadBalancingConfig()
    assert isinstance(config.load_balancing_config.cost_model, AlignedMemoryCostModel)
    assert config.load_balancing_config is not config_class().load_balancing_config  # not shared


@pytest.mark.parametrize("config_class", SHARDED)
def test_a_load_balancing_config_of_another_type_is_refused(config_class: type) -> None:
    with pytest.raises(ValueError, match="^load_balancing_config must be a LoadBalancingConfig"):
        config_class(load_balancing_config=PolynomialComputationalCostModel())


@pytest.mark.parametrize(
    "config_class", [FullyShardDistributedConfig, HybridShardDistributedConfig]
)
@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_num_sub_groups_must_be_a_positive_int(config_class: type, bad: object) -> None:
    sentence = "Must be >= 1." if bad in (0, -2) and bad is not True else "Must be an integer."
    with pytest.raises(ValueError, match=rf"^Invalid self\.num_sub_groups={bad!r}\. {sentence}$"):
        config_class(
            num_sub_groups=bad, param_assignment_strategy=FSDPParamAssignmentStrategy.ROUND_ROBIN
        )


@pytest.mark.parametrize(
    "config_class", [FullyShardDistributedConfig, HybridShardDistributedConfig]
)
def test_num_sub_groups_above_one_needs_a_lossless_strategy(config_class: type) -> None:
    with pytest.raises(
        ValueError,
        match=r"^num_sub_groups > 1 requires param_assignment_strategy != DEFAULT \(REPLICATE or "
        r"ROUND_ROBIN\)",
    ):
        config_class(num_sub_groups=2)
    for strategy in (
        FSDPParamAssignmentStrategy.ROUND_ROBIN,
        FSDPParamAssignmentStrategy.REPLICATE,
    ):
        assert (
            config_class(num_sub_groups=3, param_assignment_strategy=strategy).num_sub_groups == 3
        )


@pytest.mark.parametrize("cost", sorted(COST_MODELS))
def test_round_robin_owners_follow_the_cost_model(cost: str) -> None:
    sharded = [
        ShardedParam(torch.zeros(shape), torch.zeros(shape), shape, shard_row_ranges(shape[0], 2))
        for shape in SHAPES
    ]
    owners = assign_owners(
        sharded,
        FSDPParamAssignmentStrategy.ROUND_ROBIN,
        2,
        LoadBalancingConfig(cost_model=COST_MODELS[cost]),
    )
    assert [o for o, ranks in enumerate(owners) if ranks == (0,)] == RANK0_PARAMS[cost]
    assert all(len(ranks) == 1 for ranks in owners)


# ----- gloo, world size 2 ------------------------------------------------------------------------


def _grads(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _initial() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _optimizer(params: list[torch.Tensor], config: DistributedConfig) -> DistributedShampoo:
    return DistributedShampoo(
        params,
        lr=0.05,
        betas=(0.9, 0.99),
        epsilon=1e-12,
        max_preconditioner_dim=64,
        precondition_frequency=1,
        start_preconditioning_step=1,
        grafting_config=AdamPreconditionerConfig(beta2=0.99, epsilon=1e-8),
        distributed_config=config,
    )


def _local_param_indices(optimizer: DistributedShampoo) -> list[int]:
    return sorted(
        {
            info.composable_block_ids[0]
            for info in optimizer._runtimes[0].distributor.local_block_info_list
        }
    )


def _ddp_run(cost: str) -> dict[str, Any]:
    params = _initial()
    config = DDPDistributedConfig(
        target_parameter_dimensionality=2,
        load_balancing_config=LoadBalancingConfig(cost_model=COST_MODELS[cost]),
    )
    optimizer = _optimizer(params, config)
    for step in range(STEPS):
        for p, g in zip(params, _grads(step)):
            p.grad = g
        optimizer.step()
    return {"owned": _local_param_indices(optimizer), "params": params}


class _LinearLoss(torch.nn.Module):
    """``loss = sum_i <p_i, g_i(step)>``: its gradient is exactly ``_grads(step)``."""

    def __init__(self) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList(torch.nn.Parameter(p) for p in _initial())

    def forward(self, step: int) -> torch.Tensor:
        return sum((p * g).sum() for p, g in zip(self.params, _grads(step)))


def _fsdp_run(cost: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    module = _LinearLoss()
    fully_shard(module, mesh=init_device_mesh("cpu", (torch.distributed.get_world_size(),)))
    config = FullyShardDistributedConfig(
        param_assignment_strategy=FSDPParamAssignmentStrategy.ROUND_ROBIN,
        target_parameter_dimensionality=2,
        load_balancing_config=LoadBalancingConfig(cost_model=COST_MODELS[cost]),
    )
    optimizer = _optimizer(list(module.parameters()), config)
    for step in range(STEPS):
        module.zero_grad()
        module(step).backward()  # the same loss on every rank: FSDP's average is _grads(step)
        optimizer.step()
    return {
        "owned": _local_param_indices(optimizer),
        "params": [p.full_tensor() for p in module.parameters()],
    }


def _body(rank: int, world: int) -> dict[str, Any]:
    return {
        f"{kind}-{cost}": run(cost)
        for kind, run in (("ddp", _ddp_run), ("fsdp", _fsdp_run))
        for cost in COST_MODELS
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_cost_models_assign_by_hand_and_keep_the_single_device_numbers() -> None:
    params = _initial()
    optimizer = _optimizer(params, SingleDeviceDistributedConfig(target_parameter_dimensionality=2))
    for step in range(STEPS):
        for p, g in zip(params, _grads(step)):
            p.grad = g
        optimizer.step()
    ranks = run_on_gloo(_body, 2)
    for name in ranks[0]:
        cost = name.split("-")[1]
        assert ranks[0][name]["owned"] == RANK0_PARAMS[cost], name
        assert ranks[1][name]["owned"] == sorted(
            set(range(len(SHAPES))) - set(RANK0_PARAMS[cost])
        ), name
        for rank in ranks:
            for got, want in zip(rank[name]["params"], params):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
