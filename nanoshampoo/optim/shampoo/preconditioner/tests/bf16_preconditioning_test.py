"""``precondition_dtype=torch.bfloat16``: the preconditioning GEMMs of classic Shampoo in bfloat16.

The search direction of a block is ``X_1 x_1 ... X_k x_k G`` (``X_L G X_R`` for a matrix). With
the option, ``G`` and the roots are rounded to bfloat16, every product is a bfloat16 GEMM
(float32 accumulation on the CPU) and each product is rounded to bfloat16. So against the
float64 product of the rounded inputs, entry by entry, the error is at most one rounding per
product, each at most ``u = 2^-8`` of that entry's magnitude bound: the same product of the
absolute values ``|X_1| x_1 ... |X_k| x_k |G|``. With ``k`` roots that is ``k u = k eps / 2``
(``eps = finfo(bfloat16).eps = 2^-7``); the tests allow ``2 eps``, which a missing or misplaced
root exceeds by far (checked). Settings: float32 blocks, epsilon 1e-12.
"""

from __future__ import annotations

import pytest
import torch

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DistributedShampoo,
    EigendecomposedShampooPreconditionerConfig,
    RootInvShampooPreconditionerConfig,
)
from nanoshampoo.optim.shampoo.preconditioner.eigendecomposed_shampoo_preconditioner import (
    EigendecomposedShampooPreconditioner,
)
from nanoshampoo.optim.shampoo.preconditioner.factor_matrix_ops import multiply_along_dim
from nanoshampoo.optim.shampoo.preconditioner.preconditioner import BlockBucket
from nanoshampoo.optim.shampoo.preconditioner.shampoo_preconditioner import ShampooPreconditioner

torch.set_num_threads(1)

Override = dict[int, dict[int, float]]
BF16 = torch.bfloat16
EPS_BF16 = torch.finfo(BF16).eps
EPSILON = 1e-12
# Block shapes (two blocks each) and the exponent overrides that drop one side of a matrix:
# the 2-D path with both roots, with only the right or only the left one, the 1-D path and the
# general multiply_along_dim path.
CASES: list[tuple[tuple[int, ...], Override]] = [
    ((12, 20), {}),
    ((12, 20), {2: {0: 0.0}}),
    ((12, 20), {2: {1: 0.0}}),
    ((16,), {}),
    ((3, 4, 5), {}),
]
VARIANTS = [
    (RootInvShampooPreconditionerConfig, ShampooPreconditioner),
    (EigendecomposedShampooPreconditionerConfig, EigendecomposedShampooPreconditioner),
]


def _preconditioner(
    variant: tuple[type, type],
    shape: tuple[int, ...],
    override: Override,
    dtype: torch.dtype | None,
    history: int,
) -> ShampooPreconditioner:
    """A preconditioner of two ``shape`` blocks whose roots come from ``history`` gradients."""
    config_type, preconditioner_type = variant
    config = config_type(precondition_dtype=dtype, inverse_exponent_override=override)
    bucket = BlockBucket(shape, torch.float32, torch.device("cpu"), ("w block_0", "w block_1"))
    shampoo = preconditioner_type([bucket], config, 1.0, EPSILON, True)
    generator = torch.Generator().manual_seed(0)
    for step in range(1, history + 1):
        shampoo.update_statistics([torch.randn(2, *shape, generator=generator)], step)
    shampoo.amortized_computation(step=history)
    return shampoo


