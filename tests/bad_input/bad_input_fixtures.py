"""Shared pieces of the bad-input suite: disk snapshots, one-line error checks, run logs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

EXIT_USER_ERROR = 2


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``root``: relative path -> (sha256 of its bytes, size). Directories too."""
    state: dict[str, tuple[str, int]] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_file():
            data = path.read_bytes()
            state[rel] = (hashlib.sha256(data).hexdigest(), len(data))
        elif path.is_dir():
            state[rel] = ("dir", 0)
        else:
            state[rel] = ("special", 0)
    return state


def one_error_line(capsys: pytest.CaptureFixture[str], prog: str, *names: str) -> str:
    """The single stderr line ``PROG: error: ...``; asserts it names each of ``names``."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one error line, got: {err!r}"
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    assert "Traceback" not in err
    for name in names:
        assert name in lines[0], f"{name!r} not in {lines[0]!r}"
    return lines[0]


def write_run_log(
    path: Path, total_steps: int = 100, final_loss: float = 3.5, seed: int = 0
) -> Path:
    """A finished run's JSONL (config, validations every quarter, final)."""
    records: list[dict[str, Any]] = [
        {
            "kind": "config",
            "run_id": path.stem,
            "seed": seed,
            "preset": "tiny",
            "optimizer": "adamw",
            "world_size": 1,
            "config": {"num_iterations": total_steps},
        }
    ]
    for k in range(5):
        step = total_steps * k // 4
        records.append(
            {
                "kind": "val",
                "step": step,
                "total_steps": total_steps,
                "val_loss": final_loss + (4 - k) * 0.5 + 0.01 * seed,
                "train_time_ms": 10.0 * step,
                "step_avg_ms": 10.0,
            }
        )
    records.append(
        {
            "kind": "final",
            "step": total_steps,
            "total_steps": total_steps,
            "val_loss": records[-1]["val_loss"],
            "train_time_ms": 10.0 * total_steps,
            "step_avg_ms": 10.0,
            "peak_memory_mib": 1.0,
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_run_group(directory: Path, runs: int = 2, total_steps: int = 100) -> Path:
    for seed in range(runs):
        write_run_log(directory / f"r_seed{seed}.jsonl", total_steps, seed=seed)
    return directory


def write_trace(path: Path, events: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def x_event(name: str, ts: Any, dur: Any, tid: int = 1) -> dict[str, Any]:
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


VOCAB = 64


def write_token_shards(root: Path) -> dict[str, str]:
    """A small train and val shard of a learnable stream; the trainer's shard flags for them."""
    from nanoshampoo.data.shards import write_shard  # noqa: PLC0415 - torch-free import above

    root.mkdir(parents=True, exist_ok=True)
    stream = (5 * np.arange(20_000) + 3) % VOCAB
    write_shard(root / "syn_train_000001.bin", stream)
    write_shard(root / "syn_val_000000.bin", stream[:4_000])
    return {"train": str(root / "syn_train_*.bin"), "val": str(root / "syn_val_*.bin")}


def train_argv(shards: dict[str, str], out_dir: Path, **flags: Any) -> list[str]:
    """``T``: a 2-step AdamW run of the tiny model on ``shards`` with a final checkpoint."""
    fields: dict[str, Any] = dict(
        model="tiny",
        dataset="shards",
        vocab_size=VOCAB,
        seq_len=32,
        batch_size=4,
        num_iterations=2,
        val_every=0,
        val_tokens=512,
        progress="false",
        out_dir=out_dir,
        run_id="R",
        autocast="off",
        threads=1,
        optimizer="adamw",
        train_files=shards["train"],
        val_files=shards["val"],
        save_final_checkpoint="true",
    )
    fields.update(flags)
    argv: list[str] = []
    for name, value in fields.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    return argv
