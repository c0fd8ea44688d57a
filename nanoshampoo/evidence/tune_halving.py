"""Synchronous successive halving over decay branches: every trial to the first rung, then the
best ``1/eta`` of each rung onward, each paused at its rung and continued exactly.

The rungs ``r_1 < ... < r_m`` (fractions of the budget ``N``, ``tune_study.reduction_factor``)
are decay branches: the branch of ``round(r_k N)`` steps forks from the run at step ``f_k``
(``train/branches.py``), trains its own cooldown and records its final validation loss, the loss
of the separate run of that length. A trial's run is trained in *segments*:

* segment 0 trains from scratch to ``f_1`` (``--pause-at-step f_1``), which makes branch 1, and
  pauses there with a checkpoint: the trial ends PRUNED, its value at rung 1 reported;
* once every trial of a rung has ended, the best ``max(1, n // eta)`` of its ``n`` (by the
  rung's branch loss, ties by slot) are *continued*: a new trial of the same point and slot,
  queued for any worker, whose segment ``k`` resumes the run from ``f_k`` and pauses at
  ``f_{k+1}`` (making branch ``k + 1``); segment ``m`` resumes from ``f_m`` and finishes the run;
* the rest stay pruned at that rung.

So a trial pays ``f_1 + (r_1 N - f_1)`` steps for its first rung and, when continued, only the
main run between two forks plus the next branch: with 9 points, eta 2, rungs 1/8, 1/4, 1/2 of
512 steps and a cooldown of 0.7 that is about 41 % of the grid's 9 x 512 steps, against 50 % or
more for the asynchronous pruner (``SuccessiveHalvingPruner``), which cannot stop the first
trials to reach a rung (nothing is there to compare them with). Every value a decision sees is a
complete decayed run. The decision waits for the whole rung: a worker with nothing to run waits
for the others' trials (``tune_study.run_worker``), and the worker that sees the rung complete
queues the continued trials (two workers doing it at once make surplus trials, failed before
they train).

A paused run's checkpoint is the run's own (``RUN.ckpt/step_N``); a continued trial that dies is
retried from the latest checkpoint of that run, so no step is trained twice and none skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import optuna
from optuna.trial import FrozenTrial, TrialState

from nanoshampoo.evidence.tune_study import SEGMENT, SLOT, held_slots, segment, slot

# User attributes of a paused trial: the rung's branch steps, its run's id and checkpoint.
PAUSED_AT, RUN_ID, CHECKPOINT = "paused_at", "run_id", "checkpoint"


@dataclass(frozen=True)
class HalvingPlan:
    """Where a trial's segments pause: ``rung_steps[k]`` is rung ``k + 1``'s branch length and
    ``pause_steps[k]`` its fork (ascending, each >= 1 and below ``num_iterations``)."""

    eta: int
    num_iterations: int
    rung_steps: tuple[int, ...]
    pause_steps: tuple[int, ...]

    @classmethod
    def build(
        cls,
        eta: int,
        rung_steps: Sequence[int],
        num_iterations: int,
        cooldown_frac: float,
        warmup_steps: int,
    ) -> HalvingPlan:
        """The plan of ``rung_steps`` (``tune_study.rung_steps``) in a run of
        ``num_iterations`` with this schedule; ``ValueError`` naming ``rungs`` when two rungs
        fork at one step or one forks at step 0 (too short a budget)."""
        from nanoshampoo.train.branches import fork_step  # imports torch

        forks = tuple(fork_step(s, num_iterations, cooldown_frac, warmup_steps) for s in rung_steps)
        if forks[0] < 1 or any(a >= b for a, b in zip(forks, forks[1:])):
            raise ValueError(
                f"rungs: their branches of {list(rung_steps)} steps fork at steps {list(forks)} "
                f"of {num_iterations}; synchronous halving pauses a trial at each fork, so each "
                "needs its own fork after step 0 (a longer budget, or fewer rungs)"
            )
        return cls(eta, num_iterations, tuple(rung_steps), forks)

    @property
    def segments(self) -> int:
        """Segments of a trial that is never pruned: one per rung, then the rest of the run."""
        return len(self.rung_steps) + 1

    def pause_step(self, segment_index: int) -> int | None:
        """Where segment ``segment_index`` pauses; None for the last (it finishes the run)."""
        if segment_index < len(self.pause_steps):
            return self.pause_steps[segment_index]
        return None


_Trial = TypeVar("_Trial")


def keep_best(
    reached: Sequence[_Trial],
    at_rung: int,
    eta: int,
    loss: Callable[[_Trial], float],
    slot_of: Callable[[_Trial], int],
) -> list[_Trial]:
    """Synchronous halving's rule at a rung of ``at_rung`` trials: the best ``max(1, at_rung //
    eta)`` of those that ``reached`` it, by their branch ``loss`` (ties: the lower slot)."""
    ranked = sorted(reached, key=lambda t: (loss(t), slot_of(t)))
    return ranked[: max(1, at_rung // eta)]


def rung_decision(
    trials: Sequence[FrozenTrial], budget: int, plan: HalvingPlan
) -> tuple[int, list[FrozenTrial]] | None:
    """``(k, promoted)`` once every trial of the current rung ``k`` (segment ``k``) has ended:
    the best ``max(1, n // eta)`` of its ``n`` by the rung's branch loss (ties: the lower slot),
    among those that reached it (paused there, or complete: a finished run reused). None while
    the rung still runs (or not all of the budget's trials have started), and after the last.
    """
    held = held_slots(trials)
    if len(held) < budget or any(
        t.state in (TrialState.RUNNING, TrialState.WAITING) for t in held.values()
    ):
        return None
    k = max(segment(t) for t in held.values())
    if k >= len(plan.rung_steps):
        return None
    at_rung = [t for t in held.values() if segment(t) == k]
    steps = plan.rung_steps[k]
    reached = [
        t
        for t in at_rung
        if t.state in (TrialState.PRUNED, TrialState.COMPLETE) and steps in t.intermediate_values
    ]
    return k, keep_best(
        reached, len(at_rung), plan.eta, lambda t: t.intermediate_values[steps], slot
    )


def promote(study: optuna.Study, budget: int, plan: HalvingPlan) -> list[int]:
    """Queue the next segment of the rung's promoted trials once the rung is complete; return
    their slots (empty when there is nothing to decide yet, or nothing left to continue)."""
    decision = rung_decision(study.get_trials(deepcopy=False), budget, plan)
    if decision is None:
        return []
    k, promoted = decision
    queued = []
    for t in promoted:
        if t.state != TrialState.PRUNED or PAUSED_AT not in t.user_attrs:
            continue  # a reused finished run: nothing left to train
        study.enqueue_trial(
            t.params,
            user_attrs={
                SLOT: slot(t),
                SEGMENT: k + 1,
                RUN_ID: t.user_attrs[RUN_ID],
                CHECKPOINT: t.user_attrs[CHECKPOINT],
            },
        )
        queued.append(slot(t))
    return queued


def continued(trials: Sequence[FrozenTrial]) -> set[int]:
    """Numbers of the paused trials that a later segment of their slot continues (a row of the
    study's report is the slot's last segment, which holds every rung its run reached)."""
    later = {(slot(t), segment(t)) for t in trials if segment(t) > 0}
    return {
        t.number
        for t in trials
        if t.state == TrialState.PRUNED and (slot(t), segment(t) + 1) in later
    }
