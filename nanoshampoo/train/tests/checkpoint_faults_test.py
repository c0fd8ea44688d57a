"""Checkpoints that cannot be written are one line and leave nothing half-written: a user's
optimizer whose state would not load back (refused at the first checkpoint, naming the
optimizer and the key), and a full disk (naming the file and the last good checkpoint)."""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from run_safety_test import flags
from trainer_test import read_jsonl, tiny_config

from nanoshampoo.train import checkpoint
from nanoshampoo.train.checkpoint import check_state_loadable, read_checkpoint
from nanoshampoo.train.cli import main as cli_main
from nanoshampoo.train.config import UserError

pytestmark = pytest.mark.usefixtures("one_thread")

# SGD with something in its state that torch.load(weights_only=True) cannot give back.
STATE_OPTIMIZERS = """import torch


class Thing:
    pass


class LambdaState(torch.optim.SGD):
    def step(self, closure=None):
        super().step(closure)
        for p in self.param_groups[0]["params"]:
            self.state[p]["scale"] = lambda x: 2 * x


class ObjectState(torch.optim.SGD):
    def step(self, closure=None):
        super().step(closure)
        for p in self.param_groups[0]["params"]:
            self.state[p]["thing"] = Thing()
"""


def _custom_run(tmp_path: Path, shards: dict[str, str], cls: str, **overrides: Any) -> list[str]:
    (tmp_path / "state_optimizers.py").write_text(STATE_OPTIMIZERS)
    cfg = tiny_config(
        shards,
        tmp_path,
        num_iterations=4,
        val_every=0,
        checkpoint_every=2,
        **{
            "optimizer": "custom",
            "custom.matrix_optimizer": f"{tmp_path / 'state_optimizers.py'}:{cls}",
            **overrides,
        },
    )
    return [*flags(cfg), "--custom.matrix-kwargs", '{"lr": 0.01}']


@pytest.mark.parametrize(
    "cls, key, holds, why",
    [
        (
            "LambdaState",
            "state[0]['scale']",
            "function",
            "it cannot be saved: AttributeError: Can't pickle local object "
            "'LambdaState.step.<locals>.<lambda>'",
        ),
        ("ObjectState", "state[0]['thing']", "Thing", "torch.load(weights_only=True) refuses it"),
    ],
)
def test_an_optimizer_state_a_resume_could_not_load_is_refused_at_the_first_checkpoint(
    shards: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    cls: str,
    key: str,
    holds: str,
    why: str,
) -> None:
    assert cli_main(_custom_run(tmp_path, shards, cls)) == 2
    err = capsys.readouterr().err
    assert err == (
        f"python -m nanoshampoo.train: error: optimizer {cls} "
        f"({tmp_path / 'state_optimizers.py'}): its state {key} holds a {holds}, which a "
        f"checkpoint cannot hold ({why}); keep tensors, numbers, strings and lists, tuples "
        "and dicts of them\n"
    )
    assert not (tmp_path / "run.ckpt").exists()  # neither step_000002 nor a .partial
    last = read_jsonl(tmp_path / "run.jsonl")[-1]
    assert (last["kind"], last["step"]) == ("failed", 2)
    assert last["reason"] == err.split("error: ", 1)[1].strip()


def test_a_state_of_tensors_numbers_and_strings_passes_the_check() -> None:
    w = torch.nn.Parameter(torch.ones(3, 2))
    opt = torch.optim.Adam([w], lr=0.1)
    w.grad = torch.ones_like(w)
    opt.step()
    opt.state[w]["note"] = ("text", 3, 2.5, [torch.zeros(1)], {"k": None})
    check_state_loadable([opt])


class Key:
    """A state key of the user's own class (torch.load(weights_only=True) refuses it)."""


def test_the_whole_state_is_named_when_no_single_value_fails() -> None:
    """A key that does not load, under values that do: no value can be named, the dict is."""
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    opt.state[w][Key()] = 1
    with pytest.raises(UserError) as raised:
        check_state_loadable([opt])
    assert str(raised.value) == (
        "optimizer torch.optim.sgd.SGD: its state dict does not load back under "
        "torch.load(weights_only=True) (torch.load(weights_only=True) refuses it)"
    )


def _dev_full_path(record: dict[str, Any], path: Path) -> None:
    torch.save(record, "/dev/full")  # torch's own writer: RuntimeError [enforce fail ...]


