"""``nanoshampoo tune``: tune one setup's hyper-parameters at an equal budget per trial.

A search names train flags by their field, ``muon.lr`` (``--muon.lr``) or ``cooldown_frac``:
``KEY=V1,V2,...`` is a grid (every combination of every grid is a trial), ``KEY=log:LO:HI`` a
log-uniform range, sampled ``trials`` times (with ``sample_seed``; grid keys are then drawn
from their values). Every trial trains with the same train flags, so the same budget: the
search may not touch ``num_iterations``, ``batch_size``, ``seq_len`` or ``grad_accum_steps``.

Trials are ``compare`` setups (one directory per point, named by its values: ``lr0.02``), so
finished runs are reused exactly as ``compare`` reuses them. Each trial trains ``seeds`` seeds
and is scored by its mean final validation loss (diverged seeds are left out; a trial whose
seeds all diverged has no score). The best trial is then trained up to ``confirm_seeds`` seeds.

Writes into ``out_dir``: ``tuning.md`` and ``tuning.json`` (every trial with its final loss, the
best point, a warning for every grid key whose best value is the grid's first or last, and for
every range key whose best value is the smallest or largest sampled), and ``tuned-SETUP.toml``, a
preset that extends the setup's preset with the tuned values, ready for ``compare``.

Example:
    >>> search = parse_search("muon.lr=0.01,0.02,0.04")
    >>> search.key, search.values
    ('muon.lr', ('0.01', '0.02', '0.04'))
    >>> [t.values for t in trial_points([search], trials=None, sample_seed=0)][:2]
    [{'muon.lr': '0.01'}, {'muon.lr': '0.02'}]
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanoshampoo.evidence.compare import (
    MANAGED_OPTIONS,
    CompareConfig,
    ConfigResolver,
    Launcher,
    Setup,
    launch_subprocess,
    resolve_train_config,
    run_compare,
)
from nanoshampoo.evidence.logs import RunRecord
from nanoshampoo.evidence.report import json_ready, write_json
from nanoshampoo.evidence.tables import format_markdown_table
from nanoshampoo.io_utils import atomic_output, check_output_dir

# Train fields that set a trial's budget: equal for every trial, so never searched.
BUDGET_FIELDS = ("num_iterations", "batch_size", "seq_len", "grad_accum_steps")


@dataclass(frozen=True)
class Search:
    """One searched key: a grid of ``values`` (flag text), or a log range ``low``..``high``."""

    key: str
    values: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None

    @property
    def is_range(self) -> bool:
        return self.low is not None

    @property
    def flag(self) -> str:
        return key_flag(self.key)


def key_flag(key: str) -> str:
    """The train flag of a field: ``muon_cwd.ns_steps`` -> ``--muon_cwd.ns-steps`` (a table's
    name keeps its underscores, as ``--help`` spells it; a field's become hyphens)."""
    table, dot, field = key.rpartition(".")
    return f"--{table}{dot}{field.replace('_', '-')}"


def parse_search(text: str) -> Search:
    """``KEY=V1,V2,...`` or ``KEY=log:LO:HI`` (``ValueError`` saying what is wrong)."""
    key, sep, spec = text.partition("=")
    key, spec = key.strip(), spec.strip()
    if not sep or not key or not spec:
        raise ValueError(f"search: expected KEY=V1,V2,... or KEY=log:LO:HI, got {text!r}")
    if key.replace(".", "_").split("_")[0] == "" or key.lstrip("-") != key:
        raise ValueError(f"search: {key!r} is a field name (muon.lr), not a flag")
    if key in BUDGET_FIELDS:
        raise ValueError(f"search: {key} sets the budget, which every trial shares")
    if "--" + key.replace("_", "-") in MANAGED_OPTIONS:
        raise ValueError(f"search: {key} is set by tune for each run, not a hyper-parameter")
    if spec.startswith("log:"):
        parts = spec.split(":")
        try:
            low, high = float(parts[1]), float(parts[2])
        except (IndexError, ValueError):
            raise ValueError(f"search: {key}: expected log:LO:HI, got {spec!r}") from None
        if len(parts) != 3 or not (0 < low < high and math.isfinite(high)):
            raise ValueError(f"search: {key}: a log range needs 0 < LO < HI, got {spec!r}")
        return Search(key, low=low, high=high)
    values = tuple(v.strip() for v in spec.split(","))
    if any(not v for v in values) or len(set(values)) != len(values):
        raise ValueError(f"search: {key}: empty or repeated values in {spec!r}")
    return Search(key, values=values)


@dataclass(frozen=True)
class Trial:
    """One point: flag text per searched key; ``name`` labels its directory."""

    values: dict[str, str]

    @property
    def name(self) -> str:
        return "-".join(f"{key.rsplit('.', 1)[-1]}{value}" for key, value in self.values.items())

    def args(self) -> tuple[str, ...]:
        return tuple(part for key, value in self.values.items()
                     for part in (key_flag(key), value))


def trial_points(searches: Sequence[Search], trials: int | None, sample_seed: int) -> list[Trial]:
    """Every grid point (no ranges), or ``trials`` random points (ranges log-uniform)."""
    keys = [s.key for s in searches]
    if len(set(keys)) != len(keys):
        raise ValueError(f"search: a key is searched twice in {keys}")
    if not any(s.is_range for s in searches):
        if trials is not None:
            raise ValueError("trials: random points need a log:LO:HI range; a grid runs every point")
        return [Trial(dict(zip(keys, point)))
                for point in itertools.product(*(s.values for s in searches))]
    if trials is None or trials < 1:
        raise ValueError("trials: a log:LO:HI range needs --trials N (N >= 1)")
    rng = random.Random(sample_seed)
    points = []
    for _ in range(trials):
        point = {}
        for s in searches:
            if s.is_range:
                assert s.low is not None and s.high is not None
                value = math.exp(rng.uniform(math.log(s.low), math.log(s.high)))
                point[s.key] = f"{value:.4g}"
            else:
                point[s.key] = rng.choice(s.values)
        points.append(Trial(point))
    return points


@dataclass(frozen=True)
class TuneConfig:
    """What to tune: ``setup`` (a compare setup: preset), the searches, seeds per trial, the
    seeds of the best trial's confirmation (0: none), and where the runs and files go."""

    setup: Setup
    searches: tuple[Search, ...]
    trials: int | None = None
    seeds: int = 1
    confirm_seeds: int = 0
    seed0: int = 0
    sample_seed: int = 0
    nproc: int = 1
    out_dir: Path = Path("runs/tune")
    train_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.searches:
            raise ValueError("search: give at least one --search KEY=...")
        if self.seeds < 1:
            raise ValueError(f"seeds: must be >= 1, got {self.seeds}")
        if self.confirm_seeds < 0:
            raise ValueError(f"confirm-seeds: must be >= 0, got {self.confirm_seeds}")
        searched = {s.flag for s in self.searches}
        clash = sorted(a for a in self.train_args if a.split("=")[0] in searched)
        if clash:
            raise ValueError(f"train flags: {clash} are searched; leave them to the search")
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        trial_points(self.searches, self.trials, self.sample_seed)  # validates the search
        check_range_kinds(self.searches)
        check_output_dir(self.out_dir, "--out-dir")

    def points(self) -> list[Trial]:
        return trial_points(self.searches, self.trials, self.sample_seed)


def check_range_kinds(searches: Sequence[Search]) -> None:
    """A log range samples real numbers: refuse one over a field that is not a float (an
    int field's samples would not parse; give it a grid). Unknown keys are left to the run
    config's check."""
    from nanoshampoo.train.config import (  # imports torch: only when a range is checked
        TrainConfig,
        table_field_types,
    )

    run_kinds = typing.get_type_hints(TrainConfig)
    tables = table_field_types()
    for s in searches:
        if not s.is_range:
            continue
        table, dot, name = s.key.partition(".")
        kind = tables.get(table, {}).get(name) if dot else run_kinds.get(s.key)
        kind = kind if kind is None or isinstance(kind, str) else kind.__name__
        if kind is not None and kind != "float":
            raise ValueError(f"search: {s.key}: a log range samples real numbers, but "
                             f"{s.key} is {kind}; give it a grid ({s.key}=V1,V2,...)")


@dataclass(frozen=True)
class TrialResult:
    """A trial's point, its seeds' final losses (NaN for a diverged seed) and its score: the
    mean over the finished seeds (None when every seed diverged)."""

    name: str
    values: dict[str, str]
    finals: tuple[float, ...]
    score: float | None


@dataclass(frozen=True)
class TuneResult:
    setup: str
    preset: str
    train_args: tuple[str, ...]
    seeds: int
    trials: tuple[TrialResult, ...]
    best: str
    best_values: dict[str, Any]
    edge_warnings: tuple[str, ...]
    confirm_finals: tuple[float, ...] = ()
    preset_file: str = ""
    typed_values: dict[str, Any] = field(default_factory=dict)


def _final(run: RunRecord) -> float:
    return math.nan if run.diverged else run.final_val_loss


def _score(runs: Sequence[RunRecord]) -> float | None:
    finished = [run.final_val_loss for run in runs if not run.diverged]
    return sum(finished) / len(finished) if finished else None


def edge_warnings(searches: Sequence[Search], trials: Sequence[TrialResult],
                  best: TrialResult) -> list[str]:
    """A warning per key whose best value lies on the edge of what was tried."""
    warnings = []
    for s in searches:
        value = best.values[s.key]
        if s.is_range:
            tried = sorted({float(t.values[s.key]) for t in trials})
            on_edge = len(tried) > 1 and float(value) in (tried[0], tried[-1])
        else:
            on_edge = len(s.values) > 1 and value in (s.values[0], s.values[-1])
        if on_edge:
            warnings.append(f"{s.key} = {value} is on the edge of the values tried: the optimum "
                            "may lie beyond it; widen the search")
    return warnings


def tune(config: TuneConfig, resolve: ConfigResolver = resolve_train_config,
         launch: Launcher = launch_subprocess,
         say: Callable[[str], None] = lambda line: print(line, flush=True)) -> TuneResult:
    """Train (or reuse) every trial, pick the best, confirm it, write the files."""
    points = config.points()
    trial_setups = tuple(Setup(t.name, config.setup.preset, args=t.args()) for t in points)
    first = resolve((*config.train_args, "--preset", config.setup.preset,
                     *trial_setups[0].args, "--seed", str(config.seed0)))
    unread = [s.key for s in config.searches if s.key not in first]
    if unread:
        raise ValueError(f"search: {unread} are not fields that setup {config.setup.name!r} "
                         f"reads (its fields: {sorted(first)})")
    trial_runs = run_compare(CompareConfig(
        setups=trial_setups, seeds=config.seeds, seed0=config.seed0, nproc=config.nproc,
        out_dir=config.out_dir / "trials", train_args=config.train_args), resolve, launch, say)
    results = tuple(TrialResult(t.name, t.values, tuple(_final(r) for r in trial_runs[t.name]),
                                _score(trial_runs[t.name])) for t in points)
    scored = [r for r in results if r.score is not None]
    if not scored:
        raise RuntimeError(f"tune {config.setup.name}: every seed of every trial diverged")
    best = min(scored, key=lambda r: r.score)  # type: ignore[arg-type, return-value]
    best_setup = next(s for s in trial_setups if s.name == best.name)
    confirm: tuple[float, ...] = ()
    if config.confirm_seeds:
        runs = run_compare(CompareConfig(
            setups=(best_setup,), seeds=config.confirm_seeds, seed0=config.seed0,
            nproc=config.nproc, out_dir=config.out_dir / "trials",
            train_args=config.train_args), resolve, launch, say)[best.name]
        confirm = tuple(_final(r) for r in runs)
    resolved = resolve((*config.train_args, "--preset", config.setup.preset, *best_setup.args,
                        "--seed", str(config.seed0)))
    typed = {s.key: resolved[s.key] for s in config.searches}
    result = TuneResult(setup=config.setup.name, preset=config.setup.preset,
                        train_args=config.train_args, seeds=config.seeds, trials=results,
                        best=best.name, best_values=best.values,
                        edge_warnings=tuple(edge_warnings(config.searches, results, best)),
                        confirm_finals=confirm, typed_values=typed)
    return write_tuning(result, config.out_dir)


def tuned_preset_text(result: TuneResult) -> str:
    """A preset that extends the tuned setup's preset with the best values (TOML)."""
    base = result.preset
    if base.endswith(".toml") or "/" in base:
        base = str(Path(base).resolve())
    lines = [f"# {result.setup} tuned by nanoshampoo tune: best of {len(result.trials)} trials "
             f"at {result.seeds} seed(s) each (tuning.md).",
             f"extends = {json.dumps(base)}"]
    tables: dict[str, list[str]] = {}
    for key, value in result.typed_values.items():
        table, dot, name = key.rpartition(".")
        line = f"{name if dot else key} = {_toml_value(value)}"
        if dot:
            tables.setdefault(table, []).append(line)
        else:
            lines.append(line)
    for table, entries in tables.items():
        lines += ["", f"[{table}]", *entries]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)


