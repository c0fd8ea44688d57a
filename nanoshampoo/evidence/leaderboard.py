"""The ``compare`` leaderboard: statistics of every setup's runs against the baseline.

Per setup (mean ± unbiased std over seeds):

* the target is the baseline's mean final validation loss (``--target auto``, the speedrun
  tracks' definition) or a given number;
* steps to target: the first validation at or below the target, linearly interpolated (in the
  loss, hence in step and time) between it and the validation before it, so the resolution is
  finer than ``val_every``; averaged over the runs that reached the target, shown with how
  many did; the ratio to the baseline is the ratio of the means; same for time to target
  (training time, validation excluded);
* final val loss, Welch's two-sided p against the baseline, and the one-sided one-sample
  t-test p that the mean final loss is below the target;
* the seeds per side that Welch's p < 0.05 would need at the observed gap to the baseline and
  the observed spreads (``speedrun_rules.seeds_for_significance``);
* under ``--rule track3`` also the optimization track's verdicts (``speedrun_rules``): the
  one-record rule against the target, the pairwise rule against the baseline (steps credited
  at 0.0045 loss per 100), and a refusal when the seeds of a setup stopped at different steps;
* ms/step and peak memory (MiB; the process's peak RSS on CPU);
* MFU: the model FLOPs utilisation each run's JSONL log states in its ``final`` record (its
  matmul FLOPs / training time / the probed matmul peak, ``train/throughput.py``), averaged
  over the finished runs that have one; "—" for a setup whose logs have none (text logs,
  trainers from before MFU was logged), and "(k/n runs)" when only some have;
* n runs, of which diverged: left out of every mean and test, counted as not reaching the
  target, and marked;
* when the runs have decay branches (``--decay-branches``): the final val loss at each budget
  they trained, per setup (``stats.BudgetSummary``), and, when the baseline's runs give at least
  four budgets, each setup's speedup read off the baseline's fitted loss-versus-budget curve
  (``scaling``: ``D_eff / D`` with a bootstrap interval over seeds), the reading that replaces
  steps to target, which is read inside the baseline's own decay (labelled *mid-run*).

Example:
    >>> board = build_leaderboard(groups, config)  # doctest: +SKIP
    >>> write_leaderboard(board, groups, config.out_dir)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nanoshampoo.evidence.budget_readings import (
    budget_section,
    fitted_section,
    fitted_speedups,
    model_scale,
)
from nanoshampoo.evidence.compare import CompareConfig, Setup, expand_setups
from nanoshampoo.evidence.logs import RunRecord
from nanoshampoo.evidence.report import format_p, json_ready, write_json
from nanoshampoo.evidence.scaling import ScalingStudy
from nanoshampoo.evidence.speedrun_rules import (
    PairwiseTest,
    RecordTest,
    check_same_steps,
    pairwise_test,
    record_test,
    seeds_for_record,
    seeds_for_significance,
)
from nanoshampoo.evidence.stats import BudgetSummary, GroupReport, Summary, build_report
from nanoshampoo.evidence.tables import format_markdown_table
from nanoshampoo.evidence.telemetry_summary import telemetry_section
from nanoshampoo.io_utils import atomic_output

RULE_TEXT = {
    "welch": "welch: Welch's two-sided t-test against the baseline, one-sided t-test against "
    "the target",
    "track3": "track3: the optimization track's fixed-sigma rules (σ = 0.0013; a record needs "
    "(target − mean)·√n ≥ 0.004; pairwise: steps credited at 0.0045 loss per 100 "
    "steps; every seed stops at the same step), next to Welch's test",
}


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
    # Seeds per side for Welch's p < 0.05 at the observed gap and spreads (None: baseline, no
    # gap, or a side without a spread).
    seeds_needed: int | None = None
    # The step every seed stopped at (the largest, under --rule welch).
    steps: int = 0
    # --rule track3 only: the record rule against the target, the pairwise rule against the
    # baseline (None for the baseline), the seeds the record rule needs at this gap.
    record: RecordTest | None = None
    pairwise: PairwiseTest | None = None
    seeds_for_record: int | None = None
    # Over the finished runs whose log states an MFU (a fraction; ``mfu.n`` of them).
    mfu: Summary = Summary(0, None, None)
    # The final loss at each budget the runs trained (decay branches; empty without them).
    budgets: tuple[BudgetSummary, ...] = ()


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
    mfu: float | None = None


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
    rule: str
    seeds: tuple[int, ...]
    train_args: tuple[str, ...]
    nproc: int
    rows: tuple[LeaderboardRow, ...]
    runs: tuple[LeaderboardRun, ...]
    schedules: tuple[ScheduleRow, ...] = ()
    # The speedups off the baseline's fitted curve (budgets in steps), or why there are none
    # although the runs have decay branches ("" when they have none).
    fitted: ScalingStudy | None = None
    fitted_note: str = ""
    # The model and budget of the baseline's runs, as their logs state them ("" for logs
    # without a config): non-embedding parameters and tokens per parameter.
    scale: str = ""


def build_leaderboard(
    groups: Mapping[str, Sequence[RunRecord]], config: CompareConfig
) -> Leaderboard:
    """Statistics of every setup against the baseline (see the module docstring).

    Under ``config.rule == "track3"`` a setup whose finished seeds stopped at different steps
    raises ``ValueError`` naming it.
    """
    baseline = config.baseline
    base_losses = [run.final_val_loss for run in groups[baseline] if not run.diverged]
    if config.target is not None:
        target, rule = config.target, "given"
    elif base_losses:
        target = sum(base_losses) / len(base_losses)
        rule = f"auto: mean final val loss of the baseline {baseline} (n={len(base_losses)})"
    else:
        raise ValueError(
            f"target: every run of the baseline {baseline!r} diverged, so there is no "
            "auto target; give --target X"
        )
    report = build_report(groups, target, baseline)
    by_name = {group.name: group for group in report.groups}
    welch = {c.candidate: c.p_value for c in report.comparisons if c.metric == "final_val_loss"}
    base = by_name[baseline]
    baseline_steps = max((run.total_steps for run in groups[baseline]), default=0)
    setups = {setup.name: setup for setup in expand_setups(config, baseline_steps)}
    steps = {name: _steps(name, runs, config.rule) for name, runs in groups.items()}
    rows = tuple(
        _row(
            group,
            base,
            welch.get(group.name),
            setups[group.name].preset,
            steps,
            config.rule,
            target,
        )
        for group in report.groups
    )
    runs = tuple(
        LeaderboardRun(
            setup=group.name,
            seed=run.seed,
            run_id=run.run_id,
            path=run.path,
            final_val_loss=run.final_val_loss,
            steps_to_target=run.target_step,
            time_to_target_s=run.target_time_s,
            step_avg_ms=run.step_avg_ms,
            diverged_step=run.diverged_step,
            diverged_reason=run.diverged_reason,
            mfu=run.mfu,
        )
        for group in report.groups
        for run in group.runs
    )
    schedules = ()
    if config.step_fractions:
        schedules = tuple(
            _schedule_row(
                setups[row.setup],
                row,
                max((run.total_steps for run in groups[row.setup]), default=0),
            )
            for row in rows
            if row.setup != baseline
        )
        order = {name: index for index, name in enumerate(setups)}
        schedules = tuple(sorted(schedules, key=lambda r: (order[r.setup], -r.fraction)))
    fitted, note = fitted_speedups(
        groups, baseline, [row.setup for row in rows if not setups[row.setup].parent]
    )
    return Leaderboard(
        target=target,
        target_rule=rule,
        baseline=baseline,
        rule=config.rule,
        seeds=tuple(config.seed_list),
        train_args=config.train_args,
        nproc=config.nproc,
        rows=rows,
        runs=runs,
        schedules=schedules,
        fitted=fitted,
        fitted_note=note,
        scale=model_scale(groups[baseline]),
    )


def _steps(name: str, runs: Sequence[RunRecord], rule: str) -> int:
    """The step the setup's finished seeds stopped at (all the same under track3)."""
    finished = [run.total_steps for run in runs if not run.diverged]
    if rule == "track3" and finished:
        return check_same_steps(f"setup {name!r}", finished)
    return max(finished or [run.total_steps for run in runs] or [0])


