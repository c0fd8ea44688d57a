"""``nanoshampoo compare``: train every optimizer setup over several seeds, then one leaderboard.

A *setup* is a trainer preset under a short name: ``adamw`` runs ``--preset tiny-adamw``, and
``NAME=PRESET`` runs any preset (a name or a ``.toml`` path) under ``NAME``, e.g.
``adamw=gpt2-124m-adamw``. The train flags after ``--`` apply to every setup on top of its
preset. compare sets ``--preset``, ``--seed``, ``--run-id`` and ``--out-dir`` itself and refuses
them (and ``--resume``, ``--pause-at-step``, and ``--optimizer``, which belongs to the setup's
preset) among the train flags.

Layout of the out dir::

    <out_dir>/<setup>/<run_id>.txt, .jsonl     the trainer's logs (and its checkpoints)
    <out_dir>/<setup>/<run_id>.compare.json    the manifest: setup, seed, nproc, flags and the
                                               effective TrainConfig that the run was asked for
    <out_dir>/<setup>/<run_id>.out             the trainer's console output
    <out_dir>/leaderboard.md, leaderboard.json, loss_vs_step.png, loss_vs_time.png

Schedule lengths (``step_fractions``, e.g. ``0.7``): every non-baseline setup ``S`` is also
trained as ``S@0.7``, its own preset with ``--num-iterations`` set to 0.7 x the baseline's steps
(the whole schedule, cooldown included, shrinks). The leaderboard then says, per setup, the
shortest schedule whose mean final loss is below the target with one-sided p < 0.05: the
speedrun's measure of "reaches the baseline's loss in 0.7x the steps". Steps to target read off
a full-length curve understate the gain of a shorter schedule, because a run's loss falls
fastest during its own cooldown.

Reuse: a run is recognised by its setup directory (or one the setup names in ``reuse_from``:
a tuned setup's best trial), its seed, ``nproc`` and the effective
``TrainConfig`` that the trainer's own parser makes of preset + flags (so ``--lr=1`` and
``--lr 1`` are the same run, and editing a preset file retrains its setup), less the fields that
do not change the result (``RUN_IDENTITY_IGNORED``). A field that the manifest lacks (added to
``TrainConfig`` after the run) matches when its value is the field's default. A run whose manifest
matches and whose
JSONL log ended (finished or diverged) is reused; anything else is trained under a new run id,
never one whose files exist, so an earlier run's logs are never overwritten. The code is not
part of the identity: use a fresh ``--out-dir`` after changing the trainer.

Several commands may share an out dir (two ``compare`` commands, or a re-run after one was
killed): each run is claimed before it trains (``run_claims``), so no run trains twice. A
command that finds a run claimed trains its other runs first, then waits for the claim and
reuses the run (or trains it, if its claimant stopped without an ended log); one line says
which.

The leaderboard built from the runs is ``nanoshampoo.evidence.leaderboard``'s; ``rule``
(``--rule welch|track3``) picks its statistics.

Example:
    >>> config = CompareConfig(setups=parse_setups("adamw,shampoo"), seeds=3)  # doctest: +SKIP
    >>> groups = run_compare(config)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanoshampoo.evidence.logs import LogFormatError, RunRecord, read_run
from nanoshampoo.evidence.repeat import check_unmanaged, fresh_run_id, train_command
from nanoshampoo.evidence.run_claims import RunClaim, claim_path
from nanoshampoo.evidence.trainer_process import run_trainer, shared_probe_cache
from nanoshampoo.io_utils import atomic_output, check_output_dir
from nanoshampoo.validation import check_float

DEFAULT_SETUPS = "adamw,shampoo,soap,muon"
DEFAULT_PRESET_PREFIX = "tiny-"
# Options compare sets per run; among the train flags they would be ambiguous or unsafe
# (``--optimizer`` would silently make every setup the same optimizer).
MANAGED_OPTIONS = (
    "--preset",
    "--optimizer",
    "--seed",
    "--run-id",
    "--out-dir",
    "--resume",
    # A paused run has no result to compare (tune pauses its own trials at their rungs).
    "--pause-at-step",
    "-h",
    "--help",
)
# TrainConfig fields that do not change a run's result: two runs that differ only here are one.
# (Checkpoints are written outside the timed steps.)
# ``preset`` too: the effective config (every field and table it sets) is the identity, so a
# tuned preset that spells a trial's flags as a table is the same run as that trial.
RUN_IDENTITY_IGNORED = (
    "run_id",
    "out_dir",
    "progress",
    "embed_source",
    "save_final_checkpoint",
    "checkpoint_every",
    "preset",
    # A run resumed (exactly) from its own checkpoint, or paused and resumed, is the same run.
    "resume",
    "pause_at_step",
)
_SETUP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
MANIFEST_SUFFIX = ".compare.json"
# The leaderboard's statistics (``--rule``): see ``nanoshampoo.evidence.leaderboard``.
RULES = ("welch", "track3")


@dataclass(frozen=True)
class Setup:
    """A named trainer preset: ``name`` labels the leaderboard row and the runs' directory.

    ``num_iterations`` (``None``: the preset's and flags' own) shortens the run's schedule;
    such a setup is made by ``--step-fractions`` from ``parent`` at ``fraction`` of the
    baseline's steps, and named ``PARENT@FRACTION``.
    """

    name: str
    preset: str
    num_iterations: int | None = None
    parent: str = ""
    fraction: float = 1.0
    # Train flags of this setup alone, after its preset (a tuning trial's point).
    args: tuple[str, ...] = ()
    # More directories whose ended runs of the same effective config count as this setup's
    # (a tuned setup reuses its best trial's runs: the same computation).
    reuse_from: tuple[Path, ...] = ()

    @property
    def family(self) -> str:
        """The setup this one is a schedule variant of (itself when it is not one)."""
        return self.parent or self.name


def check_setup_name(name: str) -> None:
    """A setup's name labels directories and rows: ``ValueError`` unless it is a plain name."""
    if not _SETUP_NAME.match(name):
        raise ValueError(f"setups: {name!r} is not a plain name (letters, digits, _ . + -)")


