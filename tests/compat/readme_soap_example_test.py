"""The reference README's Example 5 (eigenvalue-corrected Shampoo / SOAP), import line swapped.

Example 5 replaces ``AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-5)`` by
``DistributedShampoo`` with ``DefaultEigenvalueCorrectedShampooConfig``, no grafting and
``precondition_frequency=100``. Its first 99 steps precede the first eigenbasis, so they are
AdamW with ``eps=1e-12`` in the identity basis: here 5 float32 steps on a small model against
``torch.optim.AdamW`` fed the same gradients, and the same 5 steps with ``DefaultSOAPConfig``
(the QR variant the example's comment names).
"""

from __future__ import annotations

import pytest
import torch

from nanoshampoo.optim.shampoo import (
    DefaultEigenvalueCorrectedShampooConfig,
    DefaultSOAPConfig,
    DistributedShampoo,
    WeightDecayType,
)

STEPS = 5


def instantiate_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def example_5_optimizer(model: torch.nn.Module, config: object) -> DistributedShampoo:
    """Example 5's call, verbatim but for the import line."""
    return DistributedShampoo(
        model.parameters(),
        lr=0.001,
        betas=(0.9, 0.999),
        epsilon=1e-12,
        weight_decay=1e-05,
        max_preconditioner_dim=8192,
        precondition_frequency=100,
        weight_decay_type=WeightDecayType.DECOUPLED,
        preconditioner_config=config,
    )


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        inputs, targets = torch.randn(32, 12, generator=gen), torch.randn(32, 3, generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "config", [DefaultEigenvalueCorrectedShampooConfig, DefaultSOAPConfig], ids=["eigh", "qr"]
)
def test_example_5_matches_adamw_for_five_float32_steps(config: object) -> None:
    model = instantiate_model()
    initial = [p.detach().clone() for p in model.parameters()]
    ours = _train(model, example_5_optimizer(model, config))
    model = instantiate_model()
    adamw = torch.optim.AdamW(
        model.parameters(), lr=0.001, betas=(0.9, 0.999), eps=1e-12, weight_decay=1e-05
    )
    expected = _train(model, adamw)
    for p, e, w0 in zip(ours, expected, initial):
        assert torch.linalg.vector_norm(p - e) / torch.linalg.vector_norm(e) <= 1e-5
        # The parameters moved, and in AdamW's direction (not SGD's): a sharper check.
        moved = torch.linalg.vector_norm(e - w0)
        assert moved > 0.0
        assert torch.linalg.vector_norm((p - w0) - (e - w0)) / moved <= 1e-3
