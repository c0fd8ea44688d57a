"""Shape and sequence tools for Shampoo: merging small dims, blocking, index ranges, contexts,
packing symmetric matrices into their upper triangle, and the assignment of blocks to ranks
(``distribute_buffer_sizes``, ``greedy_bin_pack``).

The parameter exchange between ranks (``prepare_update_param_buffers``,
``redistribute_and_update_params``) talks to other ranks, so it lives in
``param_redistribution`` and is re-exported here.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from functools import cache, reduce
from itertools import accumulate, chain, compress, pairwise
from types import TracebackType
from typing import Generic, TypeVar

import torch

from nanoshampoo.optim.shampoo.utils.commons import InvalidArgumentError, check_argument
from nanoshampoo.optim.shampoo.utils.load_balancing_utils import (
    DefaultCostModel,
    LoadBalancingConfig,
)
from nanoshampoo.optim.shampoo.utils.param_redistribution import (
    UpdateParamBuffers,
    prepare_update_param_buffers,
    redistribute_and_update_params,
)
from nanoshampoo.validation import check_int

__all__ = [
    "ParameterizeEnterExitContext",
    "UpdateParamBuffers",
    "compress_list",
    "distribute_buffer_sizes",
    "generate_pairwise_indices",
    "get_dtype_size",
    "greedy_bin_pack",
    "merge_small_dims",
    "multi_dim_split",
    "owner_ranks_by_bucket",
    "pack_upper_triangular",
    "prepare_update_param_buffers",
    "redistribute_and_update_params",
    "unpack_upper_triangular",
]

T = TypeVar("T")


def merge_small_dims(
    tensor_shape: Sequence[int],
    threshold: int,
    target_tensor_dimensionality: int | float = 2,
) -> tuple[int, ...]:
    """Reshape plan for a tensor: squeeze size-1 dims, then merge small adjacent dims.

    A shape containing a 0 always becomes ``(0,)``. With ``target_tensor_dimensionality=math.inf``
    (no merging) the shape is returned as it is, size-1 dims and 0-D included, as the reference
    library does. Otherwise:
      1. Drop every size-1 dim. All-ones shapes and 0-D shapes ``()`` become ``(1,)``; a shape
         containing a 0 becomes ``(0,)`` (an empty tensor has nothing to precondition).
      2. Walk the dims from the last to the first, multiplying a dim into the merged dim to its
         right while the product stays ``<= threshold`` and the result still has more than
         ``target_tensor_dimensionality`` dims (counting the dims not yet visited). Merging from
         the back keeps the contiguous trailing dims (e.g. the kernel of a conv weight) together.

    The product of the result always equals the product of ``tensor_shape``, so
    ``tensor.view(merge_small_dims(tensor.shape, ...))`` is valid for contiguous tensors.
    Results are cached per ``(shape, threshold, target)``.

    Args:
        tensor_shape: the shape, any sequence of non-negative ints (``torch.Size`` works).
        threshold: largest merged dim allowed; merges stop at products above it.
        target_tensor_dimensionality: an int ``>= 1``: stop merging once the result has this many
            dims; or ``math.inf``: the shape unchanged. Any other float is rejected.

    Returns:
        The new shape, a tuple of ints; empty only for ``()`` with the target ``math.inf``.

    Raises:
        InvalidArgumentError (a ``ValueError`` and ``AssertionError``): negative dims, or a bad
            ``target_tensor_dimensionality``.

    Example:
        >>> merge_small_dims((32, 3, 64, 64), threshold=8192, target_tensor_dimensionality=2)
        (96, 4096)
        >>> merge_small_dims((1, 2, 5, 1), threshold=10, target_tensor_dimensionality=1)
        (10,)
        >>> merge_small_dims((2, 1, 3), threshold=100, target_tensor_dimensionality=math.inf)
        (2, 1, 3)
    """
    shape = tuple(int(d) for d in tensor_shape)
    if any(d < 0 for d in shape):
        raise InvalidArgumentError(
            f"merge_small_dims: tensor_shape must have dims >= 0, got {shape}"
        )
    target = check_argument(
        check_int,
        "merge_small_dims: target_tensor_dimensionality",
        target_tensor_dimensionality,
        at_least=1,
        or_infinity=True,
    )
    return _merge_small_dims_cached(shape, threshold, target)


@cache
def _merge_small_dims_cached(
    shape: tuple[int, ...], threshold: int, target: int | float
) -> tuple[int, ...]:
    if 0 in shape:
        return (0,)
    if target == math.inf:
        return shape
    squeezed = [d for d in shape if d != 1] or [1]
    merged_reversed = [squeezed[-1]]
    for index in range(len(squeezed) - 2, -1, -1):
        dim = squeezed[index]
        # Dims the result would have if nothing more were merged: merged so far + unvisited.
        result_ndim = len(merged_reversed) + index + 1
        if result_ndim > target and merged_reversed[-1] * dim <= threshold:
            merged_reversed[-1] *= dim
        else:
            merged_reversed.append(dim)
    return tuple(reversed(merged_reversed))


def multi_dim_split(tensor: torch.Tensor, split_size: int | float) -> tuple[torch.Tensor, ...]:
    """Split ``tensor`` into blocks of at most ``split_size`` along every dim, as views.

    Dims are split in order (dim 0 first, then each piece along dim 1, ...), so blocks come out
    in row-major order of the block grid. A dim of size ``<= split_size`` is not split; the last
    block along a dim is smaller when its size is not divisible. A 0-D tensor is one block.

    Args:
        tensor: any tensor.
        split_size: an int ``>= 1``, or ``math.inf`` for "do not split" (returns ``(tensor,)``).

    Returns:
        Tuple of views of ``tensor`` (writing to a block writes to ``tensor``).

    Raises:
        InvalidArgumentError (a ``ValueError`` and ``AssertionError``): ``split_size`` is neither
            an int ``>= 1`` nor ``math.inf``.

    Example:
        >>> [tuple(b.shape) for b in multi_dim_split(torch.zeros(5, 3), 2)]
        [(2, 2), (2, 1), (2, 2), (2, 1), (1, 2), (1, 1)]
    """
    if split_size == math.inf:
        return (tensor,)
    check_argument(
        check_int, "multi_dim_split: split_size", split_size, at_least=1, or_infinity=True
    )
    return reduce(
        lambda blocks, dim: tuple(
            piece
            for block in blocks
            for piece in (
                torch.split(block, split_size, dim) if block.shape[dim] > split_size else (block,)
            )
        ),
        range(tensor.dim()),
        (tensor,),
    )


def compress_list(complete_list: Sequence[T], selector: Sequence[bool]) -> tuple[T, ...]:
    """The items of ``complete_list`` whose ``selector`` entry is true, as a tuple.

    Like ``itertools.compress`` but both sequences must have the same length.

    Raises:
        InvalidArgumentError (a ``ValueError`` and ``AssertionError``): the lengths differ.

    Example:
        >>> compress_list(["a", "b", "c", "d"], [True, False, True, False])
        ('a', 'c')
    """
    if len(complete_list) != len(selector):
        raise InvalidArgumentError(
            "compress_list: Inconsistent lengths between complete_list and selector, "
            f"got len(complete_list)={len(complete_list)} and len(selector)={len(selector)}"
        )
    return tuple(compress(complete_list, selector))


def get_dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``, rounded up to whole bytes.

    ``torch.bool`` is 1; floating dtypes use ``torch.finfo(dtype).bits``, complex dtypes twice
    the bits of their real part, integer dtypes ``torch.iinfo(dtype).bits``; bits become bytes as
    ``(bits + 7) // 8``.

    Raises:
        ValueError: dtypes with none of these (e.g. ``torch.bits8``, ``torch.uint4``).

    Example:
        >>> get_dtype_size(torch.bfloat16), get_dtype_size(torch.bool), get_dtype_size(torch.int64)
        (2, 1, 8)
    """
    if dtype is torch.bool:
        return 1
    if dtype.is_complex:
        bits = 2 * torch.finfo(dtype).bits
    elif dtype.is_floating_point:
        bits = torch.finfo(dtype).bits
    else:
        try:
            bits = torch.iinfo(dtype).bits
        except TypeError as exc:
            raise ValueError(f"get_dtype_size: no bit width known for dtype {dtype}") from exc
    return (bits + 7) // 8


