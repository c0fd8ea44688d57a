"""Benchmark: runs per hour of a study on this machine, and where the wall time goes.

Two ways to train the same runs, side by side in one invocation, alternating (``--repeats``):

* ``engine``: ``nanoshampoo study`` on a reduced slice of the embedded study (``--setups``,
  ``--size``, ``--seeds``, ``--num-iterations``; the slice's definition is written beside the
  runs), ``--workers`` processes on one trial store, as ``make study`` starts them;
* ``baseline``: the runs that engine pass trained to their end, each as ``make train`` trains
  a run today: its own fresh ``python -m nanoshampoo.train`` with the same flags (the
  manifest's ``argv``), one after another, each with a probe cache of its own (so each probes,
  where the engine's runs share one), the runs the engine pruned trained to their end.

Reported per pass: wall time, runs per hour, and the runs' own phases summed over the runs
(the ``phases_s`` of each run's ``final`` record: process start and imports, data, probes,
setup, first step, steps, validation, checkpoints, telemetry, logging, other;
``nanoshampoo/train/phases.py``); ``overhead`` is what no run accounts for: the pass's wall
time times its concurrent processes, less the runs' summed wall time (process exit, the
engine's own work: the trial store, pruning, the report; a pruned run's time is counted
here too, as it writes no ``final`` record). Checked: every run's final and branch
validation losses are the same, to every digit, in both passes.

``--boost`` first lowers this process's autogroup's nice value to -15 (Linux autogroup
scheduling) and does so for every process it starts in a new session (the study's trainers),
so that other users of a shared machine disturb the timing less.

Usage:
    python bench/study_throughput.py [--setups adamw,muon] [--size gpt-0.2m] [--seeds 3]
        [--num-iterations 32] [--workers 2] [--repeats 1] [--boost]
        [--out-dir runs/study-throughput] [--json docs/results/throughput-study.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from bench_facts import git_commit

from nanoshampoo.evidence.compare import MANIFEST_SUFFIX
from nanoshampoo.evidence.logs import read_run
from nanoshampoo.evidence.tune_trial import PRUNED_SUFFIX
from nanoshampoo.io_utils import atomic_output
from nanoshampoo.train.machine import cpu_name
from nanoshampoo.train.phases import PHASES
from nanoshampoo.train.probe_cache import CACHE_VAR

BOOST_NICE = -15
MODES = ("engine", "baseline")
# A 2-point learning-rate grid per setup: the values of an earlier embedded study's grid, those
# the figures in docs/results/throughput.md were measured with.
SEARCHES = {
    "adamw": ("tiny-adamw", "adamw.lr=0.002,0.004"),
    "muon": ("tiny-muon", "muon.lr=0.01,0.02"),
    "shampoo": ("tiny-shampoo", "shampoo.lr=0.002,0.004"),
    "soap": ("tiny-soap", "soap.lr=0.002,0.004"),
}


def slice_definition(setups: Sequence[str], size: str, seeds: int, steps: int) -> str:
    """The reduced study as a definition file: the embedded study's flags and budgets, one
    size, ``steps`` steps, one searched key (2 grid points) per setup, asynchronous halving.

    Asynchronous, not the embedded study's synchronous halving: this bench sums whole runs,
    and a synchronously halved trial is paused at its rung and continued by another process,
    so its phases are split over segments that no single run record holds."""
    flags = [
        "--num-iterations", str(steps), "--threads", "1", "--autocast", "off",
        "--compile", "false", "--progress", "false", "--save-final-checkpoint", "false",
        "--val-every", "0",
    ]  # fmt: skip
    lines = [
        'baseline = "adamw"',
        f'sizes = ["{size}"]',
        "budgets = [0.125, 0.25, 0.5, 1.0]",
        f"seeds = {seeds}",
        f"train_args = {json.dumps(flags)}",
        'halving = "async"',
    ]
    for name in setups:
        preset, search = SEARCHES[name]
        lines += ["", f"[setups.{name}]", f'preset = "{preset}"', f'search = ["{search}"]']
    return "\n".join(lines) + "\n"


def set_autogroup_nice(pid: int | str, nice: int) -> bool:
    """Set the nice value of ``pid``'s autogroup; False where that is not possible."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
        return True
    except OSError:
        return False


