"""Record a real 2-rank gloo trace and show what the overlap classifier sees in it.

Each rank computes, launches an async reduce-scatter, computes while it is in flight, waits,
then all-gathers (the DistAdam pattern), under ``StepProfiler``. The script prints, per rank,
every distinct ``(thread name, cat, event name)`` of the trace with its count -- the evidence
the CPU rules in ``nanoshampoo.evidence.traces`` were written from -- and the overlap table.

Usage:
    python bench/evidence_gloo_trace.py --out-dir /tmp/gloo_trace
    nanoshampoo trace /tmp/gloo_trace          # the same table, from the command line
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch

from nanoshampoo.evidence.profiling import StepProfiler
from nanoshampoo.evidence.traces import analyze_paths, format_overlap, load_trace
from nanoshampoo.optim.collectives import all_gather_into_tensor, reduce_scatter_tensor, wait_work
from nanoshampoo.testing.distributed import run_on_gloo


def _job(rank: int, world_size: int, out_dir: str, size: int) -> int:
    x = torch.randn(size, size)
    grad = torch.randn(64 * size * world_size)
    shard = torch.empty(grad.numel() // world_size)
    with StepProfiler(out_dir, [2, 3], rank=rank) as profiler:
        for step in range(4):
            profiler.step(step)
            y = x @ x
            work = reduce_scatter_tensor(shard, grad, async_op=True)
            y = y @ x
            wait_work(work)
            all_gather_into_tensor(grad, shard)
    return int(y.shape[0])


def _event_inventory(path: Path) -> list[tuple[int, str, str, str]]:
    events = load_trace(path)["traceEvents"]
    names = {
        (e.get("pid"), e.get("tid")): (e.get("args") or {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    counts = collections.Counter(
        (names.get((e.get("pid"), e.get("tid")), "?"), e.get("cat", ""), e.get("name", ""))
        for e in events
        if e.get("ph") == "X"
    )
    return sorted((n, *key) for key, n in counts.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/nanoshampoo_gloo_trace"))
    parser.add_argument("--size", type=int, default=256, help="matrix size of the compute")
    args = parser.parse_args()
    run_on_gloo(_job, 2, str(args.out_dir), args.size)
    for path in sorted(args.out_dir.glob("rank*.json.gz")):
        print(f"== {path}: events (count, thread, cat, name) ==")
        for count, thread, cat, name in _event_inventory(path):
            print(f"  {count:4d}  {thread:32s}  {cat:16s}  {name}")
    print(format_overlap(analyze_paths([args.out_dir])))


if __name__ == "__main__":
    main()
