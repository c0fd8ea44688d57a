"""``nanoshampoo study``: the whole question in one command, answered as curves.

For every model size of a study definition (:mod:`study_definition`) and every setup, in
that order: ``tune`` the setup at that size with an equal budget of trials (its search, one
seed per trial, the decay branches as successive halving's rungs or, with halving off, only
recorded), then train the best
point at every seed, each run with a decay branch at every budget, so each seed gives the whole
loss-versus-budget curve. From those final losses (:class:`~nanoshampoo.evidence.scaling.
Observation`, one per setup, size, budget and seed):

- the baseline's ``L(D) = a D^-alpha + c`` per size and every setup's speedup ``D_eff / D``
  with a bootstrap interval over seeds (:mod:`scaling`);
- Welch's test against the baseline at each (size, budget) (one budget, where it applies);
- an AlgoPerf performance profile over the (size, budget) cells (:mod:`setup_scores`);
- each setup's tunability at each size: the share of its trials within 1 % of its best;
- with ``halving = "off"`` (every trial trained to its end), the grid's best point at every
  budget, from the trials' decay branches: where it moves with the budget.

Writes ``study.md``, ``study.json`` and the plots (``speedups.png``, ``baseline_fits.png``,
``performance_profile.png``) into the out dir; the tuning of each (size, setup) lives in
``OUT/SIZE/SETUP/`` (``tuning.md``, its store, its runs). Everything goes through one trial store
(``--storage``; a SQLite file in the out dir by default), so the same command started on other
machines against a shared PostgreSQL adds workers, and a finished study is read back, not
retrained.

Example:
    >>> from nanoshampoo.evidence.study_definition import load_definition
    >>> plan = StudyPlan(load_definition("cpu"), Path("runs/study"))  # doctest: +SKIP
    >>> result = run_study(plan)  # doctest: +SKIP
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nanoshampoo.evidence.compare import ConfigResolver, Setup, resolve_train_config
from nanoshampoo.evidence.logs import LogFormatError, RunRecord, read_run
from nanoshampoo.evidence.report import json_ready, write_json
from nanoshampoo.evidence.scaling import (
    BudgetComparison,
    Observation,
    ScalingStudy,
    budget_comparisons,
    estimate_speedups,
)
from nanoshampoo.evidence.scaling_plots import write_scaling_plots
from nanoshampoo.evidence.scaling_report import format_count, format_study_markdown, study_to_dict
from nanoshampoo.evidence.setup_scores import PerformanceProfile, performance_profile
from nanoshampoo.evidence.stats import summarize
from nanoshampoo.evidence.study_definition import StudyDefinition
from nanoshampoo.evidence.tables import format_markdown_table
from nanoshampoo.evidence.telemetry_summary import telemetry_section
from nanoshampoo.evidence.trainer_process import shared_probe_cache
from nanoshampoo.evidence.tune import TuneConfig, TuneSession
from nanoshampoo.evidence.tune_report import TuneResult
from nanoshampoo.evidence.tune_space import parse_search
from nanoshampoo.io_utils import atomic_output, check_output_dir


@dataclass(frozen=True)
class StudyPlan:
    """A definition, where its files go, and its trial store (``None``: ``OUT/SIZE/SETUP``'s
    SQLite files)."""

    definition: StudyDefinition
    out_dir: Path
    storage: str | None = None
    nproc: int = 1
    resamples: int = 1000

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        if self.nproc < 1:
            raise ValueError(f"nproc: must be >= 1, got {self.nproc}")
        if self.resamples < 100:
            raise ValueError(
                f"resamples: at least 100 for 2.5-97.5 percentiles, got {self.resamples}"
            )
        check_output_dir(self.out_dir, "--out-dir")

    def tune_config(self, size: str, setup_name: str) -> TuneConfig:
        """The tune of ``setup_name`` at ``size``: its search, one seed per trial, the study's
        seeds at the best point, every budget but the last as a rung (a decay branch)."""
        definition = self.definition
        setup = definition.setup(setup_name)
        storage = self.storage
        config = TuneConfig(
            setup=Setup(setup.name, setup.preset),
            searches=tuple(parse_search(s) for s in setup.search),
            trials=setup.trials,
            seeds=1,
            confirm_seeds=definition.seeds,
            nproc=self.nproc,
            out_dir=self.out_dir / size / setup.name,
            train_args=(*definition.train_args, "--model", size),
            rungs=definition.branches,
            halving=definition.halving,
            storage=storage,
        )
        # Named by size and setup for people, and by the digest of the tune's definition so
        # that a changed grid or train flag is a new study (reusing the runs that ended),
        # never trials mixed into the old one.
        return replace(config, study=f"{size}.{config.study_name}")


@dataclass(frozen=True)
class CellRuns:
    """One (size, setup): its tune and the runs of its best point, one per seed."""

    size: str
    setup: str
    tune: TuneResult
    runs: tuple[RunRecord, ...]
    tokens_per_step: int


@dataclass
class StudyResult:
    plan: StudyPlan
    cells: list[CellRuns]
    observations: list[Observation]
    scaling: ScalingStudy
    comparisons: tuple[BudgetComparison, ...]
    profile: PerformanceProfile
    non_embedding_params: dict[str, int]
    files: list[Path] = field(default_factory=list)


def check_study(
    plan: StudyPlan,
    resolve: ConfigResolver = resolve_train_config,
    build: Callable[[TuneConfig], TuneSession] | None = None,
) -> dict[tuple[str, str], TuneSession]:
    """Build every (size, setup)'s tune session: each checks its search against the setup, every
    grid value and the rungs through the trainer's parser, and that a study of its name already
    in the store is its own; it writes nothing. So a malformed setup fails the study before any
    trial trains."""
    build = build or (lambda config: TuneSession(config, resolve))
    sessions = {}
    for size in plan.definition.sizes:
        for setup in plan.definition.setups:
            try:
                session = build(plan.tune_config(size, setup.name))
                session.check_store()
                sessions[(size, setup.name)] = session
            except ValueError as exc:
                raise ValueError(f"study: size {size}, setup {setup.name}: {exc}") from None
    return sessions


def run_study(
    plan: StudyPlan,
    resolve: ConfigResolver = resolve_train_config,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
    build: Callable[[TuneConfig], TuneSession] | None = None,
) -> StudyResult:
    """Tune and train every (size, setup) (or read them back), then analyse and write."""
    with shared_probe_cache(plan.out_dir):
        return _run_study(plan, resolve, say, build)


def _run_study(
    plan: StudyPlan,
    resolve: ConfigResolver,
    say: Callable[[str], None],
    build: Callable[[TuneConfig], TuneSession] | None,
) -> StudyResult:
    definition = plan.definition
    sessions = check_study(plan, resolve, build)
    cells = len(sessions)
    say(
        f"[study] {len(definition.setups)} setups x {len(definition.sizes)} sizes = {cells} "
        f"tunes; budgets {', '.join(f'{b:g}' for b in definition.budgets)} of each run; "
        f"{definition.seeds} seeds at each best point; into {plan.out_dir}"
    )
    # Every tune's trials first, none waiting on another worker's, so workers sharing the
    # store stay busy; then each tune ends (waiting for the other workers' trials) and confirms.
    for index, ((size, name), session) in enumerate(sessions.items(), start=1):
        say(f"[study] trials {index}/{cells}: {name} at {size}")
        session.work(wait=False)
    runs = []
    for index, ((size, name), session) in enumerate(sessions.items(), start=1):
        start = time.perf_counter()
        say(f"[study] best point {index}/{cells}: {name} at {size}")
        result = session.finish()
        base = resolve(session.config.base_argv())
        runs.append(
            CellRuns(
                size,
                name,
                result,
                _seed_runs(result, size, name),
                int(base["batch_size"]) * int(base["seq_len"]),
            )
        )
        say(
            f"[study] {index}/{cells}: {name} at {size} done in {time.perf_counter() - start:.0f}"
            f" s: best {result.best_values}, final val_loss {result.best_value:.4f}"
        )
    return analyse(plan, runs)


def _seed_runs(result: TuneResult, size: str, setup: str) -> tuple[RunRecord, ...]:
    runs = []
    for path in result.confirm_logs:
        try:
            runs.append(read_run(path))
        except LogFormatError as exc:
            raise RuntimeError(f"study: {setup} at {size}: {exc}") from None
    return tuple(runs)


def observations(cells: Sequence[CellRuns]) -> list[Observation]:
    """One observation per (setup, size, budget, seed): each seed run's decay branches and its
    own final loss (NaN where it or the branch diverged), at ``steps x tokens per step``."""
    found = []
    for cell in cells:
        for run in cell.runs:
            seed = 0 if run.seed is None else run.seed
            for steps, loss in run.final_losses_by_steps().items():
                found.append(
                    Observation(cell.setup, cell.size, steps * cell.tokens_per_step, seed, loss)
                )
    return found


def analyse(plan: StudyPlan, cells: Sequence[CellRuns]) -> StudyResult:
    """The study's statistics and files from its runs."""
    from nanoshampoo.model.gpt import gpt_preset, non_embedding_parameters  # imports torch

    definition = plan.definition
    found = observations(cells)
    params = {
        size: non_embedding_parameters(gpt_preset(size, vocab_size=1)) for size in definition.sizes
    }
    scaling = estimate_speedups(found, definition.baseline, resamples=plan.resamples)
    result = StudyResult(
        plan,
        list(cells),
        found,
        scaling,
        budget_comparisons(found, definition.baseline),
        performance_profile(found),
        params,
    )
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    result.files = write_scaling_plots(scaling, found, plan.out_dir, result.profile)
    with atomic_output(plan.out_dir / "study.md") as tmp:
        tmp.write_text(format_study(result), encoding="utf-8")
    write_json(plan.out_dir / "study.json", study_json(result))
    result.files += [plan.out_dir / "study.md", plan.out_dir / "study.json"]
    return result