# One-sided p below which a schedule is said to reach the target.
SIGNIFICANCE = 0.05


def _schedule_row(setup: Setup, row: LeaderboardRow, steps: int) -> ScheduleRow:
    return ScheduleRow(
        setup=setup.family,
        row=row.setup,
        fraction=setup.fraction,
        steps=steps,
        final_val_loss=row.final_val_loss,
        target_p=row.target_p,
        reaches=row.target_p is not None and row.target_p < SIGNIFICANCE,
    )


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


def _row(
    group: GroupReport,
    base: GroupReport,
    welch_p: float | None,
    preset: str,
    steps: Mapping[str, int],
    rule: str,
    target: float,
) -> LeaderboardRow:
    test = group.target_test
    losses = [run.final_val_loss for run in group.runs if not run.diverged]
    base_losses = [run.final_val_loss for run in base.runs if not run.diverged]
    record = pairwise = needed_for_record = None
    if rule == "track3" and losses:
        record = record_test(losses, target)
        needed_for_record = seeds_for_record(target - record.mean)
        if group.name != base.name and base_losses:
            pairwise = pairwise_test(base_losses, steps[base.name], losses, steps[group.name])
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
        seeds_needed=_seeds_needed(group.final_val_loss, base.final_val_loss)
        if group.name != base.name
        else None,
        steps=steps[group.name],
        record=record,
        pairwise=pairwise,
        seeds_for_record=needed_for_record,
        mfu=group.mfu,
        budgets=group.budgets,
    )


