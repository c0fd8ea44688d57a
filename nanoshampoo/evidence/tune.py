"""``nanoshampoo tune``: tune one setup's hyper-parameters at an equal budget per trial (Optuna).

The searches (``nanoshampoo.evidence.tune_space``: ``muon.lr=0.01,0.02``, ``adamw.weight_decay=
log:0.01:1``, ``custom.matrix_kwargs.lr=...``) span the trials of one Optuna study
(``nanoshampoo.evidence.tune_study``): every point of a grid, or ``trials`` points of TPE over
ranges. Every trial trains with the same train flags, so the same budget, at ``seeds`` seeds
(the first also trains the rungs' decay branches: ``nanoshampoo.evidence.tune_trial``) and is
scored by its mean final validation loss (diverged seeds are left out; a trial whose seeds all
diverged fails). With rungs, successive halving keeps only the best ``1/eta`` of the trials at
each rung by their branch losses: synchronously by default (``halving="sync"``, every trial
paused at each rung until the rung is complete: ``nanoshampoo.evidence.tune_halving``), or
asynchronously (``"async"``: Optuna's pruner judges a trial against those already at its rung),
or not at all (``"off"``: every trial trains to the end and records its branch losses at the
rungs, the full grid's curves).
The best complete trial is then trained up to
``confirm_seeds`` seeds (a second study, ``STUDY.confirm-N``, so workers share that too).

The study is named after the command (``SETUP-<digest>`` of the preset, train flags, searches,
trials, seeds, rungs; ``study_name`` overrides), so the same command run again, or on another
machine against the same ``storage``, works on the same study: a finished study is read back,
and nothing trains. Runs go to ``out_dir/trials/STUDY/tNNN/`` (one directory per trial slot) as
``compare`` runs, and an ended run of the same effective config anywhere under
``out_dir/trials`` is reused (a grid grown by one value trains that value only); the files
(``nanoshampoo.evidence.tune_report``) go to ``out_dir``.

Example:
    >>> config = TuneConfig(Setup("muon", "tiny-muon"), (parse_search("muon.lr=0.01,0.02"),))
    >>> config.budget, config.study_name[:5]
    (2, 'muon-')
    >>> result = tune(config)  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState

from nanoshampoo.evidence.compare import (
    MANAGED_OPTIONS,
    ConfigResolver,
    PlannedRun,
    Setup,
    check_setup_name,
    resolve_train_config,
    run_identity,
    train_config_defaults,
)
from nanoshampoo.evidence.repeat import check_unmanaged
from nanoshampoo.evidence.trainer_process import shared_probe_cache
from nanoshampoo.evidence.tune_halving import (
    CHECKPOINT,
    PAUSED_AT,
    RUN_ID,
    HalvingPlan,
    continued,
    promote,
)
from nanoshampoo.evidence.tune_report import (
    TrialResult,
    TuneResult,
    best_trial,
    edge_keys,
    trial_tunability,
    write_tuning,
)
from nanoshampoo.evidence.tune_space import (
    HALVINGS,
    Search,
    SearchSpace,
    build_space,
    check_searches,
    normalize_key,
    parse_search,
)
from nanoshampoo.evidence.tune_study import (
    DIVERGED,
    HEARTBEAT_S,
    OUTCOME,
    STORE_FILE,
    SURPLUS,
    WAIT_POLL_S,
    NoResult,
    make_pruner,
    open_storage,
    quiet_optuna,
    range_sampler,
    reduction_factor,
    run_worker,
    rung_steps,
    sampler_for,
    segment,
    shown_url,
    slot,
    storage_url,
    study_counts,
)
from nanoshampoo.evidence.tune_trial import (
    POLL_S,
    Branch,
    SeedResult,
    TrainCommand,
    branch_flags,
    continue_seed,
    train_seed,
    trainer_command,
)
from nanoshampoo.io_utils import check_output_dir

__all__ = ["TuneConfig", "TuneSession", "parse_search", "tune"]

# The study's user attribute holding its TuneConfig.definition.
DEFINITION = "definition"


@dataclass(frozen=True)
class TuneConfig:
    """What to tune: ``setup`` (a compare setup: preset), the searches, ``trials`` (ranges
    only; a grid runs every point), seeds per trial, the best trial's seeds in all
    (``confirm_seeds``, 0: none), ``rungs`` (fractions of the budget, see ``tune_study``) and
    how successive halving decides on them (``halving``: ``sync`` or ``async``), the store
    (``storage``: a URL, ``None`` for ``out_dir/study.db``), and where the runs go."""

    setup: Setup
    searches: tuple[Search, ...]
    trials: int | None = None
    seeds: int = 1
    confirm_seeds: int = 0
    seed0: int = 0
    sample_seed: int = 0
    nproc: int = 1
    out_dir: Path = Path("runs/tune")
    train_args: tuple[str, ...] = ()
    rungs: tuple[float, ...] = ()
    halving: str = "sync"
    storage: str | None = None
    study: str = ""
    heartbeat_s: int = HEARTBEAT_S
    poll_s: float = POLL_S

    def __post_init__(self) -> None:
        object.__setattr__(self, "searches", tuple(self.searches))
        object.__setattr__(self, "train_args", tuple(self.train_args))
        object.__setattr__(self, "rungs", tuple(self.rungs))
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        for name, low in (
            ("seeds", 1),
            ("confirm_seeds", 0),
            ("seed0", 0),
            ("nproc", 1),
            ("heartbeat_s", 1),
        ):
            if getattr(self, name) < low:
                raise ValueError(
                    f"{name.replace('_', '-')}: must be >= {low}, got {getattr(self, name)}"
                )
        check_setup_name(self.setup.name)
        if self.study and not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$", self.study):
            raise ValueError(
                f"study: {self.study!r} is not a plain name (letters, digits, "
                "_ . + -): it names a directory"
            )
        check_searches(self.searches, self.trials)
        check_unmanaged(self.train_args, MANAGED_OPTIONS, "tune for each run")
        given = {
            normalize_key(a.lstrip("-").split("=", 1)[0])
            for a in self.train_args
            if a.startswith("--")
        }
        clash = sorted(s.field for s in self.searches if s.field in given)
        if clash:
            raise ValueError(f"train flags: {clash} are searched; leave them to the search")
        if self.halving not in HALVINGS:
            raise ValueError(f"halving: {self.halving!r} is not one of {', '.join(HALVINGS)}")
        if self.rungs:
            if self.halving != "off":  # nothing halves otherwise, so any rungs do
                reduction_factor(self.rungs)
            if "decay_branches" in given:
                raise ValueError("train flags: --decay-branches is set by tune from --rungs")
        storage_url(self.storage, self.out_dir)
        check_output_dir(self.out_dir, "--out-dir")

    @property
    def budget(self) -> int:
        """The study's trials: the grid's size, or ``trials``."""
        return check_searches(self.searches, self.trials)

    @property
    def seed_list(self) -> range:
        return range(self.seed0, self.seed0 + self.seeds)

    @property
    def definition(self) -> str:
        """The sha256 digest of what makes two commands the same study: the preset, the train
        flags, the searches, the trial and seed counts, the rungs (and halving mode) and the
        processes per run."""
        spelled = {
            "preset": self.setup.preset,
            "train_args": self.train_args,
            "searches": [[s.key, s.values, s.low, s.high] for s in self.searches],
            "trials": self.trials,
            "seeds": self.seeds,
            "seed0": self.seed0,
            "sample_seed": self.sample_seed,
            "rungs": self.rungs,
            "nproc": self.nproc,
        }
        if self.rungs:  # a study without rungs keeps the name it had before halving modes
            spelled["halving"] = self.halving
        return hashlib.sha256(json.dumps(spelled, sort_keys=True).encode()).hexdigest()

    @property
    def study_name(self) -> str:
        """``study``, or ``SETUP-<digest>`` of :attr:`definition`."""
        return self.study or f"{self.setup.name}-{self.definition[:10]}"

    def base_argv(self, seed: int | None = None) -> tuple[str, ...]:
        return (
            *self.train_args,
            "--preset",
            self.setup.preset,
            "--seed",
            str(self.seed0 if seed is None else seed),
        )


def trial_dirs(out_dir: Path) -> list[Path]:
    """Every trial directory of every study tuned into ``out_dir``."""
    return [d for d in Path(out_dir).glob("trials/*/*") if d.is_dir()]


def trial_name(slot_number: int) -> str:
    """The directory of a trial slot's runs: ``t007``."""
    return f"t{slot_number:03d}"


