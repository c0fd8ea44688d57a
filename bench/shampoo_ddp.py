"""Benchmark: DDP Shampoo per-rank ``step()`` time, bytes sent and optimizer state per rank.

Parameters: GPT-small shaped (four 768x768, one 768x3072, one 3072x768), fp32,
``max_preconditioner_dim=1024`` (10 blocks). For world sizes 1, 2 and 4 (gloo processes on
this machine, one intra-op thread each) and communication dtypes fp32 and bf16, per rank:

- step time of preconditioned steps without a root computation (median over ``--steps``),
  and of the step that computes the roots (``precondition_frequency`` = ``--steps + 1``);
  the slowest rank is reported, since every rank waits for it in the exchange;
- bytes this rank sends per step (``DDPDistributor.bytes_sent_per_step``: its chunk of every
  ``all_to_all`` round, padding included, once per peer) and the exchange buffers it holds;
- optimizer-state bytes (``DistributedShampoo.optimizer_state_bytes()``), largest rank.

World size 1 is the DDP distributor with a group of one (no exchange). On a machine with fewer
cores than ranks the step times are oversubscribed and only the bytes are meaningful.

Usage:
    python bench/shampoo_ddp.py [--world-sizes 1,2,4] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DDPDistributedConfig,
    DistributedShampoo,
)
from nanoshampoo.optim.shampoo.distributor.ddp_distributor import DDPDistributor
from nanoshampoo.testing.distributed import run_on_gloo

GPT_SMALL_SHAPES = [(768, 768)] * 4 + [(768, 3072), (3072, 768)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def bench_rank(rank: int, world_size: int, dtype_name: str, steps: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=generator) * 0.02) for s in GPT_SMALL_SHAPES
    ]
    # Roots at step `steps + 1` only: steps 1..steps use grafting, then one root step, then
    # `steps` preconditioned steps without roots.
    frequency = steps + 1
    optimizer = DistributedShampoo(
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        epsilon=1e-12,
        max_preconditioner_dim=1024,
        precondition_frequency=frequency,
        grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
        distributed_config=DDPDistributedConfig(communication_dtype=DTYPES[dtype_name]),
    )
    times = []
    for _ in range(2 * steps + 1):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator) * 1e-3
        dist.barrier()
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    # The optimizer's distributor is built from the same parameters and config, so this one has
    # the same assignment and exchange buffers (its constructor does not communicate).
    config = DDPDistributedConfig(communication_dtype=DTYPES[dtype_name])
    distributor = DDPDistributor(params, 1024, 0, config)
    return {
        "preconditioned_s": statistics.median(times[frequency:]),
        "root_step_s": times[frequency - 1],
        "bytes_sent": float(distributor.bytes_sent_per_step),
        "exchange_buffer_bytes": float(distributor.communication_buffer_bytes),
        "state_bytes": float(optimizer.optimizer_state_bytes()),
        "local_blocks": float(len(distributor.local_block_indices)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    param_bytes = sum(4 * a * b for a, b in GPT_SMALL_SHAPES)
    print(
        f"parameters: {param_bytes / 2**20:.1f} MiB fp32; torch {torch.__version__}; "
        f"{torch.get_num_threads()} threads in this process, 1 per rank"
    )
    print(
        "| world | comm | blocks/rank | step (ms) | root step (ms) | sent/rank/step (MiB) "
        "| exchange buffers/rank (MiB) | state/rank (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for world_size in (int(w) for w in args.world_sizes.split(",")):
        for dtype_name in DTYPES:
            results = run_on_gloo(bench_rank, world_size, dtype_name, args.steps)
            slowest = max(r["preconditioned_s"] for r in results)
            root = max(r["root_step_s"] for r in results)
            blocks = "/".join(str(int(r["local_blocks"])) for r in results)
            sent = max(r["bytes_sent"] for r in results) / 2**20
            buffers = max(r["exchange_buffer_bytes"] for r in results) / 2**20
            state = max(r["state_bytes"] for r in results) / 2**20
            print(
                f"| {world_size} | {dtype_name} | {blocks} | {1e3 * slowest:.0f} "
                f"| {1e3 * root:.0f} "
                f"| {sent:.2f} | {buffers:.2f} | {state:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