def write_tuning(result: TuneResult, out_dir: Path) -> TuneResult:
    """Write ``tuning.md``, ``tuning.json`` and ``tuned-SETUP.toml``; return the result with
    the preset file's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    preset = out_dir / f"tuned-{result.setup}.toml"
    with atomic_output(preset) as tmp:
        tmp.write_text(tuned_preset_text(result), encoding="utf-8")
    result = dataclasses.replace(result, preset_file=str(preset))
    with atomic_output(out_dir / "tuning.md") as tmp:
        tmp.write_text(format_tuning(result), encoding="utf-8")
    write_json(out_dir / "tuning.json", json_ready(result))
    return result


def format_tuning(result: TuneResult) -> str:
    keys = list(result.trials[0].values)
    rows = [["trial", *keys, "final val loss per seed", "mean"]]
    for trial in sorted(result.trials, key=lambda t: math.inf if t.score is None else t.score):
        rows.append([trial.name + (" (best)" if trial.name == result.best else ""),
                     *(trial.values[k] for k in keys),
                     ", ".join("diverged" if math.isnan(f) else f"{f:.4f}" for f in trial.finals),
                     "—" if trial.score is None else f"{trial.score:.4f}"])
    flags = " ".join(result.train_args) or "(none)"
    lines = [f"# Tuning {result.setup} (preset {result.preset})", "",
             f"{len(result.trials)} trials, {result.seeds} seed(s) each, the same train flags "
             f"for every trial: `{flags}`. Best: **{result.best}** "
             f"({', '.join(f'{k} = {v}' for k, v in result.best_values.items())}).", "",
             *format_markdown_table(rows), ""]
    lines += [f"**Warning**: {w}" for w in result.edge_warnings]
    if result.confirm_finals:
        finished = [f for f in result.confirm_finals if not math.isnan(f)]
        mean = sum(finished) / len(finished) if finished else math.nan
        lines += ["", f"Confirmed over {len(result.confirm_finals)} seeds: "
                      f"{', '.join(f'{f:.4f}' for f in result.confirm_finals)} (mean {mean:.4f})."]
    lines += ["", f"Tuned preset: `{result.preset_file}`."]
    return "\n".join(lines) + "\n"
