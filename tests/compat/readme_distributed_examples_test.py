"""The reference README's distributed examples (DDP, FSDP2, HSDP2, DCP checkpointing) with the
import swapped to ``nanoshampoo.optim.shampoo``: gloo, world size 2, CPU, 5 float32 steps.

Each example's optimizer is built as the README writes it. Adapted to two CPU ranks, and
nothing else: ``device`` is the CPU, the backend gloo, ``instantiate_model`` a small MLP, the
DDP example's ``num_trainers_per_group=8`` (eight GPUs) becomes the world size, and the HSDP
mesh ``(2, WORLD_SIZE // 2)`` is ``(2, 1)``, with the dim names torch 2.13's ``fully_shard``
requires of an HSDP mesh.

With ``precondition_frequency=100`` the preconditioner starts at step 100, so the first steps
are Adam grafting on the filtered gradient with decoupled decay, which is AdamW: the steps
computed another way are ``torch.optim.AdamW`` in one process on the whole batch (each rank's
mean-loss gradient on half of it, averaged by DDP/FSDP, is the whole batch's). The checkpoint
example saves after 3 steps with ``dcp.save``, loads into a fresh model and optimizer as the
README does, and continues: it must end where the uninterrupted run ends.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from nanoshampoo.testing.distributed import run_on_gloo

STEPS, SAVED_AT, BATCH = 5, 3, 8
TOLERANCE = 1e-5


def instantiate_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(2 * BATCH, 6, generator=generator), torch.randn(
        2 * BATCH, 4, generator=generator
    )


def _train(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, rank: int | None
) -> None:
    for step in steps:
        x, y = _batch(step)
        if rank is not None:  # this rank's half of the batch
            x, y = x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH]
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _shampoo_from_readme(model: nn.Module, distributed_config: Any) -> torch.optim.Optimizer:
    from nanoshampoo.optim.shampoo import (
        AdamPreconditionerConfig,
        DistributedShampoo,
        WeightDecayType,
    )

    return DistributedShampoo(
        model.parameters(),
        lr=0.001,
        betas=(0.9, 0.999),
        epsilon=1e-12,
        weight_decay=1e-05,
        max_preconditioner_dim=8192,
        precondition_frequency=100,
        weight_decay_type=WeightDecayType.DECOUPLED,
        grafting_config=AdamPreconditionerConfig(
            beta2=0.999,
            epsilon=1e-12,
        ),
        distributed_config=distributed_config,
    )


def _full(params: Any) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in params]


def _ddp_example(rank: int, world_size: int) -> list[torch.Tensor]:
    from nanoshampoo.optim.shampoo import DDPDistributedConfig

    model = nn.parallel.DistributedDataParallel(instantiate_model())
    optimizer = _shampoo_from_readme(
        model,
        DDPDistributedConfig(
            communication_dtype=torch.float32,
            num_trainers_per_group=world_size,
            communicate_params=False,
        ),
    )
    _train(model, optimizer, range(STEPS), rank)
    return _full(model.parameters())


def _fsdp2_example(rank: int, world_size: int) -> list[torch.Tensor]:
    from torch.distributed.fsdp import fully_shard

    from nanoshampoo.optim.shampoo import FullyShardDistributedConfig

    model = fully_shard(instantiate_model())
    optimizer = _shampoo_from_readme(model, FullyShardDistributedConfig())
    _train(model, optimizer, range(STEPS), rank)
    return _full(model.parameters())


def _hsdp2_example(rank: int, world_size: int) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from nanoshampoo.optim.shampoo import HybridShardDistributedConfig

    # torch 2.13's fully_shard requires named dims on an HSDP mesh (the README's has none).
    device_mesh = init_device_mesh(
        "cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard")
    )
    model = fully_shard(instantiate_model(), mesh=device_mesh)
    optimizer = _shampoo_from_readme(model, HybridShardDistributedConfig(device_mesh=device_mesh))
    _train(model, optimizer, range(STEPS), rank)
    return _full(model.parameters())


def _dcp_example(rank: int, world_size: int, checkpoint_dir: str) -> list[torch.Tensor]:
    from nanoshampoo.optim.shampoo import DDPDistributedConfig

    model = nn.parallel.DistributedDataParallel(instantiate_model())
    optimizer = _shampoo_from_readme(model, DDPDistributedConfig())
    _train(model, optimizer, range(SAVED_AT), rank)
    state_dict = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp.save(state_dict=state_dict, checkpoint_id=checkpoint_dir)

    torch.manual_seed(
        1
    )  # the fresh model starts elsewhere: everything must come from the checkpoint
    fresh = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    )
    fresh_optimizer = _shampoo_from_readme(fresh, DDPDistributedConfig())
    state_dict = {"model": fresh.state_dict(), "optim": fresh_optimizer.state_dict()}
    dcp.load(state_dict=state_dict, checkpoint_id=checkpoint_dir)
    fresh.load_state_dict(state_dict["model"])
    fresh_optimizer.load_state_dict(state_dict["optim"])
    _train(fresh, fresh_optimizer, range(SAVED_AT, STEPS), rank)
    return _full(fresh.parameters())


def _all_examples(rank: int, world_size: int, checkpoint_dir: str) -> dict[str, list[torch.Tensor]]:
    assert dist.get_backend() == "gloo" and world_size == 2
    return {
        "ddp": _ddp_example(rank, world_size),
        "fsdp2": _fsdp2_example(rank, world_size),
        "hsdp2": _hsdp2_example(rank, world_size),
        "dcp": _dcp_example(rank, world_size, checkpoint_dir),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[torch.Tensor]]]:
    """One spawn runs every example (a spawn costs seconds on two shared cores)."""
    checkpoint_dir = str(tmp_path_factory.mktemp("dcp") / "step-3")
    return run_on_gloo(_all_examples, 2, checkpoint_dir)


def _adamw_single_process() -> list[torch.Tensor]:
    model = instantiate_model()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=0.001, betas=(0.9, 0.999), eps=1e-12, weight_decay=1e-05
    )
    _train(model, optimizer, range(STEPS), None)
    return _full(model.parameters())


def _max_relative_difference(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want, strict=True))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("example", ["ddp", "fsdp2", "hsdp2", "dcp"])
def test_readme_example_equals_adamw_in_one_process(
    example: str, ranks: list[dict[str, Any]]
) -> None:
    want = _adamw_single_process()
    initial = _full(instantiate_model().parameters())
    assert _max_relative_difference(want, initial) > 1e-4  # the steps moved the parameters
    for rank in ranks:
        assert _max_relative_difference(rank[example], want) <= TOLERANCE, example
