"""The baseline's power-law fit, speedups with their bounds, and the seed bootstrap, each
against a float64 reference written from the definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.integrate
from scaling_fixtures import LAWS, SPEEDUPS, study_observations, true_loss

from nanoshampoo.evidence.scaling import (
    BaselineFit,
    Observation,
    budget_comparisons,
    check_fit,
    estimate_speedups,
    fit_baseline,
    fit_power_law,
    group_observations,
    speedup_at,
)
from nanoshampoo.evidence.stats import welch_compare

BUDGETS = [1_000_000 * 2**k for k in range(6)]


def law(a: float, alpha: float, c: float, tokens: float) -> float:
    """L(D) = a·D^(−α) + c with D in raw tokens."""
    return a * tokens**-alpha + c


def noiseless_fit(
    a: float = 150.0, alpha: float = 0.4, c: float = 3.0, budgets: list[int] = BUDGETS
) -> BaselineFit:
    return fit_power_law("s", budgets, [law(a, alpha, c, d) for d in budgets])


def sse(budgets: list[int], means: list[float], a: float, alpha: float, c: float) -> float:
    return sum((m - law(a, alpha, c, d)) ** 2 for d, m in zip(budgets, means))


@pytest.mark.parametrize(
    "a, alpha, c, budgets",
    [
        (150.0, 0.4, 3.0, BUDGETS),
        (2.0e3, 0.3, 2.5, [10**8, 2 * 10**8, 4 * 10**8, 10**9, 4 * 10**9]),  # raw tokens up to 4e9
        (0.9, 0.05, 0.5, [10, 100, 1000, 10_000]),  # a shallow law over four decades
        (1.0e6, 1.0, 1.0, [10**6, 3 * 10**6, 10**7, 3 * 10**7]),
    ],
)
def test_noiseless_data_are_fit_exactly(
    a: float, alpha: float, c: float, budgets: list[int]
) -> None:
    fit = noiseless_fit(a, alpha, c, budgets)
    assert fit.alpha == pytest.approx(alpha, rel=1e-7)
    assert fit.c == pytest.approx(c, rel=1e-7)
    assert fit.a == pytest.approx(a, rel=1e-6)
    assert fit.scale == pytest.approx(a * budgets[0] ** -alpha, rel=1e-7)
    assert fit.d_ref == budgets[0] and fit.tokens == tuple(budgets)
    np.testing.assert_allclose(fit.residuals, 0.0, atol=1e-12)
    assert fit.loss_range == pytest.approx(
        (law(a, alpha, c, budgets[-1]), law(a, alpha, c, budgets[0]))
    )


def test_noisy_data_give_a_least_squares_fit_near_the_true_law() -> None:
    a, alpha, c = 150.0, 0.4, 3.0
    budgets = [1_000_000 * 2**k for k in range(8)]
    rng = np.random.default_rng(0)
    means = [law(a, alpha, c, d) + rng.normal(0.0, 2e-4) for d in budgets]
    fit = fit_power_law("s", budgets, means)
    assert fit.alpha == pytest.approx(alpha, abs=0.02)
    assert fit.c == pytest.approx(c, abs=0.01)
    # A least-squares minimum: no lower than the true law's error, and flat in every direction
    # (central differences of the sum of squares in float64, in the raw-token parameters).
    best = sse(budgets, means, fit.a, fit.alpha, fit.c)
    assert best <= sse(budgets, means, a, alpha, c)
    for i, step in enumerate((1e-6 * fit.a, 1e-6, 1e-6)):
        params = np.array([fit.a, fit.alpha, fit.c])
        up, down = params.copy(), params.copy()
        up[i] += step
        down[i] -= step
        slope = (sse(budgets, means, *up) - sse(budgets, means, *down)) / (2 * step)
        assert abs(slope * step) < 1e-3 * best
    # Residuals are mean − a·D^(−α) − c.
    for d, m, r in zip(budgets, means, fit.residuals):
        assert r == pytest.approx(m - law(fit.a, fit.alpha, fit.c, d), abs=1e-12)


def test_the_fit_keeps_its_bounds() -> None:
    # Losses that fall ever faster on a log axis want c < 0: the floor stops at 0.
    budgets = [1, 2, 4, 8, 16]
    fit = fit_power_law("s", budgets, [4.0 - 0.5 * math.log2(d) ** 1.2 for d in budgets])
    assert fit.a > 0 and fit.alpha > 0 and 0.0 <= fit.c < min(fit.mean_losses)


@pytest.mark.parametrize(
    "tokens, losses, message",
    [
        (
            [1, 2, 4],
            [3.0, 2.9, 2.8],
            "size 's': the baseline has 3 budgets; a power-law fit needs at least 4",
        ),
        ([1, 2, 4, 8], [2.8, 2.9, 3.0, 3.1], "size 's': the baseline's mean losses do not fall"),
        ([1, 2, 2, 8], [3.0, 2.9, 2.8, 2.7], "size 's': budgets must be > 0 and differ"),
        ([0, 2, 4, 8], [3.0, 2.9, 2.8, 2.7], "size 's': budgets must be > 0 and differ"),
        ([1, 2, 4, 8], [3.0, 2.9, math.nan, 2.7], "size 's': .* mean losses be finite and > 0"),
    ],
)
def test_a_fit_that_cannot_be_made_names_the_size(
    tokens: list[int], losses: list[float], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        fit_power_law("s", tokens, losses)


def test_effective_tokens_invert_the_curve() -> None:
    fit = noiseless_fit()
    for d in np.geomspace(1e5, 1e9, 13):
        assert fit.effective_tokens(float(fit.loss(d))) == pytest.approx(d, rel=1e-10)
        loss = law(150.0, 0.4, 3.0, d)
        assert fit.effective_tokens(loss) == pytest.approx(
            (150.0 / (loss - 3.0)) ** (1 / 0.4), rel=1e-6
        )
    assert fit.effective_tokens(fit.c) == math.inf


def test_the_baselines_own_points_have_speedup_one() -> None:
    fit = noiseless_fit()
    for d, mean in zip(fit.tokens, fit.mean_losses):
        kind, value, extrapolated = speedup_at(fit, mean, d)
        assert kind == "measured"
        assert value == pytest.approx(1.0, abs=1e-12) and extrapolated == pytest.approx(
            1.0, abs=1e-12
        )


def test_bounds_are_classified_at_the_edges_of_the_fitted_range() -> None:
    fit = noiseless_fit()
    d_min, d_max = fit.tokens[0], fit.tokens[-1]
    low, high = fit.loss_range
    d = 4_000_000
    # The ends themselves are inside.
    assert speedup_at(fit, low, d)[:2] == ("measured", pytest.approx(d_max / d, rel=1e-12))
    assert speedup_at(fit, high, d)[:2] == ("measured", pytest.approx(d_min / d, rel=1e-12))
    # Just beyond them only the bound is a value; the curve's inverse is kept as extrapolated.
    for loss, kind, bound in (
        (low - 1e-9, "above", d_max / d),
        (high + 1e-9, "below", d_min / d),
        (low - 0.05, "above", d_max / d),
        (high + 0.3, "below", d_min / d),
    ):
        got_kind, value, extrapolated = speedup_at(fit, loss, d)
        assert (got_kind, value) == (kind, bound)
        assert extrapolated == pytest.approx(
            (fit.a / (loss - fit.c)) ** (1 / fit.alpha) / d, rel=1e-6
        )
    assert speedup_at(fit, fit.c - 0.1, d) == ("above", d_max / d, math.inf)


@pytest.mark.parametrize(
    "field, kwargs, message",
    [
        ("setup", dict(setup=""), "setup: must be a non-empty string"),
        ("size", dict(size=3), "size: must be a non-empty string"),
        ("tokens", dict(tokens=0), "tokens: must be an int > 0"),
        ("tokens", dict(tokens=1.5e6), "tokens: must be an int > 0"),
        ("seed", dict(seed=None), "seed: must be an int"),
        ("loss", dict(loss=-0.1), "loss: must be a number >= 0"),
        ("loss", dict(loss="3.2"), "loss: must be a number >= 0"),
    ],
)
def test_an_observation_refuses_a_bad_field(field: str, kwargs: dict, message: str) -> None:
    values = dict(setup="adamw", size="s", tokens=1000, seed=0, loss=3.0) | kwargs
    with pytest.raises(ValueError, match=message):
        Observation(**values)


def test_grouping_orders_seeds_and_counts_diverged_runs() -> None:
    obs = [
        Observation("a", "s", 10, seed, loss)
        for seed, loss in ((2, 3.2), (0, 3.0), (3, math.nan), (1, 3.1), (4, math.inf))
    ]
    cell = group_observations(obs)[("a", "s", 10)]
    assert cell.losses.tolist() == [3.0, 3.1, 3.2] and cell.diverged == 2
    with pytest.raises(ValueError, match="setup 'a', size 's', 10 tokens, seed 1 appears twice"):
        group_observations([*obs, Observation("a", "s", 10, 1, 3.0)])


def test_point_speedups_follow_the_definition() -> None:
    obs = study_observations()
    study = estimate_speedups(obs, "adamw", resamples=0)
    assert [f.size for f in study.fits] == list(LAWS)
    for fit in study.fits:
        assert fit == fit_baseline(obs, "adamw", fit.size)
    cells = group_observations(obs)
    assert {(s.setup, s.size, s.tokens) for s in study.speedups} == {
        key for key in cells if key[0] != "adamw"
    }
    for s in study.speedups:
        fit = study.fit(s.size)
        loss = float(np.mean(cells[(s.setup, s.size, s.tokens)].losses))
        d_eff = (fit.a / (loss - fit.c)) ** (1 / fit.alpha)
        assert s.loss == pytest.approx(loss, abs=1e-15) and s.interval is None
        assert s.extrapolated == pytest.approx(d_eff / s.tokens, rel=1e-9)
        if fit.tokens[0] <= d_eff <= fit.tokens[-1]:
            assert s.kind == "measured" and s.value == pytest.approx(d_eff / s.tokens, rel=1e-9)
        else:
            above = d_eff > fit.tokens[-1]
            assert s.kind == ("above" if above else "below")
            assert s.value == (fit.tokens[-1] if above else fit.tokens[0]) / s.tokens
    # The true speedups are recovered where they are measured.
    for s in study.speedups:
        if s.kind == "measured":
            assert s.value == pytest.approx(SPEEDUPS[s.setup], rel=0.06)


def reference_bootstrap(
    obs: list[Observation], baseline: str, resamples: int, confidence: float, seed: int
) -> dict[tuple[str, str, int], tuple]:
    """The documented bootstrap, replayed: per size, per resample, the baseline's seed indices
    at each budget, then each setup's at each budget; refit; censor D_eff to [D_min, D_max]."""
    rng = np.random.default_rng(seed)
    losses: dict[tuple[str, str, int], list[float]] = {}
    for o in sorted(obs, key=lambda o: o.seed):
        if math.isfinite(o.loss):
            losses.setdefault((o.setup, o.size, o.tokens), []).append(o.loss)
    setups = list(dict.fromkeys(o.setup for o in obs))
    results = {}
    for size in dict.fromkeys(o.size for o in obs):
        budgets = sorted(t for s, z, t in losses if s == baseline and z == size)
        cells = sorted(
            (
                (s, t)
                for s, z, t in losses
                if z == size and s != baseline and len(losses[(s, z, t)]) >= 2
            ),
            key=lambda st: (setups.index(st[0]), st[1]),
        )
        values = {cell: [] for cell in cells}
        counts = {cell: [0, 0] for cell in cells}
        for _ in range(resamples):
            base = []
            for d in budgets:
                x = np.array(losses[(baseline, size, d)])
                base.append(x[rng.integers(0, x.size, x.size)].mean())
            means = {}
            for setup, d in cells:
                x = np.array(losses[(setup, size, d)])
                means[(setup, d)] = x[rng.integers(0, x.size, x.size)].mean()
            fit = fit_power_law(size, budgets, base)
            for (setup, d), loss in means.items():
                d_eff = (fit.a / (loss - fit.c)) ** (1 / fit.alpha) if loss > fit.c else math.inf
                counts[(setup, d)][0] += d_eff > budgets[-1]
                counts[(setup, d)][1] += d_eff < budgets[0]
                values[(setup, d)].append(min(max(d_eff, budgets[0]), budgets[-1]) / d)
        for setup, d in cells:
            low, high = np.percentile(
                values[(setup, d)], [50 * (1 - confidence), 50 * (1 + confidence)]
            )
            results[(setup, size, d)] = (low, high, *counts[(setup, d)])
    return results


