"""Exposed communication of DistAdam: reduce-scatters launched in backward hooks vs in step().

Spawns ``--world-size`` CPU ranks on gloo, trains one small GPT with one DistAdam and alternates
the two schedules step by step (``launch="hook"`` on even steps, ``launch="step"`` on odd ones),
so both see the same model, data and machine load. Per step and rank it records

- exposed communication: from the end of ``backward()`` to the end of ``step()`` (the time the
  optimizer adds after the gradients exist: waits on reduce-scatters, the Adam math, gathers);
- total step time: forward + backward + ``step()``.

A step's figure is the slowest rank's. Rank 0 prints the medians per schedule and the
hook/step ratios. ``--trace-dir DIR`` also records one step of each schedule per rank with
``nanoshampoo.evidence.profiling.StepProfiler``: ``DIR/{hook,step}/rank{r}.json.gz``.

Usage:
    python bench/dist_adam_overlap.py                       # ~1-2 min on 2 shared CPU cores
    python bench/dist_adam_overlap.py --steps 40 --trace-dir /tmp/dist_adam_traces
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

from nanoshampoo.evidence.profiling import StepProfiler
from nanoshampoo.model.gpt import GPT, GPTConfig
from nanoshampoo.optim.dist_adam import DistAdam
from nanoshampoo.testing.distributed import run_on_gloo

SCHEDULES = ("hook", "step")


@dataclass
class BenchConfig:
    world_size: int = 2
    steps: int = 30  # timed steps per schedule
    warmup: int = 4
    num_layers: int = 4
    model_dim: int = 256
    head_dim: int = 64
    vocab_size: int = 4096
    seq_len: int = 64
    batch_size: int = 2
    threads: int = 1  # intra-op threads per rank
    trace_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("world_size", "steps", "num_layers", "model_dim", "head_dim", "vocab_size",
                     "seq_len", "batch_size", "threads"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")


def _train_step(
    model: GPT, opt: DistAdam, schedule: str, idx: torch.Tensor, targets: torch.Tensor
) -> tuple[float, float]:
    """One step under ``schedule``; returns (exposed communication s, total step s)."""
    opt.launch = schedule
    start = time.perf_counter()
    with record_function("forward_backward"):
        model(idx, targets).backward()
    backward_end = time.perf_counter()
    with record_function(f"dist_adam_step_{schedule}"):
        opt.step()
    end = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    return end - backward_end, end - start


def _bench_rank(rank: int, world_size: int, config: BenchConfig) -> None:
    """One rank of the bench, inside the gloo group that ``run_on_gloo`` sets up."""
    torch.set_num_threads(config.threads)
    torch.manual_seed(0)  # identical initial weights on every rank
    model = GPT(
        GPTConfig(
            vocab_size=config.vocab_size,
            num_layers=config.num_layers,
            model_dim=config.model_dim,
            head_dim=config.head_dim,
            max_seq_len=config.seq_len,
        )
    )
    opt = DistAdam(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(
        0, config.vocab_size, (config.batch_size, config.seq_len + 1), generator=gen
    )
    idx, targets = tokens[:, :-1], tokens[:, 1:]

    total_steps = config.warmup + 2 * config.steps
    timings = torch.zeros(total_steps, 2, dtype=torch.float64)
    for step in range(total_steps):
        dist.barrier()  # start every step together, outside the timed region
        timings[step] = torch.tensor(_train_step(model, opt, SCHEDULES[step % 2], idx, targets))
    dist.all_reduce(timings, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank

    if config.trace_dir is not None:
        for schedule in SCHEDULES:
            with StepProfiler(Path(config.trace_dir) / schedule, steps=[1], rank=rank) as prof:
                for step in range(2):
                    dist.barrier()
                    prof.step(step)
                    _train_step(model, opt, schedule, idx, targets)

    if rank == 0:
        _report(config, timings[config.warmup :], model)


def _report(config: BenchConfig, timings: torch.Tensor, model: GPT) -> None:
    num_params = sum(p.numel() for p in model.parameters())
    print(
        f"dist_adam_overlap: world_size={config.world_size} gloo CPU, GPT "
        f"{config.num_layers}x{config.model_dim} vocab {config.vocab_size}, "
        f"{num_params / 1e6:.2f}M params, batch {config.batch_size}x{config.seq_len} per rank, "
        f"{config.steps} timed steps per schedule (alternating), {config.threads} thread(s)/rank"
    )
    medians: dict[str, tuple[float, float]] = {}
    for offset, schedule in enumerate(SCHEDULES):
        rows = timings[(config.warmup + offset) % 2 :: 2]
        exposed = statistics.median(rows[:, 0].tolist()) * 1e3
        total = statistics.median(rows[:, 1].tolist()) * 1e3
        medians[schedule] = (exposed, total)
        print(f"  launch={schedule:<4}  exposed comm median {exposed:8.2f} ms   "
              f"step median {total:8.2f} ms")  # fmt: skip
    (hook_exposed, hook_total), (step_exposed, step_total) = medians["hook"], medians["step"]
    print(f"  hook/step ratio: exposed comm {hook_exposed / step_exposed:.3f}, "
          f"step time {hook_total / step_total:.3f}")  # fmt: skip
    if config.trace_dir is not None:
        print(f"  traces: {config.trace_dir}/{{hook,step}}/rank{{r}}.json.gz")


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    defaults = BenchConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("world_size", "steps", "warmup", "num_layers", "model_dim", "head_dim",
                 "vocab_size", "seq_len", "batch_size", "threads"):  # fmt: skip
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, default=getattr(defaults, name))
    parser.add_argument("--trace-dir", default=None)
    return BenchConfig(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    run_on_gloo(_bench_rank, config.world_size, config)


if __name__ == "__main__":
    main()
