"""Statistics over repeated runs: summaries, the target-loss test, steps-to-target, A/B tests.

The methodology is the speedrun's: run a configuration with several seeds, report mean and
unbiased std (``ddof=1``) of the final validation loss and of the train time, test the losses
against the target with a one-sided one-sample t-test (``H1: mean < target``), and apply the
optimization-track rule ``(target - mean) * sqrt(n) >= 0.004`` (i.e. a z-test with an assumed
seed-to-seed sigma of 0.0013 at p < 0.001). Two configurations are compared with Welch's
t-test and a confidence interval for the difference of means (Welch--Satterthwaite dof).

Runs are averaged only when they are the same task: the runs of one group must all have the same
number of steps (a 100-step and a 1000-step run have incomparable final losses), else
``UserError`` naming the files. The target must be a finite loss.

Diverged runs (``RunRecord.diverged``) are counted but have no final loss: they are left out of
every mean, std and test, and count as not reaching the target (even when their curve crossed
it before they diverged: a recipe that blows up has not reached anything).

Runs trained with decay branches also report the final loss at every budget they trained
(:class:`BudgetSummary`: each branch's length and the runs' own), over the runs that have it.

Example:
    >>> losses = [3.2775, 3.2776, 3.2777, 3.2780, 3.2781, 3.2775, 3.2786, 3.2774, 3.2751, 3.2739]
    >>> t = compare_to_target(losses, 3.28)
    >>> round(t.mean, 4), round(t.std, 4), t.p_value < 0.001, t.passed
    (3.2771, 0.0015, True, True)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import scipy.stats

from nanoshampoo.errors import UserError
from nanoshampoo.evidence.logs import RunRecord, ValPoint
from nanoshampoo.validation import is_real

DEFAULT_TARGET = 3.28
# The optimization track's rule: (target - mean) * sqrt(n) must reach 0.004, which is a
# one-sided z-test at p < 0.001 (z = 3.08) with the assumed seed std of 0.0013.
TRACK_RULE_THRESHOLD = 0.004
TRACK_RULE_SIGMA = 0.0013


@dataclass(frozen=True)
class Summary:
    """Sample size, mean and unbiased std (``None`` when ``n < 2``) of one metric."""

    n: int
    mean: float | None
    std: float | None


def summarize(values: Sequence[float]) -> Summary:
    """Mean and unbiased (``ddof=1``) standard deviation; ``None`` where undefined."""
    array = np.asarray(values, dtype=np.float64)
    n = int(array.size)
    mean = float(np.mean(array)) if n else None
    std = float(np.std(array, ddof=1)) if n >= 2 else None
    return Summary(n=n, mean=mean, std=std)


@dataclass(frozen=True)
class TargetTest:
    """Whether final losses beat ``target``: one-sided t-test and the track rule.

    ``t_statistic``/``p_value`` come from ``scipy.stats.ttest_1samp(losses, target,
    alternative="less")`` and are ``None`` for fewer than two runs. ``rule_statistic`` is
    ``(target - mean) * sqrt(n)``; ``passed`` is ``rule_statistic >= TRACK_RULE_THRESHOLD``.
    """

    target: float
    n: int
    mean: float
    std: float | None
    t_statistic: float | None
    p_value: float | None
    rule_statistic: float
    rule_threshold: float
    passed: bool


def compare_to_target(losses: Sequence[float], target: float = DEFAULT_TARGET) -> TargetTest:
    """One-sided one-sample t-test of ``losses`` against ``target`` plus the track rule."""
    summary = summarize(losses)
    if summary.mean is None:
        raise ValueError("losses: need at least one final loss to test against the target")
    t_statistic = p_value = None
    if summary.n >= 2:
        result = scipy.stats.ttest_1samp(losses, target, alternative="less")
        t_statistic, p_value = float(result.statistic), float(result.pvalue)
    rule_statistic = (target - summary.mean) * math.sqrt(summary.n)
    return TargetTest(
        target=target,
        n=summary.n,
        mean=summary.mean,
        std=summary.std,
        t_statistic=t_statistic,
        p_value=p_value,
        rule_statistic=rule_statistic,
        rule_threshold=TRACK_RULE_THRESHOLD,
        passed=rule_statistic >= TRACK_RULE_THRESHOLD,
    )


@dataclass(frozen=True)
class TargetCrossing:
    """Where a validation curve first reaches the target (linearly interpolated)."""

    step: float
    train_time_ms: float


def steps_to_target(curve: Sequence[ValPoint], target: float) -> TargetCrossing | None:
    """First point where the validation loss reaches ``target`` (``<=``), or ``None``.

    Between the last point above the target and the first point at or below it, step and
    train time are interpolated linearly in the loss. A curve whose first point is already at
    or below the target crosses at that point. Non-finite points are skipped.
    """
    previous: ValPoint | None = None
    for point in curve:
        if not math.isfinite(point.val_loss):
            continue
        if point.val_loss <= target:
            if previous is None:
                return TargetCrossing(float(point.step), point.train_time_ms)
            fraction = (previous.val_loss - target) / (previous.val_loss - point.val_loss)
            return TargetCrossing(
                step=previous.step + fraction * (point.step - previous.step),
                train_time_ms=previous.train_time_ms
                + fraction * (point.train_time_ms - previous.train_time_ms),
            )
        previous = point
    return None


@dataclass(frozen=True)
class Comparison:
    """Welch's two-sample comparison of one metric: ``candidate - baseline``.

    ``ci_low``/``ci_high`` bound the difference of means at ``confidence`` using the
    Welch--Satterthwaite degrees of freedom ``dof``; all test fields are ``None`` when either
    group has fewer than two runs.
    """

    metric: str
    baseline: str
    candidate: str
    baseline_mean: float
    candidate_mean: float
    difference: float
    confidence: float
    ci_low: float | None
    ci_high: float | None
    t_statistic: float | None
    p_value: float | None
    dof: float | None


def welch_compare(
    metric: str,
    baseline: tuple[str, Sequence[float]],
    candidate: tuple[str, Sequence[float]],
    confidence: float = 0.95,
) -> Comparison:
    """Compare ``candidate`` against ``baseline`` with Welch's (unequal variance) t-test."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: must be in (0, 1), got {confidence}")
    (base_name, base_values), (cand_name, cand_values) = baseline, candidate
    if not base_values or not cand_values:
        raise ValueError(f"{metric}: both groups need at least one value to compare")
    base_mean, cand_mean = float(np.mean(base_values)), float(np.mean(cand_values))
    ci_low = ci_high = t_statistic = p_value = dof = None
    if len(base_values) >= 2 and len(cand_values) >= 2:
        result = scipy.stats.ttest_ind(cand_values, base_values, equal_var=False)
        interval = result.confidence_interval(confidence_level=confidence)
        ci_low, ci_high = float(interval.low), float(interval.high)
        t_statistic, p_value, dof = float(result.statistic), float(result.pvalue), float(result.df)
    return Comparison(
        metric=metric,
        baseline=base_name,
        candidate=cand_name,
        baseline_mean=base_mean,
        candidate_mean=cand_mean,
        difference=cand_mean - base_mean,
        confidence=confidence,
        ci_low=ci_low,
        ci_high=ci_high,
        t_statistic=t_statistic,
        p_value=p_value,
        dof=dof,
    )


