"""Benchmark: synchronous successive halving replayed on a study's full grids.

A study whose tunes ran with ``halving = "off"`` (the embedded one, ``make study``) trained every
grid point to its end, and each trial recorded its decay branches' final losses at the rungs.
Synchronous halving (``tune --halving sync``) decides on nothing else: at each rung it keeps the
best ``max(1, n // eta)`` of the ``n`` trials there by that rung's branch loss (ties: the lower
slot), and a kept trial resumes its own run from its pause bit for bit (tested in
``decay_branches_test.py`` and the tune tests). So on such a grid, the trials halving would keep,
the point it would pick and the steps it would train follow exactly from the records, without
training anything. This bench does that for each rung set asked, at every (size, setup) of the
study, and compares the pick with the grid's best.

Compute is counted in optimizer steps, as ``bench/pruning_vs_grid.py`` counts it from logs:
the grid is ``N`` steps per point (no branches); a halved trial pays, per segment, the main run
from its previous pause to the rung's fork plus that rung's branch after the fork, and the last
segment the rest of the run, ``N - fork``. Forks come from the trainer's schedule
(``nanoshampoo.train.branches.fork_step``) with the study's flags. The noise is the std over the
study's seeds of the final loss at the grid's best point (its three confirm runs): a pick whose
grid loss is within it of the best counts as the best point within seed noise.

The grids come from a study (``--study-json``: every (size, setup) tune of it) or from tunes
(``--tuning-json``, repeatable: each a ``tune --halving off --rungs ... --confirm-seeds 3``
grid, whose confirming runs give the noise).

Usage:
    python bench/halving_replay.py --study-json docs/results/study/study.json \\
        --rungs 0.125,0.25,0.5 --rungs 0.25,0.5 --json docs/results/halving-replay.json
    python bench/halving_replay.py --tuning-json runs/a/tuning.json \\
        --tuning-json runs/b/tuning.json \\
        --rungs 0.25,0.5 --json OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from bench_facts import git_commit

from nanoshampoo.evidence.compare import resolve_train_config
from nanoshampoo.evidence.tune_halving import keep_best
from nanoshampoo.evidence.tune_study import reduction_factor, rung_steps
from nanoshampoo.io_utils import atomic_output


def replay(
    trials: Sequence[dict[str, Any]], rung_steps_: Sequence[int], eta: int
) -> list[list[int]]:
    """The trial indices at each rung (``at[k]``: those that reached rung ``k``, in slot
    order) and, last, the ones that finish the run: ``len(result) == len(rung_steps_) + 1``.
    Each rung keeps what the tune's own rule keeps (``tune_halving.keep_best``; a trial's slot
    is its index).

    ``trials[i]["rungs"]`` maps a branch's steps (as a string) to its final loss."""
    at = [list(range(len(trials)))]
    for steps in rung_steps_:
        here = at[-1]
        kept = keep_best(here, len(here), eta, lambda i: trials[i]["rungs"][str(steps)], int)
        at.append(sorted(kept))
    return at


def halved_steps(at: Sequence[Sequence[int]], forks: Sequence[int], rung_steps_: Sequence[int],
                 num_iterations: int) -> int:  # fmt: skip
    """Steps synchronous halving trains: segment k of each trial at rung k (main run from the
    previous fork to fork k, then branch k past its fork), the last segment ``N - fork``."""
    total, previous = 0, 0
    for k, (fork, steps) in enumerate(zip(forks, rung_steps_)):
        total += len(at[k]) * ((fork - previous) + (steps - fork))
        previous = fork
    return total + len(at[-1]) * (num_iterations - previous)


def grid_points(tune: dict[str, Any]) -> list[dict[str, Any]]:
    """The grid's complete trials in slot order (the trial's directory, tNNN, which breaks ties).
    A failed trial whose point ran again to completion (its worker died; the retry keeps its
    slot) is not a point of its own; a point that never completed ends the replay."""
    trials = sorted(
        (t for t in tune["trials"] if t["state"] == "complete"),
        key=lambda t: (t.get("name", ""), t["number"]),
    )
    done = [t["params"] for t in trials]
    if any(t["state"] != "complete" and t["params"] not in done for t in tune["trials"]):
        raise SystemExit(
            f"{tune['study']}: trials that did not complete; replay needs a full grid "
            "(a study with halving off)"
        )
    return trials


def cell_result(
    tune: dict[str, Any],
    noise: float,
    rungs: Sequence[float],
    num_iterations: int,
    forks: Sequence[int],
) -> dict[str, Any]:
    """One (size, setup): the grid's best, halving's pick and compute at ``rungs``."""
    trials = grid_points(tune)
    steps = rung_steps(rungs, num_iterations)
    at = replay(trials, steps, reduction_factor(rungs))
    best = min(range(len(trials)), key=lambda i: (trials[i]["value"], i))
    # The trials that finish the run: the best of them is the halved study's pick.
    pick = min(at[-1], key=lambda i: (trials[i]["value"], i))
    gap = trials[pick]["value"] - trials[best]["value"]
    grid_steps = len(trials) * num_iterations
    pruned_steps = halved_steps(at, forks, steps, num_iterations)
    return {
        "size": tune["size"],
        "setup": tune["setup"],
        "grid_best": trials[best]["params"],
        "grid_best_value": trials[best]["value"],
        "pick": trials[pick]["params"],
        "pick_value": trials[pick]["value"],
        "gap": gap,
        "noise": noise,
        "within_noise": gap <= noise,
        "kept": [len(a) for a in at],
        "grid_steps": grid_steps,
        "halved_steps": pruned_steps,
        "compute_share": pruned_steps / grid_steps,
    }


