"""A lower root frequency for the largest factors (``large_factor_dim``,
``large_factor_frequency_multiplier``), and the warm-started roots and this schedule under DDP.

Specification (``ShampooPreconditionerConfig``, ``KroneckerFactoredPreconditioner.solved_rows``),
with frequency ``f``, start step ``s`` and multiplier ``m``: every factor's root at ``s``; then
the small factors' as before, the large factors' only at multiples of ``f m`` (or, with
``amortize_roots``, large factor ``r`` of ``f m`` equal ones at the steps ``t > s`` with
``t % (f m) == r``). The expected schedules below are written out by hand.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DDPDistributedConfig,
    DistributedShampoo,
    RootInvShampooPreconditionerConfig,
    SingleDeviceDistributedConfig,
    WarmStartedEigenConfig,
)
from nanoshampoo.optim.shampoo.preconditioner.matrix_roots import eigh_inverse_root
from nanoshampoo.optim.shampoo.preconditioner.shampoo_preconditioner import (
    ShampooPreconditioner,
)
from nanoshampoo.testing.distributed import run_on_gloo

torch.set_num_threads(1)

FREQUENCY, MULTIPLIER, STEPS = 3, 2, 14
# Vectors: one factor each. Three small (12) and six large (20) factors, one pool each.
SHAPES = [(12,)] * 3 + [(20,)] * 6


def _optimizer(
    params: list[torch.nn.Parameter], amortize: bool, **config: Any
) -> DistributedShampoo:
    return DistributedShampoo(
        params,
        lr=0.01,
        betas=(0.0, 0.99),
        epsilon=1e-10,
        max_preconditioner_dim=32,
        precondition_frequency=FREQUENCY,
        amortize_roots=amortize,
        grafting_config=AdamPreconditionerConfig(),
        preconditioner_config=RootInvShampooPreconditionerConfig(**config),
    )


def _params(dtype: torch.dtype = torch.float64) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, dtype=dtype, generator=gen)) for s in SHAPES]


def _solved_per_step(
    amortize: bool, monkeypatch: pytest.MonkeyPatch
) -> dict[int, set[tuple[int, int]]]:
    """Run STEPS steps; per step, the (factor size, pool row) pairs whose root was computed,
    each checked against the eigh root of that step's bias-corrected factor."""
    solved: dict[int, set[tuple[int, int]]] = {}
    original = ShampooPreconditioner._solve
    current = {"step": 0}

    def recording(self: Any, key: Any, matrices: torch.Tensor, rows: torch.Tensor | None) -> Any:
        indices = range(matrices.shape[0]) if rows is None else rows.tolist()
        solved.setdefault(current["step"], set()).update((key[0], r) for r in indices)
        return original(self, key, matrices, rows)

    monkeypatch.setattr(ShampooPreconditioner, "_solve", recording)
    params = _params()
    opt = _optimizer(
        params,
        amortize,
        large_factor_dim=16,
        large_factor_frequency_multiplier=MULTIPLIER,
        factor_matrix_dtype=torch.float64,
    )
    preconditioner = opt._runtimes[0].preconditioner
    gen = torch.Generator().manual_seed(1)
    for step in range(1, STEPS + 1):
        current["step"] = step
        for p in params:
            p.grad = torch.randn(p.shape, dtype=p.dtype, generator=gen)
        opt.step()
        for size, row in solved.get(step, ()):
            pool = preconditioner._factors.pools[(size, torch.float64)]
            want, _ = eigh_inverse_root(
                preconditioner._factors.matrices(pool, torch.tensor([row]), divisor=1 - 0.99**step),
                torch.tensor([0.5], dtype=torch.float64),
                1e-10,
            )
            root = preconditioner._results[(size, torch.float64)][row]
            torch.testing.assert_close(root, want[0], rtol=1e-9, atol=0.0)
    return solved


def test_large_factors_get_their_root_every_frequency_times_multiplier_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    solved = _solved_per_step(amortize=False, monkeypatch=monkeypatch)
    small = {(12, r) for r in range(3)}
    large = {(20, r) for r in range(6)}
    # Start step 3: everything; then every 3 steps the small ones, every 6 the large ones too.
    assert solved == {3: small | large, 6: small | large, 9: small, 12: small | large}


