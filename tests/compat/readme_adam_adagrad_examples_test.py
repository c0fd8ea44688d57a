"""The reference README's Examples 2-4 (Adam, AdaGrad, AdamW), import line swapped.

Each replaces a ``torch.optim`` optimizer by ``DistributedShampoo`` grafting from it, with
``precondition_frequency=100``: its first 99 steps are the grafted method alone. Here 5 float32
steps of each example on a small model against the ``torch.optim`` call the README starts from,
fed the same gradients (L2 weight decay for Adam and AdaGrad, decoupled for AdamW).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from nanoshampoo.optim.shampoo import (
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    DistributedShampoo,
    WeightDecayType,
)

STEPS = 5


def instantiate_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def example_2(model: torch.nn.Module) -> DistributedShampoo:
    return DistributedShampoo(
        model.parameters(),
        lr=0.001,
        betas=(0.9, 0.999),
        epsilon=1e-12,
        weight_decay=1e-05,
        max_preconditioner_dim=8192,
        precondition_frequency=100,
        weight_decay_type=WeightDecayType.L2,
        grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-08),
    )


def example_3(model: torch.nn.Module) -> DistributedShampoo:
    return DistributedShampoo(
        model.parameters(),
        lr=0.01,
        betas=(0.0, 1.0),
        epsilon=1e-12,
        weight_decay=1e-05,
        max_preconditioner_dim=8192,
        precondition_frequency=100,
        weight_decay_type=WeightDecayType.L2,
        grafting_config=AdaGradPreconditionerConfig(epsilon=1e-10),
    )


def example_4(model: torch.nn.Module) -> DistributedShampoo:
    return DistributedShampoo(
        model.parameters(),
        lr=0.001,
        betas=(0.9, 0.999),
        epsilon=1e-12,
        weight_decay=1e-05,
        max_preconditioner_dim=8192,
        precondition_frequency=100,
        weight_decay_type=WeightDecayType.DECOUPLED,
        grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-08),
    )


CASES: dict[
    str,
    tuple[
        Callable[[torch.nn.Module], torch.optim.Optimizer],
        Callable[[torch.nn.Module], torch.optim.Optimizer],
    ],
] = {
    "adam": (
        example_2,
        lambda m: torch.optim.Adam(
            m.parameters(), lr=0.001, betas=(0.9, 0.999), eps=1e-08, weight_decay=1e-05
        ),
    ),
    "adagrad": (
        example_3,
        lambda m: torch.optim.Adagrad(m.parameters(), lr=0.01, eps=1e-10, weight_decay=1e-05),
    ),
    "adamw": (
        example_4,
        lambda m: torch.optim.AdamW(
            m.parameters(), lr=0.001, betas=(0.9, 0.999), eps=1e-08, weight_decay=1e-05
        ),
    ),
}


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        inputs, targets = torch.randn(32, 12, generator=gen), torch.randn(32, 3, generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(CASES))
def test_examples_2_to_4_match_the_torch_optimizer_they_replace(name: str) -> None:
    example, original = CASES[name]
    model = instantiate_model()
    initial = [p.detach().clone() for p in model.parameters()]
    ours = _train(model, example(model))
    baseline = instantiate_model()
    theirs = _train(baseline, original(baseline))
    for start, a, b in zip(initial, ours, theirs):
        assert (b - start).abs().max() > 0
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-5
