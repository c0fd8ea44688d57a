"""``nanoshampoo compare``: train every optimizer setup over several seeds, then one leaderboard.

A *setup* is a trainer preset under a short name: ``adamw`` runs ``--preset tiny-adamw``, and
``NAME=PRESET`` runs any preset (a name or a ``.toml`` path) under ``NAME``, e.g.
``adamw=gpt2-124m-adamw``. The train flags after ``--`` apply to every setup on top of its
preset. compare sets ``--preset``, ``--seed``, ``--run-id`` and ``--out-dir`` itself and refuses
them (and ``--resume``, and ``--optimizer``, which belongs to the setup's preset) among the
train flags.

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

Reuse: a run is recognised by its setup directory, its seed, ``nproc`` and the effective
``TrainConfig`` that the trainer's own parser makes of preset + flags (so ``--lr=1`` and
``--lr 1`` are the same run, and editing a preset file retrains its setup), less the fields that
do not change the result (``RUN_IDENTITY_IGNORED``). A field that the manifest lacks (added to
``TrainConfig`` after the run) matches when its value is the field's default. A run whose manifest matches and whose
JSONL log ended (finished or diverged) is reused; anything else is trained under a new run id,
never one whose files exist, so an earlier run's logs are never overwritten. The code is not
part of the identity: use a fresh ``--out-dir`` after changing the trainer.

The leaderboard, per setup (mean ± unbiased std over seeds):

* the target is the baseline's mean final validation loss (``--target auto``, the speedrun
  tracks' definition) or a given number;
* steps to target: the first validation at or below the target, linearly interpolated (in the
  loss, hence in step and time) between it and the validation before it, so the resolution is
  finer than ``val_every``; averaged over the runs that reached the target, shown with how
  many did; the ratio to the baseline is the ratio of the means; same for time to target
  (training time, validation excluded);
* final val loss, Welch's two-sided p against the baseline, and the one-sided one-sample
  t-test p that the mean final loss is below the target;
* ms/step and peak memory (MiB; the process's peak RSS on CPU);
* n runs, of which diverged: left out of every mean and test, counted as not reaching the
  target, and marked.

Example:
    >>> config = CompareConfig(setups=parse_setups("adamw,shampoo"), seeds=3)  # doctest: +SKIP
    >>> groups = run_compare(config)  # doctest: +SKIP
    >>> leaderboard = build_leaderboard(groups, config)  # doctest: +SKIP
    >>> write_leaderboard(leaderboard, groups, config.out_dir)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import re
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanoshampoo.evidence.logs import LogFormatError, RunRecord, read_run
from nanoshampoo.evidence.repeat import check_unmanaged, fresh_run_id, train_command
from nanoshampoo.evidence.report import format_p, json_ready, write_json
from nanoshampoo.evidence.stats import GroupReport, Summary, build_report
from nanoshampoo.evidence.tables import format_markdown_table
from nanoshampoo.io_utils import atomic_output

DEFAULT_SETUPS = "adamw,shampoo,soap,muon"
DEFAULT_PRESET_PREFIX = "tiny-"
# Options compare sets per run; among the train flags they would be ambiguous or unsafe
# (``--optimizer`` would silently make every setup the same optimizer).
MANAGED_OPTIONS = ("--preset", "--optimizer", "--seed", "--run-id", "--out-dir", "--resume", "-h", "--help")
# TrainConfig fields that do not change a run's result: two runs that differ only here are one.
# (Checkpoints are written outside the timed steps.)
RUN_IDENTITY_IGNORED = ("run_id", "out_dir", "progress", "save_final_checkpoint", "checkpoint_every")
_SETUP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
MANIFEST_SUFFIX = ".compare.json"


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

    @property
    def family(self) -> str:
        """The setup this one is a schedule variant of (itself when it is not one)."""
        return self.parent or self.name


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

    def __post_init__(self) -> None:
        if not self.setups:
            raise ValueError("setups: give at least one setup")
        fractions = tuple(self.step_fractions)
        for fraction in fractions:
            if isinstance(fraction, bool) or not (
                isinstance(fraction, (int, float)) and 0.0 < fraction < 1.0
            ):
                raise ValueError(f"step-fractions: each must be a number in (0, 1), got {fraction!r}")
        if len(set(fractions)) != len(fractions):
            raise ValueError(f"step-fractions: {list(fractions)} repeats a fraction")
        object.__setattr__(self, "step_fractions", tuple(sorted(fractions, reverse=True)))
        names = [s.name for s in self.setups]
        for name in names:
            if not _SETUP_NAME.match(name):
                raise ValueError(f"setups: {name!r} is not a plain name (letters, digits, _ . + -)")
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
        check_unmanaged(self.train_args, MANAGED_OPTIONS, "compare for each run (use --setups NAME=PRESET "
                        "for presets)")
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
            config = config_from_args(list(argv))
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
    ``max(1, round(f * baseline_steps))`` steps (its whole schedule, warm-up and cooldown
    included, shrinks with it): the speedrun's way of asking whether ``S`` reaches the
    baseline's loss in ``f`` times the baseline's steps.
    """
    setups: list[Setup] = []
    for setup in config.setups:
        setups.append(setup)
        if setup.name == config.baseline:
            continue
        for fraction in config.step_fractions:
            steps = max(1, round(fraction * baseline_steps))
            setups.append(Setup(f"{setup.name}@{fraction:g}", setup.preset, num_iterations=steps,
                                parent=setup.name, fraction=fraction))
    return tuple(setups)


