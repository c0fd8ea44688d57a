"""What ``nanoshampoo tune`` searches: the ``--search`` spelling and the space it spans.

A search names a train field as a preset does: a run field (``cooldown_frac``, the flag
``--cooldown-frac``), a table field (``muon.lr``, ``--muon.lr``; ``muon_cwd.weight_decay``), or
one entry of a table of keyword arguments (``custom.matrix_kwargs.lr``: the trial passes
``--custom.matrix-kwargs`` with the setup's dict and that entry replaced, so the other entries
stay). A key spelled with the flags' dashes, or an old name (``muon_lr``), fails with one line
naming its spelling. ``KEY=V1,V2,...`` is a grid of flag texts; ``KEY=log:LO:HI`` a log-uniform
range of real numbers.

Fields that set a trial's budget (``num_iterations``, ``batch_size``, ``seq_len``,
``grad_accum_steps``) cannot be searched: every trial shares them. Nor can the fields tune sets
for each run (``seed``, ``run_id``, ...). Either is refused for that reason however it is
spelled (``num-iterations`` too).

Example:
    >>> search = parse_search("muon.lr=0.01,0.02,0.04")
    >>> search.key, search.values, search.choices
    ('muon.lr', ('0.01', '0.02', '0.04'), (0.01, 0.02, 0.04))
    >>> parse_search("custom.matrix_kwargs.lr=log:1e-4:1e-2").flag
    '--custom.matrix-kwargs'
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nanoshampoo.evidence.compare import ConfigResolver

# How successive halving decides at the rungs (``tune --halving``, a study's ``halving``):
# synchronously (``nanoshampoo.evidence.tune_halving``), by Optuna's asynchronous pruner, or
# not at all ("off": every trial trains to the end, its branches at the rungs recorded).
HALVINGS = ("sync", "async", "off")

# Train fields that set a trial's budget: equal for every trial, so never searched.
BUDGET_FIELDS = ("num_iterations", "batch_size", "seq_len", "grad_accum_steps")
# Train fields tune sets for each run (or that pick the setup itself).
MANAGED_FIELDS = ("seed", "run_id", "out_dir", "resume", "optimizer", "preset", "decay_branches")
# More trials than this is a typo, not a plan: every trial is a training run.
MAX_TRIALS = 10_000


def normalize_key(key: str) -> str:
    """A flag's key: ``muon-cwd.weight-decay`` -> ``muon_cwd.weight_decay``; a kwargs entry
    keeps its name."""
    parts = key.split(".")
    return ".".join([part.replace("-", "_") for part in parts[:2]] + parts[2:])


@dataclass(frozen=True)
class Search:
    """One searched key: a grid of ``values`` (flag text), or a log range ``low``..``high``.

    ``key`` is normalized (underscores); ``field`` is the train field the flag sets and
    ``entry`` the kwargs entry within it (``""`` when the key is the field itself).
    """

    key: str
    values: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None

    @property
    def is_range(self) -> bool:
        return self.low is not None

    @property
    def field(self) -> str:
        return ".".join(self.key.split(".")[:2])

    @property
    def entry(self) -> str:
        return ".".join(self.key.split(".")[2:])

    @property
    def flag(self) -> str:
        return key_flag(self.field)

    @property
    def choices(self) -> tuple[Any, ...]:
        """The grid as the study stores it: numbers when every value is one (so the dashboard
        plots them on an axis), else the flag texts."""
        numbers = [_finite_float(v) for v in self.values]
        if all(n is not None for n in numbers):
            return tuple(numbers)
        return self.values

    def text(self, value: Any) -> str:
        """The flag text of a value this search gave: the grid's own text, or the sampled
        number in full precision (the value that trained is the value recorded)."""
        if self.is_range:
            return repr(float(value))
        return self.values[self.choices.index(value)]


def key_flag(field: str) -> str:
    """The train flag of a field: ``muon_cwd.ns_steps`` -> ``--muon_cwd.ns-steps`` (a table's
    name keeps its underscores, as ``--help`` spells it; a field's become hyphens)."""
    table, dot, name = field.rpartition(".")
    return f"--{table}{dot}{name.replace('_', '-')}"


def _finite_float(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_search(text: str) -> Search:
    """``KEY=V1,V2,...`` or ``KEY=log:LO:HI`` (``ValueError`` saying what is wrong)."""
    key, sep, spec = text.partition("=")
    key, spec = key.strip(), spec.strip()
    if not sep or not key or not spec:
        raise ValueError(f"search: expected KEY=V1,V2,... or KEY=log:LO:HI, got {text!r}")
    if key.startswith("-"):
        raise ValueError(f"search: {key!r} is a field name (muon.lr), not a flag")
    if any(not part for part in key.split(".")):
        raise ValueError(f"search: {key!r} has an empty name between its dots")
    # A budget or managed field is refused for what it is, however it is spelled.
    field = ".".join(normalize_key(key).split(".")[:2])
    named = field if key == field else f"{key} ({field})"
    if field in BUDGET_FIELDS:
        raise ValueError(
            f"search: {named} sets the budget, which every trial shares: it cannot be searched"
        )
    if field in MANAGED_FIELDS:
        raise ValueError(f"search: {named} is set by tune for each run, not a hyper-parameter")
    if normalize_key(key) != key:
        raise ValueError(
            f"search: write {normalize_key(key)}, not {key} (a key is spelled as in a preset)"
        )
    if spec.startswith("log:"):
        parts = spec.split(":")
        try:
            low, high = float(parts[1]), float(parts[2])
        except (IndexError, ValueError):
            raise ValueError(f"search: {key}: expected log:LO:HI, got {spec!r}") from None
        if len(parts) != 3 or not (0 < low < high and math.isfinite(high)):
            raise ValueError(f"search: {key}: a log range needs 0 < LO < HI, got {spec!r}")
        return Search(key, low=low, high=high)
    values = tuple(v.strip() for v in spec.split(","))
    search = Search(key, values=values)
    if any(not v for v in values) or len(set(search.choices)) != len(values):
        raise ValueError(f"search: {key}: empty or repeated values in {spec!r}")
    return search


def check_searches(searches: Sequence[Search], trials: int | None) -> int:
    """The number of trials the searches plan: the grid's size (every key a grid) or
    ``trials`` (a range needs it); ``ValueError`` before any grid is built."""
    keys = [s.key for s in searches]
    if not searches:
        raise ValueError("search: give at least one --search KEY=...")
    if len(set(keys)) != len(keys):
        raise ValueError(f"search: a key is searched twice in {keys}")
    if not any(s.is_range for s in searches):
        if trials is not None:
            raise ValueError(
                "trials: sampled trials need a log:LO:HI range; a grid runs every point"
            )
        size = math.prod(len(s.values) for s in searches)
        if size > MAX_TRIALS:
            shape = " x ".join(str(len(s.values)) for s in searches)
            raise ValueError(
                f"search: a grid of {shape} = {size} trials is more than "
                f"{MAX_TRIALS}; narrow it, or give a log:LO:HI range and --trials"
            )
        return size
    if trials is None or trials < 1:
        raise ValueError("trials: a log:LO:HI range needs --trials N (N >= 1)")
    if trials > MAX_TRIALS:
        raise ValueError(f"trials: {trials} trials is more than {MAX_TRIALS} training runs")
    return trials


@dataclass(frozen=True)
class SearchSpace:
    """The searches of one setup, checked against what the setup reads.

    ``bases`` holds, per kwargs field that entries are searched in, the setup's own dict (the
    entries a trial does not search keep these values).
    """

    searches: tuple[Search, ...]
    bases: Mapping[str, dict[str, Any]]

    @property
    def is_grid(self) -> bool:
        return not any(s.is_range for s in self.searches)

    def grid(self) -> dict[str, list[Any]]:
        """The grid as ``optuna.samplers.GridSampler`` takes it (every key a grid)."""
        return {s.key: list(s.choices) for s in self.searches}

    def suggest(self, trial: Any) -> dict[str, str]:
        """Ask an ``optuna.Trial`` for a point; return its flag text per key."""
        point = {}
        for s in self.searches:
            if s.is_range:
                assert s.low is not None and s.high is not None
                value = trial.suggest_float(s.key, s.low, s.high, log=True)
            else:
                value = trial.suggest_categorical(s.key, s.choices)
            point[s.key] = s.text(value)
        return point

    def train_args(self, point: Mapping[str, str]) -> tuple[str, ...]:
        """The train flags of a point: one flag per field, a kwargs field as its whole dict."""
        args: list[str] = []
        merged: dict[str, dict[str, Any]] = {}
        for s in self.searches:
            if s.entry:
                table = merged.setdefault(s.field, dict(self.bases[s.field]))
                table[s.entry] = _entry_value(point[s.key])
            else:
                args += [s.flag, point[s.key]]
        for field, table in merged.items():
            args += [key_flag(field), json.dumps(table)]
        return tuple(args)


def _entry_value(text: str) -> Any:
    """A kwargs entry's value from its flag text: a JSON value (``0.1``, ``true``,
    ``[0.9, 0.95]``), else the text as a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def build_space(
    searches: Sequence[Search], resolve: ConfigResolver, base_argv: Sequence[str], setup: str
) -> SearchSpace:
    """Check every search against setup ``setup`` (trainer flags ``base_argv``) before any
    trial: the key is a field the setup reads (a kwargs field only by its entries), a range
    is over real numbers, and every grid value is one the trainer accepts. ``ValueError``
    naming the key."""
    from nanoshampoo.train.config import (  # imports torch: only when a tune is planned
        renamed_message,
        run_keys,
        table_field_types,
    )

    base = resolve(base_argv)
    tables = table_field_types()
    run_types = {key: k.type for key, k in run_keys().items()}
    bases: dict[str, dict[str, Any]] = {}
    for s in searches:
        if renamed_message(s.field):
            raise ValueError(f"search: {renamed_message(s.field)}")
        table, _, name = s.field.partition(".")
        if not name and table in tables:
            raise ValueError(
                f"search: {table} is a table; search one of its fields ({table}.FIELD=...)"
            )
        kind = tables.get(table, {}).get(name) if name else run_types.get(table)
        # A table's annotations are strings (postponed evaluation), the run fields' types.
        kind_name = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
        is_kwargs = kind_name.startswith("dict")
        if is_kwargs and not s.entry:
            raise ValueError(
                f"search: {s.field} is a table of keyword arguments (JSON); search "
                f"one entry of it at a time: {s.field}.lr=V1,V2 or "
                f"{s.field}.lr=log:LO:HI"
            )
        if s.entry and kind is not None and not is_kwargs:
            raise ValueError(f"search: {s.key}: {s.field} is not a table of keyword arguments")
        probe = [s.text(s.low)] if s.is_range else list(s.values)
        if s.entry:
            bases[s.field] = dict(base.get(s.field) or {})
            current = bases[s.field].get(s.entry)
            if s.is_range and current is not None and not isinstance(current, float):
                raise ValueError(
                    f"search: {s.key}: a log range samples real numbers, but the "
                    f"setup's {s.key} is {current!r}; give it a grid"
                )
        elif s.is_range and kind is not None and kind_name != "float":
            raise ValueError(
                f"search: {s.key}: a log range samples real numbers, but {s.key} "
                f"is {kind_name}; give it a grid ({s.key}=V1,V2,...)"
            )
        for text in probe:  # every grid value through the trainer's own parser
            flags = SearchSpace((s,), bases).train_args({s.key: text})
            resolve((*base_argv, *flags))
        if s.field not in base:
            read = sorted({k.split(".")[0] for k in base if "." in k})
            raise ValueError(
                f"search: {s.field} is not a field that setup {setup!r} reads "
                f"(its tables: {', '.join(read) or 'none'})"
            )
    return SearchSpace(tuple(searches), bases)
