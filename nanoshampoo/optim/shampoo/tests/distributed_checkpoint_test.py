"""DistributedShampoo state through ``torch.distributed.checkpoint`` (DCP).

Under FSDP2 the standard path is torch's: ``get_optimizer_state_dict`` (parameter names for
keys) into ``dcp.save``, and ``dcp.load`` into a fresh optimizer's ``get_optimizer_state_dict``
template, then ``set_optimizer_state_dict``, which hands the names to ``load_state_dict``.

The DCP recipe: save ``{"optim": optimizer.state_dict(), "model": model.state_dict()}``; to
resume, build a fresh model and optimizer, take their state dicts as the template (DCP fills
the template's tensors in place and replaces its plain entries), then call the modules'
``load_state_dict``. Resuming must continue bit-identically to the uninterrupted run.

Under ``DDPDistributedConfig`` each rank's state dict holds only the blocks it owns, keyed by
the global block name (``state[param_index]["block_<j>"]``), so the ranks' block keys are
disjoint and one DCP checkpoint holds every block once (the group's ``step``, the same on every
rank under every parameter, once too); loading with another world size (here a single process)
picks each block from the checkpoint by its key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from flat_shampoo_state import assert_same_flat_state, flat_state, group_step

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DDPDistributedConfig,
    DistributedConfig,
    DistributedShampoo,
    FSDPParamAssignmentStrategy,
    FullyShardDistributedConfig,
    SingleDeviceDistributedConfig,
)
from nanoshampoo.testing.distributed import run_on_gloo

torch.set_num_threads(1)

# With max_preconditioner_dim 4 the (10, 6) weight splits into 6 blocks, the (10,) bias into
# 3, the (3, 10) weight into 3 and the (3,) bias is 1: 13 blocks over 4 parameters.
MAX_DIM = 4
STEPS, RESUME_AT = 8, 4
# DCP warns that it assumes a single process when no process group exists: that is the intent.
SINGLE_PROCESS = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
# An optimizer state dict's "state", flattened: param index -> {"block_j.<path>": tensor}.
OptimizerState = dict[int, dict[str, torch.Tensor]]


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def make_optimizer(model: torch.nn.Module, config: DistributedConfig) -> DistributedShampoo:
    return DistributedShampoo(
        model.parameters(),
        lr=0.02,
        betas=(0.9, 0.99),
        epsilon=1e-8,
        momentum=0.5,
        weight_decay=0.01,
        max_preconditioner_dim=MAX_DIM,
        precondition_frequency=3,
        grafting_config=AdamPreconditionerConfig(beta2=0.99, epsilon=1e-8),
        distributed_config=config,
    )


def train(model: torch.nn.Module, optimizer: DistributedShampoo, steps: range) -> None:
    """Same seeded batch per step on every rank, so the gradients are already "averaged"."""
    for step in steps:
        generator = torch.Generator().manual_seed(100 + step)
        model.zero_grad()
        model(torch.randn(8, 6, generator=generator)).pow(2).mean().backward()
        optimizer.step()


def uninterrupted(config: DistributedConfig) -> torch.nn.Module:
    model = make_model(seed=5)
    train(model, make_optimizer(model, config), range(STEPS))
    return model


def save_at_resume_step(config: DistributedConfig, checkpoint: Path) -> OptimizerState:
    """Train RESUME_AT steps and DCP-save model and optimizer; returns a copy of the saved state."""
    model = make_model(seed=5)
    optimizer = make_optimizer(model, config)
    train(model, optimizer, range(RESUME_AT))
    state_dict = {"optim": optimizer.state_dict(), "model": model.state_dict()}
    dcp.save(state_dict, checkpoint_id=checkpoint)
    return flat_state(optimizer.state_dict())


def load_into_fresh(
    config: DistributedConfig, checkpoint: Path
) -> tuple[torch.nn.Module, DistributedShampoo]:
    """A differently initialized model and a fresh optimizer, restored from ``checkpoint``."""
    model = make_model(seed=99)
    optimizer = make_optimizer(model, config)
    template: dict[str, Any] = {"optim": optimizer.state_dict(), "model": model.state_dict()}
    dcp.load(template, checkpoint_id=checkpoint)
    model.load_state_dict(template["model"])
    optimizer.load_state_dict(template["optim"])
    return model, optimizer


def resumed(config: DistributedConfig, checkpoint: Path) -> tuple[torch.nn.Module, OptimizerState]:
    saved_state = save_at_resume_step(config, checkpoint)
    model, optimizer = load_into_fresh(config, checkpoint)
    assert group_step(optimizer) == RESUME_AT
    train(model, optimizer, range(RESUME_AT, STEPS))
    return model, saved_state


@SINGLE_PROCESS
def test_dcp_resume_in_one_process_is_bit_identical(tmp_path: Path) -> None:
    config = SingleDeviceDistributedConfig()
    model, saved_state = resumed(config, tmp_path)
    for got, want in zip(model.parameters(), uninterrupted(config).parameters(), strict=True):
        assert got.dtype == torch.float32
        assert torch.equal(got, want)
    # The fresh optimizer's template has every key the trained one saved (state is allocated
    # at construction), so DCP restores all of it; a reload reproduces the saved tensors.
    _, reloaded = load_into_fresh(config, tmp_path)
    assert_same_flat_state(flat_state(reloaded.state_dict()), saved_state)
    assert max(len(s) for s in saved_state.values()) > 1  # a parameter split into several blocks


def ddp_body(rank: int, world_size: int, checkpoint: str) -> dict[str, Any]:
    config = DDPDistributedConfig()
    model, saved_state = resumed(config, Path(checkpoint))
    return {
        "resumed": [p.detach() for p in model.parameters()],
        "uninterrupted": [p.detach() for p in uninterrupted(config).parameters()],
        "saved_state": saved_state,
    }


@pytest.mark.slow
@pytest.mark.distributed
@SINGLE_PROCESS
def test_dcp_with_ddp_ranks_saves_each_block_once_and_reshards(tmp_path: Path) -> None:
    results = run_on_gloo(ddp_body, 2, str(tmp_path))
    for result in results:
        for got, want in zip(result["resumed"], result["uninterrupted"], strict=True):
            assert torch.equal(got, want)

    # Each rank saved different blocks under their global names: no key is shared.
    blocks = [
        {(i, k) for i, s in result["saved_state"].items() for k in s if k != "step"}
        for result in results
    ]
    assert blocks[0] and blocks[1] and not blocks[0] & blocks[1]
    union: OptimizerState = {}
    for result in results:
        for index, entries in result["saved_state"].items():
            union.setdefault(index, {}).update(entries)

    # One process (another world size) restores every block from the two-rank checkpoint.
    _, single = load_into_fresh(SingleDeviceDistributedConfig(), tmp_path)
    assert_same_flat_state(flat_state(single.state_dict()), union)
    assert group_step(single) == RESUME_AT


def fsdp2_dcp_body(rank: int, world_size: int, checkpoint: str) -> dict[str, Any]:
    """Per FSDP2 assignment strategy: the uninterrupted run; and a run saved at RESUME_AT through
    ``get_optimizer_state_dict`` / ``dcp.save``, restored into a fresh, differently initialized
    model and optimizer through ``dcp.load`` / ``set_optimizer_state_dict``, and continued."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def sharded(seed: int) -> torch.nn.Module:
        model = make_model(seed)
        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
        return model

    def full(model: torch.nn.Module) -> list[torch.Tensor]:
        return [p.full_tensor().detach().clone() for p in model.parameters()]

    results: dict[str, Any] = {}
    for strategy in (FSDPParamAssignmentStrategy.ROUND_ROBIN, FSDPParamAssignmentStrategy.DEFAULT):
        config = FullyShardDistributedConfig(param_assignment_strategy=strategy)
        model = sharded(seed=5)
        train(model, make_optimizer(model, config), range(STEPS))
        uninterrupted_params = full(model)

        model = sharded(seed=5)
        optimizer = make_optimizer(model, config)
        train(model, optimizer, range(RESUME_AT))
        saved = get_optimizer_state_dict(model, optimizer)
        path = f"{checkpoint}/{strategy.name}"
        dcp.save({"model": get_model_state_dict(model), "optim": saved}, checkpoint_id=path)

        fresh = sharded(seed=99)
        fresh_optimizer = make_optimizer(fresh, config)
        template = {
            "model": get_model_state_dict(fresh),
            "optim": get_optimizer_state_dict(fresh, fresh_optimizer),
        }
        dcp.load(template, checkpoint_id=path)
        set_model_state_dict(fresh, template["model"])
        set_optimizer_state_dict(fresh, fresh_optimizer, template["optim"])
        restored = flat_state(fresh_optimizer.state_dict())
        train(fresh, fresh_optimizer, range(RESUME_AT, STEPS))
        results[strategy.name] = {
            "fqn_keys": sorted(saved["state"]),
            "saved": flat_state(optimizer.state_dict()),
            "restored": restored,
            "uninterrupted": uninterrupted_params,
            "resumed": full(fresh),
        }
    return results


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_get_and_set_optimizer_state_dict_resume_bit_identically(tmp_path: Path) -> None:
    """torch's FSDP2 checkpoint path: FQN-keyed optimizer state dicts, each rank's blocks (round
    robin: whole blocks by owner; default: blocks of the local shard) restored exactly, the run
    continued bit for bit; the uninterrupted run is the single-process one (float32, 1e-5)."""
    single = make_model(seed=5)
    train(single, make_optimizer(single, SingleDeviceDistributedConfig()), range(STEPS))
    results = run_on_gloo(fsdp2_dcp_body, 2, str(tmp_path))
    names = sorted(name for name, _ in single.named_parameters())
    for strategy in ("ROUND_ROBIN", "DEFAULT"):
        for result in (r[strategy] for r in results):
            assert result["fqn_keys"] == names
            assert_same_flat_state(result["restored"], result["saved"])
            for got, want in zip(result["resumed"], result["uninterrupted"], strict=True):
                assert torch.equal(got, want)
        if strategy == "ROUND_ROBIN":  # lossless: the single-process optimizer's parameters
            for got, want in zip(
                results[0][strategy]["uninterrupted"], single.parameters(), strict=True
            ):
                torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
