"""The reference README's Example 6 (Muon), import line swapped.

Example 6 gives the hidden matrices spectral descent with Newton-Schulz
(``scale_by_dims_fn = max(1, d_out / d_in) ** 0.5``, ``max_preconditioner_dim = inf`` and
``target_parameter_dimensionality = 2``, so a conv kernel is orthogonalized as one
``(out, in * kh * kw)`` matrix) and the rest pure Adam grafting (``start_preconditioning_step =
inf``), with decoupled weight decay. Here 5 float32 steps on a model with a hidden matrix and a
conv kernel, against a float64 loop written from those equations:

- hidden: ``M <- 0.9 M + 0.1 G`` (the default ``betas[0]``), ``O = NS(M)`` (5 quintic iterations
  on ``M / ||M||_F`` in the wide orientation; the bias correction is a scalar NS normalizes
  away), ``W <- W - lr (scale O + wd W)``;
- the rest: ``torch.optim.AdamW``-style Adam (betas (0.9, 0.95), eps 1e-10) with decoupled decay.
"""

from __future__ import annotations

import math

import torch

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DistributedShampoo,
    NewtonSchulzOrthogonalizationConfig,
    SingleDeviceDistributedConfig,
    SpectralDescentPreconditionerConfig,
    WeightDecayType,
)

STEPS = 5
COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def scale_by_dims(d_in: int, d_out: int) -> float:
    return max(1, d_out / d_in) ** 0.5


def build_model() -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter], torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {
            "first": torch.nn.Linear(8, 16),
            "hidden": torch.nn.Linear(16, 16),
            "last": torch.nn.Linear(16, 4),
            "conv": torch.nn.Conv2d(2, 3, 3),
        }
    )
    hidden = [model["hidden"].weight, model["conv"].weight]
    ids = {id(p) for p in hidden}
    return hidden, [p for p in model.parameters() if id(p) not in ids], model


def example_6_optimizer(hidden: list, other: list) -> DistributedShampoo:
    """Example 6's call, verbatim but for the import line and the parameter lists."""
    return DistributedShampoo(
        [
            {
                "params": hidden,
                "lr": 0.02,
                "preconditioner_config": SpectralDescentPreconditionerConfig(
                    orthogonalization_config=NewtonSchulzOrthogonalizationConfig(
                        scale_by_dims_fn=scale_by_dims,
                    ),
                ),
                "max_preconditioner_dim": math.inf,
                "distributed_config": SingleDeviceDistributedConfig(
                    target_parameter_dimensionality=2,
                ),
            },
            {
                "params": other,
                "lr": 3e-4,
                "start_preconditioning_step": math.inf,
                "grafting_config": AdamPreconditionerConfig(beta2=0.95, epsilon=1e-10),
            },
        ],
        weight_decay=1e-05,
        weight_decay_type=WeightDecayType.DECOUPLED,
    )


def loss_of(model: torch.nn.Module, gen: torch.Generator) -> torch.Tensor:
    """The same float32 draws for either model (cast to the model's dtype)."""
    dtype = model["first"].weight.dtype
    x, y, images = (
        torch.randn(*shape, generator=gen).to(dtype) for shape in ((32, 8), (32, 4), (4, 2, 6, 6))
    )
    out = model["last"](torch.tanh(model["hidden"](torch.tanh(model["first"](x)))))
    return ((out - y) ** 2).mean() + model["conv"](images).pow(2).mean()


def newton_schulz(matrix: torch.Tensor) -> torch.Tensor:
    """The quintic iteration on the wide orientation, written out."""
    tall = matrix.shape[0] > matrix.shape[1]
    x = matrix.T if tall else matrix
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    a, b, c = COEFFICIENTS
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def reference_steps(model: torch.nn.Module, hidden: list, other: list) -> None:
    """Example 6's 5 steps in float64, from the equations in the module docstring."""
    momentum = {id(p): torch.zeros_like(p) for p in hidden}
    first = {id(p): torch.zeros_like(p) for p in other}
    second = {id(p): torch.zeros_like(p) for p in other}
    gen = torch.Generator().manual_seed(1)
    for t in range(1, STEPS + 1):
        model.zero_grad()
        loss_of(model, gen).backward()
        with torch.no_grad():
            for p in hidden:
                m = momentum[id(p)].mul_(0.9).add_(p.grad, alpha=0.1)
                matrix = m.reshape(m.shape[0], -1)
                direction = scale_by_dims(matrix.shape[1], matrix.shape[0]) * newton_schulz(matrix)
                p.sub_(0.02 * (direction.reshape(p.shape) + 1e-5 * p))
            for p in other:
                m1 = first[id(p)].mul_(0.9).add_(p.grad, alpha=0.1)
                m2 = second[id(p)].mul_(0.95).addcmul_(p.grad, p.grad, value=0.05)
                denom = (m2 / (1 - 0.95**t)).sqrt() + 1e-10
                p.sub_(3e-4 * (m1 / (1 - 0.9**t) / denom + 1e-5 * p))


def test_example_6_matches_muon_and_adamw_written_out_for_five_float32_steps() -> None:
    hidden, other, model = build_model()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = example_6_optimizer(hidden, other)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss_of(model, gen).backward()
        optimizer.step()

    reference = build_model()[2].double()
    reference.load_state_dict({name: p.double() for name, p in initial.items()})
    ids = {id(reference["hidden"].weight), id(reference["conv"].weight)}
    reference_steps(
        reference,
        [reference["hidden"].weight, reference["conv"].weight],
        [p for p in reference.parameters() if id(p) not in ids],
    )
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        moved = (theirs - initial[name].double()).abs().max().item()
        assert moved > 0, name
        relative = ((ours.double() - theirs).abs().max() / theirs.abs().max()).item()
        assert relative <= 1e-5, (name, relative)
