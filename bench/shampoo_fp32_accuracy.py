"""Float32 accuracy of Shampoo and SOAP at the recipe's settings (``epsilon=1e-12``), and cost.

Errors are against a float64 run of the same steps (float64 factors, float64 ``eigh``, the
plain algorithm: no floor, no canonical basis), so a row's error is what its float32 path loses.
Columns:

- ``5 steps`` / ``20 steps``: parameter relative error ``|W32 - W64| / |W64 - W0|`` through
  ``DistributedShampoo`` on random gradients for shapes (64,32), (16,), (4,8,6), (200,70),
  (1,48), (3,3,5,5), ``max_preconditioner_dim=64``, ``precondition_frequency=3``, Adam grafting.
- ``one step``: worst relative error of ``X_L G X_R`` for one gradient (its own factors) over a
  16-vector, a rank-1 32x16 gradient and a wide 8x64 block; every option, configs or not
  (symmetrize, rescale, float64 ``eigh`` of a float32 factor are transformations of the factor
  before the same root function).
- ``3 steps``: the same cases through the optimizer, the direction of step 3 with a fresh root
  every step and no grafting.
- ``vs same`` (SOAP): 20-step error against float64 of the *same* option. SOAP's eigenbasis of a
  null space is arbitrary, so the plain float64 run is itself only defined up to that choice.
- ``cpu ms``: CPU time (one thread, see :func:`gpt_small_cost_ms`) of the amortized computation
  at GPT-small shapes
  (4x 768x768, 768x3072, 3072x768 with ``max_preconditioner_dim=1024``: 14 factors of 768, 6 of
  1024 of rank 768), timed once on one factor of each size; rows with the same solve share one
  timing. The accuracy runs use 2 threads.

Run: ``.venv/bin/python bench/shampoo_fp32_accuracy.py`` (10 s wall, 13 s CPU at load ~4 on
the shared 2-core machine; 5.7 min at load 10).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    CoupledNewtonConfig,
    DistributedShampoo,
    EigenConfig,
    EigenvalueCorrectedShampooPreconditionerConfig,
    EighEigendecompositionConfig,
    PerturbationConfig,
    PreconditionerConfig,
    PseudoInverseConfig,
    QREigendecompositionConfig,
    RankDeficientStabilityConfig,
    RootInvShampooPreconditionerConfig,
)
from nanoshampoo.optim.shampoo.preconditioner.eigenbasis import eigh_eigenbasis
from nanoshampoo.optim.shampoo.preconditioner.matrix_roots import (
    coupled_newton_inverse_root,
    eigh_inverse_root,
)

SHAPES = [(64, 32), (16,), (4, 8, 6), (200, 70), (1, 48), (3, 3, 5, 5)]
# (name, shape, rank-one gradient)
DIRECTION_CASES = [
    ("vector 16", (16,), False),
    ("rank-1 32x16", (32, 16), True),
    ("wide 8x64", (8, 64), False),
]
EPSILON = 1e-12
NO_FLOOR = PerturbationConfig(eigenvalue_floor_rtol=0.0)
F64 = torch.float64
EPS32 = torch.finfo(torch.float32).eps


def shampoo(
    stability: RankDeficientStabilityConfig = NO_FLOOR, factor_dtype: torch.dtype = torch.float32
) -> RootInvShampooPreconditionerConfig:
    return RootInvShampooPreconditionerConfig(
        amortized_computation_config=EigenConfig(rank_deficient_stability_config=stability),
        factor_matrix_dtype=factor_dtype,
    )


def soap(
    qr: bool, stability: RankDeficientStabilityConfig = NO_FLOOR, dtype: torch.dtype = torch.float32
) -> EigenvalueCorrectedShampooPreconditionerConfig:
    solver = (QREigendecompositionConfig if qr else EighEigendecompositionConfig)(
        rank_deficient_stability_config=stability
    )
    return EigenvalueCorrectedShampooPreconditionerConfig(
        amortized_computation_config=solver,
        factor_matrix_dtype=dtype,
        factor_matrix_eigenvectors_dtype=dtype,
        corrected_eigenvalues_dtype=dtype,
    )


def _epsilon(config: PreconditionerConfig) -> float:
    solver = getattr(config, "amortized_computation_config", None)
    pinv = isinstance(getattr(solver, "rank_deficient_stability_config", None), PseudoInverseConfig)
    return 0.0 if pinv else EPSILON


def trajectory(config: PreconditionerConfig, dtype: torch.dtype, steps: int) -> list[torch.Tensor]:
    """Parameters after ``steps`` steps on seeded random gradients (float64 values, cast)."""
    gen = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen, dtype=F64).to(dtype)) for s in SHAPES
    ]
    opt = DistributedShampoo(
        params,
        lr=0.01,
        betas=(0.9, 0.999),
        epsilon=_epsilon(config),
        max_preconditioner_dim=64,
        precondition_frequency=3,
        start_preconditioning_step=3,
        grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
        preconditioner_config=config,
    )
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=F64).to(dtype)
        opt.step()
    return [p.detach().to(F64) for p in params]


def initial() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen, dtype=F64) for s in SHAPES]


def relative(a: list[torch.Tensor], b: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    num = sum(float((x - y).norm() ** 2) for x, y in zip(a, b)) ** 0.5
    return num / sum(float((y - s).norm() ** 2) for y, s in zip(b, start)) ** 0.5


def _case_gradient(shape: tuple[int, ...], rank_one: bool, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + (0 if rank_one else step))
    if rank_one:
        left = torch.randn(shape[0], generator=gen, dtype=F64)
        return torch.outer(left, torch.randn(shape[1], generator=gen, dtype=F64))
    return torch.randn(shape, generator=gen, dtype=F64)


def last_direction(
    config: PreconditionerConfig, dtype: torch.dtype, shape: tuple[int, ...], rank_one: bool
) -> torch.Tensor:
    """The search direction of step 3 (fresh root every step, no grafting, lr 1)."""
    p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
    opt = DistributedShampoo(
        [p],
        lr=1.0,
        betas=(0.0, 0.999),
        epsilon=_epsilon(config),
        max_preconditioner_dim=64,
        precondition_frequency=1,
        start_preconditioning_step=1,
        preconditioner_config=config,
    )
    for step in range(3):
        before = p.detach().to(F64).clone()
        p.grad = _case_gradient(shape, rank_one, step).to(dtype)
        opt.step()
    return before - p.detach().to(F64)


def direction_error(config: PreconditionerConfig, reference: PreconditionerConfig) -> float:
    worst = 0.0
    for _, shape, rank_one in DIRECTION_CASES:
        got = last_direction(config, torch.float32, shape, rank_one)
        want = last_direction(reference, F64, shape, rank_one)
        worst = max(worst, float((got - want).norm() / want.norm()))
    return worst


Root = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def transformed_direction_error(transform: Root) -> float:
    """Worst error of one search direction ``X_L G X_R`` (factors ``G G^T``, ``G^T G`` of one
    gradient, accumulated in float32) where each float32 root is ``transform(factor, e)``;
    float64 plain roots of float64 factors as the reference. Every row's ``one step``."""
    worst = 0.0
    for _, shape, rank_one in DIRECTION_CASES:
        g = _case_gradient(shape, rank_one, 0)
        g = g.reshape(-1, 1) if len(shape) == 1 else g
        directions = []
        for dtype, root in ((torch.float32, transform), (F64, plain_root)):
            gd = g.to(dtype)
            exponent = torch.tensor([0.5 if len(shape) == 1 else 0.25], dtype=dtype)
            d = root(gd @ gd.T, exponent) @ gd
            if len(shape) == 2:
                d = d @ root(gd.T @ gd, exponent)
            directions.append(d.to(F64))
        worst = max(worst, float((directions[0] - directions[1]).norm() / directions[1].norm()))
    return worst


