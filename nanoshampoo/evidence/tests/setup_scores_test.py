"""The performance profile against a direct count, and tunability against a loop."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nanoshampoo.evidence.scaling import Observation
from nanoshampoo.evidence.setup_scores import performance_profile, tunability

SETUPS = ("adamw", "soap", "muon", "sgd")
CELLS = [("s", 10), ("s", 20), ("s", 40), ("m", 10), ("m", 40)]


def random_study(rng_seed: int = 0) -> list[Observation]:
    rng = np.random.default_rng(rng_seed)
    return [
        Observation(setup, size, tokens, seed, 3.0 + rng.uniform(0.0, 0.15))
        for setup in SETUPS
        for size, tokens in CELLS
        for seed in range(3)
    ]


def direct_ratios(obs: list[Observation]) -> dict[str, list[float]]:
    """r_{s,w} = mean loss / best mean loss of the cell, by loops."""
    means = {}
    for setup in SETUPS:
        for cell in CELLS:
            losses = [
                o.loss
                for o in obs
                if (o.setup, o.size, o.tokens) == (setup, *cell) and math.isfinite(o.loss)
            ]
            means[(setup, cell)] = sum(losses) / len(losses) if losses else math.inf
    ratios = {setup: [] for setup in SETUPS}
    for cell in CELLS:
        best = min(means[(setup, cell)] for setup in SETUPS)
        for setup in SETUPS:
            ratios[setup].append(means[(setup, cell)] / best if math.isfinite(best) else math.inf)
    return ratios


def counted_rho(ratios: list[float], tau: float) -> float:
    return sum(1 for r in ratios if r <= tau) / len(ratios)


def test_ratios_rho_and_scores_match_a_direct_count() -> None:
    obs = random_study()
    profile = performance_profile(obs, tau_max=1.04)
    expected = direct_ratios(obs)
    assert profile.cells == (("s", 10), ("s", 20), ("s", 40), ("m", 10), ("m", 40))
    assert list(profile.ratios) == list(SETUPS)
    taus = np.linspace(1.0, 1.04, 40_001)
    for setup in SETUPS:
        np.testing.assert_allclose(profile.ratios[setup], expected[setup], rtol=1e-15)
        for tau in (1.0, 1.01, 1.02, 1.03, 1.04, 2.0):
            assert profile.rho(setup, tau) == counted_rho(expected[setup], tau)
        # The normalized area under ρ over [1, τ_max], by a midpoint sum of the direct count.
        mids = (taus[1:] + taus[:-1]) / 2
        area = sum(counted_rho(expected[setup], t) for t in mids) * (taus[1] - taus[0])
        assert profile.scores[setup] == pytest.approx(area / 0.04, abs=1e-4)
    assert max(profile.scores.values()) < 1.0  # no setup is best in every cell here


def test_best_everywhere_scores_one_and_far_behind_scores_zero() -> None:
    obs = [
        Observation(setup, "s", tokens, 0, loss)
        for tokens in (10, 20)
        for setup, loss in (("best", 3.0), ("far", 3.0 * 1.06), ("tied", 3.0))
    ]
    profile = performance_profile(obs)
    assert profile.scores == {"best": 1.0, "far": 0.0, "tied": 1.0}
    assert profile.tau_max == 1.05


def test_diverged_setups_and_cells_never_count() -> None:
    obs = [
        Observation("a", "s", 10, 0, 3.0),
        Observation("b", "s", 10, 0, math.nan),
        Observation("a", "s", 20, 0, math.inf),
        Observation("b", "s", 20, 0, math.nan),
        Observation("a", "s", 30, 0, 3.0),
        Observation("b", "s", 30, 0, 3.03),
    ]
    profile = performance_profile(obs)
    assert profile.ratios["a"] == (1.0, math.inf, 1.0)
    assert profile.ratios["b"][:2] == (math.inf, math.inf)
    assert profile.scores["a"] == pytest.approx(2 / 3)
    assert profile.scores["b"] == pytest.approx((1.05 - 1.01) / 0.05 / 3)


def test_every_setup_must_run_every_cell() -> None:
    obs = [
        Observation("a", "s", 10, 0, 3.0),
        Observation("b", "s", 10, 0, 3.1),
        Observation("a", "s", 20, 0, 2.9),
    ]
    with pytest.raises(ValueError, match="setup 'b' has no runs at size 's', 20 tokens"):
        performance_profile(obs)


@pytest.mark.parametrize("tau_max", [1.0, 0.9, math.inf, "1.1"])
def test_tau_max_must_exceed_one(tau_max: object) -> None:
    with pytest.raises(ValueError, match="tau_max: must be a finite number > 1"):
        performance_profile([Observation("a", "s", 10, 0, 3.0)], tau_max=tau_max)


def looped_tunability(losses: list[float], tolerance: float) -> tuple[int, int]:
    finite = [x for x in losses if math.isfinite(x)]
    if not finite:
        return len(losses), 0
    best = min(finite)
    within = 0
    for x in losses:
        if math.isfinite(x) and x <= best * (1 + tolerance):
            within += 1
    return len(losses), within


@pytest.mark.parametrize("tolerance", [0.0, 0.005, 0.01, 0.05])
def test_tunability_matches_a_loop(tolerance: float) -> None:
    rng = np.random.default_rng(1)
    losses = list(3.0 + rng.exponential(0.03, size=40))
    losses[5] = math.nan
    losses[11] = math.inf
    result = tunability(losses, tolerance)
    assert (result.trials, result.within) == looped_tunability(losses, tolerance)
    assert result.best == min(x for x in losses if math.isfinite(x))
    assert result.share == result.within / 40 and result.tolerance == tolerance


def test_tunability_edges() -> None:
    assert tunability([3.0, 3.03, 3.0301]).within == 2  # 3.03 is exactly 1 % above the best
    every = tunability([math.nan, math.inf])
    assert (every.trials, every.within, every.best, every.share) == (2, 0, None, 0.0)
    with pytest.raises(ValueError, match="trial_losses: need at least one trial"):
        tunability([])
    with pytest.raises(ValueError, match=r"trial_losses\[1\]: must be a number >= 0"):
        tunability([3.0, -1.0])
    with pytest.raises(ValueError, match="tolerance: must be a finite number >= 0"):
        tunability([3.0], tolerance=-0.01)
