"""Helpers of ``bench/gpu_check.sh``: the environment record, synthetic shards, the summary.

Subcommands:

* ``environment --json OUT``: where the check ran (python, torch, CUDA, GPU, CPU model, cores).
* ``synthetic-shards --out-dir DIR --train-tokens N --val-tokens M [--vocab 50257]``: one
  training and one validation shard of uniform random tokens in ``[0, vocab)`` in the speedrun
  format (``fineweb_train_000001.bin``, ``fineweb_val_000000.bin``), seed 0: the
  ``gpt2-124m-shampoo`` preset's data is not on a GPU machine, and its step time does not
  depend on which tokens it reads.
* ``summarize --work DIR --out-dir OUT``: reads the step table the script wrote
  (``DIR/steps.tsv``: name, exit status, wall seconds, time limit) and each step's outputs,
  writes ``OUT/summary.json``, ``OUT/summary.md`` and ``OUT/logs.tar.gz`` (step logs, bench
  JSONs, run JSONLs, the trace figures, the test report). Three files, so the out dir stays
  within what a device run returns (8 files).

A step passes when its command exited 0; 124/137 is a timeout (``timeout`` killed it); a step
that got no time left in the script's budget is ``skipped``. Figures come from the files a step
wrote (the bench ``--json``, the run ``.jsonl``, the trace ``--json``, the pytest junit XML),
never from its console text, except the bench tables copied verbatim into ``summary.md``.

Example:
    $ python bench/gpu_check_tools.py synthetic-shards --out-dir /tmp/s --train-tokens 4096 \\
        --val-tokens 1024
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nanoshampoo.data.shards import write_shard
from nanoshampoo.io_utils import atomic_output

TIMEOUT_CODES = (124, 137)
# Steps after which a run's step times count as steady (compilation and warm-up come first).
STEADY_AFTER_STEP = 5
LOG_TAIL_LINES = 25
# Work-dir entries left out of logs.tar.gz: large and reproducible (shards, Chrome traces).
ARCHIVE_SKIPPED = ("shards", "profile")


def cpu_model_name() -> str:
    try:
        listing = subprocess.run(
            ["lscpu"], capture_output=True, text=True, check=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or "unknown"
    for line in listing.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def environment() -> dict[str, Any]:
    import torch  # only this subcommand needs torch

    record: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu_model_name(),
        "cpu_cores": os.cpu_count(),
        "cuda_available": torch.cuda.is_available(),
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        record.update(
            gpu=props.name,
            gpu_count=torch.cuda.device_count(),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            compute_capability=f"{props.major}.{props.minor}",
            bf16_supported=torch.cuda.is_bf16_supported(),
        )
    return record


def write_synthetic_shards(
    out_dir: Path, train_tokens: int, val_tokens: int, vocab: int
) -> list[Path]:
    """Random-token train and val shards; returns their paths."""
    rng = np.random.default_rng(0)
    paths = [out_dir / "fineweb_train_000001.bin", out_dir / "fineweb_val_000000.bin"]
    for path, count in zip(paths, (train_tokens, val_tokens), strict=True):
        write_shard(path, rng.integers(0, vocab, size=count, dtype=np.int64))
    return paths


def read_steps(work: Path) -> list[dict[str, Any]]:
    """Rows of ``steps.tsv``: name, exit status (or ``skipped``), wall seconds, limit seconds."""
    steps = []
    for line in (work / "steps.tsv").read_text().splitlines():
        name, code, seconds, limit = line.split("\t")
        if code == "skipped":
            status, rc = "skipped", None
        else:
            rc = int(code)
            status = "pass" if rc == 0 else "timeout" if rc in TIMEOUT_CODES else "fail"
        steps.append(
            {
                "name": name,
                "status": status,
                "rc": rc,
                "seconds": float(seconds),
                "limit_s": int(limit),
            }
        )
    return steps


def junit_figures(path: Path) -> dict[str, Any]:
    """Counts of a pytest junit XML report."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    totals = {
        key: sum(int(s.get(key, 0)) for s in suites)
        for key in ("tests", "failures", "errors", "skipped")
    }
    totals["passed"] = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for suite in suites
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {**totals, "failed_tests": failed}


