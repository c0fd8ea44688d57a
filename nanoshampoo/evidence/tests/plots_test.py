"""The loss-curve figures: a mean curve ends at the mean final loss (runs averaged at equal
progress, not cut at the earliest end), the zoom keeps every setup, runs validated only at
their end draw without warnings, and the log axis has plain tick labels."""

from __future__ import annotations

import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest

from nanoshampoo.evidence.logs import RunRecord, ValPoint
from nanoshampoo.evidence.plots import mean_std_by_progress, plot_curve


def _run(name: str, points: list[tuple[int, float, float]]) -> RunRecord:
    curve = tuple(ValPoint(step, loss, ms) for step, loss, ms in points)
    return RunRecord(Path(f"{name}.jsonl"), name, points[-1][0], curve, points[-1][2], 1.0)


def test_runs_are_averaged_at_equal_progress_and_end_at_the_mean_final_loss() -> None:
    xs = [np.array([0.0, 10.0, 20.0]), np.array([0.0, 15.0, 30.0])]
    ys = [np.array([8.0, 6.0, 5.0]), np.array([8.2, 6.4, 5.4])]
    x, mean, std = mean_std_by_progress(xs, ys, points=5)
    # By hand: at progress u, run i is at x_i(u) with loss y_i(u) (linear between its points).
    for k, u in enumerate(np.linspace(0, 1, 5)):
        at = [
            (np.interp(u, [0, 0.5, 1], xi), np.interp(u, [0, 0.5, 1], yi)) for xi, yi in zip(xs, ys)
        ]
        assert x[k] == pytest.approx(np.mean([a for a, _ in at]))
        assert mean[k] == pytest.approx(np.mean([b for _, b in at]))
        assert std[k] == pytest.approx(np.std([b for _, b in at], ddof=1))
    assert (x[-1], mean[-1]) == (pytest.approx(25.0), pytest.approx(5.2))  # the mean end


def _curve_lines(ax: plt.Axes) -> dict[str, np.ndarray]:
    return {
        line.get_label().split(" (")[0]: np.asarray(line.get_xdata())
        for line in ax.get_lines()
        if len(line.get_xdata()) > 2
    }


def test_the_zoom_keeps_a_setup_that_ended_before_the_others_last_30_percent() -> None:
    fast = [
        _run(f"fast{s}", [(0, 8.0, 0.0), (50, 6.0, 1000.0 + s), (100, 5.1, 2000.0 + s)])
        for s in range(2)
    ]
    slow = [
        _run(f"slow{s}", [(0, 8.0, 0.0), (50, 6.1, 5000.0), (100, 5.0, 10000.0 + s)])
        for s in range(2)
    ]
    fig = plot_curve({"fast": fast, "slow": slow}, target=5.05, x="time")
    zoom = fig.axes[1]
    low, high = zoom.get_xlim()
    for name, x in _curve_lines(zoom).items():
        assert low <= x[-1] <= high, f"{name} ends outside the zoom"
    plt.close(fig)


def test_runs_validated_only_at_their_end_draw_without_warnings() -> None:
    groups = {
        name: [_run(f"{name}{s}", [(100, loss + 0.01 * s, 1000.0 + s)]) for s in range(2)]
        for name, loss in (("adamw", 5.0), ("muon", 4.9))
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig = plot_curve(groups, target=5.0, x="step")
        fig.canvas.draw()
    plt.close(fig)
    assert [str(w.message) for w in caught] == []


def test_the_log_loss_axis_has_plain_tick_labels() -> None:
    runs = [
        _run(f"a{s}", [(0, 9.0, 0.0), (50, 6.0, 500.0), (100, 4.5 + 0.01 * s, 1000.0)])
        for s in range(2)
    ]
    fig = plot_curve({"a": runs}, target=4.5, x="step")
    fig.canvas.draw()
    whole = fig.axes[0]
    labels = [t.get_text() for t in (*whole.get_yticklabels(which="both"),) if t.get_text()]
    assert labels and all("times" not in t and "×" not in t and "^" not in t for t in labels)
    assert all(float(t) > 0 for t in labels)
    plt.close(fig)
