"""Primal averaging under DDP, FSDP2 (world 2) and HSDP2 (2 x 2 mesh) on gloo, against one process.

Each rank owns some blocks, keeps ``z`` only for those, and moves every parameter through the
distributor's exchange, on steps and on ``train()``/``eval()`` switches alike. The reference is
the single-device optimizer (itself checked against float64 loops of the papers' sequences in
``iterate_averaging_test.py``) on the same model. Every rank computes the same loss, so its
gradients are those DDP or FSDP2 would leave after averaging. FSDP2 and HSDP2 run
``ROUND_ROBIN`` (whole parameters per rank, so their blocks are the single-device ones).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DDPDistributedConfig,
    DistributedShampoo,
    FSDPParamAssignmentStrategy,
    FullyShardDistributedConfig,
    GeneralizedPrimalAveragingConfig,
    HybridShardDistributedConfig,
    ScheduleFreeConfig,
    SingleDeviceDistributedConfig,
)
from nanoshampoo.testing.distributed import run_on_gloo
from nanoshampoo.testing.toy_models import ParamsModel

torch.set_num_threads(1)

# With max_preconditioner_dim 8: (10, 7) -> (8, 7), (2, 7); (7,); (3, 4, 5); (6, 5): 5 blocks.
SHAPES = [(10, 7), (7,), (3, 4, 5), (6, 5)]
LRS = [0.01, 0.02, 0.03, 0.03, 0.02, 0.01]
EVAL_AFTER = 3  # eval(), a second eval(), then train() after this step
CONFIGS = {
    "schedule_free": ScheduleFreeConfig(train_interp_coeff=0.9),
    "gpa": GeneralizedPrimalAveragingConfig(eval_interp_coeff=0.8, train_interp_coeff=0.7),
}


def params_model() -> ParamsModel:
    """Parameters of ``SHAPES`` and a smooth, non-quadratic loss of them, new each step."""
    return ParamsModel(SHAPES, seed=0, loss_seed=100)


def full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()


def run(
    model: torch.nn.Module, distributed_config: Any, averaging: Any
) -> dict[str, list[torch.Tensor]]:
    """The parameters after every step, in eval mode after step ``EVAL_AFTER`` and at the end."""
    optimizer = DistributedShampoo(
        list(model.parameters()),
        lr=LRS[0],
        betas=(0.9, 0.99),
        epsilon=1e-12,
        weight_decay=0.01,
        max_preconditioner_dim=8,
        precondition_frequency=2,
        grafting_config=AdamPreconditionerConfig(beta2=0.99, epsilon=1e-8),
        iterate_averaging_config=averaging,
        distributed_config=distributed_config,
    )
    snapshots: dict[str, list[torch.Tensor]] = {}
    for step, lr in enumerate(LRS, start=1):
        optimizer.param_groups[0]["lr"] = lr
        model.zero_grad()
        model(step).backward()
        optimizer.step()
        snapshots[f"step {step}"] = [full(p) for p in model.parameters()]
        if step == EVAL_AFTER:
            optimizer.eval()
            optimizer.eval()
            snapshots["eval mid-run"] = [full(p) for p in model.parameters()]
            optimizer.train()
    optimizer.eval()
    snapshots["eval at the end"] = [full(p) for p in model.parameters()]
    return snapshots


def sharded_model(mesh: Any = None) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = params_model()
    fully_shard(model, mesh=mesh or init_device_mesh("cpu", (torch.distributed.get_world_size(),)))
    return model


def body(rank: int, world_size: int) -> dict[str, dict[str, list[torch.Tensor]]]:
    round_robin = FullyShardDistributedConfig(
        param_assignment_strategy=FSDPParamAssignmentStrategy.ROUND_ROBIN
    )
    results = {}
    for name, config in CONFIGS.items():
        results[f"ddp {name}"] = run(params_model(), DDPDistributedConfig(), config)
        results[f"fsdp2 {name}"] = run(sharded_model(), round_robin, config)
    return results


def assert_equal_to_one_process(
    got: dict[str, list[torch.Tensor]], config: Any, label: str
) -> None:
    want = run(params_model(), SingleDeviceDistributedConfig(), config)
    assert got.keys() == want.keys()
    for key in want:
        for a, b in zip(got[key], want[key]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{label}, {key}")


def hsdp_body(rank: int, world_size: int) -> dict[str, list[torch.Tensor]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    config = HybridShardDistributedConfig(
        device_mesh=mesh, param_assignment_strategy=FSDPParamAssignmentStrategy.ROUND_ROBIN
    )
    return run(sharded_model(mesh), config, CONFIGS["schedule_free"])


@pytest.mark.slow
@pytest.mark.distributed
def test_hsdp2_2x2_world_size_4_equals_one_process() -> None:
    for rank, got in enumerate(run_on_gloo(hsdp_body, 4)):
        assert_equal_to_one_process(got, CONFIGS["schedule_free"], f"hsdp2 rank {rank}")


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_and_fsdp2_world_size_2_equal_one_process() -> None:
    results = run_on_gloo(body, 2)
    for name, config in CONFIGS.items():
        for kind in ("ddp", "fsdp2"):
            for rank, rank_result in enumerate(results):
                assert_equal_to_one_process(
                    rank_result[f"{kind} {name}"], config, f"{kind} {name} rank {rank}"
                )
        want = run(params_model(), SingleDeviceDistributedConfig(), config)
        # The averaged iterate differs from the training point (the switch did something).
        assert any(
            not torch.equal(a, b) for a, b in zip(want["eval mid-run"], want[f"step {EVAL_AFTER}"])
        )
