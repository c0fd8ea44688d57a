"""Benchmark: our Shampoo step at precondition frequency F against this machine's floor for it.

At frequency F every F-th step recomputes every root, so the mean step over F steps cannot be
faster than the work that any implementation must do, at this machine's best speed for it (the
root work divided by F, the rest every step):

* the ``eigh`` of every Kronecker factor: per factor size, a stack of all factors of that
  size (float32), the faster of one batched ``torch.linalg.eigh`` and the stack split over
  the threads (``parallel_eigh.stacked_eigh``), the matrices column-major as LAPACK wants them;
* the GEMMs, each timed at the shape the step computes it, blocks (factors) of one shape
  stacked into one ``bmm``: per factor the root ``Q diag(λ^(-1/4)) Q^T`` (the faster of one
  ``d x d x d`` product and our triangle of tiles, ``symmetric_product``; the scaling of
  ``Q``'s columns is not a GEMM); per block ``m x n`` the factor updates ``L += G G^T`` and
  ``R += G^T G`` (each the faster of the full product and our triangle of tiles,
  ``symmetric_rank_update_`` without the mirror copies) and the preconditioning
  ``L^(-1/4) G`` and ``(...) R^(-1/4)``;
* the elementwise work, as few passes over memory as any step can make: it must read the
  gradient, the momentum ``M``, the grafting's second moment ``V``, the preconditioned
  direction and the parameters, and write ``M``, ``V`` and the parameters, eight float32
  arrays of the parameters' size. Timed as two ``torch.addcmul`` calls (three arrays read,
  one written) over that many elements, as if the grafting's norms, the bias corrections and
  the learning rate were folded into those passes and nothing else touched memory.

Each part is timed ``--repeats`` times per round with the threads the step uses, and the floor
sums each part's best over all rounds: a lower bound, not a typical time, so on a loaded
machine it stays below every measured step instead of the other way round. Against it, ours'
fastest window is the like statistic. A typical floor is also kept: each part's median call,
the median over the rounds; ours' median window over it compares typical with typical, which
the machine's own spread between calls does not tilt. (A GEMM rate
probed on one 1024^3 product, as this bench once did, was slower per FLOP than the step's own
stacked products, which put the "floor" above our step.)

Blocks: each matrix split into ``--max-preconditioner-dim`` blocks per dimension (the last
one smaller), as ``DistributedShampoo`` splits them; a block ``m x n`` has a left factor
``m x m`` and a right one ``n x n``. Elementwise work (momentum, the Adam grafting, the
update) is in the floor only as its least memory traffic at streaming speed (above): ours /
floor above 1 is every pass our step makes beyond it plus everything it does worse than the
floor's kernels.

Ours: ``nanoshampoo.optim.shampoo.DistributedShampoo`` with ``bench/peers.py``'s Shampoo
settings at frequency F (eigh roots, Adam grafting, ``max_preconditioner_dim``, epsilon
1e-12, the first root at step F), on fresh random gradients each step, the same shapes
(default: one GPT-small block, as in ``bench/peers.py``). Per round, ``--steps`` windows of F
steps, each holding one root computation, timed after the floor's parts (interleaved);
printed: the median and the fastest window's mean step over all rounds, each over the floor.

Threads: every available core by default (what a training run on idle cores uses); the first
printed line and the JSON name the count.

Allocator: run as a script, the bench re-executes itself with the glibc malloc settings a
training run uses (``nanoshampoo.train.allocator``: freed memory kept for reuse, not unmapped),
so our step's temporaries are not page-faulted in anew every step, as they are not in a run; the
floor's parts run in the same process, under the same settings. The printed report and the JSON
name the settings in force.

Usage:
    python bench/shampoo_floor.py [--shapes 768x768,...] [--max-preconditioner-dim 1024]
        [--frequency 1] [--rounds 5] [--steps 3] [--repeats 3] [--threads 0] [--json OUT]

Measured figures and their command: ``docs/results/peers.md`` "Shampoo's floor".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_facts import git_commit

from nanoshampoo.io_utils import atomic_output
from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DistributedShampoo,
    EigenConfig,
    RootInvShampooPreconditionerConfig,
)
from nanoshampoo.optim.shampoo.preconditioner.factor_matrix_ops import (
    symmetric_product,
    symmetric_rank_update_,
)
from nanoshampoo.optim.shampoo.preconditioner.parallel_eigh import parallel_width, stacked_eigh
from nanoshampoo.train.allocator import TUNED_MALLOC_ENV, exec_script_with_tuned_malloc
from nanoshampoo.train.machine import available_cores, cpu_name

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


@dataclass(frozen=True)
class Timing:
    """Seconds of one part of the floor in one round: the fastest and the median call."""

    best: float
    median: float

    @staticmethod
    def faster(*timings: Timing) -> Timing:
        """The part done the faster way: each statistic's minimum over the ways."""
        return Timing(min(t.best for t in timings), min(t.median for t in timings))

    def __add__(self, other: Timing) -> Timing:
        return Timing(self.best + other.best, self.median + other.median)


