"""The study table in Markdown and JSON: cells by kind, the fits, N and D/N, the profile."""

from __future__ import annotations

import json
import math

import pytest
from scaling_fixtures import PARAMS, study_observations

from nanoshampoo.evidence.scaling import Observation, Speedup, SpeedupInterval, estimate_speedups
from nanoshampoo.evidence.scaling_report import (
    fit_warnings,
    format_count,
    format_speedup,
    format_study_markdown,
    study_to_dict,
)
from nanoshampoo.evidence.setup_scores import performance_profile


@pytest.mark.parametrize(
    "count, text",
    [
        (999, "999"),
        (64_000, "64k"),
        (1_500_000, "1.5M"),
        (100_000_000, "100M"),
        (2_000_000_000, "2B"),
        (1.2e12, "1.2T"),
    ],
)
def test_counts_are_written_with_a_unit(count: float, text: str) -> None:
    assert format_count(count) == text


def speedup(
    kind: str,
    value: float,
    extrapolated: float = 0.0,
    interval: SpeedupInterval | None = None,
    diverged: int = 0,
) -> Speedup:
    return Speedup(
        setup="soap",
        size="s",
        tokens=100,
        kind=kind,
        value=value,
        extrapolated=extrapolated,
        loss=3.0,
        seeds=4,
        diverged=diverged,
        interval=interval,
    )


def interval(
    low: float,
    high: float,
    low_kind: str = "measured",
    high_kind: str = "measured",
    above: int = 0,
    below: int = 0,
) -> SpeedupInterval:
    return SpeedupInterval(
        low=low,
        high=high,
        low_kind=low_kind,
        high_kind=high_kind,
        confidence=0.95,
        resamples=1000,
        above=above,
        below=below,
        failed_fits=0,
    )


@pytest.mark.parametrize(
    "cell, text",
    [
        (speedup("measured", 1.234, 1.234, interval(1.1, 1.351)), "1.23× [1.10, 1.35]"),
        (speedup("measured", 1.234, 1.234), "1.23×"),
        (
            speedup("measured", 3.9, 3.9, interval(3.1, 4.0, high_kind="above", above=40)),
            "3.90× [3.10, > 4.00]",
        ),
        (
            speedup("above", 1.8, 2.312, interval(1.52, 1.8, high_kind="above", above=700)),
            "> 1.80× (extrapolated 2.31×) [1.52, > 1.80]",
        ),
        (
            speedup("above", 1.8, math.inf, interval(1.8, 1.8, "above", "above", above=1000)),
            "> 1.80× (extrapolated beyond the fitted floor) [all 1000 resamples above]",
        ),
        (
            speedup("below", 0.5, 0.41, interval(0.5, 0.5, "below", "below", below=990)),
            "< 0.50× (extrapolated 0.41×) [990 of 1000 resamples below]",
        ),
        (
            speedup("below", 0.5, 0.41, interval(0.5, 0.61, low_kind="below", below=300)),
            "< 0.50× (extrapolated 0.41×) [< 0.50, 0.61]",
        ),
        (speedup("measured", 1.5, 1.5, diverged=1), "1.50×; 1 of 5 diverged"),
        (
            Speedup(
                setup="soap",
                size="s",
                tokens=100,
                kind="diverged",
                value=math.nan,
                extrapolated=math.nan,
                loss=math.nan,
                seeds=0,
                diverged=3,
                interval=None,
            ),
            "diverged (3 of 3)",
        ),
    ],
)
def test_a_cell_says_what_is_known(cell: Speedup, text: str) -> None:
    assert format_speedup(cell) == text


@pytest.fixture(scope="module")
def study_and_profile():
    obs = study_observations(seeds=3, budgets=4)
    return estimate_speedups(obs, "adamw", resamples=30, seed=0), performance_profile(obs)


def tables(markdown: str) -> list[list[list[str]]]:
    """Every Markdown table of ``markdown`` as rows of stripped cells, header first, no rule."""
    found: list[list[list[str]]] = []
    previous = ""
    for line in markdown.splitlines():
        if line.startswith("|") and not line.startswith("|-"):
            if not previous.startswith("|"):
                found.append([])
            found[-1].append([cell.strip() for cell in line.strip("|").split("|")])
        previous = line
    return found


def test_the_markdown_table_has_a_row_per_size_and_setup(study_and_profile) -> None:
    study, profile = study_and_profile
    text = format_study_markdown(study, PARAMS, profile)
    speedup_tables = [t for t in tables(text) if t[0][1] == "N (non-emb.)"]
    assert [t[0] for t in speedup_tables] == [
        [
            "size",
            "N (non-emb.)",
            "setup",
            "D = 100M (5/param)",
            "D = 200M (10/param)",
            "D = 400M (20/param)",
            "D = 800M (40/param)",
        ],
        [
            "size",
            "N (non-emb.)",
            "setup",
            "D = 300M (5/param)",
            "D = 600M (10/param)",
            "D = 1.2B (20/param)",
            "D = 2.4B (40/param)",
        ],
    ]
    cells = {(s.size, s.setup, s.tokens): s for s in study.speedups}
    body = [row for t in speedup_tables for row in t[1:]]
    assert [(r[0], r[2]) for r in body] == [
        (size, setup) for size in ("s", "m") for setup in ("soap", "muon", "sgd")
    ]
    for row in body:
        size, n, setup = row[:3]
        assert n == format_count(PARAMS[size])
        budgets = sorted(t for z, s, t in cells if z == size and s == setup)
        assert row[3:] == [format_speedup(cells[(size, setup, t)]) for t in budgets]


