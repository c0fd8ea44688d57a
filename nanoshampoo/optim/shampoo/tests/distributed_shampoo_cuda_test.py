"""DistributedShampoo on CUDA: the same steps as on CPU (float64), and float32 / bf16 factors
within their precision of the float64 run.

The CPU float64 optimizer is checked against the equations in
``nanoshampoo/optim/shampoo/tests/distributed_shampoo_test.py``; here CUDA is compared with it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from flat_shampoo_state import flat_state

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DistributedShampoo,
    RootInvShampooPreconditionerConfig,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# Matrices split by max_dim 32 (70 -> 32, 32, 6), a vector, and an order-3 block.
SHAPES = ((40, 24), (24,), (70, 30), (3, 4, 5))
MAX_DIM = 32
STEPS = 7


@pytest.fixture(autouse=True)
def no_tf32() -> Iterator[None]:
    """Full float32 matmuls: TF32 would round operands to 10 mantissa bits."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def _initial_params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in SHAPES]


def _grads() -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES] for _ in range(STEPS)
    ]


def _run(
    device: str, dtype: torch.dtype, factor_dtype: torch.dtype, epsilon: float
) -> tuple[list[torch.Tensor], DistributedShampoo]:
    """Parameters after ``STEPS`` steps (back on CPU, float64) and the optimizer."""
    params = [torch.nn.Parameter(p.to(device=device, dtype=dtype)) for p in _initial_params()]
    optimizer = DistributedShampoo(
        params,
        lr=0.01,
        betas=(0.9, 0.95),
        epsilon=epsilon,
        weight_decay=0.1,
        max_preconditioner_dim=MAX_DIM,
        precondition_frequency=3,
        grafting_config=AdamPreconditionerConfig(beta2=0.95, epsilon=1e-10),
        preconditioner_config=RootInvShampooPreconditionerConfig(factor_matrix_dtype=factor_dtype),
    )
    for grads in _grads():
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(device=device, dtype=dtype)
        optimizer.step()
    return [p.detach().to("cpu", torch.float64) for p in params], optimizer


def test_float64_step_on_cuda_matches_cpu() -> None:
    # The recipe's epsilon: the (rank-deficient) factors' roots are well defined in float64.
    cpu, _ = _run("cpu", torch.float64, torch.float64, epsilon=1e-12)
    cuda, optimizer = _run("cuda", torch.float64, torch.float64, epsilon=1e-12)
    for got, want in zip(cuda, cpu, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)
    for per_param in flat_state(optimizer.state_dict()).values():
        for key, value in per_param.items():
            # The group's step is a CPU tensor, as in the reference (no device sync to count).
            assert value.is_cuda is key.startswith("block_"), key


# Error over distance moved, measured with the same runs on CPU (torch 2.13): float32 factors
# 5e-6 .. 1.2e-4 (the vector's rank-deficient factor is the worst), bf16 factors 1e-2 .. 9e-2.
@pytest.mark.parametrize(
    ("factor_dtype", "tolerance"),
    [(torch.float32, 1e-3), (torch.bfloat16, 0.25)],
    ids=["float32", "bfloat16"],
)
def test_float32_params_on_cuda_track_float64(factor_dtype: torch.dtype, tolerance: float) -> None:
    # epsilon 1e-3 keeps float32 roots of the rank-deficient factors out of rounding noise.
    reference, _ = _run("cpu", torch.float64, torch.float64, epsilon=1e-3)
    cuda, optimizer = _run("cuda", torch.float32, factor_dtype, epsilon=1e-3)
    start = _initial_params()
    for got, want, w0 in zip(cuda, reference, start, strict=True):
        moved = torch.linalg.vector_norm(want - w0)
        assert torch.linalg.vector_norm(got - want) <= tolerance * moved
    state = flat_state(optimizer.state_dict()).values()
    factors = [v for s in state for k, v in s.items() if ".shampoo.factor_matrices." in k]
    assert factors and all(f.dtype == factor_dtype and f.is_cuda for f in factors)
