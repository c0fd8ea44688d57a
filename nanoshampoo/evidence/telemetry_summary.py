"""A small per-setup summary of the runs' telemetry at their end, for ``compare`` and ``study``.

For each setup, over its runs' last telemetry step (``train/telemetry.py``'s records): the
median over runs and layers of the update/weight ratio ``update_ratio``, of every factor's
condition number (Shampoo family) and of the Newton-Schulz orthogonality error (spectral
descent). A setup whose runs recorded no telemetry gets no row; no row at all, no section.

Example:
    >>> telemetry_section({"adamw": ["runs/a.jsonl"]})  # doctest: +SKIP
    ['## Optimizer health at the end (telemetry)', '', '| setup | ...
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from nanoshampoo.evidence.tables import format_markdown_table

# Column -> how a record's key is recognised (its last dotted part).
COLUMNS = {
    "median u/w": "update_ratio",
    "median factor condition number": "condition_number",
    "median NS orthogonality error": "ns_orthogonality_error",
}


def last_step_values(path: str | Path) -> dict[str, list[float]]:
    """Per column statistic, the finite values of a run's last telemetry step (all layers and
    factors) in its JSONL (``path`` may name the ``.txt``); empty lists when the run has no
    telemetry or its log cannot be read."""
    records: list[dict[str, object]] = []
    try:
        lines = Path(path).with_suffix(".jsonl").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("kind") == "telemetry":
            records.append(record)
    out: dict[str, list[float]] = {stat: [] for stat in COLUMNS.values()}
    if not records:
        return out
    last = max(int(r["step"]) for r in records)  # type: ignore[call-overload]
    # A resumed run may record a step twice: the last record of each layer wins.
    final = {r.get("layer"): r for r in records if r["step"] == last}
    for record in final.values():
        for key, value in record.items():
            stat = key.rsplit(".", 1)[-1]
            if stat in out and isinstance(value, (int, float)) and math.isfinite(value):
                out[stat].append(float(value))
    return out


def setup_summary(paths: Sequence[str | Path]) -> dict[str, float | None] | None:
    """Column -> median over the runs' values (None: none recorded); None without telemetry."""
    pooled: dict[str, list[float]] = {stat: [] for stat in COLUMNS.values()}
    for path in paths:
        for stat, values in last_step_values(path).items():
            pooled[stat].extend(values)
    if not any(pooled.values()):
        return None
    return {
        column: statistics.median(pooled[stat]) if pooled[stat] else None
        for column, stat in COLUMNS.items()
    }


def telemetry_section(runs_by_setup: Mapping[str, Sequence[str | Path]]) -> list[str]:
    """Markdown lines of the section (a title, a table, a note), or ``[]`` when no setup's
    runs recorded telemetry."""
    rows = []
    for setup, paths in runs_by_setup.items():
        summary = setup_summary(paths)
        if summary is not None:
            rows.append([setup, *(_number(summary[column]) for column in COLUMNS)])
    if not rows:
        return []
    return [
        "## Optimizer health at the end (telemetry)",
        "",
        *format_markdown_table([["setup", *COLUMNS], *rows]),
        "",
        "Medians over the runs' block matrices at each run's last telemetry record "
        "(`nanoshampoo telemetry RUN` draws them): u/w is the update's RMS over the weights' "
        "RMS; the condition number is that of F + eps I for every Kronecker factor; the "
        "orthogonality error is ||U^T U - I||_F / sqrt(n) of the Newton-Schulz output. "
        "— where a setup has no such statistic.",
        "",
    ]


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}"
