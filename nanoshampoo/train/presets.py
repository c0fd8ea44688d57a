"""Named run presets: TOML files of ``TrainConfig`` overrides in ``nanoshampoo/train/presets/``.

A preset names only the fields that differ from the ``TrainConfig`` defaults (the tiny CPU
run); ``preset`` is set to the preset's name. ``extends = "other"`` starts from another preset's
fields. A path to a ``.toml`` file works wherever a name does.

Example:
    >>> sorted(preset_names())[:2]
    ['gpt2-124m-adamw', 'gpt2-124m-shampoo']
    >>> load_preset("tiny-adamw")["optimizer"]
    'adamw'
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from nanoshampoo.train.config import TrainConfig

PRESET_DIR = Path(__file__).parent / "presets"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def load_preset(name_or_path: str) -> dict[str, Any]:
    """The overrides of a preset (after its ``extends`` chain), checked against ``TrainConfig``."""
    return _load(name_or_path, seen=())


def _load(name_or_path: str, seen: tuple[str, ...]) -> dict[str, Any]:
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = PRESET_DIR / f"{name_or_path}.toml"
        if not path.is_file():
            raise ValueError(f"unknown preset {name_or_path!r}; choose one of {preset_names()} "
                             "or give a path to a .toml file")
    if str(path) in seen:
        raise ValueError(f"{path}: 'extends' loops back to itself")
    try:
        overrides = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: cannot read preset: {exc}") from exc
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(overrides) - known - {"extends"})
    if unknown:
        raise ValueError(f"{path}: unknown TrainConfig fields {unknown}")
    fields: dict[str, Any] = {}
    if "extends" in overrides:
        fields = _load(str(overrides.pop("extends")), seen=(*seen, str(path)))
    fields.update(overrides)
    if "profile_steps" in fields:
        fields["profile_steps"] = tuple(fields["profile_steps"])
    fields["preset"] = overrides.get("preset", path.stem)
    return fields
