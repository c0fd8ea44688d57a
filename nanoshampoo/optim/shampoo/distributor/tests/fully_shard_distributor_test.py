"""Shampoo on FSDP2 (``fully_shard``) parameters, on gloo with 2 and 4 CPU ranks.

Specification, against single-device references computed here in one process:

- ``ROUND_ROBIN`` and ``REPLICATE`` (both ``communicate_params`` settings) end equal to the
  single-device optimizer on the unsharded parameters (float32, <= 1e-5 relative);
- ``DEFAULT`` ends equal to the single-device optimizer run on the local shards as separate
  parameters (its blocks never cross a shard boundary);
- a ``torch.distributed.checkpoint`` saved at world 4 restores the exact state at world 2 and in
  one process, and both continue bit-identically to the uninterrupted world-4 run;
- per-rank parameter, gradient and optimizer-state bytes shrink about as ``1 / world``.

The parameters are chosen for the edge cases: uneven shards ``(7, 5)``, parameters with fewer
rows than ranks ``(3,)``, ``(2, 6)``, 1-D/2-D/3-D shapes, and blocks split at ``MAX_DIM``. One
spawn per world size runs every case (spawning dominates the time on 2 shared cores).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DistributedConfig,
    DistributedShampoo,
    FSDPParamAssignmentStrategy,
    FullyShardDistributedConfig,
    SingleDeviceDistributedConfig,
)
from nanoshampoo.optim.shampoo.config_checks import error_field
from nanoshampoo.optim.shampoo.distributor.fully_shard_plan import shard_row_ranges
from nanoshampoo.optim.shampoo.state_dict_trees import flatten_tree
from nanoshampoo.testing.distributed import run_on_gloo
from nanoshampoo.testing.toy_models import ParamsModel

SHAPES = ((7, 5), (3,), (6, 2, 3), (9, 4), (2, 6), (5,), (12, 8))
MAX_DIM = 4
STEPS, RESUME_AT = 5, 3
TOLERANCE = 1e-5
LOSSLESS = [
    (strategy, communicate)
    for strategy in (FSDPParamAssignmentStrategy.ROUND_ROBIN, FSDPParamAssignmentStrategy.REPLICATE)
    for communicate in (False, True)
]
SINGLE_PROCESS = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def params_model(seed: int = 0) -> ParamsModel:
    """Parameters of ``SHAPES`` and a smooth, non-quadratic loss of them, new each step."""
    return ParamsModel(SHAPES, seed)


def make_optimizer(params: list[torch.Tensor], config: DistributedConfig) -> DistributedShampoo:
    return DistributedShampoo(
        params,
        lr=0.05,
        betas=(0.9, 0.99),
        epsilon=1e-6,
        momentum=0.5,
        weight_decay=0.01,
        max_preconditioner_dim=MAX_DIM,
        precondition_frequency=2,
        grafting_config=AdamPreconditionerConfig(beta2=0.99, epsilon=1e-8),
        distributed_config=config,
    )


def train(model: torch.nn.Module, optimizer: DistributedShampoo, steps: range) -> None:
    """The same loss on every rank, so FSDP's averaged gradient is the single-device one."""
    for step in steps:
        model.zero_grad()
        model(torch.tensor(step)).backward()
        optimizer.step()


# ----- references (one process, plain tensors) -------------------------------------------------


def reference_lossless(steps: int) -> list[torch.Tensor]:
    model = params_model()
    train(
        model,
        make_optimizer(list(model.parameters()), SingleDeviceDistributedConfig()),
        range(steps),
    )
    return [p.detach().clone() for p in model.parameters()]


def reference_default(world: int, steps: int) -> list[torch.Tensor]:
    """Single-device Shampoo on each rank's local shard as a separate parameter."""
    model = params_model()
    shards = [
        torch.nn.Parameter(p.detach()[start:end].clone())
        for p in model.parameters()
        for start, end in shard_row_ranges(p.shape[0], world)
        if end > start
    ]
    optimizer = make_optimizer(shards, SingleDeviceDistributedConfig())
    for step in range(steps):
        model.zero_grad()
        _assemble(model, shards, world)
        model(torch.tensor(step)).backward()
        k = 0
        for p in model.parameters():
            for start, end in shard_row_ranges(p.shape[0], world):
                if end > start:
                    shards[k].grad = p.grad[start:end].clone()
                    k += 1
        optimizer.step()
    _assemble(model, shards, world)
    return [p.detach().clone() for p in model.parameters()]


def _assemble(model: torch.nn.Module, shards: list[torch.Tensor], world: int) -> None:
    k = 0
    with torch.no_grad():
        for p in model.parameters():
            for start, end in shard_row_ranges(p.shape[0], world):
                if end > start:
                    p[start:end].copy_(shards[k])
                    k += 1


# ----- the spawned side ------------------------------------------------------------------------


def fsdp_model(seed: int = 0) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = params_model(seed)
    fully_shard(model, mesh=init_device_mesh("cpu", (torch.distributed.get_world_size(),)))
    return model


