"""Newton-Schulz in float32 and bfloat16 against float64 SVDs; its dtype choice; its stacks.

The orthogonality error is measured on the singular directions that matter: for ``G = U S V^T``
(float64) and the output ``X``, ``M = U_r^T X V_r`` over the ``r`` nonzero singular values must
be diagonal with entries in the Muon band, so ``||M^T M - I||_2 <= 1 - 0.68^2``.
"""

from __future__ import annotations

import pytest
import torch

from nanoshampoo import matmul_speed
from nanoshampoo.optim.shampoo import (
    DistributedShampoo,
    NewtonSchulzOrthogonalizationConfig,
    SpectralDescentPreconditionerConfig,
)
from nanoshampoo.optim.shampoo.preconditioner.preconditioner import BlockBucket
from nanoshampoo.optim.shampoo.preconditioner.spectral_descent_preconditioner import (
    SpectralDescentPreconditioner,
    newton_schulz_orthogonalize,
    resolve_newton_schulz_dtype,
)

torch.set_num_threads(1)

MUON = (3.4445, -4.7750, 2.0315)
# Five Muon steps map normalized singular values in [1e-2, 1] into [0.68, 1.14]
# (spectral_descent_test.py::test_newton_schulz_band_and_direction), so
# ||M^T M - I||_2 <= max(1 - 0.68^2, 1.14^2 - 1) = 0.5376; 0.55 leaves bf16 rounding room.
ORTHOGONALITY_BOUND = 0.55
# Off-diagonal share of M (directions mixed): float32 measured 7e-7 iterating on X (64x96),
# 5.9e-6 in Gram space (64x160); bfloat16 6.8e-3.
OFF_DIAGONAL_BOUND = {torch.float32: 5e-5, torch.bfloat16: 2e-2}
# Share of X outside span(U_r) x span(V_r), i.e. in G's null space: float32 measured 4.3e-6 on
# X, 4.0e-5 in Gram space.
# bfloat16 measured 0.106: rounding noise there is multiplied by p'(0) = 3.44 per step, as in
# the reference Muon (always bf16); it is what bf16 buys its speed with on rank-deficient blocks.
NULL_SPACE_BOUND = {torch.float32: 2e-4, torch.bfloat16: 0.2}


def low_rank_gradient(rows: int, cols: int, rank: int) -> tuple[torch.Tensor, ...]:
    """``(G, U_r, V_r)`` in float64: singular values 1 .. 0.1 (log-spaced), the rest zero.

    Normalized by ``||G||_F`` the smallest is 0.034, inside the band's domain [1e-2, 1].
    """
    gen = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(rows, rows, generator=gen, dtype=torch.float64)).Q[:, :rank]
    v = torch.linalg.qr(torch.randn(cols, cols, generator=gen, dtype=torch.float64)).Q[:, :rank]
    s = torch.logspace(0, -1, rank, dtype=torch.float64)
    return (u * s) @ v.T, u, v


def orthogonality_errors(
    coefficients: tuple[float, float, float],
    compute_dtype: torch.dtype,
    transpose: bool,
    cols: int = 160,
) -> tuple[float, float, float]:
    """``(||M^T M - I||_2, off-diagonal share of M, null-space share of X)`` of a float32 NS
    of a rank-40 ``(64, cols)`` block (transposed: ``(cols, 64)``)."""
    g, u, v = low_rank_gradient(64, cols, rank=40)
    if transpose:
        g, u, v = g.T, v, u
    x = newton_schulz_orthogonalize(g.float().unsqueeze(0), coefficients, 5, compute_dtype)
    x = x[0].double()
    m = u.T @ x @ v
    eye = torch.eye(m.shape[0], dtype=torch.float64)
    error = torch.linalg.matrix_norm(m.T @ m - eye, ord=2).item()
    off = torch.linalg.norm(m - torch.diag(m.diagonal())) / torch.linalg.norm(m)
    null = torch.linalg.norm(x - u @ m @ v.T) / torch.linalg.norm(x)
    return error, off.item(), null.item()


# 160 columns: float32 iterates in Gram space (ratio 2.5); 96: on X (ratio 1.5).
@pytest.mark.parametrize("cols", [160, 96])
@pytest.mark.parametrize("transpose", [False, True], ids=["wide", "tall"])
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_newton_schulz_orthogonalizes_the_directions_that_matter(
    compute_dtype: torch.dtype, transpose: bool, cols: int
) -> None:
    error, off, null = orthogonality_errors(MUON, compute_dtype, transpose, cols)
    assert error <= ORTHOGONALITY_BOUND
    assert off <= OFF_DIAGONAL_BOUND[compute_dtype]
    assert null <= NULL_SPACE_BOUND[compute_dtype]


@pytest.mark.parametrize(
    "coefficients",
    [(1.5, -0.5, 0.0), (3.4445, -4.7750, 2.5), (3.4445, -4.7750, 1.8)],
    ids=["cubic", "c-too-large", "c-too-small"],
)
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cols", [160, 96])
def test_a_wrong_coefficient_set_fails_the_orthogonality_bound(
    coefficients: tuple[float, float, float], compute_dtype: torch.dtype, cols: int
) -> None:
    error, _, _ = orthogonality_errors(coefficients, compute_dtype, transpose=False, cols=cols)
    assert not error <= ORTHOGONALITY_BOUND


def test_bfloat16_output_is_float32_output_up_to_bf16_rounding_on_a_full_rank_block() -> None:
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(2, 96, 256, generator=gen)
    exact = newton_schulz_orthogonalize(g.double(), MUON, 5)
    fast = newton_schulz_orthogonalize(g, MUON, 5, torch.bfloat16)
    assert fast.dtype == torch.float32
    relative = torch.linalg.matrix_norm(fast.double() - exact) / torch.linalg.matrix_norm(exact)
    # Measured 0.011: a few bf16 ulps (2^-8 = 0.0039) through 15 products.
    assert relative.max() < 0.03, relative


