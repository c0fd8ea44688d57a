"""KL-Shampoo: each factor is updated from the gradient preconditioned by the other factors' roots.

Against a float64 loop of the equations (``nanoshampoo.testing.shampoo_reference`` with
``kl=True``: ``F_i <- b2 F_i + w H_(i) H_(i)^T``, ``H = G x_j X_j`` over ``j != i``, the roots in
force at the step) on a 2-D and a 3-D parameter, for both cached forms (roots, eigendecompositions);
and robust in float32 at ``epsilon=1e-12`` on rank-deficient factors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from nanoshampoo.optim.shampoo import (
    DistributedShampoo,
    EigendecomposedKLShampooPreconditionerConfig,
    EigendecomposedShampooPreconditionerConfig,
    QREigendecompositionConfig,
    RootInvKLShampooPreconditionerConfig,
    RootInvShampooPreconditionerConfig,
)
from nanoshampoo.testing.shampoo_reference import run_reference

torch.set_num_threads(1)

KL_CONFIGS = {
    "root_inv": lambda **kw: RootInvKLShampooPreconditionerConfig(
        factor_matrix_dtype=torch.float64, **kw
    ),
    "eigendecomposed": lambda **kw: EigendecomposedKLShampooPreconditionerConfig(
        factor_matrix_dtype=torch.float64,
        factor_matrix_eigenvectors_dtype=torch.float64,
        factor_matrix_eigenvalues_dtype=torch.float64,
        **kw,
    ),
}


def _steps(
    config: Any,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    steps: int,
    rank_one: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype))
    initial = param.detach().clone()
    grads = []
    for _ in range(steps):
        g = torch.randn(shape, generator=gen, dtype=dtype)
        if rank_one:
            g = torch.outer(g.reshape(shape[0], -1)[:, 0], g.reshape(shape[0], -1)[0]).reshape(
                shape
            )
            g[0] = 0.0
        grads.append(g)
    options = dict(
        lr=0.05,
        betas=(0.9, 0.95),
        epsilon=1e-12,
        max_preconditioner_dim=8,
        precondition_frequency=2,
    )
    options.update(kwargs)
    opt = DistributedShampoo([param], preconditioner_config=config, **options)
    for g in grads:
        param.grad = g.clone()
        opt.step()
        assert torch.isfinite(param).all()
    return initial, grads, param.detach().clone()


@pytest.mark.parametrize("kind", sorted(KL_CONFIGS))
@pytest.mark.parametrize(
    ("shape", "override"),
    [((6, 5), {}), ((6, 5), {2: 0.5}), ((3, 4, 5), {})],
    ids=["2d", "2d_paper_exponent", "3d"],
)
def test_matches_float64_loop_of_the_equations(
    kind: str, shape: tuple[int, ...], override: dict
) -> None:
    config = KL_CONFIGS[kind](inverse_exponent_override=override)
    initial, grads, final = _steps(config, shape, torch.float64, steps=8)
    exponents = [override.get(len(shape), 1.0 / (2 * len(shape)))] * len(shape)
    expected = run_reference(
        initial.numpy(),
        [g.numpy() for g in grads],
        exponents=exponents,
        lr=0.05,
        betas=(0.9, 0.95),
        epsilon=1e-12,
        frequency=2,
        start=2,
        kl=True,
    )
    assert np.linalg.norm(final.numpy() - expected) / np.linalg.norm(expected) < 1e-9
    # Not Shampoo: the same steps without the KL factor update differ.
    plain = run_reference(
        initial.numpy(),
        [g.numpy() for g in grads],
        exponents=exponents,
        lr=0.05,
        betas=(0.9, 0.95),
        epsilon=1e-12,
        frequency=2,
        start=2,
    )
    assert np.linalg.norm(final.numpy() - plain) / np.linalg.norm(plain) > 1e-4


def test_zero_exponent_dim_keeps_no_factor_and_is_skipped_in_the_others_update() -> None:
    config = KL_CONFIGS["root_inv"](inverse_exponent_override={3: {1: 0.0}})
    initial, grads, final = _steps(config, (3, 4, 5), torch.float64, steps=6)
    expected = run_reference(
        initial.numpy(),
        [g.numpy() for g in grads],
        exponents=[1 / 6, 0.0, 1 / 6],
        lr=0.05,
        betas=(0.9, 0.95),
        epsilon=1e-12,
        frequency=2,
        start=2,
        kl=True,
    )
    assert np.linalg.norm(final.numpy() - expected) / np.linalg.norm(expected) < 1e-9


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
@pytest.mark.parametrize("shape", [(6, 5), (2, 8), (3, 4, 5), (7,)])
def test_float32_rank_deficient_at_epsilon_1e_12_never_fails(
    config: Any, shape: tuple[int, ...]
) -> None:
    """Rank-1 gradients with a zero slice: the KL update multiplies by roots of up to
    ``(floor)^(-e)``; the steps stay finite and no factor's computation fails."""
    _steps(
        config, shape, torch.float32, steps=20, rank_one=len(shape) > 1, precondition_frequency=1
    )


def test_the_two_cached_forms_agree_in_float32() -> None:
    _, _, roots = _steps(RootInvKLShampooPreconditionerConfig(), (6, 5), torch.float32, steps=12)
    _, _, eig = _steps(
        EigendecomposedKLShampooPreconditionerConfig(), (6, 5), torch.float32, steps=12
    )
    assert torch.linalg.vector_norm(roots - eig) / torch.linalg.vector_norm(roots) < 1e-5


def test_configs_are_classic_shampoo_configs() -> None:
    assert isinstance(RootInvKLShampooPreconditionerConfig(), RootInvShampooPreconditionerConfig)
    assert isinstance(
        EigendecomposedKLShampooPreconditionerConfig(), EigendecomposedShampooPreconditionerConfig
    )


@pytest.mark.parametrize(
    "config_type",
    [RootInvKLShampooPreconditionerConfig, EigendecomposedKLShampooPreconditionerConfig],
)
def test_packed_factors_give_the_same_steps(config_type: type) -> None:
    """The per-dim KL update goes through the packed pools' unpack/pack like the plain one."""
    _, _, plain = _steps(config_type(), (3, 4, 5), torch.float32, steps=6)
    _, _, packed = _steps(config_type(pack_factor_matrices=True), (3, 4, 5), torch.float32, steps=6)
    assert torch.equal(plain, packed)
