"""Benchmark: our Shampoo step at precondition frequency F against this machine's floor for it.

At frequency F every F-th step recomputes every root, so the mean step over F steps cannot be
faster than the work that any implementation must do, at this machine's speed for it (the root
work divided by F, the rest every step):

* the ``eigh`` of every Kronecker factor: per factor size, a stack of all factors of that
  size (float32), the faster of one batched ``torch.linalg.eigh`` and the stack split over
  the threads (``parallel_eigh.stacked_eigh``), timed here;
* the GEMMs, at this machine's float32 GEMM rate (a ``--gemm-shape`` product timed here):
  per factor the root ``Q diag(λ^(-1/4)) Q^T`` (``2 d^3``: one product, the scaling of ``Q``'s
  columns is not a GEMM); per block ``m x n`` the factor updates ``L += G G^T`` and
  ``R += G^T G`` (``2 m^2 n + 2 m n^2``) and the preconditioning ``L^(-1/4) G R^(-1/4)``
  (the same again).

Blocks: each matrix split into ``--max-preconditioner-dim`` blocks per dimension (the last
one smaller), as ``DistributedShampoo`` splits them; a block ``m x n`` has a left factor
``m x m`` and a right one ``n x n``. Elementwise work (momentum, the Adam grafting, the
update) is not in the floor: ours / floor above 1 is that work plus everything our step does
worse than the floor's kernels.

The factor updates count as full products; a symmetric product (ours computes the upper
tiles only) does about half of that part.

Ours: ``nanoshampoo.optim.shampoo.DistributedShampoo`` with ``bench/peers.py``'s Shampoo
settings at frequency F (eigh roots, Adam grafting, ``max_preconditioner_dim``, epsilon
1e-12, the first root at step F), on fresh random gradients each step, the same shapes
(default: one GPT-small block, as in ``bench/peers.py``). Per round, ``--steps`` windows of F
steps, each holding one root computation; the round's figure is the median of the windows'
mean steps. Rounds interleave the floor's measurements and ours; each round gives one ratio;
printed: medians over rounds.

Usage:
    python bench/shampoo_floor.py [--shapes 768x768,...] [--max-preconditioner-dim 1024]
        [--frequency 1] [--rounds 5] [--steps 3] [--threads 0] [--json OUT]

Measured figures and their command: ``docs/results/peers.md`` "Shampoo at frequency 1: the
floor" and "Shampoo at frequency 10: the floor".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from nanoshampoo.io_utils import atomic_output
from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DistributedShampoo,
    EigenConfig,
    RootInvShampooPreconditionerConfig,
)
from nanoshampoo.optim.shampoo.preconditioner.parallel_eigh import parallel_width, stacked_eigh
from nanoshampoo.train.hardware import available_cores

GPT_SMALL_SHAPES = "768x768,768x768,768x768,768x768,768x3072,3072x768"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"768x768,768x3072"`` -> ``[(768, 768), (768, 3072)]``; ValueError naming ``--shapes``."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes: expected matrices like 768x3072, got {item!r}")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def split_dim(size: int, max_dim: int) -> list[int]:
    """``size`` cut into blocks of ``max_dim``, the last one smaller."""
    return [max_dim] * (size // max_dim) + ([size % max_dim] if size % max_dim else [])


def blocks(shapes: Sequence[tuple[int, int]], max_dim: int) -> list[tuple[int, int]]:
    """Every ``(m, n)`` block of the matrices."""
    return [
        (m, n)
        for rows, cols in shapes
        for m in split_dim(rows, max_dim)
        for n in split_dim(cols, max_dim)
    ]


def floor_work(
    shapes: Sequence[tuple[int, int]], max_dim: int
) -> tuple[Counter[int], float, float]:
    """``(factors per size, GEMM FLOPs of every step, GEMM FLOPs of the roots)`` (see the
    module docstring): the factor updates and the preconditioning, then ``Q diag Q^T``."""
    sizes: Counter[int] = Counter()
    step_flops = root_flops = 0.0
    for m, n in blocks(shapes, max_dim):
        sizes[m] += 1
        sizes[n] += 1
        step_flops += 2 * (2 * m * m * n + 2 * m * n * n)
        root_flops += 2 * m**3 + 2 * n**3
    return sizes, step_flops, root_flops


def _seconds(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def eigh_seconds(size: int, count: int, generator: torch.Generator) -> float:
    """Float32 ``eigh`` of ``count`` SPD ``size x size`` matrices: the faster of one batched
    call and the stack split over the threads."""
    a = torch.randn(count, size, size, generator=generator)
    spd = a @ a.mT / size + 1e-3 * torch.eye(size)
    batched = _seconds(lambda: torch.linalg.eigh(spd))
    if parallel_width(spd) < 2:
        return batched
    return min(batched, _seconds(lambda: stacked_eigh(spd)))


def gemm_flops_per_second(shape: tuple[int, int, int], generator: torch.Generator) -> float:
    """Float32 rate of one ``(m, k) @ (k, n)`` product, in FLOP/s."""
    m, k, n = shape
    a, b = torch.randn(m, k, generator=generator), torch.randn(k, n, generator=generator)
    return 2.0 * m * k * n / _seconds(lambda: a @ b)


def ours(
    shapes: Sequence[tuple[int, int]], max_dim: int, frequency: int = 1
) -> tuple[DistributedShampoo, list[torch.nn.Parameter]]:
    """Our optimizer at ``frequency``, ``bench/peers.py``'s Shampoo settings."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator) * 0.02) for s in shapes]
    optimizer = DistributedShampoo(
        params,
        lr=0.01,
        betas=(0.9, 0.999),
        epsilon=1e-12,
        weight_decay=0.0,
        max_preconditioner_dim=max_dim,
        precondition_frequency=frequency,
        start_preconditioning_step=frequency,
        use_bias_correction=True,
        grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
        preconditioner_config=RootInvShampooPreconditionerConfig(
            amortized_computation_config=EigenConfig()
        ),
    )
    return optimizer, params