def test_a_forced_compute_dtype_is_taken_as_given() -> None:
    assert resolve_newton_schulz_dtype(torch.float32, torch.float32, torch.device("cpu")) == (
        torch.float32,
        "compute_dtype=float32",
    )
    assert resolve_newton_schulz_dtype(torch.bfloat16, torch.float64, torch.device("cpu"))[0] == (
        torch.bfloat16
    )


@pytest.mark.parametrize("fast, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_on_cpu_follows_the_bf16_probe(
    fast: bool, expected: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(matmul_speed, "cpu_bf16_is_fast", lambda: fast)
    dtype, reason = resolve_newton_schulz_dtype("auto", torch.float32, torch.device("cpu"))
    assert dtype == expected
    assert reason.startswith("auto: bf16 matmuls are " + ("faster" if fast else "not faster"))
    # float64 and bf16 blocks keep their dtype whatever the probe says.
    for kept in (torch.float64, torch.bfloat16):
        assert resolve_newton_schulz_dtype("auto", kept, torch.device("cpu"))[0] == kept


@pytest.mark.parametrize("block_dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_the_default_iterates_in_the_block_dtype_as_the_reference(
    block_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """None (the config's default) ignores the probe: a ported script gets the reference's
    float32 numbers even where bf16 is fast."""
    monkeypatch.setattr(matmul_speed, "cpu_bf16_is_fast", lambda: True)
    assert NewtonSchulzOrthogonalizationConfig().compute_dtype is None
    dtype, reason = resolve_newton_schulz_dtype(None, block_dtype, torch.device("cpu"))
    assert dtype == block_dtype
    assert reason == f"compute_dtype=None: the block dtype ({str(block_dtype)[6:]})"


def test_tall_and_wide_buckets_of_one_shape_iterate_as_one_stack() -> None:
    device = torch.device("cpu")
    buckets = [
        BlockBucket((6, 10), torch.float32, device, ("a block_0", "a block_1")),
        BlockBucket((10, 6), torch.float32, device, ("b block_0",)),
        BlockBucket((4, 4), torch.float32, device, ("c block_0",)),
    ]
    config = SpectralDescentPreconditionerConfig(
        NewtonSchulzOrthogonalizationConfig(compute_dtype=torch.float32)
    )
    muon = SpectralDescentPreconditioner(buckets, config)
    assert muon.compute_dtype_reasons == (
        "(6, 10) x3: float32, compute_dtype=float32",
        "(4, 4) x1: float32, compute_dtype=float32",
    )
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(b.stacked_shape, generator=gen) for b in buckets]
    for grad, out in zip(grads, muon.precondition(grads, step=1)):
        torch.testing.assert_close(
            out, newton_schulz_orthogonalize(grad, MUON, 5), rtol=0, atol=1e-6
        )


def test_a_block_of_more_than_two_dims_is_orthogonalized_as_out_dim_by_the_rest() -> None:
    gen = torch.Generator().manual_seed(3)
    # (5, 6, 7) with max_preconditioner_dim 8: no two dims merge, nothing splits: one 3-D block.
    w = torch.nn.Parameter(torch.randn(5, 6, 7, generator=gen, dtype=torch.float64))
    g = torch.randn(5, 6, 7, generator=gen, dtype=torch.float64)
    opt = DistributedShampoo(
        [w],
        lr=1.0,
        betas=(0.0, 1.0),
        max_preconditioner_dim=8,
        preconditioner_config=SpectralDescentPreconditionerConfig(),
    )
    before = w.detach().clone()
    w.grad = g.clone()
    opt.step()
    expected = newton_schulz_orthogonalize(g.reshape(1, 5, 42), MUON, 5).reshape(5, 6, 7)
    torch.testing.assert_close(before - w.detach(), expected, rtol=0, atol=1e-13)


def test_float32_params_on_this_cpu_log_the_probed_choice(caplog: pytest.LogCaptureFixture) -> None:
    w = torch.nn.Parameter(torch.randn(40, 30))
    with caplog.at_level("INFO", logger="nanoshampoo.optim.shampoo.preconditioner"):
        DistributedShampoo(
            [w],
            max_preconditioner_dim=64,
            preconditioner_config=SpectralDescentPreconditionerConfig(
                NewtonSchulzOrthogonalizationConfig(compute_dtype="auto")
            ),
        )
    dtype, reason = resolve_newton_schulz_dtype("auto", torch.float32, torch.device("cpu"))
    assert dtype == (torch.bfloat16 if matmul_speed.cpu_bf16_is_fast() else torch.float32)
    name = str(dtype).removeprefix("torch.")
    assert f"Newton-Schulz (30, 40) x1: {name}, {reason}" in caplog.text


@pytest.mark.parametrize("shape", [(2, 8, 20), (3, 8, 16), (1, 12, 13)])
def test_gram_space_and_x_iterations_agree_in_float64(shape: tuple[int, ...]) -> None:
    """(8, 20) and (8, 16) iterate in Gram space, (12, 13) on X; the float64 reference is the
    plain iteration on X written out here."""
    gen = torch.Generator().manual_seed(4)
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    x = g / (torch.linalg.matrix_norm(g, keepdim=True) + 1e-7)
    a, b, c = MUON
    for _ in range(5):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    torch.testing.assert_close(newton_schulz_orthogonalize(g, MUON, 5), x, rtol=0, atol=1e-12)
