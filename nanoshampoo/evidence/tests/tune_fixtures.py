"""Helpers of the tuning tests: a loss known in closed form, a resolver and a trainer command
that stand in for the real trainer (``fake_trainer.py``, a real subprocess), and a worker
process (``python tune_fixtures.py CONFIG_JSON``) that runs ``tune`` with them.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

HERE = Path(__file__).resolve().parent
FAKE_TRAINER = HERE / "fake_trainer.py"
REPO = HERE.parents[2]
GRID_LRS = ("0.005", "0.01", "0.02", "0.04", "0.08")
FAKE_DEFAULTS: dict[str, Any] = {
    "preset": "tiny-muon",
    "num_iterations": 8,
    "seed": 0,
    "out_dir": "runs",
    "run_id": "",
    "decay_branches": [],
    "cooldown_frac": 0.5,
    "warmup_steps": 0,
    "pause_at_step": 0,
    "resume": "",
    "muon.lr": 0.05,
    "muon.weight_decay": 0.0,
    "custom.matrix_kwargs": {"lr": 0.05, "momentum": 0.9},
}


def fake_loss(lr: float, wd: float, seed: int, fraction: float = 1.0) -> float:
    """The fake run's final val loss: a parabola in log10(lr) with its minimum at 0.02, one in
    the weight decay with its minimum at 0.1, 0.001 per seed; a branch at ``fraction`` of the
    budget ends 0.5 x (1 - fraction) higher."""
    return (
        4.0
        + (math.log10(lr) - math.log10(0.02)) ** 2
        + (wd - 0.1) ** 2
        + 0.001 * seed
        + 0.5 * (1.0 - fraction)
    )


def fake_resolve(argv: Sequence[str]) -> dict[str, Any]:
    """Flags as a typed config dict, as the trainer's parser would make of them: each flag
    ``--a.b-c`` sets key ``a.b_c`` of ``FAKE_DEFAULTS`` (an unknown one is refused)."""
    config = json.loads(json.dumps(FAKE_DEFAULTS))
    if len(argv) % 2:
        raise ValueError(f"train flags: expected FLAG VALUE pairs, got {list(argv)}")
    for flag, text in zip(argv[::2], argv[1::2]):
        table, dot, name = flag.lstrip("-").rpartition(".")
        key = f"{table}{dot}{name.replace('-', '_')}"
        if not flag.startswith("--") or key not in config:
            raise ValueError(f"train flags: unrecognized arguments: {flag}")
        default = config[key]
        if isinstance(default, dict):
            config[key] = json.loads(text)
        elif isinstance(default, list):
            config[key] = [float(part) for part in text.split(",")]
        else:
            try:
                config[key] = type(default)(text)
            except ValueError:
                raise ValueError(f"train flags: argument {flag}: invalid value {text!r}") from None
    return config


def fake_command(argv: Sequence[str], run_id: str, out_dir: Path) -> list[str]:
    """The command line that runs ``fake_trainer.py`` where the trainer would run."""
    return [sys.executable, str(FAKE_TRAINER), *argv, "--run-id", run_id, "--out-dir", str(out_dir)]


def worker_main(spec: dict[str, Any]) -> None:
    """One worker: ``tune`` of the config ``spec`` describes, with the fake trainer."""
    from nanoshampoo.evidence.compare import Setup
    from nanoshampoo.evidence.tune import TuneConfig, parse_search, tune

    fields = dict(spec)
    fields["setup"] = Setup(*fields["setup"])
    fields["searches"] = tuple(parse_search(s) for s in fields["searches"])
    fields["out_dir"] = Path(fields["out_dir"])
    for key in ("train_args", "rungs"):
        fields[key] = tuple(fields.get(key, ()))
    tune(TuneConfig(**fields), fake_resolve, fake_command)


def start_worker(spec: dict[str, Any], output: Path, step_s: float) -> subprocess.Popen[bytes]:
    """A worker process of the tune ``spec`` describes, the fake trainer taking ``step_s``
    seconds a step, its output into ``output``. It imports this checkout's package."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "FAKE_STEP_S": str(step_s)}
    with output.open("x") as out:
        return subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), json.dumps(spec)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll ``condition`` until it returns something true; fail naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def kill_a_worker_mid_trial(storage: str | None, tmp: Path) -> tuple[list[FrozenTrial], int]:
    """Two workers on one study of a 5-point grid; SIGKILL one while its trainer runs; wait
    for the other to finish the study. Returns the study's trials and the killed trial's
    number (the checks are the caller's)."""
    import optuna

    lrs = ",".join(GRID_LRS)
    spec = {
        "setup": ["muon", "tiny-muon"],
        "searches": [f"muon.lr={lrs}"],
        "out_dir": str(tmp / "tune"),
        "train_args": ["--num-iterations", "8"],
        "storage": storage,
        "study": "killed",
        "heartbeat_s": 2,
        "poll_s": 0.05,
    }
    url = storage or f"sqlite:///{tmp}/tune/study.db"
    workers = [start_worker(spec, tmp / f"worker{i}.out", step_s=0.3) for i in range(2)]
    try:

        def busy() -> list[FrozenTrial] | None:
            try:
                trials = optuna.load_study(study_name="killed", storage=url).get_trials()
            except Exception:  # not created yet
                return None
            running = [
                t
                for t in trials
                if t.state == optuna.trial.TrialState.RUNNING
                and any((tmp / "tune" / "trials" / "killed" / f"t{t.number:03d}").glob("*.jsonl"))
            ]
            return running if len({t.user_attrs["worker"] for t in running}) == 2 else None

        victim = wait_for(busy, 120, "both workers to train a trial")[0]
        pid = int(victim.user_attrs["worker"].rsplit(":", 1)[1])
        (killed,) = [w for w in workers if w.pid == pid]
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        (survivor,) = [w for w in workers if w is not killed]
        assert survivor.wait(240) == 0, (tmp / "worker0.out").read_text()[-3000:]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    return optuna.load_study(study_name="killed", storage=url).get_trials(), victim.number


def check_every_point_ran_once(trials: Sequence[FrozenTrial], victim: int, tmp: Path) -> None:
    """Every grid point complete exactly once; the killed trial failed and retried, with its
    point, by the other worker; on disk one finished run per point, and the killed run
    stopped with its worker (no final record)."""
    from optuna.trial import TrialState

    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert sorted(t.params["muon.lr"] for t in complete) == sorted(map(float, GRID_LRS))
    (killed,) = [t for t in trials if t.number == victim]
    (retry,) = [t for t in trials if t.system_attrs.get("failed_trial") == victim]
    assert killed.state == TrialState.FAIL and retry.state == TrialState.COMPLETE
    assert retry.params == killed.params
    assert retry.user_attrs["worker"] != killed.user_attrs["worker"]
    for trial in trials:  # anything else was asked for beyond the budget and never trained
        assert trial in complete or trial is killed or trial.user_attrs["outcome"] == "surplus"
    logs = sorted((tmp / "tune" / "trials" / "killed").glob("*/*.jsonl"))
    finished = [
        json.loads(log.read_text().splitlines()[0])["config"]["muon.lr"]
        for log in logs
        if '"kind": "final"' in log.read_text()
    ]
    assert sorted(finished) == sorted(map(float, GRID_LRS)) and len(logs) == len(finished) + 1


if __name__ == "__main__":
    worker_main(json.loads(sys.argv[1]))