def _seeds_needed(row: Summary, base: Summary) -> int | None:
    if row.mean is None or base.mean is None or row.std is None or base.std is None:
        return None
    return seeds_for_significance(row.mean - base.mean, row.std, base.std)


def _ratio(value: Summary, base: Summary) -> float | None:
    if value.mean is None or not base.mean:
        return None
    return value.mean / base.mean


def format_leaderboard(board: Leaderboard) -> str:
    """The leaderboard as Markdown: the rule, the setups table, the definitions, the track-3
    verdicts (``--rule track3``), the schedules (``--step-fractions``), then every run."""
    base = board.baseline
    flags = " ".join(board.train_args) or "(none)"
    seeds = ", ".join(map(str, board.seeds))
    lines = [
        f"# Leaderboard: {', '.join(row.setup for row in board.rows)}",
        "",
        f"Rule: **{RULE_TEXT[board.rule]}**.",
        "",
        f"Target val loss **{board.target:.4f}** ({board.target_rule}). Seeds {seeds}; "
        f"{board.nproc} process(es) per run; train flags: `{flags}`."
        + (f" The baseline's {board.scale}." if board.scale else ""),
        "",
        *format_markdown_table(_setup_rows(board)),
        "",
        "Mean ± std (ddof=1) over seeds. Steps and time to target (mid-run): the first validation "
        "at or below the target, interpolated linearly between it and the validation before it, "
        "read inside each run's own learning-rate decay, so not the result of a run of that "
        "length (runs with --decay-branches and their fitted curve give that); over the runs "
        "that reached the target (the *reached* column); × is the ratio of means to the baseline. "
        f"Welch p: two-sided Welch t-test of the final val loss against {base}. p(loss < target): "
        "one-sided one-sample t-test that the mean final val loss is below the target. "
        f"Seeds for p < 0.05: seeds per side at which Welch's test against {base} would give "
        "p < 0.05 if the gap and the spreads stayed as observed. "
        "Time is training time (validation excluded); peak MiB is CUDA's peak allocation, or the "
        "peak resident set on CPU. MFU: model FLOPs utilisation, the run's matmul FLOPs "
        "(forward and backward) over its training time and the matmul peak probed at its start "
        "(the run header states both), from the logs' final records; — where the logs have "
        "none. † Diverged runs count as not reaching the target and are left "
        "out of every other column.",
        "",
        *_track3_section(board),
        *_schedule_section(board),
        *budget_section([(row.setup, row.budgets) for row in board.rows]),
        *fitted_section(board.baseline, board.fitted, board.fitted_note),
        *telemetry_section(
            {row.setup: [r.path for r in board.runs if r.setup == row.setup] for row in board.rows}
        ),
        "## Runs",
        "",
        *format_markdown_table(_run_rows(board)),
    ]
    return "\n".join(lines) + "\n"


def _setup_rows(board: Leaderboard) -> list[list[str]]:
    base = board.baseline
    rows = [
        [
            "setup",
            "preset",
            "runs",
            "reached",
            "steps to target (mid-run)",
            f"× {base}",
            "time to target (s)",
            f"× {base}",
            "final val loss",
            f"Welch p vs {base}",
            "p(loss < target)",
            "seeds for p < 0.05",
            "ms/step",
            "peak MiB",
            "MFU %",
        ]
    ]
    for row in board.rows:
        runs = f"{row.runs}" + (f" ({row.diverged} diverged †)" if row.diverged else "")
        rows.append(
            [
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
                "—" if row.seeds_needed is None else str(row.seeds_needed),
                _mean_std(row.step_avg_ms, 1),
                _mean_std(row.peak_memory_mib, 0),
                _mfu(row.mfu, row.runs - row.diverged),
            ]
        )
    return rows