def seed_noise(study: dict[str, Any], size: str, setup: str) -> float:
    """The std (n - 1) over seeds of ``setup``'s final loss at ``size``'s largest budget."""
    cells = [o for o in study["observations"] if o["size"] == size and o["setup"] == setup]
    largest = max(o["tokens"] for o in cells)
    return statistics.stdev(o["loss"] for o in cells if o["tokens"] == largest)


class Cell(NamedTuple):
    """One grid to replay: ``tune`` holds ``study``, ``size``, ``setup`` and ``trials`` (each
    with ``number``, ``state``, ``params``, ``value`` and ``rungs``); the rest is how it was
    trained and the seed std of its best point's final loss."""

    tune: dict[str, Any]
    preset: str
    train_args: list[str]
    noise: float


def study_cells(study: dict[str, Any]) -> list[Cell]:
    """Every (size, setup) tune of a study's ``study.json``."""
    definition = study["definition"]
    presets = {s["name"]: s["preset"] for s in definition["setups"]}
    return [
        Cell(
            tune,
            presets[tune["setup"]],
            [*definition["train_args"], "--model", tune["size"]],
            seed_noise(study, tune["size"], tune["setup"]),
        )
        for tune in study["tunes"]
    ]


def tuning_cell(tuning: dict[str, Any], path: Path) -> Cell:
    """One ``tune``'s ``tuning.json`` (a grid tuned with ``--halving off --rungs ...`` and
    ``--confirm-seeds`` >= 2, whose confirming runs give the noise)."""
    finals = [f for f in tuning["confirm_finals"] if f is not None]
    if len(finals) < 2:
        raise SystemExit(
            f"{path}: the noise needs the best point's final loss at >= 2 seeds "
            "(tune --confirm-seeds 3)"
        )
    train_args = list(tuning["train_args"])
    size = str(resolve_train_config(["--preset", tuning["preset"], *train_args])["model"])
    tune = {
        "study": tuning["study"],
        "size": size,
        "setup": tuning["setup"],
        "trials": [t | {"rungs": {str(k): v for k, v in t["rungs"].items()}}
                   for t in tuning["trials"]],
    }  # fmt: skip
    return Cell(tune, tuning["preset"], train_args, statistics.stdev(finals))


def measure(
    cells: Sequence[Cell], rung_sets: Sequence[tuple[float, ...]], grids: bool = False
) -> dict[str, Any]:
    """Each rung set replayed on each cell; with ``grids``, also every cell's complete trials
    (their branch and final losses), which a study's own files already show."""
    from nanoshampoo.train.branches import fork_step  # imports torch

    configs = [resolve_train_config(["--preset", c.preset, *c.train_args]) for c in cells]
    results = []
    for rungs in rung_sets:
        for cell, config in zip(cells, configs):
            num_iterations = int(config["num_iterations"])
            forks = [
                fork_step(s, num_iterations, config["cooldown_frac"], config["warmup_steps"])
                for s in rung_steps(rungs, num_iterations)
            ]
            results.append(
                {"rungs": list(rungs), "forks": forks, "num_iterations": num_iterations}
                | cell_result(cell.tune, cell.noise, rungs, num_iterations, forks)
            )
    tables = [
        {
            "size": cell.tune["size"],
            "setup": cell.tune["setup"],
            "noise": cell.noise,
            "trials": [
                {"params": t["params"], "rungs": t["rungs"], "value": t["value"]}
                for t in grid_points(cell.tune)
            ],
        }
        for cell in (cells if grids else ())
    ]
    return {
        "results": results,
        "grids": tables,
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--study-json", type=Path, help="a study's study.json")
    source.add_argument(
        "--tuning-json",
        type=Path,
        action="append",
        help="a tune's tuning.json (repeatable): a grid with --halving off and --confirm-seeds",
    )
    parser.add_argument(
        "--rungs",
        action="append",
        required=True,
        metavar="F,...",
        help="a rung set to replay (repeatable), e.g. 0.125,0.25,0.5",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    try:
        if args.study_json is not None:
            cells = study_cells(json.loads(args.study_json.read_text()))
        else:
            cells = [tuning_cell(json.loads(p.read_text()), p) for p in args.tuning_json]
        rung_sets = [tuple(float(f) for f in text.split(",")) for text in args.rungs]
        for rungs in rung_sets:
            reduction_factor(rungs)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"halving_replay: {exc}") from None
    result = measure(cells, rung_sets, grids=args.tuning_json is not None)
    for r in result["results"]:
        print(
            f"rungs {r['rungs']} {r['size']:>8} {r['setup']:>7}: grid best {r['grid_best']} "
            f"{r['grid_best_value']:.4f}; halving keeps {r['kept']} and picks {r['pick']} "
            f"{r['pick_value']:.4f} (gap {r['gap']:.4f}, noise {r['noise']:.4f}); "
            f"{r['halved_steps']} of {r['grid_steps']} steps ({100 * r['compute_share']:.0f} %)"
        )
    if args.json is not None:
        with atomic_output(args.json) as tmp:
            tmp.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
