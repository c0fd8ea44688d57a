"""The command line of tuning: ``nanoshampoo tune`` and ``nanoshampoo compare --tune``.

``tune --setup muon --search 'muon.lr=0.01,0.02,0.04' [--search ...] [--trials N]
[--seeds 1] [--confirm-seeds 3] [--rungs 0.25,0.5 [--halving sync]] [--storage URL] --
TRAIN_ARGS`` tunes one setup (``nanoshampoo.evidence.tune``). The same command started again
(another terminal, or another machine with the same ``--storage postgresql://...``) is one more
worker of the same study; run again after the study ended, it trains nothing and writes the
files again.

``compare --tune 'adamw:adamw.lr=0.001,0.003,0.01' --tune 'muon:muon.lr=0.01,0.02,0.04'
[--tune-seeds 1] [--tune-trials N] [--tune-rungs F,... [--tune-halving sync]]
[--tune-storage URL] ...`` first tunes every compared setup, each with the same number of trials
(refused otherwise: an equal budget), into ``OUT_DIR/tune/SETUP``, then compares them at their
tuned presets. Several keys of one setup: ``SETUP:K1=...;K2=...``. Every spec is checked before
any trial trains; a worker runs the trials of every setup's study it can before it waits for
another worker's. The best point's ``--seeds`` seeds are each tune's confirmation, so they too
go through the store; the comparison then reuses those it finds in the out dir and trains the
rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING

from nanoshampoo.errors import user_input
from nanoshampoo.evidence.compare import CompareConfig, Setup, parse_setups
from nanoshampoo.evidence.tables import format_markdown_table
from nanoshampoo.evidence.tune_space import HALVINGS, Search, parse_search
from nanoshampoo.io_utils import atomic_output

if TYPE_CHECKING:  # the tuning engine imports Optuna: only when a tune runs
    from nanoshampoo.evidence.tune import TuneConfig
    from nanoshampoo.evidence.tune_report import TuneResult


def add_tune_command(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser(
        "tune",
        help="tune one setup's hyper-parameters (Optuna: a grid, or TPE over ranges)",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument(
        "--setup",
        required=True,
        metavar="NAME[=PRESET]",
        help="the setup to tune (NAME runs preset tiny-NAME)",
    )
    parser.add_argument(
        "--search",
        action="append",
        default=[],
        required=True,
        metavar="KEY=V1,V2|KEY=log:LO:HI",
        help="a searched field: muon.lr, adamw.weight_decay, cooldown_frac, "
        "custom.matrix_kwargs.lr (repeatable)",
    )
    parser.add_argument(
        "--trials",
        type=int,
        default=None,
        help="TPE trials (needs a log:LO:HI range); default: the whole grid",
    )
    parser.add_argument("--seeds", type=int, default=1, help="seeds per trial")
    parser.add_argument(
        "--confirm-seeds",
        type=int,
        default=0,
        help="seeds to train the best trial with in all (0: none)",
    )
    parser.add_argument("--seed0", type=int, default=0, help="first seed")
    parser.add_argument("--sample-seed", type=int, default=0, help="seed of the TPE sampler")
    parser.add_argument("--nproc", type=int, default=1, help="processes per run")
    parser.add_argument(
        "--rungs",
        default="",
        metavar="F,...",
        help="successive-halving rungs as fractions of the budget, 1/eta^m..1/eta "
        "(0.25,0.5): each trial's first seed also trains decay branches there",
    )
    parser.add_argument(
        "--halving",
        choices=HALVINGS,
        default="sync",
        help="sync: every trial to each rung, paused there, the best 1/eta continued; "
        "async: Optuna's pruner judges each trial against those already at its rung; "
        "off: no pruning, every trial records its branches at the rungs",
    )
    parser.add_argument(
        "--storage",
        default=None,
        metavar="URL",
        help="the trial store (default: OUT_DIR/study.db, SQLite); "
        "postgresql://USER@HOST:PORT/DB shares the study between machines",
    )
    parser.add_argument(
        "--study",
        default="",
        metavar="NAME",
        help="the study's name (default: SETUP-<digest of the command>)",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="where the trials and files go (default runs/tune/NAME)",
    )
    parser.add_argument(
        "train_args",
        nargs=argparse.REMAINDER,
        help="arguments for every `python -m nanoshampoo.train` run, after `--`",
    )
    parser.set_defaults(handler=run_tune_command)


def add_compare_tune_options(compare: argparse.ArgumentParser) -> None:
    compare.add_argument(
        "--tune",
        action="append",
        default=[],
        metavar="SETUP:KEY=SPEC[;...]",
        help="tune SETUP first (repeat for every setup, equal trial counts)",
    )
    compare.add_argument("--tune-seeds", type=int, default=1, help="seeds per tuning trial")
    compare.add_argument(
        "--tune-trials", type=int, default=None, help="TPE trials per setup (with log:LO:HI ranges)"
    )
    compare.add_argument(
        "--tune-rungs",
        default="",
        metavar="F,...",
        help="successive-halving rungs of every tune (see tune --rungs)",
    )
    compare.add_argument(
        "--tune-halving",
        choices=HALVINGS,
        default="sync",
        help="how every tune halves at its rungs (see tune --halving)",
    )
    compare.add_argument(
        "--tune-storage",
        default=None,
        metavar="URL",
        help="the store of every setup's study (default: tune/SETUP/study.db); "
        "postgresql://... lets more machines run the same command as workers",
    )


def _train_args(args: argparse.Namespace) -> tuple[str, ...]:
    rest = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    return tuple(rest)


def parse_rungs(text: str, flag: str) -> tuple[float, ...]:
    """``"0.25,0.5"`` -> ``(0.25, 0.5)``; ``ValueError`` naming ``flag``."""
    try:
        rungs = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{flag}: expected fractions separated by commas, got {text!r}") from None
    if any(not math.isfinite(f) for f in rungs):
        raise ValueError(f"{flag}: expected finite fractions, got {text!r}")
    return rungs


def run_tune_command(args: argparse.Namespace) -> int:
    # As compare: a bad search, setup or flag is a ValueError, a failed run a RuntimeError;
    # both are the user's to fix.
    from nanoshampoo.evidence.tune import tune

    with user_input(RuntimeError):
        _report(tune(_tune_config(args)))
    return 0


def _tune_config(args: argparse.Namespace) -> TuneConfig:
    from nanoshampoo.evidence.tune import TuneConfig

    setups = parse_setups(args.setup)
    if len(setups) != 1:
        raise ValueError(f"setup: tune takes one NAME[=PRESET], got {args.setup!r}")
    (setup,) = setups
    return TuneConfig(
        setup=setup,
        searches=tuple(parse_search(s) for s in args.search),
        trials=args.trials,
        seeds=args.seeds,
        confirm_seeds=args.confirm_seeds,
        seed0=args.seed0,
        sample_seed=args.sample_seed,
        nproc=args.nproc,
        out_dir=args.out_dir or Path("runs/tune") / setup.name,
        train_args=_train_args(args),
        rungs=parse_rungs(args.rungs, "--rungs"),
        halving=args.halving,
        storage=args.storage,
        study=args.study,
    )


def _report(result: TuneResult) -> None:
    tune = result.tunability
    print(
        f"[tune] {result.setup}: best {result.best} "
        f"({', '.join(f'{k}={v}' for k, v in result.best_values.items())}, "
        f"{result.best_value:.4f}) of {len(result.trials)} trials; {tune.within} of "
        f"{tune.trials} trials within 1 % of it; tuned preset {result.preset_file}"
    )
    for warning in result.edge_warnings:
        print(f"[tune] warning: {warning}")


def parse_tune_specs(specs: list[str]) -> dict[str, tuple[Search, ...]]:
    """``["muon:muon.lr=0.01,0.02;muon.momentum=0.9,0.95"]`` -> searches per setup."""
    out: dict[str, tuple[Search, ...]] = {}
    for spec in specs:
        name, sep, searches = spec.partition(":")
        if not sep or not name.strip() or not searches.strip():
            raise ValueError(f"tune: expected SETUP:KEY=SPEC[;KEY=SPEC], got {spec!r}")
        if name.strip() in out:
            raise ValueError(f"tune: setup {name.strip()!r} is given twice")
        out[name.strip()] = tuple(parse_search(part) for part in searches.split(";"))
    return out


def tuned_compare_config(config: CompareConfig, args: argparse.Namespace) -> CompareConfig:
    """Tune every setup of ``config`` at an equal budget; return it at the tuned presets.

    Every spec is checked against its setup before any trial trains. This worker then runs
    what trials it can in every setup's study, and only then waits for other workers' trials
    (with ``--tune-storage``), setup by setup.
    """
    from nanoshampoo.evidence.tune import TuneConfig, TuneSession, trial_dirs

    specs = parse_tune_specs(args.tune)
    names = [s.name for s in config.setups]
    if sorted(specs) != sorted(names):
        raise ValueError(
            f"tune: give every compared setup {names} a --tune spec (an equal "
            f"tuning budget), got specs for {sorted(specs)}"
        )
    rungs = parse_rungs(args.tune_rungs, "--tune-rungs")
    # The comparison's seeds at the best point are the tune's confirmation: trained through
    # the store (shared by the workers), then reused by the comparison where they are local.
    tunes = {
        s.name: TuneConfig(
            setup=s,
            searches=specs[s.name],
            trials=args.tune_trials,
            seeds=args.tune_seeds,
            confirm_seeds=config.seeds,
            seed0=config.seed0,
            nproc=config.nproc,
            out_dir=config.out_dir / "tune" / s.name,
            train_args=config.train_args,
            rungs=rungs,
            halving=args.tune_halving,
            storage=args.tune_storage,
        )
        for s in config.setups
    }
    counts = {name: t.budget for name, t in tunes.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(
            f"tune: every setup needs the same number of trials (an equal budget), got {counts}"
        )
    sessions = [TuneSession(tunes[s.name]) for s in config.setups]
    for session in sessions:  # every store checked before any trial trains
        session.check_store()
    for session in sessions:
        session.work(wait=False)
    tuned, results = [], []
    for setup, session in zip(config.setups, sessions):
        result = session.finish()
        _report(result)
        results.append(result)
        # Trial runs are the tuned setup's runs too where their config is the same.
        tuned.append(
            Setup(
                setup.name,
                result.preset_file,
                reuse_from=tuple(sorted(trial_dirs(tunes[setup.name].out_dir))),
            )
        )
    summary = config.out_dir / "tuning.md"
    with atomic_output(summary) as tmp:
        tmp.write_text(format_tuning_summary(results), encoding="utf-8")
    print(f"wrote {summary}")
    return dataclasses.replace(config, setups=tuple(tuned))


def format_tuning_summary(results: list[TuneResult]) -> str:
    """One table of every setup's trials (value: mean final val loss, or the state), its best
    point, its tunability and any edge warning: what ``compare --tune`` gave each setup before
    comparing them."""
    rows = [["setup", "searched", "trials: mean final val loss", "best", "within 1 %", "edge"]]
    for result in results:
        keys = list(result.best_values)
        trials = ", ".join(
            f"{'/'.join(t.params.get(k, '?') for k in keys)}: "
            + (t.state if t.value is None else f"{t.value:.4f}")
            for t in result.trials
        )
        tune = result.tunability
        rows.append(
            [
                result.setup,
                ", ".join(keys),
                trials,
                ", ".join(f"{k} = {v}" for k, v in result.best_values.items()),
                f"{tune.within}/{tune.trials}",
                "yes" if result.edge_warnings else "-",
            ]
        )
    seeds = {r.seeds for r in results}
    lines = [
        "# Tuning at an equal budget",
        "",
        f"{results[0].budget} trials per setup, {'/'.join(map(str, sorted(seeds)))} "
        "seed(s) each, the same train flags for every trial; each setup's own tuning.md "
        "(under tune/SETUP/) has the per-seed losses, the rungs and its tuned preset.",
        "",
        *format_markdown_table(rows),
        "",
    ]
    lines += [f"**Warning** ({r.setup}): {w}" for r in results for w in r.edge_warnings]
    return "\n".join(lines) + "\n"
