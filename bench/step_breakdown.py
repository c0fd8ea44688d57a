"""Benchmark: where a training step's time goes, from a torch.profiler trace of real steps.

Each preset trains in this process through the trainer itself (``Trainer(config_from_args(
...))``, the command line's parsing, the tuned malloc of ``python -m nanoshampoo.train``),
with ``--profile-steps`` over a window of steps after warm-up, ``--val-every 0
--save-final-checkpoint false`` and the ``--train-args`` given. Before it runs, the script
labels two of the trainer's calls on that one instance (``record_function``): the data
loader's ``next_batch`` (``nanoshampoo::data``) and the model's forward
(``nanoshampoo::forward``). The other phases carry torch's own labels: every backward node
runs on the main thread as ``autograd::engine::evaluate_function: <Node>``, every optimizer
step as ``Optimizer.step#<Class>.step`` (``zero_grad`` as ``Optimizer.zero_grad#...``).

Per profiled step (``ProfilerStep#i``, from one step's start to the next), on the main thread,
in milliseconds, averaged over the window:

* data, forward, backward, optimizer step, zero_grad: the union of their labelled events;
* forward split: attention (outermost ``aten::scaled_dot_product_attention``), the blocks'
  linear layers (outermost ``aten::linear`` but the last), the head (the last one), the logit
  softcap and the loss (every op after the head: ``(B, T, V)`` elementwise work and the
  cross-entropy), and the rest (embedding, norms, rotary, relu², autocast's casts);
* backward split, in the backward's order: the loss and softcap (the nodes before the first
  linear node), the head (that first linear node: ``Mm``, ``Addmm`` or ``Bmm``, both matmuls
  of a linear's gradient), attention (``ScaledDotProduct...Backward`` nodes), the blocks'
  linear layers (the other linear nodes) and the rest;
* rest: the step minus every phase above: the trainer's Python between them, the finiteness
  check of the loss and gradients, the lr schedule, logging and the progress bar.

The profiler's own cost per op inflates ops that are many and small (the optimizers' foreach
kernels, Python-heavy code) more than big matmuls: the shares are of a profiled step, whose
total (printed next to the step time of the same run's unprofiled steps) is longer.

Usage:
    python bench/step_breakdown.py [--presets tiny-adamw,tiny-shampoo] [--num-iterations 40]
        [--profile-steps 30-39] [--train-args "--threads 1"] [--json OUT]

Measured figures and their command: ``docs/results/mfu.md`` ("Where the step goes").
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shlex
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from nanoshampoo.io_utils import atomic_output
from nanoshampoo.train.allocator import tuned_environment

DATA, FORWARD = "nanoshampoo::data", "nanoshampoo::forward"
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "
PHASES = ("data", "forward", "backward", "optimizer step", "zero_grad", "rest")
PARTS = ("attention", "block linears", "head", "softcap + loss", "other")
SPLITS = tuple(f"{phase}: {part}" for phase in ("forward", "backward") for part in PARTS)
_LINEAR_NODES = ("MmBackward", "AddmmBackward", "BmmBackward")

Interval = tuple[float, float]


def union_ms(intervals: Iterable[Interval]) -> float:
    """Total length of the union of ``(start, end)`` intervals in microseconds, in ms."""
    total, reach = 0.0, -float("inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1000


def outermost(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events not nested in another one of ``events`` (same thread, sorted by start)."""
    kept: list[dict[str, Any]] = []
    reach = -float("inf")
    for event in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if event["ts"] >= reach:
            kept.append(event)
            reach = event["ts"] + event["dur"]
    return kept


def _within(events: Sequence[dict[str, Any]], span: dict[str, Any]) -> list[dict[str, Any]]:
    start, end = span["ts"], span["ts"] + span["dur"]
    return [e for e in events if start <= e["ts"] and e["ts"] + e["dur"] <= end]


def _spans(events: Sequence[dict[str, Any]]) -> list[Interval]:
    return [(e["ts"], e["ts"] + e["dur"]) for e in events]