def test_the_bootstrap_matches_a_hand_written_loop() -> None:
    # Few seeds and much noise, so some intervals reach beyond the fitted range.
    obs = study_observations(seeds=3, noise=0.02, budgets=4)
    study = estimate_speedups(obs, "adamw", resamples=60, confidence=0.9, seed=7)
    reference = reference_bootstrap(obs, "adamw", 60, 0.9, seed=7)
    assert len(reference) == len(study.speedups)
    censored_ends = 0
    for s in study.speedups:
        low, high, above, below = reference[(s.setup, s.size, s.tokens)]
        fit = study.fit(s.size)
        i = s.interval
        assert (i.low, i.high) == (pytest.approx(low, rel=1e-6), pytest.approx(high, rel=1e-6))
        assert (i.above, i.below, i.resamples, i.failed_fits, i.confidence) == (
            above,
            below,
            60,
            0,
            0.9,
        )
        for end, kind in ((i.low, i.low_kind), (i.high, i.high_kind)):
            expected = (
                "below"
                if end <= fit.tokens[0] / s.tokens + 1e-12
                else "above"
                if end >= fit.tokens[-1] / s.tokens - 1e-12
                else "measured"
            )
            assert kind == expected
            censored_ends += kind != "measured"
    assert censored_ends > 0  # the case the censoring is for did occur