ZERO = Timing(0.0, 0.0)


def _timed(work: Callable[[], object], repeats: int) -> Timing:
    """The fastest and the median of ``repeats`` timed calls of ``work``, after one untimed
    call."""
    work()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - start)
    return Timing(min(seconds), statistics.median(seconds))


def _spd(count: int, size: int, generator: torch.Generator) -> torch.Tensor:
    a = torch.randn(count, size, size, generator=generator)
    return a @ a.mT / size + 1e-3 * torch.eye(size)


def eigh_seconds(size: int, count: int, generator: torch.Generator, repeats: int) -> Timing:
    """Float32 ``eigh`` of ``count`` SPD ``size x size`` matrices over ``repeats`` calls, the
    faster of one batched call and the stack split over the threads.

    The matrices lie column-major, LAPACK's layout, so ``eigh``'s copy of its input is a plain
    copy: what our step gives it (an exactly symmetric factor's transposed view), and faster
    than the strided transpose a row-major input needs (at 1024 on a CPU)."""
    spd = _spd(count, size, generator)
    spd = ((spd + spd.mT) / 2).mT  # exactly symmetric, so the view is the same matrices
    timing = _timed(lambda: torch.linalg.eigh(spd), repeats)
    if parallel_width(spd) >= 2:
        timing = Timing.faster(timing, _timed(lambda: stacked_eigh(spd), repeats))
    return timing


def gemm_seconds(
    shapes: Sequence[tuple[int, int]], max_dim: int, generator: torch.Generator, repeats: int
) -> tuple[Timing, Timing]:
    """``(every step's GEMMs, the roots' GEMMs)``, each product timed at the shapes the step
    uses, with the threads it uses, over ``repeats`` calls.

    Blocks of one shape are stacked (one ``bmm`` per product, as our step batches them), factors
    of one size too. A factor update ``F += G G^T`` is the faster of the full product and our
    triangle of tiles (:func:`symmetric_rank_update_` without its mirror copies, as a packed
    factor is updated), so the floor stays below a step that computes half of it.
    """
    step = root = ZERO
    for (m, n), count in sorted(Counter(blocks(shapes, max_dim)).items()):
        g = torch.randn(count, m, n, generator=generator)
        left, right = _spd(count, m, generator), _spd(count, n, generator)
        for unfolded, factor in ((g, left), (g.mT, right)):
            full = _timed(lambda u=unfolded: torch.bmm(u, u.mT), repeats)
            # Without the mirror copies: a packed factor keeps the triangle's tiles only.
            triangle = _timed(
                lambda u=unfolded, f=factor: symmetric_rank_update_(
                    f, u, 0.999, 0.001, mirror=False
                ),
                repeats,
            )
            step += Timing.faster(full, triangle)
        step += _timed(lambda: torch.bmm(left, g), repeats)
        step += _timed(lambda: torch.bmm(g, right), repeats)
    sizes, _, _ = floor_work(shapes, max_dim)
    for size, count in sorted(sizes.items()):
        # Q row-major, and column-major as eigh returns it (our step multiplies that), each
        # as one product and as our triangle of tiles: the fastest.
        q = _spd(count, size, generator)
        root += Timing.faster(
            *(
                _timed(lambda q=layout, product=product: product(q, q), repeats)
                for layout in (q, q.mT)
                for product in (_full_product, symmetric_product)
            )
        )
    return step, root


def _full_product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    return torch.bmm(left, right.mT)


# Arrays of the parameters' size that a step must at least read or write (module docstring).
ELEMENTWISE_ARRAYS = 8


