"""Named run presets: TOML files of ``TrainConfig`` overrides in ``nanoshampoo/train/presets/``.

A preset names only what differs from the ``TrainConfig`` defaults (the tiny CPU run): run
fields at the top, a setup's hyper-parameters in its table (``[muon]`` / ``lr = 0.02``). A
name from before (``muon_lr = 0.02``) fails with one line naming its table field.
``preset`` is set to the preset's name. ``extends = "other"`` starts from another preset.

Names and paths: text that ends in ``.toml`` or contains a path separator is a path (relative
to the working directory for ``--preset``, to the extending file's directory for ``extends``),
and must end in ``.toml``; any other text is the name of a shipped preset, and nothing else.
Every value's type is checked against its field here, before a run starts (``ValueError``
naming the file and the key).

Example:
    >>> sorted(preset_names())[:2]
    ['gpt2-124m-adamw', 'gpt2-124m-muon']
    >>> load_preset("tiny-adamw")["optimizer"], load_preset("tiny-adamw")["adamw"]
    ('adamw', {'lr': 0.003})
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from nanoshampoo.train.config import (
    check_run_value,
    renamed_message,
    run_keys,
    table_field_types,
)
from nanoshampoo.train.setups.checks import check_value_type

PRESET_DIR = Path(__file__).parent / "presets"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def is_preset_path(text: str) -> bool:
    """A path (see the module docstring) rather than a shipped preset's name."""
    separators = {os.sep, os.altsep, "/", "\\"} - {None}
    return text.endswith(".toml") or any(sep in text for sep in separators)


def load_preset(name_or_path: str) -> dict[str, Any]:
    """The overrides of a preset (after its ``extends`` chain): run fields, and one dict per
    table (``{"muon": {"lr": 0.02}}``), every value type-checked."""
    return _load(resolve_preset(name_or_path, Path.cwd()), seen=())


def resolve_preset(name_or_path: str, base: Path) -> Path:
    """The file a preset name or path means (``ValueError`` saying why there is none)."""
    if is_preset_path(name_or_path):
        path = Path(name_or_path)
        if path.suffix != ".toml":
            raise ValueError(f"preset path {name_or_path!r} must end in .toml")
        path = path if path.is_absolute() else base / path
        if not path.exists():
            raise ValueError(f"preset file {path} does not exist")
        if not path.is_file():  # a directory, a FIFO (reading it would block), a device
            raise ValueError(f"preset file {path} is not a regular file")
        return path
    if name_or_path not in preset_names():
        raise ValueError(
            f"unknown preset {name_or_path!r}; choose one of {preset_names()} "
            "or give a path to a .toml file"
        )
    return PRESET_DIR / f"{name_or_path}.toml"


def _load(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    if path.resolve() in seen:
        raise ValueError(f"{path}: 'extends' loops back to itself")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: cannot read preset: {exc}") from None
    try:
        extends = raw.pop("extends", None)
        if extends is not None and not isinstance(extends, str):
            raise ValueError(f"'extends' must be a preset name or path, got {extends!r}")
        overrides = normalize(raw)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    fields: dict[str, Any] = {}
    if extends is not None:
        try:
            parent = resolve_preset(extends, path.parent)
        except ValueError as exc:
            raise ValueError(f"{path}: extends: {exc}") from None
        fields = _load(parent, seen=(*seen, path.resolve()))
    for key, value in overrides.items():
        if isinstance(value, dict) and key in table_field_types():
            fields[key] = {**fields.get(key, {}), **value}
        else:
            fields[key] = value
    for key in ("profile_steps", "decay_branches"):
        if key in fields:
            fields[key] = tuple(fields[key])
    fields["preset"] = overrides.get("preset", path.stem)
    return fields


def normalize(raw: dict[str, Any]) -> dict[str, Any]:
    """A preset file's keys -> run fields and ``{table: {field: value}}``. ``ValueError``
    naming an unknown key (and the new spelling of an old name) or a value of the wrong
    type."""
    run_names = run_keys()
    tables = table_field_types()
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in run_names:
            check_run_value(key, key, value)
            out[key] = value
        elif key in tables and isinstance(value, dict):
            for name, item in value.items():
                if name not in tables[key]:
                    raise ValueError(
                        f"unknown field [{key}] {name} (table {key!r} has {sorted(tables[key])})"
                    )
                check_value_type(f"[{key}] {name}", item, tables[key][name])
            out.setdefault(key, {}).update(value)
        elif renamed_message(key, "preset"):
            raise ValueError(renamed_message(key, "preset"))
        else:
            raise ValueError(f"unknown TrainConfig fields [{key!r}]")
    return out
