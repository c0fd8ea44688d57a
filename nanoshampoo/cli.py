"""The ``nanoshampoo`` command: train, prepare data, and produce evidence.

Subcommands:

* ``train ...`` -- the trainer (``nanoshampoo.train.cli.main``), arguments passed through;
* ``prepare ...`` -- data preparation (``nanoshampoo.data.prepare.main``), passed through;
* ``stats PATH... [--group NAME=GLOB] [--group-by KEY] [--baseline NAME] [--target 3.28]
  [--json OUT] [--plot DIR]`` -- statistics of repeated runs and A/B comparisons;
* ``repeat -n N [--out-dir DIR] [--seed0 S] [--nproc K] [--name NAME] -- TRAIN_ARGS`` -- train
  N seeds, then report them;
* ``compare [--setups adamw,shampoo,soap,muon] [--seeds 3] [--baseline NAME] [--target auto|X]
  [--nproc K] [--out-dir runs/compare] [--step-fractions 0.7,...] [--rule welch|track3]
  [--tune SETUP:KEY=SPEC ...] -- TRAIN_ARGS`` -- train every setup over the seeds (reusing
  ended runs; tuned first with ``--tune``), then write the leaderboard
  (``nanoshampoo.evidence.compare``, ``.leaderboard``);
* ``tune --setup NAME --search KEY=V1,V2 [--trials N] [--seeds 1] [--confirm-seeds 3]
  [--rungs 0.25,0.5] [--storage URL] -- TRAIN_ARGS`` -- tune one setup at an equal budget per
  trial, an Optuna study that any number of workers share (``nanoshampoo.evidence.tune``);
* ``study [--study cpu|gpt2|PATH.toml] [--setups ...] [--sizes ...] [--storage URL] --
  TRAIN_ARGS`` -- setups x model sizes x budgets x seeds, each tuned at an equal budget, then
  speedups as curves (``nanoshampoo.evidence.study``);
* ``trace PATH... [--json OUT]`` -- communication/computation overlap in profiler traces;
* ``telemetry RUN... [--out DIR]`` -- heatmaps (layer x step) and run comparisons of the
  runs' telemetry records (``nanoshampoo.evidence.telemetry_plots``).

A user error (a bad flag, a file that cannot be read, a run that failed) prints one line
``nanoshampoo COMMAND: error: ...`` and exits with status 2.

Example:
    $ nanoshampoo compare --setups adamw,shampoo --seeds 3 -- --num-iterations 100
    $ nanoshampoo repeat -n 5 --out-dir runs/adamw --name adamw -- --preset tiny-adamw
    $ nanoshampoo stats runs/compare/adamw runs/compare/shampoo --plot plots/ --json report.json
    $ nanoshampoo trace runs/profile
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import sys
import typing
from collections.abc import Sequence
from pathlib import Path

from nanoshampoo.errors import UserError, run_command, user_input
from nanoshampoo.evidence.compare import (
    DEFAULT_SETUPS,
    RULES,
    CompareConfig,
    parse_setups,
    resolve_train_config,
    run_compare,
)
from nanoshampoo.evidence.grouping import groups_by_directory, groups_from_specs, regroup
from nanoshampoo.evidence.leaderboard import (
    build_leaderboard,
    format_leaderboard,
    write_leaderboard,
)
from nanoshampoo.evidence.logs import read_run
from nanoshampoo.evidence.repeat import MANAGED_OPTIONS as REPEAT_MANAGED
from nanoshampoo.evidence.repeat import RepeatConfig, check_unmanaged, run_repeats
from nanoshampoo.evidence.report import format_report, report_to_dict, write_json
from nanoshampoo.evidence.stats import DEFAULT_TARGET, build_report, check_confidence, check_target
from nanoshampoo.evidence.study_cli import add_study_command
from nanoshampoo.evidence.traces import analyze_paths, format_overlap
from nanoshampoo.evidence.tune_cli import (
    add_compare_tune_options,
    add_tune_command,
    tuned_compare_config,
)
from nanoshampoo.io_utils import check_output_dir, check_output_file

# Subcommands whose arguments belong to another module's own parser: name -> "module:function".
PASSTHROUGH = {
    # Through the trainer's entry point, which re-executes with tuned malloc settings.
    "train": (
        "nanoshampoo.train.cli",
        "run_entry_point",
        "train a model (see `nanoshampoo train --help`)",
    ),
    "prepare": (
        "nanoshampoo.data.prepare",
        "main",
        "tokenize a corpus into speedrun shards (see `nanoshampoo prepare --help`)",
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASSTHROUGH:
        module, function, _ = PASSTHROUGH[argv[0]]
        # Imported only when used: training and data preparation pull in heavy dependencies.
        result = getattr(importlib.import_module(module), function)(argv[1:])
        return int(result or 0)
    dashes = next((a for a in argv if re.fullmatch(r"--[A-Za-z][\w.-]*=--", a)), None)
    if dashes is not None:
        # Python 3.11's argparse hands "--FLAG=--" over as an empty list, not a string: no
        # command reads that, so it is refused here for what was typed.
        command = f"nanoshampoo {argv[0]}" if not argv[0].startswith("-") else "nanoshampoo"
        flag = dashes.partition("=")[0]
        return run_command(command, lambda: _refuse(f"{flag}: expected a value, got '--'"))
    parser = _parser()
    args = parser.parse_args(argv)
    return run_command(f"nanoshampoo {args.command}", lambda: args.handler(args))


def _refuse(message: str) -> typing.NoReturn:
    raise UserError(message)


class _OneLineErrorParser(argparse.ArgumentParser):
    """Usage errors as one line (no usage dump), exit status 2; subcommand parsers inherit it."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(prog="nanoshampoo", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, _, help_text) in PASSTHROUGH.items():
        commands.add_parser(name, help=help_text, add_help=False)

    stats = commands.add_parser("stats", help="statistics and A/B tests over repeated runs")
    stats.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="run logs (.jsonl/.txt) or directories; each directory is a group",
    )
    _add_report_options(stats)
    stats.set_defaults(handler=_run_stats)

    repeat = commands.add_parser("repeat", help="train N seeds of one configuration, then report")
    repeat.add_argument("-n", "--runs", type=int, required=True, help="number of seeds")
    repeat.add_argument(
        "--out-dir", type=Path, default=Path("runs"), help="where the runs' logs go"
    )
    repeat.add_argument("--seed0", type=int, default=0, help="first seed")
    repeat.add_argument(
        "--nproc", type=int, default=1, help="processes per run (torchrun when > 1)"
    )
    repeat.add_argument("--name", default="run", help="run id prefix: <name>_seed<s>")
    repeat.add_argument("--target", type=float, default=DEFAULT_TARGET, help="target val loss")
    repeat.add_argument("--json", type=Path, help="also write the report as JSON here")
    repeat.add_argument(
        "train_args",
        nargs=argparse.REMAINDER,
        help="arguments for `python -m nanoshampoo.train`, after `--`",
    )
    repeat.set_defaults(handler=_run_repeat)

    _add_compare_command(commands)
    add_tune_command(commands)
    add_study_command(commands)

    trace = commands.add_parser(
        "trace", help="communication/computation overlap in profiler traces"
    )
    trace.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="Chrome traces (.json/.json.gz) or directories of them (one per rank)",
    )
    trace.add_argument("--json", type=Path, help="also write the figures as JSON here")
    trace.set_defaults(handler=_run_trace)

    telemetry = commands.add_parser(
        "telemetry", help="draw the runs' per-layer telemetry (heatmaps, comparisons)"
    )
    telemetry.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="run logs (runs/<id>, .jsonl or .txt) or directories of them",
    )
    telemetry.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the PNGs (default: <first RUN>.telemetry beside it)",
    )
    telemetry.set_defaults(handler=_run_telemetry)
    return parser


