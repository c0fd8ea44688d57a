"""Eigendecomposed Shampoo: the root rebuilt from a cached ``(Q, lambda)`` is root-inverse
Shampoo's.

Against a float64 dense reference (``nanoshampoo.testing.shampoo_reference``, and an explicit
Kronecker product for a matrix), against root-inverse Shampoo with ``EigenConfig`` in float32,
and on rank-deficient float32 factors at ``epsilon=1e-12``.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from flat_shampoo_state import flat_state

from nanoshampoo.optim.shampoo import (
    DistributedShampoo,
    EigenConfig,
    EigendecomposedShampooPreconditionerConfig,
    EighEigendecompositionConfig,
    PseudoInverseConfig,
    QREigendecompositionConfig,
    RootInvShampooPreconditionerConfig,
    WarmStartedEigenConfig,
)
from nanoshampoo.optim.shampoo.config_checks import error_field
from nanoshampoo.optim.shampoo.utils.shampoo_utils import unpack_upper_triangular
from nanoshampoo.testing.shampoo_reference import run_reference

torch.set_num_threads(1)

F64 = dict(
    factor_matrix_dtype=torch.float64,
    factor_matrix_eigenvectors_dtype=torch.float64,
    factor_matrix_eigenvalues_dtype=torch.float64,
)


def _run(
    config: Any,
    shapes: list[tuple[int, ...]],
    dtype: torch.dtype,
    steps: int,
    seed: int = 0,
    rank_one: bool = False,
    **kwargs: Any,
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], list[torch.Tensor]]:
    """``(initial weights, gradients, final weights)`` of ``steps`` steps of ``config``."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in shapes]
    initial = [p.detach().clone() for p in params]
    grads = []
    for _ in range(steps):
        step = []
        for shape in shapes:
            g = torch.randn(shape, generator=gen, dtype=dtype)
            if rank_one and len(shape) == 2:
                g = torch.outer(g[:, 0], g[0]) * (
                    torch.arange(shape[0], dtype=dtype) > 0
                ).unsqueeze(1)
            step.append(g)
        grads.append(step)
    options = dict(
        lr=0.05,
        betas=(0.9, 0.95),
        epsilon=1e-12,
        max_preconditioner_dim=8,
        precondition_frequency=2,
    )
    options.update(kwargs)
    opt = DistributedShampoo(params, preconditioner_config=config, **options)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
        assert all(torch.isfinite(p).all() for p in params)
    return initial, grads, [p.detach().clone() for p in params]


@pytest.mark.parametrize(
    ("solver", "tolerance"),
    [
        (EighEigendecompositionConfig(), 1e-9),
        (EigenConfig(), 1e-9),
        # QR iterations converge linearly in the eigenvalue ratios: an approximate basis.
        (QREigendecompositionConfig(max_iterations=50, tolerance=1e-8), 1e-4),
    ],
    ids=["eigh", "eigen_config", "qr"],
)
@pytest.mark.parametrize("shape", [(6, 5), (3, 4, 5)])
def test_matches_float64_reference(solver: Any, tolerance: float, shape: tuple[int, ...]) -> None:
    """Full-rank factors from step 2 (the first decomposition): a unique root."""
    config = EigendecomposedShampooPreconditionerConfig(amortized_computation_config=solver, **F64)
    initial, grads, final = _run(config, [shape], torch.float64, steps=7)
    expected = run_reference(
        initial[0].numpy(),
        [g[0].numpy() for g in grads],
        lr=0.05,
        betas=(0.9, 0.95),
        epsilon=1e-12,
        frequency=2,
        start=2,
    )
    assert np.linalg.norm(final[0].numpy() - expected) / np.linalg.norm(expected) < tolerance


def _matrix_root(a: np.ndarray, exponent: float, epsilon: float) -> np.ndarray:
    lam, q = np.linalg.eigh(a)
    return (q * (np.maximum(lam, 0.0) + epsilon) ** (-exponent)) @ q.T


def test_one_step_is_the_dense_kronecker_product() -> None:
    """``vec(P) = (X_L kron X_R) vec(G)`` (row-major vec) for the first preconditioned step."""
    config = EigendecomposedShampooPreconditionerConfig(**F64)
    gen = torch.Generator().manual_seed(3)
    param = torch.nn.Parameter(torch.randn(6, 5, generator=gen, dtype=torch.float64))
    w0 = param.detach().numpy().copy()
    g = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    opt = DistributedShampoo(
        [param],
        lr=1.0,
        betas=(0.0, 1.0),
        epsilon=1e-3,
        max_preconditioner_dim=8,
        precondition_frequency=1,
        preconditioner_config=config,
    )
    param.grad = g.clone()
    opt.step()
    gn = g.numpy()
    left, right = _matrix_root(gn @ gn.T, 0.25, 1e-3), _matrix_root(gn.T @ gn, 0.25, 1e-3)
    expected = w0 - (np.kron(left, right) @ gn.reshape(-1)).reshape(6, 5)
    assert np.abs(param.detach().numpy() - expected).max() / np.abs(expected).max() < 1e-10


@pytest.mark.parametrize("rank_one", [False, True])
def test_same_steps_as_root_inverse_shampoo_in_float32(rank_one: bool) -> None:
    shapes = [(6, 5), (7,), (3, 4, 5), (10, 3)]
    _, _, ours = _run(
        EigendecomposedShampooPreconditionerConfig(), shapes, torch.float32, 12, rank_one=rank_one
    )
    _, _, roots = _run(
        RootInvShampooPreconditionerConfig(), shapes, torch.float32, 12, rank_one=rank_one
    )
    for a, b in zip(ours, roots):
        assert torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b) < 1e-5