def format_study(result: StudyResult) -> str:
    """``study.md``: what was asked, the speedups, Welch per budget, tunability, the plots."""
    definition = result.plan.definition
    lines = [
        f"# Study: {', '.join(s.name for s in definition.setups)} against {definition.baseline}",
        "",
    ]
    lines += _definition_lines(result)
    lines += [
        "",
        format_study_markdown(result.scaling, result.non_embedding_params, result.profile).rstrip(),
        "",
    ]
    lines += [
        "### Final validation loss at each budget (mean ± std over seeds; Welch's p "
        "against the baseline)",
        "",
    ]
    lines += _loss_table(result)
    lines += [
        "",
        "### Tunability: the share of a setup's trials within 1 % of its best "
        "(pruned trials count as not within)",
        "",
    ]
    lines += _tunability_table(result)
    lines += _edge_note(result)
    lines += _budget_best_section(result)
    lines += ["", *telemetry_section(_runs_by_setup(result))]
    lines += [
        "",
        "![speedup against budget](speedups.png)",
        "",
        "![the baseline's fitted curves](baseline_fits.png)",
        "",
        "![performance profile](performance_profile.png)",
        "",
    ]
    return "\n".join(lines)


def _runs_by_setup(result: StudyResult) -> dict[str, list[str]]:
    """The run logs of each setup's best points, every size together (for the telemetry)."""
    runs: dict[str, list[str]] = {}
    for cell in result.cells:
        runs.setdefault(cell.setup, []).extend(str(run.path) for run in cell.runs)
    return runs


