import math
from itertools import product

import pytest
import torch

from nanoshampoo.optim.shampoo.utils.commons import InvalidArgumentError
from nanoshampoo.optim.shampoo.utils.load_balancing_utils import (
    LoadBalancingConfig,
    PolynomialComputationalCostModel,
)
from nanoshampoo.optim.shampoo.utils.shampoo_utils import (
    ParameterizeEnterExitContext,
    compress_list,
    distribute_buffer_sizes,
    generate_pairwise_indices,
    get_dtype_size,
    greedy_bin_pack,
    merge_small_dims,
    multi_dim_split,
    pack_upper_triangular,
    unpack_upper_triangular,
)


# ----------------------------------------------------------------------------- merge_small_dims
@pytest.mark.parametrize(
    ("shape", "threshold", "target", "expected"),
    [
        ((32, 3, 64, 64), 8192, 2, (96, 4096)),  # spec example
        ((1, 2, 5, 1), 10, 1, (10,)),  # spec example
        ((), 10, 2, (1,)),  # 0-D -> 1-D
        ((1, 1, 1), 10, 2, (1,)),  # all ones
        ((3, 0, 4), 10, 2, (0,)),  # empty
        ((7,), 1, 1, (7,)),  # nothing to merge
        ((2, 3, 4), 1000, 1, (24,)),
        ((2, 3, 4), 1000, 2, (2, 12)),  # stops at the target although 24 <= threshold
        ((2, 3, 4), 1000, 3, (2, 3, 4)),
        ((2, 3, 4), 11, 1, (6, 4)),  # threshold blocks 12 = 3 * 4
        ((32, 3, 64, 64), 1024, 2, (32, 192, 64)),  # threshold wins over the target
        ((2, 1, 3, 1), 100, math.inf, (2, 1, 3, 1)),  # inf: the shape unchanged
        ((1, 2, 5, 1), 10, 5, (2, 5)),
    ],
)
def test_merge_small_dims_examples(
    shape: tuple[int, ...], threshold: int, target: int | float, expected: tuple[int, ...]
) -> None:
    assert merge_small_dims(shape, threshold, target) == expected


def _reference_merge(shape: tuple[int, ...], threshold: int, target: int) -> tuple[int, ...]:
    """Slow reference: repeatedly merge the right-most mergeable adjacent pair."""
    if 0 in shape:
        return (0,)
    dims = [d for d in shape if d != 1] or [1]
    position = len(dims) - 1
    while position > 0 and len(dims) > target:
        if dims[position - 1] * dims[position] <= threshold:
            dims[position - 1 : position + 1] = [dims[position - 1] * dims[position]]
        position -= 1
    return tuple(dims)


@pytest.mark.parametrize("target", [1, 2, 3])
@pytest.mark.parametrize("threshold", [1, 6, 30, 10_000])
def test_merge_small_dims_matches_reference_and_keeps_numel(threshold: int, target: int) -> None:
    for shape in product([1, 2, 3, 5], repeat=3):
        merged = merge_small_dims(shape, threshold, target)
        assert merged == _reference_merge(shape, threshold, target), shape
        assert math.prod(merged) == math.prod(shape)


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ((1, 2, 5, 1), (1, 2, 5, 1)),
        ((), ()),
        ((1,), (1,)),
        ((32, 3, 64, 64), (32, 3, 64, 64)),
        ((4, 0, 1), (0,)),
    ],
    ids=str,
)
def test_merge_small_dims_inf_target_keeps_the_shape(
    shape: tuple[int, ...], expected: tuple[int, ...]
) -> None:
    # As the reference library: no squeezing either (an empty shape still becomes (0,)).
    assert merge_small_dims(shape, 1_000_000, math.inf) == expected
    assert merge_small_dims(torch.Size(shape), 1, math.inf) == expected


def test_merge_small_dims_accepts_torch_size_and_lists() -> None:
    assert merge_small_dims(torch.Size([4, 1, 4]), 16, 1) == (16,)
    assert merge_small_dims([4, 1, 4], 16, 1) == (16,)


