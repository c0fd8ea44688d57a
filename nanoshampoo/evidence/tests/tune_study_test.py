"""The trial store's rules: which trials hold the budget's slots, which are surplus, the rungs'
reduction factor and where successive halving decides, the worker loop, the storage URLs."""

from __future__ import annotations

import datetime
from typing import Any

import optuna
import pytest
from optuna.trial import FrozenTrial, TrialState

from nanoshampoo.evidence.tune_study import (
    held_slots,
    is_surplus,
    make_pruner,
    reduction_factor,
    run_worker,
    shown_url,
    storage_url,
)


def frozen(
    number: int,
    state: TrialState,
    system: dict[str, Any] | None = None,
    user: dict[str, Any] | None = None,
) -> FrozenTrial:
    now = datetime.datetime.now()
    return FrozenTrial(
        number=number,
        state=state,
        value=1.0 if state == TrialState.COMPLETE else None,
        datetime_start=now,
        datetime_complete=None,
        params={},
        distributions={},
        user_attrs=user or {},
        system_attrs=system or {},
        intermediate_values={},
        trial_id=number,
    )


# 0 complete; 1 failed, its worker lost, queued again as 3; 2 running; 4 failed as surplus.
TRIALS = [
    frozen(0, TrialState.COMPLETE, {"grid_id": 0}),
    frozen(1, TrialState.FAIL, {"grid_id": 1}),
    frozen(2, TrialState.RUNNING, {"grid_id": 2}),
    frozen(3, TrialState.WAITING, {"grid_id": 1, "failed_trial": 1, "retry_history": [1]}),
    frozen(4, TrialState.FAIL, {"grid_id": 2}, {"outcome": "surplus"}),
]


def test_a_retry_holds_the_slot_of_the_trial_it_retries_and_a_surplus_trial_none() -> None:
    held = held_slots(TRIALS)
    assert {s: t.number for s, t in held.items()} == {0: 0, 1: 3, 2: 2}


def test_a_diverged_or_abandoned_failure_keeps_its_slot() -> None:
    diverged = frozen(5, TrialState.FAIL, user={"outcome": "diverged"})
    assert {s: t.number for s, t in held_slots([*TRIALS, diverged]).items()} == {
        0: 0,
        1: 3,
        2: 2,
        5: 5,
    }


@pytest.mark.parametrize(
    "budget, grid_id, surplus",
    [
        (3, None, True),  # three slots below 5 are held: the budget was full when 5 was asked
        (4, None, False),
        (4, 2, True),  # a free slot, but trial 2 holds that grid point already
        (4, 3, False),
    ],
)
def test_a_trial_beyond_the_budget_or_on_a_taken_grid_point_is_surplus(
    budget: int, grid_id: int | None, surplus: bool
) -> None:
    late = frozen(5, TrialState.RUNNING, {} if grid_id is None else {"grid_id": grid_id})
    assert is_surplus(late, [*TRIALS, late], budget) is surplus
    assert not is_surplus(TRIALS[2], TRIALS, 3)  # a trial within the budget never is


@pytest.mark.parametrize(
    "rungs, eta",
    [((0.25, 0.5), 2), ((0.5,), 2), ((0.25,), 4), ((0.111, 0.333), 3), ((0.125, 0.25, 0.5), 2)],
)
def test_the_reduction_factor_of_geometric_rungs(rungs: tuple[float, ...], eta: int) -> None:
    assert reduction_factor(rungs) == eta


@pytest.mark.parametrize(
    "rungs", [(0.3, 0.5), (0.5, 0.25), (0.25, 0.25), (1.0,), (0.6,), (0.25, 0.75)]
)
def test_rungs_that_are_not_one_over_eta_powers_are_refused(rungs: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="rungs"):
        reduction_factor(rungs)


@pytest.mark.parametrize("steps", [300, 302, 303, 8, 9])
def test_successive_halving_decides_each_rung_at_its_branchs_steps(steps: int) -> None:
    """At N steps the branches of 0.25 and 0.5 end at round(N/4), round(N/2) (not always in a
    ratio of exactly 2): each branch's report decides exactly its own rung."""
    study = optuna.create_study(pruner=make_pruner((0.25, 0.5), steps))
    first, second = round(0.25 * steps), round(0.5 * steps)
    trial = study.ask()

    def rungs_decided_at(step: int) -> list[str]:
        trial.report(1.0, step=step)
        assert not trial.should_prune()  # the first trial at a rung is promoted
        return sorted(k for k in study.trials[0].system_attrs if k.startswith("completed_rung"))

    assert rungs_decided_at(first) == ["completed_rung_0"]
    assert rungs_decided_at(second) == ["completed_rung_0", "completed_rung_1"]


def test_no_rungs_no_pruning() -> None:
    assert isinstance(make_pruner((), 300), optuna.pruners.NopPruner)


def test_the_worker_runs_the_budget_pops_a_retry_first_and_then_stops() -> None:
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    study.enqueue_trial({}, user_attrs={"queued": True})
    seen: list[tuple[int, int, bool]] = []

    def objective(trial: optuna.Trial, slot: int) -> float:
        seen.append((trial.number, slot, bool(trial.user_attrs.get("queued"))))
        return float(slot)

    assert run_worker(study, 3, objective, wait=True, poll_s=0.01) == 3
    assert seen == [(0, 0, True), (1, 1, False), (2, 2, False)]
    assert run_worker(study, 3, objective) == 0 and len(study.trials) == 3


def test_an_error_gives_the_trial_back_to_the_queue() -> None:
    study = optuna.create_study()

    def crash(trial: optuna.Trial, slot: int) -> float:
        raise RuntimeError("the trainer crashed")

    with pytest.raises(RuntimeError, match="crashed"):
        run_worker(study, 2, crash)
    failed, queued = study.get_trials(deepcopy=False)
    assert failed.state == TrialState.FAIL and queued.state == TrialState.WAITING
    assert queued.system_attrs["failed_trial"] == 0
    assert held_slots(study.get_trials()) == {0: queued}


@pytest.mark.parametrize(
    "given, url",
    [
        ("postgresql://tune@db:5432/studies", "postgresql+psycopg://tune@db:5432/studies"),
        ("postgres://tune@db/studies", "postgresql+psycopg://tune@db/studies"),
        ("postgresql+psycopg2://tune@db/studies", "postgresql+psycopg2://tune@db/studies"),
        ("sqlite:////tmp/x.db", "sqlite:////tmp/x.db"),
    ],
)
def test_storage_urls(given: str, url: str) -> None:
    assert storage_url(given, "runs") == url


def test_the_default_store_is_a_file_in_the_out_dir(tmp_path: Any) -> None:
    assert storage_url(None, tmp_path) == f"sqlite:///{tmp_path.resolve()}/study.db"
    with pytest.raises(ValueError, match="--storage: expected a URL"):
        storage_url("study.db", tmp_path)


def test_a_shown_url_hides_the_password() -> None:
    assert (
        shown_url("postgresql+psycopg://tune:secret@db/s") == "postgresql+psycopg://tune:***@db/s"
    )