def parse_setups(text: str) -> tuple[Setup, ...]:
    """``"adamw,shampoo,mine=path/to.toml"`` -> setups; ``NAME`` alone means ``tiny-NAME``."""
    setups = []
    for entry in (part.strip() for part in text.split(",")):
        name, sep, preset = entry.partition("=")
        name, preset = name.strip(), preset.strip()
        if sep and not preset:
            raise ValueError(f"setups: {entry!r} names no preset after '='")
        setups.append(Setup(name, preset if sep else DEFAULT_PRESET_PREFIX + name))
    return tuple(setups)


@dataclass(frozen=True)
class CompareConfig:
    """What to train and where. ``target=None`` is ``auto``; ``baseline=""`` is the first setup."""

    setups: tuple[Setup, ...]
    seeds: int = 3
    seed0: int = 0
    baseline: str = ""
    target: float | None = None
    nproc: int = 1
    out_dir: Path = Path("runs/compare")
    train_args: tuple[str, ...] = ()
    step_fractions: tuple[float, ...] = ()
    rule: str = "welch"

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"rule: must be one of {list(RULES)}, got {self.rule!r}")
        if not self.setups:
            raise ValueError("setups: give at least one setup")
        fractions = tuple(self.step_fractions)
        for fraction in fractions:
            check_float("step-fractions: each", fraction, greater_than=0.0, less_than=1.0)
        if len(set(fractions)) != len(fractions):
            raise ValueError(f"step-fractions: {list(fractions)} repeats a fraction")
        object.__setattr__(self, "step_fractions", tuple(sorted(fractions, reverse=True)))
        names = [s.name for s in self.setups]
        for name in names:
            check_setup_name(name)
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"setups: {duplicates} given twice")
        if self.seeds < 1:
            raise ValueError(f"seeds: must be >= 1, got {self.seeds}")
        if self.seed0 < 0:
            raise ValueError(f"seed0: must be >= 0, got {self.seed0}")
        if self.nproc < 1:
            raise ValueError(f"nproc: must be >= 1, got {self.nproc}")
        baseline = self.baseline or names[0]
        if baseline not in names:
            raise ValueError(f"baseline: {baseline!r} is not one of the setups {names}")
        if self.target is not None and not math.isfinite(self.target):
            raise ValueError(f"target: must be a finite number or auto, got {self.target}")
        out_dir = Path(self.out_dir)
        if out_dir.exists() and not out_dir.is_dir():
            raise ValueError(f"out-dir: {out_dir} exists and is not a directory")
        check_output_dir(out_dir, "--out-dir")  # before any run: a bad one fails no run midway
        check_unmanaged(
            self.train_args,
            MANAGED_OPTIONS,
            "compare for each run (use --setups NAME=PRESET for presets)",
        )
        object.__setattr__(self, "baseline", baseline)
        object.__setattr__(self, "out_dir", out_dir)
        object.__setattr__(self, "train_args", tuple(self.train_args))

    @property
    def seed_list(self) -> range:
        return range(self.seed0, self.seed0 + self.seeds)


