"""The scaling figures are written and draw exactly the study's numbers (read back from the
Axes, not from pixels)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
from scaling_fixtures import study_observations

from nanoshampoo.evidence.scaling import Observation, estimate_speedups, group_observations
from nanoshampoo.evidence.scaling_plots import (
    dodge,
    plot_baseline_fits,
    plot_performance_profile,
    plot_speedups,
    profile_steps,
    write_scaling_plots,
)
from nanoshampoo.evidence.setup_scores import performance_profile

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def study_data():
    # Much noise and a diverged cell, so that every kind of mark is drawn.
    obs = study_observations(seeds=3, noise=0.02, budgets=4)
    obs = [
        Observation(o.setup, o.size, o.tokens, o.seed, math.nan)
        if (o.setup, o.size, o.tokens) == ("sgd", "m", 2_400_000_000)
        else o
        for o in obs
    ]
    return obs, estimate_speedups(obs, "adamw", resamples=40, seed=0), performance_profile(obs)


def line(ax: plt.Axes, gid: str):
    found = [line for line in ax.get_lines() if line.get_gid() == gid]
    assert len(found) == 1, gid
    return found[0]


def test_the_three_figures_are_written(tmp_path: Path, study_data) -> None:
    obs, study, profile = study_data
    paths = write_scaling_plots(study, obs, tmp_path / "plots", profile)
    assert [p.name for p in paths] == [
        "speedups.png",
        "baseline_fits.png",
        "performance_profile.png",
    ]
    for path in paths:
        assert path.read_bytes()[:8] == PNG_MAGIC
    assert len(write_scaling_plots(study, obs, tmp_path / "two")) == 2


def test_the_speedup_figure_draws_the_speedups(study_data) -> None:
    _, study, _ = study_data
    fig = plot_speedups(study)
    setups = ["soap", "muon", "sgd"]
    kinds_drawn = set()
    try:
        for ax, fit in zip(fig.axes, study.fits):
            assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
            assert any(list(l.get_ydata()) == [1.0, 1.0] for l in ax.get_lines())  # the baseline
            for i, setup in enumerate(setups):
                cells = [s for s in study.speedups if s.size == fit.size and s.setup == setup]
                for kind in ("measured", "above", "below"):
                    want = [s for s in cells if s.kind == kind]
                    if kind != "measured" and not want:
                        assert not [l for l in ax.get_lines() if l.get_gid() == f"{setup}:{kind}"]
                        continue
                    drawn = line(ax, f"{setup}:{kind}")
                    np.testing.assert_allclose(
                        drawn.get_xdata(), [s.tokens * dodge(i, 3) for s in want], rtol=1e-12
                    )
                    np.testing.assert_array_equal(drawn.get_ydata(), [s.value for s in want])
                    kinds_drawn.add(kind)
            # Plain tick labels: budgets as 100M, speedups as plain numbers.
            fig.canvas.draw()
            labels = [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels()]
            assert all("^" not in t and "$" not in t and "×" not in t for t in labels), labels
            assert [t.get_text() for t in ax.get_xticklabels()] == [
                f"{d // 10**6}M" if d < 10**9 else f"{d / 10**9:g}B" for d in fit.tokens
            ]
            assert "1" in [t.get_text() for t in ax.get_yticklabels()]
        assert kinds_drawn == {"measured", "above", "below"}
        assert fig.axes[1].get_title().endswith("every run diverged: sgd at 2.4B")
        assert [t.get_text() for t in fig.legends[0].get_texts()][:4] == [
            "adamw (1×)",
            "soap",
            "muon",
            "sgd",
        ]
    finally:
        plt.close(fig)


def test_the_fit_figure_draws_seeds_means_curve_and_residuals(study_data) -> None:
    obs, study, _ = study_data
    cells = group_observations(obs)
    fig = plot_baseline_fits(study, obs)
    try:
        n = len(study.fits)  # the top row of panels, then the residual row
        tops, bottoms = fig.axes[:n], fig.axes[n:]
        for top, bottom, fit in zip(tops, bottoms, study.fits):
            seeds = [(t, x) for t in fit.tokens for x in cells[("adamw", fit.size, t)].losses]
            np.testing.assert_array_equal(line(top, "seeds").get_xdata(), [t for t, _ in seeds])
            np.testing.assert_array_equal(line(top, "seeds").get_ydata(), [x for _, x in seeds])
            np.testing.assert_array_equal(line(top, "means").get_ydata(), fit.mean_losses)
            curve = line(top, "fit")
            x = np.asarray(curve.get_xdata())
            assert x[0] == pytest.approx(fit.tokens[0]) and x[-1] == pytest.approx(fit.tokens[-1])
            np.testing.assert_allclose(curve.get_ydata(), fit.a * x**-fit.alpha + fit.c, rtol=1e-12)
            np.testing.assert_array_equal(line(bottom, "residuals").get_ydata(), fit.residuals)
            np.testing.assert_allclose(
                line(bottom, "seed residuals").get_ydata(),
                [v - (fit.a * t**-fit.alpha + fit.c) for t, v in seeds],
                atol=1e-12,
            )
            assert bottom.get_xscale() == "log"
    finally:
        plt.close(fig)


def test_the_profile_figure_draws_rho_by_a_direct_count(study_data) -> None:
    _, _, profile = study_data
    fig = plot_performance_profile(profile)
    try:
        ax = fig.axes[0]
        for setup, ratios in profile.ratios.items():
            drawn = line(ax, setup)
            taus, rho = profile_steps(ratios, profile.tau_max)
            np.testing.assert_array_equal(drawn.get_xdata(), taus)
            np.testing.assert_array_equal(drawn.get_ydata(), rho)
            assert taus[0] == 1.0 and taus[-1] == profile.tau_max
            for tau, value in zip(taus, rho):
                assert value == sum(1 for r in ratios if r <= tau) / len(ratios)
            # Between two drawn steps ρ is constant (the step is drawn "post").
            for left, right, value in zip(taus[:-1], taus[1:], rho[:-1]):
                middle = (left + right) / 2
                assert value == sum(1 for r in ratios if r <= middle) / len(ratios)
    finally:
        plt.close(fig)
