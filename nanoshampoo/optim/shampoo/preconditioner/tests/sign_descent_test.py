"""Sign descent (``SignDescentPreconditionerConfig``) against float64 loops of its equations.

A block's search direction is ``sign(Gbar) * scale_fn(Gbar)``, ``Gbar`` its filtered gradient.
The references split the parameters into blocks by hand (``max_preconditioner_dim`` 8: a
``(10, 7)`` parameter is the blocks ``rows 0-7`` and ``rows 8-9``, a ``(16, 7)`` one two blocks
of 8 rows, which share a bucket) and take gradients by
float64 autograd at their own parameters; the optimizer runs in float32 at epsilon 1e-12.

Lion: Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2 (decoupled
weight decay)::

    c = b1 m + (1 - b1) g;   W <- W - lr (sign(c) + wd W);   m <- b2 m + (1 - b2) g

is exactly sign descent with ``beta3 = b1``, ``betas[0] = b2``, decoupled ``weight_decay = wd``
(bias correction divides ``c`` by a positive number, which leaves its sign alone).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DefaultSignDescentPreconditionerConfig,
    DistributedShampoo,
    SignDescentPreconditionerConfig,
)

STEPS = 6
SHAPES = [(10, 7), (7,), (3, 4, 5), (16, 7)]


def initial_params(dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator).to(dtype) for shape in SHAPES]


def loss_of(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """A smooth, non-separable loss of all three parameters."""
    generator = torch.Generator().manual_seed(1)
    dtype = params[0].dtype
    x = torch.randn(4, 10, generator=generator).to(dtype)
    hidden = torch.tanh(x @ params[0] + params[1])  # (4, 7)
    coupled = (hidden.sum() * params[2]).square().mean()
    return coupled + hidden.square().sum() + torch.sin(hidden @ params[3].T).sum()


def grads_at(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    leaves = [p.detach().clone().requires_grad_(True) for p in params]
    return list(torch.autograd.grad(loss_of(leaves), leaves))


def blocks_of(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Views of a parameter's blocks at max_preconditioner_dim 8 (see the module docstring)."""
    return [tensor[:8], tensor[8:]] if tensor.shape in ((10, 7), (16, 7)) else [tensor]


def run_shampoo(steps: int, **settings: object) -> list[torch.Tensor]:
    params = [torch.nn.Parameter(p) for p in initial_params(torch.float32)]
    optimizer = DistributedShampoo(
        params, **{"epsilon": 1e-12, "max_preconditioner_dim": 8, **settings}
    )
    for _ in range(steps):
        optimizer.zero_grad()
        loss_of(params).backward()
        optimizer.step()
    return [p.detach() for p in params]


def l1_scale(grad: torch.Tensor) -> torch.Tensor:
    """Steepest descent under the L-infinity norm: ``sign(g) * ||g||_1`` (a tensor result)."""
    return grad.abs().sum()


def inverse_sqrt_size(grad: torch.Tensor) -> float:
    """A float result: unit RMS steps per block."""
    return grad.numel() ** -0.5


def test_config_defaults_and_validation() -> None:
    assert DefaultSignDescentPreconditionerConfig == SignDescentPreconditionerConfig()
    assert SignDescentPreconditionerConfig().scale_fn(torch.randn(3)) == 1.0
    with pytest.raises(ValueError, match="^scale_fn must be callable"):
        SignDescentPreconditionerConfig(scale_fn=2.0)


@pytest.mark.parametrize(
    "scale_fn", [None, l1_scale, inverse_sqrt_size], ids=["unit", "l1_tensor", "float"]
)
def test_sign_descent_matches_a_float64_loop(
    scale_fn: Callable[[torch.Tensor], object] | None,
) -> None:
    """``betas[0] = 0``: ``W <- W - lr sign(G) scale_fn(G)`` per block, from step 1 even with a
    ``precondition_frequency`` of 100 (stateless: taken as 1)."""
    config = SignDescentPreconditionerConfig(**({} if scale_fn is None else {"scale_fn": scale_fn}))
    lr = 1e-3
    ours = run_shampoo(
        STEPS, lr=lr, betas=(0.0, 1.0), precondition_frequency=100, preconditioner_config=config
    )
    w = initial_params(torch.float64)
    for _ in range(STEPS):
        grads = grads_at(w)
        for param, grad in zip(w, grads):
            for block, block_grad in zip(blocks_of(param), blocks_of(grad)):
                scale = 1.0 if scale_fn is None else scale_fn(block_grad)
                block -= lr * torch.sign(block_grad) * scale
    for a, b in zip(ours, w):
        torch.testing.assert_close(a.double(), b, rtol=1e-6, atol=1e-6)


def lion_float64(lr: float, beta1: float, beta2: float, weight_decay: float) -> list[torch.Tensor]:
    w = initial_params(torch.float64)
    m = [torch.zeros_like(p) for p in w]
    for _ in range(STEPS):
        for i, g in enumerate(grads_at(w)):
            c = beta1 * m[i] + (1 - beta1) * g
            w[i] = w[i] - lr * (torch.sign(c) + weight_decay * w[i])
            m[i] = beta2 * m[i] + (1 - beta2) * g
    return w


@pytest.mark.parametrize("use_bias_correction", [False, True])
def test_lion_is_sign_descent_of_the_two_beta_filter(use_bias_correction: bool) -> None:
    lr, beta1, beta2, wd = 3e-3, 0.9, 0.99, 0.1
    ours = run_shampoo(
        STEPS,
        lr=lr,
        betas=(beta2, 1.0),
        beta3=beta1,
        weight_decay=wd,
        use_bias_correction=use_bias_correction,
        preconditioner_config=DefaultSignDescentPreconditionerConfig,
    )
    for a, b in zip(ours, lion_float64(lr, beta1, beta2, wd)):
        torch.testing.assert_close(a.double(), b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("grafted", [False, True])
def test_zero_gradient_entries_take_no_step_and_tiny_ones_stay_finite(grafted: bool) -> None:
    """A gradient of one 1e-30 entry: without grafting that entry moves by a full ``lr``; with
    Adam grafting by the graft's (tiny) norm; nothing else moves and nothing is NaN."""
    params = [torch.nn.Parameter(p) for p in initial_params(torch.float32)]
    grafting = AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8) if grafted else None
    optimizer = DistributedShampoo(
        params,
        lr=0.01,
        betas=(0.9, 0.999),
        epsilon=1e-12,
        max_preconditioner_dim=8,
        preconditioner_config=DefaultSignDescentPreconditionerConfig,
        grafting_config=grafting,
    )
    before = [p.detach().clone() for p in params]
    for param in params:
        param.grad = torch.zeros_like(param)
    params[0].grad[0, 0] = 1e-30
    optimizer.step()
    moved = [p.detach() - q for p, q in zip(params, before)]
    assert all(torch.isfinite(m).all() for m in moved)
    assert torch.count_nonzero(moved[0][1:]) == 0 and torch.count_nonzero(moved[0][0, 1:]) == 0
    assert all(torch.count_nonzero(m) == 0 for m in moved[1:])
    if not grafted:
        assert moved[0][0, 0] == pytest.approx(-0.01, rel=1e-6)
