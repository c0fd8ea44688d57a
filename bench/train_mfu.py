"""Benchmark: model FLOPs utilisation (MFU) of training runs, read from their own logs.

Each preset runs through the trainer's command line in a subprocess, exactly as a user runs it:
``python -m nanoshampoo.train --preset P --num-iterations N --val-every 0 --log-every 1
--save-final-checkpoint false --out-dir DIR --run-id P`` (plus ``--train-args``). From its
logs: the config record (model, ``seq_len``, batch, autocast, threads), the vocab size (the
environment line) and each step's time (differences of the cumulative ``train_time_ms``).
MFU = ``nanoshampoo.train.throughput`` FLOPs per step / step time / the matmul peak probed
here, in this process, with the run's thread count and dtype. Steps before ``--skip`` (warm-up,
first root computations) are left out; printed: the median step (MFU of a typical step) and
the mean (MFU of the run, root computations included).

Usage:
    python bench/train_mfu.py [--presets tiny-adamw,tiny-shampoo] [--num-iterations 50]
        [--skip 10] [--train-args "--threads 2"] [--json OUT]

Measured figures and their commands: ``docs/results/mfu.md``.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from nanoshampoo.io_utils import atomic_output
from nanoshampoo.model.gpt import gpt_preset
from nanoshampoo.train.throughput import mfu_meter


@dataclass
class RunMfu:
    preset: str
    autocast: str
    threads: int
    gflop_per_step: float
    peak_gflop_s: float
    median_step_ms: float
    mean_step_ms: float
    median_mfu: float
    mean_mfu: float


def read_run(jsonl: Path, text: Path) -> tuple[dict, list[float], int]:
    """``(config record, per-step seconds, vocab size)`` of a finished run's logs."""
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    config = next(r for r in records if r.get("kind") == "config")
    train = [r for r in records if r.get("kind") == "train"]
    steps = [b["step"] - a["step"] for a, b in zip(train, train[1:])]
    if any(s != 1 for s in steps):
        raise ValueError(f"{jsonl}: train records are not one per step (run with --log-every 1)")
    times = [(b["train_time_ms"] - a["train_time_ms"]) / 1e3 for a, b in zip(train, train[1:])]
    match = re.search(r"vocab_size (\d+)", text.read_text())
    if match is None:
        raise ValueError(f"{text}: no 'vocab_size N' in the environment line")
    return config, times, int(match.group(1))


def measure(preset: str, iterations: int, skip: int, extra: Sequence[str], out_dir: Path) -> RunMfu:
    command = [
        sys.executable,
        "-m",
        "nanoshampoo.train",
        "--preset",
        preset,
        "--num-iterations",
        str(iterations),
        "--val-every",
        "0",
        "--log-every",
        "1",
        "--save-final-checkpoint",
        "false",
        "--out-dir",
        str(out_dir),
        "--run-id",
        preset,
        "--progress",
        "false",
        *extra,
    ]
    subprocess.run(command, check=True)
    config, times, vocab = read_run(out_dir / f"{preset}.jsonl", out_dir / f"{preset}.txt")
    cfg = config["config"]
    steady = times[skip:]
    if not steady:
        raise ValueError(f"--skip {skip}: leaves no step of {len(times) + 1}")
    model = gpt_preset(cfg["model"], vocab, cfg.get("combined_linear", False))
    threads = torch.get_num_threads()
    torch.set_num_threads(config["threads"])
    try:
        meter = mfu_meter(
            model,
            cfg["seq_len"],
            cfg["batch_size"] * cfg["seq_len"],
            torch.device("cpu"),
            bf16=config["autocast"] == "bf16",
        )
    finally:
        torch.set_num_threads(threads)
    median, mean = statistics.median(steady), statistics.fmean(steady)
    return RunMfu(
        preset,
        config["autocast"],
        config["threads"],
        meter.flops_per_step / 1e9,
        meter.peak_flops_per_second / 1e9,
        1e3 * median,
        1e3 * mean,
        meter.of_step(median),
        meter.of_step(mean),
    )


def main(argv: Sequence[str] | None = None) -> list[RunMfu]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--presets", default="tiny-adamw,tiny-shampoo")
    parser.add_argument("--num-iterations", type=int, default=50)
    parser.add_argument("--skip", type=int, default=10, help="steps left out at the start")
    parser.add_argument("--train-args", default="", help="more trainer flags, one string")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="train_mfu_") as tmp:
        for preset in args.presets.split(","):
            results.append(
                measure(
                    preset.strip(),
                    args.num_iterations,
                    args.skip,
                    shlex.split(args.train_args),
                    Path(tmp),
                )
            )
    print(
        "| preset | autocast | threads | GFLOP/step | peak GFLOP/s | median step ms | "
        "mean step ms | MFU (median step) | MFU (mean) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r.preset} | {r.autocast} | {r.threads} | {r.gflop_per_step:.3g} | "
            f"{r.peak_gflop_s:.0f} | {r.median_step_ms:.1f} | {r.mean_step_ms:.1f} | "
            f"{100 * r.median_mfu:.2f} % | {100 * r.mean_mfu:.2f} % |"
        )
    if args.json is not None:
        with atomic_output(args.json) as tmp_path:
            tmp_path.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return results


if __name__ == "__main__":
    main()
