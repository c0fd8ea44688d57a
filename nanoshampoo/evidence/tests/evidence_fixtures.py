"""Writers of synthetic run logs and Chrome traces for the evidence tests."""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TOTAL_STEPS = 100


def curve_for(final_loss: float, train_time_s: float) -> list[tuple[int, float, float]]:
    """A decreasing validation curve (step, loss, time ms) ending at ``final_loss``."""
    steps = [0, 25, 50, 75, TOTAL_STEPS]
    losses = [final_loss + d for d in (6.0, 1.0, 0.3, 0.05, 0.0)]
    return [(s, loss, train_time_s * 1000 * s / TOTAL_STEPS) for s, loss in zip(steps, losses)]


def write_jsonl(
    path: Path, final_loss: float, train_time_s: float, seed: int, optimizer: str = "adam"
) -> Path:
    curve = curve_for(final_loss, train_time_s)
    records: list[dict[str, Any]] = [
        {
            "kind": "config",
            "run_id": path.stem,
            "seed": seed,
            "preset": "tiny",
            "optimizer": optimizer,
            "world_size": 1,
            "config": {"lr": 0.01},
        }
    ]
    for step, loss, time_ms in curve:
        records.append(
            {
                "kind": "train",
                "step": step,
                "total_steps": TOTAL_STEPS,
                "train_loss": loss + 0.1,
                "train_time_ms": time_ms,
                "step_avg_ms": time_ms / max(step, 1),
                "tokens_per_s": 1.0,
            }
        )
        records.append(
            {
                "kind": "val",
                "step": step,
                "total_steps": TOTAL_STEPS,
                "val_loss": loss,
                "train_time_ms": time_ms,
                "step_avg_ms": time_ms / max(step, 1),
            }
        )
    records.append(
        {
            "kind": "final",
            "step": TOTAL_STEPS,
            "total_steps": TOTAL_STEPS,
            "val_loss": final_loss,
            "train_time_ms": train_time_s * 1000,
            "step_avg_ms": train_time_s * 1000 / TOTAL_STEPS,
            "peak_memory_mib": 12.5,
        }
    )
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_txt(path: Path, final_loss: float, train_time_s: float) -> Path:
    lines = [
        "import torch",
        'print0(f"step:{step}/{train_steps} val_loss:{val_loss:.4f} train_time:{t:.0f}ms '
        'step_avg:{a:.2f}ms")',
        "=" * 40,
    ]
    for step, loss, time_ms in curve_for(final_loss, train_time_s):
        avg = time_ms / max(step, 1)
        lines.append(
            f"step:{step}/{TOTAL_STEPS} train_loss:{loss + 0.1:.4f} train_time:{time_ms:.0f}ms "
            f"step_avg:{avg:.2f}ms"
        )
        lines.append(
            f"step:{step}/{TOTAL_STEPS} val_loss:{loss:.4f} train_time:{time_ms:.0f}ms "
            f"step_avg:{avg:.2f}ms"
        )
    lines.append("peak memory allocated: 321 MiB reserved: 400 MiB")
    path.write_text("\n".join(lines) + "\n")
    return path


def write_group(
    directory: Path, losses: Sequence[float], times: Sequence[float], fmt: str = "jsonl"
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for seed, (loss, time_s) in enumerate(zip(losses, times)):
        if fmt == "jsonl":
            write_jsonl(directory / f"run_seed{seed}.jsonl", loss, time_s, seed)
        else:
            write_txt(directory / f"run_seed{seed}.txt", loss, time_s)
    return directory


def x_event(
    name: str, start: float, end: float, tid: int, cat: str = "cpu_op", pid: int = 1
) -> dict[str, Any]:
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": pid,
        "tid": tid,
        "ts": start,
        "dur": end - start,
    }


def write_trace(
    path: Path,
    events: list[dict[str, Any]],
    rank: int | None = None,
    thread_names: dict[int, str] | None = None,
) -> Path:
    meta = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": name}}
        for tid, name in (thread_names or {}).items()
    ]
    trace: dict[str, Any] = {"traceEvents": meta + events}
    if rank is not None:
        trace["distributedInfo"] = {"backend": "gloo", "rank": rank, "world_size": 2}
    text = json.dumps(trace)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path