# Resolves trainer flags to the effective TrainConfig as a plain dict (the trainer's own parser).
ConfigResolver = Callable[[Sequence[str]], dict[str, Any]]
# Runs a command with its output going to a file; returns the exit status.
Launcher = Callable[[list[str], Path], int]


def resolve_train_config(argv: Sequence[str]) -> dict[str, Any]:
    """The ``TrainConfig`` (as ``to_dict``) that ``python -m nanoshampoo.train ARGV`` would run.

    A bad flag or value raises ``ValueError`` with the trainer's one-line message.
    """
    from nanoshampoo.train.cli import config_from_args  # imports torch: only when comparing

    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            config = config_from_args(list(argv), refuse_unread_tables=True)
    except SystemExit as exc:  # argparse's usage error: keep only its message
        lines = [line for line in captured.getvalue().splitlines() if line.strip()]
        message = lines[-1].split(" error: ", 1)[-1] if lines else f"exit status {exc.code}"
        raise ValueError(f"train flags: {message}") from None
    except ValueError as exc:
        raise ValueError(f"train flags: {exc}") from None
    return config.to_dict()


def run_identity(config: Mapping[str, Any], nproc: int) -> str:
    """Canonical JSON of what makes two runs the same run (see the module docstring)."""
    kept = {k: v for k, v in config.items() if k not in RUN_IDENTITY_IGNORED}
    return json.dumps({"config": kept, "nproc": nproc}, sort_keys=True)


@dataclass(frozen=True)
class PlannedRun:
    """One (setup, seed) of a comparison: how to train it, and the ended run to reuse if any."""

    setup: Setup
    seed: int
    argv: tuple[str, ...]  # trainer flags, without --run-id and --out-dir
    config: dict[str, Any] = field(repr=False)
    identity: str = field(repr=False)
    directory: Path
    reused: RunRecord | None

    @property
    def label(self) -> str:
        return f"{self.setup.name} seed {self.seed}"

    @property
    def base_run_id(self) -> str:
        digest = hashlib.sha256(self.identity.encode()).hexdigest()[:8]
        return f"{self.setup.name}-s{self.seed}-{digest}"


def expand_setups(config: CompareConfig, baseline_steps: int) -> tuple[Setup, ...]:
    """``config.setups`` and, after each non-baseline setup, its ``--step-fractions`` variants.

    The variant of setup ``S`` at fraction ``f`` trains ``S``'s preset for
    ``max(1, round(f * baseline_steps))`` steps (its cooldown, a fraction of the schedule,
    shrinks with it; a ``warmup_steps`` warmup keeps its length): the speedrun's way of asking
    whether ``S`` reaches the
    baseline's loss in ``f`` times the baseline's steps.
    """
    setups: list[Setup] = []
    for setup in config.setups:
        setups.append(setup)
        if setup.name == config.baseline:
            continue
        for fraction in config.step_fractions:
            steps = max(1, round(fraction * baseline_steps))
            setups.append(
                Setup(
                    f"{setup.name}@{fraction:g}",
                    setup.preset,
                    num_iterations=steps,
                    parent=setup.name,
                    fraction=fraction,
                    args=setup.args,
                )
            )
    return tuple(setups)


