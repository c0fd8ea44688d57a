"""What a tune found, read from its study: ``tuning.md``, ``tuning.json``, ``tuned-SETUP.toml``.

Every trial of the study is listed (a surplus trial, failed before it trained, is not): its
point, its state (complete, pruned, failed, running), its value (the mean final validation
loss over its seeds that did not diverge), each seed's final loss and each rung's branch loss.
Then the best complete trial, a warning for every key whose best value lies on the edge of
what was tried (a numeric grid's smallest or largest value, a range's smallest or largest
sample), and the
tunability: the share of the trials within ``TUNABILITY_TOLERANCE`` (1 %) of the best value
(a pruned or failed trial is not; ``setup_scores.tunability``), with their count. A flat
optimum (a high share) means the setup is easy to tune at this budget; a low share means few
points are near the best.

Example:
    >>> print(_toml_value({"lr": 0.01, "betas": [0.9, 0.95], "name": "x"}))
    {lr = 0.01, betas = [0.9, 0.95], name = "x"}
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanoshampoo.evidence.report import json_ready, write_json
from nanoshampoo.evidence.setup_scores import Tunability, tunability
from nanoshampoo.evidence.tables import format_markdown_table
from nanoshampoo.evidence.tune_space import Search
from nanoshampoo.io_utils import atomic_output

# A trial within this relative distance of the best value counts toward tunability.
TUNABILITY_TOLERANCE = 0.01
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclass(frozen=True)
class TrialResult:
    """One trial: ``name`` its directory (``t007``, shared by its retries), ``params`` the flag
    text per key, ``value`` the mean final loss (``None`` unless complete), ``finals`` per seed
    (NaN: diverged), ``rungs`` branch steps -> branch val loss as the pruner saw it, ``logs``
    the JSONL log of each seed's run."""

    number: int
    name: str
    state: str
    params: dict[str, str]
    value: float | None
    finals: tuple[float, ...] = ()
    rungs: dict[int, float] = field(default_factory=dict)
    note: str = ""
    logs: tuple[str, ...] = ()


@dataclass(frozen=True)
class TuneResult:
    """A tune's study read back: its trials, the best point and the files written."""

    setup: str
    preset: str
    study: str
    storage: str
    sampler: str
    train_args: tuple[str, ...]
    seeds: int
    budget: int
    rungs: tuple[float, ...]
    trials: tuple[TrialResult, ...]
    best: str
    best_number: int
    best_values: dict[str, str]
    best_value: float
    # The searched keys whose best value lies on the edge of the values tried (edge_keys).
    on_edge: tuple[str, ...]
    tunability: Tunability
    confirm_finals: tuple[float, ...] = ()
    # The JSONL log of each confirming seed's run ("" where it has none: it diverged or failed).
    confirm_logs: tuple[str, ...] = ()
    preset_file: str = ""
    typed_values: dict[str, Any] = field(default_factory=dict)

    @property
    def edge_warnings(self) -> tuple[str, ...]:
        """One warning per key of :attr:`on_edge`, naming its best value."""
        return tuple(
            f"{key} = {self.best_values[key]} is on the edge of the values tried: the optimum "
            "may lie beyond it; widen the search"
            for key in self.on_edge
        )


def best_trial(trials: Sequence[TrialResult]) -> TrialResult | None:
    """The complete trial of least value (the lowest number among equals)."""
    complete = [t for t in trials if t.value is not None]
    return min(complete, key=lambda t: (t.value, t.number)) if complete else None


def trial_tunability(trials: Sequence[TrialResult]) -> Tunability:
    """The share of the trial slots (a retried trial counts once, by its best value) whose
    final loss is within 1 % of the best; a pruned or failed trial counts as not within."""
    by_slot: dict[str, float] = {}
    for trial in trials:
        value = math.nan if trial.value is None else trial.value
        kept = by_slot.get(trial.name, math.nan)
        by_slot[trial.name] = value if math.isnan(kept) else min(kept, value)
    return tunability(list(by_slot.values()), TUNABILITY_TOLERANCE)


def edge_keys(
    searches: Sequence[Search], trials: Sequence[TrialResult], best: TrialResult
) -> list[str]:
    """The searched keys whose best value is the lowest or the highest number tried (a numeric
    grid's smallest or largest value, a range's smallest or largest sample), when more than one
    was tried. A grid of names (not numbers) has no edge."""
    keys = []
    for s in searches:
        value = best.params[s.key]
        if s.is_range:
            tried = sorted({float(t.params[s.key]) for t in trials if s.key in t.params})
            number = float(value)
        elif all(isinstance(c, float) for c in s.choices):
            tried = sorted(s.choices)
            number = s.choices[s.values.index(value)]
        else:
            continue
        if len(tried) > 1 and number in (tried[0], tried[-1]):
            keys.append(s.key)
    return keys


