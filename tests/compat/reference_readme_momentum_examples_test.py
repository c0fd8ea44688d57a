"""The reference library's README examples of momentum and iterate averaging, ported by the import.

The reference README (facebookresearch/optimizers, ``distributed_shampoo/README.md``) shows:

- Example 1, "SGD with Momentum": Shampoo grafted from SGD, ``ClassicMomentumConfig(0.9)``, in
  place of ``torch.optim.SGD(lr=0.01, momentum=0.9, weight_decay=1e-5)``;
- Example 7, "Iterate Averaging": classic momentum with the SGD preconditioner, GPA set up to
  equal SGD momentum 0.9 (``lr = 0.01 / (1 - 0.9)``), and Schedule-Free with Adam grafting
  (``train()`` before training, ``eval()`` before evaluating).

Each runs here with ``from nanoshampoo.optim.shampoo import ...`` in place of
``from distributed_shampoo import ...``, for 5 float32 steps on a small MLP, against the same
steps computed another way: ``torch.optim.SGD`` where the README names it, else a float64 loop
of the equations. The difference is ``max |ours - theirs| / max |theirs|`` per parameter, at most
1e-5. (The same examples against the reference library itself, side by side, are a check run
outside this suite; the figures are in the issue's report.)
"""

from __future__ import annotations

import torch

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    ClassicMomentumConfig,
    DistributedShampoo,
    GeneralizedPrimalAveragingConfig,
    ScheduleFreeConfig,
    SGDPreconditionerConfig,
)

STEPS = 5
MAX_RELATIVE_DIFFERENCE = 1e-5


def instantiate_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(
        dtype
    )


def loss(model: torch.nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    inputs, targets = (
        torch.randn(32, 8, generator=generator),
        torch.randn(32, 4, generator=generator),
    )
    dtype = next(model.parameters()).dtype
    return torch.nn.functional.mse_loss(model(inputs.to(dtype)), targets.to(dtype))


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = STEPS) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        loss(model).backward()
        optimizer.step()


def max_relative_difference(ours: torch.nn.Module, theirs: torch.nn.Module) -> float:
    return max(
        float(
            (a.detach().double() - b.detach().double()).abs().max()
            / b.detach().double().abs().max()
        )
        for a, b in zip(ours.parameters(), theirs.parameters())
    )


def torch_sgd_momentum(lr: float, weight_decay: float = 0.0) -> torch.nn.Module:
    model = instantiate_model()
    train(
        model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)
    )
    return model


def test_example_1_sgd_with_momentum() -> None:
    model = instantiate_model()
    optimizer = DistributedShampoo(
        model.parameters(),
        lr=0.01,
        betas=(0.0, 0.999),
        epsilon=1e-12,
        weight_decay=1e-05,
        max_preconditioner_dim=8192,
        precondition_frequency=100,
        grafting_config=SGDPreconditionerConfig(),
        iterate_averaging_config=ClassicMomentumConfig(
            momentum=0.9, dampening=0.0, use_nesterov=False
        ),
    )
    train(model, optimizer)
    assert (
        max_relative_difference(model, torch_sgd_momentum(0.01, weight_decay=1e-05))
        <= MAX_RELATIVE_DIFFERENCE
    )


def test_example_7_classic_momentum() -> None:
    model = instantiate_model()
    optimizer = DistributedShampoo(
        model.parameters(),
        lr=0.01,
        betas=(0.0, 1.0),
        epsilon=1e-12,
        max_preconditioner_dim=8192,
        precondition_frequency=100,
        preconditioner_config=SGDPreconditionerConfig(),
        iterate_averaging_config=ClassicMomentumConfig(
            momentum=0.9, dampening=0.0, use_nesterov=False
        ),
    )
    train(model, optimizer)
    assert max_relative_difference(model, torch_sgd_momentum(0.01)) <= MAX_RELATIVE_DIFFERENCE


def test_example_7_gpa_equals_sgd_momentum() -> None:
    model = instantiate_model()
    optimizer = DistributedShampoo(
        model.parameters(),
        lr=0.1,
        betas=(0.0, 1.0),
        epsilon=1e-12,
        max_preconditioner_dim=8192,
        precondition_frequency=100,
        preconditioner_config=SGDPreconditionerConfig(),
        iterate_averaging_config=GeneralizedPrimalAveragingConfig(
            eval_interp_coeff=0.9, train_interp_coeff=1.0
        ),
    )
    train(model, optimizer)
    optimizer.eval()  # heavy-ball (mu_y = 1): x = y, nothing moves
    assert max_relative_difference(model, torch_sgd_momentum(0.01)) <= MAX_RELATIVE_DIFFERENCE


def schedule_free_adam_float64(
    lr: float, beta1: float, beta2: float, epsilon: float, mu_y: float
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Float64 ``(y, x)`` models: Adam on the filtered gradient (Shampoo's grafting before its
    start step), then ``z <- z - lr P``, ``x <- (1 - c) x + c z`` with ``c = lr^2 / sum lr^2``,
    ``y = mu_y x + (1 - mu_y) z``; the gradient is taken at ``y``."""
    y = instantiate_model(torch.float64)
    params = list(y.parameters())
    z = [p.detach().clone() for p in params]
    x = [p.detach().clone() for p in params]
    m = [torch.zeros_like(p) for p in z]
    v = [torch.zeros_like(p) for p in z]
    weight_sum = 0.0
    for t in range(1, STEPS + 1):
        y.zero_grad()
        loss(y).backward()
        weight_sum += lr**2
        c = lr**2 / weight_sum
        with torch.no_grad():
            for i, p in enumerate(params):
                g = p.grad
                m[i] = beta1 * m[i] + (1 - beta1) * g
                v[i] = beta2 * v[i] + (1 - beta2) * g * g
                direction = (m[i] / (1 - beta1**t)) / ((v[i] / (1 - beta2**t)).sqrt() + epsilon)
                z[i] = z[i] - lr * direction
                x[i] = (1 - c) * x[i] + c * z[i]
                p.copy_(mu_y * x[i] + (1 - mu_y) * z[i])
    x_model = instantiate_model(torch.float64)
    with torch.no_grad():
        for p, value in zip(x_model.parameters(), x):
            p.copy_(value)
    return y, x_model


def test_example_7_schedule_free() -> None:
    model = instantiate_model()
    optimizer = DistributedShampoo(
        model.parameters(),
        lr=0.001,
        betas=(0.9, 0.999),
        epsilon=1e-12,
        max_preconditioner_dim=8192,
        precondition_frequency=100,
        grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-08),
        iterate_averaging_config=ScheduleFreeConfig(train_interp_coeff=0.9),
    )
    optimizer.train()
    train(model, optimizer)
    want_y, want_x = schedule_free_adam_float64(0.001, 0.9, 0.999, 1e-08, 0.9)
    assert max_relative_difference(model, want_y) <= MAX_RELATIVE_DIFFERENCE
    optimizer.eval()
    assert max_relative_difference(model, want_x) <= MAX_RELATIVE_DIFFERENCE