def test_the_bootstrap_is_reproducible_and_depends_on_its_seed() -> None:
    obs = study_observations(seeds=3, budgets=4)
    first = estimate_speedups(obs, "adamw", resamples=20, seed=1)
    assert estimate_speedups(obs, "adamw", resamples=20, seed=1) == first
    assert estimate_speedups(obs, "adamw", resamples=20, seed=2) != first


def test_cells_without_enough_seeds_get_no_interval() -> None:
    obs = study_observations(seeds=3, budgets=4)
    one_seed = [o for o in obs if not (o.setup == "soap" and o.size == "s" and o.seed > 0)]
    study = estimate_speedups(one_seed, "adamw", resamples=10)
    for s in study.speedups:
        assert (s.interval is None) == (s.setup == "soap" and s.size == "s")
    # One seed at one baseline budget: that size's resampled fits would ignore its noise.
    thin = [
        o
        for o in obs
        if not (o.setup == "adamw" and o.size == "m" and o.tokens == 300_000_000 and o.seed > 0)
    ]
    study = estimate_speedups(thin, "adamw", resamples=10)
    for s in study.speedups:
        assert (s.interval is None) == (s.size == "m")


def test_diverged_runs_are_counted_and_left_out() -> None:
    obs = study_observations(seeds=3, budgets=4)
    cell = ("muon", "s", 200_000_000)
    broken = [
        Observation(*cell, o.seed, math.nan) if (o.setup, o.size, o.tokens) == cell else o
        for o in obs
    ]
    broken = [
        o
        for o in broken
        if not (o.setup == "soap" and o.size == "s" and o.tokens == 100_000_000 and o.seed == 0)
    ] + [Observation("soap", "s", 100_000_000, 0, math.inf)]
    study = estimate_speedups(broken, "adamw", resamples=0)
    by_cell = {(s.setup, s.size, s.tokens): s for s in study.speedups}
    gone = by_cell[cell]
    assert (gone.kind, gone.seeds, gone.diverged, gone.interval) == ("diverged", 0, 3, None)
    assert math.isnan(gone.value) and math.isnan(gone.loss)
    part = by_cell[("soap", "s", 100_000_000)]
    finite = [
        o.loss for o in obs if (o.setup, o.size, o.tokens) == ("soap", "s", 100_000_000) and o.seed
    ]
    assert (part.seeds, part.diverged, part.loss) == (
        2,
        1,
        pytest.approx(np.mean(finite), abs=1e-15),
    )
    dead_baseline = [
        Observation("adamw", "s", 100_000_000, o.seed, math.nan)
        if (o.setup, o.size, o.tokens) == ("adamw", "s", 100_000_000)
        else o
        for o in obs
    ]
    with pytest.raises(
        ValueError, match="size 's': every run of the baseline 'adamw' at 100000000"
    ):
        estimate_speedups(dead_baseline, "adamw", resamples=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(baseline="sgdm"), "size 's': no runs of the baseline 'sgdm'"),
        (dict(resamples=-1), "resamples: must be an int >= 0"),
        (dict(confidence=1.0), r"confidence: must be in \(0, 1\)"),
    ],
)
def test_bad_study_arguments_are_named(kwargs: dict, message: str) -> None:
    arguments = dict(baseline="adamw", resamples=0) | kwargs
    baseline = arguments.pop("baseline")
    with pytest.raises(ValueError, match=message):
        estimate_speedups(study_observations(seeds=2, budgets=4), baseline, **arguments)