class TuneSession:
    """One setup's tune against its study: :meth:`work` runs trials, :meth:`finish` waits for
    the study to end, confirms the best and writes the files.

    Building it checks everything (the searches against the setup, every grid value through
    the trainer's parser, the rungs against the budget) and writes nothing; the store opens on
    first use of :attr:`study`.
    """

    def __init__(
        self,
        config: TuneConfig,
        resolve: ConfigResolver = resolve_train_config,
        command: TrainCommand | None = None,
        say: Callable[[str], None] = lambda line: print(line, flush=True),
    ) -> None:
        self.config, self.resolve, self.say = config, resolve, say
        self.command = command or trainer_command(config.nproc)
        self.space: SearchSpace = build_space(
            config.searches, resolve, config.base_argv(), config.setup.name
        )
        resolved = resolve(config.base_argv())
        self.num_iterations = int(resolved["num_iterations"])
        self.halving: HalvingPlan | None = None
        if config.rungs and config.halving == "sync":
            self.pruner: optuna.pruners.BasePruner = optuna.pruners.NopPruner()
            self.halving = HalvingPlan.build(
                reduction_factor(config.rungs),
                rung_steps(config.rungs, self.num_iterations),
                self.num_iterations,
                float(resolved["cooldown_frac"]),
                int(resolved["warmup_steps"]),
            )
        elif config.halving == "off":
            self.pruner = optuna.pruners.NopPruner()
        else:
            self.pruner = make_pruner(config.rungs, self.num_iterations)
        if config.rungs:  # the trainer must know the flags before a trial asks for branches
            resolve((*config.base_argv(), *branch_flags(config.rungs), *self._pause_flags(0)))
        self.url = storage_url(config.storage, config.out_dir)
        self.defaults = train_config_defaults()
        self.storage: RDBStorage | None = None
        self._study: optuna.Study | None = None

    @property
    def study(self) -> optuna.Study:
        """The study, opened (and its store created) on first use; says what it holds."""
        if self._study is not None:
            return self._study
        config = self.config
        if config.storage is None:
            config.out_dir.mkdir(parents=True, exist_ok=True)
        self.storage = open_storage(self.url, config.heartbeat_s)
        grid = self.space.grid() if self.space.is_grid else None
        with quiet_optuna():
            self._study = optuna.create_study(
                storage=self.storage,
                study_name=config.study_name,
                sampler=sampler_for(grid, config.sample_seed, config.budget),
                pruner=self.pruner,
                direction="minimize",
                load_if_exists=True,
            )
        stored = self._study.user_attrs.get(DEFINITION)
        self._check_definition(stored)
        if stored is None:
            self._study.set_user_attr(DEFINITION, config.definition)
        counts = study_counts(self._study.get_trials(deepcopy=False), config.budget)
        shape = f"grid {' x '.join(str(len(s.values)) for s in config.searches)}" if grid else "TPE"
        rungs = ""
        if config.rungs:
            rungs = f", rungs {','.join(f'{f:g}' for f in config.rungs)} " + (
                "(decay branches recorded, no halving)"
                if config.halving == "off"
                else f"({config.halving}hronous successive halving, "
                f"eta {reduction_factor(config.rungs)})"
            )
        self.say(
            f"[tune] {config.setup.name}: study {config.study_name} in "
            f"{shown_url(self.url)}: {config.budget} trials ({shape}), {config.seeds} "
            f"seed(s) each{rungs}: " + ", ".join(f"{n} {name}" for name, n in counts.items())
        )
        return self._study

    def _check_definition(self, stored: str | None) -> None:
        """ValueError naming ``--study`` when the store holds a study of this name that another
        command made (``stored``: its :attr:`TuneConfig.definition`; ``None``: a new study, or
        one made before studies recorded it, which is taken as it is): its trials would be
        read as this command's."""
        config = self.config
        if stored is not None and stored != config.definition:
            raise ValueError(
                f"--study {config.study_name}: {shown_url(self.url)} holds a study of this name "
                "made by another command (its preset, train flags, search, rungs or seeds "
                "differ); give a new --study name or --out-dir"
            )

    def check_store(self) -> None:
        """The check of :attr:`study` without creating anything: where the store already holds
        a study of this name, it must be this command's (see :meth:`_check_definition`)."""
        config = self.config
        if config.storage is None and not (config.out_dir / STORE_FILE).exists():
            return
        storage = open_storage(self.url, config.heartbeat_s)
        try:
            study_id = storage.get_study_id_from_name(config.study_name)
        except KeyError:  # no such study yet
            return
        self._check_definition(storage.get_study_user_attrs(study_id).get(DEFINITION))

    def work(self, wait: bool = True) -> int:
        """Run trials while the study has one to run (``wait``: then wait for the other
        workers' trials to end); return how many ran here."""
        return run_worker(
            self.study,
            self.config.budget,
            self._objective,
            wait,
            poll_s=min(WAIT_POLL_S, self.config.heartbeat_s),
            before_look=None if self.halving is None else self._promote,
        )

    def _promote(self, study: optuna.Study) -> None:
        """Synchronous halving: queue the next segment of a complete rung's best trials."""
        assert self.halving is not None
        queued = promote(study, self.config.budget, self.halving)
        if queued:
            self.say(
                f"[tune] promote  {self.config.setup.name}: "
                f"{', '.join(trial_name(n) for n in queued)} continue to the next rung"
            )

    def _pause_flags(self, segment_index: int) -> tuple[str, ...]:
        """``--pause-at-step`` of a trial's segment under synchronous halving (none for the
        last segment, or without it)."""
        step = None if self.halving is None else self.halving.pause_step(segment_index)
        return () if step is None else ("--pause-at-step", str(step))

    def _objective(self, trial: optuna.Trial, slot_number: int) -> float:
        config = self.config
        if not self.space.is_grid:  # see tune_study: TPE's random stream follows the slot
            self.study.sampler = range_sampler(config.sample_seed, slot_number, config.budget)
        point = self.space.suggest(trial)
        name = trial_name(slot_number)
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        finals, logs = [], []
        part = segment(trial)  # > 0: a paused trial's continuation
        for index, seed in enumerate(config.seed_list):
            label = (
                f"{config.setup.name} {name} "
                f"({', '.join(f'{k}={v}' for k, v in point.items())}) seed {seed}"
            )
            extra = (*branch_flags(config.rungs), *self._pause_flags(part)) if index == 0 else ()
            plan = self._plan(name, point, extra, seed)

            def on_branch(branch: Branch) -> bool:
                trial.report(branch.val_loss, step=branch.steps)
                return self.halving is None and trial.should_prune()

            result = self._train_seed(trial, part if index == 0 else 0, plan, label, on_branch)
            if result.stopped:
                branch = result.branches[-1]
                self.say(
                    f"[tune] pruned   {label} at rung {branch.steps} steps (branch val_loss "
                    f"{branch.val_loss:.4f}): {result.log}"
                )
                raise optuna.TrialPruned()
            finals.append(result.final)
            logs.append(str(result.log))
            outcome = (
                "diverged" if math.isnan(result.final) else f"final val_loss {result.final:.4f}"
            )
            self.say(f"[tune] {'reused  ' if result.reused else 'finished'} {label}: {outcome}")
        trial.set_user_attr("finals", [None if math.isnan(f) else f for f in finals])
        trial.set_user_attr("logs", logs)
        finished = [f for f in finals if not math.isnan(f)]
        if not finished:
            trial.set_user_attr(OUTCOME, DIVERGED)
            raise NoResult(f"every seed of trial {name} diverged")
        return sum(finished) / len(finished)

    def _train_seed(
        self,
        trial: optuna.Trial,
        part: int,
        plan: PlannedRun,
        label: str,
        on_branch: Callable[[Branch], bool],
    ) -> SeedResult:
        """Train segment ``part`` of ``plan``'s run (0: from the start, or a whole run); raise
        ``TrialPruned`` when it paused at its rung (the trial then says where), ``NoResult``
        when it ended before a pause it was given (it diverged)."""
        if part > 0:
            assert self.halving is not None
            result = continue_seed(
                plan,
                label,
                str(trial.user_attrs[RUN_ID]),
                self.halving.pause_step(part),
                self.command,
                on_branch,
                self.say,
                self.config.poll_s,
            )
        else:
            result = self._train(plan, label, on_branch)
        if result.paused is not None:
            branch = result.branches[-1]
            trial.set_user_attr(PAUSED_AT, branch.steps)
            trial.set_user_attr(RUN_ID, result.run_id)
            trial.set_user_attr(CHECKPOINT, str(result.paused))
            self.say(
                f"[tune] paused   {label} at rung {branch.steps} steps (branch val_loss "
                f"{branch.val_loss:.4f}): it goes on if among the rung's best"
            )
            raise optuna.TrialPruned()
        if "--pause-at-step" in plan.argv:  # it ended before its pause: it diverged
            trial.set_user_attr("finals", [None])
            trial.set_user_attr("logs", [str(result.log)])
            trial.set_user_attr(OUTCOME, DIVERGED)
            raise NoResult(f"{label} diverged before its rung")
        return result

    def _plan(
        self, name: str, point: dict[str, str], extra: Sequence[str], seed: int
    ) -> PlannedRun:
        config = self.config
        args = self.space.train_args(point)
        argv = (
            *config.train_args,
            "--preset",
            config.setup.preset,
            *args,
            *extra,
            "--seed",
            str(seed),
        )
        resolved = self.resolve(argv)
        return PlannedRun(
            Setup(name, config.setup.preset, args=args),
            seed,
            argv,
            resolved,
            run_identity(resolved, config.nproc),
            self.trial_dir(name),
            None,
        )

    def trial_dir(self, name: str) -> Path:
        """Where trial ``name``'s runs go: ``out_dir/trials/STUDY/NAME``."""
        return self.config.out_dir / "trials" / self.config.study_name / name

    def _train(
        self, plan: PlannedRun, label: str, on_branch: Callable[[Branch], bool]
    ) -> SeedResult:
        """Train ``plan`` (or reuse an ended run of its config from any trial of any study in
        this out dir: the same config is the same run)."""
        others = [d for d in sorted(trial_dirs(self.config.out_dir)) if d != plan.directory]
        return train_seed(
            plan,
            label,
            self.config.nproc,
            self.command,
            on_branch,
            self.say,
            self.defaults,
            self.config.poll_s,
            others,
        )

    def finish(self) -> TuneResult:
        """Wait for the study to end, confirm its best trial, write the files."""
        config = self.config
        self.work(wait=True)
        trials = self.study.get_trials(deepcopy=False)
        superseded = continued(trials)  # a paused trial's row is its last segment's
        results = tuple(
            _trial_result(t, trials, self.space)
            for t in trials
            if t.user_attrs.get(OUTCOME) != SURPLUS and t.number not in superseded
        )
        best = best_trial(results)
        if best is None:
            raise RuntimeError(
                f"tune {config.setup.name}: no trial of study "
                f"{config.study_name} ended with a value (every seed diverged?)"
            )
        confirm, confirm_logs = self._confirm(best) if config.confirm_seeds else ((), ())
        best_args = self.space.train_args(best.params)
        resolved = self.resolve((*config.base_argv(), *best_args))
        typed = {s.field: resolved[s.field] for s in config.searches}
        assert best.value is not None
        sampler = "GridSampler" if self.space.is_grid else "TPE"
        result = TuneResult(
            setup=config.setup.name,
            preset=config.setup.preset,
            study=config.study_name,
            storage=shown_url(self.url),
            sampler=sampler,
            train_args=config.train_args,
            seeds=config.seeds,
            budget=config.budget,
            rungs=config.rungs,
            trials=results,
            best=best.name,
            best_number=best.number,
            best_values=best.params,
            best_value=best.value,
            on_edge=tuple(edge_keys(config.searches, results, best)),
            tunability=trial_tunability(results),
            confirm_finals=confirm,
            confirm_logs=confirm_logs,
            typed_values=typed,
        )
        return write_tuning(result, config.out_dir)

    def _confirm(self, best: TrialResult) -> tuple[tuple[float, ...], tuple[str, ...]]:
        """The best point's final losses at ``confirm_seeds`` seeds, and their runs' logs: its
        own seeds' (the trial's), then a study over the seeds it lacks. With rungs, every
        confirming run trains the rungs' decay branches too (never pruned), so each seed gives
        the loss at every budget."""
        config = self.config
        seeds = list(range(config.seed0, config.seed0 + config.confirm_seeds))
        extra = seeds[config.seeds :]
        finals = list(best.finals[: config.confirm_seeds])
        logs = list(best.logs[: config.confirm_seeds])
        if not extra:
            return tuple(finals), tuple(logs)
        with quiet_optuna():
            study = optuna.create_study(
                storage=self.storage,
                study_name=f"{config.study_name}.confirm-{best.number}",
                sampler=optuna.samplers.GridSampler({"seed": extra}, seed=0),
                direction="minimize",
                load_if_exists=True,
            )

        def objective(trial: optuna.Trial, slot_number: int) -> float:
            seed = int(trial.suggest_categorical("seed", extra))
            label = f"{config.setup.name} {best.name} (best) seed {seed}"
            result = self._train(
                self._plan(best.name, best.params, branch_flags(config.rungs), seed),
                label,
                lambda branch: False,
            )
            trial.set_user_attr("log", str(result.log))
            self.say(
                f"[tune] confirm  {label}: "
                + ("diverged" if math.isnan(result.final) else f"final val_loss {result.final:.4f}")
            )
            if math.isnan(result.final):
                trial.set_user_attr(OUTCOME, DIVERGED)
                raise NoResult(f"{label} diverged")
            return result.final

        run_worker(
            study, len(extra), objective, wait=True, poll_s=min(WAIT_POLL_S, config.heartbeat_s)
        )
        by_seed = {
            t.params.get("seed"): t
            for t in study.get_trials(deepcopy=False)
            if t.state in (TrialState.COMPLETE, TrialState.FAIL)
            and t.user_attrs.get(OUTCOME) != SURPLUS
        }
        return (
            tuple(
                finals
                + [
                    math.nan if (t := by_seed.get(s)) is None or t.value is None else float(t.value)
                    for s in extra
                ]
            ),
            tuple(
                logs
                + [str(by_seed[s].user_attrs.get("log", "")) if s in by_seed else "" for s in extra]
            ),
        )