def train_config_defaults() -> dict[str, Any]:
    """``TrainConfig``'s field defaults, as ``to_dict`` writes them (JSON types): the run fields
    and the ``TABLE.FIELD`` of every registered table (``to_dict`` keeps only the setup's)."""
    # imports torch: only when comparing
    from nanoshampoo.train.config import TrainConfig, flatten_tables

    config = TrainConfig()
    return json.loads(json.dumps(flatten_tables(config.to_dict() | config.tables)))


def plan_runs(
    config: CompareConfig,
    resolve: ConfigResolver = resolve_train_config,
    defaults: Mapping[str, Any] | None = None,
) -> list[PlannedRun]:
    """Resolve every (setup, seed) and find its reusable run; launches nothing, writes nothing.

    Every setup's flags are checked here, so a bad flag fails before any training starts.
    ``defaults`` (``TrainConfig``'s when ``None``) lets a run logged before a config field
    existed be reused when the field is at its default now (see ``find_reusable``).
    """
    if defaults is None:
        defaults = train_config_defaults()
    base = next(s for s in config.setups if s.name == config.baseline)
    base_argv = (
        *config.train_args,
        "--preset",
        base.preset,
        *base.args,
        "--seed",
        str(config.seed0),
    )
    try:
        baseline_steps = int(resolve(base_argv)["num_iterations"])
    except ValueError as exc:
        raise ValueError(f"setup {base.name!r}: {exc}") from None
    plans = []
    for setup in expand_setups(config, baseline_steps):
        schedule = (
            () if setup.num_iterations is None else ("--num-iterations", str(setup.num_iterations))
        )
        for seed in config.seed_list:
            argv = (
                *config.train_args,
                "--preset",
                setup.preset,
                *setup.args,
                *schedule,
                "--seed",
                str(seed),
            )
            try:
                resolved = resolve(argv)
            except ValueError as exc:
                raise ValueError(f"setup {setup.name!r}: {exc}") from None
            identity = run_identity(resolved, config.nproc)
            directory = config.out_dir / setup.name
            reusable = next(
                (
                    run
                    for d in (directory, *setup.reuse_from)
                    if (run := find_reusable(d, resolved, config.nproc, defaults))
                ),
                None,
            )
            plans.append(PlannedRun(setup, seed, argv, resolved, identity, directory, reusable))
    return plans