def train_config_defaults() -> dict[str, Any]:
    """``TrainConfig``'s field defaults, as ``to_dict`` writes them (JSON types)."""
    from nanoshampoo.train.config import TrainConfig  # imports torch: only when comparing

    return TrainConfig().to_dict()


def plan_runs(config: CompareConfig, resolve: ConfigResolver = resolve_train_config,
              defaults: Mapping[str, Any] | None = None) -> list[PlannedRun]:
    """Resolve every (setup, seed) and find its reusable run; launches nothing, writes nothing.

    Every setup's flags are checked here, so a bad flag fails before any training starts.
    ``defaults`` (``TrainConfig``'s when ``None``) lets a run logged before a config field
    existed be reused when the field is at its default now (see ``find_reusable``).
    """
    if defaults is None:
        defaults = train_config_defaults()
    base = next(s for s in config.setups if s.name == config.baseline)
    base_argv = (*config.train_args, "--preset", base.preset, "--seed", str(config.seed0))
    try:
        baseline_steps = int(resolve(base_argv)["num_iterations"])
    except ValueError as exc:
        raise ValueError(f"setup {base.name!r}: {exc}") from None
    plans = []
    for setup in expand_setups(config, baseline_steps):
        schedule = () if setup.num_iterations is None else ("--num-iterations", str(setup.num_iterations))
        for seed in config.seed_list:
            argv = (*config.train_args, "--preset", setup.preset, *schedule, "--seed", str(seed))
            try:
                resolved = resolve(argv)
            except ValueError as exc:
                raise ValueError(f"setup {setup.name!r}: {exc}") from None
            identity = run_identity(resolved, config.nproc)
            directory = config.out_dir / setup.name
            plans.append(PlannedRun(setup, seed, argv, resolved, identity, directory,
                                    find_reusable(directory, resolved, config.nproc, defaults)))
    return plans


def find_reusable(directory: Path, resolved: Mapping[str, Any], nproc: int,
                  defaults: Mapping[str, Any] | None = None) -> RunRecord | None:
    """The first run in ``directory`` (by run id) of this config whose log says it ended.

    A manifest written before a config field existed lacks that field: the run counts as the
    same when the field's value now equals its default in ``defaults`` (a new field's default
    keeps the old behaviour), and as a different run otherwise.
    """
    if not directory.is_dir():
        return None
    identity = run_identity(resolved, nproc)
    defaults = defaults or {}
    for manifest in sorted(directory.glob(f"*{MANIFEST_SUFFIX}")):
        try:
            data = json.loads(manifest.read_text(encoding="utf-8"))
            logged = dict(data["config"])
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
            return read_run(directory / f"{run_id}.jsonl")
        except LogFormatError:
            continue  # crashed, killed or still running: train it again under a new id
    return None


