"""SOAP with ``use_symmetric_packing``: factors stored as packed upper triangles."""

from __future__ import annotations

import pytest
import torch
from flat_shampoo_state import flat_state

from nanoshampoo.optim.shampoo import (
    DistributedShampoo,
    EigenvalueCorrectedShampooPreconditionerConfig,
    QREigendecompositionConfig,
)


def run_soap(packed: bool, qr: bool) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 5, dtype=torch.float64))
    solver = {"amortized_computation_config": QREigendecompositionConfig()} if qr else {}
    opt = DistributedShampoo(
        [w],
        lr=0.01,
        betas=(0.9, 0.95),
        epsilon=1e-8,
        precondition_frequency=2,
        max_preconditioner_dim=8,
        preconditioner_config=EigenvalueCorrectedShampooPreconditionerConfig(
            use_symmetric_packing=packed, **solver
        ),
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(7):
        w.grad = torch.randn(6, 5, generator=gen, dtype=torch.float64)
        opt.step()
    return w.detach().clone(), flat_state(opt.state_dict())[0]


def test_packed_factors_hold_the_upper_triangle_and_eigh_steps_are_identical() -> None:
    full, full_state = run_soap(packed=False, qr=False)
    packed, packed_state = run_soap(packed=True, qr=False)
    assert torch.equal(packed, full)
    for dim, n in ((0, 6), (1, 5)):
        stored = packed_state[f"block_0.shampoo.factor_matrices.{dim}"]
        rows, cols = torch.triu_indices(n, n)
        assert torch.equal(stored, full_state[f"block_0.shampoo.factor_matrices.{dim}"][rows, cols])


def test_packed_qr_refreshes_agree_to_rounding() -> None:
    full, _ = run_soap(packed=False, qr=True)
    packed, _ = run_soap(packed=True, qr=True)
    assert (packed - full).abs().max() <= 1e-6 * full.abs().max()


def test_a_non_bool_is_refused() -> None:
    with pytest.raises(ValueError, match="use_symmetric_packing"):
        EigenvalueCorrectedShampooPreconditionerConfig(use_symmetric_packing=1)
