"""Scores that rank setups across a study: the performance profile and tunability.

Performance profile (as AlgoPerf scores training algorithms, here on final losses): the cells
are the (size, budget) pairs of the study. In cell w, setup s's ratio is r_{s,w} = ℓ_{s,w} /
min_s ℓ_{s,w} of seed-mean final losses (``inf`` where every run of s diverged), and its
profile ρ_s(τ) is the fraction of cells with r_{s,w} <= τ. The score is the area under ρ_s over
τ in [1, τ_max] divided by τ_max − 1, so a setup best in every cell scores 1 and one beyond
τ_max everywhere scores 0. A cell contributes (τ_max − r)/(τ_max − 1) when r <= τ_max, which
is that area exactly.

τ_max defaults to 1.05: at one budget, optimizers' final losses differ by a few percent, so a
setup 5 % worse than the best in a cell is counted as not solving it, and over [1, 1.05] the
profile separates setups that differ by tenths of a percent.

Tunability: of one setup's tuning trials at one budget, the share whose final loss is within
1 % of the setup's best trial (a diverged or failed trial, a non-finite loss, is never within).

Example:
    >>> from nanoshampoo.evidence.scaling import Observation
    >>> obs = [Observation("a", "s", 10, 0, 3.0), Observation("b", "s", 10, 0, 3.3),
    ...        Observation("a", "s", 20, 0, 2.9), Observation("b", "s", 20, 0, 2.9)]
    >>> profile = performance_profile(obs)
    >>> {s: round(v, 6) for s, v in profile.scores.items()}
    {'a': 1.0, 'b': 0.5}
    >>> t = tunability([3.0, 3.02, 3.5, float("nan")])
    >>> t.within, t.trials, t.share
    (2, 4, 0.5)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from nanoshampoo.evidence.scaling import Observation, group_observations
from nanoshampoo.validation import is_real

DEFAULT_TAU_MAX = 1.05
DEFAULT_TOLERANCE = 0.01

Cell = tuple[str, int]  # (size, tokens)


@dataclass(frozen=True)
class PerformanceProfile:
    """Ratios, profiles and scores of every setup over the same ``cells``.

    ``ratios[setup][w]`` is r for ``cells[w]`` (>= 1; ``inf`` where the setup has no finished
    run there, and for every setup in a cell where none has); ``scores[setup]`` in [0, 1].
    Setups and sizes keep the order they first appear in; budgets ascend within a size.
    """

    cells: tuple[Cell, ...]
    ratios: Mapping[str, tuple[float, ...]]
    tau_max: float
    scores: Mapping[str, float]

    def rho(self, setup: str, tau: float) -> float:
        """ρ_setup(τ): the fraction of cells where the setup's ratio is <= ``tau``."""
        return float(np.mean(np.asarray(self.ratios[setup]) <= tau))


def performance_profile(
    observations: Sequence[Observation], tau_max: float = DEFAULT_TAU_MAX
) -> PerformanceProfile:
    """The profile of every setup in ``observations`` over every (size, budget) they ran.

    ``ValueError`` naming the setup and cell when a setup has no runs in a cell another setup
    ran (every setup must be compared on the same cells), or when ``tau_max`` is not > 1.
    """
    if not (is_real(tau_max) and math.isfinite(tau_max) and tau_max > 1.0):
        raise ValueError(f"tau_max: must be a finite number > 1, got {tau_max!r}")
    groups = group_observations(observations)
    setups = list(dict.fromkeys(setup for setup, _, _ in groups))
    sizes = list(dict.fromkeys(size for _, size, _ in groups))
    cells = sorted(
        {(size, tokens) for _, size, tokens in groups},
        key=lambda cell: (sizes.index(cell[0]), cell[1]),
    )
    means = np.empty((len(setups), len(cells)))
    for i, setup in enumerate(setups):
        for w, (size, tokens) in enumerate(cells):
            group = groups.get((setup, size, tokens))
            if group is None:
                raise ValueError(
                    f"setup {setup!r} has no runs at size {size!r}, {tokens} tokens; "
                    "a performance profile compares every setup on the same cells"
                )
            means[i, w] = group.losses.mean() if group.losses.size else math.inf
    best = means.min(axis=0)
    with np.errstate(invalid="ignore"):  # inf / inf where no setup finished: no one solved it
        ratios = np.where(np.isfinite(best), means / best, math.inf)
    credit = np.where(ratios <= tau_max, (tau_max - ratios) / (tau_max - 1.0), 0.0)
    return PerformanceProfile(
        cells=tuple(cells),
        ratios={s: tuple(float(r) for r in ratios[i]) for i, s in enumerate(setups)},
        tau_max=float(tau_max),
        scores={s: float(credit[i].mean()) for i, s in enumerate(setups)},
    )


@dataclass(frozen=True)
class Tunability:
    """``within`` of ``trials`` tuning trials ended within ``tolerance`` of ``best`` (the best
    finite final loss; ``None`` when every trial diverged or failed)."""

    trials: int
    within: int
    best: float | None
    tolerance: float

    @property
    def share(self) -> float:
        """``within / trials``."""
        return self.within / self.trials


def tunability(trial_losses: Sequence[float], tolerance: float = DEFAULT_TOLERANCE) -> Tunability:
    """How many trials reach loss <= best·(1 + ``tolerance``); non-finite losses never do.

    ``ValueError`` naming the field for no trials, a loss that is not a number >= 0, or a
    ``tolerance`` that is not >= 0.
    """
    if not (is_real(tolerance) and math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance: must be a finite number >= 0, got {tolerance!r}")
    if not trial_losses:
        raise ValueError("trial_losses: need at least one trial")
    for i, loss in enumerate(trial_losses):
        if not is_real(loss) or loss < 0:
            raise ValueError(
                f"trial_losses[{i}]: must be a number >= 0 (NaN or inf: diverged), got {loss!r}"
            )
    losses = np.asarray(trial_losses, dtype=np.float64)
    finite = losses[np.isfinite(losses)]
    if not finite.size:
        return Tunability(trials=losses.size, within=0, best=None, tolerance=float(tolerance))
    best = float(finite.min())
    within = int(np.sum(finite <= best * (1.0 + tolerance)))
    return Tunability(trials=losses.size, within=within, best=best, tolerance=float(tolerance))
