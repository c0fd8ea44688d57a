"""Which eigenvalue floor suits bfloat16 factor storage? Error against float64, and the noise.

Shampoo floors the eigenvalues of a factor at ``rtol * lambda_max`` before the inverse root
(``PerturbationConfig.eigenvalue_floor_rtol``). The default ``sqrt(n) * eps`` of the least precise
dtype was chosen for float32 factors, whose noise comes from the float32 ``eigh``. A bfloat16
factor is decomposed in float32 too; its noise is the rounding of its storage. This script
measures both sides:

1. ``noise``: the spectral norm of ``L_bf16 - L_64`` over ``lambda_max`` for an EMA factor
   ``L <- b L + (1 - b) G G^T`` (b = 0.95, 200 steps) kept in bfloat16 (rounded every step)
   against the same EMA in float64, for gradients ``G = A X`` with a decaying spectrum
   (``A``'s columns scaled by ``1/j``), in units of bfloat16's unit roundoff ``u = 2^-8``.
2. ``error``: the largest relative error of a parameter's change, ``|W - W_64| / |W_64 - W_0|``,
   after 20 and 200 steps of ``DistributedShampoo`` on random gradients (shapes 64x64, 64x96,
   96x64, (32,), ``max_preconditioner_dim=64``, ``precondition_frequency=5``, betas (0.9, 0.99),
   Adam grafting, ``epsilon=1e-12``), against the float64 run (float64 factors and ``eigh``, no
   floor), for float32 factors at the default floor and bfloat16 factors at the default floor
   and at ``--floors``.

Usage:
    python bench/bf16_factor_floor.py [--floors 2^-7,2^-8,2^-9,2^-11] [--steps 20,200]
"""

from __future__ import annotations

import argparse
import sys

import torch

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DistributedShampoo,
    EigenConfig,
    PerturbationConfig,
    RootInvShampooPreconditionerConfig,
)

SHAPES = [(64, 64), (64, 96), (96, 64), (32,)]
UNIT_ROUNDOFF_BF16 = 2.0**-8


def parse_floor(text: str) -> float:
    """``"2^-9"`` or ``"0.00195"`` -> float in (0, 1); raises ValueError naming --floors."""
    item = text.strip()
    try:
        value = 2.0 ** float(item[2:]) if item.startswith("2^") else float(item)
    except ValueError:
        raise ValueError(f"--floors: expected numbers or 2^k, got {text!r}") from None
    if not 0.0 < value < 1.0:
        raise ValueError(f"--floors: each floor must be in (0, 1), got {text!r}")
    return value


def storage_noise(size: int, cols: int, steps: int = 200, beta: float = 0.95) -> float:
    """``|L_bf16 - L_64|_2 / lambda_max(L_64)`` in units of ``u`` (see the module doc)."""
    gen = torch.Generator().manual_seed(size * 1000 + cols)
    scale = torch.arange(1, size + 1, dtype=torch.float64).reciprocal()
    mixing = torch.randn(size, size, generator=gen, dtype=torch.float64) * scale
    exact = torch.zeros(size, size, dtype=torch.float64)
    stored = torch.zeros(size, size, dtype=torch.bfloat16)
    for _ in range(steps):
        grad = mixing @ torch.randn(size, cols, generator=gen, dtype=torch.float64) * 1e-2
        update = grad @ grad.T
        exact = beta * exact + (1 - beta) * update
        stored = (beta * stored.double() + (1 - beta) * update).to(torch.bfloat16)
    top = torch.linalg.eigvalsh(exact)[-1]
    noise = torch.linalg.matrix_norm(stored.double() - exact, ord=2)
    return (noise / top).item() / UNIT_ROUNDOFF_BF16


def parameters_after(
    steps: int, factors: torch.dtype, floor: float | None, dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(W after steps, W_0)`` in float64, for one factor dtype and floor (module doc, 2)."""
    gen = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype))
        for s in SHAPES
    ]
    start = [p.detach().double().clone() for p in params]
    optimizer = DistributedShampoo(
        params,
        lr=1e-2,
        betas=(0.9, 0.99),
        epsilon=1e-12,
        max_preconditioner_dim=64,
        precondition_frequency=5,
        grafting_config=AdamPreconditionerConfig(beta2=0.99),
        preconditioner_config=RootInvShampooPreconditionerConfig(
            factor_matrix_dtype=factors,
            amortized_computation_config=EigenConfig(
                rank_deficient_stability_config=PerturbationConfig(eigenvalue_floor_rtol=floor)
            ),
        ),
    )
    for step in range(steps):
        grads = torch.Generator().manual_seed(1000 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=grads, dtype=torch.float64).to(dtype)
        optimizer.step()
    return [p.detach().double() for p in params], start


def relative_error(
    params: list[torch.Tensor], reference: list[torch.Tensor], start: list[torch.Tensor]
) -> float:
    return max(
        ((w - r).norm() / (r - w0).norm()).item() for w, r, w0 in zip(params, reference, start)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--floors",
        default="2^-7,2^-8,2^-9,2^-11",
        help="eigenvalue_floor_rtol values for the bfloat16 rows",
    )
    parser.add_argument("--steps", default="20,200", help="comma-separated step counts")
    args = parser.parse_args(argv)
    try:
        floors = [(item.strip(), parse_floor(item)) for item in args.floors.split(",")]
        step_counts = [int(s) for s in args.steps.split(",")]
        if any(s < 1 for s in step_counts):
            raise ValueError("--steps: each count must be >= 1")
    except ValueError as error:
        parser.error(str(error))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        print("noise of a bfloat16 EMA factor, |L_bf16 - L_64|_2 / lambda_max, in units of 2^-8:")
        for size, cols in ((128, 512), (512, 128), (128, 128)):
            print(
                f"  {size}x{size} factor of {size}x{cols} gradients: "
                f"{storage_noise(size, cols):.2f}"
            )
        rows: list[tuple[str, torch.dtype, float | None]] = [
            ("float32 factors, default floor", torch.float32, None),
            ("bfloat16 factors, default floor", torch.bfloat16, None),
        ] + [(f"bfloat16 factors, floor {name}", torch.bfloat16, value) for name, value in floors]
        print("\nparameter error against float64 (largest |W - W_64| / |W_64 - W_0|):")
        print(f"  {'config':<36}" + "".join(f"{f'{s} steps':>12}" for s in step_counts))
        errors = {name: [] for name, _, _ in rows}
        for steps in step_counts:
            reference, start = parameters_after(steps, torch.float64, 0.0, torch.float64)
            for name, factors, floor in rows:
                params, _ = parameters_after(steps, factors, floor, torch.float32)
                errors[name].append(relative_error(params, reference, start))
        for name, values in errors.items():
            print(f"  {name:<36}" + "".join(f"{100 * v:>11.2f}%" for v in values))
    finally:
        torch.set_num_threads(before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
