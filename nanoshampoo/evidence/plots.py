"""PNG figures of repeated runs: validation-loss curves (mean ± 1 std) and an A/B figure.

Curves of a group are interpolated onto a common grid (steps, or training seconds) that
spans the range every run covers, then averaged; the band is ±1 unbiased std over seeds. The
top row shows whole curves (log loss axis), the bottom row zooms on the last 30 % of the
x range, where the target is decided. The A/B figure shows every run's final loss and train
time per group, with the group mean and its 95 % t confidence interval.

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

from nanoshampoo.evidence.logs import RunRecord  # noqa: E402
from nanoshampoo.evidence.stats import EvidenceReport  # noqa: E402
from nanoshampoo.io_utils import atomic_output  # noqa: E402

GRID_POINTS = 400
ZOOM_FRACTION = 0.3


def mean_std_on_grid(
    xs: Sequence[np.ndarray], ys: Sequence[np.ndarray], points: int = GRID_POINTS
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Interpolate curves ``(xs[i], ys[i])`` onto one grid; return ``(grid, mean, std)``.

    Each ``xs[i]`` must be increasing. The grid spans ``[max of starts, min of ends]`` so no
    curve is extrapolated; ``std`` is the unbiased std over curves (zeros for one curve).
    """
    start = max(float(x[0]) for x in xs)
    end = min(float(x[-1]) for x in xs)
    grid = np.linspace(start, end, points)
    stacked = np.stack([np.interp(grid, x, y) for x, y in zip(xs, ys)])
    std = stacked.std(axis=0, ddof=1) if len(xs) >= 2 else np.zeros_like(grid)
    return grid, stacked.mean(axis=0), std


def plot_curves(groups: Mapping[str, Sequence[RunRecord]], target: float) -> Figure:
    """2x2 figure: loss vs step and vs train time; whole curves on top, zoom below."""
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    for column, axis_name in enumerate(("step", "train time (s)")):
        for color, (name, runs) in zip(_colors(), groups.items()):
            xs = [_curve_x(run, column) for run in runs]
            ys = [np.array([p.val_loss for p in run.curve]) for run in runs]
            grid, mean, std = mean_std_on_grid(xs, ys)
            for row in range(2):
                ax = axes[row][column]
                ax.plot(grid, mean, color=color, label=f"{name} (n={len(runs)})")
                ax.fill_between(grid, mean - std, mean + std, color=color, alpha=0.25, linewidth=0)
        for row in range(2):
            ax = axes[row][column]
            ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:g}")
            ax.set_xlabel(axis_name)
            ax.set_ylabel("validation loss")
            ax.grid(alpha=0.3)
        axes[0][column].set_yscale("log")
        axes[0][column].set_title(f"validation loss vs {axis_name} (mean ± 1 std)")
        _zoom(axes[1][column], target)
        axes[1][column].set_title(f"last {ZOOM_FRACTION:.0%} of the run")
    axes[0][0].legend(loc="upper right")
    return fig


def plot_ab(report: EvidenceReport) -> Figure:
    """Final loss and train time per group: runs as points, mean with 95 % CI."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), constrained_layout=True)
    panels = (("final_val_loss", "final validation loss"), ("train_time_s", "train time (s)"))
    rng = np.random.default_rng(0)  # fixed jitter: the same logs give the same figure
    names = [group.name for group in report.groups]
    for ax, (metric, label) in zip(axes, panels):
        for i, (color, group) in enumerate(zip(_colors(), report.groups)):
            values = np.array([getattr(run, metric) for run in group.runs])
            jitter = rng.uniform(-0.12, 0.12, size=values.size)
            ax.scatter(np.full(values.size, i) + jitter, values, color=color, alpha=0.6, s=20)
            mean = values.mean()
            if values.size >= 2:
                half = scipy.stats.sem(values) * scipy.stats.t.ppf(0.975, values.size - 1)
                ax.errorbar(i + 0.3, mean, yerr=half, fmt="o", color=color, capsize=6)
            else:
                ax.plot(i + 0.3, mean, "o", color=color)
        if metric == "final_val_loss":
            ax.axhline(report.target, color="black", linestyle="--", linewidth=1,
                       label=f"target {report.target:g}")
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
    """Write ``val_loss_curves.png`` and ``ab_comparison.png`` into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in (
        ("val_loss_curves.png", plot_curves(groups, report.target)),
        ("ab_comparison.png", plot_ab(report)),
    ):
        written.append(_save(fig, out_dir / name))
    return written


def _curve_x(run: RunRecord, column: int) -> np.ndarray:
    if column == 0:
        return np.array([p.step for p in run.curve], dtype=np.float64)
    return np.array([p.train_time_ms / 1000.0 for p in run.curve])


def _zoom(ax: Axes, target: float) -> None:
    """Limit ``ax`` to the last part of its x range and to the y range drawn there."""
    # The target line (an axhline, two points in axes coordinates) is not a curve.
    curves = [
        tuple(np.asarray(v, dtype=np.float64) for v in line.get_data())
        for line in ax.get_lines()
        if len(line.get_xdata()) > 2
    ]
    lo = min(float(x[0]) for x, _ in curves)
    hi = max(float(x[-1]) for x, _ in curves)
    start = hi - ZOOM_FRACTION * (hi - lo)
    ax.set_xlim(start, hi)
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
