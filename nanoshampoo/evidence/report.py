"""Render an :class:`~nanoshampoo.evidence.stats.EvidenceReport` as a text table or JSON.

The JSON form is ``dataclasses.asdict`` of the report with non-finite numbers written as
``null`` (strict JSON); files are written atomically.

Example:
    >>> print(format_report(build_report({"base": runs})))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from nanoshampoo.evidence.stats import (
    BudgetSummary,
    Comparison,
    EvidenceReport,
    GroupReport,
    Summary,
)
from nanoshampoo.evidence.tables import format_table
from nanoshampoo.io_utils import atomic_output


def report_to_dict(report: EvidenceReport) -> dict[str, Any]:
    """The report as plain JSON-ready data (NaN and infinities become ``None``)."""
    return json_ready(report)


def json_ready(data: Any) -> Any:
    """A dataclass instance as plain strict-JSON data: ``asdict``, non-finite floats to ``None``."""
    return _finite(dataclasses.asdict(data))


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented strict JSON to ``path`` atomically."""
    with atomic_output(path) as tmp, tmp.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, allow_nan=False)
        f.write("\n")


def format_report(report: EvidenceReport) -> str:
    """Human-readable report: one block per group, then the A/B comparisons."""
    blocks = [_format_group(group, report.target) for group in report.groups]
    if report.comparisons:
        blocks.append(_format_comparisons(report.comparisons))
    return "\n\n".join(blocks)


def _format_group(group: GroupReport, target: float) -> str:
    test = group.target_test
    diverged = f", {group.diverged} diverged" if group.diverged else ""
    lines = [f"== {group.name} ({len(group.runs)} runs{diverged}) =="]
    if group.diverged:
        lines.append(
            f"  diverged runs    {group.diverged} of {len(group.runs)}: left out of the"
            " statistics, counted as not reaching the target"
        )
    if test is None:
        lines.append(f"  vs target {target:g}   every run diverged: no final loss to test")
    else:
        verdict = "PASS" if test.passed else "FAIL"
        lines += [
            f"  final val loss   {_mean_std(group.final_val_loss, 4)}",
            f"  vs target {target:g}   "
            + (
                f"t = {test.t_statistic:.3f}  p = {format_p(test.p_value)}  (one-sided, H1: mean < "
                "target)"
                if test.p_value is not None
                else "t-test needs at least 2 runs"
            ),
            f"  track rule       (target - mean) * sqrt(n) = {test.rule_statistic:.5f}"
            f" {'>=' if test.passed else '<'} {test.rule_threshold:g}  {verdict}",
        ]
    lines += [
        f"  train time       {_mean_std(group.train_time_s, 4, ' s')}",
        f"  step avg         {_mean_std(group.step_avg_ms, 2, ' ms')}",
        f"  steps to target  {_mean_std(group.target_step, 1)}"
        f"  ({group.reached} of {len(group.runs)} reached)",
        f"  time to target   {_mean_std(group.target_time_s, 3, ' s')}",
    ]
    rows = [
        ["run", "seed", "val_loss", "train_time_s", "step_avg_ms", "target_step", "target_time_s"]
    ]
    for run in group.runs:
        rows.append(
            [
                run.run_id,
                "-" if run.seed is None else str(run.seed),
                f"diverged at step {run.diverged_step}"
                if run.diverged
                else f"{run.final_val_loss:.4f}",
                f"{run.train_time_s:.3f}",
                f"{run.step_avg_ms:.2f}",
                "not reached" if run.target_step is None else f"{run.target_step:.1f}",
                "-" if run.target_time_s is None else f"{run.target_time_s:.3f}",
            ]
        )
    lines.extend("  " + line for line in format_table(rows))
    if group.budgets:
        lines.append("  final val loss at each budget (decay branches):")
        lines.extend("  " + line for line in format_table(budget_rows(group.budgets, "-")))
    return "\n".join(lines)


def budget_rows(budgets: tuple[BudgetSummary, ...], missing: str) -> list[list[str]]:
    """A table of a group's budgets: steps, mean ± std of the final loss, runs, diverged."""
    rows = [["steps", "final val loss", "runs", "diverged"]]
    for budget in budgets:
        loss = budget.final_val_loss
        text = (
            missing
            if loss.mean is None
            else f"{loss.mean:.4f}" + ("" if loss.std is None else f" ± {loss.std:.4f}")
        )
        rows.append([str(budget.steps), text, str(budget.runs), str(budget.diverged)])
    return rows


def _format_comparisons(comparisons: tuple[Comparison, ...]) -> str:
    confidence = comparisons[0].confidence
    header = f"{confidence:.0%} CI"
    rows = [
        [
            "baseline",
            "candidate",
            "metric",
            "baseline",
            "candidate",
            "diff",
            header,
            "t",
            "dof",
            "p",
        ]
    ]
    for c in comparisons:
        has_test = c.p_value is not None
        rows.append(
            [
                c.baseline,
                c.candidate,
                c.metric,
                f"{c.baseline_mean:.4f}",
                f"{c.candidate_mean:.4f}",
                f"{c.difference:+.4f}",
                f"[{c.ci_low:+.4f}, {c.ci_high:+.4f}]" if has_test else "-",
                f"{c.t_statistic:.3f}" if has_test else "-",
                f"{c.dof:.1f}" if has_test else "-",
                format_p(c.p_value) if has_test else "-",
            ]
        )
    title = "== A/B: candidate - baseline, Welch's t-test (two-sided) =="
    return "\n".join([title, *("  " + line for line in format_table(rows))])


def _mean_std(summary: Summary, digits: int, unit: str = "") -> str:
    if summary.mean is None:
        return "-"
    std = "-" if summary.std is None else f"{summary.std:.{digits}f}"
    return f"mean {summary.mean:.{digits}f}{unit}  std {std}{unit}  (n={summary.n})"


def format_p(p: float | None) -> str:
    """A p-value with 4 decimals, or in scientific notation below 1e-4; "-" when undefined."""
    if p is None or math.isnan(p):
        return "-"
    return f"{p:.4f}" if p >= 1e-4 else f"{p:.2e}"


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