def full_params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def local_bytes(tensors: list[torch.Tensor | None]) -> int:
    return sum(t.to_local().numel() * t.to_local().element_size() for t in tensors if t is not None)


def run_strategy(strategy: FSDPParamAssignmentStrategy, communicate: bool) -> dict[str, Any]:
    model = fsdp_model()
    config = FullyShardDistributedConfig(
        param_assignment_strategy=strategy, communicate_params=communicate
    )
    optimizer = make_optimizer(list(model.parameters()), config)
    train(model, optimizer, range(STEPS))
    grads = [p.grad for p in model.parameters()]
    return {
        "params": full_params(model),
        "param_bytes": local_bytes(list(model.parameters())),
        "grad_bytes": local_bytes(grads),
        "state_bytes": optimizer.optimizer_state_bytes(),
    }


def save_checkpoint(checkpoint: str) -> dict[str, Any]:
    """ROUND_ROBIN at this world: train, DCP-save, train on; returns the saved state and the end."""
    model = fsdp_model()
    config = FullyShardDistributedConfig(
        param_assignment_strategy=FSDPParamAssignmentStrategy.ROUND_ROBIN
    )
    optimizer = make_optimizer(list(model.parameters()), config)
    train(model, optimizer, range(RESUME_AT))
    dcp.save(
        {"optim": optimizer.state_dict(), "model": model.state_dict()}, checkpoint_id=checkpoint
    )
    saved = {
        i: {k: v.clone() for k, v in flatten_tree(s).items()}
        for i, s in optimizer.state_dict()["state"].items()
    }
    train(model, optimizer, range(RESUME_AT, STEPS))
    return {"saved_state": saved, "params": full_params(model)}


def load_checkpoint(checkpoint: str) -> dict[str, Any]:
    """A fresh, differently initialized ROUND_ROBIN model and optimizer restored from DCP."""
    model = fsdp_model(seed=99)
    config = FullyShardDistributedConfig(
        param_assignment_strategy=FSDPParamAssignmentStrategy.ROUND_ROBIN
    )
    optimizer = make_optimizer(list(model.parameters()), config)
    template: dict[str, Any] = {"optim": optimizer.state_dict(), "model": model.state_dict()}
    dcp.load(template, checkpoint_id=checkpoint)
    model.load_state_dict(template["model"])
    optimizer.load_state_dict(template["optim"])
    state = {
        i: {k: v.clone() for k, v in flatten_tree(s).items()}
        for i, s in optimizer.state_dict()["state"].items()
    }
    restored = full_params(model)
    train(model, optimizer, range(RESUME_AT, STEPS))
    return {"loaded_state": state, "restored": restored, "params": full_params(model)}


def body(rank: int, world: int, checkpoint: str, mode: str) -> dict[str, Any]:
    torch.manual_seed(0)
    results: dict[str, Any] = {
        f"{strategy.name}-{communicate}": run_strategy(strategy, communicate)
        for strategy, communicate in LOSSLESS
    }
    results["DEFAULT"] = run_strategy(FSDPParamAssignmentStrategy.DEFAULT, False)
    results["dcp"] = save_checkpoint(checkpoint) if mode == "save" else load_checkpoint(checkpoint)
    return results


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fsdp_dcp")


@pytest.fixture(scope="module")
def world4(checkpoint: Path) -> list[dict[str, Any]]:
    return run_on_gloo(body, 4, str(checkpoint), "save")


@pytest.fixture(scope="module")
def world2(world4: list[dict[str, Any]], checkpoint: Path) -> list[dict[str, Any]]:
    return run_on_gloo(body, 2, str(checkpoint), "load")


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert (g - w).norm() <= TOLERANCE * w.norm(), (g - w).abs().max()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    "strategy, communicate", LOSSLESS, ids=lambda v: getattr(v, "name", str(v))
)
def test_lossless_strategies_equal_single_device(
    world: int,
    strategy: FSDPParamAssignmentStrategy,
    communicate: bool,
    request: pytest.FixtureRequest,
) -> None:
    results = request.getfixturevalue(f"world{world}")
    want = reference_lossless(STEPS)
    for result in results:
        assert_close(result[f"{strategy.name}-{communicate}"]["params"], want)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_default_equals_single_device_on_local_shards(
    world: int, request: pytest.FixtureRequest
) -> None:
    results = request.getfixturevalue(f"world{world}")
    want = reference_default(world, STEPS)
    for result in results:
        assert_close(result["DEFAULT"]["params"], want)
    # ...and it is a different optimizer from single-device Shampoo on the whole parameters.
    lossless = reference_lossless(STEPS)
    assert any((g - w).norm() > 100 * TOLERANCE * w.norm() for g, w in zip(want, lossless))


