"""Benchmark: Shampoo under FSDP2 (``fully_shard``) against DDP, and the largest GPT per budget.

Part 1 (measured, gloo ranks on this machine, one intra-op thread each): GPT-small shaped
matrices (four 768x768, one 768x3072, one 3072x768; fp32; ``max_preconditioner_dim=1024``)
under ``DDPDistributedConfig`` (plain replicated parameters) and ``FullyShardDistributedConfig``
with each ``FSDPParamAssignmentStrategy`` (parameters wrapped by ``fully_shard`` on a 1-D mesh).
Per world size and mode, the worst rank's:

- ``step()`` time of preconditioned steps without a root computation (median over ``--steps``)
  and of the step computing the roots; on a machine with fewer cores than ranks they are
  oversubscribed and only the bytes are meaningful;
- bytes sent to other ranks per step (the distributor's ``bytes_sent_per_step``);
- parameter plus gradient bytes held (local shards under FSDP2);
- optimizer-state bytes (``optimizer_state_bytes()``);
- the distributor's persistent buffers (DDP: exchange buffers; FSDP2: owners' full-size work
  tensors plus the ``all_to_all`` buffers).

Part 2 (computed): for every GPT preset (``nanoshampoo.model.gpt``, vocabulary ``--vocab``) the
per-rank bytes of a training step's parameters, gradients and optimizer state, without
activations, under DDP and under FSDP2 ``ROUND_ROBIN``; the largest preset within
``--budget-gib`` per rank is named. Inputs: the Shampoo state bytes of the preset's block
matrices, measured by building the optimizer on the ``meta`` device (exact, no memory); AdamW's
8 bytes per element for the embedding, head and 1-D parameters (the trainer's split); and the
distributor buffer bytes per matrix-parameter byte measured in part 1. Per rank (W ranks, P all
parameters, M the Shampoo matrices, A the AdamW parameters, S the Shampoo state, b the buffer
ratio): DDP ``8P + 8A + S/W + b*4M``; FSDP2 ``(8P + 8A)/W + S/W + b*4M + 8B`` where ``B`` is
the largest transformer block's parameter count (its unsharded parameters and gradients exist
during its forward and backward).

Usage:
    python bench/shampoo_fsdp.py [--world-sizes 1,2,4] [--steps 3] [--budget-gib 2] [--vocab 50304]

Measured with ``--steps 1 --budget-gib 2`` (torch 2.13 CPU, 2 cores shared with other jobs, so
the times are noise; worst rank; MiB):

    world mode              sent/step  params+grads  state   buffers
    4     ddp                 24.75       54.00      45.50    41.25
    4     fsdp2-default        0.00       13.50      66.47     0.00
    4     fsdp2-round_robin   15.75       13.50      55.50    49.50
    4     fsdp2-replicate     40.50       13.50     165.00   162.00

``ROUND_ROBIN`` sends less than DDP at 4 ranks (gradient and value shards in, updates out,
against DDP's update rounds to every peer) and holds a quarter of the parameters and gradients;
its state is balanced per parameter (here one 768x3072 matrix is the worst rank's whole share),
DDP's per block. ``DEFAULT`` keeps more state than the lossless split (a 192-row shard of a
768-row matrix still has a 768x768 factor for its other dim). Part 2 at 4 ranks: gpt2-124m needs
2.76 GiB per rank under DDP and 1.57 GiB under FSDP2 ``ROUND_ROBIN``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from nanoshampoo.model.gpt import GPT, gpt_preset, gpt_preset_names
from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DDPDistributedConfig,
    DistributedConfig,
    DistributedShampoo,
    FSDPParamAssignmentStrategy,
    FullyShardDistributedConfig,
)
from nanoshampoo.optim.shampoo.distributor.ddp_distributor import DDPDistributor
from nanoshampoo.optim.shampoo.distributor.fully_shard_distributor import FullyShardDistributor
from nanoshampoo.testing.distributed import run_on_gloo

GPT_SMALL_SHAPES = [(768, 768)] * 4 + [(768, 3072), (3072, 768)]
MAX_DIM = 1024
MODES = ("ddp", "fsdp2-default", "fsdp2-round_robin", "fsdp2-replicate")


def make_optimizer(
    params: list[torch.Tensor], config: DistributedConfig, frequency: int
) -> DistributedShampoo:
    return DistributedShampoo(
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        epsilon=1e-12,
        max_preconditioner_dim=MAX_DIM,
        precondition_frequency=frequency,
        grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
        distributed_config=config,
    )


def bench_rank(rank: int, world_size: int, mode: str, steps: int) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    generator = torch.Generator().manual_seed(0)
    module = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(s, generator=generator) * 0.02) for s in GPT_SMALL_SHAPES
    )
    if mode == "ddp":
        config: DistributedConfig = DDPDistributedConfig()
    else:
        strategy = FSDPParamAssignmentStrategy[mode.removeprefix("fsdp2-").upper()]
        config = FullyShardDistributedConfig(param_assignment_strategy=strategy)
        fully_shard(module, mesh=init_device_mesh("cpu", (world_size,)))
    params = list(module.parameters())
    frequency = steps + 1  # roots only at step `steps + 1`, as in bench/shampoo_ddp.py
    optimizer = make_optimizer(params, config, frequency)
    times = []
    for _ in range(2 * steps + 1):
        for p in params:  # the same full gradient on every rank; each keeps its rows
            grad = torch.randn(p.shape, generator=generator) * 1e-3
            if isinstance(p, DTensor):
                rows = -(-p.shape[0] // world_size)
                local = grad[rank * rows : (rank + 1) * rows]
                grad = DTensor.from_local(
                    local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )
            p.grad = grad
        dist.barrier()
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    # A second distributor from the same parameters and config has the same plan (its
    # constructor does not communicate).
    if mode == "ddp":
        ddp = DDPDistributor(params, MAX_DIM, 0, config)
        sent, buffers = ddp.bytes_sent_per_step, ddp.communication_buffer_bytes
    else:
        fsdp = FullyShardDistributor(params, MAX_DIM, 0, config)
        sent, buffers = fsdp.bytes_sent_per_step, fsdp.buffer_bytes

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    held = sum(local(t).numel() * local(t).element_size() for p in params for t in (p, p.grad))
    return {
        "preconditioned_s": statistics.median(times[frequency:]),
        "root_step_s": times[frequency - 1],
        "bytes_sent": float(sent),
        "held_bytes": float(held),
        "state_bytes": float(optimizer.optimizer_state_bytes()),
        "buffer_bytes": float(buffers),
    }


def preset_costs(name: str, vocab: int) -> dict[str, float]:
    """Element counts and the measured Shampoo state bytes of a preset (built on ``meta``)."""
    with torch.device("meta"):
        model = GPT(gpt_preset(name, vocab))
    matrices = [
        p
        for n, p in model.named_parameters()
        if p.ndim >= 2 and not n.startswith(("embed", "lm_head"))
    ]
    ids = {id(p) for p in matrices}
    others = [p for p in model.parameters() if id(p) not in ids]
    state = make_optimizer(matrices, DDPDistributedConfig(), 1).optimizer_state_bytes()
    return {
        "params": float(sum(p.numel() for p in model.parameters())),
        "matrices": float(sum(p.numel() for p in matrices)),
        "adam": float(sum(p.numel() for p in others)),
        "shampoo_state": float(state),
        "largest_block": float(max(sum(p.numel() for p in b.parameters()) for b in model.blocks)),
    }


def per_rank_bytes(costs: dict[str, float], world: int, mode: str, buffer_ratio: float) -> float:
    """The part-2 formula of the module docstring."""
    replicated = 8 * costs["params"] + 8 * costs["adam"]
    buffers = buffer_ratio * 4 * costs["matrices"]
    if mode == "ddp":
        return replicated + costs["shampoo_state"] / world + buffers
    return (replicated + costs["shampoo_state"]) / world + buffers + 8 * costs["largest_block"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget-gib", type=float, default=2.0)
    parser.add_argument("--vocab", type=int, default=50304)
    args = parser.parse_args()
    worlds = [int(w) for w in args.world_sizes.split(",")]
    mib = 2**20
    param_bytes = sum(4 * a * b for a, b in GPT_SMALL_SHAPES)
    print(
        f"part 1: {param_bytes / mib:.1f} MiB of fp32 matrices; torch {torch.__version__}; "
        "1 thread per rank"
    )
    print(
        "| world | mode | step (ms) | root step (ms) | sent/rank/step (MiB) "
        "| params+grads/rank (MiB) | state/rank (MiB) | buffers/rank (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ratios: dict[tuple[int, str], float] = {}
    for world in worlds:
        for mode in MODES:
            results: list[dict[str, Any]] = run_on_gloo(bench_rank, world, mode, args.steps)
            worst = {key: max(r[key] for r in results) for key in results[0]}
            ratios[(world, mode)] = worst["buffer_bytes"] / param_bytes
            print(
                f"| {world} | {mode} | {1e3 * worst['preconditioned_s']:.0f} "
                f"| {1e3 * worst['root_step_s']:.0f} "
                f"| {worst['bytes_sent'] / mib:.2f} | {worst['held_bytes'] / mib:.2f} "
                f"| {worst['state_bytes'] / mib:.2f} | {worst['buffer_bytes'] / mib:.2f} |",
                flush=True,
            )

    budget = args.budget_gib * 2**30
    costs = {name: preset_costs(name, args.vocab) for name in gpt_preset_names()}
    names = sorted(costs, key=lambda n: costs[n]["params"])
    print(
        f"\npart 2: per-rank GiB (no activations), vocab {args.vocab}; "
        f"budget {args.budget_gib} GiB per rank"
    )
    print(
        "| world | mode | "
        + " | ".join(f"{n} ({costs[n]['params'] / 1e6:.0f}M)" for n in names)
        + " | largest within budget |"
    )
    print("|---|---|" + "---|" * (len(names) + 1))
    for world in worlds:
        for mode in ("ddp", "fsdp2-round_robin"):
            sizes = [per_rank_bytes(costs[n], world, mode, ratios[(world, mode)]) for n in names]
            fits = [n for n, size in zip(names, sizes) if size <= budget]
            print(
                f"| {world} | {mode} | "
                + " | ".join(f"{s / 2**30:.2f}" for s in sizes)
                + f" | {fits[-1] if fits else 'none'} |"
            )


if __name__ == "__main__":
    main()
