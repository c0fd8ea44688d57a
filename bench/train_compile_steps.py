"""Benchmark: eager and ``torch.compile``-d training steps alternating in one process.

``bench/train_compile.py`` compares whole runs, one process each; when other jobs share the
cores their load moves between two runs and with it the ratio. Here one trainer (built from the
command line's parsing, ``--compile false``) runs the trainer's own timed step
(``Trainer._train_step``: forward, backward, the finiteness check, every optimizer's step)
with its ``forward`` switched between the eager model and ``torch.compile(model)`` in the
order E C C E E C C E ...: every pair of neighbouring steps sees the same load. Both modes
train the same model, one step after the other. From the command line the script re-executes
itself under the trainer's tuned glibc malloc settings, as ``python -m nanoshampoo.train`` does.
The compile cost is the first preset's (later presets reuse what the first compiled in this
process where their graphs match, so theirs is a lower bound).

Printed per preset: the median eager and compiled step, their ratio, the first compiled step
(it compiles the training graph) minus the median compiled one (the compile cost), and the
steps after which it is paid back.

Usage:
    python bench/train_compile_steps.py [--presets tiny-adamw,tiny-shampoo] [--steps 40]
        [--train-args "--threads 1"] [--json OUT]

Measured figures and their command: ``docs/results/mfu.md`` "torch.compile".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from nanoshampoo.io_utils import atomic_output
from nanoshampoo.train.allocator import tuned_environment


def schedule(steps: int) -> list[str]:
    """``steps`` modes in the order E C C E E C C E ... (each mode ``steps // 2`` times)."""
    if steps < 4 or steps % 2:
        raise ValueError(f"--steps {steps}: an even number >= 4")
    return [("eager", "compiled")[(i + 1) // 2 % 2] for i in range(steps)]


def figures(times: dict[str, list[float]]) -> dict[str, float]:
    """The comparison of the alternating steps' seconds (the first compiled one compiles)."""
    eager = statistics.median(times["eager"])
    compiled = statistics.median(times["compiled"][1:])
    cost = times["compiled"][0] - compiled
    saved = eager - compiled
    return {
        "eager_step_ms": 1000 * eager,
        "compiled_step_ms": 1000 * compiled,
        "compiled_over_eager": compiled / eager,
        "compile_cost_s": cost,
        "payback_steps": cost / saved if saved > 0 else float("inf"),
    }


def alternate(preset: str, steps: int, train_args: Sequence[str], work: Path) -> dict[str, float]:
    from nanoshampoo.train.cli import config_from_args
    from nanoshampoo.train.trainer import Trainer

    argv = [
        "--preset",
        preset,
        "--num-iterations",
        str(steps),
        "--compile",
        "false",
        "--val-every",
        "0",
        "--save-final-checkpoint",
        "false",
        "--progress",
        "false",
        "--out-dir",
        str(work / preset),
        *train_args,
    ]
    trainer = Trainer(config_from_args(argv, refuse_unread_tables=True))
    forwards = {"eager": trainer.model, "compiled": torch.compile(trainer.model)}
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for step, mode in enumerate(schedule(steps)):
        trainer.forward = forwards[mode]
        start = time.perf_counter()
        trainer._train_step(step, steps)
        times[mode].append(time.perf_counter() - start)
    return {**figures(times), "threads": torch.get_num_threads()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny-adamw,tiny-shampoo")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--train-args", default="--threads 1")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    schedule(args.steps)
    environment = tuned_environment(os.environ, platform.libc_ver()[0])
    if argv is None and environment is not None:  # the command line, as the trainer runs
        os.execve(sys.executable, [sys.executable, *sys.argv], environment)
    loads = [os.getloadavg()[0]]
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for preset in args.presets.split(","):
            results[preset] = alternate(
                preset, args.steps, shlex.split(args.train_args), Path(work)
            )
            loads.append(os.getloadavg()[0])
    print(
        f"load average {min(loads):.2f}-{max(loads):.2f}; {args.steps} steps alternating "
        f"E C C E ...; train args {args.train_args!r}"
    )
    print(json.dumps(results, indent=2))
    if args.json:
        with atomic_output(Path(args.json)) as tmp:
            tmp.write_text(json.dumps({"loads": loads, "results": results}, indent=2))


if __name__ == "__main__":
    main()