@pytest.mark.slow
@pytest.mark.distributed
def test_dcp_saved_at_world_4_restores_exactly_at_world_2(
    world4: list[dict[str, Any]], world2: list[dict[str, Any]]
) -> None:
    saved: dict[int, dict[str, torch.Tensor]] = {}
    for result in world4:
        for index, entries in result["dcp"]["saved_state"].items():
            # Each block saved once; the group's step is under every parameter on every rank.
            assert not (saved.get(index, {}).keys() & entries.keys()) - {"step"}
            saved.setdefault(index, {}).update(entries)
    loaded: dict[int, dict[str, torch.Tensor]] = {}
    for result in world2:
        for index, entries in result["dcp"]["loaded_state"].items():
            loaded.setdefault(index, {}).update(entries)
    assert loaded.keys() == saved.keys()
    for index in saved:
        assert loaded[index].keys() == saved[index].keys()
        for key, value in saved[index].items():
            assert torch.equal(loaded[index][key], value), (index, key)
    for result in world2:  # bit-exact continuation of the world-4 run
        for got, want in zip(result["dcp"]["params"], world4[0]["dcp"]["params"], strict=True):
            assert torch.equal(got, want)


@pytest.mark.slow
@pytest.mark.distributed
@SINGLE_PROCESS
def test_dcp_saved_at_world_4_restores_exactly_in_one_process(
    world4: list[dict[str, Any]], checkpoint: Path
) -> None:
    model = params_model(seed=99)
    optimizer = make_optimizer(list(model.parameters()), SingleDeviceDistributedConfig())
    template: dict[str, Any] = {"optim": optimizer.state_dict(), "model": model.state_dict()}
    dcp.load(template, checkpoint_id=checkpoint)
    model.load_state_dict(template["model"])
    optimizer.load_state_dict(template["optim"])
    loaded = {i: flatten_tree(s) for i, s in optimizer.state_dict()["state"].items()}
    for result in world4:
        for index, entries in result["dcp"]["saved_state"].items():
            for key, value in entries.items():
                assert torch.equal(loaded[index][key], value), (index, key)
    train(model, optimizer, range(RESUME_AT, STEPS))
    for got, want in zip(model.parameters(), world4[0]["dcp"]["params"], strict=True):
        assert torch.equal(got.detach(), want)


@pytest.mark.slow
@pytest.mark.distributed
def test_per_rank_memory_shrinks_with_world_size(
    world4: list[dict[str, Any]], world2: list[dict[str, Any]]
) -> None:
    model = params_model()
    total_params = sum(p.numel() * p.element_size() for p in model.parameters())
    single = make_optimizer(
        list(model.parameters()), SingleDeviceDistributedConfig()
    ).optimizer_state_bytes()
    largest_state = max(
        make_optimizer([p], SingleDeviceDistributedConfig()).optimizer_state_bytes()
        for p in model.parameters()
    )
    report = {}
    for world, results in ((2, world2), (4, world4)):
        for key in ("param_bytes", "grad_bytes", "state_bytes"):
            per_rank = [r["ROUND_ROBIN-False"][key] for r in results]
            report[(world, key)] = per_rank
        params, grads, states = (
            report[(world, k)] for k in ("param_bytes", "grad_bytes", "state_bytes")
        )
        # Shards and owned state partition the single-device totals exactly...
        assert sum(params) == sum(grads) == total_params
        assert sum(states) == single
        # ...and no rank holds much more than its 1 / world share (a shard is at most a row
        # longer than the even split; the owner balance is within one parameter's state).
        rows = sum(
            -(-p.shape[0] // world) * p[0].numel() * p.element_size() for p in model.parameters()
        )
        assert max(params) <= rows < total_params
        assert max(states) <= single / world + largest_state
    print("\nper-rank bytes (world, kind): ranks", report)
    assert max(report[(4, "state_bytes")]) < max(report[(2, "state_bytes")]) < single


# ----- one process: layout and validation ------------------------------------------------------


@pytest.mark.parametrize("dim0, world", [(7, 4), (3, 4), (2, 4), (12, 2), (1, 2), (9, 4)])
def test_shard_row_ranges_follow_torch_chunk_padded_with_empty_shards(
    dim0: int, world: int
) -> None:
    chunks = torch.arange(dim0).chunk(world)
    want = [(int(c[0]), int(c[-1]) + 1) for c in chunks]
    want += [(dim0, dim0)] * (world - len(want))
    assert list(shard_row_ranges(dim0, world)) == want


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"param_assignment_strategy": "ROUND_ROBIN"}, "param_assignment_strategy"),
        ({"communication_dtype": torch.int32}, "communication_dtype"),
        ({"communicate_params": 1}, "communicate_params"),
    ],
)
def test_invalid_config_raises_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as info:
        FullyShardDistributedConfig(**kwargs)
    assert re.match(field, error_field(info.value)), str(info.value)


def test_plain_tensor_params_are_rejected_before_any_state_is_built() -> None:
    model = params_model()
    config = FullyShardDistributedConfig(
        param_assignment_strategy=FSDPParamAssignmentStrategy.ROUND_ROBIN
    )
    with pytest.raises(ValueError, match=r"^params\[0\] must be a DTensor"):
        make_optimizer(list(model.parameters()), config)
