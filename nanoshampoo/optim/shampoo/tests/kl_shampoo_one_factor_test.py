"""KL-Shampoo on blocks with one factor (1-D parameters, tensors merged into one dim) and on
merged 2-D blocks, against the float64 loop of the equations (``shampoo_reference``, ``kl=True``).

A block with one factor has no other factor to precondition ``G`` with, so ``H = G`` and its
KL-Shampoo steps are classic Shampoo's (``F <- b2 F + w g g^T``, ``X = (F / bc2 + eps I)^(-1/2)``),
as in the well-known library, whose KL outer product contracts no dim for an order-1 block.
Merging is a reshape, so the loop runs on the parameter reshaped to the block.

Why the first roots here come from full-rank factors (or from a pseudo-inverse): a 1-D factor
after ``t`` steps has rank ``t``; at ``epsilon = 1e-12`` its null space gets the weight
``(1e-12 + noise)^(-1/2) ~ 1e6``, where the noise is ``eigh``'s float64 rounding of the zero
eigenvalues (``~1e-16 lambda_max``). The step then depends on that rounding at the ``1e-4``
level: the loop itself moves by 2.8e-4 when its gradients are perturbed by 1e-15 (relative),
and the loop, this library and the well-known library differ pairwise by 1.5e-4..8e-4 (also
for classic Shampoo). That comparison measures rounding, not the algorithm; a pseudo-inverse
(zero weight on the null space) or a full-rank factor makes the step well defined.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from kl_shampoo_test import _steps  # the neighbouring test module (pytest puts its dir on sys.path)

from nanoshampoo.optim.shampoo import (
    EigenConfig,
    EigendecomposedKLShampooPreconditionerConfig,
    EighEigendecompositionConfig,
    PseudoInverseConfig,
    QREigendecompositionConfig,
    RootInvKLShampooPreconditionerConfig,
    RootInvShampooPreconditionerConfig,
)
from nanoshampoo.testing.shampoo_reference import run_reference

torch.set_num_threads(1)

FLOAT64 = {"factor_matrix_dtype": torch.float64}
EIG64 = {
    **FLOAT64,
    "factor_matrix_eigenvectors_dtype": torch.float64,
    "factor_matrix_eigenvalues_dtype": torch.float64,
}


def kl_config(kind: str, pseudo_inverse: bool = False, **kwargs: Any) -> Any:
    """A float64 KL-Shampoo config of ``kind`` (``root_inv`` or ``eigendecomposed``)."""
    stability = {"rank_deficient_stability_config": PseudoInverseConfig()} if pseudo_inverse else {}
    if kind == "root_inv":
        return RootInvKLShampooPreconditionerConfig(
            amortized_computation_config=EigenConfig(**stability), **FLOAT64, **kwargs
        )
    return EigendecomposedKLShampooPreconditionerConfig(
        amortized_computation_config=EighEigendecompositionConfig(**stability), **EIG64, **kwargs
    )


# (parameter shape, max_preconditioner_dim, the one block's shape, precondition_frequency):
# the frequency puts the first root where every factor is full rank (and not near singular:
# a 7x7 sum of 7 random outer products can be, which moved the tight comparison to 2e-10).
CASES = {
    "1d": ((7,), 8, (7,), 10),
    "3d_merged_to_1d": ((2, 2, 3), 12, (12,), 16),
    "3d_merged_to_2d": ((3, 4, 5), 12, (12, 5), 3),
    "2d": ((6, 5), 8, (6, 5), 2),
}


def _run(
    config: Any,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    steps: int,
    max_dim: int,
    frequency: int,
    epsilon: float = 1e-12,
    rank_one: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """``(W_0, gradients, W_steps)``: the KL tests' steps, ungrafted, first root at
    ``frequency``."""
    return _steps(
        config,
        shape,
        dtype,
        steps,
        rank_one=rank_one,
        epsilon=epsilon,
        max_preconditioner_dim=max_dim,
        precondition_frequency=frequency,
        start_preconditioning_step=frequency,
        grafting_config=None,
    )


def _loop(
    initial: torch.Tensor,
    grads: list[torch.Tensor],
    block: tuple[int, ...],
    frequency: int,
    **kwargs: Any,
) -> np.ndarray:
    """The loop on the parameter reshaped to its block, default exponents ``1 / (2 k)``."""
    expected = run_reference(
        initial.numpy().reshape(block),
        [g.numpy().reshape(block) for g in grads],
        lr=0.05,
        betas=(0.9, 0.95),
        frequency=frequency,
        start=frequency,
        **kwargs,
    )
    return expected.reshape(initial.shape)


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("kind", ["root_inv", "eigendecomposed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_float64_matches_the_loop_of_the_equations(kind: str, case: str) -> None:
    shape, max_dim, block, frequency = CASES[case]
    initial, grads, final = _run(
        kl_config(kind), shape, torch.float64, 2 * frequency + 3, max_dim, frequency
    )
    expected = _loop(initial, grads, block, frequency, epsilon=1e-12, kl=True)
    assert _relative(final.numpy(), expected) < 1e-10
    if len(block) > 1:  # KL's factor update, not classic Shampoo's
        plain = _loop(initial, grads, block, frequency, epsilon=1e-12)
        assert _relative(final.numpy(), plain) > 1e-4


@pytest.mark.parametrize("kind", ["root_inv", "eigendecomposed"])
@pytest.mark.parametrize("case", ["1d", "3d_merged_to_1d", "3d_merged_to_2d"])
def test_rank_deficient_float64_pseudo_inverse_matches_the_loop(kind: str, case: str) -> None:
    """Roots from the second step on, of rank-deficient factors (rank 2 of 7 and of 12, 10 of
    12), with the null space dropped: well defined, so the tight tolerance holds."""
    shape, max_dim, block, _ = CASES[case]
    initial, grads, final = _run(
        kl_config(kind, pseudo_inverse=True), shape, torch.float64, 9, max_dim, 2, epsilon=0.0
    )
    expected = _loop(initial, grads, block, 2, epsilon=0.0, kl=True, pseudo_inverse=True)
    assert _relative(final.numpy(), expected) < 1e-10


@pytest.mark.parametrize("case", ["1d", "3d_merged_to_1d"])
def test_one_factor_kl_steps_are_classic_shampoos(case: str) -> None:
    """``H = G`` without another factor: the KL config takes classic Shampoo's steps."""
    shape, max_dim, _, frequency = CASES[case]
    _, _, kl = _run(
        kl_config("root_inv"), shape, torch.float64, 2 * frequency + 3, max_dim, frequency
    )
    _, _, plain = _run(
        RootInvShampooPreconditionerConfig(**FLOAT64),
        shape,
        torch.float64,
        2 * frequency + 3,
        max_dim,
        frequency,
    )
    assert torch.allclose(kl, plain, rtol=1e-13, atol=0.0)


@pytest.mark.parametrize(
    "config",
    [
        RootInvKLShampooPreconditionerConfig(num_tolerated_failed_amortized_computations=0),
        EigendecomposedKLShampooPreconditionerConfig(num_tolerated_failed_amortized_computations=0),
        EigendecomposedKLShampooPreconditionerConfig(
            amortized_computation_config=QREigendecompositionConfig(),
            num_tolerated_failed_amortized_computations=0,
        ),
    ],
    ids=["root_inv", "eigendecomposed", "eigendecomposed_qr"],
)
@pytest.mark.parametrize("case", sorted(CASES))
def test_float32_rank_one_at_epsilon_1e_12_stays_finite_and_never_fails(
    config: Any, case: str
) -> None:
    """Rank-1 gradients with a zero slice (a vector's factor gains one rank a step), a fresh
    root every step from rank-deficient factors: steps finite, no failed root (any failure
    raises: zero tolerated)."""
    shape, max_dim, _, _ = CASES[case]
    _run(config, shape, torch.float32, 20, max_dim, 1, rank_one=True)