@pytest.mark.parametrize("target", [2.0, 0.5, -math.inf, math.nan])
def test_merge_small_dims_rejects_finite_float_targets(target: float) -> None:
    with pytest.raises(
        InvalidArgumentError,
        match=r"target_tensor_dimensionality must be an int >= 1 or math.inf, got",
    ):
        merge_small_dims((2, 3), 10, target)


@pytest.mark.parametrize("target", [0, -1, True, "2"])
def test_merge_small_dims_rejects_bad_int_targets(target: object) -> None:
    with pytest.raises(ValueError, match=r"int >= 1 or math.inf, got"):
        merge_small_dims((2, 3), 10, target)  # type: ignore[arg-type]


def test_merge_small_dims_rejects_negative_dims() -> None:
    with pytest.raises(ValueError, match=r"dims >= 0, got \(2, -1\)"):
        merge_small_dims((2, -1), 10)


# ----------------------------------------------------------------------------- multi_dim_split
def _reference_blocks(tensor: torch.Tensor, split_size: int) -> list[torch.Tensor]:
    """Slow reference: enumerate the block grid in row-major order and slice each block."""
    ranges = [
        [(start, min(start + split_size, size)) for start in range(0, size, split_size)] or [(0, 0)]
        for size in tensor.shape
    ]
    return [tensor[tuple(slice(a, b) for a, b in corner)] for corner in product(*ranges)]


@pytest.mark.parametrize(
    "shape", [(5, 3), (4, 4), (7,), (1, 9), (2, 3, 5), (6, 6, 1), (0, 3)], ids=str
)
@pytest.mark.parametrize("split_size", [1, 2, 4, 100])
def test_multi_dim_split_matches_reference(shape: tuple[int, ...], split_size: int) -> None:
    tensor = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    blocks = multi_dim_split(tensor, split_size)
    reference = _reference_blocks(tensor, split_size)
    assert isinstance(blocks, tuple)
    assert [b.shape for b in blocks] == [r.shape for r in reference]
    for block, ref in zip(blocks, reference, strict=True):
        assert torch.equal(block, ref)
        assert max(block.shape, default=0) <= split_size or block.numel() == 0


def test_multi_dim_split_returns_views() -> None:
    tensor = torch.zeros(5, 3)
    for index, block in enumerate(multi_dim_split(tensor, 2)):
        block.fill_(index + 1)
    assert torch.equal(
        tensor,
        torch.tensor([[1, 1, 2], [1, 1, 2], [3, 3, 4], [3, 3, 4], [5, 5, 6]], dtype=torch.float32),
    )


def test_multi_dim_split_inf_and_0d_give_the_tensor_itself() -> None:
    tensor = torch.randn(3, 4)
    (block,) = multi_dim_split(tensor, math.inf)
    assert block is tensor
    scalar = torch.tensor(2.0)
    assert multi_dim_split(scalar, 1) == (scalar,)


@pytest.mark.parametrize("split_size", [0, -2, 1.5, True])
def test_multi_dim_split_rejects_bad_split_size(split_size: object) -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"split_size must be an int >= 1 or math.inf, got"
    ):
        multi_dim_split(torch.zeros(2, 2), split_size)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- small helpers
@pytest.mark.parametrize(
    ("seq", "selector", "expected"),
    [
        (["a", "b", "c", "d"], [True, False, True, False], ("a", "c")),
        ([], [], ()),
        ((1, 2), (False, False), ()),
        ((1,), (True,), (1,)),
    ],
)
def test_compress_list(seq: list, selector: list, expected: tuple) -> None:
    assert compress_list(seq, selector) == expected
    assert compress_list(complete_list=seq, selector=selector) == expected


@pytest.mark.parametrize("caught", [ValueError, AssertionError])
def test_compress_list_rejects_mismatched_lengths(caught: type[Exception]) -> None:
    # Both the type a ValueError-minded caller catches and the reference's AssertionError.
    with pytest.raises(caught, match=r"len\(complete_list\)=3 and len\(selector\)=2"):
        compress_list([1, 2, 3], [True, False])


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
        torch.float8_e4m3fn, torch.complex64, torch.complex128,
    ],
)  # fmt: skip
def test_get_dtype_size_matches_element_size(dtype: torch.dtype) -> None:
    assert get_dtype_size(dtype) == torch.empty(0, dtype=dtype).element_size()