def bench_figures(path: Path) -> dict[str, Any]:
    """Per Shampoo config: mean/median/max ms, x AdamW, max/median and the breakdown."""
    record = json.loads(path.read_text())
    configs = {}
    for row in record["shampoo"]:
        configs[row["name"]] = {
            "median_ms": round(row["median_ms"], 2),
            "mean_ms": round(row["mean_ms"], 2),
            "max_over_median": round(row["max_over_median"], 2),
            "x_adamw": round(row["x_adamw"], 2),
            "state_bytes_per_param_byte": round(row["state_bytes_per_param_byte"], 2),
            "breakdown_ms": {k: round(v, 2) for k, v in row["phase_ms"].items()},
        }
    return {"adamw_mean_ms": round(record["adamw"]["mean_ms"], 3), "configs": configs}


def run_figures(path: Path) -> dict[str, Any]:
    """Final val loss, steady step time (median and mean of steps after the warm-up), peak memory.

    Step times are differences of consecutive ``train`` records' ``train_time_ms``, so the run
    must log every step (``--log-every 1``).
    """
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["step"])
    step_ms = [
        b["train_time_ms"] - a["train_time_ms"]
        for a, b in zip(train, train[1:], strict=False)
        if b["step"] == a["step"] + 1 and a["step"] >= STEADY_AFTER_STEP
    ]
    figures: dict[str, Any] = {"steps_logged": len(train)}
    if step_ms:
        figures.update(
            steady_median_step_ms=round(statistics.median(step_ms), 2),
            steady_mean_step_ms=round(statistics.fmean(step_ms), 2),
            steady_max_step_ms=round(max(step_ms), 2),
        )
    if train:
        figures["first_step_ms"] = round(train[0]["train_time_ms"], 1)
        figures["median_tokens_per_s"] = round(statistics.median(r["tokens_per_s"] for r in train))
    for record in records:
        if record["kind"] == "final":
            figures.update(
                final_val_loss=record["val_loss"],
                step_avg_ms=round(record["step_avg_ms"], 2),
                peak_memory_mib=round(record["peak_memory_mib"]),
            )
        elif record["kind"] == "diverged":
            figures["diverged"] = record["reason"]
    return figures


def trace_figures(path: Path) -> dict[str, Any]:
    """Per rank: the profiled window, computation and communication time, GPU busy share."""
    ranks = []
    for stats in json.loads(path.read_text()):
        window = stats["window_ms"]
        ranks.append(
            {
                "rank": stats["rank"],
                "device": stats["device"],
                "steps": stats["steps"],
                "window_ms": round(window, 2),
                "computation_ms": round(stats["computation_ms"], 2),
                "communication_ms": round(stats["communication_ms"], 2),
                "busy_pct": round(100 * stats["computation_ms"] / window, 1) if window else None,
            }
        )
    return {"ranks": ranks}


# Step name -> (file in the work dir it leaves, the reader of its figures).
FIGURE_SOURCES = {
    "environment": ("environment.json", lambda p: json.loads(p.read_text())),
    "cuda_tests": ("cuda_tests.xml", junit_figures),
    "bench_fp32": ("bench_fp32.json", bench_figures),
    "bench_bf16": ("bench_bf16.json", bench_figures),
    "train_tiny_shampoo": ("runs/tiny-shampoo.jsonl", run_figures),
    "train_tiny_adamw": ("runs/tiny-adamw.jsonl", run_figures),
    "train_gpt2_124m_shampoo": ("runs/gpt2-124m-shampoo.jsonl", run_figures),
    "train_gpt2_124m_fsdp2": ("runs/gpt2-124m-fsdp2.jsonl", run_figures),
    "trace": ("trace.json", trace_figures),
}
# Console output copied verbatim into summary.md: the benchmark tables.
VERBATIM_STEPS = ("bench_fp32", "bench_bf16")


def step_figures(work: Path, name: str) -> dict[str, Any]:
    """The step's figures, or ``{"figures_error": ...}`` when its output is missing or malformed."""
    if name not in FIGURE_SOURCES:
        return {}
    relative, reader = FIGURE_SOURCES[name]
    path = work / relative
    if not path.is_file():
        return {"figures_error": f"{relative} was not written"}
    try:
        return reader(path)
    except (ValueError, KeyError, TypeError, ET.ParseError) as exc:
        return {"figures_error": f"{relative}: {type(exc).__name__}: {exc}"}