@pytest.mark.parametrize(
    ("solver", "epsilon"),
    [
        (EighEigendecompositionConfig(), 1e-12),
        (QREigendecompositionConfig(), 1e-12),
        (EighEigendecompositionConfig(rank_deficient_stability_config=PseudoInverseConfig()), 0.0),
    ],
    ids=["eigh", "qr", "pseudo_inverse"],
)
def test_rank_deficient_float32_never_fails(solver: Any, epsilon: float) -> None:
    """Rank-1 gradients with a zero row, a vector, a wide block: finite, no failed solve."""
    config = EigendecomposedShampooPreconditionerConfig(
        amortized_computation_config=solver, num_tolerated_failed_amortized_computations=0
    )
    _run(
        config,
        [(6, 5), (7,), (2, 8)],
        torch.float32,
        20,
        rank_one=True,
        epsilon=epsilon,
        precondition_frequency=1,
    )


def test_state_holds_eigenvectors_and_eigenvalues_and_round_trips() -> None:
    config = EigendecomposedShampooPreconditionerConfig(
        factor_matrix_eigenvalues_dtype=torch.float64
    )
    gen = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(6, 5, generator=gen))]
    opt = DistributedShampoo(
        params, max_preconditioner_dim=8, precondition_frequency=2, preconditioner_config=config
    )
    grads = [torch.randn(6, 5, generator=gen) for _ in range(4)]
    for g in grads[:3]:
        params[0].grad = g.clone()
        opt.step()
    state = flat_state(opt.state_dict())[0]
    assert state["block_0.shampoo.factor_matrices_eigenvalues.0"].dtype == torch.float64
    assert state["block_0.shampoo.factor_matrices_eigenvalues.0"].shape == (6,)
    assert state["block_0.shampoo.factor_matrices_eigenvectors.1"].shape == (5, 5)
    copy = [torch.nn.Parameter(params[0].detach().clone())]
    fresh = DistributedShampoo(
        copy, max_preconditioner_dim=8, precondition_frequency=2, preconditioner_config=config
    )
    fresh.load_state_dict(opt.state_dict())
    for p, g in ((params[0], grads[3]), (copy[0], grads[3])):
        p.grad = g.clone()
    opt.step()
    fresh.step()
    assert torch.equal(params[0], copy[0])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(inv_factor_matrix_dtype=torch.bfloat16), "inv_factor_matrix_dtype"),
        (
            dict(amortized_computation_config=WarmStartedEigenConfig()),
            "amortized_computation_config",
        ),
        (dict(factor_matrix_eigenvalues_dtype=torch.int32), "factor_matrix_eigenvalues_dtype"),
        (dict(factor_matrix_eigenvectors_dtype="float32"), "factor_matrix_eigenvectors_dtype"),
        (dict(use_trace_scaling=True, trace_scaling_exponent=0.0), "trace_scaling_exponent"),
    ],
)
def test_invalid_config_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as info:
        EigendecomposedShampooPreconditionerConfig(**kwargs)
    assert re.match(field, error_field(info.value)), str(info.value)


def test_eigh_tolerance_keeps_the_basis_and_re_estimates_the_eigenvalues() -> None:
    """``tolerance=1`` accepts any previous basis: after the first decomposition ``Q`` stays
    (its columns re-sorted), and ``lambda`` becomes ``diag(Q^T (F / bc2 + eps I) Q)``
    (ascending) of the new factor."""
    solver = EighEigendecompositionConfig(tolerance=1.0, eigendecomposition_offload_device="cpu")
    config = EigendecomposedShampooPreconditionerConfig(amortized_computation_config=solver, **F64)
    gen = torch.Generator().manual_seed(7)
    param = torch.nn.Parameter(torch.randn(6, 5, generator=gen, dtype=torch.float64))
    opt = DistributedShampoo(
        [param],
        betas=(0.0, 0.9),
        epsilon=1e-3,
        max_preconditioner_dim=8,
        precondition_frequency=2,
        preconditioner_config=config,
    )
    bases = []
    for _ in range(4):
        param.grad = torch.randn(6, 5, generator=gen, dtype=torch.float64)
        opt.step()
        bases.append(
            flat_state(opt.state_dict())[0][
                "block_0.shampoo.factor_matrices_eigenvectors.0"
            ].clone()
        )
    # The kept columns are only re-ordered (ascending by the new estimates): a permutation.
    overlap = (bases[3].T @ bases[1]).abs()
    assert torch.allclose(overlap.amax(dim=1), torch.ones(6, dtype=torch.float64), atol=1e-12)
    assert not torch.equal(bases[0], bases[1])
    state = flat_state(opt.state_dict())[0]
    # Factors are stored as packed upper triangles (use_symmetric_packing, on by default).
    stored = unpack_upper_triangular(state["block_0.shampoo.factor_matrices.0"], 6)
    factor = stored / (1 - 0.9**4) + 1e-3 * torch.eye(6, dtype=torch.float64)
    q = bases[3]
    expected = torch.sort((q.T @ factor @ q).diagonal()).values
    assert torch.allclose(
        state["block_0.shampoo.factor_matrices_eigenvalues.0"], expected, rtol=1e-12
    )
