"""A resume never records a hyper-parameter that did not run: a changed peak lr is applied,
any other changed optimizer setting is refused in one line before the log starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from run_safety_test import flags
from trainer_test import read_jsonl, tiny_config

from nanoshampoo.train.cli import main as cli_main
from nanoshampoo.train.trainer import Trainer


@pytest.fixture
def adamw_checkpoint(shards: dict[str, str], tmp_path: Path) -> Path:
    torch.set_num_threads(1)
    result = Trainer(
        tiny_config(
            shards,
            tmp_path,
            optimizer="adamw",
            run_id="first",
            num_iterations=2,
            val_every=0,
            save_final_checkpoint=True,
        )
    ).run()
    assert result.last_checkpoint is not None
    return result.last_checkpoint


@pytest.mark.parametrize(
    "override, setting",
    [
        ({"adamw.weight_decay": 0.0}, "weight_decay 0.2 -> 0.0"),
        ({"adam.beta2": 0.5}, "betas (0.8, 0.95) -> (0.8, 0.5)"),
        ({"adam.eps": 1e-8}, "eps 1e-10 -> 1e-08"),
    ],
)
def test_a_resume_that_changes_a_setting_is_refused_before_the_log_starts(
    override: dict[str, float],
    setting: str,
    adamw_checkpoint: Path,
    shards: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = flags(
        tiny_config(
            shards, tmp_path, optimizer="adamw", run_id="second", num_iterations=4, val_every=0
        ),
        resume=str(adamw_checkpoint),
        **override,
    )
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and setting in err and "--resume" in err, err
    assert not (tmp_path / "second.jsonl").exists()


def test_a_resume_with_a_changed_weight_decay_in_the_log_runs_it_or_stops(
    adamw_checkpoint: Path, shards: dict[str, str], tmp_path: Path
) -> None:
    """The config the log records and the optimizer's param groups agree after a resume."""
    cfg = tiny_config(
        shards,
        tmp_path,
        optimizer="adamw",
        run_id="second",
        num_iterations=4,
        val_every=0,
        resume=str(adamw_checkpoint),
        **{"adamw.lr": 0.01, "adamw.weight_decay": 0.2},
    )
    trainer = Trainer(cfg)
    (opt,) = trainer.setup.optimizers
    matrix = opt.param_groups[-1]
    assert (matrix["peak_lr"], matrix["weight_decay"]) == (0.01, 0.2)  # the new lr is applied
    trainer.run()
    logged = read_jsonl(tmp_path / "second.jsonl")[0]["config"]
    assert (logged["adamw.lr"], logged["adamw.weight_decay"]) == (
        matrix["peak_lr"],
        matrix["weight_decay"],
    )