def elementwise_seconds(numel: int, generator: torch.Generator, repeats: int) -> Timing:
    """The elementwise part of the floor: ``ELEMENTWISE_ARRAYS`` float32 arrays of ``numel``
    elements moved once, timed as ``torch.addcmul`` calls of four arrays each (three read, one
    written) over ``repeats`` calls."""
    a, b, c = (torch.randn(numel, generator=generator) for _ in range(3))
    out = torch.empty(numel)
    one = _timed(lambda: torch.addcmul(a, b, c, out=out), repeats)
    total = ZERO
    for _ in range(ELEMENTWISE_ARRAYS // 4):
        total += one
    return total


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
            start = time.perf_counter()
            optimizer.step()
            total += time.perf_counter() - start
        means.append(total / frequency)
    return statistics.median(means)


def measure(args: argparse.Namespace) -> dict[str, object]:
    """Rounds that interleave the floor's parts and our windows; the floor is the sum of each
    part's best over all rounds (a lower bound at this machine's best speed for it), ours the
    mean step of each window of F steps."""
    commit = git_commit()  # of the code this run imported, not of a later checkout
    shapes = parse_shapes(args.shapes)
    max_dim = args.max_preconditioner_dim
    sizes, step_flops, root_flops = floor_work(shapes, max_dim)
    numel = sum(m * n for m, n in shapes)
    frequency = args.frequency
    generator = torch.Generator().manual_seed(1)
    optimizer, params = ours(shapes, max_dim, frequency)
    # Warm-up: state and the first roots (step F); later windows of F steps hold one root each.
    our_step_seconds(optimizer, params, max(2, frequency) // frequency, generator, frequency)
    rounds = []
    for _ in range(args.rounds):
        eigh = {s: eigh_seconds(s, n, generator, args.repeats) for s, n in sorted(sizes.items())}
        step_gemm, root_gemm = gemm_seconds(shapes, max_dim, generator, args.repeats)
        elementwise = elementwise_seconds(numel, generator, args.repeats)
        windows = [
            our_step_seconds(optimizer, params, 1, generator, frequency) for _ in range(args.steps)
        ]
        rounds.append(
            {
                "eigh_ms": {s: 1000 * t.best for s, t in eigh.items()},
                "step_gemm_ms": 1000 * step_gemm.best,
                "root_gemm_ms": 1000 * root_gemm.best,
                "elementwise_ms": 1000 * elementwise.best,
                # The same parts' median calls: the floor's typical time, against ours' median.
                "eigh_median_ms": {s: 1000 * t.median for s, t in eigh.items()},
                "step_gemm_median_ms": 1000 * step_gemm.median,
                "root_gemm_median_ms": 1000 * root_gemm.median,
                "elementwise_median_ms": 1000 * elementwise.median,
                "ours_ms": [1000 * w for w in windows],
            }
        )

    def over_rounds(
        pick: Callable[[Iterable[float]], float], stat: str
    ) -> tuple[dict[int, float], float, float, float]:
        """Each part's ``pick`` over the rounds of its calls' ``stat`` ("": the fastest,
        "_median": the median): ``(eigh per size, step GEMMs, root GEMMs, elementwise)``."""
        return (
            {s: pick(r[f"eigh{stat}_ms"][s] for r in rounds) for s in sorted(sizes)},
            pick(r[f"step_gemm{stat}_ms"] for r in rounds),
            pick(r[f"root_gemm{stat}_ms"] for r in rounds),
            pick(r[f"elementwise{stat}_ms"] for r in rounds),
        )

    eigh_ms, step_gemm_ms, root_gemm_ms, elementwise_ms = over_rounds(min, "")
    eigh_per_step = sum(eigh_ms.values()) / frequency
    gemm_ms = step_gemm_ms + root_gemm_ms / frequency
    floor_ms = eigh_per_step + gemm_ms + elementwise_ms
    # The typical floor: each part's median call, the median over the rounds.
    eigh_typical, step_typical, root_typical, elementwise_typical = over_rounds(
        statistics.median, "_median"
    )
    floor_median_ms = (
        sum(eigh_typical.values()) / frequency
        + step_typical
        + root_typical / frequency
        + elementwise_typical
    )
    ours_ms = [w for r in rounds for w in r["ours_ms"]]
    flops = root_flops / frequency + step_flops  # per step, the roots' share included
    return {
        "shapes": args.shapes,
        "max_preconditioner_dim": max_dim,
        "frequency": frequency,
        "threads": torch.get_num_threads(),
        "rounds_run": args.rounds,
        "windows_per_round": args.steps,
        "repeats": args.repeats,
        "factors_per_size": dict(sorted(sizes.items())),
        "gemm_gflop": flops / 1e9,
        "eigh_ms": eigh_ms,
        "eigh_ms_per_step": eigh_per_step,
        "gemm_ms": gemm_ms,
        "gemm_gflop_s": flops / gemm_ms / 1e6,
        "elementwise_arrays": ELEMENTWISE_ARRAYS,
        "numel": numel,
        "elementwise_ms": elementwise_ms,
        "elementwise_gb_s": ELEMENTWISE_ARRAYS * numel * 4 / elementwise_ms / 1e6,
        "floor_ms": floor_ms,
        "ours_min_ms": min(ours_ms),
        "ours_median_ms": statistics.median(ours_ms),
        "ours_over_floor": statistics.median(ours_ms) / floor_ms,
        "ours_min_over_floor": min(ours_ms) / floor_ms,
        "floor_median_ms": floor_median_ms,
        "ours_median_over_floor_median": statistics.median(ours_ms) / floor_median_ms,
        "floor_below_every_window": floor_ms < min(ours_ms),
        "rounds": rounds,
        "machine": cpu_name(),
        "malloc": {name: os.environ.get(name, "default") for name in TUNED_MALLOC_ENV},
        "torch": torch.__version__,
        "commit": commit,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "load_average": os.getloadavg()[0],
    }


def report(result: dict[str, object]) -> str:
    eigh = ", ".join(
        f"{n} of {s}: {result['eigh_ms'][s]:.1f} ms"  # type: ignore[index]
        for s, n in result["factors_per_size"].items()  # type: ignore[union-attr]
    )
    return "\n".join(
        [
            f"{result['machine']}; {result['threads']} threads; load average "
            f"{result['load_average']:.2f}; commit {result['commit']}; malloc "
            + " ".join(f"{k}={v}" for k, v in result["malloc"].items()),  # type: ignore[union-attr]
            f"shapes {result['shapes']}; blocks of at most {result['max_preconditioner_dim']}; "
            f"frequency {result['frequency']}",
            f"eigh (per size, every root computation, best of the rounds): {eigh}; per step "
            f"{result['eigh_ms_per_step']:.1f} ms",
            f"GEMMs per step (each at its own shape, best of the rounds): "
            f"{result['gemm_gflop']:.2f} GFLOP in {result['gemm_ms']:.1f} ms "
            f"({result['gemm_gflop_s']:.1f} GFLOP/s)",
            f"elementwise: {result['elementwise_arrays']} arrays of {result['numel']} float32 "
            f"in {result['elementwise_ms']:.1f} ms ({result['elementwise_gb_s']:.1f} GB/s)",
            f"floor {result['floor_ms']:.1f} ms; ours (windows of {result['frequency']} steps, "
            f"mean step) min {result['ours_min_ms']:.1f} ms, median "
            f"{result['ours_median_ms']:.1f} ms; ours / floor: median "
            f"{result['ours_over_floor']:.2f}x, min {result['ours_min_over_floor']:.2f}x; floor "
            f"below every window: {'yes' if result['floor_below_every_window'] else 'NO'}",
            f"typical: the floor's parts at their median calls {result['floor_median_ms']:.1f} "
            f"ms; ours' median / that: {result['ours_median_over_floor_median']:.2f}x",
        ]
    )


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=GPT_SMALL_SHAPES)
    parser.add_argument("--max-preconditioner-dim", type=int, default=1024)
    parser.add_argument("--frequency", type=int, default=1, help="precondition frequency F")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--steps", type=int, default=3, help="our timed windows of F steps per round"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed calls per part of the floor per round"
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
    for name in ("max_preconditioner_dim", "frequency", "rounds", "steps", "repeats"):
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
    exec_script_with_tuned_malloc(__file__, sys.argv[1:])
    try:
        main()
    except ValueError as error:
        sys.exit(f"shampoo_floor.py: {error}")