def test_amortized_large_factors_are_spread_over_frequency_times_multiplier_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    solved = _solved_per_step(amortize=True, monkeypatch=monkeypatch)
    # Equal sizes: small row r is share r of 3, large row r share r of 6 (balanced, ties low).
    expected = {3: {(12, r) for r in range(3)} | {(20, r) for r in range(6)}}
    for t in range(4, STEPS + 1):
        expected[t] = {(12, t % 3), (20, t % 6)}
    assert solved == expected


def test_a_multiplier_of_one_or_no_large_dim_is_the_plain_schedule() -> None:
    gen = torch.Generator().manual_seed(2)
    grads = [[torch.randn(s, dtype=torch.float64, generator=gen) for s in SHAPES] for _ in range(8)]
    finals = []
    for config in (
        {},
        dict(large_factor_dim=16),
        dict(large_factor_frequency_multiplier=4),
        dict(large_factor_dim=21, large_factor_frequency_multiplier=4),
    ):
        params = _params()
        opt = _optimizer(params, False, **config)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        finals.append([p.detach().clone() for p in params])
    for other in finals[1:]:
        for a, b in zip(finals[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(large_factor_dim=-1), "large_factor_dim"),
        (dict(large_factor_dim=True), "large_factor_dim"),
        (dict(large_factor_dim=2.0), "large_factor_dim"),
        (dict(large_factor_frequency_multiplier=0), "large_factor_frequency_multiplier"),
        (dict(large_factor_frequency_multiplier=1.5), "large_factor_frequency_multiplier"),
    ],
)
def test_invalid_fields_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RootInvShampooPreconditionerConfig(**kwargs)


# ---------------------------------------------------------------------------------------------
# DDP (world 2) against one device
# ---------------------------------------------------------------------------------------------

DDP_SHAPES = [(6, 5), (7,), (3, 4, 5), (16, 5), (10, 7), (20, 3)]
DDP_CONFIGS: dict[str, dict[str, Any]] = {
    "warm_qr": dict(amortized_computation_config=WarmStartedEigenConfig()),
    "large_factors": dict(large_factor_dim=7, large_factor_frequency_multiplier=2),
    "warm_qr_large_factors": dict(
        amortized_computation_config=WarmStartedEigenConfig(),
        large_factor_dim=7,
        large_factor_frequency_multiplier=2,
    ),
}


def _ddp_run(config: Any, name: str, amortize: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in DDP_SHAPES]
    opt = DistributedShampoo(
        params,
        lr=0.05,
        betas=(0.9, 0.999),
        epsilon=1e-8,
        max_preconditioner_dim=8,
        precondition_frequency=2,
        amortize_roots=amortize,
        distributed_config=config,
        grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
        preconditioner_config=RootInvShampooPreconditionerConfig(**DDP_CONFIGS[name]),
    )
    for step in range(1, 11):
        step_gen = torch.Generator().manual_seed(1000 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=step_gen)
        opt.step()
    return [p.detach() for p in params]


def _ddp_body(rank: int, world_size: int) -> dict[str, list[torch.Tensor]]:
    results = {name: _ddp_run(DDPDistributedConfig(), name, False) for name in DDP_CONFIGS}
    results["amortized"] = _ddp_run(DDPDistributedConfig(), "warm_qr_large_factors", True)
    return results


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_world_2_equals_single_device() -> None:
    """Each rank solves its own blocks' roots with the same maths, so DDP equals one device.
    With amortize_roots the shares are assigned per rank (over its own factors), so that run
    is only checked to be identical on both ranks and finite."""
    results = run_on_gloo(_ddp_body, 2)
    for name in DDP_CONFIGS:
        want = _ddp_run(SingleDeviceDistributedConfig(), name, False)
        for result in results:
            for got, expected in zip(result[name], want, strict=True):
                torch.testing.assert_close(got, expected, rtol=0.0, atol=1e-6, msg=name)
    for a, b in zip(results[0]["amortized"], results[1]["amortized"], strict=True):
        assert torch.equal(a, b) and bool(torch.isfinite(a).all())