def _add_compare_command(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    compare = commands.add_parser(
        "compare",
        help="train every optimizer setup over seeds, then write a leaderboard",
        description="Train every setup (NAME runs preset tiny-NAME; NAME=PRESET any preset) over "
        "the seeds, reusing runs that already ended with the same effective config, then "
        "write leaderboard.md, leaderboard.json and loss_vs_{step,time}.png into --out-dir. "
        "Steps and time to the target are interpolated linearly between the two "
        "validations around the crossing; diverged runs count as not reaching it.",
    )
    compare.add_argument(
        "--setups",
        default=DEFAULT_SETUPS,
        metavar="NAME[=PRESET],...",
        help="setups to compare, comma-separated",
    )
    compare.add_argument("--seeds", type=int, default=3, help="seeds per setup")
    compare.add_argument("--seed0", type=int, default=0, help="first seed")
    compare.add_argument(
        "--baseline", default="", help="setup the others are compared with (default: first)"
    )
    compare.add_argument(
        "--target",
        default="auto",
        help="target val loss, or auto: the baseline's mean final val loss",
    )
    compare.add_argument(
        "--nproc", type=int, default=1, help="processes per run (torchrun when > 1)"
    )
    compare.add_argument(
        "--out-dir",
        type=Path,
        default=Path("runs/compare"),
        help="where the runs and the leaderboard go",
    )
    compare.add_argument(
        "--step-fractions",
        default="",
        metavar="F,...",
        help="also train every non-baseline setup with its schedule shortened to "
        "these fractions of the baseline's steps (e.g. 0.7): does it reach "
        "the target in that many steps?",
    )
    compare.add_argument(
        "--rule",
        choices=RULES,
        default="welch",
        help="the leaderboard's statistics: welch, or track3 (the speedrun "
        "optimization track's fixed-sigma record and pairwise rules, too)",
    )
    add_compare_tune_options(compare)
    compare.add_argument(
        "train_args",
        nargs=argparse.REMAINDER,
        help="arguments for every `python -m nanoshampoo.train` run, after `--`",
    )
    compare.set_defaults(handler=_run_compare)


def _add_report_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--group",
        action="append",
        default=[],
        metavar="NAME=GLOB",
        help="a named group of run logs matching GLOB (repeatable)",
    )
    parser.add_argument(
        "--group-by",
        metavar="KEY",
        help="regroup all runs by optimizer, preset, world_size or a config field",
    )
    parser.add_argument("--baseline", help="group the others are compared with (default: first)")
    parser.add_argument("--target", type=float, default=DEFAULT_TARGET, help="target val loss")
    parser.add_argument("--confidence", type=float, default=0.95, help="confidence of the A/B CIs")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    parser.add_argument("--plot", type=Path, metavar="DIR", help="write PNG figures into DIR")