class Booster:
    """While running, sets :data:`BOOST_NICE` on the autogroup of every descendant of this
    process (trainers started in a new session have an autogroup of their own)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Booster:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def _loop(self) -> None:
        boosted: set[int] = set()
        while not self.stop.wait(0.2):
            parents: dict[int, int] = {}
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    try:
                        stat = (entry / "stat").read_text()
                    except OSError:
                        continue
                    parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            mine = {os.getpid()}
            for pid in sorted(parents):  # children have larger pids, mostly; repeat to close
                for _ in range(2):
                    if parents.get(pid) in mine:
                        mine.add(pid)
            for pid in mine - boosted - {os.getpid()}:
                set_autogroup_nice(pid, BOOST_NICE)
                boosted.add(pid)


def study_runs(out_dir: Path) -> list[dict[str, Any]]:
    """Every run of the study under ``out_dir`` that ended: manifest, final and branch
    losses, phases, when its log was last written; sorted by the manifest's path (the same
    runs in every pass)."""
    runs = []
    for manifest in sorted(out_dir.rglob(f"*{MANIFEST_SUFFIX}")):
        info = json.loads(manifest.read_text())
        jsonl = manifest.with_name(manifest.name.removesuffix(MANIFEST_SUFFIX) + ".jsonl")
        runs.append({"manifest": str(manifest.relative_to(out_dir)), "argv": info["argv"]})
        runs[-1].update(run_outcome(jsonl), ended=jsonl.stat().st_mtime)
    return runs


def pruned_runs(out_dir: Path) -> list[dict[str, Any]]:
    """The runs the study's pruner stopped (``RUN.pruned.json`` manifests), by path."""
    return [
        {"manifest": str(path.relative_to(out_dir)), "argv": json.loads(path.read_text())["argv"]}
        for path in sorted(out_dir.rglob(f"*{PRUNED_SUFFIX}"))
    ]


def run_outcome(jsonl: Path) -> dict[str, Any]:
    """A run's final loss (as written, every digit), branch losses and ``phases_s``."""
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    final = next((r for r in records if r.get("kind") == "final"), None)
    if final is None:
        # Synchronous halving leaves a stopped trial's run paused at its rung, and a continued
        # one's earlier segments record no phases: this bench sums whole runs only.
        raise SystemExit(
            f"{jsonl}: the run has no final record (paused by synchronous halving?); this bench "
            "measures studies whose halving is async"
        )
    branches = {str(r["fraction"]): r["val_loss"] for r in records if r.get("kind") == "branch"}
    read_run(jsonl)  # refuses a log that did not finish
    return {"val_loss": final["val_loss"], "branches": branches, "phases_s": final["phases_s"]}