def test_get_dtype_size_rejects_dtypes_without_bit_width() -> None:
    with pytest.raises(ValueError, match="no bit width known for dtype torch.bits8"):
        get_dtype_size(torch.bits8)


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [([2, 3, 1], [(0, 2), (2, 5), (5, 6)]), ([], []), ([4], [(0, 4)]), ([0, 2], [(0, 0), (0, 2)])],
)
def test_generate_pairwise_indices(sizes: list[int], expected: list[tuple[int, int]]) -> None:
    assert list(generate_pairwise_indices(sizes)) == expected


def test_generate_pairwise_indices_rejects_negative_sizes_at_call_time() -> None:
    with pytest.raises(ValueError, match=r"sizes must be >= 0, got \[1, -1\]"):
        generate_pairwise_indices([1, -1])


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []


def test_parameterize_enter_exit_context_calls_both_and_binds_obj() -> None:
    recorder = _Recorder()
    context = ParameterizeEnterExitContext(
        recorder, lambda r: r.calls.append("enter"), lambda r: r.calls.append("exit")
    )
    with context as bound:
        assert bound is recorder
        recorder.calls.append("body")
    assert recorder.calls == ["enter", "body", "exit"]


def test_parameterize_enter_exit_context_exits_when_body_raises() -> None:
    recorder = _Recorder()
    with pytest.raises(RuntimeError, match="boom"):
        with ParameterizeEnterExitContext(
            recorder, lambda r: r.calls.append("enter"), lambda r: r.calls.append("exit")
        ):
            raise RuntimeError("boom")
    assert recorder.calls == ["enter", "exit"]


# ----------------------------------------------------------------------- distribute_buffer_sizes
def _byte_blocks(sizes: list[int] | tuple[int, ...]) -> list[torch.Tensor]:
    """Meta blocks of ``sizes`` bytes each (no memory)."""
    return [torch.empty(size, dtype=torch.uint8, device="meta") for size in sizes]


def _reference_lpt(costs: list[float], num_bins: int, order: list[int]) -> list[int]:
    """Slow reference: place each item, in ``order``, on the first bin of least total cost."""
    totals = [0.0] * num_bins
    bins = [-1] * len(costs)
    for index in order:
        target = min(range(num_bins), key=lambda b: (totals[b], b))
        bins[index] = target
        totals[target] += costs[index]
    return bins


def test_distribute_buffer_sizes_article_example() -> None:
    # Loads 128, 64, 512, 256 (aligned): 512 -> rank 0, then 256, 128, 64 all -> rank 1.
    assert distribute_buffer_sizes(_byte_blocks((128, 64, 500, 256)), 2) == (
        (128, 1),
        (64, 1),
        (512, 0),
        (256, 1),
    )


