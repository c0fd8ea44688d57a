"""Benchmark: tuning with successive halving on decay branches against the full grid.

For each setup (``--setup NAME --search KEY=V1,V2 ...``, repeatable as ``--tune
'NAME:KEY=...;KEY=...'``), one ``tune`` of the whole grid without rungs (every trial trains its
full schedule), then the same grid with ``--rungs`` (each trial also trains its decay branches,
and successive halving stops a trial whose branch loss at a rung is not among the best
``1/eta``: synchronously by default, ``--halving async`` for Optuna's asynchronous pruner), both
through ``nanoshampoo.evidence.tune`` with the real trainer, one worker, into separate stores
(``grid`` and ``pruned-sync`` / ``pruned-async`` under the setup's out dir). The compute of a
study is counted in optimizer steps from its runs' own logs: a complete run's ``N`` plus every
branch's own steps (``steps - fork_step``); a stopped or paused run's last fork reached plus the
branches it made (a branch is trained at its fork; the trainer pauses there, or is stopped once
the rung's branch record is read). A paused run that was continued is one log, counted once.
Printed per setup: both best points, their values in the full grid, the pruned study's share of
the grid's compute, and whether the two best points' full-grid values differ by less than the
seed spread (``--noise``, the std of the final loss over seeds at that setup, one number or
``SETUP=STD,...``; e.g. from a
study's Welch table).

Usage:
    python bench/pruning_vs_grid.py \\
        --tune 'adamw:adamw.lr=0.001,0.002,0.004;adamw.weight_decay=0,0.2,0.4' \\
        --tune 'muon:muon.lr=0.01,0.02,0.04;muon.weight_decay=0,0.05,0.1' --rungs 0.125,0.25,0.5 \\
        --noise 0.005 --out-dir runs/pruning -- --num-iterations 128 --threads 2 \\
        --autocast off --compile false --val-every 0 --save-final-checkpoint false
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_facts import measured_facts

from nanoshampoo.evidence.compare import Setup
from nanoshampoo.evidence.tune import TuneConfig, tune
from nanoshampoo.evidence.tune_cli import parse_rungs, parse_tune_specs
from nanoshampoo.evidence.tune_report import TuneResult
from nanoshampoo.evidence.tune_space import HALVINGS
from nanoshampoo.io_utils import atomic_output


def run_steps(jsonl: Path) -> int:
    """The optimizer steps a run took, from its log: the main run's (its final step, or the
    last fork it reached when it was stopped) plus each decay branch's own."""
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    branches = [r for r in records if r["kind"] == "branch"]
    final = next((r for r in records if r["kind"] == "final"), None)
    main = (
        final["step"] if final is not None else max((b["fork_step"] for b in branches), default=0)
    )
    return int(main) + sum(int(b["steps"]) - int(b["fork_step"]) for b in branches)


def study_steps(out_dir: Path) -> int:
    """Every run of a tune's out dir, pruned ones included."""
    return sum(run_steps(path) for path in sorted((out_dir / "trials").rglob("*.jsonl")))