def _forward_parts(ops: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The forward's outermost ops by part (``PARTS`` but "other"); ``ops``: sorted by start."""
    linears = [e for e in ops if e["name"] == "aten::linear"]
    head_end = linears[-1]["ts"] + linears[-1]["dur"] if linears else float("inf")
    return {
        "attention": [e for e in ops if e["name"] == "aten::scaled_dot_product_attention"],
        "block linears": linears[:-1],
        "head": linears[-1:],
        "softcap + loss": [e for e in ops if e["ts"] >= head_end],
    }


def _backward_parts(nodes: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The backward's outermost nodes by part (``PARTS`` but "other"), sorted by start."""
    names = [e["name"].removeprefix(BACKWARD_PREFIX) for e in nodes]
    linear = [i for i, name in enumerate(names) if name.startswith(_LINEAR_NODES)]
    # No linear node (a compiled model's backward is one node): nothing marks the head.
    head = linear[0] if linear else 0
    return {
        "attention": [e for e, name in zip(nodes, names) if "ScaledDotProduct" in name],
        "block linears": [nodes[i] for i in linear[1:]],
        "head": [nodes[head]] if linear else [],
        "softcap + loss": list(nodes[:head]),
    }


def _split(phase: str, total: float, parts: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    out = {f"{phase}: {part}": union_ms(_spans(found)) for part, found in parts.items()}
    out[f"{phase}: other"] = total - sum(out.values())
    return out


def step_phases(events: Sequence[dict[str, Any]], step: dict[str, Any]) -> dict[str, float]:
    """Milliseconds of one ``ProfilerStep#i`` event's phases (``PHASES`` and ``SPLITS``).

    ``events``: the complete (``"ph": "X"``) events of the step's thread.
    """
    inside = [e for e in _within(events, step) if e is not step]
    named = {
        "data": [e for e in inside if e["name"] == DATA],
        "forward": [e for e in inside if e["name"] == FORWARD],
        "backward": [e for e in inside if e["name"].startswith(BACKWARD_PREFIX)],
        "optimizer step": [e for e in inside if e["name"].startswith("Optimizer.step#")],
        "zero_grad": [e for e in inside if e["name"].startswith("Optimizer.zero_grad#")],
    }
    out = {phase: union_ms(_spans(found)) for phase, found in named.items()}
    out["rest"] = step["dur"] / 1000 - sum(out.values())
    forward_ops = outermost(
        [e for span in named["forward"] for e in _within(inside, span) if e is not span]
    )
    out.update(_split("forward", out["forward"], _forward_parts(forward_ops)))
    out.update(_split("backward", out["backward"], _backward_parts(outermost(named["backward"]))))
    return out


def trace_breakdown(trace: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """``(steps, mean ms per phase)`` over the ``ProfilerStep#i`` events of a Chrome trace."""
    complete = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in complete if e["name"].startswith("ProfilerStep#")]
    if not steps:
        raise ValueError("the trace has no ProfilerStep#i events (no profiled step)")
    thread = (steps[0]["pid"], steps[0]["tid"])
    same = [e for e in complete if (e["pid"], e["tid"]) == thread]
    per_step = [step_phases(same, step) for step in steps]
    names = [*PHASES, *SPLITS]
    return len(steps), {name: sum(p[name] for p in per_step) / len(steps) for name in names}


class _Labelled(nn.Module):
    """``module`` called inside ``record_function(label)`` (train/eval reach it as a child)."""

    def __init__(self, module: nn.Module, label: str) -> None:
        super().__init__()
        self.inner = module
        self.label = label

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with record_function(self.label):
            return self.inner(*args, **kwargs)


def _labelled_call(function: Callable[[], Any], label: str) -> Callable[[], Any]:
    def call() -> Any:
        with record_function(label):
            return function()

    return call


def profile_preset(
    preset: str, num_iterations: int, steps: range, train_args: Sequence[str], work_dir: Path
) -> dict[str, Any]:
    """Train ``preset`` with ``steps`` profiled; its breakdown and unprofiled step time."""
    from nanoshampoo.train.cli import config_from_args
    from nanoshampoo.train.trainer import Trainer

    out = work_dir / preset
    argv = [
        "--preset",
        preset,
        "--num-iterations",
        str(num_iterations),
        "--val-every",
        "0",
        "--save-final-checkpoint",
        "false",
        "--log-every",
        "1",
        "--progress",
        "false",
        "--out-dir",
        str(out),
        "--run-id",
        preset,
        "--profile-dir",
        str(out / "profile"),
        "--profile-steps",
        ",".join(map(str, steps)),
        *train_args,
    ]
    trainer = Trainer(config_from_args(argv, refuse_unread_tables=True))
    trainer.loader.next_batch = _labelled_call(trainer.loader.next_batch, DATA)  # type: ignore[method-assign]
    trainer.forward = _Labelled(trainer.forward, FORWARD)
    trainer.run()
    with gzip.open(out / "profile" / "rank0.json.gz", "rt") as f:
        count, phases = trace_breakdown(json.load(f))
    records = [json.loads(line) for line in (out / f"{preset}.jsonl").read_text().splitlines()]
    times = {r["step"]: r["train_time_ms"] for r in records if r["kind"] == "train"}
    # Unprofiled steps after warm-up: those before the window, from its first quarter on.
    first, last = steps[0] // 4, steps[0]
    unprofiled = (times[last] - times[first]) / (last - first)
    return {
        "preset": preset,
        "steps": count,
        "unprofiled_step_ms": unprofiled,
        "profiled_step_ms": sum(phases[p] for p in PHASES),
        "ms": phases,
        "threads": torch.get_num_threads(),
    }


def format_table(results: Sequence[dict[str, Any]]) -> str:
    header = "| phase | " + " | ".join(f"{r['preset']} ms | %" for r in results) + " |"
    rule = "|---|" + "---:|---:|" * len(results)
    lines = [header, rule]
    for name in (*PHASES, *SPLITS):
        cells = [
            f"{r['ms'][name]:.1f} | {100 * r['ms'][name] / r['profiled_step_ms']:.1f}"
            for r in results
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(
        "| profiled step | "
        + " | ".join(f"{r['profiled_step_ms']:.1f} | 100" for r in results)
        + " |"
    )
    lines.append(
        "| unprofiled step (same run) | "
        + " | ".join(f"{r['unprofiled_step_ms']:.1f} | " for r in results)
        + " |"
    )
    return "\n".join(lines)


def _parse_steps(text: str) -> range:
    first, _, last = text.partition("-")
    steps = range(int(first), int(last or first) + 1)
    if not steps or steps[0] < 4:
        raise ValueError(
            f"--profile-steps {text}: a window FIRST-LAST with FIRST >= 4 (the "
            "steps before it give the unprofiled step time)"
        )
    return steps


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny-adamw,tiny-shampoo")
    parser.add_argument("--num-iterations", type=int, default=40)
    parser.add_argument("--profile-steps", default="30-39", help="FIRST-LAST, FIRST >= 4")
    parser.add_argument("--train-args", default="--threads 1")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if argv is None:  # from the command line (not a test calling main)
        _reexec_with_tuned_malloc()
    steps = _parse_steps(args.profile_steps)
    if steps[-1] >= args.num_iterations:
        raise ValueError(
            f"--profile-steps {args.profile_steps}: beyond --num-iterations {args.num_iterations}"
        )
    with tempfile.TemporaryDirectory() as work:
        results = [
            profile_preset(p, args.num_iterations, steps, shlex.split(args.train_args), Path(work))
            for p in args.presets.split(",")
        ]
    print(
        f"load average {os.getloadavg()[0]:.2f}; steps {args.profile_steps} profiled; "
        f"train args {args.train_args!r}"
    )
    print(format_table(results))
    if args.json:
        with atomic_output(Path(args.json)) as tmp:
            tmp.write_text(json.dumps(results, indent=2))


def _reexec_with_tuned_malloc() -> None:
    """Run as ``python -m nanoshampoo.train`` runs: under its tuned glibc malloc settings."""
    environment = tuned_environment(os.environ, platform.libc_ver()[0])
    if environment is not None:
        os.execve(sys.executable, [sys.executable, *sys.argv], environment)


if __name__ == "__main__":
    main()
