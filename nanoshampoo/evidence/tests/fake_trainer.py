"""A stand-in for ``python -m nanoshampoo.train`` in the tuning tests: a subprocess that writes
the trainer's JSONL records (config, decay branches, final or diverged) for a loss known in
closed form (``tune_fixtures.fake_loss``), taking ``FAKE_STEP_S`` seconds per step.

Flags, as the trainer spells them: ``--run-id``, ``--out-dir``, ``--seed``, ``--num-iterations``
(default 8), ``--cooldown-frac`` (0.5), ``--decay-branches F,...``, ``--muon.lr``,
``--muon.weight-decay``, ``--custom.matrix-kwargs JSON`` (its ``lr`` is the lr),
``--pause-at-step S`` and ``--resume RUN.ckpt/step_S``. A branch is recorded when the run reaches
its fork (the first step where the two linear cooldowns differ, as the trainer's); a pause makes
the checkpoint directory ``RUN.ckpt/step_S`` and a ``paused`` record; a resume appends to the
run's log from step S, making only the branches the log lacks. An lr >= 1 diverges at step 1
(exit 3); ``FAKE_CRASH=1`` exits with status 1 after the first step, without an ending record.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tune_fixtures import FAKE_DEFAULTS, fake_loss, fake_resolve  # noqa: E402


def multiplier(step: int, total: int, cooldown: float) -> float:
    """The trainer's schedule without warmup: 1, then a linear cooldown to 0 at ``total``."""
    x = step / total
    return 1.0 if cooldown == 0 or x < 1 - cooldown else (1 - x) / cooldown


def fork(steps: int, total: int, cooldown: float) -> int:
    """Where the branch of ``steps`` leaves the run of ``total``: the first step whose
    multipliers differ (``steps`` when none does)."""
    return next(
        (
            t
            for t in range(steps)
            if multiplier(t, steps, cooldown) != multiplier(t, total, cooldown)
        ),
        steps,
    )


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
    cooldown, pause = float(config["cooldown_frac"]), int(config["pause_at_step"])
    start = int(Path(config["resume"]).name[len("step_") :]) if config["resume"] else 0
    path = out_dir / f"{run_id}.jsonl"
    made = (
        {
            r["steps"]
            for r in map(json.loads, path.read_text().splitlines())
            if r["kind"] == "branch"
        }
        if start
        else set()
    )
    branches = {
        round(f * steps): (f, fork(round(f * steps), steps, cooldown))
        for f in config["decay_branches"]
        if round(f * steps) not in made
    }
    step_s = float(os.environ.get("FAKE_STEP_S", "0"))
    log = path.open("a" if start else "x", encoding="utf-8")

    def write(record: dict[str, object]) -> None:
        log.write(json.dumps(record) + "\n")
        log.flush()

    write({"kind": "config", "run_id": run_id, "seed": seed, "world_size": 1, "config": config})
    for step in range(start, steps + 1):
        for length, (fraction, at) in sorted(branches.items()):
            if at == step:
                write(
                    {
                        "kind": "branch",
                        "fraction": fraction,
                        "steps": length,
                        "fork_step": at,
                        "val_loss": fake_loss(lr, wd, seed, fraction),
                        "train_time_ms": 1.0 * length,
                        "tokens": 64 * length,
                    }
                )
        if pause and step == pause:
            checkpoint = out_dir / f"{run_id}.ckpt" / f"step_{step:06d}"
            checkpoint.mkdir(parents=True)
            write(
                {
                    "kind": "paused",
                    "step": step,
                    "total_steps": steps,
                    "checkpoint": str(checkpoint),
                }
            )
            return 0
        if step == steps:
            break
        time.sleep(step_s)
        if lr >= 1:
            write(
                {
                    "kind": "diverged",
                    "step": step + 1,
                    "total_steps": steps,
                    "reason": "nan loss",
                    "train_time_ms": 1.0,
                }
            )
            return 3
        if os.environ.get("FAKE_CRASH") == "1":
            return 1
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
