"""Shape and sequence tools for Shampoo: merging small dims, blocking, index ranges, contexts,
and the assignment of blocks to ranks (``distribute_buffer_sizes``).

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

from nanoshampoo.optim.shampoo.utils.load_balancing_utils import (
    DefaultCostModel,
    LoadBalancingConfig,
)
from nanoshampoo.optim.shampoo.utils.param_redistribution import (
    UpdateParamBuffers,
    prepare_update_param_buffers,
    redistribute_and_update_params,
)

__all__ = [
    "ParameterizeEnterExitContext",
    "UpdateParamBuffers",
    "compress_list",
    "distribute_buffer_sizes",
    "generate_pairwise_indices",
    "get_dtype_size",
    "merge_small_dims",
    "multi_dim_split",
    "prepare_update_param_buffers",
    "redistribute_and_update_params",
]

T = TypeVar("T")


def merge_small_dims(
    tensor_shape: Sequence[int],
    threshold: int,
    target_tensor_dimensionality: int | float = 2,
) -> tuple[int, ...]:
    """Reshape plan for a tensor: squeeze size-1 dims, then merge small adjacent dims.

    Steps:
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
            dims; or ``math.inf``: no merging at all (only step 1). Any other float is rejected.

    Returns:
        The new shape as a tuple of ints, never empty.

    Raises:
        ValueError: negative dims, or a bad ``target_tensor_dimensionality``.

    Example:
        >>> merge_small_dims((32, 3, 64, 64), threshold=8192, target_tensor_dimensionality=2)
        (96, 4096)
        >>> merge_small_dims((1, 2, 5, 1), threshold=10, target_tensor_dimensionality=1)
        (10,)
        >>> merge_small_dims((2, 1, 3), threshold=100, target_tensor_dimensionality=math.inf)
        (2, 3)
    """
    shape = tuple(int(d) for d in tensor_shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"merge_small_dims: tensor_shape must have dims >= 0, got {shape}")
    target = target_tensor_dimensionality
    if isinstance(target, float):
        if target != math.inf:
            raise ValueError(
                "merge_small_dims: target_tensor_dimensionality may be a float only when it is "
                f"math.inf (no merging), got {target!r}"
            )
    elif isinstance(target, bool) or not isinstance(target, int) or target < 1:
        raise ValueError(
            "merge_small_dims: target_tensor_dimensionality must be an int >= 1 or math.inf, "
            f"got {target!r}"
        )
    return _merge_small_dims_cached(shape, threshold, target)


@cache
def _merge_small_dims_cached(
    shape: tuple[int, ...], threshold: int, target: int | float
) -> tuple[int, ...]:
    if 0 in shape:
        return (0,)
    squeezed = [d for d in shape if d != 1] or [1]
    if target == math.inf:
        return tuple(squeezed)
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
        ValueError: ``split_size`` is neither an int ``>= 1`` nor ``math.inf``.

    Example:
        >>> [tuple(b.shape) for b in multi_dim_split(torch.zeros(5, 3), 2)]
        [(2, 2), (2, 1), (2, 2), (2, 1), (1, 2), (1, 1)]
    """
    if split_size == math.inf:
        return (tensor,)
    if isinstance(split_size, bool) or not isinstance(split_size, int) or split_size < 1:
        raise ValueError(
            f"multi_dim_split: split_size must be an int >= 1 or math.inf, got {split_size!r}"
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


def compress_list(seq: Sequence[T], selector: Sequence[bool]) -> tuple[T, ...]:
    """The items of ``seq`` whose ``selector`` entry is true, as a tuple.

    Like ``itertools.compress`` but both sequences must have the same length.

    Raises:
        ValueError: the lengths differ.

    Example:
        >>> compress_list(["a", "b", "c", "d"], [True, False, True, False])
        ('a', 'c')
    """
    if len(seq) != len(selector):
        raise ValueError(
            f"compress_list: seq and selector must have the same length, "
            f"got len(seq)={len(seq)} and len(selector)={len(selector)}"
        )
    return tuple(compress(seq, selector))


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


def distribute_buffer_sizes(
    buffer_sizes: Sequence[int],
    group_size: int,
    load_balancing_config: LoadBalancingConfig | None = None,
    blocks: Sequence[torch.Tensor] | None = None,
) -> tuple[tuple[int, int], ...]:
    """Assign blocks to ``group_size`` ranks, balancing their load; deterministic on every rank.

    Each block is described by its buffer size in bytes. Its aligned buffer size is
    ``DefaultCostModel.cost`` of the block and its load is
    ``load_balancing_config.cost_model.cost`` of the block (default: the aligned bytes). The
    cost models need a tensor: when ``blocks`` is given they get the real blocks (so a
    shape-aware model such as ``PolynomialComputationalCostModel`` sees the real dims), otherwise
    they get a proxy, a 1-D ``uint8`` meta tensor with ``buffer_size`` elements (same byte
    count, no memory; a shape-aware model then sees one dim equal to the byte count).

    Greedy (longest-processing-time first) with a heap: blocks in decreasing load, ties by
    block index, each goes to the rank with the least load so far, ties by lower rank. The
    result depends only on the inputs, so all ranks agree without communicating, and
    ``max load - min load <= largest block load``.

    Args:
        buffer_sizes: bytes per block, ints ``>= 0``.
        group_size: number of ranks, int ``>= 1``.
        load_balancing_config: what to balance; ``None`` means ``LoadBalancingConfig()``.
        blocks: optional, the blocks themselves (same length as ``buffer_sizes``), given to the
            cost models instead of the proxies.

    Returns:
        One ``(aligned_buffer_size, rank)`` per block, in block order.

    Raises:
        ValueError: bad ``group_size``, a negative size, or ``blocks`` of another length.

    Example:
        >>> distribute_buffer_sizes((128, 64, 500, 256), group_size=2)
        ((128, 1), (64, 1), (512, 0), (256, 1))
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(
            f"distribute_buffer_sizes: group_size must be an int >= 1, got {group_size!r}"
        )
    if any(size < 0 for size in buffer_sizes):
        raise ValueError(
            f"distribute_buffer_sizes: buffer_sizes must be >= 0, got {tuple(buffer_sizes)}"
        )
    if blocks is not None and len(blocks) != len(buffer_sizes):
        raise ValueError(
            "distribute_buffer_sizes: blocks must match buffer_sizes, got "
            f"len(blocks)={len(blocks)} and len(buffer_sizes)={len(buffer_sizes)}"
        )
    cost_model = (load_balancing_config or LoadBalancingConfig()).cost_model
    proxies = [torch.empty(int(size), dtype=torch.uint8, device="meta") for size in buffer_sizes]
    aligned_sizes = [int(DefaultCostModel.cost(proxy)) for proxy in proxies]
    loads = [
        float(cost_model.cost(tensor)) for tensor in (blocks if blocks is not None else proxies)
    ]

    rank_loads = [(0.0, rank) for rank in range(group_size)]  # sorted, hence already a heap
    ranks = [0] * len(loads)
    for index in sorted(range(len(loads)), key=lambda i: (-loads[i], i)):
        load, rank = heapq.heappop(rank_loads)
        ranks[index] = rank
        heapq.heappush(rank_loads, (load + loads[index], rank))
    return tuple(zip(aligned_sizes, ranks, strict=True))
