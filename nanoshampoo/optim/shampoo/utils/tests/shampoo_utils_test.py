import math
from itertools import product

import pytest
import torch

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
    merge_small_dims,
    multi_dim_split,
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
        ((2, 1, 3, 1), 100, math.inf, (2, 3)),  # inf: only squeezing
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


def test_merge_small_dims_accepts_torch_size_and_lists() -> None:
    assert merge_small_dims(torch.Size([4, 1, 4]), 16, 1) == (16,)
    assert merge_small_dims([4, 1, 4], 16, 1) == (16,)


@pytest.mark.parametrize("target", [2.0, 0.5, -math.inf, math.nan])
def test_merge_small_dims_rejects_finite_float_targets(target: float) -> None:
    with pytest.raises(ValueError, match=r"may be a float only when it is math.inf.*got"):
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
    with pytest.raises(ValueError, match=r"split_size must be an int >= 1 or math.inf, got"):
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


def test_compress_list_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match=r"len\(seq\)=3 and len\(selector\)=2"):
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
def _loads_per_rank(
    loads: list[float], assignment: tuple[tuple[int, int], ...], group_size: int
) -> list[float]:
    per_rank = [0.0] * group_size
    for load, (_, rank) in zip(loads, assignment, strict=True):
        per_rank[rank] += load
    return per_rank


def test_distribute_buffer_sizes_article_example() -> None:
    # Loads 128, 64, 512, 256 (aligned): 512 -> rank 0, then 256, 128, 64 all -> rank 1.
    assert distribute_buffer_sizes((128, 64, 500, 256), 2) == (
        (128, 1),
        (64, 1),
        (512, 0),
        (256, 1),
    )


@pytest.mark.parametrize("group_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_distribute_buffer_sizes_balances_and_aligns(group_size: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 5000, (13,), generator=generator).tolist()
    assignment = distribute_buffer_sizes(sizes, group_size)
    aligned = [-(-s // 64) * 64 for s in sizes]
    assert [a for a, _ in assignment] == aligned
    assert all(0 <= rank < group_size for _, rank in assignment)
    per_rank = _loads_per_rank(aligned, assignment, group_size)
    assert max(per_rank) - min(per_rank) <= max(aligned)
    assert distribute_buffer_sizes(list(sizes), group_size) == assignment  # deterministic


def test_distribute_buffer_sizes_group_size_one_and_more_ranks_than_blocks() -> None:
    assert distribute_buffer_sizes((10, 200, 3), 1) == ((64, 0), (256, 0), (64, 0))
    # Heaviest first to the emptiest rank, ties by lower rank: each block gets its own rank.
    assert distribute_buffer_sizes((10, 200, 3), 5) == ((64, 1), (256, 0), (64, 2))
    assert distribute_buffer_sizes((), 3) == ()


def test_distribute_buffer_sizes_breaks_ties_by_index_then_rank() -> None:
    assert distribute_buffer_sizes((64,) * 5, 2) == ((64, 0), (64, 1), (64, 0), (64, 1), (64, 0))


def test_distribute_buffer_sizes_uses_config_cost_model_on_blocks() -> None:
    blocks = [torch.empty(100, 100), torch.empty(10, 10), torch.empty(90, 90), torch.empty(20, 20)]
    sizes = [b.numel() * 4 for b in blocks]
    config = LoadBalancingConfig(cost_model=PolynomialComputationalCostModel())
    assignment = distribute_buffer_sizes(sizes, 2, config, blocks=blocks)
    # Cubic loads 2e6, 2e3, 1.458e6, 1.6e4: 100x100 alone on rank 0, the rest on rank 1.
    assert [rank for _, rank in assignment] == [0, 1, 1, 1]
    assert [size for size, _ in assignment] == [-(-s // 64) * 64 for s in sizes]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"buffer_sizes": (1,), "group_size": 0}, r"group_size must be an int >= 1, got 0"),
        ({"buffer_sizes": (1, -1), "group_size": 2}, r"buffer_sizes must be >= 0, got \(1, -1\)"),
        (
            {"buffer_sizes": (1, 2), "group_size": 2, "blocks": [torch.empty(1)]},
            r"len\(blocks\)=1 and len\(buffer_sizes\)=2",
        ),
    ],
)
def test_distribute_buffer_sizes_rejects_bad_input(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        distribute_buffer_sizes(**kwargs)
