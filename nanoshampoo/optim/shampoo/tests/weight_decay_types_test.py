"""``WeightDecayType``: every type against a float64 loop of its equation, under an lr schedule.

With the identity preconditioner and no filtering the search direction is the gradient, so the
step isolates the decay: ``W <- W - lr_t (G_t + alpha_t W)`` with ``alpha_t`` = ``wd``
(``DECOUPLED``, and ``L2`` which adds ``wd W`` to ``G``), ``wd lr_t / peak_lr`` (``CORRECTED``)
or ``wd / peak_lr`` (``INDEPENDENT``); momentum ``B <- mu B + P``, ``W <- W - lr_t B`` after it.
"""

from __future__ import annotations

import pytest
import torch

from nanoshampoo.optim.shampoo import (
    DistributedShampoo,
    SGDPreconditionerConfig,
    WeightDecayType,
)

LRS = (0.1, 0.05, 0.02, 0.08, 0.1)
WD = 0.3
SHAPES = ((4, 3), (5,))


def _alpha(decay_type: WeightDecayType, lr: float, peak_lr: float) -> float:
    return {
        WeightDecayType.L2: WD,
        WeightDecayType.DECOUPLED: WD,
        WeightDecayType.CORRECTED: WD * lr / peak_lr,
        WeightDecayType.INDEPENDENT: WD / peak_lr,
    }[decay_type]


def _run(decay_type: WeightDecayType, momentum: float, peak_lr: float | None) -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    reference = [p.detach().double().clone() for p in params]
    buffers = [torch.zeros_like(w) for w in reference]
    group: dict[str, object] = {"params": params}
    if peak_lr is not None:
        group["peak_lr"] = peak_lr
    opt = DistributedShampoo(
        [group],
        lr=LRS[0],
        betas=(0.0, 1.0),
        epsilon=1e-12,
        weight_decay=WD,
        weight_decay_type=decay_type,
        momentum=momentum,
        preconditioner_config=SGDPreconditionerConfig(),
    )
    peak = LRS[0] if peak_lr is None else peak_lr
    for lr in LRS:
        opt.param_groups[0]["lr"] = lr
        grads = [torch.randn(shape) for shape in SHAPES]
        for param, grad in zip(params, grads):
            param.grad = grad
        opt.step()
        for w, b, grad in zip(reference, buffers, grads):
            direction = grad.double() + _alpha(decay_type, lr, peak) * w
            if momentum > 0.0:
                b.mul_(momentum).add_(direction)
                direction = b
            w.sub_(lr * direction)
    for param, w in zip(params, reference):
        torch.testing.assert_close(param.detach().double(), w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("decay_type", list(WeightDecayType))
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_each_decay_type_matches_its_equation(decay_type: WeightDecayType, momentum: float) -> None:
    _run(decay_type, momentum, peak_lr=None)


@pytest.mark.parametrize("decay_type", [WeightDecayType.CORRECTED, WeightDecayType.INDEPENDENT])
def test_a_group_may_set_its_own_peak_lr(decay_type: WeightDecayType) -> None:
    _run(decay_type, momentum=0.0, peak_lr=0.4)


def test_peak_lr_defaults_to_the_group_lr() -> None:
    opt = DistributedShampoo(
        [
            {"params": [torch.nn.Parameter(torch.zeros(2))]},
            {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.5},
        ],
        lr=0.25,
    )
    assert [group["peak_lr"] for group in opt.param_groups] == [0.25, 0.5]


@pytest.mark.parametrize("decay_type", [WeightDecayType.CORRECTED, WeightDecayType.INDEPENDENT])
def test_a_zero_peak_lr_is_refused_where_it_divides(decay_type: WeightDecayType) -> None:
    with pytest.raises(ValueError, match=r"^Invalid param_group\[PEAK_LR\]=0\.0\. Must be > 0\.0"):
        DistributedShampoo(
            [torch.nn.Parameter(torch.zeros(2))],
            lr=0.0,
            weight_decay=WD,
            weight_decay_type=decay_type,
        )