def _trial_result(
    trial: FrozenTrial, trials: Sequence[FrozenTrial], space: SearchSpace
) -> TrialResult:
    """A trial of the study as tuning.md lists it (its point spelled as the flags were)."""
    states = {
        TrialState.COMPLETE: "complete",
        TrialState.PRUNED: "pruned",
        TrialState.FAIL: "failed",
    }
    notes = []
    if trial.state == TrialState.PRUNED and PAUSED_AT in trial.user_attrs:
        notes.append(f"paused at rung {trial.user_attrs[PAUSED_AT]} steps, not continued")
    if segment(trial) > 0:
        notes.append(f"its run continued over {segment(trial)} pause(s)")
    if "failed_trial" in trial.system_attrs:
        notes.append(f"retry of trial {trial.system_attrs['failed_trial']}")
    if trial.state == TrialState.FAIL and trial.user_attrs.get(OUTCOME) == DIVERGED:
        notes.append("every seed diverged")
    elif trial.state == TrialState.FAIL:
        retries = [
            t.number for t in trials if trial.number in t.system_attrs.get("retry_history", [])
        ]
        notes.append(
            "no result (its worker stopped)"
            + (f"; retried as trial {retries[0]}" if retries else "")
        )
    return TrialResult(
        number=trial.number,
        name=trial_name(slot(trial)),
        state=states.get(trial.state, "running"),
        params={
            s.key: s.text(trial.params[s.key]) for s in space.searches if s.key in trial.params
        },
        value=None
        if trial.state != TrialState.COMPLETE or trial.value is None
        else float(trial.value),
        finals=tuple(
            math.nan if f is None else float(f) for f in trial.user_attrs.get("finals", [])
        ),
        logs=tuple(trial.user_attrs.get("logs", [])),
        rungs={int(step): float(value) for step, value in trial.intermediate_values.items()},
        note="; ".join(notes),
    )


def tune(
    config: TuneConfig,
    resolve: ConfigResolver = resolve_train_config,
    command: TrainCommand | None = None,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
) -> TuneResult:
    """Tune ``config.setup``: run trials of its study until none is left (with other workers
    on the same store, if any), confirm the best, write the files; return what was found.

    ``command`` builds the trainer's command line (default ``python -m nanoshampoo.train``).
    """
    with shared_probe_cache(config.out_dir):
        return TuneSession(config, resolve, command, say).finish()
