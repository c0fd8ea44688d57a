"""A stand-in for ``python -m nanoshampoo.train`` in the tuning tests: a subprocess that writes
the trainer's JSONL records (config, decay branches, final or diverged) for a loss known in
closed form (``tune_fixtures.fake_loss``), taking ``FAKE_STEP_S`` seconds per step.

Flags, as the trainer spells them: ``--run-id``, ``--out-dir``, ``--seed``, ``--num-iterations``
(default 8), ``--decay-branches F,...``, ``--muon.lr``, ``--muon.weight-decay``,
``--custom.matrix-kwargs JSON`` (its ``lr`` is the lr). An lr >= 1 diverges at step 1 (exit 3);
``FAKE_CRASH=1`` exits with status 1 after the first step, without an ending record.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tune_fixtures import FAKE_DEFAULTS, fake_loss, fake_resolve  # noqa: E402


def main(argv: list[str]) -> int:
    pairs = dict(zip(argv[::2], argv[1::2]))
    run_id, out_dir = pairs.pop("--run-id"), Path(pairs.pop("--out-dir"))
    flags = [part for pair in pairs.items() for part in pair]
    config = fake_resolve(flags)
    steps, seed = int(config["num_iterations"]), int(config["seed"])
    lr = float(
        config["custom.matrix_kwargs"].get("lr", FAKE_DEFAULTS["muon.lr"])
        if "--custom.matrix-kwargs" in flags
        else config["muon.lr"]
    )
    wd = float(config["muon.weight_decay"])
    branches = {round(f * steps): f for f in config["decay_branches"]}
    step_s = float(os.environ.get("FAKE_STEP_S", "0"))
    log = (out_dir / f"{run_id}.jsonl").open("x", encoding="utf-8")

    def write(record: dict[str, object]) -> None:
        log.write(json.dumps(record) + "\n")
        log.flush()

    write({"kind": "config", "run_id": run_id, "seed": seed, "world_size": 1, "config": config})
    for step in range(1, steps + 1):
        time.sleep(step_s)
        if lr >= 1:
            write(
                {
                    "kind": "diverged",
                    "step": step,
                    "total_steps": steps,
                    "reason": "nan loss",
                    "train_time_ms": 1.0,
                }
            )
            return 3
        if os.environ.get("FAKE_CRASH") == "1":
            return 1
        if step in branches:
            fraction = branches[step]
            write(
                {
                    "kind": "branch",
                    "fraction": fraction,
                    "steps": step,
                    "fork_step": step // 2,
                    "val_loss": fake_loss(lr, wd, seed, fraction),
                    "train_time_ms": 1.0 * step,
                    "tokens": 64 * step,
                }
            )
    write(
        {
            "kind": "final",
            "step": steps,
            "total_steps": steps,
            "val_loss": fake_loss(lr, wd, seed),
            "train_time_ms": 10.0 * steps,
            "step_avg_ms": 10.0,
            "peak_memory_mib": 1.0,
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