def log_tail(work: Path, name: str, lines: int = LOG_TAIL_LINES) -> str:
    path = work / "logs" / f"{name}.log"
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def format_markdown(summary: dict[str, Any], work: Path) -> str:
    head = summary["environment"] or {}
    where = ", ".join(
        f"{k} {head[k]}" for k in ("gpu", "torch", "cuda", "python", "cpu") if head.get(k)
    )
    lines = [
        f"# GPU check ({summary['device']})",
        "",
        where or "environment not recorded",
        "",
        f"Total {summary['total_seconds']:.0f} s; {summary['passed']}/{len(summary['steps'])} "
        "steps passed.",
        "",
        "| step | status | seconds | limit s |",
        "|---|---|---|---|",
    ]
    for step in summary["steps"]:
        lines.append(
            f"| {step['name']} | {step['status']} | {step['seconds']:.1f} | {step['limit_s']} |"
        )
    for step in summary["steps"]:
        lines += ["", f"## {step['name']}: {step['status']}"]
        if step["name"] in VERBATIM_STEPS and step["status"] == "pass":
            log = (work / "logs" / f"{step['name']}.log").read_text(errors="replace").strip()
            lines += ["", "```", log, "```"]
        elif step["figures"]:
            lines += ["", "```json", json.dumps(step["figures"], indent=1), "```"]
        if step["status"] != "pass":
            lines += ["", "Last lines of its log:", "", "```", log_tail(work, step["name"]), "```"]
    return "\n".join(lines) + "\n"


def summarize(work: Path, out_dir: Path, device: str, total_seconds: float) -> dict[str, Any]:
    """Write summary.json, summary.md and logs.tar.gz into ``out_dir``; return the summary."""
    steps = read_steps(work)
    for step in steps:
        step["figures"] = step_figures(work, step["name"])
    environment_step = next((s for s in steps if s["name"] == "environment"), None)
    summary = {
        "device": device,
        "total_seconds": total_seconds,
        "passed": sum(s["status"] == "pass" for s in steps),
        "environment": environment_step["figures"] if environment_step else None,
        "steps": steps,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_output(out_dir / "summary.json") as tmp:
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
    with atomic_output(out_dir / "summary.md") as tmp:
        tmp.write_text(format_markdown(summary, work))
    with atomic_output(out_dir / "logs.tar.gz", suffix=".tar.gz") as tmp:
        with tarfile.open(tmp, "w:gz") as archive:
            for name in sorted(os.listdir(work)):
                if name not in ARCHIVE_SKIPPED:
                    archive.add(work / name, arcname=f"gpu_check/{name}", filter=_archive_filter)
    return summary


def _archive_filter(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    # The source that ran (runs/sources/, or a .txt log's head) is the tree in git; keep the .jsonl.
    run_file = info.name.startswith("gpu_check/runs/")
    if run_file and (info.name.endswith(".txt") or info.name.startswith("gpu_check/runs/sources")):
        return None
    return info


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    env = commands.add_parser("environment", help="record where the check runs")
    env.add_argument("--json", type=Path, required=True)
    shards = commands.add_parser("synthetic-shards", help="random-token speedrun shards")
    shards.add_argument("--out-dir", type=Path, required=True)
    shards.add_argument("--train-tokens", type=int, required=True)
    shards.add_argument("--val-tokens", type=int, required=True)
    shards.add_argument("--vocab", type=int, default=50257, help="tokens are drawn from [0, vocab)")
    summary = commands.add_parser("summarize", help="write summary.md, summary.json, logs.tar.gz")
    summary.add_argument("--work", type=Path, required=True)
    summary.add_argument("--out-dir", type=Path, required=True)
    summary.add_argument("--device", required=True)
    summary.add_argument("--total-seconds", type=float, required=True)
    args = parser.parse_args(argv)

    if args.command == "environment":
        record = environment()
        print(json.dumps(record, indent=1))
        with atomic_output(args.json) as tmp:
            tmp.write_text(json.dumps(record, indent=2) + "\n")
    elif args.command == "synthetic-shards":
        if args.train_tokens < 1 or args.val_tokens < 1 or not 1 <= args.vocab <= 2**16:
            parser.error("--train-tokens and --val-tokens must be >= 1, --vocab in [1, 65536]")
        for path in write_synthetic_shards(
            args.out_dir, args.train_tokens, args.val_tokens, args.vocab
        ):
            print(f"wrote {path} ({path.stat().st_size} bytes)")
    else:
        result = summarize(args.work, args.out_dir, args.device, args.total_seconds)
        print(
            f"{result['passed']}/{len(result['steps'])} steps passed; wrote "
            f"{args.out_dir / 'summary.md'}, summary.json, logs.tar.gz"
        )
        return 0 if result["passed"] == len(result["steps"]) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