def _track3_section(board: Leaderboard) -> list[str]:
    """``## Track-3 verdicts`` (only under ``--rule track3``)."""
    if board.rule != "track3":
        return []
    rows = [
        [
            "setup",
            "steps",
            "n",
            "(target − mean)·√n",
            "z",
            "p (z)",
            "record",
            "seeds for a record",
            f"pairwise vs {board.baseline}: credit",
            "statistic",
            "beats it",
        ]
    ]
    for row in board.rows:
        record, pair = row.record, row.pairwise
        if record is None:
            rows.append([row.setup, str(row.steps), "0", *["—"] * 8])
            continue
        rows.append(
            [
                row.setup,
                str(row.steps),
                str(record.n),
                f"{record.statistic:.5f}",
                f"{record.z:.2f}",
                format_p(record.p_value),
                "yes" if record.passed else "no",
                "—" if row.seeds_for_record is None else str(row.seeds_for_record),
                "—" if pair is None else f"{pair.credit:+.4f}",
                "—" if pair is None else f"{pair.statistic:.5f}",
                "—" if pair is None else ("yes" if pair.passed else "no"),
            ]
        )
    return [
        "## Track-3 verdicts",
        "",
        *format_markdown_table(rows),
        "",
        "Record: (target − mean)·√n ≥ 0.004, a one-sided z-test at the track's fixed σ = 0.0013 "
        "(z = statistic / σ). Seeds for a record: ⌈(0.004 / (target − mean))²⌉. Pairwise: the "
        f"candidate's mean, credited 0.0045 loss per 100 steps fewer than {board.baseline}'s "
        "(charged for more), must beat the baseline's by 0.004·√(1/n_b + 1/n_c). Every seed of "
        "a setup stopped at the step shown.",
        "",
    ]


def _schedule_section(board: Leaderboard) -> list[str]:
    """``## Steps to the target by schedule length`` (only with ``--step-fractions``)."""
    if not board.schedules:
        return []
    rows = [
        [
            "setup",
            "row",
            f"steps (× {board.baseline})",
            "final val loss",
            "p(loss < target)",
            "reaches target",
        ]
    ]
    for row in board.schedules:
        rows.append(
            [
                row.setup,
                row.row,
                f"{row.steps} ({row.fraction:.2f}×)",
                _mean_std(row.final_val_loss, 4),
                _p(row.target_p),
                "yes" if row.reaches else "no",
            ]
        )
    summary = []
    for setup, best in shortest_schedules(board).items():
        summary.append(
            f"- **{setup}**: "
            + (
                f"reaches {board.target:.4f} in {best.fraction:.2f}× {board.baseline}'s steps "
                f"({best.steps}; p = {format_p(best.target_p)})"
                if best is not None
                else "no schedule tried reaches the target with p < 0.05"
            )
        )
    return [
        "## Steps to the target by schedule length",
        "",
        f"Each setup trained again with its schedule (and its cooldown) shortened to a "
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
    rows = [
        [
            "setup",
            "seed",
            "run id",
            "final val loss",
            "steps to target",
            "time to target (s)",
            "ms/step",
            "MFU %",
            "status",
        ]
    ]
    for run in board.runs:
        rows.append(
            [
                run.setup,
                "-" if run.seed is None else str(run.seed),
                run.run_id,
                "—" if run.diverged_step is not None else f"{run.final_val_loss:.4f}",
                "not reached" if run.steps_to_target is None else f"{run.steps_to_target:.1f}",
                "—" if run.time_to_target_s is None else f"{run.time_to_target_s:.2f}",
                f"{run.step_avg_ms:.1f}",
                "—" if run.mfu is None else f"{100 * run.mfu:.2f}",
                "finished"
                if run.diverged_step is None
                else f"diverged † at step {run.diverged_step}: {run.diverged_reason}",
            ]
        )
    return rows


def _mean_std(summary: Summary, digits: int) -> str:
    if summary.mean is None:
        return "—"
    if summary.std is None:
        return f"{summary.mean:.{digits}f}"
    return f"{summary.mean:.{digits}f} ± {summary.std:.{digits}f}"


def _mfu(mfu: Summary, finished: int) -> str:
    """Mean ± std MFU in percent over the runs that state one; their count when not all do."""
    if mfu.mean is None:
        return "—"
    text = f"{100 * mfu.mean:.2f}" + ("" if mfu.std is None else f" ± {100 * mfu.std:.2f}")
    return text if mfu.n == finished else f"{text} ({mfu.n}/{finished} runs)"


def _times(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio:.2f}×"


def _p(p: float | None) -> str:
    text = format_p(p)
    return "—" if text == "-" else text


def write_leaderboard(
    board: Leaderboard, groups: Mapping[str, Sequence[RunRecord]], out_dir: str | Path
) -> list[Path]:
    """Write ``leaderboard.md``, ``leaderboard.json`` and the two loss-curve PNGs; return paths."""
    from nanoshampoo.evidence.plots import write_curve_plots  # matplotlib loads only here

    out_dir = Path(out_dir)
    markdown, data = out_dir / "leaderboard.md", out_dir / "leaderboard.json"
    with atomic_output(markdown) as tmp:
        tmp.write_text(format_leaderboard(board), encoding="utf-8")
    write_json(data, json_ready(board))
    return [markdown, data, *write_curve_plots(groups, board.target, out_dir)]
