"""What a study asks: setups x model sizes x budgets x seeds, each setup's search, the baseline.

A study definition is a TOML file (the packaged ones are ``nanoshampoo/evidence/studies/
NAME.toml``: ``cpu``, the embedded default, and ``gpt2``, the GPU sizes)::

    baseline = "adamw"
    sizes = ["gpt-0.2m", "tiny"]          # --model values, smallest first
    budgets = [0.125, 0.25, 0.5, 1.0]     # fractions of --num-iterations: 1/eta^m .. 1/eta, 1
    seeds = 3
    train_args = ["--num-iterations", "200", "--threads", "1"]
    halving = "sync"                      # successive halving's mode (tune --halving)

    [setups.adamw]
    preset = "tiny-adamw"
    search = ["adamw.lr=0.002,0.004", "adamw.weight_decay=0,0.2"]
    trials = 8                            # only with a range search (a grid runs every point)

Every budget but the last is a decay branch of every run, so one run gives the whole curve, and
a rung of the tuning's successive halving (hence the geometric budgets: each rung keeps the best
``1/eta`` of the trials that reached it).

Example:
    >>> definition = load_definition("cpu")
    >>> definition.baseline, definition.sizes, definition.budgets
    ('adamw', ('gpt-0.2m', 'tiny'), (0.125, 0.25, 0.5, 1.0))
    >>> definition.branches
    (0.125, 0.25, 0.5)
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanoshampoo.errors import UserError
from nanoshampoo.evidence.tune_space import HALVINGS

STUDY_DIR = Path(__file__).parent / "studies"
_TOP_KEYS = {"baseline", "sizes", "budgets", "seeds", "train_args", "setups", "halving"}
_SETUP_KEYS = {"preset", "search", "trials"}


@dataclass(frozen=True)
class StudySetup:
    """One optimizer setup: a trainer preset (its model size is overridden per size), the
    ``tune`` searches (``KEY=V1,V2`` grids or ``KEY=log:LO:HI`` ranges) and, for ranges, the
    number of trials."""

    name: str
    preset: str
    search: tuple[str, ...]
    trials: int | None = None


@dataclass(frozen=True)
class StudyDefinition:
    """A validated study. ``budgets`` ascending in (0, 1], the last 1.0 (the full run)."""

    setups: tuple[StudySetup, ...]
    sizes: tuple[str, ...]
    budgets: tuple[float, ...]
    seeds: int
    baseline: str
    train_args: tuple[str, ...] = ()
    source: str = ""
    halving: str = "sync"

    def __post_init__(self) -> None:
        where = self.source or "study"
        if self.halving not in HALVINGS:
            raise ValueError(
                f"{where}: halving: {self.halving!r} is not one of {', '.join(HALVINGS)}"
            )
        names = [s.name for s in self.setups]
        if not names:
            raise ValueError(f"{where}: setups: give at least one setup")
        if len(set(names)) != len(names):
            raise ValueError(f"{where}: setups: {names} repeats a name")
        if self.baseline not in names:
            raise ValueError(
                f"{where}: baseline: {self.baseline!r} is not one of the setups {names}"
            )
        if not self.sizes or len(set(self.sizes)) != len(self.sizes):
            raise ValueError(f"{where}: sizes: give distinct model sizes, got {list(self.sizes)}")
        budgets = list(self.budgets)
        if len(budgets) < 4:
            # The baseline's L(D) = a D^-alpha + c has three parameters: four points at least.
            raise ValueError(
                f"{where}: budgets: give at least 4 (the fit has 3 parameters), got {budgets}"
            )
        if budgets != sorted(set(budgets)) or budgets[-1] != 1.0 or budgets[0] <= 0:
            raise ValueError(
                f"{where}: budgets: strictly increasing fractions in (0, 1] "
                f"ending at 1.0, got {budgets}"
            )
        if self.seeds < 2:
            raise ValueError(
                f"{where}: seeds: at least 2 (intervals need a spread), got {self.seeds}"
            )
        for setup in self.setups:
            if not setup.search:
                raise ValueError(
                    f"{where}: setups.{setup.name}.search: give at least one "
                    f"searched key (an equal budget of trials for every setup)"
                )
            if setup.trials is not None and setup.trials < 1:
                raise ValueError(
                    f"{where}: setups.{setup.name}.trials: must be >= 1, got {setup.trials}"
                )

    @property
    def branches(self) -> tuple[float, ...]:
        """The decay branches every run trains: each budget but the full run."""
        return self.budgets[:-1]

    def setup(self, name: str) -> StudySetup:
        return next(s for s in self.setups if s.name == name)

    def replace(self, **changes: Any) -> StudyDefinition:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)


def packaged_studies() -> list[str]:
    """Names of the packaged study definitions."""
    return sorted(p.stem for p in STUDY_DIR.glob("*.toml"))


def load_definition(name_or_path: str) -> StudyDefinition:
    """A packaged study by name, or a ``.toml`` path. ``UserError`` in one line naming the file
    and the key for anything malformed."""
    if name_or_path.endswith(".toml") or "/" in name_or_path:
        path = Path(name_or_path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise UserError(f"--study {path}: cannot read it ({exc.strerror})") from None
        source = str(path)
    else:
        if name_or_path not in packaged_studies():
            raise UserError(
                f"--study {name_or_path!r}: no such study; packaged: "
                f"{packaged_studies()} (or give a .toml path)"
            )
        source = f"study {name_or_path!r}"
        text = (STUDY_DIR / f"{name_or_path}.toml").read_text(encoding="utf-8")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{source}: not valid TOML ({exc})") from None
    try:
        return _definition(raw, source)
    except (TypeError, ValueError) as exc:
        raise UserError(str(exc)) from None


def _definition(raw: dict[str, Any], source: str) -> StudyDefinition:
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise ValueError(f"{source}: unknown keys {unknown}; a study has {sorted(_TOP_KEYS)}")
    setups_raw = _typed(raw, "setups", dict, source)
    setups = []
    for name, body in setups_raw.items():
        where = f"{source}: setups.{name}"
        if not isinstance(body, dict):
            raise ValueError(f"{where}: must be a table with preset and search")
        extra = sorted(set(body) - _SETUP_KEYS)
        if extra:
            raise ValueError(f"{where}: unknown keys {extra}; a setup has {sorted(_SETUP_KEYS)}")
        search = _typed(body, "search", list, where)
        if not all(isinstance(s, str) for s in search):
            raise ValueError(
                f"{where}.search: must be a list of strings like 'adamw.lr=0.002,0.004'"
            )
        trials = body.get("trials")
        if trials is not None and (not isinstance(trials, int) or isinstance(trials, bool)):
            raise ValueError(f"{where}.trials: must be an integer, got {trials!r}")
        setups.append(StudySetup(name, _typed(body, "preset", str, where), tuple(search), trials))
    sizes = _typed(raw, "sizes", list, source)
    budgets = _typed(raw, "budgets", list, source)
    if not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in budgets):
        raise ValueError(f"{source}: budgets: must be numbers, got {budgets}")
    train_args = raw.get("train_args", [])
    if not isinstance(train_args, list) or not all(isinstance(a, str) for a in train_args):
        raise ValueError(f"{source}: train_args: must be a list of strings")
    seeds = _typed(raw, "seeds", int, source)
    return StudyDefinition(
        tuple(setups),
        tuple(str(s) for s in sizes),
        tuple(float(b) for b in budgets),
        seeds,
        _typed(raw, "baseline", str, source),
        tuple(train_args),
        source,
        _typed(raw, "halving", str, source) if "halving" in raw else "sync",
    )


def _typed(raw: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in raw:
        raise ValueError(f"{where}: {key}: missing")
    value = raw[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{where}: {key}: must be a {kind.__name__}, got {value!r}")
    return value