def _same_json(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def launch_subprocess(command: list[str], output: Path) -> int:
    """Run ``command`` with stdout and stderr into ``output`` (a new file); return its status."""
    with output.open("x", encoding="utf-8") as out:
        return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False).returncode


def run_compare(
    config: CompareConfig,
    resolve: ConfigResolver = resolve_train_config,
    launch: Launcher = launch_subprocess,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
) -> dict[str, list[RunRecord]]:
    """Train (or reuse) every (setup, seed) in turn; return the runs by setup name.

    Prints one line per run reused, started and ended. A run that another compare (into the
    same out dir) ended after this one planned it is reused, not trained again. A run that exits without a finished or
    diverged log raises ``RuntimeError`` naming it and its output file; the runs before it
    stay on disk and are reused by the next invocation.
    """
    defaults = train_config_defaults()
    plans = plan_runs(config, resolve, defaults)
    to_train = [p for p in plans if p.reused is None]
    setups = len({plan.setup.name for plan in plans})
    say(f"[compare] {len(plans)} runs ({setups} setups x {config.seeds} seeds): "
        f"{len(plans) - len(to_train)} reused, {len(to_train)} to train, in {config.out_dir}")
    groups: dict[str, list[RunRecord]] = {}
    for plan in plans:
        groups.setdefault(plan.setup.name, [])
        if plan.reused is not None:
            say(f"[compare] reused   {plan.label}: {_outcome(plan.reused)} ({plan.reused.path})")
            groups[plan.setup.name].append(plan.reused)
    for index, plan in enumerate(to_train, start=1):
        # Another compare into the same setup directory may have ended this run meanwhile.
        ended = find_reusable(plan.directory, plan.config, config.nproc, defaults)
        if ended is not None:
            say(f"[compare] reused   {plan.label}: {_outcome(ended)} ({ended.path}), ended meanwhile")
            groups[plan.setup.name].append(ended)
            continue
        groups[plan.setup.name].append(_train(plan, config.nproc, launch, say, f"{index}/{len(to_train)}"))
    for runs in groups.values():
        runs.sort(key=lambda run: -1 if run.seed is None else run.seed)
    return groups


def _train(plan: PlannedRun, nproc: int, launch: Launcher, say: Callable[[str], None],
           position: str) -> RunRecord:
    plan.directory.mkdir(parents=True, exist_ok=True)
    run_id = fresh_run_id(plan.directory, plan.base_run_id)
    command = train_command(plan.argv, run_id, plan.directory, nproc)
    manifest = {"setup": plan.setup.name, "preset": plan.setup.preset, "seed": plan.seed,
                "nproc": nproc, "argv": list(plan.argv), "command": command, "config": plan.config}
    # The manifest goes first: a run without one is never reused, whatever its log says.
    with atomic_output(plan.directory / f"{run_id}{MANIFEST_SUFFIX}") as tmp:
        tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    output = plan.directory / f"{run_id}.out"
    say(f"[compare] start    {plan.label} ({position}): run {run_id}, output {output}")
    start = time.perf_counter()
    status = launch(command, output)
    elapsed = time.perf_counter() - start
    try:
        run = read_run(plan.directory / f"{run_id}.jsonl")
    except LogFormatError as exc:
        raise RuntimeError(f"{plan.label} failed (exit status {status}): {_last_line(output)}; "
                           f"log: {exc}; output: {output}") from None
    if status != 0 and not run.diverged:
        raise RuntimeError(f"{plan.label} exited with status {status} after finishing: "
                           f"{_last_line(output)}; output: {output}")
    say(f"[compare] finished {plan.label} in {elapsed:.1f} s: {_outcome(run)}")
    return run


