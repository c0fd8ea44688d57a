"""PNG figures of repeated runs: validation-loss curves (mean ± 1 std) and an A/B figure.

Curves of a group are averaged run by run at equal progress through each run (steps, or
training seconds), so a mean curve ends at the group's mean final loss; the band is ±1 unbiased
std over seeds. The whole curves are drawn on a log loss axis with plain tick labels, and a zoom
shows the last 30 % of every setup's curve, where the target is decided (every setup stays in
it, also one that ended early). A run validated only at its end is a point. The A/B figure
shows every run's final loss and train time per group, with the group mean and its 95 % t
confidence interval. Diverged runs are left out of every figure (the legend counts them).

Matplotlib runs on the Agg backend, so plotting needs no display.

Example:
    >>> paths = write_plots(groups, report, "plots/")  # doctest: +SKIP
    >>> [p.name for p in paths]  # doctest: +SKIP
    ['val_loss_curves.png', 'ab_comparison.png']
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen before pyplot loads
import numpy as np  # noqa: E402
import scipy.stats  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FormatStrFormatter  # noqa: E402

from nanoshampoo.evidence.logs import RunRecord  # noqa: E402
from nanoshampoo.evidence.stats import EvidenceReport  # noqa: E402
from nanoshampoo.io_utils import atomic_output, check_output_dir  # noqa: E402

GRID_POINTS = 400
ZOOM_FRACTION = 0.3


def mean_std_by_progress(
    xs: Sequence[np.ndarray], ys: Sequence[np.ndarray], points: int = GRID_POINTS
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Average curves ``(xs[i], ys[i])`` run by run at equal progress; return ``(x, mean,
    std)``.

    Each run is read at the same fractions ``u`` of its own span (``u = 0`` its first point,
    ``u = 1`` its last), and ``x``, the loss mean and its unbiased std are taken over runs at
    each ``u``. So the mean curve ends at the mean final loss and at the runs' mean end: seeds
    that end at different times (the time axis) are not cut at the earliest end, where the
    others are still mid-decay. Each ``xs[i]`` must be increasing; a one-point curve is a
    point. ``std`` is zeros for one curve.
    """
    progress = np.linspace(0.0, 1.0, points)
    at_x, at_y = [], []
    for x, y in zip(xs, ys):
        span = float(x[-1] - x[0])
        own = (x - x[0]) / span if span > 0 else np.zeros_like(x, dtype=np.float64)
        at_x.append(np.interp(progress, own, x) if span > 0 else np.full(points, float(x[0])))
        at_y.append(np.interp(progress, own, y) if span > 0 else np.full(points, float(y[-1])))
    stacked = np.stack(at_y)
    std = stacked.std(axis=0, ddof=1) if len(xs) >= 2 else np.zeros(points)
    return np.stack(at_x).mean(axis=0), stacked.mean(axis=0), std


# The two x axes of a loss curve: file-name stem and axis label.
CURVE_AXES = {"step": "step", "time": "train time (s)"}


def plot_curves(groups: Mapping[str, Sequence[RunRecord]], target: float) -> Figure:
    """2x2 figure: loss vs step and vs train time; whole curves on top, zoom below."""
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    for column, x in enumerate(CURVE_AXES):
        _draw_curves(axes[0][column], axes[1][column], groups, target, x)
    axes[0][0].legend(loc="upper right")
    return fig


def plot_curve(groups: Mapping[str, Sequence[RunRecord]], target: float, x: str) -> Figure:
    """1x2 figure of loss vs ``x`` (``"step"`` or ``"time"``): whole curves, then the zoom."""
    if x not in CURVE_AXES:
        raise ValueError(f"x: expected one of {sorted(CURVE_AXES)}, got {x!r}")
    fig, (whole, zoom) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    _draw_curves(whole, zoom, groups, target, x)
    whole.legend(loc="upper right")
    return fig


def _draw_curves(
    whole: Axes, zoom: Axes, groups: Mapping[str, Sequence[RunRecord]], target: float, x: str
) -> None:
    """Mean ± 1 std of every group's finished runs on ``whole`` and on ``zoom``."""
    label = CURVE_AXES[x]
    for color, (name, runs) in zip(_colors(), groups.items()):
        finished = [run for run in runs if not run.diverged]
        if not finished:
            continue
        xs = [_curve_x(run, x) for run in finished]
        ys = [np.array([p.val_loss for p in run.curve]) for run in finished]
        grid, mean, std = mean_std_by_progress(xs, ys)
        diverged = len(runs) - len(finished)
        legend = f"{name} (n={len(finished)}" + (f", {diverged} diverged)" if diverged else ")")
        for ax in (whole, zoom):
            ax.plot(
                grid,
                mean,
                color=color,
                label=legend,
                marker="o" if grid[0] == grid[-1] else None,
                markevery=[len(grid) - 1],
            )
            ax.fill_between(grid, mean - std, mean + std, color=color, alpha=0.25, linewidth=0)
    for ax in (whole, zoom):
        ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:g}")
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
    whole.set_yscale("log")
    # Plain numbers on the log axis ("5", "5.5"), not "5×10⁰".
    whole.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    whole.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    whole.set_title(f"validation loss vs {label} (mean ± 1 std)")
    _zoom(zoom, target)
    zoom.set_title(f"last {ZOOM_FRACTION:.0%} of the run")


