"""``target_parameter_dimensionality`` on every ``DistributedConfig``: how far small dims merge.

The block shapes are written out by hand for 1-D to 4-D parameters; the numbers of a step on a
3-D parameter viewed as a matrix are checked against a dense float64 Kronecker-product
reference of Shampoo on that matrix.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nanoshampoo.optim.shampoo import (
    DDPDistributedConfig,
    DistributedShampoo,
    FullyShardDistributedConfig,
    HybridShardDistributedConfig,
    SingleDeviceDistributedConfig,
    SpectralDescentPreconditionerConfig,
)

torch.set_num_threads(1)

CONFIG_CLASSES = [
    SingleDeviceDistributedConfig,
    DDPDistributedConfig,
    FullyShardDistributedConfig,
    HybridShardDistributedConfig,
]

# (shape, max_preconditioner_dim, target) -> the blocks, by hand: drop size-1 dims, merge from
# the back while the product stays <= max dim and more than `target` dims remain, then cut
# every dim into chunks of max dim.
BLOCK_CASES = [
    ((7,), 64, 1, [(7,)]),
    ((7,), 64, math.inf, [(7,)]),
    ((70,), 64, 1, [(64,), (6,)]),
    ((6, 5), 64, 1, [(30,)]),
    ((6, 5), 64, 2, [(6, 5)]),
    ((6, 5), 64, math.inf, [(6, 5)]),
    ((6, 5), 16, 1, [(6, 5)]),  # 30 > 16: nothing merges
    ((4, 3, 5), 64, 1, [(60,)]),
    ((4, 3, 5), 64, 2, [(4, 15)]),  # 3 * 5 merges; 4 * 15 would leave one dim
    ((4, 3, 5), 64, 3, [(4, 3, 5)]),
    ((4, 3, 5), 64, math.inf, [(4, 3, 5)]),
    ((4, 3, 5), 8, 2, [(4, 3, 5)]),  # 15 > 8: nothing merges
    ((2, 3, 4, 5), 64, 1, [(2, 60)]),  # 2 * 60 > 64
    ((2, 3, 4, 5), 64, 2, [(2, 60)]),
    ((2, 3, 4, 5), 64, 3, [(2, 3, 20)]),
    ((2, 3, 4, 5), 1000, 1, [(120,)]),
    ((2, 3, 4, 5), 1000, 2, [(2, 60)]),
    ((2, 3, 4, 5), math.inf, 2, [(2, 60)]),  # with no threshold: exactly `target` dims
    ((2, 3, 4, 5), math.inf, 3, [(2, 3, 20)]),
    ((2, 3, 4, 5), 4, 2, [(2, 3, 4, 4), (2, 3, 4, 1)]),  # 20 > 4: nothing merges; 5 splits
    ((8, 1, 6), 64, 2, [(8, 6)]),  # the size-1 dim is dropped first
    ((8, 1, 6), 64, math.inf, [(8, 1, 6)]),  # inf keeps the shape, size-1 dims included
    ((1, 6), 64, 1, [(6,)]),
]


def _block_shapes(
    shape: tuple[int, ...], max_dim: int | float, target: int | float
) -> list[tuple[int, ...]]:
    config = SingleDeviceDistributedConfig(target_parameter_dimensionality=target)
    optimizer = DistributedShampoo(
        [torch.zeros(shape)], max_preconditioner_dim=max_dim, distributed_config=config
    )
    return [tuple(b.shape) for b in optimizer._runtimes[0].distributor.local_blocked_params]


@pytest.mark.parametrize(("shape", "max_dim", "target", "blocks"), BLOCK_CASES)
def test_block_shapes_follow_the_target_dimensionality(
    shape: tuple[int, ...], max_dim: int | float, target: int | float, blocks: list[tuple[int, ...]]
) -> None:
    assert _block_shapes(shape, max_dim, target) == blocks


@pytest.mark.parametrize("config_class", CONFIG_CLASSES)
def test_default_is_one_and_the_field_is_keyword_only(config_class: type) -> None:
    assert config_class().target_parameter_dimensionality == 1
    assert (
        config_class(target_parameter_dimensionality=math.inf).target_parameter_dimensionality
        == math.inf
    )
    # Keyword-only: positional arguments keep meaning what they meant before the field existed.
    if config_class is DDPDistributedConfig:
        assert config_class(torch.bfloat16).communication_dtype == torch.bfloat16


@pytest.mark.parametrize("config_class", CONFIG_CLASSES)
@pytest.mark.parametrize("bad", [0, -1, 1.5, 2.0, -math.inf, math.nan, True, "2", None])
def test_invalid_target_is_refused_naming_the_field(config_class: type, bad: object) -> None:
    # Ints below 1 fail the lower bound; anything else fails "an integer" first (-inf included).
    too_small = isinstance(bad, int) and not isinstance(bad, bool) and bad < 1
    sentence = "Must be >= 1." if too_small else "Must be an integer or math.inf."
    with pytest.raises(ValueError) as info:
        config_class(target_parameter_dimensionality=bad)
    assert str(info.value) == (
        f"Invalid self.target_parameter_dimensionality={bad!r} value. {sentence}"
    )


def test_spectral_descent_merges_to_matrices_without_changing_the_config() -> None:
    config = SingleDeviceDistributedConfig()
    optimizer = DistributedShampoo(
        [torch.zeros(4, 3, 5)],
        max_preconditioner_dim=math.inf,
        distributed_config=config,
        preconditioner_config=SpectralDescentPreconditionerConfig(),
    )
    assert [tuple(b.shape) for b in optimizer._runtimes[0].distributor.local_blocked_params] == [
        (4, 15)
    ]
    assert config.target_parameter_dimensionality == 1


def _inverse_root(a: np.ndarray, eps: float, exponent: float) -> np.ndarray:
    mu, q = np.linalg.eigh(a + eps * np.eye(len(a)))
    return (q * np.maximum(mu, eps) ** -exponent) @ q.T


def test_a_3d_parameter_at_target_2_is_shampoo_on_its_matrix_view() -> None:
    """(4, 3, 5) at target 2 is the (4, 15) matrix: ``vec(P) = (L^-1/4 kron R^-1/4) vec(G)``
    with ``L = sum G G^T``, ``R = sum G^T G`` (float64, dense Kronecker product, row-major vec).
    Float32 at epsilon 1e-12; R has rank <= 6 of 15 after 6 steps (rank-deficient)."""
    generator = torch.Generator().manual_seed(0)
    steps, lr, eps = 6, 0.1, 1e-12
    grads = [torch.randn(4, 3, 5, generator=generator) for _ in range(steps)]
    param = torch.zeros(4, 3, 5)
    optimizer = DistributedShampoo(
        [param],
        lr=lr,
        betas=(0.0, 1.0),
        epsilon=eps,
        max_preconditioner_dim=64,
        precondition_frequency=1,
        start_preconditioning_step=1,
        distributed_config=SingleDeviceDistributedConfig(target_parameter_dimensionality=2),
    )
    w = np.zeros(60)
    left, right = np.zeros((4, 4)), np.zeros((15, 15))
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
        g = grad.double().numpy().reshape(4, 15)
        left += g @ g.T
        right += g.T @ g
        kron = np.kron(_inverse_root(left, eps, 0.25), _inverse_root(right, eps, 0.25))
        w -= lr * kron @ g.reshape(-1)
    got = param.double().numpy().reshape(-1)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - w) <= 1e-4 * np.linalg.norm(w)
