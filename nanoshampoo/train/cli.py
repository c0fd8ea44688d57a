"""Command line: ``python -m nanoshampoo.train [--preset NAME] [--<field> VALUE ...]``.

Every ``TrainConfig`` field is a flag (underscores become dashes): ``--seed 3``,
``--num-iterations 500``, ``--autocast off``, ``--profile-steps 5,6,7``. Flags override the
preset, which overrides the defaults; ``--preset NAME --help`` shows the preset's values.
``--autocast-bf16 true|false`` is kept as an alias of ``--autocast bf16|off``. Runs as one
process or under ``torchrun``.

Exit status: 0 done; 2 a user error (a bad flag value, a missing or damaged file), printed as
one line without a traceback; 3 the run diverged (NaN/Inf; the logs say where); 130 Ctrl-C (it
prints the last checkpoint and the ``--resume`` command that continues the run). Other failures
are bugs and keep their traceback.

Example:
    >>> main(["--preset", "tiny-adamw", "--num-iterations", "50", "--out-dir", "/tmp/runs"])
    ...                                                                    # doctest: +SKIP
    $ python -m nanoshampoo.train --preset tiny-muon --muon-lr 0.03 --seed 1
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from nanoshampoo.errors import EXIT_USER_ERROR, run_command, user_input
from nanoshampoo.train.allocator import exec_with_tuned_malloc
from nanoshampoo.train.config import TrainConfig
from nanoshampoo.train.interrupt import EXIT_INTERRUPTED, TrainingInterrupted, interrupted_message
from nanoshampoo.train.presets import load_preset, preset_names

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


def parse_autocast_bf16(text: str) -> str:
    """The ``--autocast-bf16 true|false`` alias: ``bf16`` or ``off``."""
    return "bf16" if parse_bool(text) else "off"


def _parser_for(annotation: Any) -> Callable[[str], Any]:
    if annotation is bool:
        return parse_bool
    if typing.get_origin(annotation) is tuple:
        return parse_int_tuple
    return annotation  # int, float, str


def build_parser(preset: str = DEFAULT_PRESET,
                 preset_values: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    """The flag parser; each flag's help shows ``preset_values``' value where the preset has one."""
    preset_values = preset_values or {}
    parser = _OneLineErrorParser(
        prog=PROG,
        description="Train a speedrun GPT. Presets: " + ", ".join(preset_names()),
    )
    hints = typing.get_type_hints(TrainConfig)
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        if field.name == "preset":
            parser.add_argument(flag, default=DEFAULT_PRESET,
                                help="preset name or path to a .toml of TrainConfig fields "
                                     f"(default {DEFAULT_PRESET!r})")
            continue
        default = field.default if field.default is not dataclasses.MISSING else None
        if field.name in preset_values:
            shown = f"(preset {preset}: {preset_values[field.name]!r}; default {default!r})"
        else:
            shown = f"(default {default!r})"
        parser.add_argument(flag, dest=field.name, type=_parser_for(hints[field.name]),
                            default=argparse.SUPPRESS, help=shown)
    parser.add_argument("--autocast-bf16", dest="autocast", type=parse_autocast_bf16,
                        default=argparse.SUPPRESS,
                        help="alias: true = --autocast bf16, false = --autocast off")
    return parser


def config_from_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """Defaults <- preset <- flags, validated (``ValueError`` naming the field)."""
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
    args = vars(build_parser(preset, preset_values).parse_args(argv))
    fields = load_preset(args.pop("preset"))
    fields.update(args)
    return TrainConfig(**fields)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, train, and return the exit status (see the module docstring)."""
    return run_command(PROG, lambda: _train(argv))


def _train(argv: Sequence[str] | None) -> int:
    from nanoshampoo.train.trainer import Trainer, TrainingDiverged

    argv = list(sys.argv[1:] if argv is None else argv)
    with user_input():  # a bad value or preset: a usage error, not a crash
        cfg = config_from_args(argv)
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