def plain_root(factor: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    return eigh_inverse_root(factor[None], exponent, EPSILON, stability=NO_FLOOR)[0][0]


def stable_root(stability: RankDeficientStabilityConfig) -> Root:
    epsilon = 0.0 if isinstance(stability, PseudoInverseConfig) else EPSILON

    def root(factor: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
        return eigh_inverse_root(factor[None], exponent, epsilon, stability=stability)[0][0]

    return root


def symmetrized_root(factor: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    return plain_root((factor + factor.T) / 2, exponent)


def rescaled_root(factor: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    scale = factor.trace()
    root, _ = eigh_inverse_root(
        (factor / scale)[None], exponent, EPSILON / float(scale), stability=NO_FLOOR
    )
    return root[0] * scale.pow(-exponent)


def float64_eigh_root(factor: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    return plain_root(factor.double(), exponent.double()).to(factor.dtype)


def newton_root(factor: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    order = round(1.0 / float(exponent))
    return coupled_newton_inverse_root(factor[None], order, EPSILON, 100, 1e-6)[0][0]


def gpt_small_cost_ms(solve: Callable[[torch.Tensor], object], scale: float = 1.0) -> float:
    """CPU milliseconds, one thread, of the amortized computation at GPT-small shapes: 14
    factors of 768 and 6 of 1024 (rank 768), timed once on one factor of each size and summed
    (times ``scale``). One thread and CPU time because on the shared 2-core machine both wall
    time and 2-thread CPU time (spinning threads) measured the neighbours: 2-thread figures of
    one computation varied 5x between runs, 1-thread ones by 10 %."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    total = 0.0
    gen = torch.Generator().manual_seed(1)
    for size, count in ((768, 14), (1024, 6)):
        g = torch.randn(size, 768, generator=gen)
        factor = (g @ g.T)[None]
        start = time.process_time()
        solve(factor)
        total += count * (time.process_time() - start)
    torch.set_num_threads(threads)
    return 1000.0 * total * scale


def eigh_cost(
    stability: RankDeficientStabilityConfig, double: bool = False
) -> Callable[[torch.Tensor], object]:
    def solve(factor: torch.Tensor) -> object:
        matrices = factor.double() if double else factor
        exponents = torch.full((1,), 0.25, dtype=matrices.dtype)
        return eigh_inverse_root(
            matrices, exponents, EPSILON, stability=stability, root_dtype=torch.float32
        )

    return solve


def newton_cost(factor: torch.Tensor) -> object:
    """10 of the iteration's 100 (the cap, which float32 reaches: its tolerance 1e-6 is near
    float32's resolution of ``M``); the table scales it by 10."""
    return coupled_newton_inverse_root(factor, 4, EPSILON, 10, 0.0)


def soap_cost(stability: RankDeficientStabilityConfig) -> Callable[[torch.Tensor], object]:
    return lambda factor: eigh_eigenbasis(factor, True, stability)


@dataclass
class Cost:
    """A solve whose GPT-small cost is measured once and shared by the rows using it."""

    solve: Callable[[torch.Tensor], object]
    scale: float = 1.0
    ms: float | None = None

    def __call__(self) -> float:
        if self.ms is None:
            self.ms = gpt_small_cost_ms(self.solve, self.scale)
        return self.ms


@dataclass
class Row:
    """One option: its config (None: not a config, measured on one step only), the float32
    root it computes from a float32 factor (None: it needs a float64 factor), and its cost."""

    name: str
    config: PreconditionerConfig | None
    root: Root | None
    cost: Cost


def main() -> None:
    torch.set_num_threads(2)
    logging.disable(logging.WARNING)
    start = initial()
    floor_64 = PerturbationConfig(eigenvalue_floor_rtol=64 * EPS32)
    floor_1e6 = PerturbationConfig(eigenvalue_floor_rtol=1e-6)
    default, pinv = PerturbationConfig(), PseudoInverseConfig()
    eigh32, eigh64 = Cost(eigh_cost(default)), Cost(eigh_cost(NO_FLOOR, double=True))
    rows = [
        Row("baseline: fp32 eigh, shift, no floor", shampoo(), plain_root, eigh32),
        Row("symmetrize before eigh", None, symmetrized_root, eigh32),
        Row("rescale by trace before eigh", None, rescaled_root, eigh32),
        Row("fp64 eigh of the fp32 factor", None, float64_eigh_root, eigh64),
        Row("fp64 factors + fp64 eigh (no floor)", shampoo(factor_dtype=F64), None, eigh64),
        Row("floor 64 eps (n eps at n = 64)", shampoo(floor_64), stable_root(floor_64), eigh32),
        Row("floor 1e-6", shampoo(floor_1e6), stable_root(floor_1e6), eigh32),
        Row("DEFAULT: floor sqrt(n) eps", shampoo(default), stable_root(default), eigh32),
        Row("pseudo-inverse (epsilon 0)", shampoo(pinv), stable_root(pinv), eigh32),
        Row(
            "coupled Newton (ridge sqrt(n) eps)",
            RootInvShampooPreconditionerConfig(amortized_computation_config=CoupledNewtonConfig()),
            newton_root,
            Cost(newton_cost, 10.0),
        ),
    ]
    print(
        f"root-inverse Shampoo: float32 vs float64 plain (epsilon={EPSILON}); cpu ms at GPT-small, "
        "1 thread"
    )
    print(
        f"{'option':40s} {'5 steps':>8s} {'20 steps':>9s} {'one step':>9s} {'3 steps':>9s} "
        f"{'cpu ms':>7s}"
    )
    references = {steps: trajectory(shampoo(factor_dtype=F64), F64, steps) for steps in (5, 20)}
    for row in rows:
        one_step = (
            f"{'-':>9s}"
            if row.root is None
            else f"{100 * transformed_direction_error(row.root):8.3f}%"
        )
        if row.config is None:
            cells = f"{'-':>8s} {'-':>9s} {one_step} {'-':>9s}"
        else:
            errors = [
                relative(trajectory(row.config, torch.float32, s), references[s], start)
                for s in (5, 20)
            ]
            direction = direction_error(row.config, shampoo(factor_dtype=F64))
            cells = (
                f"{100 * errors[0]:7.2f}% {100 * errors[1]:8.2f}% {one_step} "
                f"{100 * direction:8.3f}%"
            )
        print(f"{row.name:40s} {cells} {row.cost():7.0f}", flush=True)

    print(
        "\nSOAP: float32 vs float64 (epsilon=1e-12); 'vs same' compares with float64 of the same "
        "option"
    )
    print(
        f"{'option':40s} {'5 steps':>8s} {'20 steps':>9s} {'3 steps':>9s} {'vs same':>9s} "
        f"{'cpu ms':>7s}"
    )
    soap_costs = {False: Cost(soap_cost(NO_FLOOR)), True: Cost(soap_cost(default))}
    for qr in (False, True):
        plain64 = soap(qr, dtype=F64)
        plain_refs = {steps: trajectory(plain64, F64, steps) for steps in (5, 20)}
        # No pseudo-inverse row: SOAP's config refuses a PseudoInverseConfig (as the reference
        # library's does).
        for name, stability in (
            ("baseline", NO_FLOOR),
            ("DEFAULT floor, canonical null", default),
        ):
            config, same64 = soap(qr, stability), soap(qr, stability, F64)
            errors = [
                relative(trajectory(config, torch.float32, s), plain_refs[s], start)
                for s in (5, 20)
            ]
            same_error = relative(
                trajectory(config, torch.float32, 20), trajectory(same64, F64, 20), start
            )
            print(
                f"{('QR ' if qr else 'eigh ') + name:40s} {100 * errors[0]:7.2f}% "
                f"{100 * errors[1]:8.2f}% "
                f"{100 * direction_error(config, plain64):8.3f}% {100 * same_error:8.3f}% "
                f"{soap_costs[stability is not NO_FLOOR]():7.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