def _run_stats(args: argparse.Namespace) -> int:
    if not args.paths and not args.group:
        raise UserError("give run log paths or directories, or --group NAME=GLOB")
    check_target("--target", args.target)
    check_confidence("--confidence", args.confidence)
    if args.plot:
        check_output_dir(args.plot, "--plot")
    with user_input():
        groups = {}
        if args.paths:
            groups.update(groups_by_directory(args.paths))
        for name, runs in groups_from_specs(args.group).items():
            if name in groups:
                raise ValueError(f"group: name {name!r} is also a directory group")
            groups[name] = runs
        if args.group_by:
            groups = regroup(groups, args.group_by)
        inputs = [run.path for runs in groups.values() for run in runs]
        if args.json:
            check_output_file(args.json, "--json", inputs)
        report = build_report(groups, args.target, args.baseline, args.confidence)
    print(format_report(report))
    if args.json:
        write_json(args.json, report_to_dict(report))
        print(f"\nwrote {args.json}")
    if args.plot:
        from nanoshampoo.evidence.plots import write_plots  # matplotlib loads only when plotting

        for path in write_plots(groups, report, args.plot):
            print(f"wrote {path}")
    return 0


def _run_repeat(args: argparse.Namespace) -> int:
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    check_target("--target", args.target)
    with user_input():
        config = RepeatConfig(
            runs=args.runs, out_dir=args.out_dir, seed0=args.seed0, nproc=args.nproc, name=args.name
        )
        check_unmanaged(train_args, REPEAT_MANAGED, "repeat for each seed")
        # A bad train flag fails here, before the out dir exists (not in seed 0's subprocess).
        resolve_train_config([*train_args, "--seed", str(config.seed0)])
    check_output_dir(config.out_dir, "--out-dir")
    if args.json:
        check_output_file(args.json, "--json")
    files = run_repeats(config, train_args)
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise UserError(f"the runs did not write their logs: {', '.join(missing)}")
    groups = {str(config.out_dir): [read_run(f) for f in files]}
    report = build_report(groups, args.target)
    print(format_report(report))
    if args.json:
        write_json(args.json, report_to_dict(report))
    return 0


def _run_compare(args: argparse.Namespace) -> int:
    # Compare reports a bad setup or flag as ValueError and a run that failed as RuntimeError,
    # both the user's to fix (the failed run printed its own output).
    with user_input(RuntimeError):
        return _compare(args)


def _compare(args: argparse.Namespace) -> int:
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    config = CompareConfig(
        setups=parse_setups(args.setups),
        seeds=args.seeds,
        seed0=args.seed0,
        baseline=args.baseline,
        target=_target(args.target),
        nproc=args.nproc,
        out_dir=args.out_dir,
        train_args=tuple(train_args),
        step_fractions=_fractions(args.step_fractions),
        rule=args.rule,
    )
    if args.tune:
        config = tuned_compare_config(config, args)
    groups = run_compare(config)
    board = build_leaderboard(groups, config)
    print()
    print(format_leaderboard(board))
    for path in write_leaderboard(board, groups, config.out_dir):
        print(f"wrote {path}")
    return 0


def _fractions(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(
            f"step-fractions: expected numbers separated by commas, got {text!r}"
        ) from None


def _target(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"target: expected auto or a number, got {text!r}") from None


def _run_telemetry(args: argparse.Namespace) -> int:
    from nanoshampoo.evidence.telemetry_plots import write_telemetry_plots

    first = Path(args.runs[0])
    out = args.out or (first / "telemetry" if first.is_dir() else first.with_suffix(".telemetry"))
    check_output_dir(out, "--out")
    paths = write_telemetry_plots(args.runs, out)
    print(f"{len(paths)} figures in {out}")
    return 0


def _run_trace(args: argparse.Namespace) -> int:
    stats = analyze_paths(args.paths)
    if args.json:
        check_output_file(args.json, "--json", [s.path for s in stats])
    print(format_overlap(stats))
    if args.json:
        write_json(args.json, [dataclasses.asdict(s) for s in stats])
        print(f"\nwrote {args.json}")
    return 0
