"""Command line: ``python -m nanoshampoo.train --preset NAME [--<field> VALUE ...]``.

Every ``TrainConfig`` field is a flag (underscores become dashes): ``--seed 3``,
``--num-iterations 500``, ``--autocast-bf16 false``, ``--profile-steps 5,6,7``. Flags override
the preset, which overrides the defaults. Runs as one process or under ``torchrun``.

Example:
    >>> main(["--preset", "tiny-adamw", "--num-iterations", "50", "--out-dir", "/tmp/runs"])
    ...                                                                    # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Sequence
from typing import Any

from nanoshampoo.train.allocator import exec_with_tuned_malloc
from nanoshampoo.train.config import TrainConfig
from nanoshampoo.train.presets import load_preset, preset_names

DEFAULT_PRESET = "tiny-shampoo"


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def parse_int_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from exc


def _parser_for(annotation: Any) -> Callable[[str], Any]:
    if annotation is bool:
        return parse_bool
    if typing.get_origin(annotation) is tuple:
        return parse_int_tuple
    return annotation  # int, float, str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nanoshampoo.train",
        description="Train a speedrun GPT. Presets: " + ", ".join(preset_names()),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    hints = typing.get_type_hints(TrainConfig)
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        if field.name == "preset":
            parser.add_argument(flag, default=DEFAULT_PRESET,
                                help="preset name or path to a .toml of TrainConfig fields")
            continue
        parser.add_argument(flag, dest=field.name, type=_parser_for(hints[field.name]),
                            default=argparse.SUPPRESS, help=f"(default {field.default!r})")
    return parser


def config_from_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """Defaults <- preset <- flags, validated."""
    args = vars(build_parser().parse_args(argv))
    fields = load_preset(args.pop("preset"))
    fields.update(args)
    return TrainConfig(**fields)


def main(argv: Sequence[str] | None = None) -> int:
    from nanoshampoo.train.loop.trainer import Trainer

    try:
        cfg = config_from_args(argv)
    except ValueError as exc:  # a bad value or preset: a usage error, not a crash
        build_parser().error(str(exc))
    Trainer(cfg).run()
    return 0


def run_entry_point(argv: Sequence[str]) -> int:
    """``python -m nanoshampoo.train ARGV`` / ``nanoshampoo train ARGV``: :func:`main` in a
    process with tuned glibc malloc settings (re-executes once; see
    ``nanoshampoo.train.allocator``). Tests call :func:`main` directly instead."""
    exec_with_tuned_malloc("nanoshampoo.train", list(argv))
    return main(argv)