def measure(
    name: str,
    searches: tuple[Any, ...],
    rungs: tuple[float, ...],
    train_args: tuple[str, ...],
    out_dir: Path,
    halving: str = "sync",
) -> dict[str, Any]:
    """The grid and the pruned grid of one setup; their best points and compute."""
    results: dict[str, TuneResult] = {}
    for label, with_rungs in (("grid", ()), (f"pruned-{halving}", rungs)):
        config = TuneConfig(
            Setup(name, f"tiny-{name}"),
            searches,
            train_args=train_args,
            rungs=with_rungs,
            halving=halving,
            out_dir=out_dir / name / label,
        )
        results[label] = tune(config)
    grid, pruned = results["grid"], results[f"pruned-{halving}"]

    def point(params: dict[str, str]) -> str:
        return json.dumps(params, sort_keys=True)

    by_point = {point(t.params): t.value for t in grid.trials}
    pruned_best_in_grid = by_point[point(pruned.best_values)]
    grid_steps = study_steps(out_dir / name / "grid")
    pruned_steps = study_steps(out_dir / name / f"pruned-{halving}")
    states = [t.state for t in pruned.trials]
    halved = {point(t.params): t for t in pruned.trials}
    points = [
        {
            "params": t.params,
            "grid_value": t.value,
            "state": halved[point(t.params)].state,
            "rungs": halved[point(t.params)].rungs,
        }
        for t in sorted(grid.trials, key=lambda t: t.name)
    ]
    return {
        "points": points,
        "grid_best": grid.best_values,
        "grid_best_value": grid.best_value,
        "pruned_best": pruned.best_values,
        "pruned_best_value": pruned.best_value,
        "pruned_best_in_grid": pruned_best_in_grid,
        "gap": pruned_best_in_grid - grid.best_value,
        "grid_steps": grid_steps,
        "pruned_steps": pruned_steps,
        "compute_share": pruned_steps / grid_steps,
        "trials": len(states),
        "pruned_trials": states.count("pruned"),
    }


def parse_noise(text: str, setups: list[str]) -> dict[str, float]:
    """``--noise``: one std for every setup, or ``SETUP=STD,...`` naming each."""
    if "=" not in text:
        return dict.fromkeys(setups, float(text))
    given = {k.strip(): float(v) for k, v in (part.split("=", 1) for part in text.split(","))}
    if sorted(given) != sorted(setups):
        raise SystemExit(f"--noise: give a std for each of {setups}, got {sorted(given)}")
    return given


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune", action="append", required=True, metavar="SETUP:KEY=SPEC[;...]")
    parser.add_argument("--rungs", default="0.125,0.25,0.5")
    parser.add_argument(
        "--halving",
        choices=HALVINGS,
        default="sync",
        help="successive halving's mode (tune --halving)",
    )
    parser.add_argument(
        "--noise",
        default="0",
        metavar="STD or SETUP=STD,...",
        help="the final loss's std over seeds (per setup): a gap below it is seed noise",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("runs/pruning"))
    parser.add_argument("--json", default="", help="write the results here")
    parser.add_argument("train_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    train_args = tuple(args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args)
    rungs = parse_rungs(args.rungs, "--rungs")
    specs = parse_tune_specs(args.tune)
    noise = parse_noise(args.noise, list(specs))
    threads = train_args[train_args.index("--threads") + 1] if "--threads" in train_args else "auto"
    facts = measured_facts(threads)  # the commit of the code the runs use, taken before them
    results = {
        name: measure(name, searches, rungs, train_args, args.out_dir, args.halving)
        for name, searches in specs.items()
    }
    for name, r in results.items():
        verdict = (
            "the same point"
            if r["grid_best"] == r["pruned_best"]
            else f"within seed noise ({r['gap']:.4f} < {noise[name]})"
            if r["gap"] < noise[name]
            else f"NOT within seed noise ({r['gap']:.4f} >= {noise[name]})"
        )
        print(
            f"{name}: grid best {r['grid_best']} {r['grid_best_value']:.4f} "
            f"({r['grid_steps']} steps); pruned best {r['pruned_best']} "
            f"{r['pruned_best_value']:.4f}, {r['pruned_best_in_grid']:.4f} in the grid "
            f"({r['pruned_steps']} steps, {r['pruned_trials']} of {r['trials']} trials "
            f"pruned): {verdict}; compute {100 * r['compute_share']:.0f} % of the grid's"
        )
    if args.json:
        with atomic_output(Path(args.json)) as tmp:
            tmp.write_text(
                json.dumps(
                    {
                        **facts,
                        "rungs": rungs,
                        "halving": args.halving,
                        "train_args": train_args,
                        "noise": noise,
                        "results": results,
                    },
                    indent=2,
                )
            )


if __name__ == "__main__":
    main()
