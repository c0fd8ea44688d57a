"""SOAP before its first eigenbasis, without grafting: diagonal Adam/AdaGrad in the identity basis.

Until the start step the eigenbases are the identity, so the corrected eigenvalues are the
EMA (or sum) of the squared gradient and the step is ``Gbar / (sqrt(D / bc2) + eps)``: exactly
``torch.optim.Adam`` (bias-corrected) or ``torch.optim.Adagrad``. At the start step the first
eigenbasis is computed and ``D`` is carried into it (not reset), as in the reference library.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flat_shampoo_state import flat_state

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DistributedShampoo,
    EigenvalueCorrectedShampooPreconditionerConfig,
    EighEigendecompositionConfig,
    QREigendecompositionConfig,
    WeightDecayType,
)

torch.set_num_threads(1)

SHAPES = [(6, 5), (7,), (3, 4, 5)]
SOLVERS = {"eigh": EighEigendecompositionConfig, "qr": QREigendecompositionConfig}


def _params(
    seed: int, dtype: torch.dtype = torch.float32, shapes: list = SHAPES
) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in shapes]


def _grads(
    seed: int, steps: int, dtype: torch.dtype, rank_one: bool = False, shapes: list = SHAPES
) -> list[list[torch.Tensor]]:
    """Random gradients; ``rank_one``: every matrix gradient has rank 1 and a zero row."""
    gen = torch.Generator().manual_seed(seed + 100)
    steps_grads = []
    for _ in range(steps):
        step = []
        for shape in shapes:
            g = torch.randn(shape, generator=gen, dtype=dtype)
            if rank_one and len(shape) == 2:
                g = torch.outer(
                    torch.randn(shape[0], generator=gen, dtype=dtype),
                    torch.randn(shape[1], generator=gen, dtype=dtype),
                )
                g[0] = 0.0
            step.append(g)
        steps_grads.append(step)
    return steps_grads


def _soap(params: list[torch.nn.Parameter], solver: str, **kwargs: object) -> DistributedShampoo:
    config = EigenvalueCorrectedShampooPreconditionerConfig(
        amortized_computation_config=SOLVERS[solver]()
    )
    return DistributedShampoo(
        params,
        max_preconditioner_dim=8,
        preconditioner_config=config,
        grafting_config=None,
        **kwargs,
    )


def _relative(a: list[torch.nn.Parameter], b: list[torch.nn.Parameter]) -> float:
    return max(
        (
            torch.linalg.vector_norm(x.detach() - y.detach()) / torch.linalg.vector_norm(y.detach())
        ).item()
        for x, y in zip(a, b)
    )


def _step_both(
    ours: DistributedShampoo, torch_opt: torch.optim.Optimizer, a: list, b: list, grads: list
) -> None:
    for p, q, g in zip(a, b, grads):
        p.grad, q.grad = g.clone(), g.clone()
    ours.step()
    torch_opt.step()


@pytest.mark.parametrize("solver", sorted(SOLVERS))
@pytest.mark.parametrize("epsilon", [1e-8, 1e-12])
@pytest.mark.parametrize("rank_one", [False, True])
def test_matches_torch_adam_before_the_start_step(
    solver: str, epsilon: float, rank_one: bool
) -> None:
    ours_params, torch_params = _params(0), _params(0)
    ours = _soap(
        ours_params,
        solver,
        lr=1e-2,
        betas=(0.9, 0.999),
        epsilon=epsilon,
        weight_decay=1e-3,
        weight_decay_type=WeightDecayType.DECOUPLED,
        precondition_frequency=100,
    )
    reference = torch.optim.AdamW(
        torch_params, lr=1e-2, betas=(0.9, 0.999), eps=epsilon, weight_decay=1e-3
    )
    for t, grads in enumerate(_grads(0, 12, torch.float32, rank_one), start=1):
        _step_both(ours, reference, ours_params, torch_params, grads)
        assert all(torch.isfinite(p).all() for p in ours_params)
        assert _relative(ours_params, torch_params) <= 1e-6, t


@pytest.mark.parametrize("solver", sorted(SOLVERS))
def test_matches_torch_adagrad_with_beta2_one(solver: str) -> None:
    ours_params, torch_params = _params(1), _params(1)
    ours = _soap(
        ours_params, solver, lr=0.1, betas=(0.0, 1.0), epsilon=1e-10, precondition_frequency=50
    )
    reference = torch.optim.Adagrad(torch_params, lr=0.1, eps=1e-10)
    for t, grads in enumerate(_grads(1, 12, torch.float32), start=1):
        _step_both(ours, reference, ours_params, torch_params, grads)
        assert _relative(ours_params, torch_params) <= 1e-6, t


def test_grafting_still_runs_alone_before_the_start_step() -> None:
    """With grafting, steps before ``s`` are the grafting method's (Adam here), SOAP unused."""
    ours_params, torch_params = _params(2), _params(2)
    ours = DistributedShampoo(
        ours_params,
        lr=1e-2,
        betas=(0.0, 0.999),
        epsilon=1e-12,
        max_preconditioner_dim=8,
        precondition_frequency=20,
        preconditioner_config=EigenvalueCorrectedShampooPreconditionerConfig(),
        grafting_config=AdamPreconditionerConfig(beta2=0.99, epsilon=1e-8),
    )
    reference = torch.optim.Adam(torch_params, lr=1e-2, betas=(0.0, 0.99), eps=1e-8)
    for grads in _grads(2, 6, torch.float32):
        _step_both(ours, reference, ours_params, torch_params, grads)
    assert _relative(ours_params, torch_params) <= 1e-6