def _definition_lines(result: StudyResult) -> list[str]:
    definition = result.plan.definition
    tokens = {cell.size: cell.tokens_per_step for cell in result.cells}
    rows = [["size", "N (non-emb.)", "budgets (steps)", "budgets (tokens)", "tokens / N"]]
    for size in definition.sizes:
        steps = sorted(
            {
                s
                for cell in result.cells
                if cell.size == size
                for run in cell.runs
                for s in run.final_losses_by_steps()
            }
        )
        n = result.non_embedding_params[size]
        rows.append(
            [
                size,
                format_count(n),
                ", ".join(str(s) for s in steps),
                ", ".join(format_count(s * tokens[size]) for s in steps),
                ", ".join(f"{s * tokens[size] / n:.2g}" for s in steps),
            ]
        )
    searches = [["setup", "preset", "search", "trials", "sampler"]]
    for cell in result.cells:
        if cell.size == definition.sizes[0]:
            setup = definition.setup(cell.setup)
            searches.append(
                [
                    setup.name,
                    setup.preset,
                    "; ".join(setup.search),
                    str(cell.tune.budget),
                    cell.tune.sampler,
                ]
            )
    return (
        [
            f"{definition.seeds} seeds per (setup, size) at its best point; every budget "
            "from one run per seed (decay branches: "
            f"{', '.join(f'{b:g}' for b in definition.branches)} "
            f"of the full run). Definition: {definition.source}; train flags: "
            f"`{' '.join(definition.train_args)}`.",
            "",
        ]
        + format_markdown_table(rows)
        + [""]
        + format_markdown_table(searches)
    )


