"""The optimization track's rules against values computed by hand (and scipy's own paths)."""

from __future__ import annotations

import math

import pytest
import scipy.stats

from nanoshampoo.evidence.speedrun_rules import (
    check_same_steps,
    pairwise_test,
    record_test,
    seeds_for_record,
    seeds_for_significance,
)


def test_record_rule_is_a_fixed_sigma_z_test() -> None:
    test = record_test([3.2770, 3.2772, 3.2768], target=3.28)
    # mean 3.2770, gap 0.0030: statistic = 0.0030 * sqrt(3) = 0.0051962, z = 0.0051962 / 0.0013.
    assert test.mean == pytest.approx(3.2770, abs=1e-12)
    assert test.statistic == pytest.approx(0.0051961524, rel=1e-8)
    assert test.z == pytest.approx(3.9970403, rel=1e-7)
    assert test.p_value == pytest.approx(0.5 * math.erfc(3.9970403 / math.sqrt(2)), rel=1e-6)
    assert test.passed


@pytest.mark.parametrize("mean, passed", [(3.2781, False), (3.2779, True)])
def test_record_rule_threshold_is_0_004(mean: float, passed: bool) -> None:
    # n = 4: statistic = 2 * (3.28 - mean) = 0.0038 (short of 0.004) or 0.0042.
    test = record_test([mean] * 4, target=3.28)
    assert test.statistic == pytest.approx(2 * (3.28 - mean))
    assert test.passed is passed


def test_the_spread_does_not_enter_the_record_rule() -> None:
    tight, wide = record_test([3.27, 3.27], 3.28), record_test([3.26, 3.28], 3.28)
    assert tight.statistic == pytest.approx(wide.statistic) and tight.passed and wide.passed


@pytest.mark.parametrize(
    "candidate_steps, credit, statistic, passed",
    [
        # baseline 3.2800 at 1000 steps; candidate 3.2820 (2 seeds a side, sqrt(1/2 + 1/2) = 1).
        (1000, 0.0, -0.0020, False),
        (900, 0.0045, 0.0025, False),  # 100 steps fewer: credited 0.0045
        (800, 0.0090, 0.0070, True),  # 200 fewer: 0.0090; 3.2800 - (3.2820 - 0.0090) = 0.0070
        (1100, -0.0045, -0.0065, False),  # 100 more: charged
    ],
)
def test_pairwise_rule_converts_steps_to_loss(
    candidate_steps: int, credit: float, statistic: float, passed: bool
) -> None:
    test = pairwise_test([3.2790, 3.2810], 1000, [3.2815, 3.2825], candidate_steps)
    assert test.credit == pytest.approx(credit)
    assert test.statistic == pytest.approx(statistic)
    assert test.z == pytest.approx(statistic / 0.0013)
    assert test.passed is passed


def test_pairwise_standard_error_uses_both_seed_counts() -> None:
    # 4 against 1 seeds: sqrt(1/4 + 1) = 1.1180340; gap 0.0050.
    test = pairwise_test([3.28] * 4, 500, [3.275], 500)
    assert test.statistic == pytest.approx(0.0050 / 1.1180340, rel=1e-7)


def test_every_seed_must_stop_at_the_same_step() -> None:
    assert check_same_steps("adamw", [100, 100, 100]) == 100
    with pytest.raises(ValueError, match=r"adamw: every seed .* same step, got steps \[90, 100\]"):
        check_same_steps("adamw", [100, 90])


def test_seeds_for_significance_equal_spreads_by_hand() -> None:
    # gap 0.01, both stds 0.01: t = 0.01 / sqrt(2e-4 / n) = sqrt(n / 2), dof = 2n - 2.
    # n = 8: t = 2.0000 < t_0.975(14) = 2.1448; n = 9: t = 2.1213 > t_0.975(16) = 2.1199.
    assert seeds_for_significance(0.01, 0.01, 0.01) == 9
    assert seeds_for_significance(-0.01, 0.01, 0.01) == 9  # the sign of the gap does not matter


@pytest.mark.parametrize(
    "gap, std_a, std_b", [(0.02, 0.01, 0.03), (0.005, 0.002, 0.004), (0.0531, 0.0153, 0.0252)]
)
def test_seeds_for_significance_matches_scipys_welch_from_stats(
    gap: float, std_a: float, std_b: float
) -> None:
    n = seeds_for_significance(gap, std_a, std_b)
    assert n is not None

    def p(k: int) -> float:
        return scipy.stats.ttest_ind_from_stats(
            gap, std_a, k, 0.0, std_b, k, equal_var=False
        ).pvalue

    assert p(n) < 0.05 and (n == 2 or p(n - 1) >= 0.05)


def test_seeds_for_significance_without_a_gap_or_a_spread() -> None:
    assert seeds_for_significance(0.0, 0.01, 0.01) is None
    assert seeds_for_significance(0.01, 0.0, 0.0) == 2
    assert seeds_for_significance(1e-9, 0.1, 0.1) is None  # more than MAX_SEEDS


@pytest.mark.parametrize(
    "gap, seeds", [(0.001, 16), (0.002, 4), (0.0015, 8), (0.005, 1), (0.0, None), (-0.001, None)]
)
def test_seeds_for_a_record(gap: float, seeds: int | None) -> None:
    # ceil((0.004 / gap)^2): 16, 4, ceil(7.11) = 8, ceil(0.64) = 1.
    assert seeds_for_record(gap) == seeds