def _contract(x: np.ndarray, matrix: np.ndarray, dim: int) -> np.ndarray:
    return np.moveaxis(np.tensordot(matrix, x, axes=([1], [dim])), 0, dim)


def _reference_run(
    weights: list[np.ndarray],
    grads: list[list[np.ndarray]],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    start: int,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Float64 loop: Adam on D in the identity basis for t < s; at t == s the eigenbases of the
    factors (ascending, as the reference library's ``eigh``), and D (accumulated so far in the
    identity basis) carried into them by position, unchanged."""
    b1, b2 = betas
    weights = [w.copy() for w in weights]
    factors = [[np.zeros((n, n)) for n in w.shape] for w in weights]
    bases = [[np.eye(n) for n in w.shape] for w in weights]
    d = [np.zeros(w.shape) for w in weights]
    m = [np.zeros(w.shape) for w in weights]
    for t, step in enumerate(grads, start=1):
        for i, g in enumerate(step):
            for dim in range(g.ndim):
                unfolded = np.moveaxis(g, dim, 0).reshape(g.shape[dim], -1)
                factors[i][dim] = b2 * factors[i][dim] + (1 - b2) * unfolded @ unfolded.T
                if t == start:  # ascending: coordinate j of D goes to the j-th smallest's column
                    bases[i][dim] = np.linalg.eigh(factors[i][dim] / (1 - b2**t))[1]
            rotated = g
            for dim, q in enumerate(bases[i]):
                rotated = _contract(rotated, q.T, dim)
            d[i] = b2 * d[i] + (1 - b2) * rotated**2
            m[i] = b1 * m[i] + (1 - b1) * g
            x = m[i] / (1 - b1**t)
            for dim, q in enumerate(bases[i]):
                x = _contract(x, q.T, dim)
            x = x / (np.sqrt(d[i] / (1 - b2**t)) + eps)
            for dim, q in enumerate(bases[i]):
                x = _contract(x, q, dim)
            weights[i] = weights[i] - lr * x
    return weights, d


def test_corrected_eigenvalues_carry_into_the_first_eigenbasis_float64() -> None:
    """Steps 1..s-1 in the identity basis, then s and s+1 in the first eigenbasis, float64.

    Shapes whose factors are full rank at ``s`` (a rank-deficient factor has no unique basis).
    """
    start, steps, shapes = 4, 5, [(6, 5), (3, 4, 5)]
    params = _params(3, torch.float64, shapes)
    grads = _grads(3, steps, torch.float64, shapes=shapes)
    expected, corrected = _reference_run(
        [p.detach().numpy().copy() for p in params],
        [[g.numpy() for g in s] for s in grads],
        lr=0.05,
        betas=(0.9, 0.95),
        eps=1e-12,
        start=start,
    )
    config = EigenvalueCorrectedShampooPreconditionerConfig(
        factor_matrix_dtype=torch.float64,
        factor_matrix_eigenvectors_dtype=torch.float64,
        corrected_eigenvalues_dtype=torch.float64,
    )
    opt = DistributedShampoo(
        params,
        lr=0.05,
        betas=(0.9, 0.95),
        epsilon=1e-12,
        max_preconditioner_dim=8,
        precondition_frequency=start,
        preconditioner_config=config,
    )
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    for p, e in zip(params, expected):
        assert np.linalg.norm(p.detach().numpy() - e) / np.linalg.norm(e) < 1e-9
    state = flat_state(opt.state_dict())
    for index, d in enumerate(corrected):
        ours = state[index]["block_0.shampoo.corrected_eigenvalues"].numpy()
        # A state dict indexes D by ascending columns, as the loop (and the reference) does;
        # the live state keeps them descending.
        assert np.abs(ours - d).max() / np.abs(d).max() < 1e-9