def summed_phases(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    return {k: round(sum(r["phases_s"][k] for r in runs), 2) for k in (*PHASES, "wall")}


def engine_command(out_dir: Path, args: argparse.Namespace) -> list[str]:
    """The study slice (its definition written into ``out_dir``), or ``make compare``'s
    command on the slice's setups and seeds, at ``--num-iterations`` steps."""
    if args.engine == "compare":
        return [
            *(sys.executable, "-m", "nanoshampoo", "compare", "--setups", args.setups),
            *("--seeds", str(args.seeds), "--baseline", "adamw", "--step-fractions", "0.7"),
            *("--out-dir", str(out_dir / "study"), "--", "--save-final-checkpoint", "false"),
            *("--num-iterations", str(args.num_iterations), "--progress", "false"),
        ]
    definition = out_dir / "slice.toml"
    definition.write_text(
        slice_definition(args.setups.split(","), args.size, args.seeds, args.num_iterations)
    )
    command = [sys.executable, "-m", "nanoshampoo", "study", "--study", str(definition)]
    return command + ["--out-dir", str(out_dir / "study"), "--resamples", "100"]


def engine_pass(out_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``--workers`` study processes on one store, as ``make study`` starts two (one
    ``compare``, which trains one run at a time)."""
    out_dir.mkdir(parents=True)
    command = engine_command(out_dir, args)
    processes = 1 if args.engine == "compare" else args.workers
    start, started = time.perf_counter(), time.time()
    workers = [
        subprocess.Popen(
            command,
            stdout=(out_dir / f"worker-{i}.out").open("x"),
            stderr=subprocess.STDOUT,
        )
        for i in range(processes)
    ]
    codes = [w.wait() for w in workers]
    wall, ended = time.perf_counter() - start, time.time()
    if any(codes):
        raise SystemExit(f"study worker failed ({codes}); see {out_dir}/worker-*.out")
    runs = study_runs(out_dir / "study")
    record = pass_record("engine", wall, processes, runs, command)
    record["pruned_runs"] = [r["manifest"] for r in pruned_runs(out_dir / "study")]
    # The engine's own time at both ends: to the first run's process start, and after the
    # last run's final record (the study's report: bootstrap, plots).
    first_start = min(r["ended"] - r["phases_s"]["wall"] for r in runs)
    record["engine_start_s"] = round(first_start - started, 2)
    record["engine_report_s"] = round(ended - max(r["ended"] for r in runs), 2)
    return record


def baseline_pass(
    out_dir: Path,
    runs: Sequence[dict[str, Any]],
    pruned: Sequence[dict[str, Any]],
    mode: str = "baseline",
    threads: int | None = None,
) -> dict[str, Any]:
    """Each of ``runs``, then each of the engine's ``pruned`` runs (to its end: no pruner
    stops a run trained by hand), in its own fresh trainer process, one after another.
    ``threads``: replaces the runs' ``--threads`` value."""
    out_dir.mkdir(parents=True)
    done, walls = [], {}
    start = time.perf_counter()
    for number, run in enumerate([*runs, *pruned]):
        run_id = f"run{number}"
        argv = with_threads(run["argv"], threads)
        command = [sys.executable, "-m", "nanoshampoo.train", *argv]
        command += ["--run-id", run_id, "--out-dir", str(out_dir)]
        # Each run its own probe cache: every run probes, as each did before runs shared one.
        env = {**os.environ, CACHE_VAR: str(out_dir / f"{run_id}.probes.json")}
        begin = time.perf_counter()
        with (out_dir / f"{run_id}.out").open("x") as output:
            code = subprocess.call(command, stdout=output, stderr=subprocess.STDOUT, env=env)
        if code:
            raise SystemExit(f"baseline run {run_id} failed ({code}); see {out_dir}")
        walls[run["manifest"]] = round(time.perf_counter() - begin, 2)
        if number < len(runs):
            done.append({"manifest": run["manifest"], "argv": run["argv"]})
            done[-1].update(run_outcome(out_dir / f"{run_id}.jsonl"))
    wall = time.perf_counter() - start
    record = pass_record(mode, wall, 1, done, ["python", "-m", "nanoshampoo.train"])
    record["run_walls_s"] = walls
    # Without the pruned runs: the baseline of an engine that pruned nothing.
    record["wall_without_pruned_s"] = round(wall - sum(walls[r["manifest"]] for r in pruned), 2)
    record["pruned_runs"] = [r["manifest"] for r in pruned]
    record["threads"] = threads
    return record


def with_threads(argv: Sequence[str], threads: int | None) -> list[str]:
    """``argv`` with its ``--threads`` value set to ``threads`` (None: as it is)."""
    out = list(argv)
    if threads is not None:
        out[out.index("--threads") + 1] = str(threads)
    return out


def pass_record(
    mode: str,
    wall: float,
    processes: int,
    runs: Sequence[dict[str, Any]],
    command: Sequence[str],
) -> dict[str, Any]:
    phases = summed_phases(runs)
    return {
        "mode": mode,
        "command": " ".join(command),
        "wall_s": round(wall, 2),
        "processes": processes,
        "runs": len(runs),
        "runs_per_hour": round(3600 * len(runs) / wall, 2),
        "phases_s": phases,
        "overhead_s": round(processes * wall - phases["wall"], 2),
        "losses": {r["manifest"]: [r["val_loss"], r["branches"]] for r in runs},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--engine",
        choices=("study", "compare"),
        default="study",
        help="the study slice on --workers processes, or make compare's command (its runs "
        "probe their threads, so their losses vary run to run)",
    )
    parser.add_argument("--setups", default="adamw,muon")
    parser.add_argument("--size", default="gpt-0.2m")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--num-iterations", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--boost", action="store_true")
    parser.add_argument(
        "--two-threads",
        action="store_true",
        help="also train the runs one at a time on 2 threads each (other numerics)",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("runs/study-throughput"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    unknown = [s for s in args.setups.split(",") if s not in SEARCHES]
    if unknown or "adamw" not in args.setups.split(","):
        raise SystemExit(f"--setups: from {sorted(SEARCHES)}, adamw included; got {args.setups}")
    if args.out_dir.exists():
        raise SystemExit(f"--out-dir {args.out_dir}: exists; runs are never overwritten")
    if args.two_threads and args.engine != "study":
        raise SystemExit("--two-threads: only with --engine study (its runs fix one thread)")
    if args.boost and not set_autogroup_nice("self", BOOST_NICE):
        raise SystemExit("--boost: cannot write /proc/self/autogroup")
    passes: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    pruned: list[dict[str, Any]] = []
    booster = Booster() if args.boost else None
    if booster is not None:
        booster.__enter__()
    try:
        for repeat in range(args.repeats):
            # The engine decides which runs there are (its first pass); after that the two
            # alternate which goes first, so neither always meets the machine's later load.
            engine_dir, baseline_dir = (args.out_dir / f"{m}-{repeat}" for m in MODES)
            if repeat % 2 == 0:
                engine = engine_pass(engine_dir, args)
                if not runs:
                    runs = study_runs(engine_dir / "study")
                    pruned = pruned_runs(engine_dir / "study")
                baseline = baseline_pass(baseline_dir, runs, pruned)
            else:
                baseline = baseline_pass(baseline_dir, runs, pruned)
                engine = engine_pass(engine_dir, args)
            passes += [engine, baseline]
            _report(engine, baseline)
            if args.two_threads:  # one 2-thread run at a time: other numerics, so not the study
                two = baseline_pass(
                    args.out_dir / f"two-threads-{repeat}", runs, pruned, "two-threads", 2
                )
                passes.append(two)
                print(
                    f"  two-threads {two['wall_s']:.0f}s (engine/two-threads "
                    f"{engine['wall_s'] / two['wall_s']:.3f})"
                )
    finally:
        if booster is not None:
            booster.__exit__()
    result = {
        "bench": "study_throughput",
        "command": "python bench/study_throughput.py " + " ".join(sys.argv[1:] or []),
        "machine": cpu_name(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": git_commit(),
        "engine": args.engine,
        "slice": {k: getattr(args, k) for k in ("setups", "size", "seeds", "num_iterations")},
        "workers": args.workers,
        "passes": passes,
    }
    if args.json is not None:
        with atomic_output(args.json) as tmp:
            tmp.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _report(engine: dict[str, Any], baseline: dict[str, Any]) -> None:
    same = all(baseline["losses"].get(k) == v for k, v in engine["losses"].items())
    print(
        f"engine {engine['wall_s']:.0f}s ({engine['runs']} runs, {len(engine['pruned_runs'])} "
        f"pruned; start {engine['engine_start_s']:.0f}s, report {engine['engine_report_s']:.0f}s)"
        f", baseline {baseline['wall_s']:.0f}s ({baseline['wall_without_pruned_s']:.0f}s "
        f"without the pruned runs): ratio {engine['wall_s'] / baseline['wall_s']:.3f} "
        f"({engine['wall_s'] / baseline['wall_without_pruned_s']:.3f}); "
        f"losses identical: {same}"
    )
    for record in (engine, baseline):
        print(f"  {record['mode']:8s} phases {record['phases_s']} overhead {record['overhead_s']}")


if __name__ == "__main__":
    sys.exit(main())
