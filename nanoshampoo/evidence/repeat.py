"""Run one training configuration with several seeds, one subprocess per seed.

Each seed ``s`` runs ``python -m nanoshampoo.train <train args> --seed s --run-id
<name>_seed<s> --out-dir DIR`` (through ``torch.distributed.run --standalone`` when
``nproc > 1``), so every run leaves ``DIR/<name>_seed<s>.{txt,jsonl}`` for
``nanoshampoo stats DIR``. The trainer never overwrites a run's logs, so when that run id is
taken (a repeat into the same directory) the run gets ``<name>_seed<s>-2``, ``-3``, ... A seed
that diverged (non-zero exit, and a log that says so) is kept: it is a result.

Example:
    >>> config = RepeatConfig(runs=3, out_dir="runs/adam")  # doctest: +SKIP
    >>> run_repeats(config, ["--preset", "tiny"])  # doctest: +SKIP
"""

from __future__ import annotations

import glob
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from nanoshampoo.errors import UserError
from nanoshampoo.evidence.logs import LogFormatError, read_run
from nanoshampoo.evidence.trainer_process import run_trainer

# Options repeat sets per seed; giving them among the train args would be ambiguous.
# (``--resume`` would start every seed from one checkpoint, so from the same weights.)
MANAGED_OPTIONS = ("--seed", "--run-id", "--out-dir", "--resume")


@dataclass(frozen=True)
class RepeatConfig:
    """How many seeds to run, from which seed, where, and on how many processes."""

    runs: int
    out_dir: Path
    seed0: int = 0
    nproc: int = 1
    name: str = "run"

    def __post_init__(self) -> None:
        if self.runs < 1:
            raise ValueError(f"runs: must be >= 1, got {self.runs}")
        if self.seed0 < 0:
            raise ValueError(f"seed0: must be >= 0, got {self.seed0}")
        if self.nproc < 1:
            raise ValueError(f"nproc: must be >= 1, got {self.nproc}")
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"name: must be a plain file-name prefix, got {self.name!r}")
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise ValueError(f"out_dir: {self.out_dir} is a file, not a directory")

    @property
    def seeds(self) -> range:
        return range(self.seed0, self.seed0 + self.runs)

    def run_id(self, seed: int) -> str:
        return f"{self.name}_seed{seed}"


def check_unmanaged(train_args: Sequence[str], managed: Sequence[str], owner: str) -> None:
    """Raise ``UserError`` if ``train_args`` give an option that ``owner`` sets itself."""
    for arg in train_args:
        if arg.split("=", 1)[0] in managed:
            raise UserError(f"train_args: {arg!r} is set by {owner}; remove it")


def train_command(train_args: Sequence[str], run_id: str, out_dir: Path, nproc: int) -> list[str]:
    """``python -m nanoshampoo.train TRAIN_ARGS --run-id ID --out-dir DIR``, under
    ``torch.distributed.run --standalone`` with ``nproc`` processes when ``nproc > 1``."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [
        *launcher,
        "-m",
        "nanoshampoo.train",
        *train_args,
        "--run-id",
        run_id,
        "--out-dir",
        str(out_dir),
    ]


def seed_command(
    config: RepeatConfig, seed: int, train_args: Sequence[str], run_id: str | None = None
) -> list[str]:
    """The command line that trains seed ``seed`` (as ``run_id``, default ``config.run_id``)."""
    check_unmanaged(train_args, MANAGED_OPTIONS, "repeat for each seed")
    return train_command(
        [*train_args, "--seed", str(seed)],
        run_id or config.run_id(seed),
        config.out_dir,
        config.nproc,
    )


def fresh_run_id(directory: Path, base: str) -> str:
    """``base``, or ``base-2``, ``base-3``, ...: the first that no file in ``directory`` uses."""
    candidate, attempt = base, 1
    while any(directory.glob(f"{glob.escape(candidate)}.*")):
        attempt += 1
        candidate = f"{base}-{attempt}"
    return candidate


def run_repeats(
    config: RepeatConfig,
    train_args: Sequence[str],
    run: Callable[[list[str]], int] = run_trainer,
) -> list[Path]:
    """Train every seed in turn; return their JSONL logs, one per seed.

    Raises ``UserError`` naming the first seed that fails (its output, printed above, says
    why); a diverged seed is not a failure.
    """
    check_unmanaged(train_args, MANAGED_OPTIONS, "repeat for each seed")
    config.out_dir.mkdir(parents=True, exist_ok=True)
    logs = []
    for seed in config.seeds:
        run_id = fresh_run_id(config.out_dir, config.run_id(seed))
        command = seed_command(config, seed, train_args, run_id)
        print(f"[repeat] seed {seed}: {' '.join(command)}", flush=True)
        returncode = run(command)
        log = config.out_dir / f"{run_id}.jsonl"
        if returncode != 0 and not _diverged(log):
            raise UserError(
                f"seed {seed} failed with exit status {returncode}: {' '.join(command)}"
            )
        logs.append(log)
    return logs


def _diverged(log: Path) -> bool:
    try:
        return read_run(log).diverged
    except LogFormatError:
        return False
