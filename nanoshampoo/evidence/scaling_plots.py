"""PNG figures of a scaling study: speedups, the baseline's fitted curves, the performance profile.

1. ``speedups.png``: speedup against budget, one panel per model size, one line per setup
   through its measured speedups with their bootstrap intervals. A speedup known only as a
   bound is an open triangle at the bound, pointing the way the truth lies (▲ "more than",
   ▼ "less than"), and an interval end that is a bound carries a small triangle too. The
   baseline is the dashed line at 1. Setups at one budget are drawn slightly apart
   (:func:`dodge`), so a drawn x is D·dodge(i, n), not D itself.
2. ``baseline_fits.png``: per size, the baseline's seeds (small points), their means and the
   fitted power law (solid over the fitted budgets, dotted beyond); below, each mean's and
   each seed's difference from the curve (the seeds' spread is invisible on the loss scale).
3. ``performance_profile.png``: ρ_s(τ) of every setup, a step function over [1, τ_max].

Budgets and speedups are on log axes whose ticks are plain numbers (``10M``, ``2``), not powers.
Every drawn curve carries a ``gid`` (``"<setup>:measured"``, ``"<setup>:above"``,
``"<setup>:below"``, ``"seeds"``, ``"means"``, ``"fit"``, ``"residuals"``, ``"seed
residuals"``, ``"<setup>"`` in the profile) so that tests can read the plotted data back.

Example:
    >>> paths = write_scaling_plots(study, observations, "plots/", profile)  # doctest: +SKIP
    >>> [p.name for p in paths]  # doctest: +SKIP
    ['speedups.png', 'baseline_fits.png', 'performance_profile.png']
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen before pyplot loads
import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import (  # noqa: E402
    FixedLocator,
    FormatStrFormatter,
    FuncFormatter,
    NullFormatter,
)

from nanoshampoo.evidence.plots import _colors, _save  # noqa: E402
from nanoshampoo.evidence.scaling import (  # noqa: E402
    BaselineFit,
    Observation,
    ScalingStudy,
    Speedup,
    group_observations,
)
from nanoshampoo.evidence.scaling_report import format_count  # noqa: E402
from nanoshampoo.evidence.setup_scores import PerformanceProfile  # noqa: E402
from nanoshampoo.io_utils import check_output_dir  # noqa: E402

# Tick values for a log speedup axis: enough that a panel spanning a factor of two has three.
_SPEEDUP_TICKS = (
    0.05,
    0.1,
    0.2,
    0.3,
    0.5,
    0.7,
    1,
    1.5,
    2,
    2.5,
    3,
    4,
    5,
    7,
    10,
    15,
    20,
    30,
    50,
    70,
    100,
    150,
    200,
    300,
    500,
    1000,
)
# For the narrow ranges speedups usually span (0.8x-1.3x): the coarse ticks would leave one.
_FINE_SPEEDUP_TICKS = (
    0.3,
    0.4,
    0.5,
    0.6,
    0.7,
    0.8,
    0.9,
    1,
    1.1,
    1.2,
    1.3,
    1.4,
    1.5,
    1.7,
    2,
    2.5,
    3,
)
_BOUND_MARKERS = {"above": "^", "below": "v"}
PANEL = (5.5, 4.5)
# Setups at one budget are drawn side by side so that their markers and error bars do not hide
# each other: setup i of n at D·exp(DODGE·(i − (n − 1)/2)).
DODGE = 0.06


def dodge(index: int, count: int) -> float:
    """The factor on D at which setup ``index`` of ``count`` is drawn."""
    return float(np.exp(DODGE * (index - (count - 1) / 2)))


def plot_speedups(study: ScalingStudy) -> Figure:
    """Speedup against budget, one panel per size (see the module docstring)."""
    sizes = [fit.size for fit in study.fits]
    fig, axes = plt.subplots(
        1,
        len(sizes),
        figsize=(PANEL[0] * len(sizes), PANEL[1]),
        squeeze=False,
        constrained_layout=True,
    )
    setups = list(dict.fromkeys(s.setup for s in study.speedups))
    # The baseline takes the first color, as it does where it is drawn with the setups.
    colors = dict(zip([study.baseline, *setups], _colors()))
    for ax, fit in zip(axes[0], study.fits):
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label=f"{study.baseline} (1×)")
        for i, setup in enumerate(setups):
            cells = [s for s in study.speedups if s.size == fit.size and s.setup == setup]
            _draw_setup_speedups(ax, setup, cells, colors[setup], dodge(i, len(setups)))
        ax.set_xscale("log")
        ax.set_yscale("log")
        _budget_ticks(
            ax, sorted({*fit.tokens, *(s.tokens for s in study.speedups if s.size == fit.size)})
        )
        _plain_log_ticks(ax)
        ax.set_xlabel("budget D (training tokens)")
        ax.set_ylabel(f"speedup: {study.baseline} tokens / D")
        diverged = [
            f"{s.setup} at {format_count(s.tokens)}"
            for s in study.speedups
            if s.size == fit.size and s.kind == "diverged"
        ]
        ax.set_title(
            f"size {fit.size}: speedup over {study.baseline}"
            + (f"\nevery run diverged: {', '.join(diverged)}" if diverged else "")
        )
        ax.grid(alpha=0.3, which="major")
    # One legend for all panels, below them, where it hides no point.
    handles = {h.get_label(): h for ax in axes[0] for h in ax.get_legend_handles_labels()[0]}
    fig.legend(
        handles=[*handles.values(), *_bound_legend()],
        loc="outside lower center",
        ncols=min(4, len(handles) + 3),
        fontsize="small",
    )
    return fig


def _draw_setup_speedups(
    ax: Axes, setup: str, cells: list[Speedup], color: str, shift: float
) -> None:
    """One setup's speedups on ``ax``, drawn at D·``shift``."""
    measured = [s for s in cells if s.kind == "measured"]
    ax.plot(
        [s.tokens * shift for s in measured],
        [s.value for s in measured],
        "o-",
        color=color,
        label=setup,
        gid=f"{setup}:measured",
    )
    for kind, marker in _BOUND_MARKERS.items():
        bounds = [s for s in cells if s.kind == kind]
        if bounds:
            ax.plot(
                [s.tokens * shift for s in bounds],
                [s.value for s in bounds],
                linestyle="none",
                marker=marker,
                markersize=10,
                fillstyle="none",
                markeredgewidth=1.5,
                color=color,
                gid=f"{setup}:{kind}",
            )
    with_interval = [s for s in cells if s.interval is not None]
    if not with_interval:
        return
    x = np.array([s.tokens * shift for s in with_interval], dtype=np.float64)
    y = np.array([s.value for s in with_interval])
    low = np.array([s.interval.low for s in with_interval])
    high = np.array([s.interval.high for s in with_interval])
    ax.errorbar(x, y, yerr=[y - low, high - y], fmt="none", ecolor=color, capsize=3, elinewidth=1)
    for end, kind in ((low, "below"), (high, "above")):
        hit = [
            i
            for i, s in enumerate(with_interval)
            if (s.interval.low_kind if kind == "below" else s.interval.high_kind) == kind
        ]
        if hit:
            ax.plot(
                x[hit],
                end[hit],
                linestyle="none",
                marker=_BOUND_MARKERS[kind],
                markersize=5,
                color=color,
            )


