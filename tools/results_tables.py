"""Write the result tables of ``docs/results/`` from the JSON their bench scripts wrote.

A rendered table sits in its page between two marker lines that name its JSON file::

    <!-- table: rendered by tools/results_tables.py from decay-branches.json -->
    | ... |
    <!-- end of table -->

so the numbers in the text and those the bench measured cannot disagree. After a bench run
writes its JSON (the command is printed above each table), this script rewrites the tables;
``tests/results_tables_test.py`` fails while a page differs from what it writes.

Usage (from the project's root)::

    python tools/results_tables.py          # rewrite every rendered table
    python tools/results_tables.py --check  # exit 1 if one is out of date
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nanoshampoo.io_utils import atomic_output

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
TABLE = re.compile(
    r"(<!-- table: rendered by tools/results_tables\.py from (?P<json>[\w./-]+\.json) -->\n)"
    r"(?P<body>.*?)"
    r"(<!-- end of table -->)",
    re.DOTALL,
)


def decay_branches(data: dict[str, Any]) -> str:
    """``bench/decay_branches.py --json``: per cooldown, the branched run against separate runs."""
    runs = len(data["fractions"]) + 1
    lines = [
        f"| cooldown | branched run | {runs} separate runs | wall ratio | CPU-time ratio "
        "| training-time ratio | step ratio (exact) | same final losses |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cooldown, row in data["results"].items():
        same = row["same_final_loss"]
        steps = ", ".join(same)
        verdict = (
            f"{steps} steps: yes"
            if all(same.values())
            else "; ".join(f"{s} steps: {'yes' if ok else 'no'}" for s, ok in same.items())
        )
        lines.append(
            f"| {cooldown} | {row['branched_wall_s']:.1f} s, {row['branched_steps']} steps "
            f"| {row['separate_wall_s']:.1f} s, {row['separate_steps']} steps "
            f"| {row['measured_ratio']:.3f} | {row['measured_cpu_ratio']:.3f} "
            f"| {row['measured_train_time_ratio']:.3f} | {row['expected_ratio']:.2f} | {verdict} |"
        )
    return "\n".join(lines) + "\n"


PHASE_LABELS = {
    "start": "process start, imports",
    "data": "data",
    "probes": "probes (threads, bf16, compile, matmul peak)",
    "setup": "setup (model, optimizers, checks)",
    "first_step": "first step (compile, when on)",
    "steps": "optimizer steps",
    "validation": "validation",
    "checkpoint": "checkpoints",
    "telemetry": "telemetry",
    "logging": "logging",
    "other": "other (loop, branch snapshots, header)",
}


def study_throughput(data: dict[str, Any]) -> str:
    """``bench/study_throughput.py --json``: each pass of the first repeat as a column: runs,
    wall time, runs per hour, the ratio to the baseline, the final losses against the
    baseline's, then the runs' phases summed over the runs, and the time no run accounts for."""
    passes = [p for p in data["passes"]]
    first = {}
    for p in passes:
        first.setdefault(p["mode"], p)
    base = first["baseline"]
    columns = list(first.values())

    def losses(p: dict[str, Any]) -> str:
        if p is base:
            return "(reference)"
        pairs = [(v, base["losses"][k]) for k, v in p["losses"].items() if k in base["losses"]]
        same = sum(a == b for a, b in pairs)
        if same == len(pairs):
            return f"identical ({same}/{len(pairs)} runs, every branch)"
        worst = max(abs(a[0] - b[0]) for a, b in pairs)
        return f"{same}/{len(pairs)} identical (largest final-loss difference {worst:.2g})"

    def cell(p: dict[str, Any], seconds: float) -> str:
        return f"{seconds:.1f} s ({100 * seconds / (p['wall_s'] * p['processes']):.0f} %)"

    header = [
        "",
        *(
            f"{p['mode']} ({p['processes']} process{'es' if p['processes'] > 1 else ''})"
            for p in columns
        ),
    ]
    rows = [
        ["runs (+ pruned)", *(f"{p['runs']} (+{len(p.get('pruned_runs', []))})" for p in columns)],
        ["wall time", *(f"{p['wall_s']:.0f} s" for p in columns)],
        ["runs per hour", *(f"{p['runs_per_hour']:.0f}" for p in columns)],
        ["wall time / baseline's", *(f"{p['wall_s'] / base['wall_s']:.2f}" for p in columns)],
        ["final and branch losses", *(losses(p) for p in columns)],
    ]
    for phase, label in PHASE_LABELS.items():
        rows.append([label, *(cell(p, p["phases_s"][phase]) for p in columns)])
    rows.append(
        [
            "not in any run (exits, pruned runs, the engine)",
            *(cell(p, p["overhead_s"]) for p in columns),
        ]
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def thread_choice(data: dict[str, Any]) -> str:
    """``bench/study_throughput.py --two-threads --json``: the same runs as two 1-thread runs
    at once (the engine), one 1-thread run at a time and one 2-thread run at a time."""
    first: dict[str, dict[str, Any]] = {}
    for p in data["passes"]:
        first.setdefault(p["mode"], p)
    labels = {
        "engine": "two 1-thread runs at once (the study's engine)",
        "baseline": "one 1-thread run at a time",
        "two-threads": "one 2-thread run at a time",
    }
    base = first["baseline"]
    lines = [
        "| how | wall time | runs per hour | wall time / one 1-thread run at a time's |",
        "|---|---|---|---|",
    ]
    for mode, label in labels.items():
        p = first[mode]
        lines.append(
            f"| {label} | {p['wall_s']:.0f} s | {p['runs_per_hour']:.0f} "
            f"| {p['wall_s'] / base['wall_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def measured_on(data: dict[str, Any]) -> str:
    """The line above a bench's table: its commit, date, machine, threads and load."""
    return (
        f"Commit {data['commit']}, {data['date']}, `{data['machine']}`, {data['threads']} "
        f"threads, torch {data['torch']}, load average {data['load_average']:.1f}.\n\n"
    )


