"""The trial store of ``nanoshampoo tune`` and the workers that share it (Optuna).

One study holds a tune's trials. The default store is an SQLite file in the out dir
(``study.db``); ``--storage postgresql://...`` puts it in a PostgreSQL database, so that the
same command started on any number of machines works on one study. Both are Optuna's
``RDBStorage``, the storage that keeps heartbeats: every running trial records one every
``heartbeat_interval`` seconds, and a trial without one for ``3 x`` that long (its worker was
killed) is failed by the next worker that looks and queued again, with its point, for any
worker to run (``RetryHeartbeatStaleTrialCallback``). SQLite's file lock serialises the writes
of workers on one machine, which wait for it (a 60 s busy timeout) instead of failing.

A study has a budget of trials (the grid's size, or ``--trials``). Each trial holds a *slot*:
its own number, or for a retried trial the number of the trial it retries. A worker asks the
study for a trial while a slot is free or a retry waits, so no point is trained twice: grid
points go by trial number (``GridSampler`` gives trial ``k`` < grid size the ``k``-th point),
and a trial that two workers' simultaneous asks created beyond the budget is marked
``surplus`` and failed before it trains. A worker that finds no free slot waits while other
workers' trials run (one of them may die and be retried), then returns.

Samplers: ``GridSampler`` when every key is a grid; otherwise TPE, whose random stream is
seeded per trial by ``(sample_seed, slot)``, so workers on many machines draw different points
and one worker's study is reproducible. (QMC was the alternative: it spreads a small budget
evenly, but its sample counter is read and then written in the store, so two workers may draw
the same point; TPE also narrows in on the good region once it has results.)

Halving: with rungs (fractions ``1/eta^m, ..., 1/eta`` of the budget: ``0.25,0.5`` is eta 2),
either synchronous successive halving (``tune_halving``: every trial to the first rung, the best
``1/eta`` onward, a trial paused at each rung and continued as a new trial of the same slot), or
asynchronous: ``SuccessiveHalvingPruner`` with ``reduction_factor`` eta and ``min_resource`` the
first rung's steps, so its rungs fall on the decay branches' steps. Without rungs, none.
"""

from __future__ import annotations

import logging
import random
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState

STORE_FILE = "study.db"
# Seconds between a running trial's heartbeats; a trial is stale after GRACE_FACTOR of them.
HEARTBEAT_S = 20
# Seconds between two looks at the store of a worker waiting for other workers' trials: a
# worker that slept a whole heartbeat left a core idle for up to 20 s after each trial it
# waited for (bench/study_throughput.py; docs/results/throughput.md).
WAIT_POLL_S = 1.0
GRACE_FACTOR = 3
# Times a trial whose worker died is queued again before its slot counts as spent.
MAX_RETRIES = 3
# The user attribute that says why a trial failed without a value (a result or not).
OUTCOME = "outcome"
# User attributes of a continued trial (synchronous halving: ``tune_halving``): the slot it
# continues, and its segment (how many rungs its run has passed when it starts).
SLOT, SEGMENT = "slot", "segment"
DIVERGED, SURPLUS, ERROR = "diverged", "surplus", "error"
# Relative distance from a geometric rung that still counts as on it (0.333 for 1/3).
RUNG_TOLERANCE = 0.02


class NoResult(Exception):
    """A trial that ends without a value, and says why in its ``outcome`` attribute."""


def storage_url(text: str | None, out_dir: Path) -> str:
    """The SQLAlchemy URL of ``--storage`` (default: the SQLite file in ``out_dir``).
    ``postgresql://`` is PostgreSQL through the ``psycopg`` driver."""
    if not text:
        return f"sqlite:///{(Path(out_dir) / STORE_FILE).resolve()}"
    scheme, sep, rest = text.partition("://")
    if not sep or not scheme or not rest:
        raise ValueError(
            f"--storage: expected a URL (postgresql://USER@HOST:PORT/DB or "
            f"sqlite:///PATH), got {text!r}"
        )
    if scheme in ("postgresql", "postgres"):
        return f"postgresql+psycopg://{rest}"
    return text


