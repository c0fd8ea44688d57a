"""The NanoGPT speedrun optimization track's statistics ("track 3"), next to Welch's test.

- **One record** (:func:`record_test`): the mean final loss of ``n`` seeds beats the target when
  ``(target - mean) * sqrt(n) >= 0.004``: a one-sided z-test with the track's fixed seed-to-seed
  sigma ``0.0013`` (``z = (target - mean) * sqrt(n) / 0.0013 >= 3.08``, p < 0.001). The
  observed spread does not enter; ``p`` is the z-test's ``norm.sf(z)``.
- **Two records** (:func:`pairwise_test`): a candidate against a baseline, both at fixed sigma.
  Steps convert to loss at ``0.0045`` per 100 steps: a candidate that trains ``s`` fewer steps
  is credited ``0.0045 * s / 100`` of loss (one that trains more is charged). The candidate
  wins when ``(baseline mean - credited candidate mean) / sqrt(1/n_b + 1/n_c) >= 0.004``, the
  one-record threshold with the two-sample standard error.
- **Seeds**: every seed of a record stops at the same step (:func:`check_same_steps`).

:func:`seeds_for_significance` answers "how many seeds would p < 0.05 need at this gap and
spread?": the smallest ``n`` per side at which Welch's two-sided test of two groups with the
observed means and stds gives p < 0.05 (scipy's t distribution).

Example:
    >>> test = record_test([3.2770, 3.2772, 3.2768], target=3.28)
    >>> round(test.statistic, 5), test.passed
    (0.0052, True)
    >>> seeds_for_significance(0.01, 0.01, 0.01)  # t = sqrt(n / 2) > t_0.975(2n - 2)
    9
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.stats

RECORD_THRESHOLD = 0.004
RECORD_SIGMA = 0.0013
LOSS_PER_100_STEPS = 0.0045
SIGNIFICANCE = 0.05
MAX_SEEDS = 10_000


@dataclass(frozen=True)
class RecordTest:
    """``statistic = (target - mean) * sqrt(n)``; ``z = statistic / RECORD_SIGMA``;
    ``p = norm.sf(z)`` (one-sided); ``passed``: ``statistic >= RECORD_THRESHOLD``."""

    n: int
    mean: float
    target: float
    statistic: float
    z: float
    p_value: float
    passed: bool


def record_test(losses: Sequence[float], target: float) -> RecordTest:
    """The one-record rule for the final losses of ``n >= 1`` seeds."""
    if not losses:
        raise ValueError("losses: need at least one final loss")
    n, mean = len(losses), float(np.mean(np.asarray(losses, dtype=np.float64)))
    statistic = (target - mean) * math.sqrt(n)
    z = statistic / RECORD_SIGMA
    return RecordTest(
        n=n,
        mean=mean,
        target=target,
        statistic=statistic,
        z=z,
        p_value=float(scipy.stats.norm.sf(z)),
        passed=statistic >= RECORD_THRESHOLD,
    )


@dataclass(frozen=True)
class PairwiseTest:
    """A candidate against a baseline: ``credit = 0.0045 * (baseline_steps - candidate_steps)
    / 100``; ``statistic = (baseline_mean - (candidate_mean - credit)) / sqrt(1/n_b + 1/n_c)``;
    ``z``, ``p`` and ``passed`` as in :class:`RecordTest`."""

    baseline_mean: float
    candidate_mean: float
    baseline_steps: int
    candidate_steps: int
    credit: float
    statistic: float
    z: float
    p_value: float
    passed: bool


def pairwise_test(
    baseline: Sequence[float], baseline_steps: int, candidate: Sequence[float], candidate_steps: int
) -> PairwiseTest:
    """The two-record rule (see the module docstring)."""
    if not baseline or not candidate:
        raise ValueError("pairwise: both records need at least one final loss")
    base_mean = float(np.mean(np.asarray(baseline, dtype=np.float64)))
    cand_mean = float(np.mean(np.asarray(candidate, dtype=np.float64)))
    credit = LOSS_PER_100_STEPS * (baseline_steps - candidate_steps) / 100
    statistic = (base_mean - (cand_mean - credit)) / math.sqrt(
        1 / len(baseline) + 1 / len(candidate)
    )
    z = statistic / RECORD_SIGMA
    return PairwiseTest(
        baseline_mean=base_mean,
        candidate_mean=cand_mean,
        baseline_steps=baseline_steps,
        candidate_steps=candidate_steps,
        credit=credit,
        statistic=statistic,
        z=z,
        p_value=float(scipy.stats.norm.sf(z)),
        passed=statistic >= RECORD_THRESHOLD,
    )


def check_same_steps(name: str, steps: Sequence[int]) -> int:
    """The one step every seed of ``name`` stopped at (``ValueError`` naming the steps if not)."""
    distinct = sorted(set(steps))
    if len(distinct) != 1:
        raise ValueError(
            f"{name}: every seed of a record must stop at the same step, got steps {distinct}"
        )
    return distinct[0]


def seeds_for_significance(
    gap: float, std_a: float, std_b: float, alpha: float = SIGNIFICANCE
) -> int | None:
    """The smallest ``n >= 2`` seeds per side at which two groups ``gap`` apart in mean, with
    stds ``std_a`` and ``std_b``, give Welch's two-sided p < ``alpha``; None for no gap, or
    when more than ``MAX_SEEDS`` would be needed."""
    if gap == 0 or not math.isfinite(gap):
        return None
    variance = std_a**2 + std_b**2
    if variance == 0:
        return 2
    for n in range(2, MAX_SEEDS + 1):
        se2 = variance / n
        t = abs(gap) / math.sqrt(se2)
        dof = se2**2 / ((std_a**2 / n) ** 2 / (n - 1) + (std_b**2 / n) ** 2 / (n - 1))
        if 2 * scipy.stats.t.sf(t, dof) < alpha:
            return n
    return None


def seeds_for_record(gap: float) -> int | None:
    """The seeds the one-record rule needs at a mean ``gap = target - mean`` below the target:
    ``ceil((0.004 / gap)**2)``; None when the mean is not below the target."""
    if not gap > 0:
        return None
    n = math.ceil((RECORD_THRESHOLD / gap) ** 2 - 1e-12)
    return max(1, n)