def generate_pairwise_indices(sizes: Sequence[int]) -> Iterator[tuple[int, int]]:
    """Half-open ``(start, end)`` ranges of consecutive segments with the given sizes.

    Used to slice a flat list of blocks back into per-parameter groups.

    Raises:
        ValueError: a negative size.

    Example:
        >>> list(generate_pairwise_indices([2, 3, 1]))
        [(0, 2), (2, 5), (5, 6)]
    """
    sizes = list(sizes)
    if any(size < 0 for size in sizes):
        raise ValueError(f"generate_pairwise_indices: sizes must be >= 0, got {sizes}")
    return pairwise(accumulate(chain([0], sizes)))


class ParameterizeEnterExitContext(Generic[T]):
    """Calls ``enter_method_caller(obj)`` on ``__enter__`` and ``exit_method_caller(obj)`` on exit.

    The exit callback also runs when the body raises (the exception then propagates). ``with``
    binds ``obj`` itself.

    Example:
        >>> class Switch:
        ...     on = False
        >>> s = Switch()
        >>> with ParameterizeEnterExitContext(
        ...     s, lambda o: setattr(o, "on", True), lambda o: setattr(o, "on", False)
        ... ):
        ...     print(s.on)
        True
        >>> s.on
        False
    """

    def __init__(
        self,
        input_with_enter_exit_context: T,
        enter_method_caller: Callable[[T], object],
        exit_method_caller: Callable[[T], object],
    ) -> None:
        self._obj = input_with_enter_exit_context
        self._enter = enter_method_caller
        self._exit = exit_method_caller

    def __enter__(self) -> T:
        self._enter(self._obj)
        return self._obj

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._exit(self._obj)


