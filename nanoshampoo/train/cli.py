"""Command line: ``python -m nanoshampoo.train [--preset NAME] [--<field> VALUE ...]``.

Every ``TrainConfig`` run-level key is a flag (underscores become dashes): ``--seed 3``,
``--num-iterations 500``, ``--autocast off``, ``--profile-steps 5,6,7``, ``--decay-branches
0.25,0.5,0.75``; every field of a setup's hyper-parameter table is ``--TABLE.FIELD``:
``--muon.lr 0.03``, ``--shampoo.epsilon 1e-12``, ``--custom.matrix-kwargs '{"lr": 1e-4}'``
(a JSON object). That is the one spelling: an old flag (``--muon-lr``, ``--autocast-bf16``,
``--shampoo.warm_qr_tolerance``) fails with one line naming the new one. Flags override the
preset, which overrides the defaults; ``--preset NAME --help`` shows the preset's values. Runs
as one process or under ``torchrun``.

Exit status: 0 done; 2 a user error (a bad flag value, a missing or damaged file), printed as
one line without a traceback; 3 the run diverged (NaN/Inf; the logs say where); 130 Ctrl-C (it
prints the last checkpoint and the ``--resume`` command that continues the run). Other failures
are bugs and keep their traceback.

Example:
    >>> main(["--preset", "tiny-adamw", "--num-iterations", "50", "--out-dir", "/tmp/runs"])
    ...                                                                    # doctest: +SKIP
    $ python -m nanoshampoo.train --preset tiny-muon --muon.lr 0.03 --seed 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from nanoshampoo.errors import EXIT_USER_ERROR, run_command, user_input
from nanoshampoo.train.allocator import exec_with_tuned_malloc
from nanoshampoo.train.config import (
    TrainConfig,
    flag_of,
    flatten_tables,
    renamed_message,
    run_keys,
)
from nanoshampoo.train.interrupt import EXIT_INTERRUPTED, TrainingInterrupted, interrupted_message
from nanoshampoo.train.presets import load_preset, preset_names
from nanoshampoo.train.setups import setup_names, table_classes

DEFAULT_PRESET = "tiny-shampoo"
PROG = "python -m nanoshampoo.train"
EXIT_DIVERGED = 3


class _OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage dump burying the message)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see --help)\n")


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


def parse_float_tuple(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc


def parse_json_table(text: str) -> dict[str, Any]:
    """A table of keyword arguments given as a JSON object: ``'{"lr": 1e-4}'``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _parser_for(annotation: Any) -> Callable[[str], Any]:
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    if annotation is bool or kind == "bool":
        return parse_bool
    if typing.get_origin(annotation) is tuple or kind.startswith("tuple"):
        return parse_float_tuple if "float" in str(annotation) else parse_int_tuple
    if kind.startswith("dict"):
        return parse_json_table
    return {"int": int, "float": float, "str": str}.get(kind, annotation)


def _metavar(annotation: Any) -> str:
    """``FLOAT``, ``INT``, ``BOOL``, ``STR``; ``JSON`` for a table of keyword arguments."""
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return "JSON" if kind.startswith("dict") else kind.upper()


def _shown(key: str, default: Any, preset: str, preset_values: dict[str, Any]) -> str:
    if key in preset_values:
        return f"(preset {preset}: {preset_values[key]!r}; default {default!r})"
    return f"(default {default!r})"


def build_parser(
    preset: str = DEFAULT_PRESET, preset_values: dict[str, Any] | None = None
) -> argparse.ArgumentParser:
    """The flag parser; each flag's help shows ``preset_values``' value where the preset has
    one. Run fields are ``--field-name``, table fields ``--table.field-name``."""
    flat = flatten_tables(preset_values or {})
    parser = _OneLineErrorParser(
        prog=PROG,
        usage="%(prog)s [--preset NAME] [--FIELD VALUE ...] [--TABLE.FIELD VALUE ...]",
        # One line per flag where it fits: the flag list is long.
        formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=52, width=110),
        description="Train a speedrun GPT. Presets: "
        + ", ".join(preset_names())
        + ". Setups (--optimizer): "
        + ", ".join(setup_names()),
    )
    for key in run_keys().values():
        flag = "--" + key.key.replace("_", "-")
        if key.key == "preset":
            parser.add_argument(
                flag,
                default=DEFAULT_PRESET,
                help="a shipped preset's name, or a path to a .toml file (text "
                "ending in .toml or holding a path separator) "
                f"(default {DEFAULT_PRESET!r})",
            )
            continue
        parser.add_argument(
            flag,
            dest=key.key,
            type=_parser_for(key.type),
            default=argparse.SUPPRESS,
            help=_shown(key.key, key.default, preset, flat),
        )
    for table, cls in table_classes().items():
        doc = (cls.__doc__ or "").strip().split("\n")[0]
        group = parser.add_argument_group(f"[{table}]", doc)
        for field in dataclasses.fields(cls):
            key = f"{table}.{field.name}"
            default = (
                field.default_factory() if field.default is dataclasses.MISSING else field.default
            )
            group.add_argument(
                flag_of(key),
                dest=key,
                type=_parser_for(field.type),
                default=argparse.SUPPRESS,
                metavar=_metavar(field.type),
                help=_shown(key, default, preset, flat),
            )
    return parser