def find_reusable(
    directory: Path,
    resolved: Mapping[str, Any],
    nproc: int,
    defaults: Mapping[str, Any] | None = None,
) -> RunRecord | None:
    """The first run in ``directory`` (by run id) of this config whose log says it ended.

    A manifest written before a config field existed lacks that field: the run counts as the
    same when the field's value now equals its default in ``defaults`` (a new field's default
    keeps the old behaviour), and as a different run otherwise. A manifest that spells the
    config with names from before (``muon_lr``: ``TrainConfig``'s ``RENAMED``) is not reused,
    with one line saying so.
    """
    if not directory.is_dir():
        return None
    identity = run_identity(resolved, nproc)
    defaults = defaults or {}
    for manifest in sorted(directory.glob(f"*{MANIFEST_SUFFIX}")):
        try:
            data = json.loads(manifest.read_text(encoding="utf-8"))
            logged = dict(data["config"])
            old = old_spelling(logged)
            if old:
                print(
                    f"[compare] not reusing {manifest}: it spells the config as before "
                    f"({old}); training it again",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            for key, value in resolved.items():
                if key not in logged and key in defaults and _same_json(value, defaults[key]):
                    logged[key] = value
            same = run_identity(logged, data["nproc"]) == identity
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # not a manifest compare can read: not a run it can vouch for
        if not same:
            continue
        run_id = manifest.name[: -len(MANIFEST_SUFFIX)]
        try:
            run = read_run(directory / f"{run_id}.jsonl")
        except LogFormatError:
            continue  # crashed, killed or still running: train it again under a new id
        disagreement = _log_disagrees(run, resolved)
        if disagreement:
            print(
                f"[compare] not reusing {run.path}: {disagreement}; training it again",
                file=sys.stderr,
                flush=True,
            )
            continue
        return run
    return None


def _log_disagrees(run: RunRecord, resolved: Mapping[str, Any]) -> str:
    """Why a run whose manifest matches is still not the run asked for, from its own log (the
    seed and every config field it recorded, a non-negative training time); "" when none."""
    if run.seed is not None and str(run.seed) != str(resolved.get("seed", run.seed)):
        return f"its log says seed {run.seed}, the manifest {resolved['seed']}"
    logged = run.config
    for key, value in resolved.items():
        if key in RUN_IDENTITY_IGNORED or key not in logged:
            continue
        if not _same_json(logged[key], value):
            return f"its log says {key} {logged[key]!r}, the manifest {value!r}"
    if not run.train_time_ms >= 0:
        return f"its log's training time is {run.train_time_ms} ms"
    return ""


def old_spelling(config: Mapping[str, Any]) -> str:
    """The first name of ``config`` (a manifest's) that is spelled as before, with its new
    spelling (``"muon_lr is now muon.lr"``); "" when there is none. A boolean ``compile`` is
    one."""
    from nanoshampoo.train.config import renamed_message  # imports torch

    for key, value in config.items():
        message = renamed_message(key)
        if message:
            return message
        if key == "compile" and isinstance(value, bool):
            return f'compile {value!r} is now "{str(value).lower()}"'
    return ""


def _same_json(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def launch_subprocess(command: list[str], output: Path) -> int:
    """Run ``command`` with stdout and stderr into ``output`` (a new file); return its status.
    The trainer dies with this process (``trainer_process``): a killed compare leaves none."""
    return run_trainer(command, output)


def run_compare(
    config: CompareConfig,
    resolve: ConfigResolver = resolve_train_config,
    launch: Launcher = launch_subprocess,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
) -> dict[str, list[RunRecord]]:
    """Train (or reuse) every (setup, seed) in turn; return the runs by setup name.

    Prints one line per run reused, started, ended, skipped or waited for. A run that exits
    without a finished or diverged log raises ``RuntimeError`` naming it and its output file;
    the runs before it stay on disk and are reused by the next invocation.

    A run is trained only under its claim (``run_claims``). One that another command has
    claimed is skipped until the others are done, then waited for: reused once its claimant's
    log ended, trained here when the claimant stopped without one.
    """
    with shared_probe_cache(config.out_dir):
        return _run_compare(config, resolve, launch, say)


def _run_compare(
    config: CompareConfig,
    resolve: ConfigResolver,
    launch: Launcher,
    say: Callable[[str], None],
) -> dict[str, list[RunRecord]]:
    defaults = train_config_defaults()
    plans = plan_runs(config, resolve, defaults)
    to_train = [p for p in plans if p.reused is None]
    setups = len({plan.setup.name for plan in plans})
    say(
        f"[compare] {len(plans)} runs ({setups} setups x {config.seeds} seeds): "
        f"{len(plans) - len(to_train)} reused, {len(to_train)} to train, in {config.out_dir}"
    )
    groups: dict[str, list[RunRecord]] = {}
    for plan in plans:
        groups.setdefault(plan.setup.name, [])
        if plan.reused is not None:
            say(f"[compare] reused   {plan.label}: {_outcome(plan.reused)} ({plan.reused.path})")
            groups[plan.setup.name].append(plan.reused)
    claimed_elsewhere: list[tuple[PlannedRun, RunClaim, str]] = []
    for index, plan in enumerate(to_train, start=1):
        position = f"{index}/{len(to_train)}"
        claim = RunClaim(claim_path(plan.directory, plan.base_run_id))
        if not claim.try_take():
            say(
                f"[compare] skipped  {plan.label} for now: {claim.holder()} is training it; "
                "back to it after the others"
            )
            claimed_elsewhere.append((plan, claim, position))
            continue
        groups[plan.setup.name].append(
            _train_claimed(plan, claim, config.nproc, launch, say, position, defaults)
        )
    for plan, claim, position in claimed_elsewhere:
        say(f"[compare] waiting  for {plan.label}: {claim.holder()} is training it")
        claim.wait()
        groups[plan.setup.name].append(
            _train_claimed(plan, claim, config.nproc, launch, say, position, defaults)
        )
    for runs in groups.values():
        runs.sort(key=lambda run: -1 if run.seed is None else run.seed)
    return groups


def write_manifest(plan: PlannedRun, run_id: str, command: Sequence[str], nproc: int) -> None:
    """Write ``run_id``'s manifest into ``plan.directory`` (created): what the run was asked
    for. It goes before the run starts: a run without one is never reused, whatever its log
    says."""
    plan.directory.mkdir(parents=True, exist_ok=True)
    manifest = {
        "setup": plan.setup.name,
        "preset": plan.setup.preset,
        "seed": plan.seed,
        "nproc": nproc,
        "argv": list(plan.argv),
        "command": list(command),
        "config": plan.config,
    }
    with atomic_output(plan.directory / f"{run_id}{MANIFEST_SUFFIX}") as tmp:
        tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def _train_claimed(
    plan: PlannedRun,
    claim: RunClaim,
    nproc: int,
    launch: Launcher,
    say: Callable[[str], None],
    position: str,
    defaults: Mapping[str, Any],
) -> RunRecord:
    """Under ``claim`` (held; released here): reuse the run if another command ended it since
    the plan was made, else train it."""
    try:
        done = find_reusable(plan.directory, plan.config, nproc, defaults)
        if done is not None:
            say(
                f"[compare] reused   {plan.label}: {_outcome(done)} ({done.path}), "
                "trained meanwhile by another command"
            )
            return done
        return _train(plan, nproc, launch, say, position)
    finally:
        claim.release()


def _train(
    plan: PlannedRun, nproc: int, launch: Launcher, say: Callable[[str], None], position: str
) -> RunRecord:
    run_id = fresh_run_id(plan.directory, plan.base_run_id)
    command = train_command(plan.argv, run_id, plan.directory, nproc)
    write_manifest(plan, run_id, command, nproc)
    output = plan.directory / f"{run_id}.out"
    say(f"[compare] start    {plan.label} ({position}): run {run_id}, output {output}")
    start = time.perf_counter()
    status = launch(command, output)
    elapsed = time.perf_counter() - start
    try:
        run = read_run(plan.directory / f"{run_id}.jsonl")
    except LogFormatError as exc:
        raise RuntimeError(
            f"{plan.label} failed (exit status {status}): {last_output_line(output)}; "
            f"log: {exc}; output: {output}"
        ) from None
    if status != 0 and not run.diverged:
        raise RuntimeError(
            f"{plan.label} exited with status {status} after finishing: "
            f"{last_output_line(output)}; output: {output}"
        )
    say(f"[compare] finished {plan.label} in {elapsed:.1f} s: {_outcome(run)}")
    return run


def _outcome(run: RunRecord) -> str:
    if run.diverged:
        return f"diverged at step {run.diverged_step}/{run.total_steps}: {run.diverged_reason}"
    return f"final val_loss {run.final_val_loss:.4f}"


def last_output_line(path: Path) -> str:
    """The last line a run printed into ``path`` (its last redraw), for an error message."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no output)"
    # tqdm redraws with carriage returns: the last redraw is what was on screen.
    lines = [line.rsplit("\r", 1)[-1].strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    return lines[-1] if lines else "(no output)"
