"""``EighEigendecompositionConfig.tolerance``: a factor whose previous eigenbasis ``Q`` still has
``||B - diag(B)||_F <= tolerance ||B||_F`` (``B = Q^T F Q``) keeps ``Q``; otherwise ``eigh``.

With ``betas[1] = 0`` each factor is the current gradient's (``F_0 = G G^T``, ``F_1 = G^T G``), so
the test chooses exactly how far a factor moves: step 2 perturbs step 1's gradient slightly, step 3
draws a new one. The ratio is recomputed here in float64 from the saved state, and decides what
the optimizer must have done.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flat_shampoo_state import flat_state

from nanoshampoo.optim.shampoo import (
    DistributedShampoo,
    EigenvalueCorrectedShampooPreconditionerConfig,
    EighEigendecompositionConfig,
)

SHAPE = (5, 4)
TOLERANCE = 0.05


def _off_diagonal_ratio(factor: np.ndarray, basis: np.ndarray) -> float:
    projected = basis.T @ factor @ basis
    return float(
        np.linalg.norm(projected - np.diag(np.diag(projected))) / np.linalg.norm(projected)
    )


def _gradients() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    first = torch.randn(SHAPE, generator=generator, dtype=torch.float64)
    return [
        first,
        first + 1e-3 * torch.randn(SHAPE, generator=generator, dtype=torch.float64),
        torch.randn(SHAPE, generator=generator, dtype=torch.float64),
    ]


def _run(tolerance: float) -> list[dict[str, np.ndarray]]:
    """Per step: ``{"factor.i", "basis.i"}`` of the block's two dims after the step (float64)."""
    param = torch.nn.Parameter(torch.zeros(SHAPE, dtype=torch.float64))
    config = EigenvalueCorrectedShampooPreconditionerConfig(
        amortized_computation_config=EighEigendecompositionConfig(tolerance=tolerance),
        factor_matrix_dtype=torch.float64,
        factor_matrix_eigenvectors_dtype=torch.float64,
        corrected_eigenvalues_dtype=torch.float64,
        use_symmetric_packing=False,  # full factors to read
    )
    opt = DistributedShampoo(
        [param],
        lr=0.01,
        betas=(0.0, 0.0),
        epsilon=1e-12,
        max_preconditioner_dim=5,
        precondition_frequency=1,
        preconditioner_config=config,
    )
    history = []
    for grad in _gradients():
        param.grad = grad
        opt.step()
        state = flat_state(opt.state_dict())[0]
        history.append(
            {
                f"{kind}.{dim}": state[f"block_0.shampoo.{key}.{dim}"].numpy().copy()
                for kind, key in (
                    ("factor", "factor_matrices"),
                    ("basis", "factor_matrices_eigenvectors"),
                )
                for dim in (0, 1)
            }
        )
    return history


@pytest.mark.parametrize("dim", [0, 1])
def test_a_basis_within_the_tolerance_is_kept_and_one_outside_is_recomputed(dim: int) -> None:
    history = _run(TOLERANCE)
    for before, after in zip(history, history[1:]):
        factor, previous, basis = (
            after[f"factor.{dim}"],
            before[f"basis.{dim}"],
            after[f"basis.{dim}"],
        )
        if _off_diagonal_ratio(factor, previous) <= TOLERANCE:
            np.testing.assert_array_equal(basis, previous)
        else:
            assert _off_diagonal_ratio(factor, basis) < 1e-12
    # The data exercise both branches: step 2 keeps, step 3 recomputes.
    assert _off_diagonal_ratio(history[1][f"factor.{dim}"], history[0][f"basis.{dim}"]) <= TOLERANCE
    assert _off_diagonal_ratio(history[2][f"factor.{dim}"], history[1][f"basis.{dim}"]) > TOLERANCE


@pytest.mark.parametrize("dim", [0, 1])
def test_zero_tolerance_recomputes_every_time(dim: int) -> None:
    history = _run(0.0)
    for step in history:
        assert _off_diagonal_ratio(step[f"factor.{dim}"], step[f"basis.{dim}"]) < 1e-12
    assert not np.array_equal(history[1][f"basis.{dim}"], history[0][f"basis.{dim}"])
