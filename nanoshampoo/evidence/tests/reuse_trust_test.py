"""compare reuses a run only when its own log agrees with what is asked: a hand-edited
manifest, a copied log with another seed, or a negative training time is not reused, and
one line on stderr says why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nanoshampoo.evidence.compare import MANIFEST_SUFFIX, find_reusable

WANTED = {"seed": 0, "optimizer": "adamw", "adamw.lr": 0.01, "num_iterations": 8}


def _run(directory: Path, logged: dict[str, Any], seed: int = 0, time_ms: float = 80.0) -> None:
    """A manifest that matches WANTED and a finished log that says ``logged``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"r{MANIFEST_SUFFIX}").write_text(json.dumps({"config": WANTED, "nproc": 1}))
    records = [
        {
            "kind": "config",
            "run_id": "r",
            "seed": seed,
            "preset": "tiny-adamw",
            "optimizer": "adamw",
            "world_size": 1,
            "config": logged,
        },
        {"kind": "val", "step": 8, "total_steps": 8, "val_loss": 5.0, "train_time_ms": time_ms},
        {
            "kind": "final",
            "step": 8,
            "total_steps": 8,
            "val_loss": 5.0,
            "train_time_ms": time_ms,
            "step_avg_ms": time_ms / 8,
            "peak_memory_mib": 1.0,
        },
    ]
    (directory / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_run_whose_log_agrees_is_reused(tmp_path: Path) -> None:
    _run(tmp_path, dict(WANTED))
    run = find_reusable(tmp_path, WANTED, 1)
    assert run is not None and run.final_val_loss == 5.0


@pytest.mark.parametrize(
    "logged, seed, time_ms, why",
    [
        (
            dict(WANTED, **{"adamw.lr": 0.003}),
            0,
            80.0,
            "its log says adamw.lr 0.003, the manifest 0.01",
        ),
        (dict(WANTED), 1, 80.0, "its log says seed 1, the manifest 0"),
        (dict(WANTED), 0, -5.0, "its log's training time is -5.0 ms"),
    ],
)
def test_a_run_whose_log_disagrees_is_not_reused(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    logged: dict[str, Any],
    seed: int,
    time_ms: float,
    why: str,
) -> None:
    _run(tmp_path, logged, seed, time_ms)
    assert find_reusable(tmp_path, WANTED, 1) is None
    err = capsys.readouterr().err.strip()
    assert err == f"[compare] not reusing {tmp_path / 'r.jsonl'}: {why}; training it again"
