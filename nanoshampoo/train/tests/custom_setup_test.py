"""The ``custom`` setup: a user's optimizer class by import path, from presets or flags, with
DDP, checkpoints and resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_test import flat_params, read_jsonl, tiny_config

from nanoshampoo.testing.distributed import run_on_gloo
from nanoshampoo.train.cli import main as cli_main
from nanoshampoo.train.config import TrainConfig, UserError
from nanoshampoo.train.trainer import Trainer

SGD = {
    "optimizer": "custom",
    "custom.matrix_optimizer": "torch.optim:SGD",
    "custom.matrix_kwargs": {"lr": 0.05, "momentum": 0.9},
}
SIGN_SGD = """import torch


class SignSGD(torch.optim.Optimizer):
    def __init__(self, params, lr=0.01):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])
"""


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"optimizer": "custom"},
            r"custom\.matrix_optimizer \(--custom\.matrix-optimizer\) is "
            "required",
        ),
        ({"custom.matrix_optimizer": "torch.optim.SGD"}, "must be 'package.module:Class'"),
        ({"custom.matrix_optimizer": "no_such_module:Opt"}, "cannot import 'no_such_module'"),
        ({"custom.matrix_optimizer": "torch.optim:Linear"}, "no torch.optim.Optimizer subclass"),
        ({"custom.matrix_optimizer": "torch.nn:Linear"}, "no torch.optim.Optimizer subclass"),
        ({"custom.matrix_optimizer": "missing.py:Opt"}, "cannot import 'missing.py'"),
        ({"custom.rest_kwargs": {"lr": 1.0}}, r"needs custom\.rest_optimizer"),
        ({"custom.matrix_kwargs": "lr=1"}, "must be a table"),
    ],
)
def test_bad_custom_configs_are_refused_naming_the_field(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**fields)


def test_arguments_the_class_refuses_are_one_line_at_build_time(
    shards: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--optimizer",
        "custom",
        "--custom.matrix-optimizer",
        "torch.optim:SGD",
        "--custom.matrix-kwargs",
        '{"lr": 0.1, "nesterov_momentum": 3}',
        "--dataset",
        "shards",
        "--vocab-size",
        "64",
        "--train-files",
        shards["train_files"],
        "--val-files",
        shards["val_files"],
        "--out-dir",
        str(tmp_path),
        "--threads",
        "1",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--val-tokens",
        "512",
    ]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "custom.matrix_optimizer" in err
    assert "nesterov_momentum" in err
    assert not list(tmp_path.glob("*.jsonl"))  # refused before the log was started


def test_a_file_outside_the_package_trains_every_group_from_flags(
    shards: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "sign_sgd.py").write_text(SIGN_SGD)
    spec = f"{tmp_path / 'sign_sgd.py'}:SignSGD"
    cfg = tiny_config(
        shards,
        tmp_path,
        num_iterations=2,
        val_every=0,
        **{
            "optimizer": "custom",
            "custom.matrix_optimizer": spec,
            "custom.matrix_kwargs": {"lr": 0.01},
            "custom.rest_optimizer": spec,
        },
    )
    trainer = Trainer(cfg)
    assert [type(o).__name__ for o in trainer.setup.optimizers] == ["SignSGD", "SignSGD"]
    rest, matrix = trainer.setup.optimizers
    # The rest optimizer's groups carry the [adam] lrs: embed, head, scalar.
    assert [g["lr"] for g in rest.param_groups] == [0.3, 1 / 320, 0.01]
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.run()
    moved = {
        name
        for (name, p), old in zip(trainer.model.named_parameters(), before)
        if not torch.equal(p.detach(), old)
    }
    # Both optimizers stepped (the blocks' output projections start at zero, so in two steps
    # only they, of the block matrices, get a gradient).
    assert {"embed.weight", "lm_head.weight", "final_norm.weight"} <= moved
    assert {f"blocks.{i}.attn.proj.weight" for i in range(4)} <= moved


@pytest.mark.slow
def test_resume_of_a_custom_run_repeats_the_uninterrupted_losses(
    shards: dict[str, str], tmp_path: Path
) -> None:
    full = Trainer(tiny_config(shards, tmp_path, run_id="full", checkpoint_every=4, **SGD)).run()
    resumed = Trainer(
        tiny_config(
            shards,
            tmp_path,
            run_id="resumed",
            **SGD,
            resume=str(tmp_path / "full.ckpt" / "step_000004"),
        )
    ).run()
    losses = {
        (r["kind"], r["step"]): r.get("train_loss", r.get("val_loss"))
        for r in read_jsonl(full.jsonl_log)
        if r["kind"] in ("train", "val")
    }
    after = {
        (r["kind"], r["step"]): r.get("train_loss", r.get("val_loss"))
        for r in read_jsonl(resumed.jsonl_log)
        if r["kind"] in ("train", "val")
    }
    assert sorted(after) == [("train", s) for s in range(5, 9)] + [("val", 4), ("val", 8)]
    assert after == {key: losses[key] for key in after}
    config = read_jsonl(full.jsonl_log)[0]["config"]
    assert json.loads(json.dumps(config))["custom.matrix_kwargs"] == {"lr": 0.05, "momentum": 0.9}


def train_custom_on_rank(
    rank: int, world_size: int, shards: dict[str, str], out_dir: str
) -> dict[str, torch.Tensor]:
    trainer = Trainer(
        tiny_config(
            shards, Path(out_dir), run_id="custom-ddp", num_iterations=3, val_every=0, **SGD
        )
    )
    trainer.run()
    return {"params": flat_params(trainer)}


@pytest.mark.slow
@pytest.mark.distributed
def test_a_custom_optimizer_on_two_ranks_matches_one_process(
    shards: dict[str, str], tmp_path: Path
) -> None:
    rank0, rank1 = run_on_gloo(train_custom_on_rank, 2, shards, str(tmp_path / "ddp"))
    torch.testing.assert_close(rank0["params"], rank1["params"], rtol=0, atol=0)
    single = Trainer(
        tiny_config(
            shards, tmp_path / "single", run_id="custom-1", num_iterations=3, val_every=0, **SGD
        )
    )
    single.run()
    # The gradients were averaged across ranks: the 2-rank run took the 1-process steps (SGD
    # with momentum is linear in the gradient, so only rounding separates them; the AdamW
    # embedding amplifies rounding of near-zero entries, hence 2e-4 as in trainer_test).
    torch.testing.assert_close(rank0["params"], flat_params(single), rtol=0, atol=2e-4)


def test_a_resume_of_another_setup_is_refused(shards: dict[str, str], tmp_path: Path) -> None:
    Trainer(
        tiny_config(
            shards,
            tmp_path,
            optimizer="shampoo",
            num_iterations=1,
            val_every=0,
            save_final_checkpoint=True,
        )
    ).run()
    with pytest.raises(UserError, match="optimizer"):
        Trainer(
            tiny_config(
                shards,
                tmp_path,
                run_id="other",
                **SGD,
                resume=str(tmp_path / "run.ckpt" / "step_000001"),
            )
        )


def test_a_diverging_custom_optimizer_stops_the_run(shards: dict[str, str], tmp_path: Path) -> None:
    from nanoshampoo.train.trainer import TrainingDiverged

    cfg = tiny_config(
        shards,
        tmp_path,
        num_iterations=6,
        val_every=0,
        **{**SGD, "custom.matrix_kwargs": {"lr": float("inf")}},
    )  # a user's class may take it
    with pytest.raises(TrainingDiverged, match="non-finite|train loss is"):
        Trainer(cfg).run()
    assert read_jsonl(tmp_path / "run.jsonl")[-1]["kind"] == "diverged"


# An SGD that raises in its second step on rank 1 only (as an optimizer whose state differs by
# rank may); rank 0 would go on into the next step's gradient all-reduce and wait there.
RAISES_ON_RANK_ONE = """import torch
import torch.distributed as dist


