"""The ``lion`` setup: the block matrices' steps are Lion's (Chen et al. 2023, Algorithm 2),
against a float64 loop of its equations, in a trainer step and over several steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_test import tiny_config

from nanoshampoo.model.gpt import GPT, gpt_preset
from nanoshampoo.train.config import TrainConfig
from nanoshampoo.train.optimizers import build_optimizer_setup
from nanoshampoo.train.schedule import lr_multiplier, remember_peak_lrs
from nanoshampoo.train.trainer import Trainer

HP = {"lion.lr": 0.001, "lion.beta1": 0.9, "lion.beta2": 0.99, "lion.weight_decay": 0.6}


pytestmark = pytest.mark.usefixtures("one_thread")


def lion_float64(
    w0: torch.Tensor, grads: list[torch.Tensor], multipliers: list[float] | None = None
) -> torch.Tensor:
    """The parameter after Lion's steps: ``c = b1 m + (1 - b1) g``, ``W <- W - lr (sign(c) +
    wd W)``, ``m <- b2 m + (1 - b2) g``; in float64 (``lr``: the peak times the multiplier)."""
    peak, b1, b2, wd = (HP[f"lion.{k}"] for k in ("lr", "beta1", "beta2", "weight_decay"))
    w = w0.double()
    m = torch.zeros_like(w)
    for g, multiplier in zip(grads, multipliers or [1.0] * len(grads)):
        lr = peak * multiplier
        g = g.double()
        c = b1 * m + (1 - b1) * g
        w = w - lr * (torch.sign(c) + wd * w)
        m = b2 * m + (1 - b2) * g
    return w


def test_trainer_steps_move_the_matrices_by_lions_steps(
    shards: dict[str, str], tmp_path: Path
) -> None:
    # Three steps: the zero-initialized head gives the blocks no gradient at the first, the
    # zero-initialized output projections none to the layers before them at the second.
    cfg = tiny_config(shards, tmp_path, optimizer="lion", num_iterations=3, val_every=0, **HP)
    trainer = Trainer(cfg)
    matrices = trainer.setup.groups["matrix"]
    before = [p.detach().clone() for p in matrices]
    optimizer = trainer.setup.optimizers[1]
    seen: list[list[torch.Tensor]] = []
    step = optimizer.step

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        seen.append([p.grad.detach().clone() for p in matrices])
        return step(*args, **kwargs)

    optimizer.step = recording_step  # type: ignore[method-assign]
    trainer.run()
    multipliers = [lr_multiplier(t, 3, cfg.schedule.cooldown_frac) for t in range(3)]
    assert len(seen) == 3
    for i, (p, w0) in enumerate(zip(matrices, before)):
        grads = [g[i] for g in seen]
        assert grads[-1].abs().max() > 0  # the sign of a real gradient was taken
        torch.testing.assert_close(
            p.detach().double(), lion_float64(w0, grads, multipliers), rtol=0, atol=1e-7
        )


def test_three_steps_are_lions_with_its_momentum() -> None:
    torch.manual_seed(0)
    model = GPT(gpt_preset("tiny", vocab_size=64))
    setup = build_optimizer_setup(model, TrainConfig(optimizer="lion", **HP), 1)
    remember_peak_lrs(setup.optimizers)
    matrices = setup.groups["matrix"]
    start = [p.detach().clone() for p in matrices]
    generator = torch.Generator().manual_seed(1)
    grads: list[list[torch.Tensor]] = []
    for _ in range(3):
        # A shared offset keeps the signs of c away from zero, where float32 may round.
        grads.append([torch.randn(p.shape, generator=generator) + 0.05 for p in matrices])
        for p, g in zip(matrices, grads[-1]):
            p.grad = g.clone()
        setup.optimizers[1].step()
    for i, (p, w0) in enumerate(zip(matrices, start)):
        torch.testing.assert_close(
            p.detach().double(), lion_float64(w0, [g[i] for g in grads]), rtol=0, atol=1e-7
        )


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("beta1", 1.0, r"lion\.beta1 \(--lion\.beta1\) must be in \[0.0, 1.0\)"),
        ("beta2", -0.1, r"lion\.beta2 .* must be in \[0.0, 1.0\)"),
        ("lr", float("inf"), r"lion\.lr .* must be finite and >= 0"),
        ("weight_decay", -1.0, r"lion\.weight_decay .* must be finite and >= 0"),
    ],
)
def test_bad_lion_values_are_refused_naming_the_field(
    field: str, value: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(optimizer="lion", **{f"lion.{field}": value})