def test_one_budget_comparisons_are_welchs() -> None:
    obs = study_observations(seeds=3, budgets=4)
    found = budget_comparisons(obs, "adamw", confidence=0.9)
    cells = group_observations(obs)
    assert len(found) == len([k for k in cells if k[0] != "adamw"])
    for c in found:
        setup = c.comparison.candidate
        expected = welch_compare(
            "final_val_loss",
            ("adamw", list(cells[("adamw", c.size, c.tokens)].losses)),
            (setup, list(cells[(setup, c.size, c.tokens)].losses)),
            0.9,
        )
        assert c.comparison == expected
        assert c.comparison.difference == pytest.approx(
            true_loss(c.size, SPEEDUPS[setup] * c.tokens) - true_loss(c.size, c.tokens), abs=0.02
        )


def f_upper_tail(x: float, d1: int, d2: int) -> float:
    """P(F > x) for F(d1, d2), integrating the density written from its definition."""
    log_norm = (
        math.lgamma((d1 + d2) / 2)
        - math.lgamma(d1 / 2)
        - math.lgamma(d2 / 2)
        + (d1 / 2) * math.log(d1 / d2)
    )

    def density(t: float) -> float:
        return math.exp(
            log_norm + (d1 / 2 - 1) * math.log(t) - ((d1 + d2) / 2) * math.log1p(d1 * t / d2)
        )

    value, _ = scipy.integrate.quad(density, x, math.inf, epsabs=0.0, epsrel=1e-12, limit=200)
    return value


