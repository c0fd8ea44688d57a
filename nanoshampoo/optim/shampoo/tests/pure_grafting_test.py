"""``start_preconditioning_step=math.inf``: never precondition, every step is the grafting method's.

Against float64 loops of the diagonal methods on the filtered gradient
``Gbar_t = M_t / (1 - b1^t)``, ``M_t = b1 M_{t-1} + (1 - b1) G_t``:
Adam ``Gbar / (sqrt(V_t / (1 - b2^t)) + eps)`` with ``V_t = b2 V + (1 - b2) G^2``, RMSprop
``Gbar / (sqrt(V_t) + eps)``, AdaGrad ``Gbar / (sqrt(sum G^2) + eps)``, and without grafting
``Gbar`` itself; then ``W <- W - lr P``. Blocked shapes, float32, epsilon 1e-12.
"""

from __future__ import annotations

import math

import pytest
import torch

from nanoshampoo.optim.shampoo import (
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    DistributedShampoo,
    PreconditionerConfig,
    RMSpropPreconditionerConfig,
)

SHAPES = ((10, 6), (7,), (3, 4, 5))
LR, BETA1, STEPS = 0.01, 0.9, 6
GRAFT_EPS = 1e-8


def _reference_direction(
    config: PreconditionerConfig | None,
    grad: torch.Tensor,
    filtered: torch.Tensor,
    second: torch.Tensor,
    t: int,
) -> torch.Tensor:
    """Updates ``second`` in place; returns the grafting direction for step ``t``."""
    if config is None:
        return filtered
    if isinstance(config, RMSpropPreconditionerConfig):
        second.mul_(config.beta2).add_((1.0 - config.beta2) * grad**2)
    else:
        second.add_(grad**2)
    if isinstance(config, AdamPreconditionerConfig):
        return filtered / ((second / (1.0 - config.beta2**t)).sqrt() + config.epsilon)
    return filtered / (second.sqrt() + config.epsilon)


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


@pytest.mark.parametrize(
    "config",
    [
        AdamPreconditionerConfig(beta2=0.999, epsilon=GRAFT_EPS),
        RMSpropPreconditionerConfig(beta2=0.99, epsilon=GRAFT_EPS),
        AdaGradPreconditionerConfig(epsilon=GRAFT_EPS),
        None,
    ],
    ids=["adam", "rmsprop", "adagrad", "no-grafting"],
)
def test_never_preconditioning_is_the_grafting_method(config: PreconditionerConfig | None) -> None:
    params = _params()
    opt = DistributedShampoo(
        params,
        lr=LR,
        betas=(BETA1, 0.999),
        epsilon=1e-12,
        max_preconditioner_dim=4,
        precondition_frequency=1,
        start_preconditioning_step=math.inf,
        grafting_config=config,
    )
    weights = [p.detach().double().clone() for p in params]
    moments = [torch.zeros_like(w) for w in weights]
    seconds = [torch.zeros_like(w) for w in weights]
    for t in range(1, STEPS + 1):
        grads = _grads(t)
        for param, grad in zip(params, grads):
            param.grad = grad
        opt.step()
        for w, m, v, grad in zip(weights, moments, seconds, grads):
            m.mul_(BETA1).add_((1.0 - BETA1) * grad.double())
            w.sub_(LR * _reference_direction(config, grad.double(), m / (1.0 - BETA1**t), v, t))
    for param, w in zip(params, weights):
        torch.testing.assert_close(param.detach().double(), w, rtol=1e-6, atol=1e-7)


def test_adam_grafting_alone_is_torch_adam() -> None:
    params, twins = _params(), _params()
    opt = DistributedShampoo(
        params,
        lr=LR,
        betas=(BETA1, 0.999),
        epsilon=1e-12,
        start_preconditioning_step=math.inf,
        grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=GRAFT_EPS),
    )
    adam = torch.optim.Adam(twins, lr=LR, betas=(BETA1, 0.999), eps=GRAFT_EPS)
    for t in range(1, STEPS + 1):
        for param, twin, grad in zip(params, twins, _grads(t)):
            param.grad, twin.grad = grad, grad.clone()
        opt.step()
        adam.step()
    for param, twin in zip(params, twins):
        torch.testing.assert_close(param, twin, rtol=1e-6, atol=1e-7)


def test_an_infinite_start_is_kept_in_the_group_and_finite_floats_are_refused() -> None:
    opt = DistributedShampoo(_params(), start_preconditioning_step=math.inf)
    assert opt.param_groups[0]["start_preconditioning_step"] == math.inf
    with pytest.raises(
        ValueError,
        match=r"^Invalid param_group\[START_PRECONDITIONING_STEP\]=5\.0\. Must be an integer or "
        r"math\.inf\.",
    ):
        DistributedShampoo(_params(), start_preconditioning_step=5.0)
