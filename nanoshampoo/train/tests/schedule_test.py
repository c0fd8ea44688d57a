"""The learning-rate schedule: constant, then linear cooldown to zero."""

from __future__ import annotations

import pytest
import torch

from nanoshampoo.train.schedule import apply_lr_multiplier, lr_multiplier, remember_peak_lrs


def reference_multiplier(step: int, total: int, cooldown_frac: float) -> float:
    cooldown_start = total - cooldown_frac * total  # first step of the cooldown (real-valued)
    if step < cooldown_start:
        return 1.0
    return (total - step) / (total - cooldown_start)


@pytest.mark.parametrize("total, cooldown_frac", [(100, 0.7), (10, 0.5), (7, 1.0), (1000, 0.25)])
def test_multiplier_matches_reference_at_every_step(total: int, cooldown_frac: float) -> None:
    for step in range(total + 1):
        assert lr_multiplier(step, total, cooldown_frac) == pytest.approx(
            reference_multiplier(step, total, cooldown_frac), abs=1e-12
        )


def test_known_values() -> None:
    assert lr_multiplier(0, 100, 0.7) == 1.0
    assert lr_multiplier(29, 100, 0.7) == 1.0
    assert lr_multiplier(30, 100, 0.7) == pytest.approx(1.0)
    assert lr_multiplier(65, 100, 0.7) == pytest.approx(0.5)
    assert lr_multiplier(100, 100, 0.7) == 0.0
    assert [lr_multiplier(s, 4, 0.0) for s in range(5)] == [1.0] * 5


@pytest.mark.parametrize(
    "total, cooldown_frac, warmup", [(100, 0.7, 10), (10, 0.5, 8), (20, 0.25, 1)]
)
def test_warmup_caps_the_schedule_linearly(total: int, cooldown_frac: float, warmup: int) -> None:
    for step in range(total + 1):
        expected = min(reference_multiplier(step, total, cooldown_frac), (step + 1) / warmup)
        assert lr_multiplier(step, total, cooldown_frac, warmup) == pytest.approx(
            expected, abs=1e-12
        )
    assert lr_multiplier(0, 100, 0.7, 10) == pytest.approx(0.1)
    assert lr_multiplier(9, 100, 0.7, 10) == 1.0


def test_warmup_lr_reaches_the_optimizer() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.4)
    remember_peak_lrs([opt])
    apply_lr_multiplier([opt], lr_multiplier(1, 50, 0.5, warmup_steps=4))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)


def test_negative_warmup_raises() -> None:
    with pytest.raises(ValueError, match="warmup_steps"):
        lr_multiplier(0, 10, 0.5, warmup_steps=-1)


def test_out_of_range_step_raises() -> None:
    with pytest.raises(ValueError, match="step"):
        lr_multiplier(11, 10, 0.5)
    with pytest.raises(ValueError, match="total_steps"):
        lr_multiplier(0, 0, 0.5)


def test_multiplier_scales_each_group_from_its_own_peak() -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([dict(params=[a], lr=0.3), dict(params=[b], lr=0.01)])
    remember_peak_lrs([opt])
    apply_lr_multiplier([opt], 0.5)
    apply_lr_multiplier([opt], 0.25)  # not compounding
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.075), pytest.approx(0.0025)]
