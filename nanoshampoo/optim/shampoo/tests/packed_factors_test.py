"""``use_symmetric_packing``: factors kept as one triangle (below 512) or as the upper tiles of
the tiled update (from 512 on, updated in place), saved as the reference library's upper
triangle, give the same numbers in fewer bytes (update, roots, steps, checkpoints, DDP), at the
recipe's float32 settings; ``pack_factor_matrices`` is its deprecated alias."""

from __future__ import annotations

import copy

import pytest
import torch

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DDPDistributedConfig,
    DistributedShampoo,
    RootInvShampooPreconditionerConfig,
    SingleDeviceDistributedConfig,
)
from nanoshampoo.optim.shampoo.preconditioner.factor_matrix_ops import (
    SymmetricPacking,
    TiledPacking,
    symmetric_rank_update_,
    tile_edges,
    tiled_storage_size,
)
from nanoshampoo.optim.shampoo.preconditioner.kronecker_factors import KroneckerFactors
from nanoshampoo.optim.shampoo.preconditioner.preconditioner import BlockBucket
from nanoshampoo.optim.shampoo.shampoo_types import WarmStartedEigenConfig
from nanoshampoo.testing.distributed import run_on_gloo

torch.set_num_threads(1)

# A 3-D block, a vector, a wide block and a 600 x 520 matrix: its 600- and 520-factors take the
# tiled (one-triangle) update path of factors >= 512.
SHAPES = [(40, 24), (3, 8, 6), (48,), (2, 64), (600, 520)]
STEPS = 6


def test_pack_then_unpack_restores_a_symmetric_matrix() -> None:
    packing = SymmetricPacking(5, torch.device("cpu"))
    a = torch.randn(3, 5, 5, dtype=torch.float64)
    symmetric = a + a.mT
    packed = packing.pack(symmetric)
    assert packed.shape == (3, 15)
    rows, cols = torch.triu_indices(5, 5)
    assert torch.equal(packed, symmetric[:, rows, cols])
    # The reference's row-major upper triangle, written out: (0,0) (0,1) ... (0,4) (1,1) ...
    assert torch.equal(
        packed[0, :6], torch.stack([symmetric[0, 0, j] for j in range(5)] + [symmetric[0, 1, 1]])
    )
    assert torch.equal(packing.unpack(packed), symmetric)
    # Only the lower triangle is read (the one eigh reads): the upper one may be anything.
    assert torch.equal(packing.unpack(packing.pack(torch.tril(symmetric))), symmetric)