def _outcome(run: RunRecord) -> str:
    if run.diverged:
        return f"diverged at step {run.diverged_step}/{run.total_steps}: {run.diverged_reason}"
    return f"final val_loss {run.final_val_loss:.4f}"


def _last_line(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no output)"
    # tqdm redraws with carriage returns: the last redraw is what was on screen.
    lines = [line.rsplit("\r", 1)[-1].strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    return lines[-1] if lines else "(no output)"


@dataclass(frozen=True)
class LeaderboardRow:
    """One setup's line. Ratios are ``setup mean / baseline mean``; p-values ``None`` where a
    test needs more runs (two finished runs on each side) or the row is the baseline."""

    setup: str
    preset: str
    runs: int
    diverged: int
    reached: int
    steps_to_target: Summary
    steps_ratio: float | None
    time_to_target_s: Summary
    time_ratio: float | None
    final_val_loss: Summary
    welch_p: float | None
    target_p: float | None
    step_avg_ms: Summary
    peak_memory_mib: Summary


@dataclass(frozen=True)
class LeaderboardRun:
    """One run's line: ``final_val_loss`` is NaN and the crossing ``None`` for a diverged run."""

    setup: str
    seed: int | None
    run_id: str
    path: str
    final_val_loss: float
    steps_to_target: float | None
    time_to_target_s: float | None
    step_avg_ms: float
    diverged_step: int | None
    diverged_reason: str


@dataclass(frozen=True)
class ScheduleRow:
    """One setup at one schedule length: does it reach the target in ``fraction`` x the
    baseline's steps? ``reaches``: its one-sided ``target_p`` is below ``SIGNIFICANCE``."""

    setup: str
    row: str
    fraction: float
    steps: int
    final_val_loss: Summary
    target_p: float | None
    reaches: bool


@dataclass(frozen=True)
class Leaderboard:
    """The comparison: target (and how it was set), baseline, one row per setup, every run,
    and (with ``--step-fractions``) each setup at every schedule length tried."""

    target: float
    target_rule: str
    baseline: str
    seeds: tuple[int, ...]
    train_args: tuple[str, ...]
    nproc: int
    rows: tuple[LeaderboardRow, ...]
    runs: tuple[LeaderboardRun, ...]
    schedules: tuple[ScheduleRow, ...] = ()


def build_leaderboard(groups: Mapping[str, Sequence[RunRecord]], config: CompareConfig) -> Leaderboard:
    """Statistics of every setup against the baseline (see the module docstring)."""
    baseline = config.baseline
    base_losses = [run.final_val_loss for run in groups[baseline] if not run.diverged]
    if config.target is not None:
        target, rule = config.target, "given"
    elif base_losses:
        target = sum(base_losses) / len(base_losses)
        rule = f"auto: mean final val loss of the baseline {baseline} (n={len(base_losses)})"
    else:
        raise ValueError(f"target: every run of the baseline {baseline!r} diverged, so there is no "
                         "auto target; give --target X")
    report = build_report(groups, target, baseline)
    by_name = {group.name: group for group in report.groups}
    welch = {c.candidate: c.p_value for c in report.comparisons if c.metric == "final_val_loss"}
    base = by_name[baseline]
    baseline_steps = max((run.total_steps for run in groups[baseline]), default=0)
    setups = {setup.name: setup for setup in expand_setups(config, baseline_steps)}
    rows = tuple(_row(group, base, welch.get(group.name), setups[group.name].preset)
                 for group in report.groups)
    runs = tuple(
        LeaderboardRun(
            setup=group.name, seed=run.seed, run_id=run.run_id, path=run.path,
            final_val_loss=run.final_val_loss, steps_to_target=run.target_step,
            time_to_target_s=run.target_time_s, step_avg_ms=run.step_avg_ms,
            diverged_step=run.diverged_step, diverged_reason=run.diverged_reason,
        )
        for group in report.groups
        for run in group.runs
    )
    schedules = ()
    if config.step_fractions:
        schedules = tuple(
            _schedule_row(setups[row.setup], row,
                          max((run.total_steps for run in groups[row.setup]), default=0))
            for row in rows if row.setup != baseline
        )
        order = {name: index for index, name in enumerate(setups)}
        schedules = tuple(sorted(schedules, key=lambda r: (order[r.setup], -r.fraction)))
    return Leaderboard(target=target, target_rule=rule, baseline=baseline,
                       seeds=tuple(config.seed_list), train_args=config.train_args,
                       nproc=config.nproc, rows=rows, runs=runs, schedules=schedules)


# One-sided p below which a schedule is said to reach the target.
SIGNIFICANCE = 0.05


def _schedule_row(setup: Setup, row: LeaderboardRow, steps: int) -> ScheduleRow:
    return ScheduleRow(setup=setup.family, row=row.setup, fraction=setup.fraction, steps=steps,
                       final_val_loss=row.final_val_loss, target_p=row.target_p,
                       reaches=row.target_p is not None and row.target_p < SIGNIFICANCE)


def shortest_schedules(board: Leaderboard) -> dict[str, ScheduleRow | None]:
    """Per setup, its shortest schedule that reaches the target (p < ``SIGNIFICANCE``), if any."""
    shortest: dict[str, ScheduleRow | None] = {}
    for row in board.schedules:
        best = shortest.get(row.setup)
        if row.reaches and (best is None or row.fraction < best.fraction):
            shortest[row.setup] = row
        else:
            shortest.setdefault(row.setup, None)
    return shortest


def _row(group: GroupReport, base: GroupReport, welch_p: float | None, preset: str) -> LeaderboardRow:
    test = group.target_test
    return LeaderboardRow(
        setup=group.name,
        preset=preset,
        runs=len(group.runs),
        diverged=group.diverged,
        reached=group.reached,
        steps_to_target=group.target_step,
        steps_ratio=_ratio(group.target_step, base.target_step),
        time_to_target_s=group.target_time_s,
        time_ratio=_ratio(group.target_time_s, base.target_time_s),
        final_val_loss=group.final_val_loss,
        welch_p=welch_p,
        target_p=None if test is None else test.p_value,
        step_avg_ms=group.step_avg_ms,
        peak_memory_mib=group.peak_memory_mib,
    )


def _ratio(value: Summary, base: Summary) -> float | None:
    if value.mean is None or not base.mean:
        return None
    return value.mean / base.mean


def format_leaderboard(board: Leaderboard) -> str:
    """The leaderboard as Markdown: the setups table, the definitions, then every run."""
    base = board.baseline
    header = ["setup", "preset", "runs", "reached", "steps to target", f"× {base}",
              "time to target (s)", f"× {base}", "final val loss", f"Welch p vs {base}",
              "p(loss < target)", "ms/step", "peak MiB"]
    rows = [header]
    for row in board.rows:
        runs = f"{row.runs}" + (f" ({row.diverged} diverged †)" if row.diverged else "")
        rows.append([
            row.setup + (" (baseline)" if row.setup == base else ""),
            row.preset,
            runs,
            f"{row.reached}/{row.runs}",
            _mean_std(row.steps_to_target, 1),
            _times(row.steps_ratio),
            _mean_std(row.time_to_target_s, 2),
            _times(row.time_ratio),
            _mean_std(row.final_val_loss, 4),
            "—" if row.setup == base else _p(row.welch_p),
            _p(row.target_p),
            _mean_std(row.step_avg_ms, 1),
            _mean_std(row.peak_memory_mib, 0),
        ])
    flags = " ".join(board.train_args) or "(none)"
    seeds = ", ".join(map(str, board.seeds))
    lines = [
        f"# Leaderboard: {', '.join(row.setup for row in board.rows)}",
        "",
        f"Target val loss **{board.target:.4f}** ({board.target_rule}). Seeds {seeds}; "
        f"{board.nproc} process(es) per run; train flags: `{flags}`.",
        "",
        *format_markdown_table(rows),
        "",
        "Mean ± std (ddof=1) over seeds. Steps and time to target: the first validation at or below "
        "the target, interpolated linearly between it and the validation before it; over the runs "
        "that reached the target (the *reached* column); × is the ratio of means to the baseline. "
        f"Welch p: two-sided Welch t-test of the final val loss against {base}. p(loss < target): "
        "one-sided one-sample t-test that the mean final val loss is below the target. "
        "Time is training time (validation excluded); peak MiB is CUDA's peak allocation, or the "
        "peak resident set on CPU. † Diverged runs count as not reaching the target and are left "
        "out of every other column.",
        "",
        *_schedule_section(board),
        "## Runs",
        "",
        *format_markdown_table(_run_rows(board)),
    ]
    return "\n".join(lines) + "\n"


def _schedule_section(board: Leaderboard) -> list[str]:
    """``## Steps to the target by schedule length`` (only with ``--step-fractions``)."""
    if not board.schedules:
        return []
    rows = [["setup", "row", f"steps (× {board.baseline})", "final val loss", "p(loss < target)",
             "reaches target"]]
    for row in board.schedules:
        rows.append([row.setup, row.row, f"{row.steps} ({row.fraction:.2f}×)",
                     _mean_std(row.final_val_loss, 4), _p(row.target_p),
                     "yes" if row.reaches else "no"])
    summary = []
    for setup, best in shortest_schedules(board).items():
        summary.append(f"- **{setup}**: " + (
            f"reaches {board.target:.4f} in {best.fraction:.2f}× {board.baseline}'s steps "
            f"({best.steps}; p = {format_p(best.target_p)})" if best is not None
            else "no schedule tried reaches the target with p < 0.05"))
    return [
        "## Steps to the target by schedule length",
        "",
        f"Each setup trained again with its whole schedule (warm-up and cooldown) shortened to a "
        f"fraction of {board.baseline}'s steps. A schedule reaches the target when the one-sided "
        f"t-test that its mean final val loss is below the target gives p < {SIGNIFICANCE}: the "
        "speedrun's criterion, where a record is the shortest schedule that reaches the loss.",
        "",
        *format_markdown_table(rows),
        "",
        *summary,
        "",
    ]


def _run_rows(board: Leaderboard) -> list[list[str]]:
    rows = [["setup", "seed", "run id", "final val loss", "steps to target", "time to target (s)",
             "ms/step", "status"]]
    for run in board.runs:
        rows.append([
            run.setup,
            "-" if run.seed is None else str(run.seed),
            run.run_id,
            "—" if run.diverged_step is not None else f"{run.final_val_loss:.4f}",
            "not reached" if run.steps_to_target is None else f"{run.steps_to_target:.1f}",
            "—" if run.time_to_target_s is None else f"{run.time_to_target_s:.2f}",
            f"{run.step_avg_ms:.1f}",
            "finished" if run.diverged_step is None
            else f"diverged † at step {run.diverged_step}: {run.diverged_reason}",
        ])
    return rows


def _mean_std(summary: Summary, digits: int) -> str:
    if summary.mean is None:
        return "—"
    if summary.std is None:
        return f"{summary.mean:.{digits}f}"
    return f"{summary.mean:.{digits}f} ± {summary.std:.{digits}f}"


def _times(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio:.2f}×"


def _p(p: float | None) -> str:
    text = format_p(p)
    return "—" if text == "-" else text


def write_leaderboard(board: Leaderboard, groups: Mapping[str, Sequence[RunRecord]],
                      out_dir: str | Path) -> list[Path]:
    """Write ``leaderboard.md``, ``leaderboard.json`` and the two loss-curve PNGs; return paths."""
    from nanoshampoo.evidence.plots import write_curve_plots  # matplotlib loads only here

    out_dir = Path(out_dir)
    markdown, data = out_dir / "leaderboard.md", out_dir / "leaderboard.json"
    with atomic_output(markdown) as tmp:
        tmp.write_text(format_leaderboard(board), encoding="utf-8")
    write_json(data, json_ready(board))
    return [markdown, data, *write_curve_plots(groups, board.target, out_dir)]
