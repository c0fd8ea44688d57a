"""Two workers of one study in the embedded store (SQLite, no server): a SIGKILLed worker's
trial is retried by the other, and every grid point trains to completion exactly once; under
synchronous halving, a killed continuation resumes from its run's pause.

The workers are real processes running ``tune`` (``tune_fixtures.worker_main``), each
launching the fake trainer as a real subprocess, as the command line does.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from tune_fixtures import (
    check_every_point_ran_once,
    fake_loss,
    kill_a_worker_mid_trial,
    start_worker,
    wait_for,
)


@pytest.mark.slow
def test_a_killed_local_workers_trial_is_retried_by_the_other(tmp_path: Path) -> None:
    trials, victim = kill_a_worker_mid_trial(None, tmp_path)
    check_every_point_ran_once(trials, victim, tmp_path)


@pytest.mark.slow
def test_synchronous_halving_retries_a_killed_continuation_from_its_pause(tmp_path: Path) -> None:
    """Two workers, 4 points, rungs at 2 and 4 of 8 steps (pauses at steps 2 and 3): the
    worker that continues the last trial from step 3 is killed mid-run; the other fails it
    (stale heartbeat), continues it again from the same checkpoint, and finishes the study.
    Every run trains once and records each branch once."""
    import optuna

    lrs = ("0.005", "0.01", "0.02", "0.04")
    spec = {
        "setup": ["muon", "tiny-muon"],
        "searches": [f"muon.lr={','.join(lrs)}"],
        "out_dir": str(tmp_path / "tune"),
        "train_args": ["--num-iterations", "8"],
        "rungs": [0.25, 0.5],
        "study": "halving",
        "heartbeat_s": 2,
        "poll_s": 0.05,
    }
    url = f"sqlite:///{tmp_path}/tune/study.db"
    workers = [start_worker(spec, tmp_path / f"worker{i}.out", step_s=0.4) for i in range(2)]
    try:

        def last_segment_running() -> optuna.trial.FrozenTrial | None:
            try:
                trials = optuna.load_study(study_name="halving", storage=url).get_trials()
            except Exception:  # not created yet
                return None
            return next(
                (
                    t
                    for t in trials
                    if t.state == optuna.trial.TrialState.RUNNING
                    and t.user_attrs.get("segment") == 2
                    and "worker" in t.user_attrs
                    # A new trial has its attributes before its point: wait for both.
                    and t.params
                ),
                None,
            )

        victim = wait_for(last_segment_running, 120, "a worker to continue the last trial")
        time.sleep(0.6)  # its trainer is past step 3
        pid = int(victim.user_attrs["worker"].rsplit(":", 1)[1])
        (killed,) = [w for w in workers if w.pid == pid]
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        (survivor,) = [w for w in workers if w is not killed]
        assert survivor.wait(240) == 0, (tmp_path / "worker0.out").read_text()[-3000:]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    trials = optuna.load_study(study_name="halving", storage=url).get_trials()
    # The killed trial as the store keeps it (the snapshot above was taken while it started).
    (killed_trial,) = [t for t in trials if t.number == victim.number]
    (retry,) = [t for t in trials if t.system_attrs.get("failed_trial") == victim.number]
    assert killed_trial.state == optuna.trial.TrialState.FAIL
    assert retry.state == optuna.trial.TrialState.COMPLETE
    assert retry.params == killed_trial.params
    assert retry.user_attrs["segment"] == 2
    assert retry.user_attrs["slot"] == killed_trial.user_attrs["slot"]
    assert retry.params == {"muon.lr": 0.02} and retry.value == fake_loss(0.02, 0.0, 0)
    logs = sorted((tmp_path / "tune" / "trials" / "halving").glob("*/*.jsonl"))
    assert len(logs) == len(lrs)  # one run per point, however often it paused or was retried
    for log in logs:
        records = [json.loads(line) for line in log.read_text().splitlines()]
        steps = [r["steps"] for r in records if r["kind"] == "branch"]
        assert len(steps) == len(set(steps))
    finished = [log for log in logs if '"kind": "final"' in log.read_text()]
    assert len(finished) == 1
    # The killed try and the retry each resumed the run from its pause at step 3.
    assert sorted(p.name for p in finished[0].parent.glob("*.s000003*.out")) == [
        f"{finished[0].stem}.s000003-2.out",
        f"{finished[0].stem}.s000003.out",
    ]
