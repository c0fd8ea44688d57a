"""Statistics: the seed article's figures, steps-to-target, Welch A/B comparisons."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import scipy.stats

from nanoshampoo.evidence.logs import RunRecord, ValPoint
from nanoshampoo.evidence.stats import (
    build_report,
    compare_to_target,
    group_report,
    steps_to_target,
    summarize,
    welch_compare,
)

SEED_LOSSES = [3.2775, 3.2776, 3.2777, 3.2780, 3.2781, 3.2775, 3.2786, 3.2774, 3.2751, 3.2739]
SEED_TIMES = [
    140.909,
    140.872,
    140.743,
    140.743,
    140.747,
    140.809,
    140.728,
    140.784,
    140.862,
    140.934,
]


def test_seed_losses_beat_the_target() -> None:
    result = compare_to_target(SEED_LOSSES, 3.28)
    assert round(result.mean, 4) == 3.2771
    assert round(result.std, 4) == 0.0015
    assert result.p_value < 0.001
    assert f"{result.p_value:.4f}" == "0.0001"  # the article prints p=0.0001
    assert result.rule_statistic == pytest.approx((3.28 - np.mean(SEED_LOSSES)) * math.sqrt(10))
    assert result.passed


def test_seed_times_summary() -> None:
    summary = summarize(SEED_TIMES)
    assert summary.n == 10
    assert round(summary.mean, 4) == 140.8131
    assert round(summary.std, 4) == 0.0760


def test_track_rule_fails_when_margin_too_small() -> None:
    # mean 3.2790: (3.28 - 3.279) * sqrt(4) = 0.002 < 0.004 even though every run beats 3.28.
    result = compare_to_target([3.2789, 3.2791, 3.2790, 3.2790], 3.28)
    assert result.rule_statistic == pytest.approx(0.002)
    assert not result.passed


def test_summary_of_one_value_has_no_std() -> None:
    assert summarize([3.0]).std is None
    result = compare_to_target([3.27], 3.28)
    assert result.p_value is None and result.t_statistic is None
    with pytest.raises(ValueError, match="losses"):
        compare_to_target([], 3.28)


def _curve(points: list[tuple[int, float, float]]) -> list[ValPoint]:
    return [ValPoint(step, loss, time_ms) for step, loss, time_ms in points]


def test_steps_to_target_interpolates_linearly() -> None:
    curve = _curve([(0, 10.0, 0.0), (100, 3.5, 1000.0), (200, 3.2, 2500.0), (300, 3.1, 4000.0)])
    crossing = steps_to_target(curve, 3.28)
    # From (100, 3.5) to (200, 3.2) the loss reaches 3.28 after (3.5-3.28)/(3.5-3.2) of the way.
    fraction = 0.22 / 0.3
    assert crossing.step == pytest.approx(100 + 100 * fraction)
    assert crossing.train_time_ms == pytest.approx(1000 + 1500 * fraction)


@pytest.mark.parametrize(
    ("points", "expected"),
    [
        ([(0, 3.0, 0.0), (10, 2.0, 5.0)], 0.0),  # already below at the first point
        ([(0, 4.0, 0.0), (10, 3.28, 5.0)], 10.0),  # exactly reaches it
        ([(0, 4.0, 0.0), (10, 3.3, 5.0)], None),  # never reached
    ],
)
def test_steps_to_target_edge_cases(
    points: list[tuple[int, float, float]], expected: float | None
) -> None:
    crossing = steps_to_target(_curve(points), 3.28)
    assert (None if crossing is None else crossing.step) == expected


def test_welch_comparison_matches_scipy_and_hand_dof() -> None:
    base = [141.654, 141.413, 141.467, 141.516]
    cand = SEED_TIMES
    c = welch_compare("train_time_s", ("base", base), ("hook", cand))
    va, vb = np.var(cand, ddof=1) / len(cand), np.var(base, ddof=1) / len(base)
    dof = (va + vb) ** 2 / (va**2 / (len(cand) - 1) + vb**2 / (len(base) - 1))
    diff = np.mean(cand) - np.mean(base)
    half = scipy.stats.t.ppf(0.975, dof) * math.sqrt(va + vb)
    reference = scipy.stats.ttest_ind(cand, base, equal_var=False)
    assert c.dof == pytest.approx(dof)
    assert c.difference == pytest.approx(diff)
    assert (c.ci_low, c.ci_high) == pytest.approx((diff - half, diff + half))
    assert c.t_statistic == pytest.approx(reference.statistic)
    assert c.p_value == pytest.approx(reference.pvalue)
    assert round(c.difference, 2) == -0.70  # the article's "about 0.7 s faster"
    assert c.ci_high < 0


def test_welch_comparison_needs_two_runs_per_group_for_a_test() -> None:
    c = welch_compare("final_val_loss", ("a", [3.0]), ("b", [3.1, 3.2]))
    assert c.difference == pytest.approx(0.15)
    assert c.p_value is None and c.ci_low is None and c.dof is None
    with pytest.raises(ValueError, match="confidence"):
        welch_compare("x", ("a", [1.0, 2.0]), ("b", [1.0, 2.0]), confidence=1.5)


def _run(
    run_id: str, points: list[tuple[int, float, float]], diverged_step: int | None = None
) -> RunRecord:
    curve = tuple(_curve(points))
    return RunRecord(
        path=Path(f"{run_id}.jsonl"),
        run_id=run_id,
        total_steps=100,
        curve=curve,
        train_time_ms=curve[-1].train_time_ms,
        step_avg_ms=curve[-1].train_time_ms / 100,
        peak_memory_mib=10.0,
        diverged_step=diverged_step,
    )


def test_steps_to_target_skips_non_finite_points() -> None:
    curve = _curve([(0, 10.0, 0.0), (50, math.nan, 50.0), (75, 3.5, 75.0), (100, 3.0, 100.0)])
    assert steps_to_target(curve, 3.28).step == pytest.approx(75 + 25 * 0.22 / 0.5)


def test_diverged_runs_are_counted_but_not_averaged() -> None:
    finished = [
        _run(f"a{i}", [(0, 9.0, 0.0), (100, loss, 1000.0 + i)])
        for i, loss in enumerate([3.2, 3.25])
    ]
    # Crossed the target at step 50 before diverging: still counts as not reaching it.
    blown = _run("a2", [(0, 9.0, 0.0), (50, 3.0, 500.0)], diverged_step=60)
    group = group_report("a", [*finished, blown], target=3.28)
    assert (group.finished, group.diverged, group.reached, len(group.runs)) == (2, 1, 2, 3)
    assert group.final_val_loss.mean == pytest.approx(3.225) and group.final_val_loss.n == 2
    assert group.train_time_s.mean == pytest.approx(1.0005)
    assert group.target_test.p_value == pytest.approx(
        scipy.stats.ttest_1samp([3.2, 3.25], 3.28, alternative="less").pvalue
    )
    assert group.runs[2].diverged and group.runs[2].target_step is None

    other = [
        _run(f"b{i}", [(0, 9.0, 0.0), (100, loss, 900.0 + 7 * i)])
        for i, loss in enumerate([3.1, 3.15])
    ]
    report = build_report({"a": [*finished, blown], "b": other}, 3.28)
    loss = next(c for c in report.comparisons if c.metric == "final_val_loss")
    assert loss.p_value == pytest.approx(
        scipy.stats.ttest_ind([3.1, 3.15], [3.2, 3.25], equal_var=False).pvalue
    )


def test_a_group_whose_runs_all_diverged_has_no_test_and_no_comparison() -> None:
    blown = [_run("x", [(0, 9.0, 0.0)], diverged_step=3)]
    report = build_report(
        {"ok": [_run("o", [(0, 9.0, 0.0), (100, 3.0, 1.0)])], "blown": blown}, 3.28
    )
    group = report.groups[1]
    assert group.target_test is None and group.final_val_loss.mean is None and group.reached == 0
    assert report.comparisons == ()
