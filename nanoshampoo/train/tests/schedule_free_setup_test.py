"""The ``schedule-free`` setup: Schedule-Free AdamW's step against a float64 loop of its
equations; validation and checkpoints at the averaged iterate; resume exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_test import flat_params, read_jsonl, tiny_config

from nanoshampoo.data.loader import validation_batches
from nanoshampoo.model.gpt import GPT, gpt_preset
from nanoshampoo.train.checkpoint import read_checkpoint
from nanoshampoo.train.config import TrainConfig
from nanoshampoo.train.optimizers import build_optimizer_setup
from nanoshampoo.train.schedule import apply_lr_multiplier, remember_peak_lrs
from nanoshampoo.train.trainer import Trainer

HP = {
    "schedule_free.lr": 0.01,
    "schedule_free.beta1": 0.9,
    "schedule_free.beta2": 0.95,
    "schedule_free.epsilon": 1e-8,
    "schedule_free.weight_decay": 0.2,
}


pytestmark = pytest.mark.usefixtures("one_thread")


def schedule_free_float64(
    w0: torch.Tensor, grads: list[torch.Tensor], lrs: list[float], lr_power: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, x)`` after Schedule-Free AdamW's steps in float64, in the library's documented
    form (step 8 of ``distributed_shampoo``): the decay shrinks ``z``, ``y`` moves from the
    shrunk ``z``, and ``x = (y - (1 - mu_y) z) / mu_y``."""
    b1, b2, eps, wd = (
        HP[f"schedule_free.{k}"] for k in ("beta1", "beta2", "epsilon", "weight_decay")
    )
    y = z = w0.double()
    v = torch.zeros_like(z)
    weights = 0.0
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        g = g.double()  # the gradient at y
        v = b2 * v + (1 - b2) * g * g
        step = g / ((v / (1 - b2**t)).sqrt() + eps)
        weights += lr**lr_power
        mu_x = 1 - lr**lr_power / weights
        z = (1 - lr * wd) * z
        y = y + (1 - mu_x) * (z - y) - (1 - mu_x * b1) * lr * step
        z = z - lr * step
    return y, (y - (1 - b1) * z) / b1


def test_the_matrix_step_is_schedule_free_adamw() -> None:
    torch.manual_seed(0)
    model = GPT(gpt_preset("tiny", vocab_size=64))
    setup = build_optimizer_setup(model, TrainConfig(optimizer="schedule-free", **HP), 1)
    remember_peak_lrs(setup.optimizers)
    matrices = setup.groups["matrix"]
    start = [p.detach().clone() for p in matrices]
    generator = torch.Generator().manual_seed(1)
    multipliers = [1.0, 0.5, 0.25]  # a cooldown: the average weights the steps by lr^2
    grads: list[list[torch.Tensor]] = []
    for multiplier in multipliers:
        grads.append([torch.randn(p.shape, generator=generator) for p in matrices])
        for p, g in zip(matrices, grads[-1]):
            p.grad = g.clone()
        apply_lr_multiplier(setup.optimizers, multiplier)
        setup.optimizers[1].step()
    lrs = [HP["schedule_free.lr"] * m for m in multipliers]
    want = [schedule_free_float64(w0, [g[i] for g in grads], lrs) for i, w0 in enumerate(start)]
    for p, (y, _) in zip(matrices, want):
        torch.testing.assert_close(p.detach().double(), y, rtol=1e-5, atol=1e-6)
    with setup.evaluation_point():
        for p, (_, x) in zip(matrices, want):
            torch.testing.assert_close(p.detach().double(), x, rtol=1e-5, atol=1e-6)
    for p, (y, _) in zip(matrices, want):  # back at the training point
        torch.testing.assert_close(p.detach().double(), y, rtol=1e-5, atol=1e-6)


