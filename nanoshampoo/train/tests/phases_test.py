"""A run's phases: each timed where it happens, together the run's wall time."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest

from nanoshampoo.train.phases import PHASES, PhaseClock, process_age_s
from nanoshampoo.train.tests.trainer_test import tiny_config
from nanoshampoo.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_record_adds_the_untimed_rest_as_other() -> None:
    clock = PhaseClock(process_age_s=lambda: 2.5)
    with clock.phase("steps"):
        time.sleep(0.05)
    clock.add("validation", 0.01)
    time.sleep(0.05)  # in no phase: "other"
    record = clock.record(logging_s=0.005)
    assert set(record) == {*PHASES, "wall"}
    assert record["start"] == 2.5 and record["validation"] == 0.01
    assert record["logging"] == 0.005 and record["steps"] >= 0.05
    assert record["other"] >= 0.05 - 0.015  # the sleep, less the added phases
    # wall = start + the time since the clock was made; the phases add up to it
    assert record["wall"] == pytest.approx(
        sum(v for k, v in record.items() if k != "wall"), abs=0.002
    )
    assert 2.5 + 0.1 <= record["wall"] < 2.5 + 5.0
    with pytest.raises(ValueError, match="unknown phase 'compile'"):
        clock.add("compile", 1.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (0.0 elsewhere)")
def test_process_age_is_the_time_since_this_process_started() -> None:
    # pytest has imported torch and the project by now: certainly more than 10 ms ago, and
    # less than a day.
    assert 0.01 < process_age_s() < 86400


def test_final_record_holds_the_run_phases(shards: dict[str, str], tmp_path: Path) -> None:
    cfg = tiny_config(
        shards,
        tmp_path,
        num_iterations=6,
        val_every=3,
        checkpoint_every=3,
        compile="false",
        decay_branches=(0.5,),
    )
    result = Trainer(cfg).run()
    records = [json.loads(line) for line in Path(result.jsonl_log).read_text().splitlines()]
    final = records[-1]
    phases = final["phases_s"]
    assert set(phases) == {*PHASES, "wall"}
    # Every optimizer step is timed once: the first, then the rest (the branch's included);
    # train_time_ms counts the main run's only.
    branch = next(r for r in records if r["kind"] == "branch")
    branch_steps_ms = branch["train_time_ms"] - fork_time_ms(records, branch["fork_step"])
    steps_ms = final["train_time_ms"] + branch_steps_ms
    assert 1000 * (phases["first_step"] + phases["steps"]) == pytest.approx(steps_ms, abs=2)
    assert phases["validation"] > 0 and phases["checkpoint"] > 0 and phases["setup"] > 0
    assert phases["probes"] >= 0 and phases["telemetry"] >= 0 and phases["logging"] > 0
    assert phases["start"] > 0  # pytest started before this run's trainer
    assert phases["wall"] == pytest.approx(
        sum(v for k, v in phases.items() if k != "wall"), abs=0.01
    )
    assert all(math.isfinite(v) and v >= 0 for v in phases.values())


def fork_time_ms(records: list[dict[str, object]], fork_step: int) -> float:
    """The main run's training time after ``fork_step`` steps (0 before the first)."""
    if fork_step == 0:
        return 0.0
    train = [r for r in records if r["kind"] == "train" and r["step"] == fork_step]
    return float(train[0]["train_time_ms"])  # type: ignore[arg-type]