def _bound_legend() -> list[Line2D]:
    """Legend entries for the bound markers (not drawn on the axes)."""
    return [
        Line2D(
            [],
            [],
            linestyle="none",
            marker="^",
            fillstyle="none",
            color="gray",
            markersize=10,
            label="speedup > this (loss below the fitted range)",
        ),
        Line2D(
            [],
            [],
            linestyle="none",
            marker="v",
            fillstyle="none",
            color="gray",
            markersize=10,
            label="speedup < this (loss above the fitted range)",
        ),
        Line2D(
            [],
            [],
            linestyle="none",
            marker="^",
            color="gray",
            markersize=5,
            label="interval end that is a bound (> or <)",
        ),
    ]


def plot_baseline_fits(study: ScalingStudy, observations: Sequence[Observation]) -> Figure:
    """Per size: the baseline's seeds, means and fitted curve; residuals below."""
    cells = group_observations(observations)
    n = len(study.fits)
    fig, axes = plt.subplots(
        2,
        n,
        figsize=(PANEL[0] * n, PANEL[1] + 1.5),
        squeeze=False,
        sharex="col",
        height_ratios=(3, 1),
        constrained_layout=True,
    )
    for column, fit in enumerate(study.fits):
        top, bottom = axes[0][column], axes[1][column]
        seeds = [
            (t, loss) for t in fit.tokens for loss in cells[(study.baseline, fit.size, t)].losses
        ]
        diverged = sum(cells[(study.baseline, fit.size, t)].diverged for t in fit.tokens)
        top.plot(
            [t for t, _ in seeds],
            [loss for _, loss in seeds],
            linestyle="none",
            marker=".",
            color="gray",
            alpha=0.6,
            label="seeds",
            gid="seeds",
        )
        top.plot(
            fit.tokens,
            fit.mean_losses,
            linestyle="none",
            marker="o",
            color="C0",
            label="seed mean",
            gid="means",
        )
        _draw_fit(top, fit)
        top.set_ylabel("final validation loss")
        top.set_title(
            f"size {fit.size}: {study.baseline}"
            + (f" ({diverged} diverged runs left out)" if diverged else "")
        )
        top.legend(loc="upper right", fontsize="small")
        top.grid(alpha=0.3)
        bottom.axhline(0.0, color="black", linewidth=1)
        bottom.plot(
            [t for t, _ in seeds],
            [loss - fit.loss(t) for t, loss in seeds],
            linestyle="none",
            marker=".",
            color="gray",
            alpha=0.6,
            gid="seed residuals",
        )
        bottom.plot(fit.tokens, fit.residuals, "o", color="C0", gid="residuals")
        bottom.set_ylabel("loss − fit")
        bottom.set_xlabel("budget D (training tokens)")
        bottom.grid(alpha=0.3)
        bottom.set_xscale("log")
        _budget_ticks(bottom, list(fit.tokens))
    return fig


