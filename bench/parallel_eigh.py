"""Benchmark: a stack's ``eigh`` and QR split over the CPU threads against one batched call.

Times, for each stack ``NxS`` (N float32 ``S x S`` random PSD matrices of rank ``S/2``, like
early Shampoo factors):

* ``batched``: ``torch.linalg.eigh(stack)`` with ``--threads`` intra-op threads (what Shampoo
  called before ``stacked_eigh``);
* ``split``: ``stacked_eigh(stack)`` split over ``min(threads, N)`` chunks, one single-threaded
  ``eigh`` per worker thread and chunk (also below ``MIN_PARALLEL_SIZE``, where Shampoo does not
  split, so that the crossover shows);
* ``1 thread``: ``torch.linalg.eigh(stack)`` on one thread, for scale.

and, in a table printed first, the same columns for the QR: batched ``torch.linalg.qr(stack)``
against ``stacked_qr(stack)`` (``geqrf`` + ``householder_product``, split), as the SOAP refresh
calls it on ``A Q``.

Each figure is the median of ``--repeats`` timed calls after one untimed call; ``split / batched``
is the ratio of those medians, measured side by side in one process. The default stacks are
GPT-small's factors at ``max_preconditioner_dim=1024`` (fourteen 768s, six 1024s); ``--sizes``
takes others (e.g. the crossover around ``MIN_PARALLEL_SIZE``: ``8x64,8x128,8x256``).

Usage:
    python bench/parallel_eigh.py [--threads 2] [--repeats 5] [--sizes 14x768,6x1024]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from nanoshampoo.optim.shampoo.preconditioner.parallel_eigh import (
    MIN_PARALLEL_SIZE,
    stacked_eigh,
    stacked_qr,
)


def parse_stacks(text: str) -> list[tuple[int, int]]:
    """``"14x768,6x1024"`` -> ``[(14, 768), (6, 1024)]``; raises ValueError naming --sizes."""
    stacks = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--sizes: expected COUNTxSIZE items like 14x768, got {item!r}")
        stacks.append((int(parts[0]), int(parts[1])))
    return stacks


def psd_stack(count: int, size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(size)
    g = torch.randn(count, size, max(1, size // 2), generator=gen)
    return g @ g.mT / g.shape[-1]


def median_ms(call: Callable[[], object], repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default="14x768,6x1024")
    args = parser.parse_args(argv)
    try:
        stacks = parse_stacks(args.sizes)
        if args.threads < 1 or args.repeats < 1:
            raise ValueError("--threads and --repeats must be >= 1")
    except ValueError as error:
        parser.error(str(error))  # one line and exit status 2
    before = torch.get_num_threads()
    try:
        report(stacks, args.threads, args.repeats)
    finally:
        torch.set_num_threads(before)
    return 0


def report(stacks: list[tuple[int, int]], threads: int, repeats: int) -> None:
    """Print the table (see the module doc)."""
    print(f"torch {torch.__version__} | threads {threads} | repeats {repeats} (median)")
    print(f"MIN_PARALLEL_SIZE {MIN_PARALLEL_SIZE}: Shampoo splits stacks of at least that size")
    # The QR table first, so that the eigh table (and its total) stays the output's tail.
    ops: dict[str, tuple[Callable[[torch.Tensor], object], Callable[..., object]]] = {
        "qr": (torch.linalg.qr, stacked_qr),
        "eigh": (torch.linalg.eigh, stacked_eigh),
    }
    stack_list = [(count, size, psd_stack(count, size)) for count, size in stacks]
    for op, (plain, split_call) in ops.items():
        print(f"{op}: batched torch.linalg.{op} against stacked_{op}")
        print(
            f"{'stack':>10} {'width':>5} {'batched ms':>11} {'split ms':>9} "
            f"{'1 thread ms':>12} {'split/batched':>14}"
        )
        totals = [0.0, 0.0]
        for count, size, stack in stack_list:
            width = min(threads, count)  # split even below MIN_PARALLEL_SIZE, to find it
            torch.set_num_threads(1)
            single = median_ms(lambda: plain(stack), repeats)
            torch.set_num_threads(threads)
            batched = median_ms(lambda: plain(stack), repeats)
            split = median_ms(lambda: split_call(stack, width), repeats)
            totals[0] += batched
            totals[1] += split
            print(
                f"{count:>4}x{size:<5} {width:>5} {batched:>11.1f} {split:>9.1f} "
                f"{single:>12.1f} {split / batched:>13.2f}x"
            )
        print(
            f"{'total':>10} {'':>5} {totals[0]:>11.1f} {totals[1]:>9.1f} {'':>12} "
            f"{totals[1] / totals[0]:>13.2f}x"
        )


if __name__ == "__main__":
    sys.exit(main())