def _loss_table(result: StudyResult) -> list[str]:
    definition = result.plan.definition
    by_cell = {(c.size, c.tokens, c.comparison.candidate): c.comparison for c in result.comparisons}
    rows = [["size", "setup", *[f"{b:g}" for b in definition.budgets]]]
    for size in definition.sizes:
        budgets = sorted({o.tokens for o in result.observations if o.size == size})
        for setup in definition.setups:
            cells = []
            for tokens in budgets:
                losses = [
                    o.loss
                    for o in result.observations
                    if (o.size, o.setup, o.tokens) == (size, setup.name, tokens)
                ]
                cells.append(_mean_std(losses) + _p(by_cell.get((size, tokens, setup.name))))
            rows.append([size, setup.name, *cells])
    return format_markdown_table(rows)


def _mean_std(losses: Sequence[float]) -> str:
    finite = [x for x in losses if math.isfinite(x)]
    diverged = len(losses) - len(finite)
    if not finite:
        return f"diverged ({diverged} of {len(losses)})"
    summary = summarize(finite)
    text = (
        f"{summary.mean:.4f}" if summary.std is None else f"{summary.mean:.4f} ± {summary.std:.4f}"
    )
    return text + (f" ({diverged} diverged)" if diverged else "")


def _p(comparison: Any) -> str:
    if comparison is None or comparison.p_value is None:
        return ""
    return f", p {comparison.p_value:.2g}"


def _tunability_table(result: StudyResult) -> list[str]:
    rows = [
        [
            "size",
            "setup",
            "within 1 % of best",
            "trials: complete / pruned / failed",
            "best point",
            "best trial's final loss",
            "best on the search's edge",
        ]
    ]
    for cell in result.cells:
        states = [t.state for t in cell.tune.trials]
        share = cell.tune.tunability
        rows.append(
            [
                cell.size,
                cell.setup,
                f"{share.within} of {share.trials} ({100 * share.share:.0f} %)",
                f"{states.count('complete')} / {states.count('pruned')} / {states.count('failed')}",
                ", ".join(f"{k}={v}" for k, v in cell.tune.best_values.items()),
                f"{cell.tune.best_value:.4f}",
                ", ".join(cell.tune.on_edge) or "-",
            ]
        )
    return format_markdown_table(rows)


def _edge_note(result: StudyResult) -> list[str]:
    """What a best point on its search's edge means for the speedups, when there is one."""
    baseline = result.plan.definition.baseline
    edges = [c for c in result.cells if c.tune.on_edge]
    if not edges:
        return []
    sizes = sorted({c.size for c in edges if c.setup == baseline})
    text = (
        "A best point on its search's edge may not be the setup's optimum: the loss may fall "
        "further beyond it. A setup tuned on an edge may understate its own speedup"
    )
    if sizes:
        text += (
            f"; the baseline ({baseline}) is on an edge at {', '.join(sizes)}, so every speedup "
            "there may be overstated. Widen its search to check"
        )
    return ["", text + "."]


