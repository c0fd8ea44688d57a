"""Benchmark: ``--compile`` (``torch.compile`` of the model, inductor) against eager training.

Each preset trains through the trainer's command line in a subprocess, as a user runs it:
``python -m nanoshampoo.train --preset P --num-iterations N --val-every 0 --log-every 1
--save-final-checkpoint false --progress false --compile {false,true}`` (plus
``--train-args``), same seed. Eager and compiled runs alternate, and the order flips every
round, so both see the same share of the other jobs on the cores. From each run's logs: every
step's time (differences of the cumulative ``train_time_ms``), the final MFU, and the
process's wall time (the final validation's inference graph, compiled too, is in it; the
training time excludes it).

Inductor keeps what it compiled in an on-disk cache (``TORCHINDUCTOR_CACHE_DIR``, by default
under ``/tmp``) that later processes reuse: a user's first compiled run pays the whole
compilation, later ones mostly load it. ``--cold-cache`` gives every compiled run a fresh,
empty cache directory (the first run's cost); without it the runs share the machine's cache.

Per preset and mode, medians over rounds of:

* ``step_ms``: the median step from ``--skip`` on (the steady step);
* ``warm_s``: the steps before ``--skip`` minus as many steady steps: the one-off cost inside
  training time (for ``--compile true`` the compilation of the training graph at step 0);
* ``wall_s``: the process's wall time;
* ``mfu``: the run's final MFU (its log's), ``step_mfu``: the steady step's, and
  ``mfu_at_P``: a ``--pays-at`` P-step run's (P steady steps plus the warm-up).

Printed: the steady speed-up (eager step / compiled step), the compile cost (the compiled
warm-up minus the eager one) and the steps after which it is paid back (cost / the time a step
saves), and for a run of ``--pays-at`` steps (300: ``make train``) the predicted training time
of both modes, from the steady steps and the warm-up.

Usage:
    python bench/train_compile.py [--presets tiny-adamw,tiny-shampoo] [--num-iterations 60]
        [--skip 10] [--rounds 2] [--pays-at 300] [--cold-cache] [--train-args "--threads 1"]
        [--json OUT]

Measured figures and their command: ``docs/results/mfu.md`` ("torch.compile").
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from nanoshampoo.io_utils import atomic_output

MODES = ("eager", "compiled")


def step_times_s(jsonl: Path) -> tuple[list[float], float, float]:
    """Every step's seconds (the log has a train record per step), the final MFU (the whole
    run's), and the MFU of a 1-second step (the run's FLOPs per step over its probed peak)."""
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    train = [r for r in records if r["kind"] == "train"]
    steps = [r["step"] for r in train]
    if steps != list(range(1, len(steps) + 1)):
        raise ValueError(f"{jsonl}: train records at steps {steps[:5]}...; run with --log-every 1")
    cumulative = [0.0, *(r["train_time_ms"] / 1000 for r in train)]
    final = next(r for r in records if r["kind"] == "final")
    meter = next(r for r in records if r["kind"] == "config")["mfu"]
    return (
        [b - a for a, b in zip(cumulative, cumulative[1:])],
        float(final["mfu"]),
        meter["flops_per_step"] / meter["peak_flops_per_second"],
    )


def run_figures(times: Sequence[float], skip: int) -> dict[str, float]:
    """``step_ms`` (median from ``skip`` on) and ``warm_s`` (the first ``skip`` steps' excess
    over as many steady steps) of one run's step times."""
    if not 0 < skip < len(times):
        raise ValueError(f"--skip {skip}: must be in 1..{len(times) - 1} (the run's steps - 1)")
    steady = statistics.median(times[skip:])
    return {"step_ms": 1000 * steady, "warm_s": sum(times[:skip]) - skip * steady}


def summarize(runs: dict[str, list[dict[str, float]]], pays_at: int) -> dict[str, float]:
    """The comparison of one preset's eager and compiled runs (medians over rounds)."""
    med = {
        mode: {key: statistics.median(r[key] for r in runs[mode]) for key in runs[mode][0]}
        for mode in MODES
    }
    eager, compiled = med["eager"], med["compiled"]
    saved_s = (eager["step_ms"] - compiled["step_ms"]) / 1000
    cost_s = compiled["warm_s"] - eager["warm_s"]
    return {
        **{f"{mode}_{key}": value for mode in MODES for key, value in med[mode].items()},
        "speedup": eager["step_ms"] / compiled["step_ms"],
        "compile_cost_s": cost_s,
        "payback_steps": cost_s / saved_s if saved_s > 0 else float("inf"),
        f"eager_train_s_at_{pays_at}": pays_at * eager["step_ms"] / 1000 + eager["warm_s"],
        f"compiled_train_s_at_{pays_at}": pays_at * compiled["step_ms"] / 1000 + compiled["warm_s"],
    }


def train_once(
    preset: str, mode: str, tag: str, args: argparse.Namespace, work: Path
) -> dict[str, float]:
    out = work / f"{preset}-{mode}-{tag}"
    command = [
        sys.executable,
        "-m",
        "nanoshampoo.train",
        "--preset",
        preset,
        "--num-iterations",
        str(args.num_iterations),
        "--val-every",
        "0",
        "--log-every",
        "1",
        "--save-final-checkpoint",
        "false",
        "--progress",
        "false",
        "--out-dir",
        str(out),
        "--run-id",
        "run",
        "--compile",
        "true" if mode == "compiled" else "false",
        *shlex.split(args.train_args),
    ]
    environment = dict(os.environ)
    if args.cold_cache:
        environment["TORCHINDUCTOR_CACHE_DIR"] = str(out / "inductor-cache")
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=environment)
    wall = time.perf_counter() - start
    times, mfu, mfu_of_1s = step_times_s(out / "run.jsonl")
    figures = run_figures(times, args.skip)
    return {
        **figures,
        "wall_s": wall,
        "mfu": mfu,
        "step_mfu": mfu_of_1s / (figures["step_ms"] / 1000),
        f"mfu_at_{args.pays_at}": mfu_of_1s
        * args.pays_at
        / (args.pays_at * figures["step_ms"] / 1000 + figures["warm_s"]),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny-adamw,tiny-shampoo")
    parser.add_argument("--num-iterations", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pays-at", type=int, default=300)
    parser.add_argument(
        "--cold-cache", action="store_true", help="a fresh inductor cache for every compiled run"
    )
    parser.add_argument("--train-args", default="--threads 1")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if not 0 < args.skip < args.num_iterations or args.rounds < 1:
        raise ValueError("need 0 < --skip < --num-iterations and --rounds >= 1")
    loads = [os.getloadavg()[0]]
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as work:
        for preset in args.presets.split(","):
            runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
            for round_index in range(args.rounds):
                for mode in MODES if round_index % 2 == 0 else MODES[::-1]:
                    runs[mode].append(train_once(preset, mode, str(round_index), args, Path(work)))
                    loads.append(os.getloadavg()[0])
            results[preset] = summarize(runs, args.pays_at)
    print(
        f"load average {min(loads):.2f}-{max(loads):.2f}; {args.rounds} rounds of "
        f"{args.num_iterations} steps, steady from step {args.skip + 1}; "
        f"inductor cache {'cold' if args.cold_cache else 'shared'}; "
        f"train args {args.train_args!r}"
    )
    print(json.dumps(results, indent=2))
    if args.json:
        with atomic_output(Path(args.json)) as tmp:
            tmp.write_text(json.dumps({"loads": loads, "results": results}, indent=2))


if __name__ == "__main__":
    main()