def tuned_preset_text(result: TuneResult) -> str:
    """A preset that extends the tuned setup's preset with the best values (TOML)."""
    base = result.preset
    if base.endswith(".toml") or "/" in base:
        base = str(Path(base).resolve())
    lines = [
        f"# {result.setup} tuned by nanoshampoo tune: best of {len(result.trials)} trials "
        f"at {result.seeds} seed(s) each, study {result.study} (tuning.md).",
        f"extends = {json.dumps(base)}",
    ]
    tables: dict[str, list[str]] = {}
    for key, value in result.typed_values.items():
        table, dot, name = key.rpartition(".")
        line = f"{name if dot else key} = {_toml_value(value)}"
        if dot:
            tables.setdefault(table, []).append(line)
        else:
            lines.append(line)
    for table, entries in tables.items():
        lines += ["", f"[{table}]", *entries]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    """A TOML value: inline tables for a kwargs table, arrays for lists."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        items = (
            f"{k if _BARE_KEY.match(k) else json.dumps(k)} = {_toml_value(v)}"
            for k, v in value.items()
        )
        return "{" + ", ".join(items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)


def write_tuning(result: TuneResult, out_dir: Path) -> TuneResult:
    """Write ``tuning.md``, ``tuning.json`` and ``tuned-SETUP.toml``; return the result with
    the preset file's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    preset = out_dir / f"tuned-{result.setup}.toml"
    with atomic_output(preset) as tmp:
        tmp.write_text(tuned_preset_text(result), encoding="utf-8")
    result = dataclasses.replace(result, preset_file=str(preset))
    with atomic_output(out_dir / "tuning.md") as tmp:
        tmp.write_text(format_tuning(result), encoding="utf-8")
    write_json(out_dir / "tuning.json", json_ready(result))
    return result


def _loss(value: float | None) -> str:
    return "—" if value is None else "diverged" if not math.isfinite(value) else f"{value:.4f}"


def format_tuning(result: TuneResult) -> str:
    keys = list(result.best_values)
    steps = sorted({s for t in result.trials for s in t.rungs})
    rows = [
        [
            "trial",
            "state",
            *keys,
            *(f"rung {s} steps" for s in steps),
            "final val loss per seed",
            "value",
            "note",
        ]
    ]
    order = sorted(
        result.trials, key=lambda t: (math.inf if t.value is None else t.value, t.number)
    )
    for t in order:
        rows.append(
            [
                t.name + (" (best)" if t.number == result.best_number else ""),
                t.state,
                *(t.params.get(k, "—") for k in keys),
                *(_loss(t.rungs[s]) if s in t.rungs else "—" for s in steps),
                ", ".join(_loss(f) for f in t.finals) or "—",
                _loss(t.value),
                t.note,
            ]
        )
    flags = " ".join(result.train_args) or "(none)"
    rungs = (
        f"rungs {', '.join(f'{f:g}' for f in result.rungs)} of the budget (decay branches, "
        "successive halving)"
        if result.rungs
        else "no rungs (every trial trains fully)"
    )
    tune = result.tunability
    lines = [
        f"# Tuning {result.setup} (preset {result.preset})",
        "",
        f"Study `{result.study}` in `{result.storage}`: {result.budget} trials "
        f"({result.sampler}), {result.seeds} seed(s) each, {rungs}; the same train flags "
        f"for every trial: `{flags}`. Best: **{result.best}** "
        f"({', '.join(f'{k} = {v}' for k, v in result.best_values.items())}), "
        f"{result.best_value:.4f}.",
        "",
        f"Tunability: {tune.within} of {tune.trials} trials ({100 * tune.share:.0f} %) are "
        f"within {100 * tune.tolerance:g} % of the best (a pruned or failed trial is not).",
        "",
        *format_markdown_table(rows),
        "",
    ]
    lines += [f"**Warning**: {w}" for w in result.edge_warnings]
    if result.confirm_finals:
        finished = [f for f in result.confirm_finals if not math.isnan(f)]
        mean = sum(finished) / len(finished) if finished else math.nan
        lines += [
            "",
            f"Confirmed over {len(result.confirm_finals)} seeds: "
            f"{', '.join(_loss(f) for f in result.confirm_finals)} (mean {mean:.4f}).",
        ]
    lines += ["", f"Tuned preset: `{result.preset_file}`."]
    return "\n".join(lines) + "\n"