def _draw_fit(ax: Axes, fit: BaselineFit) -> None:
    """The fitted curve: solid over [D_min, D_max], dotted a little beyond on either side."""
    d_min, d_max = fit.tokens[0], fit.tokens[-1]
    inside = np.geomspace(d_min, d_max, 200)
    ax.plot(inside, fit.loss(inside), color="C1", label=_fit_label(fit), gid="fit")
    for lo, hi in ((d_min / 1.5, d_min), (d_max, d_max * 1.5)):
        beyond = np.geomspace(lo, hi, 20)
        ax.plot(beyond, fit.loss(beyond), color="C1", linestyle=":")


def _fit_label(fit: BaselineFit) -> str:
    return rf"fit: ${fit.a:.4g}\,D^{{-{fit.alpha:.3f}}} + {fit.c:.3f}$"


def plot_performance_profile(profile: PerformanceProfile) -> Figure:
    """ρ_s(τ) over [1, τ_max] for every setup, its score in the legend."""
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    for color, (setup, ratios) in zip(_colors(), profile.ratios.items()):
        taus, rho = profile_steps(ratios, profile.tau_max)
        ax.step(
            taus,
            rho,
            where="post",
            color=color,
            gid=setup,
            label=f"{setup} (score {profile.scores[setup]:.3f})",
        )
    ax.set_xlim(1.0, profile.tau_max)
    ax.set_ylim(-0.02, 1.02)
    ax.xaxis.set_major_formatter(FormatStrFormatter("%.3f"))
    ax.set_xlabel("τ: final loss / best final loss in the cell")
    ax.set_ylabel("ρ(τ): fraction of (size, budget) cells")
    ax.set_title(f"performance profile over {len(profile.cells)} cells")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def profile_steps(ratios: Sequence[float], tau_max: float) -> tuple[np.ndarray, np.ndarray]:
    """``(taus, rho)`` of a step curve (``where="post"``) equal to ρ(τ) on [1, τ_max]: τ = 1,
    each distinct ratio in (1, τ_max], and τ_max, with ρ at each."""
    r = np.asarray(ratios, dtype=np.float64)
    inside = np.unique(r[(r > 1.0) & (r <= tau_max)])
    taus = np.concatenate([[1.0], inside, [tau_max]])
    rho = np.array([np.mean(r <= tau) for tau in taus])
    return taus, rho


def _budget_ticks(ax: Axes, budgets: list[int]) -> None:
    """Major ticks at the budgets, labelled ``10M``; no minor labels."""
    ax.xaxis.set_major_locator(FixedLocator(budgets))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: format_count(value)))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _plain_log_ticks(ax: Axes) -> None:
    """Plain-number ticks on a log y axis, chosen from ``_SPEEDUP_TICKS`` within its limits
    (from ``_FINE_SPEEDUP_TICKS`` when that would leave fewer than three)."""
    low, high = ax.get_ylim()
    ticks = [t for t in _SPEEDUP_TICKS if low <= t <= high]
    if len(ticks) < 3:
        ticks = [t for t in _FINE_SPEEDUP_TICKS if low <= t <= high]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def write_scaling_plots(
    study: ScalingStudy,
    observations: Sequence[Observation],
    out_dir: str | Path,
    profile: PerformanceProfile | None = None,
) -> list[Path]:
    """Write ``speedups.png``, ``baseline_fits.png`` and (with ``profile``)
    ``performance_profile.png`` into ``out_dir``; ``OutputPathError`` naming it when it cannot
    be written."""
    out_dir = Path(out_dir)
    check_output_dir(out_dir, "plot directory")
    figures = [
        ("speedups.png", plot_speedups(study)),
        ("baseline_fits.png", plot_baseline_fits(study, observations)),
    ]
    if profile is not None:
        figures.append(("performance_profile.png", plot_performance_profile(profile)))
    return [_save(fig, out_dir / name) for name, fig in figures]