def peers(data: dict[str, Any]) -> str:
    """``bench/peers.py --json``: each row's step times, ratio, goal, numerics and compile."""
    lines = [
        "| optimizer | peer | peer ms | ours ms | ours / peer | goal | | update difference "
        "| peer compile |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["results"]:
        goal = "-" if r["goal"] is None else f"<= {r['goal']}x"
        against = r["compared_with"]
        difference = "-" if against == "-" else f"{r['update_difference']:.2g} vs {against}"
        compile_s = "-" if r["peer_compile_s"] is None else f"{r['peer_compile_s']:.0f} s"
        lines.append(
            f"| {r['name']} | {r['peer_name']} | {r['peer_ms']:.1f} | {r['ours_ms']:.1f} "
            f"| {r['ratio']:.2f}x | {goal} | {r['verdict']} | {difference} | {compile_s} |"
        )
    choice = [line for line in data["log"] if line.startswith("Muon: ours' Newton-Schulz")]
    if not data.get("complete", True):
        choice.insert(0, f"The run was stopped after these {len(data['results'])} rows.")
    return measured_on(data) + "\n".join(lines + [""] + choice[:2]) + "\n"


def shampoo_floor(data: dict[str, Any]) -> str:
    """``bench/shampoo_floor.py --json``: the floor's parts, ours, and ours over the floor."""
    frequency = data["frequency"]
    per = "" if frequency == 1 else f", once per {frequency} steps"
    eigh = " + ".join(
        f"{n} factors of {size} ({data['eigh_ms'][size]:.1f} ms)"
        for size, n in data["factors_per_size"].items()
    )
    windows = data["rounds_run"] * data["windows_per_round"]
    lines = [
        f"| frequency {frequency}, ms per step | measured |",
        "|---|---|",
        f"| `eigh`: {eigh}{per} | {data['eigh_ms_per_step']:.1f} |",
        f"| GEMMs: {data['gemm_gflop']:.2f} GFLOP, each at its shape "
        f"({data['gemm_gflop_s']:.1f} GFLOP/s) | {data['gemm_ms']:.1f} |",
    ]
    if "elementwise_ms" in data:  # older files: the floor had no elementwise part
        lines.append(
            f"| elementwise: {data['elementwise_arrays']} float32 arrays of {data['numel']} "
            f"moved once ({data['elementwise_gb_s']:.1f} GB/s) | {data['elementwise_ms']:.1f} |"
        )
    lines += [
        f"| **floor** (each part's best of {data['rounds_run']} rounds) "
        f"| **{data['floor_ms']:.1f}** |",
        f"| **ours**, median of {windows} windows (fastest) "
        f"| **{data['ours_median_ms']:.1f}** ({data['ours_min_ms']:.1f}) |",
        f"| **ours / floor**, median (fastest) | **{data['ours_over_floor']:.2f}x** "
        f"({data['ours_min_over_floor']:.2f}x) |",
        f"| floor below every window | {'yes' if data['floor_below_every_window'] else 'no'} |",
    ]
    if "floor_median_ms" in data:  # files from before the bench kept the parts' medians lack it
        lines.append(
            f"| typical: the floor's parts at their median call | {data['floor_median_ms']:.1f} |"
        )
        lines.append(
            "| **ours / floor, typical** (ours' median over the parts' medians) "
            f"| **{data['ours_median_over_floor_median']:.2f}x** |"
        )
    if "malloc" in data:  # files from before the bench named its allocator settings lack it
        settings = ", ".join(f"`{k}={v}`" for k, v in data["malloc"].items())
        lines.append(f"| glibc malloc (a training run's: freed memory kept) | {settings} |")
    return measured_on(data) + "\n".join(lines) + "\n"


def _point(params: dict[str, str]) -> str:
    """``{"muon.lr": "0.02", "muon.weight_decay": "0.1"}`` -> ``lr 0.02, weight_decay 0.1``."""
    return ", ".join(f"{key.split('.')[-1]} {value}" for key, value in params.items())


def pruning(data: dict[str, Any]) -> str:
    """``bench/pruning_vs_grid.py --json``: per setup, every grid point's final loss and how far
    halving took it; then each setup's best points and compute against the grid's."""
    out = [measured_on(data).rstrip("\n"), ""]
    summary = [
        f"| setup | grid: best point, final loss (steps) | {data['halving']}hronous halving: best "
        "point, its grid loss (steps) | compute | trials pruned | gap vs seed noise |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in data["results"].items():
        steps = sorted({int(s) for p in r["points"] for s in p["rungs"]})
        out += [
            f"| {name}: point | grid final loss | "
            + " | ".join(f"rung {s} steps" for s in steps)
            + " | halving |",
            "|---|---|" + "---|" * len(steps) + "---|",
        ]
        for p in r["points"]:
            spelled = _point(p["params"])
            best = p["params"] == r["grid_best"]
            value = f"**{p['grid_value']:.4f}**" if best else f"{p['grid_value']:.4f}"
            reached = [p["rungs"].get(str(s)) for s in steps]
            out.append(
                f"| {spelled} | {value} | "
                + " | ".join("-" if v is None else f"{v:.4f}" for v in reached)
                + f" | {p['state']} |"
            )
        out.append("")
        noise = data["noise"][name]
        verdict = (
            "the same point"
            if r["grid_best"] == r["pruned_best"]
            else (f"{r['gap']:.4f} {'<' if r['gap'] < noise else '>='} {noise}")
        )
        summary.append(
            f"| {name} | {_point(r['grid_best'])}: {r['grid_best_value']:.4f} ({r['grid_steps']}) "
            f"| {_point(r['pruned_best'])}: {r['pruned_best_in_grid']:.4f} ({r['pruned_steps']}) "
            f"| **{100 * r['compute_share']:.0f} %** of the grid's | {r['pruned_trials']} of "
            f"{r['trials']} | {verdict} |"
        )
    return "\n".join(out + summary) + "\n"


def halving_replay(data: dict[str, Any]) -> str:
    """``bench/halving_replay.py --json``: per rung set and (size, setup), the grid's best,
    halving's pick, the gap against the seed noise, and the compute."""
    lines = [
        f"Commit {data['commit']}, {data['date']}; replayed from the grids' records, no training.",
        "",
        "| rungs (steps) | size | setup | grid best: point, final loss | halving's pick: point, "
        "its final loss | gap / seed std | trials at each rung | compute |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["results"]:
        steps = ", ".join(str(round(f * r["num_iterations"])) for f in r["rungs"])
        verdict = (
            "the same point"
            if r["pick"] == r["grid_best"]
            else f"{r['gap']:.4f} / {r['noise']:.4f}"
            + (" (within)" if r["within_noise"] else " (**beyond**)")
        )
        lines.append(
            f"| {steps} | {r['size']} | {r['setup']} | {_point(r['grid_best'])}: "
            f"{r['grid_best_value']:.4f} | {_point(r['pick'])}: {r['pick_value']:.4f} | {verdict} "
            f"| {' → '.join(str(k) for k in r['kept'])} | {100 * r['compute_share']:.0f} % |"
        )
    for grid in data["grids"]:
        steps = sorted({int(k) for t in grid["trials"] for k in t["rungs"]})
        lines += [
            "",
            f"{grid['setup']} at {grid['size']}: each grid point's decay-branch losses and final "
            f"loss (one seed; the best point's seed std {grid['noise']:.4f}; bold: the best at "
            "each budget)",
            "",
            "| point | " + " | ".join(f"{s} steps" for s in steps) + " | final |",
            "|---|" + "---|" * (len(steps) + 1),
        ]
        columns = [[t["rungs"].get(str(s)) for t in grid["trials"]] for s in steps]
        columns.append([t["value"] for t in grid["trials"]])
        best = [min(v for v in column if v is not None) for column in columns]
        order = sorted(range(len(grid["trials"])), key=lambda i: grid["trials"][i]["value"])
        for i in order:
            cells = []
            for column, low in zip(columns, best):
                value = column[i]
                text = "-" if value is None else f"{value:.4f}"
                cells.append(f"**{text}**" if value == low else text)
            lines.append(f"| {_point(grid['trials'][i]['params'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def telemetry_overhead(data: dict[str, Any]) -> str:
    """``bench/telemetry_overhead.py --json``: each preset's step time with telemetry off and
    on at its cadence, and (with ``--runs``) whole trainer runs off and on."""

    def cells(c: dict[str, Any], unit: str) -> str:
        return (
            f"{c['mean_off']:.1f} ± {c['std_off']:.1f} {unit} | {c['mean_on']:.1f} ± "
            f"{c['std_on']:.1f} {unit} | **{100 * c['overhead']:+.2f} %** | "
            f"{100 * c['ratio_mean']:+.2f} ± {100 * c['ratio_std']:.2f} % | {c['welch_p']:.2g}"
        )

    lines = [
        "| what | n | off | on | overhead | paired per round | Welch p |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in data["steps"]:
        lines.append(
            f"| {s['preset']}, wall ms/step, telemetry every {s['every']} steps "
            f"({s['records_per_round']} records, {s['record_ms_per_round']:.0f} ms a round) "
            f"| {s['rounds']} rounds | {cells(s['ms_per_step'], 'ms')} |"
        )
    runs = data.get("runs")
    if runs:
        same = "same" if runs["same_final_val_loss"] else "NOT the same"
        for name, key in (("wall", "wall_s"), ("train_time", "train_time_s")):
            lines.append(
                f"| `{runs['command']}`, {name} ({same} final val loss) | {runs['runs']} runs "
                f"| {cells(runs[key], 's')} |"
            )
    return measured_on(data) + "\n".join(lines) + "\n"


# JSON file name (relative to docs/results/) -> its table's renderer.
RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "decay-branches.json": decay_branches,
    "decay-branches-repeat.json": decay_branches,
    "throughput-study.json": study_throughput,
    "throughput-compare.json": study_throughput,
    "throughput-threads.json": thread_choice,
    "peers-heavyball.json": peers,
    "peers-muon.json": peers,
    "shampoo-floor-freq1.json": shampoo_floor,
    "shampoo-floor-freq10.json": shampoo_floor,
    "shampoo-floor-intel-freq1.json": shampoo_floor,
    "shampoo-floor-intel-freq10.json": shampoo_floor,
    "shampoo-floor-amd-avx2-freq1.json": shampoo_floor,
    "shampoo-floor-amd-avx2-freq10.json": shampoo_floor,
    "pruning-512.json": pruning,
    "halving-replay.json": halving_replay,
    "halving-replay-1024.json": halving_replay,
    "halving-replay-1024-cooldown02.json": halving_replay,
    "halving-replay-1024-cooldown01.json": halving_replay,
    "halving-replay-1024-eta3.json": halving_replay,
    "telemetry-overhead.json": telemetry_overhead,
    "telemetry-overhead-runs.json": telemetry_overhead,
}


def render_page(text: str, folder: Path) -> str:
    """``text`` with every marked table rendered from its JSON in ``folder``.

    ``ValueError`` naming the JSON when no renderer knows it or the file is missing."""

    def table(match: re.Match[str]) -> str:
        name = match.group("json")
        if name not in RENDERERS:
            raise ValueError(f"{name}: no renderer in tools/results_tables.py knows this JSON")
        path = folder / name
        if not path.is_file():
            raise ValueError(f"{path}: missing (run the bench command above the table)")
        return match.group(1) + RENDERERS[name](json.loads(path.read_text())) + match.group(4)

    return TABLE.sub(table, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a table is out of date")
    args = parser.parse_args(argv)
    stale = []
    for page in sorted(RESULTS.rglob("*.md")):
        text = page.read_text()
        wanted = render_page(text, page.parent)
        if wanted == text:
            continue
        stale.append(page)
        if not args.check:
            with atomic_output(page) as tmp:
                tmp.write_text(wanted)
    if args.check and stale:
        print(f"out of date: {', '.join(str(p.relative_to(ROOT)) for p in stale)}; run {__file__}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