def plot_ab(report: EvidenceReport) -> Figure:
    """Final loss and train time per group: runs as points, mean with 95 % CI."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), constrained_layout=True)
    panels = (("final_val_loss", "final validation loss"), ("train_time_s", "train time (s)"))
    rng = np.random.default_rng(0)  # fixed jitter: the same logs give the same figure
    names = [group.name for group in report.groups]
    for ax, (metric, label) in zip(axes, panels):
        for i, (color, group) in enumerate(zip(_colors(), report.groups)):
            values = np.array([getattr(run, metric) for run in group.runs if not run.diverged])
            if not values.size:
                continue
            jitter = rng.uniform(-0.12, 0.12, size=values.size)
            ax.scatter(np.full(values.size, i) + jitter, values, color=color, alpha=0.6, s=20)
            mean = values.mean()
            if values.size >= 2:
                half = scipy.stats.sem(values) * scipy.stats.t.ppf(0.975, values.size - 1)
                ax.errorbar(i + 0.3, mean, yerr=half, fmt="o", color=color, capsize=6)
            else:
                ax.plot(i + 0.3, mean, "o", color=color)
        if metric == "final_val_loss":
            ax.axhline(
                report.target,
                color="black",
                linestyle="--",
                linewidth=1,
                label=f"target {report.target:g}",
            )
            ax.legend(loc="best")
        ax.set_xticks(range(len(names)), names, rotation=15, ha="right")
        ax.set_xlim(-0.6, len(names) - 0.4)
        ax.set_ylabel(label)
        ax.set_title(f"{label}: runs, mean and 95% CI")
        ax.grid(alpha=0.3, axis="y")
    return fig


def write_plots(
    groups: Mapping[str, Sequence[RunRecord]], report: EvidenceReport, out_dir: str | Path
) -> list[Path]:
    """Write ``val_loss_curves.png`` and ``ab_comparison.png`` into ``out_dir``.

    ``OutputPathError`` (one line naming ``out_dir``) when the directory cannot be written.
    """
    out_dir = Path(out_dir)
    check_output_dir(out_dir, "plot directory")
    written = []
    for name, fig in (
        ("val_loss_curves.png", plot_curves(groups, report.target)),
        ("ab_comparison.png", plot_ab(report)),
    ):
        written.append(_save(fig, out_dir / name))
    return written


def write_curve_plots(
    groups: Mapping[str, Sequence[RunRecord]], target: float, out_dir: str | Path
) -> list[Path]:
    """Write ``loss_vs_step.png`` and ``loss_vs_time.png`` into ``out_dir``."""
    return [
        _save(plot_curve(groups, target, x), Path(out_dir) / f"loss_vs_{x}.png") for x in CURVE_AXES
    ]


def _curve_x(run: RunRecord, x: str) -> np.ndarray:
    if x == "step":
        return np.array([p.step for p in run.curve], dtype=np.float64)
    return np.array([p.train_time_ms / 1000.0 for p in run.curve])


def _zoom(ax: Axes, target: float) -> None:
    """Limit ``ax`` to the last ``ZOOM_FRACTION`` of every curve (from the earliest such start,
    so a setup that ended early stays in view) and to the y range drawn there."""
    # The target line (an axhline, two points in axes coordinates) is not a curve.
    curves = [
        tuple(np.asarray(v, dtype=np.float64) for v in line.get_data())
        for line in ax.get_lines()
        if len(line.get_xdata()) > 2
    ]
    if not curves:  # every run diverged: nothing to zoom on
        return
    start = min(float(x[-1]) - ZOOM_FRACTION * float(x[-1] - x[0]) for x, _ in curves)
    hi = max(float(x[-1]) for x, _ in curves)
    if hi > start:  # runs validated only at their end are points: no x range to narrow
        ax.set_xlim(start - 0.02 * (hi - start), hi + 0.02 * (hi - start))
    visible = [target]
    for x, y in curves:
        visible.extend(y[x >= start])
    for band in ax.collections:
        for path in band.get_paths():
            vertices = path.vertices
            visible.extend(vertices[vertices[:, 0] >= start, 1])
    bottom, top = min(visible), max(visible)
    margin = 0.05 * (top - bottom) or 0.01
    ax.set_ylim(bottom - margin, top + margin)


def _colors() -> Iterator[str]:
    return itertools.cycle(plt.rcParams["axes.prop_cycle"].by_key()["color"])


def _save(fig: Figure, path: Path) -> Path:
    try:
        with atomic_output(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)
    return path