@cache
def _triu_indices(dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column indices of the upper triangle of a ``dim x dim`` matrix, row-major.

    Cached per ``(dim, device)`` because the factor dims of a model are few and fixed; callers
    must not modify the returned tensors. int32 halves the cache (``dim`` is at most a few
    thousand, far below 2**31).
    """
    rows, cols = torch.triu_indices(dim, dim, device=device).to(torch.int32)
    return rows, cols


def pack_upper_triangular(matrix: torch.Tensor) -> torch.Tensor:
    """The upper triangle (diagonal included) of square matrices, as flat vectors, row-major.

    Order for ``d = 3``: ``(0,0), (0,1), (0,2), (1,1), (1,2), (2,2)``, which is the order of
    ``torch.triu_indices(d, d)``. For a symmetric matrix this holds every entry once, in
    ``d (d + 1) / 2`` elements instead of ``d * d``. Entries below the diagonal are not read.

    Args:
        matrix: ``(..., d, d)``, any dtype and device; leading dims are batch dims.

    Returns:
        A new contiguous tensor ``(..., d (d + 1) / 2)`` of the same dtype and device.

    Raises:
        InvalidArgumentError (a ``ValueError`` and ``AssertionError``): ``matrix`` is not a
            (batch of) square matrix.

    Example:
        >>> pack_upper_triangular(torch.tensor([[1.0, 2.0], [2.0, 4.0]]))
        tensor([1., 2., 4.])
    """
    if matrix.dim() < 2 or matrix.shape[-1] != matrix.shape[-2]:
        raise InvalidArgumentError(
            f"pack_upper_triangular: matrix must have shape (..., d, d), got {tuple(matrix.shape)}"
        )
    rows, cols = _triu_indices(matrix.shape[-1], matrix.device)
    return matrix[..., rows, cols].contiguous()


def unpack_upper_triangular(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """The symmetric ``dim x dim`` matrices whose upper triangles ``packed`` holds.

    Inverse of :func:`pack_upper_triangular` for symmetric matrices: each packed entry ``(i, j)``
    is written to both ``(i, j)`` and ``(j, i)``.

    Args:
        packed: ``(..., dim (dim + 1) / 2)``, row-major upper triangles.
        dim: the matrix size, an int ``>= 0``.

    Returns:
        A new tensor ``(..., dim, dim)`` of the same dtype and device, symmetric.

    Raises:
        InvalidArgumentError (a ``ValueError`` and ``AssertionError``): a bad ``dim``, or a last
            dim of ``packed`` other than ``dim (dim + 1) / 2``.

    Example:
        >>> unpack_upper_triangular(torch.tensor([1.0, 2.0, 4.0]), dim=2)
        tensor([[1., 2.],
                [2., 4.]])
    """
    check_argument(check_int, "unpack_upper_triangular: dim", dim, at_least=0)
    expected = dim * (dim + 1) // 2
    if packed.dim() < 1 or packed.shape[-1] != expected:
        raise InvalidArgumentError(
            f"unpack_upper_triangular: packed must have shape (..., {expected}) for {dim=}, "
            f"got {tuple(packed.shape)}"
        )
    rows, cols = _triu_indices(dim, packed.device)
    matrix = packed.new_zeros((*packed.shape[:-1], dim, dim))
    matrix[..., rows, cols] = packed
    matrix[..., cols, rows] = packed
    return matrix


def _check_num_bins(name: str, value: int) -> None:
    check_argument(check_int, name, value, at_least=1)


def _longest_first_assignment(
    costs: Sequence[float],
    num_bins: int,
    order: Sequence[int],
    start: Sequence[float] | None = None,
) -> tuple[list[int], list[float]]:
    """Greedy LPT: items in ``order`` each go to the least-loaded bin, ties to the lower bin.

    Returns the bin of every item (by item index) and the total cost of every bin. The loads
    start at ``start`` (per bin; default int 0, so int costs give int totals).
    """
    loads: list[tuple[float, int]] = [
        (0 if start is None else start[b], b) for b in range(num_bins)
    ]
    heapq.heapify(loads)
    bins = [0] * len(costs)
    for index in order:
        load, b = heapq.heappop(loads)
        bins[index] = b
        heapq.heappush(loads, (load + costs[index], b))
    totals: list[float] = [0] * num_bins
    for load, b in loads:
        totals[b] = load
    return bins, totals


def greedy_bin_pack(
    items: Sequence[T], num_bins: int, cost_fn: Callable[[T], float]
) -> tuple[list[list[T]], list[float]]:
    """Partition ``items`` into ``num_bins`` bins with balanced total cost (greedy LPT).

    Items go in decreasing cost, equal costs in decreasing position (the reference library's
    order, so both libraries form the same bins), each to the bin with the least total cost so
    far, ties to the lower bin. Deterministic; items are never compared with each other. With
    ``n`` items the largest bin total exceeds the smallest by at most the largest item cost.

    Args:
        items: the things to partition; any objects.
        num_bins: an int ``>= 1``; bins may stay empty.
        cost_fn: the cost of one item, a number (called once per item).

    Returns:
        ``(bins, bin_costs)``: ``bins[b]`` lists the items of bin ``b`` in the order they were
        placed (largest first); ``bin_costs[b]`` is their total cost (an int for int costs).

    Raises:
        InvalidArgumentError (a ``ValueError`` and ``AssertionError``): a bad ``num_bins``.

    Example:
        >>> greedy_bin_pack([1000, 100, 100, 100], num_bins=2, cost_fn=lambda x: x)
        ([[1000], [100, 100, 100]], [1000, 300])
    """
    _check_num_bins("greedy_bin_pack: num_bins", num_bins)
    costs = [cost_fn(item) for item in items]
    order = sorted(range(len(costs)), key=lambda i: (costs[i], i), reverse=True)
    assignment, totals = _longest_first_assignment(costs, num_bins, order)
    bins: list[list[T]] = [[] for _ in range(num_bins)]
    for index in order:
        bins[assignment[index]].append(items[index])
    return bins, totals


def owner_ranks_by_bucket(
    buckets: Sequence[Sequence[torch.Tensor]],
    group_size: int,
    load_balancing_config: LoadBalancingConfig | None = None,
) -> list[list[int]]:
    """An owner rank for every tensor of every bucket: greedy LPT with the load carried over.

    The buckets are taken in order. Within one, the tensors go in decreasing load, ties by
    position, each to the rank with the least load so far, ties to the lower rank, where the
    load of a rank counts the tensors it got in the earlier buckets too. So a single bucket gets
    :func:`distribute_buffer_sizes`' ranks, every bucket of at least ``group_size`` tensors
    tends to reach every rank, and over all buckets the ranks' loads stay within the largest
    tensor's load of each other. A load is ``load_balancing_config.cost_model.cost`` of a meta
    tensor of the tensor's shape and dtype (default: its bytes rounded up to 64): a ``DTensor``
    costs as its whole (global) shape, whatever its device. The ``ROUND_ROBIN`` owner map of
    FSDP2/HSDP (``param_group_split.py``, ``distributor/fully_shard_plan.py``).

    Args:
        buckets: per bucket, its tensors (any shapes, 0-D and empty included).
        group_size: the number of ranks, int ``>= 1``.
        load_balancing_config: what to balance; ``None`` means ``LoadBalancingConfig()``.

    Returns:
        Per bucket, the owner rank (``0 <= rank < group_size``) of each of its tensors, in
        bucket order. The same on every rank for the same shapes.

    Example:
        >>> t = [torch.empty(n, dtype=torch.uint8, device="meta") for n in (64, 640, 64, 640)]
        >>> owner_ranks_by_bucket([t[:2], t[2:]], group_size=2)
        [[1, 0], [0, 1]]
    """
    _check_num_bins("owner_ranks_by_bucket: group_size", group_size)
    cost_model = (load_balancing_config or LoadBalancingConfig()).cost_model
    carried: list[float] = [0] * group_size
    result = []
    for bucket in buckets:
        loads = [
            float(cost_model.cost(torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")))
            for t in bucket
        ]
        order = sorted(range(len(loads)), key=lambda i: (-loads[i], i))
        ranks, carried = _longest_first_assignment(loads, group_size, order, carried)
        result.append(ranks)
    return result


def distribute_buffer_sizes(
    blocked_params: Sequence[torch.Tensor],
    group_size: int,
    load_balancing_config: LoadBalancingConfig | None = None,
) -> tuple[tuple[int, int], ...]:
    """Assign parameter blocks to ``group_size`` ranks, balancing their load; same on every rank.

    A block's aligned buffer size is ``DefaultCostModel.cost(block)`` (its bytes rounded up to
    64) and its load is ``load_balancing_config.cost_model.cost(block)`` (default: the aligned
    bytes; ``PolynomialComputationalCostModel`` weighs the dims instead). The models read only
    shapes and dtypes, so meta tensors (``torch.empty(shape, device="meta")``) work as blocks.

    Greedy (longest-processing-time first) with a heap: blocks in decreasing load, ties by
    block index, each goes to the rank with the least load so far, ties by lower rank (the
    reference library's order, so both assign alike). The result depends only on the inputs,
    so all ranks agree without communicating, and ``max load - min load <= largest block load``.

    Args:
        blocked_params: the blocks, tensors of any shape (0-D included) and dtype.
        group_size: number of ranks, int ``>= 1``.
        load_balancing_config: what to balance; ``None`` means ``LoadBalancingConfig()``.

    Returns:
        One ``(aligned_buffer_size, rank)`` per block, in block order.

    Raises:
        InvalidArgumentError (a ``ValueError`` and ``AssertionError``): a bad ``group_size``.

    Example:
        >>> blocks = [torch.empty(n, dtype=torch.uint8, device="meta") for n in (128, 64, 500, 256)]
        >>> distribute_buffer_sizes(blocks, group_size=2)
        ((128, 1), (64, 1), (512, 0), (256, 1))
    """
    _check_num_bins("distribute_buffer_sizes: group_size", group_size)
    cost_model = (load_balancing_config or LoadBalancingConfig()).cost_model
    aligned_sizes = [int(DefaultCostModel.cost(block)) for block in blocked_params]
    loads = [float(cost_model.cost(block)) for block in blocked_params]
    order = sorted(range(len(loads)), key=lambda i: (-loads[i], i))
    ranks, _ = _longest_first_assignment(loads, group_size, order)
    return tuple(zip(aligned_sizes, ranks, strict=True))