def _stored_elements(n: int) -> int:
    """Elements a packed factor of size ``n`` keeps: the triangle, or from 512 on the tiles on
    and above the diagonal of ``n // 256`` near-equal tiles per side, each whole."""
    if n < 512:
        return n * (n + 1) // 2
    tiles = n // 256
    heights = [n * (i + 1) // tiles - n * i // tiles for i in range(tiles)]
    return sum(heights[a] * heights[b] for a in range(tiles) for b in range(a, tiles))


@pytest.mark.parametrize("size", [5, 600, 768])
def test_packed_statistics_keep_the_lower_triangle_bit_for_bit(size: int) -> None:
    bucket = BlockBucket((size, 7), torch.float32, torch.device("cpu"), ("a block_0", "b block_0"))
    full = KroneckerFactors([bucket], torch.float32, lambda b, dim: b.shape[dim])
    packed = KroneckerFactors([bucket], torch.float32, lambda b, dim: b.shape[dim], packed=True)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        grad = torch.randn(2, size, 7, generator=gen)
        full.update([grad], beta2=0.95)
        packed.update([grad], beta2=0.95)
    for key in (size, 7):
        n = key
        assert packed.pools[key].factors.shape == (2, _stored_elements(n))
        reference = full.pools[key].factors
        rows, cols = torch.triu_indices(n, n)
        # Position (i, j) of the upper triangle holds the lower triangle's (j, i).
        assert torch.equal(packed.reference_layout(packed.pools[key]), reference[:, cols, rows])
        lower = torch.tril(reference)
        mirrored = lower + torch.tril(reference, -1).mT
        assert torch.equal(packed.matrices(packed.pools[key]), mirrored)
        assert torch.equal(packed.matrices(packed.pools[key], torch.tensor([1])), mirrored[1:])


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    # Rank-deficient gradients (rank <= 3 per matrix block), as early steps and wide blocks give.
    grads = []
    for shape in SHAPES:
        if len(shape) == 2:
            left = torch.randn(shape[0], 3, generator=gen)
            grads.append(left @ torch.randn(3, shape[1], generator=gen))
        else:
            grads.append(torch.randn(shape, generator=gen))
    return grads


def _optimizer(
    params: list[torch.nn.Parameter],
    packed: bool,
    distributed: DDPDistributedConfig | SingleDeviceDistributedConfig | None = None,
    warm_qr: bool = False,
    roots: torch.dtype | None = None,
) -> DistributedShampoo:
    """The float32 recipe: epsilon 1e-12, Adam grafting, betas (0.9, 0.95), frequency 2."""
    solver = {"amortized_computation_config": WarmStartedEigenConfig()} if warm_qr else {}
    return DistributedShampoo(
        params,
        lr=0.01,
        betas=(0.9, 0.95),
        epsilon=1e-12,
        weight_decay=0.01,
        precondition_frequency=2,
        max_preconditioner_dim=600,
        use_bias_correction=True,
        grafting_config=AdamPreconditionerConfig(beta2=0.95, epsilon=1e-10),
        preconditioner_config=RootInvShampooPreconditionerConfig(
            use_symmetric_packing=packed, inv_factor_matrix_dtype=roots, **solver
        ),
        distributed_config=distributed or SingleDeviceDistributedConfig(),
    )


def _train(opt: DistributedShampoo, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        for param, grad in zip(params, _grads(step)):
            param.grad = grad.clone()
        opt.step()


@pytest.mark.parametrize("roots", [None, torch.bfloat16], ids=["fp32_roots", "bf16_roots"])
def test_packed_steps_equal_full_steps_bit_for_bit(roots: torch.dtype | None) -> None:
    full_params, packed_params = _params(), _params()
    _train(_optimizer(full_params, False, roots=roots), full_params, range(STEPS))
    _train(_optimizer(packed_params, True, roots=roots), packed_params, range(STEPS))
    for full, packed in zip(full_params, packed_params, strict=True):
        assert torch.equal(full, packed), tuple(full.shape)


def test_packed_warm_started_roots_match_full_ones() -> None:
    """Warm-started roots multiply by the whole factor (``Q^T A Q``) and the packed factor is
    the mirrored lower triangle, so they differ by rounding, which float32 roots of these
    rank-deficient factors amplify: the parameter changes agree within 1 %, far inside the
    5 % root error the warm start accepts by design."""
    initial = _params()
    full_params, packed_params = _params(), _params()
    _train(_optimizer(full_params, False, warm_qr=True), full_params, range(STEPS))
    _train(_optimizer(packed_params, True, warm_qr=True), packed_params, range(STEPS))
    for start, full, packed in zip(initial, full_params, packed_params, strict=True):
        change = torch.linalg.vector_norm(full - start)
        error = torch.linalg.vector_norm(packed - full) / change
        assert error < 1e-2, (tuple(full.shape), error.item())


def _factor_sizes(opt: DistributedShampoo) -> list[int]:
    sizes = []
    for runtime in opt._runtimes:
        for pool in runtime.preconditioner._factors.pools.values():
            sizes.extend([pool.size] * len(pool.labels))
    return sizes


def test_packing_saves_the_bytes_its_layout_leaves_out() -> None:
    full_params, packed_params = _params(), _params()
    full, packed = _optimizer(full_params, False), _optimizer(packed_params, True)
    _train(full, full_params, range(1))
    _train(packed, packed_params, range(1))
    sizes = _factor_sizes(full)
    assert sizes == _factor_sizes(packed) and 600 in sizes and 520 in sizes
    saved = sum(4 * (n * n - _stored_elements(n)) for n in sizes)
    assert full.optimizer_state_bytes() - packed.optimizer_state_bytes() == saved


def test_packed_checkpoint_round_trip_continues_identically() -> None:
    straight = _params()
    _train(_optimizer(straight, True), straight, range(STEPS))

    first = _params()
    opt = _optimizer(first, True)
    _train(opt, first, range(3))
    state = opt.state_dict()
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = _optimizer(resumed, True)
    opt2.load_state_dict(state)
    _train(opt2, resumed, range(3, STEPS))
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)


def test_full_checkpoint_into_packed_optimizer_raises_and_changes_nothing() -> None:
    params = _params()
    full = _optimizer(params, False)
    _train(full, params, range(2))
    state = full.state_dict()
    packed_params = _params()
    packed = _optimizer(packed_params, True)
    _train(packed, packed_params, range(2))
    before = packed.state_dict()
    with pytest.raises(ValueError, match="factor_matrices"):
        packed.load_state_dict(state)
    after = packed.state_dict()
    for key, value in _leaves(before):
        assert torch.equal(value, dict(_leaves(after))[key]), key


def _leaves(tree: object, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        return [(prefix, tree)]
    if isinstance(tree, dict):
        return [item for k, v in tree.items() for item in _leaves(v, f"{prefix}.{k}")]
    return []


@pytest.mark.parametrize("value", [1, "yes", None])
def test_use_symmetric_packing_must_be_a_bool(value: object) -> None:
    with pytest.raises(ValueError, match="^use_symmetric_packing must be a bool"):
        RootInvShampooPreconditionerConfig(use_symmetric_packing=value)  # type: ignore[arg-type]


def test_packing_is_on_by_default_as_in_the_reference() -> None:
    assert RootInvShampooPreconditionerConfig().use_symmetric_packing is True


@pytest.mark.parametrize("value", [True, False])
def test_pack_factor_matrices_is_a_deprecated_alias(value: bool) -> None:
    with pytest.warns(DeprecationWarning, match="use use_symmetric_packing"):
        config = RootInvShampooPreconditionerConfig(pack_factor_matrices=value)
    assert config.use_symmetric_packing is value
    with pytest.raises(ValueError, match="^pack_factor_matrices must be a bool"):
        RootInvShampooPreconditionerConfig(pack_factor_matrices=1)  # type: ignore[arg-type]


def _ddp_body(rank: int, world_size: int) -> list[torch.Tensor]:
    params = _params()
    _train(_optimizer(params, True, DDPDistributedConfig()), params, range(STEPS))
    return [p.detach() for p in params]


@pytest.mark.slow
@pytest.mark.distributed
def test_packed_ddp_on_two_ranks_equals_single_device() -> None:
    results = run_on_gloo(_ddp_body, 2)
    single = _params()
    _train(_optimizer(single, True), single, range(STEPS))
    for rank_params in results:
        for got, want in zip(rank_params, single, strict=True):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), tuple(want.shape)


@pytest.mark.parametrize("size", [40, 512, 600, 768, 1024])
def test_the_packed_update_skips_the_mirror_and_packs_the_same_bits(size: int) -> None:
    """``pack_updated`` of an unmirrored tiled update equals ``pack`` of the mirrored one, bit
    for bit: the packed factors evolve as before, one transposed copy per tile pair fewer."""
    packing = SymmetricPacking(size, torch.device("cpu"))
    a = torch.randn(2, size, size)
    packed = packing.pack(a @ a.mT / size)
    unfolded = torch.randn(2, size, 96)
    mirrored = symmetric_rank_update_(packing.unpack(packed), unfolded, 0.95, 0.05)
    unmirrored = symmetric_rank_update_(packing.unpack(packed), unfolded, 0.95, 0.05, mirror=False)
    assert torch.equal(packing.pack_updated(unmirrored), packing.pack(mirrored))
    if size >= 512:  # tiled: the lower tiles were left stale, so a plain pack would differ
        assert not torch.equal(packing.pack(unmirrored), packing.pack(mirrored))


@pytest.mark.parametrize("size", [5, 300])
def test_the_roots_start_from_the_updates_full_factors_with_the_same_bits(size: int) -> None:
    """The amortized computation right after an update takes the update's full factors,
    mirrored, instead of unpacking the packed rows again: the same numbers (a second
    ``matrices`` call unpacks), for every row or some, in another dtype; and not once the
    packed rows changed after the update (a loaded state dict)."""
    # Two buckets whose factors share the pool of ``size``, filled a bucket at a time.
    buckets = [
        BlockBucket((size, 7), torch.float32, torch.device("cpu"), ("a block_0", "a block_1")),
        BlockBucket((9, size), torch.float32, torch.device("cpu"), ("b block_0",)),
    ]
    factors = KroneckerFactors(buckets, torch.float32, lambda b, dim: b.shape[dim], packed=True)
    pool = factors.pools[size]
    assert len(pool.labels) == 3
    gen = torch.Generator().manual_seed(0)

    def update() -> None:
        grads = [torch.randn(2, size, 7, generator=gen), torch.randn(1, 9, size, generator=gen)]
        factors.update(grads, beta2=0.95)

    for rows in (None, torch.tensor([2, 0])):
        update()
        assert id(pool) in factors._updated_full  # kept for the roots, and taken once
        taken = factors.matrices(pool, rows, torch.float64, 0.37)
        assert id(pool) not in factors._updated_full
        unpacked = factors.matrices(pool, rows, torch.float64, 0.37)
        assert torch.equal(taken, unpacked)
        assert torch.equal(taken, taken.mT)
    # For eigh of the transposed view, the upper triangle alone.
    update()
    upper = torch.triu(factors.matrices(pool, None, torch.float64, 0.37, upper_only=True))
    assert torch.equal(upper, torch.triu(factors.matrices(pool, None, torch.float64, 0.37)))
    update()
    pool.factors.mul_(2.0)  # as a loaded state dict would change them
    expected = factors._packings[size].unpack(pool.factors)
    assert torch.equal(factors.matrices(pool), expected)
    update()
    factors.release_unpacked()  # a step without an amortized computation
    assert torch.equal(factors.matrices(pool), factors._packings[size].unpack(pool.factors))


@pytest.mark.parametrize("size", [512, 600, 768, 1000, 1024])
def test_the_tiled_update_in_place_keeps_the_packed_updates_bits(size: int) -> None:
    """From 512 on a packed factor lives by tiles, updated in place: its values, in the
    triangle's layout, are those of the triangle packing's unpack / update / pack, bit for bit,
    and the two layouts convert both ways."""
    packing = SymmetricPacking(size, torch.device("cpu"))
    tiled = TiledPacking(size, torch.device("cpu"))
    edges = tile_edges(size)
    assert len(tiled.bands) == len(edges) - 1
    assert tiled.storage_size == _stored_elements(size) == tiled_storage_size(size)
    gen = torch.Generator().manual_seed(size)
    a = torch.randn(2, size, size, generator=gen)
    packed = packing.pack(a @ a.mT / size)
    storage = tiled.from_reference(packed)
    assert torch.equal(tiled.to_reference(storage), packed)
    for _ in range(2):
        unfolded = torch.randn(2, size, 96, generator=gen)
        full = symmetric_rank_update_(packing.unpack(packed), unfolded, 0.95, 0.05, mirror=False)
        packed = packing.pack_updated(full)
        tiled.update_(storage, unfolded, 0.95, 0.05)
        assert torch.equal(tiled.to_reference(storage), packed)
    # Full matrices from the tiles: the unpacked ones, cast and divided elementwise.
    expected = packing.unpack(packed.double() / 0.37)
    assert torch.equal(tiled.full(storage, torch.float64, 0.37), expected)
    upper = torch.triu(tiled.full(storage, torch.float64, 0.37, upper_only=True))
    assert torch.equal(upper, torch.triu(expected))
    assert torch.equal(tiled.full(storage), packing.unpack(packed))


def test_tiled_factors_are_saved_in_the_triangles_layout_and_load_back() -> None:
    """A state dict holds a tiled factor (600 x 600, 520 x 520) as the triangle packing would,
    from the full-storage run's factor, and a packed optimizer loads it back to the same
    values (the round trip's steps: test_packed_checkpoint_round_trip_continues_identically)."""
    full_params, packed_params = _params(), _params()
    full, packed = _optimizer(full_params, False), _optimizer(packed_params, True)
    _train(full, full_params, range(3))
    _train(packed, packed_params, range(3))
    index = len(SHAPES) - 1  # the 600 x 520 matrix, one block
    saved = packed.state_dict()["state"][index]["block_0"]["shampoo"]["factor_matrices"]
    want = full.state_dict()["state"][index]["block_0"]["shampoo"]["factor_matrices"]
    for dim, n in ((0, 600), (1, 520)):
        rows, cols = torch.triu_indices(n, n)
        assert saved[dim].shape == (n * (n + 1) // 2,)
        # Position (i, j) holds the lower triangle's (j, i), as the triangle packing keeps it.
        assert torch.equal(saved[dim], want[dim][cols, rows])
    # Compared as saved: a diagonal tile's upper triangle is not saved (it is never read, and
    # a load fills it with the mirror of the lower one).
    live = {
        key: runtime.preconditioner._factors.reference_layout(pool).clone()
        for runtime in packed._runtimes
        for key, pool in runtime.preconditioner._factors.pools.items()
    }
    state = copy.deepcopy(packed.state_dict())  # (untiled entries are the live tensors)
    for runtime in packed._runtimes:
        for pool in runtime.preconditioner._factors.pools.values():
            pool.factors.zero_()
    packed.load_state_dict(state)
    for runtime in packed._runtimes:
        factors = runtime.preconditioner._factors
        for key, pool in factors.pools.items():
            assert torch.equal(factors.reference_layout(pool), live[key]), key
