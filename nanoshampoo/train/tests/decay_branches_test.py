"""Decay branches (``--decay-branches``): where they fork, and that a branch IS the shorter run.

Specification:

- the branch at fraction ``b`` of an ``N``-step run has ``round(b N)`` steps and forks at the
  first step whose learning rate differs between the two schedules;
- on CPU, eager, one thread, same seed: a branch's final validation loss and parameters equal
  those of the separate run of its length, bit for bit, and the main run's final loss and
  parameters equal those of the run without branches, for adamw, shampoo, soap and muon (with
  Shampoo's roots and SOAP's eigenbases refreshed every 2 steps from step 2, so the forks at
  steps 3, 5 and 7 fall between refreshes, with preconditioned steps behind them), and for
  schedule-free (iterate averaging) with a checkpoint every 2 steps;
- a restore that forgets any part of the state (parameters, optimizer state, loader) makes the
  main run differ: the comparison above catches it;
- each branch is one ``branch`` record and one ``branch:`` text line, written when it is done;
  a diverged branch is recorded as such and the main run goes on, unchanged;
- a run resumed past a fork says that branch cannot be made, and keeps the branches its log
  recorded before (none is made twice);
- a run paused at each branch's fork (``--pause-at-step``: a checkpoint, a ``paused`` record,
  exit) and resumed from there each time is the uninterrupted run: the same branch records, final
  loss and parameters, bit for bit (adamw, shampoo, soap, muon, schedule-free); a paused log is
  refused by the readers with the checkpoint that continues it; a pause outside the run is
  refused naming the flag;
- on 2 gloo ranks (ddp with DistAdam and DDP Shampoo, fsdp2 with SOAP) the same holds.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_test import read_jsonl, tiny_config

from nanoshampoo.evidence.logs import LogFormatError, read_run
from nanoshampoo.testing.distributed import run_on_gloo
from nanoshampoo.train import branches as branches_module
from nanoshampoo.train.branches import Branch, branches_to_make, plan_branches
from nanoshampoo.train.cli import config_from_args
from nanoshampoo.train.config import TrainConfig, UserError
from nanoshampoo.train.schedule import lr_multiplier
from nanoshampoo.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

FRACTIONS = (0.25, 0.5, 0.75)
STEPS = 16
# Cooldown 0.5: the branches of 4, 8 and 12 steps fork at steps 3, 5 and 7 (plan test below).
# The smallest model size (2 layers, width 96): each setup's every step, Shampoo's and SOAP's
# eigendecompositions included, at a fraction of tiny's cost; bit-equality needs no more.
RUN = dict(num_iterations=STEPS, cooldown_frac=0.5, val_every=4, compile="false", model="gpt-0.2m")
SETUPS = {
    "adamw": {},
    "shampoo": {
        "shampoo.precondition_frequency": 2,
        "preconditioner.start_preconditioning_step": 2,
    },
    "soap": {"soap.precondition_frequency": 2, "preconditioner.start_preconditioning_step": 2},
    "muon": {},
    # Iterate averaging: every checkpoint and validation is an evaluation-point round trip,
    # which a branch replays without writing the checkpoint.
    "schedule-free": {"checkpoint_every": 2},
}
BRANCH_KEYS = {"kind", "fraction", "steps", "fork_step", "val_loss", "train_time_ms", "tokens"}
BRANCH_LINE = re.compile(
    r"^branch:(0\.25|0\.5|0\.75) step:(\d+)/\2 val_loss:\d+\.\d{4} "
    r"train_time:\d+ms step_avg:\d+\.\d{2}ms \(forked at step (\d+)\)$"
)


@pytest.mark.parametrize(
    "cooldown, warmup, forks",
    [
        # N_b = 4, 8, 12 of 16. Cooldown 0.5: multiplier 1 while t / N_b <= 0.5 (at t / N_b = 0.5
        # the cooldown's (1 - x) / c is still 1), so the fork is the first t > N_b / 2.
        (0.5, 0, (3, 5, 7)),
        # Cooldown 0.7: the first t with t / N_b > 0.3: 4 * 0.3 = 1.2 -> 2, 2.4 -> 3, 3.6 -> 4.
        (0.7, 0, (2, 3, 4)),
        # No cooldown: the schedules never differ; the branch is the first N_b steps, validated.
        (0.0, 0, (4, 8, 12)),
        # A warmup of 6 caps both multipliers by (t + 1) / 6, which hides where the shorter
        # cooldown starts: 4 steps first differ at t = 3 (at t = 2 both are capped to 0.5), 8 at
        # t = 4 (0.714 against the cap 0.833), 12 at t = 5 (0.833 against 0.982).
        (0.7, 6, (3, 4, 5)),
    ],
)
def test_a_branch_forks_where_the_schedules_first_differ(
    cooldown: float, warmup: int, forks: tuple[int, ...]
) -> None:
    plan = plan_branches(FRACTIONS, STEPS, cooldown, warmup)
    assert plan == tuple(Branch(b, n, f) for b, n, f in zip(FRACTIONS, (4, 8, 12), forks))
    for branch in plan:
        same = [
            lr_multiplier(t, branch.steps, cooldown, warmup)
            == lr_multiplier(t, STEPS, cooldown, warmup)
            for t in range(branch.fork_step + 1)
        ]
        assert all(same[:-1]) and (not same[-1] or branch.fork_step == branch.steps)


def test_a_resumed_run_makes_only_the_branches_ahead_that_its_log_lacks() -> None:
    plan = plan_branches(FRACTIONS, STEPS, 0.5)  # forks 3, 5, 7
    four, eight, twelve = plan
    assert branches_to_make(plan, set(), 0) == (plan, ())
    assert branches_to_make(plan, set(), 5) == ((eight, twelve), (four,))
    assert branches_to_make(plan, {4, 12}, 5) == ((eight,), ())
    assert branches_to_make(plan, {4}, 8) == ((), (eight, twelve))


@pytest.mark.parametrize(
    "value, message",
    [
        ((0.5, 1.0), "strictly between 0 and 1"),
        ((0.0, 0.5), "strictly between 0 and 1"),
        ((0.75, 0.5), "strictly increasing"),
        ((0.5, 0.5), "strictly increasing"),
        ((0.02, 0.5), r"lengths round\(b \* N\) at --num-iterations 16 are \[0, 8\]"),
        ((0.5, 0.51), r"are \[8, 8\]; they must be distinct"),
        ((0.97,), r"are \[16\]"),
        (("a",), "must be a list of numbers"),
    ],
)
def test_bad_fractions_are_refused_naming_the_field(value: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ValueError, match=r"TrainConfig\.decay_branches.*" + message):
        TrainConfig(num_iterations=STEPS, decay_branches=value)


def test_the_flag_and_the_preset_key_set_the_fractions(tmp_path: Path) -> None:
    preset = tmp_path / "branched.toml"
    preset.write_text("num_iterations = 16\ndecay_branches = [0.25, 0.5, 0.75]\n")
    assert config_from_args(["--preset", str(preset)]).schedule.decay_branches == FRACTIONS
    assert (
        config_from_args(
            ["--num-iterations", "16", "--decay-branches", "0.25,0.5,0.75"]
        ).schedule.decay_branches
        == FRACTIONS
    )
    assert config_from_args([]).schedule.decay_branches == ()


def _flat(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, gathered whole (collective for DTensors), flattened."""
    tensors = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _branch_finals(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The parameters of each branch as it ends (just before its restore), in fork order."""
    finals: list[torch.Tensor] = []
    restore = branches_module.TrainingSnapshot.restore

    def recording(self: Any) -> None:
        finals.append(_flat(self.model))
        restore(self)

    monkeypatch.setattr(branches_module.TrainingSnapshot, "restore", recording)
    return finals


def _branches_against_separate_runs(
    shards: dict[str, str], out_dir: Path, finals: list[torch.Tensor], **fields: Any
) -> dict[str, Any]:
    """Train with branches, without, and each branch's length alone; every final loss and
    parameter vector, by run (``fields`` set the setup)."""
    config = dict(RUN, **fields)
    main = Trainer(tiny_config(shards, out_dir, run_id="main", decay_branches=FRACTIONS, **config))
    result = main.run()
    out: dict[str, Any] = {
        "main": (result.final_val_loss, _flat(main.model)),
        "finals": list(finals),
        "log": result,
    }
    plain = Trainer(tiny_config(shards, out_dir, run_id="plain", **config))
    out["plain"] = (plain.run().final_val_loss, _flat(plain.model))
    for steps in (4, 8, 12):
        alone = Trainer(
            tiny_config(
                shards, out_dir, run_id=f"alone{steps}", **dict(config, num_iterations=steps)
            )
        )
        out[steps] = (alone.run().final_val_loss, _flat(alone.model))
    return out


def _assert_bit_for_bit(runs: dict[str, Any], branch_losses: dict[int, float]) -> None:
    assert runs["main"][0] == runs["plain"][0]
    assert torch.equal(runs["main"][1], runs["plain"][1])
    assert len(runs["finals"]) == 3
    for steps, final in zip((4, 8, 12), runs["finals"]):
        assert branch_losses[steps] == runs[steps][0], steps
        assert torch.equal(final, runs[steps][1]), steps


# Shampoo and SOAP take the longest: slow; muon drives the same optimizer class.
EVERY_SETUP = pytest.mark.parametrize(
    "optimizer",
    [
        "adamw",
        pytest.param("shampoo", marks=pytest.mark.slow),
        pytest.param("soap", marks=pytest.mark.slow),
        "muon",
        pytest.param("schedule-free", marks=pytest.mark.slow),
    ],
)


@EVERY_SETUP
def test_each_branch_is_the_shorter_run_and_the_main_run_is_unchanged(
    optimizer: str, shards: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    finals = _branch_finals(monkeypatch)
    runs = _branches_against_separate_runs(
        shards, tmp_path, finals, optimizer=optimizer, **SETUPS[optimizer]
    )
    records = read_jsonl(runs["log"].jsonl_log)
    branch_records = [r for r in records if r["kind"] == "branch"]
    _assert_bit_for_bit(runs, {r["steps"]: r["val_loss"] for r in branch_records})

    # Each branch is one record, in fork order, written when it was done.
    tokens_per_step = 4 * 32
    assert [(r["fraction"], r["steps"], r["fork_step"], r["tokens"]) for r in branch_records] == [
        (0.25, 4, 3, 4 * tokens_per_step),
        (0.5, 8, 5, 8 * tokens_per_step),
        (0.75, 12, 7, 12 * tokens_per_step),
    ]
    assert all(set(r) == BRANCH_KEYS for r in branch_records)
    # A branch's time: the main run's up to the fork (its train record there) and its own.
    train_time = {r["step"]: r["train_time_ms"] for r in records if r["kind"] == "train"}
    for record in branch_records:
        assert record["train_time_ms"] > train_time[record["fork_step"]]
    # The main run's records are its own: one train record per step, vals every 4 steps.
    assert sorted(train_time) == list(range(1, STEPS + 1))
    assert [r["step"] for r in records if r["kind"] == "val"] == [0, 4, 8, 12, 16]
    lines = [m for m in map(BRANCH_LINE.match, runs["log"].text_log.read_text().splitlines()) if m]
    assert [(m.group(2), m.group(3)) for m in lines] == [("4", "3"), ("8", "5"), ("12", "7")]
    run = read_run(runs["log"].jsonl_log)
    assert run.final_losses_by_steps() == {
        4: runs[4][0],
        8: runs[8][0],
        12: runs[12][0],
        STEPS: runs["plain"][0],
    }


@pytest.mark.parametrize("forgotten", ["params", "optimizer", "loader"])
def test_a_restore_that_forgets_part_of_the_state_is_caught(
    forgotten: str, shards: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The comparison of the test above would fail if the restore were incomplete.
    restore = branches_module.TrainingSnapshot.restore

    def incomplete(self: Any) -> None:
        keep = {
            "params": [t.detach().clone() for t in self.tensors],
            "optimizer": [dict(vars(c)) for c, _ in self.states],
            "loader": self.loader.state_dict(),
        }[forgotten]
        restore(self)
        if forgotten == "params":
            with torch.no_grad():
                for tensor, value in zip(self.tensors, keep):
                    tensor.copy_(value)
        elif forgotten == "optimizer":
            for (component, _), state in zip(self.states, keep):
                vars(component).clear()
                vars(component).update(state)
        else:
            self.loader.load_state_dict(keep)

    monkeypatch.setattr(branches_module.TrainingSnapshot, "restore", incomplete)
    config = dict(RUN, optimizer="adamw")
    branched = Trainer(
        tiny_config(shards, tmp_path, run_id="main", decay_branches=FRACTIONS, **config)
    )
    branched.run()
    plain = Trainer(tiny_config(shards, tmp_path, run_id="plain", **config))
    plain.run()
    assert not torch.equal(_flat(branched.model), _flat(plain.model))


def test_a_diverged_branch_is_recorded_and_the_main_run_goes_on(
    shards: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    finals = _branch_finals(monkeypatch)
    train_step = Trainer._train_step

    def poisoned(self: Trainer, step: int, schedule_steps: int, *rest: bool) -> torch.Tensor:
        if (
            self.cfg.schedule.decay_branches and schedule_steps == 8 and step == 6
        ):  # the 8-step branch
            with torch.no_grad():
                next(self.model.parameters()).fill_(math.nan)
        return train_step(self, step, schedule_steps, *rest)

    monkeypatch.setattr(Trainer, "_train_step", poisoned)
    runs = _branches_against_separate_runs(shards, tmp_path, finals, optimizer="adamw")
    records = {r["steps"]: r for r in read_jsonl(runs["log"].jsonl_log) if r["kind"] == "branch"}
    assert records[8]["val_loss"] == "nan"
    assert records[8]["diverged"].startswith("at step 6: train loss is nan")
    assert set(records[8]) == BRANCH_KEYS | {"diverged"}
    # The main run, and the other branches, are as if it had not happened.
    assert runs["main"][0] == runs["plain"][0] and torch.equal(runs["main"][1], runs["plain"][1])
    for steps, final in ((4, finals[0]), (12, finals[2])):
        assert records[steps]["val_loss"] == runs[steps][0] and torch.equal(final, runs[steps][1])
    run = read_run(runs["log"].jsonl_log)
    assert run.branches[8].diverged and math.isnan(run.final_losses_by_steps()[8])
    assert "branch:0.5 diverged at step:6/8: train loss is nan" in runs["log"].text_log.read_text()


@pytest.mark.slow
def test_a_resumed_run_keeps_its_branches_and_says_which_it_cannot_make(
    shards: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = dict(RUN, optimizer="adamw", checkpoint_every=4, decay_branches=FRACTIONS)
    full = Trainer(tiny_config(shards, tmp_path, run_id="full", **config)).run()
    recorded = {r["steps"]: r for r in read_jsonl(full.jsonl_log) if r["kind"] == "branch"}
    checkpoint = tmp_path / "full.ckpt" / "step_000004"

    # A new run id from step 4: the 4-step branch forked at step 3 and cannot be made; the
    # others are, with the values of the uninterrupted run.
    other = Trainer(
        tiny_config(shards, tmp_path, run_id="other", resume=str(checkpoint), **config)
    ).run()
    made = {r["steps"]: r for r in read_jsonl(other.jsonl_log) if r["kind"] == "branch"}
    assert sorted(made) == [8, 12]
    assert all(made[n]["val_loss"] == recorded[n]["val_loss"] for n in made)
    note = (
        "branch:0.25 (4 steps) not made: it forks at step 3, before step 4 where this run resumed"
    )
    assert note in capsys.readouterr().out and note in other.text_log.read_text()
    assert set(read_run(other.jsonl_log).branches) == {8, 12}

    # The same run id, resumed from step 4 (as if it had stopped there): its log holds all
    # three branches already, so none is made again and none is said to be missing.
    for later in ("step_000008", "step_000012", "step_000016"):
        shutil.rmtree(tmp_path / "full.ckpt" / later)
    before = read_jsonl(full.jsonl_log)
    Trainer(tiny_config(shards, tmp_path, run_id="full", resume=str(checkpoint), **config)).run()
    after = read_jsonl(full.jsonl_log)
    assert [r for r in after[len(before) :] if r["kind"] == "branch"] == []
    assert note not in full.text_log.read_text()
    assert {n: b.val_loss for n, b in read_run(full.jsonl_log).branches.items()} == {
        n: r["val_loss"] for n, r in recorded.items()
    }


@EVERY_SETUP
def test_a_run_paused_at_each_fork_and_resumed_is_the_uninterrupted_run(
    optimizer: str, shards: dict[str, str], tmp_path: Path
) -> None:
    config = dict(RUN, optimizer=optimizer, decay_branches=FRACTIONS, **SETUPS[optimizer])
    if optimizer == "schedule-free":  # the pauses' checkpoints are round trips: both runs do them
        config["checkpoint_every"] = 1
    plain = Trainer(tiny_config(shards, tmp_path, run_id="plain", **config))
    plain_result = plain.run()

    resume, trainer = "", None
    for pause in (3, 5, 7, 0):  # the forks of the 4-, 8- and 12-step branches, then the end
        trainer = Trainer(
            tiny_config(
                shards, tmp_path, run_id="chain", resume=resume, pause_at_step=pause, **config
            )
        )
        result = trainer.run()
        if pause:
            assert result.paused_at == pause and math.isnan(result.final_val_loss)
            assert result.last_checkpoint == tmp_path / "chain.ckpt" / f"step_{pause:06d}"
            last = read_jsonl(result.jsonl_log)[-1]
            assert last == {
                "kind": "paused",
                "step": pause,
                "total_steps": STEPS,
                "checkpoint": str(result.last_checkpoint),
            }
            with pytest.raises(LogFormatError, match=f"paused at step {pause} of {STEPS}"):
                read_run(result.jsonl_log)
            resume = str(result.last_checkpoint)
    assert trainer is not None and result.paused_at is None
    assert result.final_val_loss == plain_result.final_val_loss
    assert torch.equal(_flat(trainer.model), _flat(plain.model))
    chain, uninterrupted = read_run(result.jsonl_log), read_run(plain_result.jsonl_log)
    assert chain.final_losses_by_steps() == uninterrupted.final_losses_by_steps()
    assert sorted(chain.branches) == [4, 8, 12]
    # Each branch was made once, by the segment that reached its fork.
    made = [r["steps"] for r in read_jsonl(result.jsonl_log) if r["kind"] == "branch"]
    assert made == [4, 8, 12]


@pytest.mark.parametrize(
    ("pause", "resume_step", "message"),
    [
        (
            STEPS,
            0,
            "--pause-at-step 16: must lie after the step the run starts from \\(0\\) "
            "and before --num-iterations \\(16\\)",
        ),
        (3, 4, "--pause-at-step 3: must lie after the step the run starts from \\(4\\)"),
    ],
)
def test_a_pause_outside_the_run_is_refused_naming_the_flag(
    pause: int, resume_step: int, message: str, shards: dict[str, str], tmp_path: Path
) -> None:
    config = dict(RUN, optimizer="adamw")
    resume = ""
    if resume_step:
        Trainer(
            tiny_config(shards, tmp_path, run_id="first", pause_at_step=resume_step, **config)
        ).run()
        resume = str(tmp_path / "first.ckpt" / f"step_{resume_step:06d}")
    with pytest.raises(UserError, match=message):
        Trainer(
            tiny_config(
                shards, tmp_path, run_id="first", resume=resume, pause_at_step=pause, **config
            )
        ).run()


# (run id prefix, parallel mode, setup, its fields) of the 2-rank cases.
TWO_RANK_CASES = (
    ("ddp", "ddp", "shampoo-distadam", SETUPS["shampoo"]),
    ("fsdp2", "fsdp2", "soap", SETUPS["soap"]),
)


def branches_on_rank(
    rank: int, world_size: int, shards: dict[str, str], out_dir: str
) -> dict[str, Any]:
    results = {}
    for name, parallel, optimizer, fields in TWO_RANK_CASES:
        finals: list[torch.Tensor] = []
        restore = branches_module.TrainingSnapshot.restore

        def recording(self: Any, finals: list[torch.Tensor] = finals) -> None:
            finals.append(_flat(self.model))
            restore(self)

        branches_module.TrainingSnapshot.restore = recording  # type: ignore[method-assign]
        try:
            runs = _branches_against_separate_runs(
                shards,
                Path(out_dir) / name,
                finals,
                parallel=parallel,
                optimizer=optimizer,
                **fields,
            )
        finally:
            branches_module.TrainingSnapshot.restore = restore  # type: ignore[method-assign]
        runs.pop("log")
        results[name] = runs
    return results


@pytest.mark.slow
@pytest.mark.distributed
def test_branches_on_two_ranks_are_the_shorter_runs(shards: dict[str, str], tmp_path: Path) -> None:
    rank0, rank1 = run_on_gloo(branches_on_rank, 2, shards, str(tmp_path))
    for name, *_ in TWO_RANK_CASES:
        records = [
            json.loads(line) for line in (tmp_path / name / "main.jsonl").read_text().splitlines()
        ]
        losses = {r["steps"]: r["val_loss"] for r in records if r["kind"] == "branch"}
        for runs in (rank0[name], rank1[name]):
            _assert_bit_for_bit(runs, losses)
        assert torch.equal(rank0[name]["main"][1], rank1[name]["main"][1])
