"""Synchronous successive halving's rules: where a trial's segments pause, which trials of a
complete rung go on (the best ``max(1, n // eta)`` of the ``n`` that ran it, ties by slot), that
nothing is decided while the rung runs, that a continued trial holds its slot and a second
continuation of it is surplus, and that a worker runs a whole study of paused trials to its
end. The study is a real (in-memory) Optuna study; the objective stands in for the trainer.
"""

from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState

from nanoshampoo.evidence.tune_halving import (
    CHECKPOINT,
    PAUSED_AT,
    RUN_ID,
    HalvingPlan,
    continued,
    promote,
    rung_decision,
)
from nanoshampoo.evidence.tune_study import (
    SEGMENT,
    SLOT,
    held_slots,
    is_surplus,
    run_worker,
    segment,
    slot,
)

# 64 steps, rungs 1/8, 1/4, 1/2 (eta 2), cooldown 0.5: branches of 8, 16, 32 steps.
PLAN = HalvingPlan.build(2, (8, 16, 32), 64, cooldown_frac=0.5, warmup_steps=0)


def test_a_segment_pauses_at_its_rungs_fork_and_the_last_finishes_the_run() -> None:
    # A branch of n steps with cooldown 0.5 forks at the first step past n / 2 where the
    # linear cooldowns differ: 5, 9, 17.
    assert PLAN.pause_steps == (5, 9, 17)
    assert [PLAN.pause_step(k) for k in range(PLAN.segments)] == [5, 9, 17, None]


def test_rungs_that_share_a_fork_or_fork_at_step_zero_are_refused() -> None:
    with pytest.raises(ValueError, match=r"rungs: their branches of \[1, 2\] steps fork at"):
        HalvingPlan.build(2, (1, 2), 4, cooldown_frac=1.0, warmup_steps=0)


def paused(study: optuna.Study, values: dict[int, float | None], k: int = 0) -> None:
    """Trials of rung ``k``: slot -> the branch loss they paused with (None: diverged first)."""
    for number, value in values.items():
        attrs = {RUN_ID: f"run{number}", CHECKPOINT: f"ckpt{number}"}
        if k:
            attrs.update({SLOT: number, SEGMENT: k})
        if value is None:
            study.add_trial(
                optuna.trial.create_trial(
                    state=TrialState.FAIL, user_attrs={**attrs, "outcome": "diverged"}
                )
            )
            continue
        attrs[PAUSED_AT] = PLAN.rung_steps[k]
        study.add_trial(
            optuna.trial.create_trial(
                state=TrialState.PRUNED,
                params={"lr": 0.01 * (number + 1)},
                distributions={"lr": optuna.distributions.FloatDistribution(0.001, 1.0)},
                user_attrs=attrs,
                intermediate_values={
                    s: value for s in PLAN.rung_steps[: k + 1]
                },  # earlier rungs replayed too
            )
        )


def test_the_best_half_of_a_complete_rung_goes_on_ties_by_slot() -> None:
    study = optuna.create_study()
    # 9 trials at rung 1: one diverged before it (it counts among the 9, never goes on), two
    # tie; 9 // 2 = 4 go on.
    paused(study, {0: 5.0, 1: 4.2, 2: None, 3: 4.5, 4: 4.2, 5: 6.0, 6: 4.4, 7: 4.9, 8: 4.45})
    decision = rung_decision(study.get_trials(), 9, PLAN)
    assert decision is not None
    k, best = decision
    assert k == 0 and [slot(t) for t in best] == [1, 4, 6, 8]
    assert promote(study, 9, PLAN) == [1, 4, 6, 8]
    queued = [t for t in study.get_trials() if t.state == TrialState.WAITING]
    assert [(t.user_attrs[SLOT], t.user_attrs[SEGMENT]) for t in queued] == [
        (1, 1),
        (4, 1),
        (6, 1),
        (8, 1),
    ]
    assert [t.user_attrs[CHECKPOINT] for t in queued] == ["ckpt1", "ckpt4", "ckpt6", "ckpt8"]
    assert queued[0].system_attrs["fixed_params"] == {"lr": 0.02}
    # The continued trials now hold their slots; while they wait, nothing more is decided.
    held = held_slots(study.get_trials())
    assert [held[s].number for s in (1, 4, 6, 8)] == [t.number for t in queued]
    assert rung_decision(study.get_trials(), 9, PLAN) is None
    assert continued(study.get_trials()) == {1, 4, 6, 8}


def test_nothing_is_decided_before_every_trial_of_the_budget_reached_the_rung() -> None:
    study = optuna.create_study()
    paused(study, {0: 5.0, 1: 4.2})
    assert rung_decision(study.get_trials(), 3, PLAN) is None  # slot 2 not asked for yet
    study.add_trial(optuna.trial.create_trial(state=TrialState.RUNNING))
    assert rung_decision(study.get_trials(), 3, PLAN) is None  # slot 2 still running
    assert promote(study, 3, PLAN) == []


def test_a_second_continuation_of_one_slot_is_surplus() -> None:
    study = optuna.create_study()
    paused(study, {0: 5.0, 1: 4.2, 2: 4.0, 3: 4.1})
    assert promote(study, 4, PLAN) == [2, 3]
    # Another worker saw the same complete rung at the same moment and promoted it too.
    study.enqueue_trial(
        {"lr": 0.03}, user_attrs={SLOT: 2, SEGMENT: 1, RUN_ID: "run2", CHECKPOINT: "ckpt2"}
    )
    trials = study.get_trials()
    first, late = [t for t in trials if slot(t) == 2 and segment(t) == 1]
    assert not is_surplus(first, trials, 4) and is_surplus(late, trials, 4)


def test_a_worker_runs_a_study_of_paused_trials_to_its_end() -> None:
    """Four points, every trial paused at each rung until the last: the worker queues the
    continued trials itself, and the best at every rung goes on."""
    losses = {0.1: 3.0, 0.2: 1.0, 0.3: 2.0, 0.4: 4.0}
    study = optuna.create_study(sampler=optuna.samplers.GridSampler({"lr": list(losses)}, seed=0))
    plan = HalvingPlan.build(2, (16, 32), 64, cooldown_frac=0.5, warmup_steps=0)
    ran: list[tuple[float, int]] = []

    def objective(trial: optuna.Trial, slot_number: int) -> float:
        lr = trial.suggest_categorical("lr", list(losses))
        part = int(trial.user_attrs.get(SEGMENT, 0))
        ran.append((lr, part))
        for s in plan.rung_steps[: part + 1]:
            trial.report(losses[lr] + 1 / s, step=s)
        if part < len(plan.rung_steps):
            trial.set_user_attr(PAUSED_AT, plan.rung_steps[part])
            trial.set_user_attr(RUN_ID, f"run{slot_number}")
            trial.set_user_attr(CHECKPOINT, f"ckpt{slot_number}")
            raise optuna.TrialPruned()
        return losses[lr]

    assert run_worker(study, 4, objective, poll_s=0.01, before_look=lambda s: promote(s, 4, plan))
    # Rung 1 keeps the best 2 of 4 (0.2 and 0.3), rung 2 the best 1 of those 2.
    assert sorted(ran) == [(0.1, 0), (0.2, 0), (0.2, 1), (0.2, 2), (0.3, 0), (0.3, 1), (0.4, 0)]
    (best,) = [t for t in study.get_trials() if t.state == TrialState.COMPLETE]
    assert best.params == {"lr": 0.2} and best.intermediate_values == {
        16: 1 + 1 / 16,
        32: 1 + 1 / 32,
    }
