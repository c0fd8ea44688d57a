"""The command line of ``nanoshampoo study`` (the study itself: :mod:`nanoshampoo.evidence.study`).

``study [--study cpu|gpt2|PATH.toml] [--setups a,b] [--sizes s1,s2] [--seeds N]
[--storage URL] [--out-dir runs/study] [--nproc K] [-- TRAIN_ARGS]``: setups x model sizes x
budgets x seeds, each setup tuned at each size with an equal budget of trials, then its best
point trained at every seed with a decay branch at every budget; writes study.md, study.json
and the plots. ``--setups`` and ``--sizes`` pick from the definition; train flags after ``--``
come after the definition's own. The same command started on other machines with a shared
``--storage postgresql://...`` adds workers; run again when it is done, it trains nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nanoshampoo.errors import user_input
from nanoshampoo.evidence.study_definition import StudyDefinition, load_definition


def add_study_command(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser(
        "study",
        help="setups x sizes x budgets x seeds, tuned fairly: speedups as curves",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument(
        "--study",
        default="cpu",
        metavar="NAME|PATH.toml",
        help="a packaged study definition (cpu: the embedded default; gpt2: the "
        "GPT-2 sizes on GPUs) or your own .toml",
    )
    parser.add_argument(
        "--setups",
        default="",
        metavar="NAME,...",
        help="only these of the definition's setups (the baseline always runs)",
    )
    parser.add_argument(
        "--sizes",
        default="",
        metavar="SIZE,...",
        help="only these model sizes (--model values) instead of the definition's",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="seeds at each best point (default: the definition's)",
    )
    parser.add_argument(
        "--storage",
        default=None,
        metavar="URL",
        help="the trial store of every tune (default: a SQLite file per tune "
        "in the out dir); postgresql://... shares the study between machines",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("runs/study"),
        help="where the tunes, runs, study.md, study.json and plots go",
    )
    parser.add_argument(
        "--nproc", type=int, default=1, help="processes per run (torchrun when > 1)"
    )
    parser.add_argument(
        "--resamples", type=int, default=1000, help="bootstrap resamples of the speedup intervals"
    )
    parser.add_argument(
        "train_args",
        nargs=argparse.REMAINDER,
        help="more arguments for every `python -m nanoshampoo.train` run, after `--`",
    )
    parser.set_defaults(handler=run_study_command)


def chosen_definition(args: argparse.Namespace) -> StudyDefinition:
    """The definition, narrowed and extended by the flags (validated again)."""
    definition = load_definition(args.study)
    changes: dict[str, object] = {}
    if args.setups:
        wanted = [name.strip() for name in args.setups.split(",") if name.strip()]
        known = [s.name for s in definition.setups]
        unknown = [name for name in wanted if name not in known]
        if unknown:
            raise ValueError(f"setups: {unknown} are not in the study's setups {known}")
        keep = set(wanted) | {definition.baseline}
        changes["setups"] = tuple(s for s in definition.setups if s.name in keep)
    if args.sizes:
        changes["sizes"] = tuple(s.strip() for s in args.sizes.split(",") if s.strip())
    if args.seeds is not None:
        changes["seeds"] = args.seeds
    extra = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if extra:
        changes["train_args"] = (*definition.train_args, *extra)
    return definition.replace(**changes) if changes else definition


def run_study_command(args: argparse.Namespace) -> int:
    # A malformed definition or flag is a ValueError, a run that failed a RuntimeError: both
    # are the user's to fix, in one line.
    with user_input(RuntimeError):
        from nanoshampoo.evidence.study import StudyPlan, format_summary, run_study  # Optuna

        plan = StudyPlan(
            chosen_definition(args),
            args.out_dir,
            storage=args.storage,
            nproc=args.nproc,
            resamples=args.resamples,
        )
        result = run_study(plan)
        print()
        print(format_summary(result))
        for path in result.files:
            print(f"wrote {path}")
    return 0