class OneRankFails(torch.optim.SGD):
    def step(self, closure=None):
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == 2 and dist.get_rank() == 1:
            raise ValueError("the preconditioner is singular")
        return super().step(closure)
"""


def fail_on_one_rank(rank: int, world_size: int, shards: dict[str, str], out_dir: str) -> str:
    optimizer_file = Path(out_dir) / "one_rank_fails.py"
    config = tiny_config(
        shards,
        Path(out_dir),
        run_id="one-rank-fails",
        num_iterations=4,
        val_every=0,
        **{
            "optimizer": "custom",
            "custom.matrix_optimizer": f"{optimizer_file}:OneRankFails",
            "custom.matrix_kwargs": {"lr": 0.05},
        },
    )
    try:
        Trainer(config).run()
    except UserError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
@pytest.mark.distributed
def test_an_optimizer_raising_on_one_rank_stops_every_rank_with_its_line(
    shards: dict[str, str], tmp_path: Path
) -> None:
    """Both ranks stop at once with rank 1's one line (not rank 0 at the distributed timeout:
    pytest's own timeout would end the test first)."""
    (tmp_path / "one_rank_fails.py").write_text(RAISES_ON_RANK_ONE)
    rank0, rank1 = run_on_gloo(fail_on_one_rank, 2, shards, str(tmp_path))
    assert rank1 == (
        f"optimizer OneRankFails ({tmp_path / 'one_rank_fails.py'}) raised in step 2: "
        "ValueError: the preconditioner is singular"
    )
    assert rank0 == rank1
    records = read_jsonl(tmp_path / "one-rank-fails.jsonl")
    assert records[-1]["kind"] == "failed"
