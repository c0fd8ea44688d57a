"""Benchmark: one run with decay branches against the separate runs of every budget.

For each cooldown fraction ``c`` (``--cooldowns``), side by side in one invocation: one run of
``--steps N`` with ``--decay-branches`` (``--fractions``, default 0.25,0.5,0.75), and the
separate runs of ``round(b N)`` steps for every fraction and of ``N`` steps, each through the
trainer's command line in its own process (``python -m nanoshampoo.train --preset P
--num-iterations K --cooldown-frac c --val-every 0 --save-final-checkpoint false --compile false
--progress false`` plus ``--train-args``), same seed; which side goes first alternates with
``c``. Measured: each process's wall time and CPU time (start-up, data, validations included)
and the training time of every step it took (for the branched run: the main run's, plus each
branch's own, from its record's time less the main run's time at its fork).

Expected: the branched run takes ``N + sum(N_b - fork_b)`` optimizer steps (the forks from
``train/branches.py``), about ``N (1 + c sum(b))``; the separate runs take ``N + sum(N_b)``,
about ``N (1 + sum(b))``. Printed per ``c``: the measured wall-time and training-time ratios
(branched / separate) next to the expected step ratio, both exact and by the formula. Also
checked: every branch's final loss equals its separate run's (bit for bit under ``--compile
false`` and fixed threads).

Usage:
    python bench/decay_branches.py [--steps 300] [--preset tiny-adamw] [--cooldowns 0.7,0.2]
        [--fractions 0.25,0.5,0.75] [--train-args "--threads 1"] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nanoshampoo.evidence.logs import read_run
from nanoshampoo.io_utils import atomic_output
from nanoshampoo.train.branches import plan_branches


def expected_steps(steps: int, fractions: Sequence[float], cooldown: float) -> dict[str, float]:
    """Optimizer steps of the branched run and of the separate runs: exact (from the forks)
    and by the formula ``N (1 + c sum(b))`` / ``N (1 + sum(b))``."""
    plan = plan_branches(fractions, steps, cooldown)
    branched = steps + sum(b.steps - b.fork_step for b in plan)
    separate = steps + sum(b.steps for b in plan)
    return {
        "branched_steps": branched,
        "separate_steps": separate,
        "expected_ratio": branched / separate,
        "formula_ratio": (1 + cooldown * sum(fractions)) / (1 + sum(fractions)),
    }


def train(
    out_dir: Path,
    run_id: str,
    steps: int,
    cooldown: float,
    args: argparse.Namespace,
    fractions: Sequence[float] = (),
) -> dict[str, Any]:
    """One trainer process; its wall time, its CPU time (user + system, which a busy machine
    inflates far less than the wall time), its log's training time and final losses."""
    command = [
        sys.executable,
        "-m",
        "nanoshampoo.train",
        "--preset",
        args.preset,
        "--num-iterations",
        str(steps),
        "--cooldown-frac",
        str(cooldown),
        "--val-every",
        "0",
        "--log-every",
        "1",
        "--save-final-checkpoint",
        "false",
        "--compile",
        "false",
        "--progress",
        "false",
        "--out-dir",
        str(out_dir),
        "--run-id",
        run_id,
        *shlex.split(args.train_args),
    ]
    if fractions:
        command += ["--decay-branches", ",".join(map(str, fractions))]
    start, cpu_start = time.perf_counter(), _children_cpu_s()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    cpu = _children_cpu_s() - cpu_start
    log = out_dir / f"{run_id}.jsonl"
    run = read_run(log)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    at_step = {0: 0.0, **{r["step"]: r["train_time_ms"] for r in records if r["kind"] == "train"}}
    branch_ms = sum(b.train_time_ms - at_step[b.fork_step] for b in run.branches.values())
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "train_time_s": (run.train_time_ms + branch_ms) / 1000,
        "final_losses": {str(k): v for k, v in run.final_losses_by_steps().items()},
    }


def _children_cpu_s() -> float:
    """User + system seconds of every finished child process so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def compare(cooldown: float, first: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The branched run and the separate runs at one cooldown, ``first`` side first."""
    fractions, steps = args.fractions, args.steps
    lengths = [b.steps for b in plan_branches(fractions, steps, cooldown)] + [steps]
    out = work / f"c{cooldown:g}"

    def branched() -> dict[str, Any]:
        return train(out, "branched", steps, cooldown, args, fractions)

    def separate() -> list[dict[str, Any]]:
        return [train(out, f"alone{n}", n, cooldown, args) for n in lengths]

    if first == "branched":
        one, alone = branched(), separate()
    else:
        alone, one = separate(), branched()
    separate_wall = sum(r["wall_s"] for r in alone)
    separate_train = sum(r["train_time_s"] for r in alone)
    same = {
        str(n): one["final_losses"][str(n)] == r["final_losses"][str(n)]
        for n, r in zip(lengths, alone)
    }
    return {
        **expected_steps(steps, fractions, cooldown),
        "first": first,
        "branched_wall_s": one["wall_s"],
        "separate_wall_s": separate_wall,
        "measured_ratio": one["wall_s"] / separate_wall,
        "branched_cpu_s": one["cpu_s"],
        "separate_cpu_s": sum(r["cpu_s"] for r in alone),
        "measured_cpu_ratio": one["cpu_s"] / sum(r["cpu_s"] for r in alone),
        "branched_train_time_s": one["train_time_s"],
        "separate_train_time_s": separate_train,
        "measured_train_time_ratio": one["train_time_s"] / separate_train,
        "final_losses": one["final_losses"],
        "same_final_loss": same,
    }


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(part) for part in text.split(",") if part.strip())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="N, the longest budget")
    parser.add_argument("--preset", default="tiny-adamw")
    parser.add_argument("--cooldowns", type=_floats, default=(0.7, 0.2))
    parser.add_argument("--fractions", type=_floats, default=(0.25, 0.5, 0.75))
    parser.add_argument("--train-args", default="--threads 1")
    parser.add_argument("--json", default="", help="write the results here")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for index, cooldown in enumerate(args.cooldowns):
            first = "branched" if index % 2 == 0 else "separate"
            results[f"{cooldown:g}"] = compare(cooldown, first, args, Path(work))
    print(
        f"load average {load:.2f} at the start; {args.preset}, N = {args.steps}, fractions "
        f"{list(args.fractions)}, train args {args.train_args!r}"
    )
    for cooldown, r in results.items():
        print(
            f"cooldown {cooldown}: branched {r['branched_wall_s']:.1f} s "
            f"({r['branched_steps']} steps) vs separate {r['separate_wall_s']:.1f} s "
            f"({r['separate_steps']} steps): measured {r['measured_ratio']:.3f} (CPU time "
            f"{r['measured_cpu_ratio']:.3f}, training "
            f"time {r['measured_train_time_ratio']:.3f}), expected "
            f"{r['expected_ratio']:.3f} (N(1 + c sum b) / N(1 + sum b) = "
            f"{r['formula_ratio']:.3f}); same final losses: {r['same_final_loss']}"
        )
    if args.json:
        with atomic_output(Path(args.json)) as tmp:
            tmp.write_text(
                json.dumps(
                    {
                        "load": load,
                        "preset": args.preset,
                        "steps": args.steps,
                        "fractions": list(args.fractions),
                        "train_args": args.train_args,
                        "results": results,
                    },
                    indent=2,
                )
            )


if __name__ == "__main__":
    main()
