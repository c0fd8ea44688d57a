"""An exception in a user's optimizer's ``step()`` is one line (the optimizer, the step, the
exception's last line), and every run that stops on an exception closes its logs as failed."""

from __future__ import annotations

from pathlib import Path

import pytest
from run_safety_test import flags
from trainer_test import read_jsonl, tiny_config

from nanoshampoo.evidence.logs import LogFormatError, read_run
from nanoshampoo.train.cli import main as cli_main
from nanoshampoo.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

# SGD that raises in its second step.
FAILING = """import torch


class FailsAtStep2(torch.optim.SGD):
    def __init__(self, params, lr=0.01):
        super().__init__(params, lr=lr)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        if self.calls == 2:
            raise ValueError(MESSAGE)
        return super().step(closure)
"""


@pytest.mark.parametrize(
    "message, shown",
    [
        ("preconditioner init failed", "ValueError: preconditioner init failed"),
        (
            "Traceback of the library:\n  in kron()\nall-zero gradient",
            "ValueError: all-zero gradient",
        ),
    ],
)
def test_an_exception_in_a_users_optimizer_is_one_line_and_the_log_says_failed(
    shards: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    message: str,
    shown: str,
) -> None:
    source = tmp_path / "failing.py"
    source.write_text(FAILING.replace("MESSAGE", repr(message)))
    cfg = tiny_config(
        shards,
        tmp_path,
        num_iterations=4,
        val_every=0,
        **{"optimizer": "custom", "custom.matrix_optimizer": f"{source}:FailsAtStep2"},
    )
    assert cli_main(flags(cfg)) == 2
    reason = f"optimizer FailsAtStep2 ({source}) raised in step 2: {shown}"
    assert capsys.readouterr().err == f"python -m nanoshampoo.train: error: {reason}\n"
    last = read_jsonl(tmp_path / "run.jsonl")[-1]
    assert last == {
        "kind": "failed",
        "step": 1,
        "total_steps": 4,
        "reason": reason,
        "train_time_ms": last["train_time_ms"],
    }
    assert last["train_time_ms"] > 0
    text = (tmp_path / "run.txt").read_text().splitlines()
    assert text[-1] == f"failed after step:1/4: {reason}"
    for log in ("run.jsonl", "run.txt"):  # stats and compare refuse it, saying it failed
        with pytest.raises(LogFormatError) as refused:
            read_run(tmp_path / log)
        assert str(refused.value) == f"{tmp_path / log}: the run failed after step 1 of 4: {reason}"


def test_an_exception_in_the_projects_own_optimizer_keeps_its_traceback_and_the_log_says_failed(
    shards: dict[str, str], tmp_path: Path
) -> None:
    trainer = Trainer(
        tiny_config(shards, tmp_path, num_iterations=4, val_every=0, optimizer="adamw")
    )
    opt = trainer.setup.optimizers[0]
    assert type(opt).__module__.startswith("torch.optim")
    step, calls = opt.step, []

    def bug(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a bug in the project")
        return step(*args, **kwargs)

    opt.step = bug  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="^a bug in the project$"):
        trainer.run()
    last = read_jsonl(tmp_path / "run.jsonl")[-1]
    assert (last["kind"], last["step"], last["reason"]) == (
        "failed",
        1,
        "RuntimeError: a bug in the project",
    )