def _gradient(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(2, *shape, generator=torch.Generator().manual_seed(7))


def _product(roots: list[torch.Tensor | None], grad: torch.Tensor) -> torch.Tensor:
    """``X_1 x_1 ... X_k x_k G`` for stacked blocks, by one matrix product per dim."""
    result = grad
    for dim, root in enumerate(roots):
        if root is not None:
            result = multiply_along_dim(root, result, dim)
    return result


def _rounded64(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(BF16).double()


@pytest.mark.parametrize("variant", VARIANTS, ids=["root-inverse", "eigendecomposed"])
@pytest.mark.parametrize("shape, override", CASES)
def test_bf16_product_is_the_float64_product_of_the_rounded_inputs(
    variant: tuple[type, type], shape: tuple[int, ...], override: Override
) -> None:
    # Roots of one gradient: the 20-factor of a 12x20 block and a vector's factor are
    # rank-deficient (the usual case early in training), their roots large on the null space.
    shampoo = _preconditioner(variant, shape, override, BF16, history=1)
    grad = _gradient(shape)
    roots = shampoo._bucket_roots(0)
    assert sum(root is not None for root in roots) == len(shape) - len(override)
    (out,) = shampoo.precondition([grad], step=1)
    assert out.dtype == torch.float32
    assert torch.equal(out, out.to(BF16).float())  # the product was rounded to bfloat16
    rounded = [_rounded64(root) for root in roots]
    reference = _product(rounded, _rounded64(grad))
    magnitude = _product([None if r is None else r.abs() for r in rounded], _rounded64(grad).abs())
    bound = 2 * EPS_BF16 * magnitude
    error = (out.double() - reference).abs()
    assert (error <= bound).all(), (error / magnitude).max()
    # The bound has teeth: dropping any one root breaks it.
    for dim, root in enumerate(rounded):
        if root is not None:
            missing = _product(
                [None if d == dim else r for d, r in enumerate(rounded)], _rounded64(grad)
            )
            assert ((out.double() - missing).abs() > bound).any(), dim


@pytest.mark.parametrize("shape, override", CASES)
def test_bf16_is_close_to_the_float32_path_on_full_rank_factors(
    shape: tuple[int, ...], override: Override
) -> None:
    """Relative Frobenius error at most ``2 eps`` (1.6 %; measured 0.30-0.52 eps on these
    cases, the entrywise bound above at 0.31-0.72 eps). With 40 gradients of 2 blocks every
    factor (n <= 20) is full rank and its root well conditioned, so the roundings of ``G``, the
    roots and the products are not amplified (on rank-deficient factors they may be: the floor
    weights the null space by ``(sqrt(n) eps_32)^(-e)``, see ``shampoo_preconditioner``)."""
    variant = VARIANTS[0]
    grad = _gradient(shape)
    (narrow,) = _preconditioner(variant, shape, override, BF16, history=40).precondition([grad], 40)
    (full,) = _preconditioner(variant, shape, override, None, history=40).precondition([grad], 40)
    relative = torch.linalg.vector_norm(narrow - full) / torch.linalg.vector_norm(full)
    assert relative <= 2 * EPS_BF16
    assert relative > 0.0  # it did run in bfloat16


@pytest.mark.parametrize("shape, override", CASES)
def test_none_multiplies_in_the_block_dtype_bit_for_bit(
    shape: tuple[int, ...], override: Override
) -> None:
    """The default path is the float32 batched products of the roots, in the same order."""
    shampoo = _preconditioner(VARIANTS[0], shape, override, None, history=3)
    grad = _gradient(shape)
    left, *others = shampoo._bucket_roots(0)
    (out,) = shampoo.precondition([grad], step=3)
    if len(shape) == 2:
        right = others[0]
        expected = grad if left is None else torch.bmm(left, grad)
        expected = expected if right is None else torch.bmm(expected, right)
    elif len(shape) == 1:
        expected = torch.bmm(left, grad.unsqueeze(-1)).squeeze(-1)
    else:
        expected = _product([left, *others], grad)
    assert torch.equal(out, expected)


def test_distributed_shampoo_with_bf16_gemms_stays_finite_on_rank_deficient_factors() -> None:
    """Rank-1 gradients of a 32x16 matrix, a wide 8x64 block and a vector, a fresh root every
    step at epsilon 1e-12: every factor stays rank-deficient, and the steps stay finite."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((32, 16), (8, 64), (48,))]
    initial = [p.detach().clone() for p in params]
    optimizer = DistributedShampoo(
        params,
        lr=1e-2,
        betas=(0.9, 0.95),
        epsilon=EPSILON,
        max_preconditioner_dim=64,
        precondition_frequency=1,
        start_preconditioning_step=1,
        grafting_config=AdamPreconditionerConfig(beta2=0.95, epsilon=1e-10),
        preconditioner_config=RootInvShampooPreconditionerConfig(precondition_dtype=BF16),
    )
    for _ in range(6):
        params[0].grad = torch.outer(torch.randn(32), torch.randn(16))
        for p in params[1:]:
            p.grad = torch.randn(p.shape)
        optimizer.step()
    for p, p0 in zip(params, initial):
        assert torch.isfinite(p).all()
        assert not torch.equal(p.detach(), p0)


@pytest.mark.parametrize("config_type", [c for c, _ in VARIANTS])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, "bfloat16", 16])
def test_precondition_dtype_other_than_none_or_bfloat16_is_refused(
    config_type: type, dtype: object
) -> None:
    with pytest.raises(ValueError, match="^precondition_dtype"):
        config_type(precondition_dtype=dtype)


def test_precondition_dtype_defaults_to_the_block_dtype() -> None:
    assert RootInvShampooPreconditionerConfig().precondition_dtype is None
    assert RootInvShampooPreconditionerConfig(precondition_dtype=BF16).precondition_dtype is BF16