@pytest.mark.parametrize("group_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_distribute_buffer_sizes_matches_reference_lpt(group_size: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    shapes = torch.randint(1, 40, (13, 2), generator=generator).tolist()
    blocks = [torch.empty(shape, dtype=torch.float32, device="meta") for shape in shapes]
    assignment = distribute_buffer_sizes(blocks, group_size)
    aligned = [-(-(rows * cols * 4) // 64) * 64 for rows, cols in shapes]
    assert [a for a, _ in assignment] == aligned
    order = sorted(range(len(aligned)), key=lambda i: (-aligned[i], i))
    assert [rank for _, rank in assignment] == _reference_lpt(aligned, group_size, order)
    loads = [0] * group_size
    for load, (_, rank) in zip(aligned, assignment, strict=True):
        loads[rank] += load
    assert max(loads) - min(loads) <= max(aligned)


def test_distribute_buffer_sizes_group_size_one_and_more_ranks_than_blocks() -> None:
    blocks = _byte_blocks((10, 200, 3))
    assert distribute_buffer_sizes(blocks, 1) == ((64, 0), (256, 0), (64, 0))
    # Heaviest first to the emptiest rank, ties by lower rank: each block gets its own rank.
    assert distribute_buffer_sizes(blocks, 5) == ((64, 1), (256, 0), (64, 2))
    assert distribute_buffer_sizes((), 3) == ()


def test_distribute_buffer_sizes_breaks_ties_by_index_then_rank() -> None:
    assert distribute_buffer_sizes(_byte_blocks((64,) * 5), 2) == (
        (64, 0), (64, 1), (64, 0), (64, 1), (64, 0)
    )  # fmt: skip


def test_distribute_buffer_sizes_aligns_by_dtype_bytes_and_handles_0d() -> None:
    blocks = [torch.empty(3, 5, dtype=torch.bfloat16), torch.empty(()), torch.empty(0, 4)]
    # 30 bytes -> 64, a 0-D float32 is 4 bytes -> 64, an empty block is 0 bytes.
    assert [size for size, _ in distribute_buffer_sizes(blocks, 2)] == [64, 64, 0]


def test_distribute_buffer_sizes_uses_config_cost_model_on_block_shapes() -> None:
    blocks = [torch.empty(100, 100), torch.empty(10, 10), torch.empty(90, 90), torch.empty(20, 20)]
    config = LoadBalancingConfig(cost_model=PolynomialComputationalCostModel())
    assignment = distribute_buffer_sizes(blocks, 2, config)
    # Cubic loads 2e6, 2e3, 1.458e6, 1.6e4: 100x100 alone on rank 0, the rest on rank 1.
    assert [rank for _, rank in assignment] == [0, 1, 1, 1]
    assert [size for size, _ in assignment] == [40000, 448, 32448, 1600]


def test_distribute_buffer_sizes_quadratic_model_balances_exactly() -> None:
    # 384^2 = 256^2 + 256^2 + 128^2: the quadratic load is split evenly.
    blocks = _byte_blocks((256, 128, 384, 256))
    config = LoadBalancingConfig(cost_model=PolynomialComputationalCostModel((0.0, 0.0, 1.0)))
    assert distribute_buffer_sizes(blocks, 2, config) == ((256, 1), (128, 1), (384, 0), (256, 1))


@pytest.mark.parametrize("group_size", [0, -1, 1.0, True])
def test_distribute_buffer_sizes_rejects_bad_group_size(group_size: object) -> None:
    with pytest.raises(InvalidArgumentError, match=r"group_size must be an int >= 1, got"):
        distribute_buffer_sizes(_byte_blocks((1,)), group_size)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- greedy_bin_pack
@pytest.mark.parametrize("num_bins", [1, 2, 3, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_bin_pack_matches_reference_lpt(num_bins: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    costs = torch.randint(0, 6, (11,), generator=generator).tolist()  # many ties
    items = [f"item{i}" for i in range(len(costs))]
    bins, totals = greedy_bin_pack(items, num_bins, cost_fn=lambda item: costs[items.index(item)])
    # The reference library's order: decreasing cost, equal costs by decreasing position.
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], -i))
    expected = _reference_lpt([float(c) for c in costs], num_bins, order)
    assert bins == [[items[i] for i in order if expected[i] == b] for b in range(num_bins)]
    assert totals == [sum(costs[i] for i in range(len(costs)) if expected[i] == b)
                      for b in range(num_bins)]  # fmt: skip
    assert all(isinstance(total, int) for total in totals)


def test_greedy_bin_pack_examples() -> None:
    assert greedy_bin_pack([1000, 100, 100, 100], 2, lambda x: x) == (
        [[1000], [100, 100, 100]], [1000, 300]
    )  # fmt: skip
    assert greedy_bin_pack(list(range(6)), 3, lambda x: 1) == ([[5, 2], [4, 1], [3, 0]], [2, 2, 2])
    assert greedy_bin_pack(["a", "b"], 4, lambda x: 1) == ([["b"], ["a"], [], []], [1, 1, 0, 0])
    assert greedy_bin_pack([], 3, lambda x: x) == ([[], [], []], [0, 0, 0])


def test_greedy_bin_pack_never_compares_items() -> None:
    class Opaque:  # no ordering: equal costs must not fall back to comparing items
        pass

    items = [Opaque() for _ in range(4)]
    bins, totals = greedy_bin_pack(items, 2, lambda item: 1.5)
    assert bins == [[items[3], items[1]], [items[2], items[0]]]
    assert totals == [3.0, 3.0]


@pytest.mark.parametrize("num_bins", [0, -2, 2.0, False])
def test_greedy_bin_pack_rejects_bad_num_bins(num_bins: object) -> None:
    with pytest.raises(InvalidArgumentError, match=r"num_bins must be an int >= 1, got"):
        greedy_bin_pack([1], num_bins, lambda x: x)  # type: ignore[arg-type]


# ------------------------------------------------------------ pack / unpack_upper_triangular
def _reference_pack(matrix: torch.Tensor) -> torch.Tensor:
    """Slow reference: read the upper triangle row by row with plain loops."""
    d = matrix.shape[-1]
    return torch.stack([matrix[..., i, j] for i in range(d) for j in range(i, d)], dim=-1)


@pytest.mark.parametrize("dim", [1, 2, 3, 5, 8])
def test_pack_upper_triangular_reads_the_upper_triangle_row_major(dim: int) -> None:
    generator = torch.Generator().manual_seed(dim)
    matrix = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
    packed = pack_upper_triangular(matrix)
    assert packed.shape == (dim * (dim + 1) // 2,) and packed.is_contiguous()
    assert torch.equal(packed, _reference_pack(matrix))
    # Nothing below the diagonal is read: changing it does not change the packing.
    assert torch.equal(pack_upper_triangular(torch.triu(matrix)), packed)


def test_pack_upper_triangular_example_values() -> None:
    matrix = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    assert torch.equal(pack_upper_triangular(matrix), torch.tensor([1.0, 2.0, 3.0, 5.0, 6.0, 9.0]))


@pytest.mark.parametrize("dim", [0, 1, 2, 4, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_pack_unpack_round_trip_against_a_dense_triangle(dim: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(dim)
    upper = torch.triu(torch.randn(dim, dim, generator=generator, dtype=torch.float64)).to(dtype)
    symmetric = upper + upper.triu(1).T  # the dense symmetric matrix with that upper triangle
    packed = pack_upper_triangular(symmetric)
    assert packed.dtype == dtype
    unpacked = unpack_upper_triangular(packed, dim)
    assert unpacked.dtype == dtype and unpacked.shape == (dim, dim)
    assert torch.equal(unpacked, symmetric)
    assert torch.equal(unpacked, unpacked.T)


def test_pack_unpack_batched_leading_dims() -> None:
    generator = torch.Generator().manual_seed(0)
    factors = torch.randn(2, 3, 4, 4, generator=generator)
    factors = factors + factors.transpose(-1, -2)
    packed = pack_upper_triangular(factors)
    assert packed.shape == (2, 3, 10)
    for index in product(range(2), range(3)):
        assert torch.equal(packed[index], pack_upper_triangular(factors[index]))
    assert torch.equal(unpack_upper_triangular(packed, 4), factors)


def test_unpack_upper_triangular_example_values() -> None:
    expected = torch.tensor([[1.0, 2.0, 3.0], [2.0, 5.0, 6.0], [3.0, 6.0, 9.0]])
    assert torch.equal(
        unpack_upper_triangular(torch.tensor([1.0, 2.0, 3.0, 5.0, 6.0, 9.0]), dim=3), expected
    )


@pytest.mark.parametrize("shape", [(3,), (2, 3), (4, 3, 2)], ids=str)
def test_pack_upper_triangular_rejects_non_square(shape: tuple[int, ...]) -> None:
    with pytest.raises(InvalidArgumentError, match=r"shape \(\.\.\., d, d\), got"):
        pack_upper_triangular(torch.zeros(shape))


@pytest.mark.parametrize(
    ("packed", "dim", "message"),
    [
        (torch.zeros(5), 3, r"shape \(\.\.\., 6\) for dim=3, got \(5,\)"),
        (torch.zeros(()), 1, r"shape \(\.\.\., 1\) for dim=1, got \(\)"),
        (torch.zeros(3), -1, r"dim must be an int >= 0, got -1"),
        (torch.zeros(3), 2.0, r"dim must be an int >= 0, got 2.0"),
    ],
)
def test_unpack_upper_triangular_rejects_bad_input(
    packed: torch.Tensor, dim: object, message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        unpack_upper_triangular(packed, dim)  # type: ignore[arg-type]