@dataclass(frozen=True)
class RunSummary:
    """One run's line in a group report.

    A diverged run has ``diverged_step`` set, ``final_val_loss`` NaN and no target crossing;
    its train time and step average cover the steps it ran.
    """

    run_id: str
    path: str
    seed: int | None
    final_val_loss: float
    train_time_s: float
    step_avg_ms: float
    target_step: float | None
    target_time_s: float | None
    peak_memory_mib: float | None = None
    diverged_step: int | None = None
    diverged_reason: str = ""
    mfu: float | None = None

    @property
    def diverged(self) -> bool:
        return self.diverged_step is not None


@dataclass(frozen=True)
class BudgetSummary:
    """One training budget of a group: the final validation loss of its runs' decay branches of
    ``steps`` steps (or of the runs themselves at their length). ``runs`` of the group trained
    it; ``diverged`` of those diverged and are left out of ``final_val_loss``."""

    steps: int
    final_val_loss: Summary
    runs: int
    diverged: int


def budget_summaries(runs: Sequence[RunRecord]) -> tuple[BudgetSummary, ...]:
    """Per budget, ascending: the final losses of every run's decay branches and of the runs
    themselves (``RunRecord.final_losses_by_steps``); empty when no run has a branch."""
    if not any(run.branches for run in runs):
        return ()
    by_steps: dict[int, list[float]] = {}
    for run in runs:
        for steps, loss in run.final_losses_by_steps().items():
            by_steps.setdefault(steps, []).append(loss)
    return tuple(
        BudgetSummary(
            steps,
            summarize([x for x in losses if math.isfinite(x)]),
            len(losses),
            sum(not math.isfinite(x) for x in losses),
        )
        for steps, losses in sorted(by_steps.items())
    )


@dataclass(frozen=True)
class GroupReport:
    """All statistics of one group of runs (one configuration, several seeds).

    Summaries and the target test cover the ``finished`` runs only; ``diverged`` of
    ``len(runs)`` diverged. ``target_test`` is ``None`` when every run diverged.
    """

    name: str
    runs: tuple[RunSummary, ...]
    final_val_loss: Summary
    train_time_s: Summary
    step_avg_ms: Summary
    peak_memory_mib: Summary
    # Over the finished runs whose log holds an MFU (``n`` says how many did).
    mfu: Summary
    target_test: TargetTest | None
    # Over the runs that reached the target; ``reached`` of ``len(runs)`` did.
    target_step: Summary
    target_time_s: Summary
    reached: int
    finished: int
    diverged: int
    # The final loss at each budget the runs trained (decay branches); empty without branches.
    budgets: tuple[BudgetSummary, ...] = ()