def our_step_seconds(
    optimizer: DistributedShampoo,
    params: Sequence[torch.nn.Parameter],
    windows: int,
    generator: torch.Generator,
    frequency: int = 1,
) -> float:
    """Median over ``windows`` windows of ``frequency`` steps of their mean step, on fresh
    random gradients (set outside the timing)."""
    means = []
    for _ in range(windows):
        total = 0.0
        for _ in range(frequency):
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator)
            total += _seconds(optimizer.step)
        means.append(total / frequency)
    return statistics.median(means)


def measure(args: argparse.Namespace) -> dict[str, object]:
    shapes = parse_shapes(args.shapes)
    sizes, step_flops, root_flops = floor_work(shapes, args.max_preconditioner_dim)
    frequency = args.frequency
    generator = torch.Generator().manual_seed(1)
    optimizer, params = ours(shapes, args.max_preconditioner_dim, frequency)
    # Warm-up: state and the first roots (step F); later windows of F steps hold one root each.
    our_step_seconds(optimizer, params, max(2, frequency) // frequency, generator, frequency)
    for size, count in sizes.items():
        eigh_seconds(size, count, generator)
    rounds = []
    for _ in range(args.rounds):
        eigh = {size: eigh_seconds(size, count, generator) for size, count in sorted(sizes.items())}
        rate = gemm_flops_per_second(args.gemm_shape, generator)
        step = our_step_seconds(optimizer, params, args.steps, generator, frequency)
        floor = (sum(eigh.values()) + root_flops / rate) / frequency + step_flops / rate
        rounds.append(
            {
                "eigh_ms": {s: 1000 * t for s, t in eigh.items()},
                "gemm_gflop_s": rate / 1e9,
                "floor_ms": 1000 * floor,
                "ours_ms": 1000 * step,
                "ours_over_floor": step / floor,
            }
        )
    median = {
        key: statistics.median(r[key] for r in rounds)
        for key in ("gemm_gflop_s", "floor_ms", "ours_ms", "ours_over_floor")
    }
    eigh_ms = {s: statistics.median(r["eigh_ms"][s] for r in rounds) for s in sorted(sizes)}
    flops = root_flops / frequency + step_flops  # per step, the roots' share included
    return {
        "shapes": args.shapes,
        "frequency": frequency,
        "factors_per_size": dict(sorted(sizes.items())),
        "gemm_gflop": flops / 1e9,
        "eigh_ms": eigh_ms,
        "eigh_ms_per_step": sum(eigh_ms.values()) / frequency,
        "gemm_ms_at_rate": flops / (median["gemm_gflop_s"] * 1e9) * 1000,
        **median,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg()[0],
    }


def report(result: dict[str, object]) -> str:
    eigh = ", ".join(
        f"{n} of {s}: {result['eigh_ms'][s]:.1f} ms"  # type: ignore[index]
        for s, n in result["factors_per_size"].items()
    )  # type: ignore[union-attr]
    return "\n".join(
        [
            f"shapes {result['shapes']}; frequency {result['frequency']}; "
            f"{result['threads']} threads; load average "
            f"{result['load_average']:.2f}",
            f"eigh (per size, every root computation): {eigh}; per step "
            f"{result['eigh_ms_per_step']:.1f} ms",
            f"GEMMs per step: {result['gemm_gflop']:.2f} GFLOP at "
            f"{result['gemm_gflop_s']:.1f} GFLOP/s = {result['gemm_ms_at_rate']:.1f} ms",
            f"floor {result['floor_ms']:.1f} ms; ours {result['ours_ms']:.1f} ms; "
            f"ours / floor {result['ours_over_floor']:.2f}x (medians over rounds)",
        ]
    )


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=GPT_SMALL_SHAPES)
    parser.add_argument("--max-preconditioner-dim", type=int, default=1024)
    parser.add_argument("--gemm-shape", default="1024x1024x1024", help="MxKxN of the rate probe")
    parser.add_argument("--frequency", type=int, default=1, help="precondition frequency F")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--steps", type=int, default=3, help="our timed windows of F steps per round"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="intra-op threads; 0 (default): every available core, as a training run on idle "
        "cores uses",
    )
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    parse_shapes(args.shapes)
    gemm = args.gemm_shape.lower().split("x")
    if len(gemm) != 3 or not all(p.isdigit() and int(p) > 0 for p in gemm):
        raise ValueError(f"--gemm-shape: expected MxKxN, got {args.gemm_shape!r}")
    args.gemm_shape = tuple(int(p) for p in gemm)
    for name in ("max_preconditioner_dim", "frequency", "rounds", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    torch.set_num_threads(args.threads or available_cores())
    result = measure(args)
    print(report(result))
    if args.json:
        with atomic_output(Path(args.json)) as tmp:
            tmp.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