def _budget_best_section(result: StudyResult) -> list[str]:
    """Each cell's best grid point at every budget, from its trials' decay branches: only
    when every trial trained to its end (halving off), so each budget ranks every point."""
    if result.plan.definition.halving != "off":
        return []
    steps = sorted(
        {s for cell in result.cells for t in cell.tune.trials for s in t.rungs}
        | {s for cell in result.cells for run in cell.runs for s in run.final_losses_by_steps()}
    )
    rows = [["size", "setup", *(f"{s} steps" for s in steps)]]
    moved = 0
    for cell in result.cells:
        trials = [t for t in cell.tune.trials if t.state == "complete"]
        full = max(steps)
        row = [cell.size, cell.setup]
        for s in steps:
            losses = {t.name: (t.value if s == full else t.rungs.get(s)) for t in trials}
            if any(v is None for v in losses.values()) or not losses:
                row.append("–")
                continue
            best = min(trials, key=lambda t: (losses[t.name], t.number))
            same = best.params == cell.tune.best_values
            moved += not same
            point = ", ".join(f"{k.split('.')[-1]} {v}" for k, v in best.params.items())
            row.append(f"{point}: {losses[best.name]:.4f}" + ("" if same else " *"))
        rows.append(row)
    return [
        "",
        "### The grid's best point at each budget (one seed per point, from every trial's "
        "decay branches)",
        "",
        *format_markdown_table(rows),
        "",
        f"`*`: not the full budget's best point ({moved} of {len(result.cells) * len(steps)} "
        "cells). The seeds above train the full budget's best point, so a shorter budget's "
        "losses and speedups are read at hyper-parameters tuned for the full run, as one tune "
        "at the full budget gives them.",
    ]


def format_summary(result: StudyResult) -> str:
    """The console's summary: the speedup table (study.md has the rest)."""
    return format_study_markdown(
        result.scaling, result.non_embedding_params, result.profile
    ).rstrip()


@dataclass(frozen=True)
class _StudyRecord:
    """study.json's shape (a dataclass, so ``json_ready`` makes strict JSON of it)."""

    definition: StudyDefinition
    out_dir: str
    scaling: dict[str, Any]
    observations: list[Observation]
    welch: tuple[BudgetComparison, ...]
    tunes: list[dict[str, Any]]


def stored_storage(url: str, out_dir: Path) -> str:
    """A trial store as study.json records it: a SQLite file inside ``out_dir`` as its path
    relative to ``out_dir`` (``tiny/adamw/study.db``), so the file names no folder outside the
    study; any other store as its URL (password hidden, as ``tune`` shows it)."""
    prefix = "sqlite:///"
    if url.startswith(prefix):
        path = Path(url.removeprefix(prefix))
        if path.is_relative_to(out_dir.resolve()):
            return path.relative_to(out_dir.resolve()).as_posix()
    return url


def study_json(result: StudyResult) -> dict[str, Any]:
    """study.json: the definition, the scaling analysis, every observation, Welch at every
    budget, and each tune's best point, trials, tunability and seed runs."""
    tunes = [
        {
            "size": c.size,
            "setup": c.setup,
            "study": c.tune.study,
            "storage": stored_storage(c.tune.storage, result.plan.out_dir),
            "best": c.tune.best_values,
            "best_value": c.tune.best_value,
            "tunability": c.tune.tunability,
            "on_edge": c.tune.on_edge,
            "trials": list(c.tune.trials),
            "runs": [str(r.path) for r in c.runs],
        }
        for c in result.cells
    ]
    record = _StudyRecord(
        result.plan.definition,
        str(result.plan.out_dir),
        study_to_dict(result.scaling, result.non_embedding_params, result.profile),
        result.observations,
        result.comparisons,
        tunes,
    )
    return json_ready(record)  # type: ignore[no-any-return]
