"""Telemetry of runs (``train/telemetry.py``'s records), read and drawn.

``nanoshampoo telemetry RUN [RUN ...] [--out DIR]`` draws, for each statistic the runs recorded:

- per run, a heatmap of layer (rows, in the model's order) by step (columns), the colour on a
  log scale when the positive values span more than a decade (``telemetry.<run>.<stat>.png``);
- a line plot of the median over layers against the step, one line per run, on a log axis by
  the same rule (``telemetry.compare.<stat>.png``).

A ``RUN`` is a run's ``.jsonl`` (or ``.txt``, or the path without suffix, ``runs/<id>``), or a
directory: every run log in it. A resumed run may record a step twice: the last record wins.

Example:
    >>> paths = write_telemetry_plots(["runs/tiny-soap-s0-..."], "plots/")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen before pyplot loads
import numpy as np  # noqa: E402
from matplotlib.colors import LogNorm, Normalize  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from nanoshampoo.errors import UserError  # noqa: E402
from nanoshampoo.io_utils import atomic_output  # noqa: E402

# What each statistic measures, for axis labels (the last part of a key: factor0.condition_number).
UNITS = {
    "grad_rms": "gradient RMS (loss / weight unit)",
    "weight_rms": "weight RMS (weight units)",
    "update_rms": "update RMS (weight units per step)",
    "update_ratio": "update RMS / weight RMS (per step)",
    "update_top_sv": "update's largest singular value (weight units)",
    "condition_number": "condition number of F + eps I",
    "effective_rank": "effective rank (dimensions)",
    "share_below_epsilon": "share of eigenvalues below eps (fraction)",
    "failures": "consecutive failed roots/bases (count)",
    "off_diagonal": "off-diagonal share of Q^T F Q (fraction of its norm)",
    "graft_ratio": "||P_shampoo|| / ||P_graft|| (ratio)",
    "ns_orthogonality_error": "||U^T U - I||_F / sqrt(n) of the NS output",
    "ns_sigma_min": "smallest singular value of the NS output",
    "ns_sigma_max": "largest singular value of the NS output",
    "sqrt_v_spread": "max / median sqrt(v) (ratio)",
}
# Positive values spanning more than this ratio (a decade) get a log scale.
LOG_SPAN = 10.0


@dataclass(frozen=True)
class RunTelemetry:
    """One run's records: ``name`` (its run id), ``layers`` (first-seen order), ``steps``
    (ascending) and ``values[stat]`` ``(layers, steps)`` float arrays, NaN where absent."""

    name: str
    layers: tuple[str, ...]
    steps: tuple[int, ...]
    values: dict[str, np.ndarray]


def run_log_paths(target: str | Path) -> list[Path]:
    """The JSONL logs ``target`` names (see the module docstring); ``UserError`` if none."""
    path = Path(target)
    if path.is_dir():
        found = sorted(path.glob("*.jsonl"))
        if not found:
            raise UserError(f"{target}: a directory with no run log (*.jsonl) in it")
        return found
    candidates = [path] if path.suffix == ".jsonl" else [path.with_suffix(".jsonl")]
    if path.suffix not in (".jsonl", ".txt"):
        candidates.append(Path(f"{path}.jsonl"))
    for candidate in candidates:
        if candidate.is_file():
            return [candidate]
    raise UserError(f"{target}: no run log ({' or '.join(str(c) for c in candidates)})")


def read_telemetry(path: Path) -> RunTelemetry:
    """The telemetry records of one JSONL run log; ``UserError`` naming the line if one is
    not JSON, and naming the file if it holds no telemetry."""
    by_point: dict[tuple[int, str], dict[str, float]] = {}
    layers: dict[str, None] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or record.get("kind") != "telemetry":
            continue
        layer, step = record.get("layer"), record.get("step")
        if not isinstance(layer, str) or not isinstance(step, int):
            raise UserError(f"{path}:{lineno}: a telemetry record needs 'layer' and 'step'")
        layers.setdefault(layer)
        by_point[(step, layer)] = {
            key: _number(value)
            for key, value in record.items()
            if key not in ("kind", "step", "layer")
        }
    if not by_point:
        raise UserError(
            f"{path}: no telemetry records (train with --telemetry-every K, K > 0, or the "
            "default, at each validation)"
        )
    steps = tuple(sorted({step for step, _ in by_point}))
    names = tuple(layers)
    stats = sorted({key for values in by_point.values() for key in values})
    values = {stat: np.full((len(names), len(steps)), np.nan) for stat in stats}
    for (step, layer), record in by_point.items():
        row, column = names.index(layer), steps.index(step)
        for key, value in record.items():
            values[key][row, column] = value
    return RunTelemetry(path.stem, names, steps, values)


def _number(value: object) -> float:
    """A record's value as a float (``"inf"``/``"nan"`` strings as written for JSON)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if value in ("inf", "-inf", "nan"):
        return float(value)  # type: ignore[arg-type]
    return math.nan