@torch.no_grad()
def validation_loss_by_hand(model: GPT, cfg: TrainConfig) -> float:
    """The mean loss over the validation batches, as the trainer defines it (float32)."""
    model.eval()
    losses = [
        model(x, y).float()
        for x, y in validation_batches(
            cfg.data.val_files, cfg.data.batch_size, cfg.data.seq_len, 0, 1, cfg.data.val_tokens
        )
    ]
    model.train()
    return float(torch.stack(losses).sum() / len(losses))


def test_validation_and_checkpoints_are_at_the_averaged_iterate(
    shards: dict[str, str], tmp_path: Path
) -> None:
    cfg = tiny_config(
        shards,
        tmp_path,
        optimizer="schedule-free",
        num_iterations=6,
        val_every=3,
        save_final_checkpoint=True,
        **HP,
    )
    trainer = Trainer(cfg)
    result = trainer.run()
    at_training_point = validation_loss_by_hand(trainer.model, cfg)  # the run ends at y
    y = {name: value.clone() for name, value in trainer.model.state_dict().items()}
    trainer.setup.optimizers[1].eval()
    at_average = validation_loss_by_hand(trainer.model, cfg)
    assert result.final_val_loss == pytest.approx(at_average, rel=0, abs=1e-6)
    assert abs(at_training_point - at_average) > 1e-4  # the two points are told apart
    saved = read_checkpoint(tmp_path / "run.ckpt" / "step_000006", 0, 1).shared["model"]
    # x by hand went through the run's two train()/eval() round trips since: rounding apart.
    for name, x in trainer.model.state_dict().items():
        torch.testing.assert_close(saved[name], x, rtol=0, atol=1e-6)
    matrix = "blocks.0.attn.qkv.weight"
    assert (saved[matrix] - y[matrix]).abs().max() > 1e-3


@pytest.mark.slow
def test_resume_from_checkpoint_repeats_the_uninterrupted_run(
    shards: dict[str, str], tmp_path: Path
) -> None:
    # Checkpoint and validation fall on the same step (4): the resumed run validates there
    # again, from the training point the checkpoint gives back.
    full = Trainer(
        tiny_config(
            shards,
            tmp_path,
            optimizer="schedule-free",
            run_id="full",
            checkpoint_every=4,
            autocast="bf16",
            **HP,
        )
    )
    full_result = full.run()
    resumed = Trainer(
        tiny_config(
            shards,
            tmp_path,
            optimizer="schedule-free",
            run_id="resumed",
            autocast="bf16",
            resume=str(tmp_path / "full.ckpt" / "step_000004"),
            **HP,
        )
    )
    resumed_result = resumed.run()

    def losses(path: Path) -> dict[tuple[str, int], float]:
        return {
            (r["kind"], r["step"]): r.get("train_loss", r.get("val_loss"))
            for r in read_jsonl(path)
            if r["kind"] in ("train", "val")
        }

    before, after = losses(full_result.jsonl_log), losses(resumed_result.jsonl_log)
    assert sorted(after) == [("train", s) for s in range(5, 9)] + [("val", 4), ("val", 8)]
    assert after == {key: before[key] for key in after}
    # The losses are bit-for-bit; the block matrices end within float32 rounding (a few 1e-10
    # apart, against bit-for-bit for shampoo, lion and adamw).
    torch.testing.assert_close(flat_params(resumed), flat_params(full), rtol=0, atol=1e-8)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("beta1", 0.0, r"schedule_free\.beta1 \(--schedule_free\.beta1\) must be in \(0, 1\]"),
        ("beta2", 1.0, r"schedule_free\.beta2 .* must be in \[0.0, 1.0\)"),
        ("epsilon", 0.0, r"schedule_free\.epsilon .* must be finite and > 0"),
        ("lr", -1.0, r"schedule_free\.lr .* must be finite and >= 0"),
        ("eval_coeff_lr_power", -1, r"schedule_free\.eval_coeff_lr_power .* must be an int >= 0"),
    ],
)
def test_bad_schedule_free_values_are_refused_naming_the_field(
    field: str, value: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(optimizer="schedule-free", **{f"schedule_free.{field}": value})