@dataclass(frozen=True)
class EvidenceReport:
    """Reports of every group and the comparisons of each group against the baseline."""

    target: float
    groups: tuple[GroupReport, ...]
    comparisons: tuple[Comparison, ...]


# Metrics compared between groups: name in the report -> RunSummary attribute.
COMPARED_METRICS = ("final_val_loss", "train_time_s", "step_avg_ms")


def check_target(name: str, target: float) -> None:
    """``UserError`` naming ``name`` unless ``target`` is a finite number (a loss to reach)."""
    if not (is_real(target) and math.isfinite(target)):
        raise UserError(f"{name} {target}: the target must be a finite validation loss")


def check_confidence(name: str, confidence: float) -> None:
    """``UserError`` naming ``name`` unless ``confidence`` is in (0, 1) (checked even when one
    group makes no comparison: a flag that means nothing is refused, not ignored)."""
    if not (is_real(confidence) and 0.0 < confidence < 1.0):
        raise UserError(f"{name} {confidence}: the confidence level must be in (0, 1)")


def check_same_length(name: str, runs: Sequence[RunRecord]) -> None:
    """``UserError`` if the runs of group ``name`` ran different numbers of steps."""
    lengths: dict[int, list[str]] = {}
    for run in runs:
        lengths.setdefault(run.total_steps, []).append(str(run.path))
    if len(lengths) > 1:
        described = "; ".join(
            f"{steps} steps: {', '.join(paths[:2])}" + (", ..." if len(paths) > 2 else "")
            for steps, paths in sorted(lengths.items())
        )
        raise UserError(
            f"group {name!r} mixes runs of different lengths ({described}); their "
            "final losses are not comparable: put each length in its own group"
        )


def group_report(
    name: str, runs: Sequence[RunRecord], target: float = DEFAULT_TARGET
) -> GroupReport:
    """Summarize one group of runs against ``target``; diverged runs are counted, not averaged."""
    if not runs:
        raise ValueError(f"group {name!r}: no runs")
    check_same_length(name, runs)
    summaries = []
    for run in runs:
        crossing = None if run.diverged else steps_to_target(run.curve, target)
        summaries.append(
            RunSummary(
                run_id=run.run_id,
                path=str(run.path),
                seed=run.seed,
                final_val_loss=run.final_val_loss,
                train_time_s=run.train_time_ms / 1000.0,
                step_avg_ms=run.step_avg_ms,
                target_step=None if crossing is None else crossing.step,
                target_time_s=None if crossing is None else crossing.train_time_ms / 1000.0,
                peak_memory_mib=run.peak_memory_mib,
                diverged_step=run.diverged_step,
                diverged_reason=run.diverged_reason,
                mfu=run.mfu,
            )
        )
    finished = [s for s in summaries if not s.diverged]
    reached = [s for s in finished if s.target_step is not None]
    losses = [s.final_val_loss for s in finished]
    return GroupReport(
        name=name,
        runs=tuple(summaries),
        final_val_loss=summarize(losses),
        train_time_s=summarize([s.train_time_s for s in finished]),
        step_avg_ms=summarize([s.step_avg_ms for s in finished]),
        peak_memory_mib=summarize(
            [s.peak_memory_mib for s in finished if s.peak_memory_mib is not None]
        ),
        mfu=summarize([s.mfu for s in finished if s.mfu is not None]),
        target_test=compare_to_target(losses, target) if losses else None,
        target_step=summarize([s.target_step for s in reached]),
        target_time_s=summarize([s.target_time_s for s in reached]),
        reached=len(reached),
        finished=len(finished),
        diverged=len(summaries) - len(finished),
        budgets=budget_summaries(runs),
    )


def build_report(
    groups: Mapping[str, Sequence[RunRecord]],
    target: float = DEFAULT_TARGET,
    baseline: str | None = None,
    confidence: float = 0.95,
) -> EvidenceReport:
    """Report every group; with two or more, compare each group against ``baseline``.

    ``baseline`` defaults to the first group. Differences are ``group - baseline``, so a
    negative train-time difference means the group is faster than the baseline. Only
    finished runs are compared; a group whose runs all diverged has no comparisons.
    """
    if not groups:
        raise ValueError("groups: no groups of runs to report")
    check_target("target", target)
    check_confidence("confidence", confidence)
    if baseline is None:
        baseline = next(iter(groups))
    if baseline not in groups:
        raise ValueError(f"baseline: {baseline!r} is not one of the groups {sorted(groups)}")
    reports = {name: group_report(name, runs, target) for name, runs in groups.items()}
    comparisons = []
    base = reports[baseline]
    for name, report in reports.items():
        if name == baseline:
            continue
        if not base.finished or not report.finished:
            continue
        for metric in COMPARED_METRICS:
            comparisons.append(
                welch_compare(
                    metric,
                    (baseline, [getattr(r, metric) for r in base.runs if not r.diverged]),
                    (name, [getattr(r, metric) for r in report.runs if not r.diverged]),
                    confidence,
                )
            )
    return EvidenceReport(
        target=target, groups=tuple(reports.values()), comparisons=tuple(comparisons)
    )