def check_old_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """``ValueError`` with one line naming the new spelling of the first old flag in ``argv``:
    a name from ``config.RENAMED`` (``--muon-lr``), or a table field spelled with underscores
    (``--shampoo.warm_qr_tolerance``). Other unknown flags are left to the parser."""
    known = set(parser._option_string_actions)
    for arg in argv:
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        if not name.startswith("--") or name in known:
            continue
        key = name[2:].replace("-", "_")
        if "." in key and flag_of(key) in known:
            raise ValueError(f"{name} is now {flag_of(key)}")
        message = renamed_message(key, "flag")
        if message:
            raise ValueError(message)


def config_from_args(
    argv: Sequence[str] | None = None, *, refuse_unread_tables: bool = False
) -> TrainConfig:
    """Defaults <- preset <- flags, validated (``ValueError`` naming the field).

    ``refuse_unread_tables`` (what a run's command line wants): a ``--TABLE.FIELD`` flag of a
    table the setup does not read is an error (:func:`check_tables_read`), not ignored."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default=DEFAULT_PRESET)
    preset = pre.parse_known_args(argv)[0].preset
    try:
        preset_values = load_preset(preset)
    except ValueError:
        if any(a in ("-h", "--help") for a in argv):
            preset_values = {}  # still show the help; the parse below reports the preset
        else:
            raise
    parser = build_parser(preset, preset_values)
    check_old_flags(parser, argv)
    args = vars(parser.parse_args(argv))
    fields = load_preset(args.pop("preset"))
    # A flag's TABLE.FIELD wins over the preset's [TABLE] (see ``split_values``).
    cfg = TrainConfig(**{**fields, **args})
    if refuse_unread_tables:
        check_tables_read(cfg, [key for key in args if "." in key])
    return cfg


def check_tables_read(cfg: TrainConfig, table_keys: Sequence[str]) -> None:
    """``ValueError`` naming a ``--TABLE.FIELD`` flag of a table that the setup does not read:
    the flag would change nothing, yet a user who typed it expects it to. (A preset's other
    tables are fine: ``--optimizer`` may switch away from them.)"""
    read = set(cfg.setup.tables)
    unread = [flag_of(key) for key in table_keys if key.split(".", 1)[0] not in read]
    if unread:
        raise ValueError(
            f"{', '.join(unread)}: setup {cfg.optimizer!r} (--optimizer) does not "
            f"read {'this table' if len(unread) == 1 else 'these tables'}; it reads "
            f"{', '.join(f'[{t}]' for t in cfg.setup.tables) or 'no table'}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, train, and return the exit status (see the module docstring)."""
    return run_command(PROG, lambda: _train(argv))


def _train(argv: Sequence[str] | None) -> int:
    from nanoshampoo.train.trainer import Trainer, TrainingDiverged

    argv = list(sys.argv[1:] if argv is None else argv)
    with user_input():  # a bad value or preset: a usage error, not a crash
        cfg = config_from_args(argv, refuse_unread_tables=True)
    try:
        Trainer(cfg).run()
    except TrainingDiverged as exc:
        print(f"{PROG}: diverged at step {exc.step}: {exc.reason}", file=sys.stderr)
        return EXIT_DIVERGED
    except TrainingInterrupted as exc:
        print(f"{PROG}: {interrupted_message(exc, PROG, argv)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def run_entry_point(argv: Sequence[str]) -> int:
    """``python -m nanoshampoo.train ARGV`` / ``nanoshampoo train ARGV``: :func:`main` in a
    process with tuned glibc malloc settings (re-executes once; see
    ``nanoshampoo.train.allocator``). Tests call :func:`main` directly instead."""
    exec_with_tuned_malloc("nanoshampoo.train", list(argv))
    return main(argv)