def reference_fit_check(fit: BaselineFit, runs: dict[int, list[float]]) -> tuple:
    """(standard errors, z, F, dof, p) of the lack-of-fit test, with plain loops."""
    pure_error, total = 0.0, 0
    for tokens in fit.tokens:
        losses = runs[tokens]
        mean = sum(losses) / len(losses)
        pure_error += sum((v - mean) ** 2 for v in losses)
        total += len(losses)
    dof = (len(fit.tokens) - 3, total - len(fit.tokens))
    sigma = math.sqrt(pure_error / dof[1])
    errors = [sigma / math.sqrt(len(runs[t])) for t in fit.tokens]
    z = [r / e for r, e in zip(fit.residuals, errors)]
    f = sum(v * v for v in z) / dof[0]
    return errors, z, f, dof, f_upper_tail(f, *dof)


@pytest.mark.parametrize("budgets, seeds", [(4, 3), (5, 3), (6, 2)])
def test_the_fit_check_is_the_lack_of_fit_test(budgets: int, seeds: int) -> None:
    obs = study_observations(seeds=seeds, noise=0.01, budgets=budgets)
    cells = {t: c for (s, z, t), c in group_observations(obs).items() if s == "adamw" and z == "s"}
    fit = fit_baseline(obs, "adamw", "s")
    check = check_fit(fit, cells)
    runs = {
        t: [o.loss for o in obs if (o.setup, o.size, o.tokens) == ("adamw", "s", t)] for t in cells
    }
    errors, z, f, dof, p = reference_fit_check(fit, runs)
    assert check.standard_errors == pytest.approx(errors, rel=1e-12)
    assert check.z == pytest.approx(z, rel=1e-9)
    assert check.dof == dof
    assert check.f_statistic == pytest.approx(f, rel=1e-9)
    assert check.p_value == pytest.approx(p, rel=1e-7)
    # The fixture's law has a floor of 2.95 that these budgets resolve.
    assert not check.floor_on_bound
    assert estimate_speedups(obs, "adamw", resamples=0).fit_checks[0] == check


def test_a_curve_that_misses_its_points_fails_the_check() -> None:
    # The embedded study's adamw means at gpt-0.2m, 16-128 steps, with a seed std of 0.01:
    # no a·D^(−α) + c with c >= 0 passes within it, and c goes to its bound.
    means = {32_768: 6.5833, 65_536: 6.1632, 131_072: 5.4814, 262_144: 4.9809}
    obs = [
        Observation("adamw", "z", t, seed, m + shift)
        for t, m in means.items()
        for seed, shift in enumerate((-0.01, 0.0, 0.01))
    ]
    check = estimate_speedups(obs, "adamw", resamples=0).fit_checks[0]
    assert check.floor_on_bound
    assert check.p_value < 1e-6 and max(abs(v) for v in check.z) > 5


def test_the_fit_check_has_no_verdict_without_seed_noise() -> None:
    obs = [Observation("adamw", "s", t, 0, true_loss("s", t)) for t in BUDGETS[:4]]
    obs += [Observation("adamw", "s", t, 1, true_loss("s", t)) for t in BUDGETS[:4]]
    check = estimate_speedups(obs, "adamw", resamples=0).fit_checks[0]
    assert check.standard_errors == (0.0,) * 4 and check.dof == (1, 4)
    assert all(math.isnan(v) for v in (*check.z, check.f_statistic, check.p_value))
    one_seed = [o for o in obs if o.seed == 0]
    check = estimate_speedups(one_seed, "adamw", resamples=0).fit_checks[0]
    assert check.dof == (1, 0) and all(math.isnan(v) for v in check.standard_errors)
    assert math.isnan(check.p_value)