def test_the_markdown_gives_the_fits_and_the_profile(study_and_profile) -> None:
    study, profile = study_and_profile
    text = format_study_markdown(study, PARAMS, profile)
    fits, scores = tables(text)[2:]
    assert fits[0] == [
        "size",
        "budgets",
        "a",
        "α",
        "c",
        "L(D_min) − c",
        "residuals (mean − fit)",
        "residuals / std. error",
        "lack of fit: F (dof), p",
    ]
    for row, fit, check in zip(fits[1:], study.fits, study.fit_checks):
        assert row[0] == fit.size
        assert float(row[2]) == pytest.approx(fit.a, rel=1e-3)
        assert float(row[3]) == pytest.approx(fit.alpha, abs=1e-4)
        assert float(row[4]) == pytest.approx(fit.c, abs=1e-4)
        assert [float(r) for r in row[6].split(", ")] == pytest.approx(fit.residuals, abs=1e-5)
        assert [float(z) for z in row[7].split(", ")] == pytest.approx(check.z, abs=0.05)
        assert row[8] == f"{check.f_statistic:.3g} (1, 8), p {check.p_value:.2g}"
    assert scores[0] == ["setup", "score", "best (r = 1)", "within τ_max"]
    for row in scores[1:]:
        assert float(row[1]) == pytest.approx(profile.scores[row[0]], abs=5e-4)
        assert row[2] == f"{sum(r == 1.0 for r in profile.ratios[row[0]])} of {len(profile.cells)}"
    assert "Performance profile" not in format_study_markdown(study, PARAMS)


def test_the_json_form_is_strict_and_complete(study_and_profile) -> None:
    study, profile = study_and_profile
    data = study_to_dict(study, PARAMS, profile)
    text = json.dumps(data, allow_nan=False)
    back = json.loads(text)
    assert back["baseline"] == "adamw" and back["resamples"] == 30
    assert back["sizes"]["s"] == {
        "non_embedding_params": 20_000_000,
        "tokens_per_param": {
            "100000000": 5.0,
            "200000000": 10.0,
            "400000000": 20.0,
            "800000000": 40.0,
        },
    }
    assert [f["a"] for f in back["fits"]] == [f.a for f in study.fits]
    for got, s in zip(back["speedups"], study.speedups):
        assert (got["setup"], got["size"], got["tokens"], got["kind"]) == (
            s.setup,
            s.size,
            s.tokens,
            s.kind,
        )
        assert got["extrapolated"] == (s.extrapolated if math.isfinite(s.extrapolated) else None)
        assert got["interval"]["low"] == s.interval.low
    assert back["performance_profile"]["scores"] == profile.scores
    assert study_to_dict(study, PARAMS)["performance_profile"] is None


@pytest.mark.parametrize(
    "params, message",
    [
        ({"s": 20_000_000}, r"non_embedding_params\['m'\]: must be an int > 0, got None"),
        ({"s": 20_000_000, "m": 0}, r"non_embedding_params\['m'\]: must be an int > 0, got 0"),
    ],
)
def test_parameter_counts_are_required_for_every_size(study_and_profile, params, message) -> None:
    study, _ = study_and_profile
    for render in (format_study_markdown, study_to_dict):
        with pytest.raises(ValueError, match=message):
            render(study, params)


def test_a_misfit_and_a_floorless_fit_are_said_in_words(study_and_profile) -> None:
    study, _ = study_and_profile
    # The fixture's law is a power law with a floor and small noise: nothing to say.
    assert all(c.p_value >= 0.05 and not c.floor_on_bound for c in study.fit_checks)
    assert fit_warnings(study) == []
    means = {32_768: 6.5833, 65_536: 6.1632, 131_072: 5.4814, 262_144: 4.9809}
    obs = [
        Observation("adamw", "z", t, seed, m + shift)
        for t, m in means.items()
        for seed, shift in enumerate((-0.01, 0.0, 0.01))
    ]
    bad = estimate_speedups(obs, "adamw", resamples=0)
    check = bad.fit_checks[0]
    misfit, floorless = fit_warnings(bad)
    assert misfit.startswith("**z: the fitted curve misses adamw's points beyond seed noise**")
    assert f"p {check.p_value:.2g}" in misfit
    assert f"{max(abs(v) for v in check.z):.1f} standard errors off" in misfit
    assert floorless.startswith("z: the fit's floor c is at its bound 0")
    assert misfit in format_study_markdown(bad, {"z": 1000})