def shown_url(url: str) -> str:
    """``url`` with its password hidden, for logs and files."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy reads: show only its scheme
        return url.partition("://")[0] + "://..."


@contextmanager
def quiet_optuna() -> Iterator[None]:
    """Optuna's experimental-feature warnings and per-trial log lines off: tune prints its
    own line per trial, and a trial failed on purpose (diverged, surplus) is not news."""
    logger = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(logger)


def open_storage(url: str, heartbeat_s: int = HEARTBEAT_S, attempts: int = 5) -> RDBStorage:
    """The store at ``url`` with heartbeats; ``ValueError`` naming ``--storage`` when it cannot
    be opened. Workers that start together may race to create the tables: retried."""
    engine = (
        {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    )
    for attempt in range(1, attempts + 1):
        try:
            with quiet_optuna():
                return RDBStorage(
                    url,
                    engine_kwargs=engine,
                    heartbeat_interval=heartbeat_s,
                    grace_period=GRACE_FACTOR * heartbeat_s,
                    heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(
                        max_retry=MAX_RETRIES
                    ),
                )
        except ModuleNotFoundError as exc:
            raise ValueError(
                f"--storage {shown_url(url)}: its driver is not installed ({exc}); "
                "for PostgreSQL: pip install 'nanoshampoo[postgres]'"
            ) from None
        except Exception as exc:  # the database's own errors: SQLAlchemy's, Optuna's
            if attempt == attempts:
                message = " ".join(str(exc).split())[:300]
                raise ValueError(
                    f"--storage {shown_url(url)}: cannot open it: {type(exc).__name__}: {message}"
                ) from None
            time.sleep(0.5 + random.random())
    raise AssertionError("unreachable")


def reduction_factor(rungs: Sequence[float]) -> int:
    """eta of the rungs ``1/eta^m, ..., 1/eta`` (ascending); ``ValueError`` otherwise."""
    if any(not 0 < f < 1 for f in rungs) or list(rungs) != sorted(set(rungs)):
        raise ValueError(f"rungs: fractions in (0, 1), ascending, each once; got {list(rungs)}")
    eta = round(1 / rungs[-1])
    expected = [eta ** -(len(rungs) - k) for k in range(len(rungs))]
    if eta < 2 or any(abs(f / e - 1) > RUNG_TOLERANCE for f, e in zip(rungs, expected)):
        raise ValueError(
            f"rungs: successive halving keeps 1 of eta trials at each rung, so the "
            f"rungs are 1/eta^m, ..., 1/eta of the budget (0.25,0.5 for eta 2; "
            f"0.111,0.333 for eta 3), got {list(rungs)}"
        )
    return eta


def rung_steps(rungs: Sequence[float], num_iterations: int) -> list[int]:
    """The steps of each rung's branch at a budget of ``num_iterations`` steps, as the trainer
    rounds them (``round(f * N)``)."""
    steps = [round(f * num_iterations) for f in rungs]
    if steps[0] < 1 or len(set(steps)) != len(steps):
        raise ValueError(
            f"rungs: {list(rungs)} of {num_iterations} steps are {steps} steps; "
            "each rung needs its own step count >= 1 (a longer budget or fewer rungs)"
        )
    return steps


def make_pruner(rungs: Sequence[float], num_iterations: int) -> optuna.pruners.BasePruner:
    """Successive halving on the rungs' branch steps; no pruning without rungs."""
    if not rungs:
        return optuna.pruners.NopPruner()
    eta, steps = reduction_factor(rungs), rung_steps(rungs, num_iterations)
    # Rung k decides at min_resource * eta^k steps, which must not pass branch k's steps
    # (round(f * N) need not be exactly geometric) nor reach branch k + 1's.
    min_resource = max(1, min(s // eta**k for k, s in enumerate(steps)))
    if any(s >= min_resource * eta ** (k + 1) for k, s in enumerate(steps)):
        raise ValueError(
            f"rungs: {list(rungs)} of {num_iterations} steps are {steps} steps, too "
            "few to tell the rungs apart; a longer budget or fewer rungs"
        )
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=min_resource, reduction_factor=eta)


def range_sampler(sample_seed: int, slot: int, budget: int) -> optuna.samplers.TPESampler:
    """TPE for the trial in ``slot``: random for the first third of the budget (2 to 10
    trials), then drawn toward the best results so far."""
    return optuna.samplers.TPESampler(
        seed=(sample_seed * 1_000_003 + slot) % 2**32, n_startup_trials=max(2, min(10, budget // 3))
    )


def slot(trial: FrozenTrial) -> int:
    """The slot a trial holds: the slot it continues (a later segment of a paused trial), else
    the number of the first trial of its retries."""
    if SLOT in trial.user_attrs:
        return int(trial.user_attrs[SLOT])
    return int(trial.system_attrs.get("failed_trial", trial.number))


def segment(trial: FrozenTrial | optuna.Trial) -> int:
    """How many rungs the trial's run had passed when the trial started (0: a new trial)."""
    return int(trial.user_attrs.get(SEGMENT, 0))


def _set_aside(trials: Sequence[FrozenTrial]) -> set[int]:
    """Trials that hold no slot: surplus ones, and failed ones queued again (a retry holds it)."""
    retried = {n for t in trials for n in t.system_attrs.get("retry_history", [])}
    return {
        t.number
        for t in trials
        if t.state == TrialState.FAIL
        and (t.user_attrs.get(OUTCOME) == SURPLUS or t.number in retried)
    }


def held_slots(trials: Sequence[FrozenTrial]) -> dict[int, FrozenTrial]:
    """Slot -> the trial holding it: the latest of the slot's trials (a continued trial's last
    segment), leaving out surplus ones and failed ones that were queued again (the retry holds
    the slot)."""
    aside = _set_aside(trials)
    held: dict[int, FrozenTrial] = {}
    for t in sorted(trials, key=lambda t: t.number):
        if t.number not in aside:
            held[slot(t)] = t
    return held


def is_surplus(trial: FrozenTrial, trials: Sequence[FrozenTrial], budget: int) -> bool:
    """Whether ``trial`` came after the budget was full (``budget`` slots below its own are
    held), or holds a grid point that another slot's trial holds (two workers' samplers drew
    the same free point at once), or continues a slot's segment that an earlier trial already
    continues (two workers promoted the same rung at once)."""
    if segment(trial) > 0:
        aside = _set_aside(trials)
        return any(
            t.number < trial.number
            and t.number not in aside
            and slot(t) == slot(trial)
            and segment(t) == segment(trial)
            for t in trials
        )
    held = held_slots(trials)
    below = [s for s, t in held.items() if s < slot(trial) and t.number != trial.number]
    grid_id = trial.system_attrs.get("grid_id")
    taken = grid_id is not None and any(
        t.system_attrs.get("grid_id") == grid_id and s < slot(trial) for s, t in held.items()
    )
    return len(below) >= budget or taken


def give_back(study: optuna.Study, number: int) -> None:
    """Queue a trial that failed without a result (its trainer crashed, the worker was
    interrupted) again, so its point is not lost; a trial in any other state is left."""
    trial = next((t for t in study.get_trials(deepcopy=False) if t.number == number), None)
    if trial is not None and trial.state == TrialState.FAIL and OUTCOME not in trial.user_attrs:
        with quiet_optuna():
            RetryHeartbeatStaleTrialCallback()(study, trial)


def run_worker(
    study: optuna.Study,
    budget: int,
    objective: Callable[[optuna.Trial, int], float],
    wait: bool = True,
    poll_s: float = float(HEARTBEAT_S),
    before_look: Callable[[optuna.Study], object] | None = None,
) -> int:
    """Run trials of ``study`` while a slot is free or a queued trial waits (a retry, or a
    continued trial of synchronous halving); return how many ran here.

    ``objective(trial, slot)`` trains a trial. A trial asked for beyond the budget is failed
    as ``surplus`` before the objective sees it. ``wait``: while other workers' trials run,
    wait for them (and take a dead worker's trial over) instead of returning. An exception of
    the objective other than ``NoResult`` gives the trial back (:func:`give_back`) and
    propagates. ``before_look(study)`` runs before each look at the study (synchronous
    halving queues a rung's promoted trials there, once the rung is complete).
    """
    ran = 0
    while True:
        with quiet_optuna():
            optuna.storages.fail_stale_trials(study)
            if before_look is not None:
                before_look(study)
        held = held_slots(study.get_trials(deepcopy=False)).values()
        states = {t.state for t in held}
        if TrialState.WAITING in states or len(held) < budget:
            asked: list[int] = []

            def tracked(trial: optuna.Trial) -> float:
                asked.append(trial.number)
                trials = study.get_trials(deepcopy=False)
                frozen = next(t for t in trials if t.number == trial.number)
                if is_surplus(frozen, trials, budget):
                    trial.set_user_attr(OUTCOME, SURPLUS)
                    raise NoResult(f"trial {trial.number} came after the budget was full")
                return objective(trial, slot(frozen))

            try:
                with quiet_optuna():
                    study.optimize(tracked, n_trials=1, catch=(NoResult,))
            except BaseException:
                if asked:
                    give_back(study, asked[0])
                raise
            last = next(t for t in study.get_trials(deepcopy=False) if t.number == asked[0])
            if last.user_attrs.get(OUTCOME) == SURPLUS:
                time.sleep(poll_s * random.random())  # another worker asked at the same time
            else:
                ran += 1
            continue
        if wait and TrialState.RUNNING in states:
            time.sleep(poll_s)
            continue
        return ran


def study_counts(trials: Sequence[FrozenTrial], budget: int) -> dict[str, int]:
    """How many of the budget's slots are complete, pruned, failed, running, queued again (a
    retry), and not asked for yet."""
    held = held_slots(trials).values()
    counts = {
        name: sum(t.state == state for t in held)
        for name, state in (
            ("complete", TrialState.COMPLETE),
            ("pruned", TrialState.PRUNED),
            ("failed", TrialState.FAIL),
            ("running", TrialState.RUNNING),
        )
    }
    counts["queued"] = sum(t.state == TrialState.WAITING for t in held)
    counts["to run"] = max(0, budget - len(held))
    return counts


def sampler_for(
    grid: dict[str, list[Any]] | None, sample_seed: int, budget: int
) -> optuna.samplers.BaseSampler:
    """``GridSampler`` over ``grid``; TPE (re-seeded per trial by the objective) without."""
    if grid is not None:
        return optuna.samplers.GridSampler(grid, seed=sample_seed)
    return range_sampler(sample_seed, 0, budget)