def unit_label(stat: str) -> str:
    return UNITS.get(stat.rsplit(".", 1)[-1], stat)


def wants_log_scale(values: np.ndarray) -> bool:
    """Positive finite values spanning more than ``LOG_SPAN`` (and none <= 0)."""
    finite = values[np.isfinite(values)]
    if finite.size == 0 or (finite <= 0).any():
        return False
    return float(finite.max() / finite.min()) > LOG_SPAN


def plot_heatmap(run: RunTelemetry, stat: str) -> Figure:
    """Layer x step heatmap of ``stat`` for one run."""
    data = run.values[stat]
    finite = data[np.isfinite(data)]
    masked = np.ma.masked_invalid(data)
    if wants_log_scale(data):
        norm: Normalize = LogNorm(vmin=float(finite.min()), vmax=float(finite.max()))
    else:
        low = float(finite.min()) if finite.size else 0.0
        high = float(finite.max()) if finite.size else 1.0
        norm = Normalize(vmin=low, vmax=high if high > low else low + 1.0)
    height = 1.8 + 0.28 * len(run.layers)
    fig, ax = plt.subplots(figsize=(9.0, height))
    image = ax.pcolormesh(
        np.arange(len(run.steps) + 1),
        np.arange(len(run.layers) + 1),
        masked,
        norm=norm,
        cmap="viridis",
        shading="flat",
    )
    _step_ticks(ax, run.steps)
    ax.set_yticks(np.arange(len(run.layers)) + 0.5, run.layers, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("layer (parameter)")
    scale = "log colour scale" if isinstance(norm, LogNorm) else "linear colour scale"
    if finite.size and float(finite.min()) == float(finite.max()):
        scale = f"every value {float(finite.min()):.3g}"
    ax.set_title(f"{run.name}: {stat} ({scale})", fontsize=9)
    bar = fig.colorbar(image, ax=ax)
    bar.set_label(unit_label(stat), fontsize=8)
    fig.tight_layout()
    return fig


def _step_ticks(ax: plt.Axes, steps: Sequence[int]) -> None:
    """At most ~12 labelled columns, centred on their cells."""
    every = max(1, math.ceil(len(steps) / 12))
    positions = np.arange(0, len(steps), every)
    ax.set_xticks(positions + 0.5, [str(steps[i]) for i in positions], fontsize=7)


def plot_comparison(runs: Sequence[RunTelemetry], stat: str) -> Figure:
    """Median over layers of ``stat`` against the step, one line per run that recorded it."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    drawn = []
    for run in runs:
        if stat not in run.values:
            continue
        with np.errstate(all="ignore"):
            data = np.where(np.isfinite(run.values[stat]), run.values[stat], np.nan)
            columns = [c for c in range(data.shape[1]) if np.isfinite(data[:, c]).any()]
            median = np.array([np.nanmedian(data[:, c]) for c in columns])
        steps = np.array([run.steps[c] for c in columns])
        ax.plot(steps, median, marker="o", markersize=3, label=run.name)
        drawn.append(median)
    if drawn and wants_log_scale(np.concatenate(drawn)):
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(unit_label(stat), fontsize=9)
    scale = "log axis" if ax.get_yscale() == "log" else "linear axis"
    ax.set_title(f"{stat}: median over the block matrices ({scale})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write_telemetry_plots(targets: Sequence[str | Path], out_dir: str | Path) -> list[Path]:
    """Every heatmap and comparison of the runs ``targets`` name, as PNGs in ``out_dir``;
    returns their paths."""
    paths = [path for target in targets for path in run_log_paths(target)]
    runs = [read_telemetry(path) for path in paths]
    out = Path(out_dir)
    written = []
    for run in runs:
        for stat in run.values:
            written.append(_save(plot_heatmap(run, stat), out / f"telemetry.{run.name}.{stat}.png"))
    stats = sorted({stat for run in runs for stat in run.values})
    for stat in stats:
        written.append(_save(plot_comparison(runs, stat), out / f"telemetry.compare.{stat}.png"))
    return written


def _save(fig: Figure, path: Path) -> Path:
    try:
        with atomic_output(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)
    return path
