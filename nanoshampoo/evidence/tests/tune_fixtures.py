"""Helpers of the tuning tests: a loss known in closed form, a resolver and a trainer command
that stand in for the real trainer (``fake_trainer.py``, a real subprocess), and a worker
process (``python tune_fixtures.py CONFIG_JSON``) that runs ``tune`` with them.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FAKE_TRAINER = HERE / "fake_trainer.py"
FAKE_DEFAULTS: dict[str, Any] = {
    "preset": "tiny-muon", "num_iterations": 8, "seed": 0, "out_dir": "runs", "run_id": "",
    "decay_branches": [], "muon.lr": 0.05, "muon.weight_decay": 0.0,
    "custom.matrix_kwargs": {"lr": 0.05, "momentum": 0.9},
}


def fake_loss(lr: float, wd: float, seed: int, fraction: float = 1.0) -> float:
    """The fake run's final val loss: a parabola in log10(lr) with its minimum at 0.02, one in
    the weight decay with its minimum at 0.1, 0.001 per seed; a branch at ``fraction`` of the
    budget ends 0.5 x (1 - fraction) higher."""
    return (4.0 + (math.log10(lr) - math.log10(0.02)) ** 2 + (wd - 0.1) ** 2 + 0.001 * seed
            + 0.5 * (1.0 - fraction))


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
    return [sys.executable, str(FAKE_TRAINER), *argv, "--run-id", run_id, "--out-dir",
            str(out_dir)]


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


if __name__ == "__main__":
    worker_main(json.loads(sys.argv[1]))
