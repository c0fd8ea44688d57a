"""Cost of the DDP Shampoo parameter exchange (``param_redistribution``) on the speedrun GPT.

Static part (no communication): the Shampoo-managed blocks of a GPT preset (matrices in the
transformer blocks, split at ``--max-preconditioner-dim``), assigned to ranks by
``distribute_buffer_sizes``; per world size it prints the number of all_to_all rounds, the
zero-padding overhead of the rounds (elements moved / elements of the blocks), and the load
imbalance (max rank load / mean rank load) for the memory and the cubic compute cost models.

Timed part (``--time``): milliseconds per ``redistribute_and_update_params`` call on a gloo group
of ``--world-size`` CPU processes, fp32 and bf16 communication.

    .venv/bin/python bench/utils_param_exchange.py --preset gpt2-124m
    .venv/bin/python bench/utils_param_exchange.py --preset tiny --time --world-size 2
"""

from __future__ import annotations

import argparse
import time

import torch

from nanoshampoo.model.gpt import GPT, gpt_preset
from nanoshampoo.optim.shampoo.utils.load_balancing_utils import (
    LoadBalancingConfig,
    PolynomialComputationalCostModel,
)
from nanoshampoo.optim.shampoo.utils.param_redistribution import (
    prepare_update_param_buffers,
    redistribute_and_update_params,
)
from nanoshampoo.optim.shampoo.utils.shampoo_utils import (
    distribute_buffer_sizes,
    merge_small_dims,
    multi_dim_split,
)
from nanoshampoo.testing.distributed import run_on_gloo


def shampoo_blocks(preset: str, max_dim: int, device: str) -> list[torch.Tensor]:
    """Blocks of the block-stack matrices (what Shampoo preconditions in the speedrun)."""
    with torch.device(device):
        model = GPT(gpt_preset(preset, vocab_size=50304))
    matrices = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim >= 2]
    blocks = []
    for param in matrices:
        view = param.detach().view(merge_small_dims(param.shape, max_dim, 1))
        blocks.extend(multi_dim_split(view, max_dim))
    return blocks


def static_report(blocks: list[torch.Tensor], world_sizes: list[int]) -> None:
    sizes = [b.numel() * 4 for b in blocks]
    cubic = LoadBalancingConfig(cost_model=PolynomialComputationalCostModel())
    total = sum(b.numel() for b in blocks)
    print(f"{len(blocks)} blocks, {total / 1e6:.2f}M elements, largest {max(sizes) // 4} elements")
    print("world  model    rounds  moved/ideal  load max/mean")
    for world in world_sizes:
        for label, config in (("memory", None), ("cubic", cubic)):
            assignment = distribute_buffer_sizes(blocks, world, config)
            by_size = sorted(range(len(blocks)), key=lambda i: (-blocks[i].numel(), i))
            owned = [[i for i in by_size if assignment[i][1] == rank] for rank in range(world)]
            rounds = max(len(o) for o in owned)
            round_sizes = [
                max(blocks[o[k]].numel() for o in owned if k < len(o)) for k in range(rounds)
            ]
            model = (config or LoadBalancingConfig()).cost_model
            loads = [sum(model.cost(blocks[i]) for i in o) for o in owned]
            print(
                f"{world:5d}  {label:7s}  {rounds:6d}  {world * sum(round_sizes) / total:11.3f}"
                f"  {max(loads) / (sum(loads) / world):13.3f}"
            )


def _timed_body(rank: int, world_size: int, preset: str, max_dim: int, steps: int) -> dict:
    blocks = shampoo_blocks(preset, max_dim, "cpu")
    assignment = distribute_buffer_sizes(blocks, world_size)
    timings = {}
    for dtype in (torch.float32, torch.bfloat16):
        buffers = prepare_update_param_buffers(blocks, assignment, communication_dtype=dtype)
        values = [blocks[i] * 0.5 for i in buffers.owned_block_indices]
        redistribute_and_update_params(buffers, values)  # warm-up
        torch.distributed.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            redistribute_and_update_params(buffers, values)
        timings[str(dtype)] = (time.perf_counter() - start) / steps * 1e3
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--max-preconditioner-dim", type=int, default=8192)
    parser.add_argument("--world-sizes", default="2,4,8")
    parser.add_argument("--time", action="store_true", help="also time the exchange on gloo")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    blocks = shampoo_blocks(args.preset, args.max_preconditioner_dim, "meta")
    static_report(blocks, [int(w) for w in args.world_sizes.split(",")])
    if args.time:
        results = run_on_gloo(
            _timed_body, args.world_size, args.preset, args.max_preconditioner_dim, args.steps
        )
        for dtype in results[0]:
            slowest = max(result[dtype] for result in results)
            print(f"gloo world {args.world_size}, {dtype}: {slowest:.1f} ms per exchange")


if __name__ == "__main__":
    main()
