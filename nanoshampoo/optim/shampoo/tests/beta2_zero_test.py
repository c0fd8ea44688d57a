"""``betas[1] = 0``: the factors hold only the current gradient's statistics (accepted as in the
well-known library, whose range is [0, 1]).

Then ``L = G G^T``, ``R = G^T G`` and the bias correction ``1 - 0^t`` is 1, so each step is
``W <- W - lr (L + eps I)^(-1/4) G (R + eps I)^(-1/4)`` of that step's gradient alone: checked
against a float64 ``eigh`` of the equation, float32 optimizer, epsilon 1e-12.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoshampoo.optim.shampoo import DistributedShampoo

SHAPE = (4, 3)
LR, EPSILON, STEPS = 0.1, 1e-12, 4


def _inverse_fourth_root(matrix: np.ndarray) -> np.ndarray:
    values, vectors = np.linalg.eigh(matrix + EPSILON * np.eye(len(matrix)))
    return (vectors * values**-0.25) @ vectors.T


def test_each_step_is_shampoo_on_its_own_gradient() -> None:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(SHAPE))
    weights = param.detach().double().numpy().copy()
    # max_preconditioner_dim 4 keeps the (4, 3) block one matrix: 4 * 3 > 4, so no merge. L is
    # rank 3 (rank-deficient, as wide blocks are), G has no component in its null space.
    opt = DistributedShampoo(
        [param],
        lr=LR,
        betas=(0.0, 0.0),
        epsilon=EPSILON,
        max_preconditioner_dim=4,
        precondition_frequency=1,
    )
    for _ in range(STEPS):
        grad = torch.randn(SHAPE)
        param.grad = grad
        opt.step()
        g = grad.double().numpy()
        weights -= LR * _inverse_fourth_root(g @ g.T) @ g @ _inverse_fourth_root(g.T @ g)
    np.testing.assert_allclose(param.detach().double().numpy(), weights, rtol=1e-4, atol=1e-5)


def test_the_range_of_betas_1_is_closed() -> None:
    for beta2 in (0.0, 1.0):
        opt = DistributedShampoo([torch.nn.Parameter(torch.zeros(2))], betas=(0.9, beta2))
        assert opt.param_groups[0]["betas"] == (0.9, beta2)
    with pytest.raises(
        ValueError, match=r"^Invalid param_group\[BETAS\]\[1\]=-0\.1\. Must be in \[0\.0, 1\.0\]\."
    ):
        DistributedShampoo([torch.nn.Parameter(torch.zeros(2))], betas=(0.9, -0.1))
