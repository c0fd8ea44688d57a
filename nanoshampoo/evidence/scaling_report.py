"""The study table: a :class:`~nanoshampoo.evidence.scaling.ScalingStudy` as Markdown or JSON.

The speedup table of each size has a row per setup and a column per budget, headed by the
budget D and the tokens per parameter D/N (N: the size's non-embedding parameters, also a
column). A cell reads
``1.23× [1.10, 1.35]`` (measured, with its bootstrap interval), ``> 1.80× (extrapolated
2.31×) [1.52, > 1.80]`` (the loss is below the baseline's fitted range: only the bound is a
result, the curve's extrapolation is labelled as one), ``< 0.50× [< 0.50, 0.61]`` (above the
range), or ``diverged (3 of 3)``; an interval end written ``> x``/``< x`` is a bound too, and
``[all 1000 resamples above]`` says every resample fell beyond the range. The baseline's fits
follow (a, α, c, each budget's residual, raw and in standard errors of its mean, and the
lack-of-fit F-test), with a sentence for each fit that misses its points beyond seed noise or
has no floor, then the performance profile's scores when one is given.

The JSON form holds the same: the study's dataclasses (non-finite numbers as ``null``), N and
D/N per size, and the profile.

Example:
    >>> format_count(1_500_000), format_count(2_000_000_000), format_count(64_000)
    ('1.5M', '2B', '64k')
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from nanoshampoo.evidence.report import json_ready
from nanoshampoo.evidence.scaling import FitCheck, ScalingStudy, Speedup, SpeedupInterval
from nanoshampoo.evidence.setup_scores import PerformanceProfile
from nanoshampoo.evidence.tables import format_markdown_table
from nanoshampoo.validation import is_int

_UNITS = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k"))


def format_count(count: float) -> str:
    """A token or parameter count with a unit: ``"1.5M"``, ``"2B"``, ``"64k"``, ``"999"``."""
    for scale, unit in _UNITS:
        if abs(count) >= scale:
            return f"{count / scale:.3g}{unit}"
    return f"{count:.3g}"


def format_speedup(speedup: Speedup) -> str:
    """The table cell of one speedup (see the module docstring)."""
    if speedup.kind == "diverged":
        return f"diverged ({speedup.diverged} of {speedup.diverged + speedup.seeds})"
    if speedup.kind == "measured":
        text = f"{speedup.value:.2f}×"
    else:
        sign = ">" if speedup.kind == "above" else "<"
        curve = (
            "beyond the fitted floor"
            if math.isinf(speedup.extrapolated)
            else f"{speedup.extrapolated:.2f}×"
        )
        text = f"{sign} {speedup.value:.2f}× (extrapolated {curve})"
    if speedup.interval is not None:
        text += f" {_format_interval(speedup.interval)}"
    if speedup.diverged:
        text += f"; {speedup.diverged} of {speedup.diverged + speedup.seeds} diverged"
    return text


def _format_interval(interval: SpeedupInterval) -> str:
    if interval.low_kind == interval.high_kind != "measured":
        count = interval.above if interval.low_kind == "above" else interval.below
        share = "all" if count == interval.resamples else f"{count} of"
        return f"[{share} {interval.resamples} resamples {interval.low_kind}]"
    return (
        f"[{_format_end(interval.low, interval.low_kind)}, "
        f"{_format_end(interval.high, interval.high_kind)}]"
    )


def _format_end(value: float, kind: str) -> str:
    sign = {"above": "> ", "below": "< "}.get(kind, "")
    return f"{sign}{value:.2f}"


def _check_params(study: ScalingStudy, non_embedding_params: Mapping[str, int]) -> None:
    for fit in study.fits:
        params = non_embedding_params.get(fit.size)
        if not is_int(params) or params <= 0:
            raise ValueError(
                f"non_embedding_params[{fit.size!r}]: must be an int > 0, got {params!r}"
            )


def _budgets(study: ScalingStudy, size: str) -> list[int]:
    return sorted({s.tokens for s in study.speedups if s.size == size})


def format_study_markdown(
    study: ScalingStudy,
    non_embedding_params: Mapping[str, int],
    profile: PerformanceProfile | None = None,
) -> str:
    """The study as Markdown: speedup table, baseline fits, and the profile's scores.

    ``non_embedding_params`` maps every size to its non-embedding parameter count
    (``ValueError`` naming a size that is missing or not an int > 0).
    """
    _check_params(study, non_embedding_params)
    blocks = [
        f"### Speedup over {study.baseline}: {study.baseline} tokens to reach the setup's "
        f"mean final loss, per token ({study.confidence:.0%} bootstrap interval over seeds, "
        f"{study.resamples} resamples)"
    ]
    for fit in study.fits:
        if _budgets(study, fit.size):
            rows = _speedup_rows(study, fit.size, non_embedding_params[fit.size])
            blocks.append("\n".join(format_markdown_table(rows)))
    blocks += [
        f"### Baseline fits: L(D) = a·D^(−α) + c to {study.baseline}'s mean final losses",
        "\n".join(format_markdown_table(_fit_rows(study))),
        *fit_warnings(study),
    ]
    if profile is not None:
        blocks += [
            f"### Performance profile over {len(profile.cells)} (size, budget) cells, "
            f"τ_max = {profile.tau_max:g}",
            "\n".join(format_markdown_table(_profile_rows(profile))),
        ]
    return "\n\n".join(blocks) + "\n"


def _speedup_rows(study: ScalingStudy, size: str, params: int) -> list[list[str]]:
    budgets = _budgets(study, size)
    cells = {(s.setup, s.tokens): s for s in study.speedups if s.size == size}
    rows = [
        [
            "size",
            "N (non-emb.)",
            "setup",
            *(f"D = {format_count(d)} ({d / params:.3g}/param)" for d in budgets),
        ]
    ]
    for setup in dict.fromkeys(setup for setup, _ in cells):
        row = [size, format_count(params), setup]
        for tokens in budgets:
            speedup = cells.get((setup, tokens))
            row.append("–" if speedup is None else format_speedup(speedup))
        rows.append(row)
    return rows


FIT_HEADER = [
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
# Below this p the curve misses the baseline's points by more than its seeds' noise.
MISFIT_P = 0.05


def _fit_rows(study: ScalingStudy) -> list[list[str]]:
    checks = {check.size: check for check in study.fit_checks}
    rows = [list(FIT_HEADER)]
    for fit in study.fits:
        check = checks.get(fit.size)
        rows.append(
            [
                fit.size,
                ", ".join(format_count(d) for d in fit.tokens),
                f"{fit.a:.4g}",
                f"{fit.alpha:.4f}",
                f"{fit.c:.4f}",
                f"{fit.scale:.4f}",
                ", ".join(f"{r:+.5f}" for r in fit.residuals),
                "–" if check is None else ", ".join(f"{z:+.1f}" for z in check.z),
                "–" if check is None else _format_f_test(check),
            ]
        )
    return rows


def _format_f_test(check: FitCheck) -> str:
    if not math.isfinite(check.f_statistic):
        return "– (no seed noise to compare)" if check.dof[0] > 0 else "– (dof 0)"
    return f"{check.f_statistic:.3g} ({check.dof[0]}, {check.dof[1]}), p {check.p_value:.2g}"


def fit_warnings(study: ScalingStudy) -> list[str]:
    """One sentence per size whose fit misses its points beyond seed noise (the lack-of-fit
    F-test's p below ``MISFIT_P``) or whose floor c sits on its bound 0."""
    found = []
    for check in study.fit_checks:
        if math.isfinite(check.p_value) and check.p_value < MISFIT_P:
            worst = max(abs(z) for z in check.z)
            found.append(
                f"**{check.size}: the fitted curve misses {study.baseline}'s points beyond seed "
                f"noise** (lack-of-fit F {check.f_statistic:.3g} on {check.dof} dof, "
                f"p {check.p_value:.2g}; "
                f"the worst point is {worst:.1f} standard errors off). A speedup read between "
                "budgets rests on the power law's shape there, and its interval counts the "
                "seeds' noise only, not this misfit."
            )
        if check.floor_on_bound:
            found.append(
                f"{check.size}: the fit's floor c is at its bound 0: these budgets do not "
                "determine a floor, so the curve is a pure power law and its extrapolations "
                "beyond the largest budget are the least certain."
            )
    return found


def _profile_rows(profile: PerformanceProfile) -> list[list[str]]:
    rows = [["setup", "score", "best (r = 1)", "within τ_max"]]
    total = len(profile.cells)
    for setup, ratios in profile.ratios.items():
        best = sum(r == 1.0 for r in ratios)
        within = sum(r <= profile.tau_max for r in ratios)
        rows.append(
            [setup, f"{profile.scores[setup]:.3f}", f"{best} of {total}", f"{within} of {total}"]
        )
    return rows


def study_to_dict(
    study: ScalingStudy,
    non_embedding_params: Mapping[str, int],
    profile: PerformanceProfile | None = None,
) -> dict[str, Any]:
    """The study as strict-JSON-ready data: ``json_ready(study)`` plus ``sizes`` (N and D/N at
    each budget, keyed by the budget as a string) and ``performance_profile`` (or ``None``)."""
    _check_params(study, non_embedding_params)
    data = json_ready(study)
    data["sizes"] = {
        fit.size: {
            "non_embedding_params": non_embedding_params[fit.size],
            "tokens_per_param": {
                str(d): d / non_embedding_params[fit.size]
                for d in sorted({*_budgets(study, fit.size), *fit.tokens})
            },
        }
        for fit in study.fits
    }
    data["performance_profile"] = None if profile is None else json_ready(profile)
    return data