def _dev_full_file(record: dict[str, Any], path: Path) -> None:
    with open("/dev/full", "wb") as f:  # a Python file: OSError ENOSPC
        torch.save(record, f)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize(
    "full_disk, why",
    [
        (_dev_full_file, r"No space left on device"),
        (
            _dev_full_path,
            r"RuntimeError: \[enforce fail at inline_container\.cc:\d+\] \. unexpected pos "
            r"\d+ vs \d+; [\d,]+ bytes free on its disk",
        ),
    ],
)
def test_a_full_disk_is_one_line_naming_the_last_good_checkpoint(
    shards: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    full_disk: Any,
    why: str,
) -> None:
    """The step-2 checkpoint is written; the disk is full when step 4's is (a write into
    /dev/full, which fails as a full disk does)."""
    writes: list[Path] = []
    write = checkpoint._write_record

    def fills_up(record: dict[str, Any], path: Path) -> None:
        writes.append(path)
        (write if len(writes) == 1 else full_disk)(record, path)

    monkeypatch.setattr(checkpoint, "_write_record", fills_up)
    argv = flags(tiny_config(shards, tmp_path, num_iterations=4, val_every=0, checkpoint_every=2))
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    ckpt = tmp_path / "run.ckpt"
    assert len(err.splitlines()) == 1
    assert re.fullmatch(
        rf"python -m nanoshampoo\.train: error: checkpoint {re.escape(str(ckpt))}/step_000004: "
        rf"could not write rank0\.pt \({why}\); step_000004\.partial removed; the last good "
        rf"checkpoint is {re.escape(str(ckpt))}/step_000002\n",
        err,
    ), err
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000002"]
    assert read_checkpoint(ckpt / "step_000002", 0, 1).step == 2
    last = read_jsonl(tmp_path / "run.jsonl")[-1]
    assert (last["kind"], last["step"]) == ("failed", 4)
    assert json.dumps(last["reason"]).count("step_000002") == 1


def test_a_full_disk_under_the_log_is_one_line_naming_the_last_good_checkpoint(
    shards: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The disk fills up after the step-2 checkpoint: the log's next line cannot be written."""
    from nanoshampoo.train.run_log import RunLog

    line = RunLog._line

    def fills_up(self: RunLog, text: str) -> None:
        if (tmp_path / "run.ckpt" / "step_000002").is_dir():
            raise OSError(errno.ENOSPC, "No space left on device", str(self.text_path))
        line(self, text)

    monkeypatch.setattr(RunLog, "_line", fills_up)
    argv = flags(tiny_config(shards, tmp_path, num_iterations=4, val_every=0, checkpoint_every=2))
    assert cli_main(argv) == 2
    assert capsys.readouterr().err == (
        f"python -m nanoshampoo.train: error: could not write {tmp_path / 'run.txt'} (No space "
        f"left on device); the last good checkpoint is {tmp_path / 'run.ckpt' / 'step_000002'}\n"
    )


def test_a_checkpoint_holding_an_object_is_named_as_such_on_resume_not_as_damaged(
    tmp_path: Path,
) -> None:
    """A whole file written before the check existed: resume names the refused class."""
    step = tmp_path / "run.ckpt" / "step_000002"
    step.mkdir(parents=True)
    torch.save({"step": 2, "optimizers": [{"state": {0: {"k": Key()}}}]}, step / "rank0.pt")
    with pytest.raises(UserError) as refused:
        read_checkpoint(step, 0, 1)
    assert str(refused.value) == (
        f"--resume: {step / 'rank0.pt'} holds an object of class checkpoint_faults_test.Key, "
        "which torch.load(weights_only=True) does not load (an optimizer kept it in its "
        "state); the file is whole, but no resume can read it"
    )


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_disk_in_a_run_resumed_under_a_new_id_names_the_checkpoint_it_resumed_from(
    shards: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Run "run" writes steps 2 and 4; "again" resumes from step 2 under its own id and cannot
    write its step-4 checkpoint: it has none of its own, so the last good one is the one it
    resumed from."""
    first = tiny_config(shards, tmp_path, num_iterations=4, val_every=0, checkpoint_every=2)
    assert cli_main(flags(first)) == 0
    capsys.readouterr()
    resumed_from = tmp_path / "run.ckpt" / "step_000002"
    monkeypatch.setattr(checkpoint, "_write_record", _dev_full_file)
    again = tiny_config(
        shards,
        tmp_path,
        num_iterations=4,
        val_every=0,
        checkpoint_every=2,
        run_id="again",
        resume=str(resumed_from),
    )
    assert cli_main(flags(again)) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert err.endswith(f"the last good checkpoint is {resumed_from}\n"), err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_disk_under_the_final_log_record_is_one_line(
    shards: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run ends and writes its step-4 checkpoint; its final record goes to a full disk
    (the JSONL log on /dev/full): one line naming the file and the last good checkpoint."""
    from nanoshampoo.train.run_log import RunLog

    final = RunLog.final

    def onto_a_full_disk(self: RunLog, *args: Any, **kwargs: Any) -> None:
        self.jsonl_path = Path("/dev/full")
        final(self, *args, **kwargs)

    monkeypatch.setattr(RunLog, "final", onto_a_full_disk)
    argv = flags(tiny_config(shards, tmp_path, num_iterations=4, val_every=0, checkpoint_every=2))
    assert cli_main(argv) == 2
    assert capsys.readouterr().err == (
        "python -m nanoshampoo.train: error: could not write /dev/full (No space left on "
        f"device); the last good checkpoint is {tmp_path / 'run.ckpt' / 'step_000004'}\n"
    )
