"""Optimizer state stored in a low-precision float format and computed with in a higher one.

Shampoo keeps large per-block state (factor matrices, their roots). Storing it in bf16 halves
its memory; :class:`QuantizedTensorList` dequantizes it into the computation dtype for an update
and writes the result back afterwards::

    state = QuantizedTensorList([(t, None, None) for t in fp32_tensors], torch.bfloat16)
    with DequantizeQuantizedTensorListContext(state):
        for t in state.dequantized_value:   # float32 copies
            t.mul_(0.9)
    # state is back in bfloat16 storage; the float32 copies are freed

    values = state.dequantize()             # or by hand: new float32 copies, no cache
    state.quantize(tuple(v * 2 for v in values))

Only float formats (fp16, bf16, fp32, fp64) are supported; conversion is a rounding ``copy_``,
so the per-element relative round-trip error is at most the format's unit roundoff (2^-11 for
fp16, 2^-8 for bf16 on normal values; exact for fp32 stored and computed in fp32, and for fp64).
Storage in another format (int64, int8, fp8, ...) can be built, as in the reference library, and
raises ``NotImplementedError`` at the first conversion (``quantize`` / ``dequantize``).

The lifecycle follows the reference library: calling ``dequantize_()`` twice or ``quantize_()``
without a cache logs a warning (in the reference's words) instead of raising.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Sequence

import torch

from nanoshampoo.optim.shampoo.utils.commons import (
    InvalidArgumentError,
    InvalidStateError,
)
from nanoshampoo.optim.shampoo.utils.optimizer_modules import OptimizerModule
from nanoshampoo.optim.shampoo.utils.shampoo_block_info import BlockInfo
from nanoshampoo.optim.shampoo.utils.shampoo_utils import (
    ParameterizeEnterExitContext,
    compress_list,
)

logger = logging.getLogger(__name__)

FLOAT_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)


def _check_format(dtype: torch.dtype, role: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise NotImplementedError(
            f"{role}: Quantization for {dtype} is not yet supported! "
            f"Supported formats: {list(FLOAT_DTYPES)}"
        )


class QuantizedTensor(OptimizerModule):
    """One tensor stored in a float format, with optional min/max metadata and its block.

    ``min_value``/``max_value`` are metadata for range-based formats; the float formats here do
    not need them and conversion ignores them. ``block_info`` is structure, not state: it is not
    part of ``state_dict()``.

    Example:
        >>> info = BlockInfo(param=torch.zeros(3), composable_block_ids=(0, "block_0"))
        >>> values = torch.tensor([1.0, 2.5, 3.0])
        >>> q = QuantizedTensor.init_from_dequantized_tensor(values, torch.bfloat16, info)
        >>> q.quantized_values.dtype, q.dequantize(dequantized_dtype=torch.float32)
        (torch.bfloat16, tensor([1.0000, 2.5000, 3.0000]))
    """

    non_state_attributes = frozenset({"block_info"})

    def __init__(
        self,
        quantized_values: torch.Tensor,
        block_info: BlockInfo,
        min_value: torch.Tensor | None = None,
        max_value: torch.Tensor | None = None,
    ) -> None:
        self.quantized_values = quantized_values
        self.min_value = min_value
        self.max_value = max_value
        self.block_info = block_info

    @classmethod
    def init_from_dequantized_tensor(
        cls,
        dequantized_values: torch.Tensor,
        quantized_dtype: torch.dtype,
        block_info: BlockInfo,
    ) -> QuantizedTensor:
        """Allocate ``quantized_dtype`` storage via ``block_info``; quantize the values into it.

        Raises:
            NotImplementedError: ``quantized_dtype`` or the values' dtype is not a float format
                (raised by :meth:`quantize`).
        """
        storage = block_info.allocate_zeros_tensor(
            tuple(dequantized_values.shape), quantized_dtype, dequantized_values.device
        )
        quantized = cls(storage, block_info)
        quantized.quantize(dequantized_values)
        return quantized

    def dequantize(self, dequantized_dtype: torch.dtype) -> torch.Tensor:
        """The stored values in ``dequantized_dtype``.

        A new tensor, except when ``dequantized_dtype`` is the storage format: then the storage
        itself, as in the reference library (and :meth:`QuantizedTensorList.dequantize`), so
        that no memory is spent on a copy; writing to it writes the state.

        Raises:
            NotImplementedError: the storage or ``dequantized_dtype`` is not a float format.
        """
        _check_format(self.quantized_values.dtype, "QuantizedTensor storage dtype")
        _check_format(dequantized_dtype, "dequantize dtype")
        storage = self.block_info.get_tensor(self.quantized_values)
        return storage if storage.dtype == dequantized_dtype else storage.to(dequantized_dtype)

    def quantize(self, dequantized_tensor: torch.Tensor) -> None:
        """Round ``dequantized_tensor`` (same shape, any float format) into the storage, in place.

        Raises:
            NotImplementedError: the storage or ``dequantized_tensor`` is not in a float format.
            InvalidArgumentError (a ``ValueError`` and ``AssertionError``): the shapes differ.
        """
        _check_format(self.quantized_values.dtype, "QuantizedTensor storage dtype")
        _check_format(dequantized_tensor.dtype, "quantize input dtype")
        storage = self.block_info.get_tensor(self.quantized_values)
        if dequantized_tensor.shape != storage.shape:
            raise InvalidArgumentError(
                f"QuantizedTensor.quantize: expected shape {tuple(storage.shape)}, "
                f"got {tuple(dequantized_tensor.shape)}"
            )
        storage.copy_(dequantized_tensor)


QuantizedItem = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


class QuantizedTensorList(OptimizerModule):
    """A list of tensors sharing one storage format, dequantized together for computation.

    Build it from ``(tensor, min, max)`` tuples or from :class:`QuantizedTensor`s. A tuple whose
    tensor is in ``quantized_dtype`` is stored as it is (no copy); one in another float format
    is rounded into new ``quantized_dtype`` storage. Min/max are all ``None`` or all set. Storage
    in a format other than the four floats is kept, and :meth:`dequantize` / :meth:`quantize`
    (and the cached forms) raise ``NotImplementedError``, as in the reference library.

    Two ways to compute in ``computation_dtype`` (both the reference library's API):

    - by hand: :meth:`dequantize` returns computation-precision tensors and :meth:`quantize`
      rounds given tensors back into the storage;
    - cached: :meth:`dequantize_` caches them (:attr:`dequantized_value`); :meth:`quantize_`
      writes the cache back and drops it (and empties the CUDA caching allocator when the
      storage is on CUDA, so the freed high-precision copies really return to the device).

    When ``quantized_dtype == computation_dtype`` the dequantized tensors are the storage
    itself (no copy, no extra memory). ``state_dict()`` holds the storage (and min/max), never
    the cache.

    Args:
        quantized_data: the tensors, as described above; may be empty.
        quantized_dtype: the storage format (fp16, bf16, fp32 or fp64 to convert).
        computation_dtype: the format of the dequantized tensors, one of the four floats.

    Raises:
        InvalidArgumentError (a ``ValueError`` and ``AssertionError``): a ``computation_dtype``
            that is not one of the four; mixed tuple / ``QuantizedTensor`` items, a
            ``QuantizedTensor`` stored in another dtype, a tuple tensor that would have to
            convert to or from a non-float format, or mixed ``None`` / set min-max.

    Example:
        >>> tensors = [torch.randn(50, 50) for _ in range(3)]
        >>> qlist = QuantizedTensorList([(t, None, None) for t in tensors], torch.bfloat16)
        >>> qlist.quantized_value[0].dtype
        torch.bfloat16
        >>> with DequantizeQuantizedTensorListContext(qlist):
        ...     sums = [t.sum() for t in qlist.dequantized_value]   # float32
    """

    non_state_attributes = frozenset(
        {"quantized_dtype", "computation_dtype", "dequantized_value_list"}
    )

    def __init__(
        self,
        quantized_data: Sequence[QuantizedItem] | Sequence[QuantizedTensor],
        quantized_dtype: torch.dtype,
        computation_dtype: torch.dtype = torch.float32,
    ) -> None:
        if computation_dtype not in FLOAT_DTYPES:
            raise InvalidArgumentError(
                f"QuantizedTensorList: {computation_dtype=} is not supported! "
                f"It must be one of {FLOAT_DTYPES}!"
            )
        items = _validated_items(quantized_data, quantized_dtype)
        self.quantized_dtype = quantized_dtype
        self.computation_dtype = computation_dtype
        self.quantized_values: tuple[torch.Tensor, ...] = tuple(
            t if t.dtype == quantized_dtype else t.to(quantized_dtype) for t, _, _ in items
        )
        self.min_values: tuple[torch.Tensor | None, ...] = tuple(item[1] for item in items)
        self.max_values: tuple[torch.Tensor | None, ...] = tuple(item[2] for item in items)
        self.dequantized_value_list: tuple[torch.Tensor, ...] | None = None

    def __len__(self) -> int:
        return len(self.quantized_values)

    @property
    def quantized_value(self) -> tuple[torch.Tensor, ...]:
        """The storage tensors, in ``quantized_dtype``."""
        return self.quantized_values

    @property
    def storage_bytes(self) -> int:
        """Bytes held by the storage tensors (the cache not counted)."""
        return sum(t.numel() * t.element_size() for t in self.quantized_values)

    def is_dequantized_stored(self) -> bool:
        """Whether a dequantized cache exists (between ``dequantize_`` and ``quantize_``)."""
        return self.dequantized_value_list is not None

    @property
    def dequantized_value(self) -> tuple[torch.Tensor, ...]:
        """The cached computation-precision tensors.

        Raises:
            InvalidStateError (a ``RuntimeError`` and ``AssertionError``): no cache, i.e. read
                outside ``dequantize_()`` ... ``quantize_()``.
        """
        if self.dequantized_value_list is None:
            raise InvalidStateError(
                "QuantizedTensorList.dequantized_value: no dequantized cache; call dequantize_() "
                "or use DequantizeQuantizedTensorListContext first"
            )
        return self.dequantized_value_list

    def dequantize(self) -> tuple[torch.Tensor, ...]:
        """The values in ``computation_dtype``: new tensors, or the storage when formats match.

        Does not touch the cache. Raises ``NotImplementedError`` for non-float storage.
        """
        if self.quantized_dtype == self.computation_dtype:
            return self.quantized_values
        _check_format(self.quantized_dtype, "QuantizedTensorList storage dtype")
        return tuple(t.to(self.computation_dtype) for t in self.quantized_values)

    def quantize(self, tensor_list: Sequence[torch.Tensor]) -> None:
        """Round ``tensor_list`` (one tensor per entry, same shapes) into the storage, in place.

        Logs a warning when a cache exists and ``tensor_list`` is not it (the cache is then
        stale; ``quantize_()`` would later overwrite these values with it).

        Raises:
            NotImplementedError: the storage is not in a float format.
            InvalidArgumentError (a ``ValueError`` and ``AssertionError``): another number of
                tensors than entries, or a shape that differs from its entry's.
        """
        _check_format(self.quantized_dtype, "QuantizedTensorList storage dtype")
        if tensor_list is not self.dequantized_value_list and self.is_dequantized_stored():
            logger.warning(
                "Existing stored dequantized values.\nWriting quantized values with input "
                "tensor_list without using these stored dequantized values..."
            )
        self._write_back(tuple(tensor_list))

    def dequantize_(self) -> None:
        """Cache the values in ``computation_dtype`` (see :meth:`dequantize`).

        Logs a warning and replaces the cache when one exists (updates made to it are lost).
        """
        if self.is_dequantized_stored():
            logger.warning("Dequantized values are already stored; overwriting these values...")
        self.dequantized_value_list = self.dequantize()

    def quantize_(self) -> None:
        """Write the cached values back into storage (rounding) and free the cache.

        Logs a warning and does nothing when there is no cache.
        """
        cache = self.dequantized_value_list
        if cache is None:
            logger.warning(
                "No stored dequantized values self.dequantized_value_list=None. "
                "Must first call dequantize_()."
            )
            return
        self._write_back(cache)
        self.dequantized_value_list = None
        # Drop the last reference to the high-precision copies before returning memory.
        del cache
        if any(t.is_cuda for t in self.quantized_values) and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _write_back(self, tensors: tuple[torch.Tensor, ...]) -> None:
        if len(tensors) != len(self.quantized_values):
            raise InvalidArgumentError(
                f"QuantizedTensorList.quantize: expected {len(self.quantized_values)} tensors, "
                f"got {len(tensors)}"
            )
        for index, (stored, tensor) in enumerate(zip(self.quantized_values, tensors, strict=True)):
            if stored.shape != tensor.shape:
                raise InvalidArgumentError(
                    f"QuantizedTensorList.quantize: tensor {index} has shape "
                    f"{tuple(tensor.shape)}, its entry {tuple(stored.shape)}"
                )
        pairs = [(q, t) for q, t in zip(self.quantized_values, tensors, strict=True) if q is not t]
        if pairs:
            torch._foreach_copy_([q for q, _ in pairs], [t for _, t in pairs])

    def compress(self, selector: Sequence[bool]) -> QuantizedTensorList:
        """A new list of the selected entries, sharing their storage.

        Raises:
            InvalidStateError (a ``RuntimeError`` and ``AssertionError``): the list is
                dequantized (the cache would be lost).
            InvalidArgumentError (a ``ValueError`` and ``AssertionError``): ``selector`` has
                another length than the list.
        """
        if self.is_dequantized_stored():
            raise InvalidStateError("QuantizedTensorList.compress: quantize_() before compressing")
        return QuantizedTensorList(
            list(
                zip(
                    compress_list(self.quantized_values, selector),
                    compress_list(self.min_values, selector),
                    compress_list(self.max_values, selector),
                    strict=True,
                )
            ),
            self.quantized_dtype,
            self.computation_dtype,
        )

    def __repr__(self) -> str:
        return (
            f"QuantizedTensorList(len={len(self)}, quantized_dtype={self.quantized_dtype}, "
            f"computation_dtype={self.computation_dtype}, "
            f"dequantized={self.is_dequantized_stored()})"
        )


def _validated_items(
    quantized_data: Sequence[QuantizedItem] | Sequence[QuantizedTensor],
    quantized_dtype: torch.dtype,
) -> list[QuantizedItem]:
    """The input as ``(tensor, min, max)`` tuples, checked (see :class:`QuantizedTensorList`)."""
    items = list(quantized_data)
    kinds = {isinstance(item, QuantizedTensor) for item in items}
    if len(kinds) > 1:
        raise InvalidArgumentError(
            "QuantizedTensorList.quantized_data must be all (tensor, min, max) tuples or all "
            "QuantizedTensor, got a mix"
        )
    if kinds != {True}:
        for index, item in enumerate(items):
            if not (isinstance(item, tuple) and len(item) == 3):
                # The reference's sentence (its type hint, then the container's type), then
                # which item is wrong.
                hint = typing.get_type_hints(QuantizedTensorList.__init__)["quantized_data"]
                raise TypeError(
                    f"quantized_data must be {hint} but get {type(quantized_data)}: item {index} "
                    f"is a {type(item).__name__}, not a (tensor, min, max) tuple"
                )
    if kinds == {True}:
        items = [(q.quantized_values, q.min_value, q.max_value) for q in items]
        stored_dtypes = {t.dtype for t, _, _ in items}
        if stored_dtypes != {quantized_dtype}:
            raise InvalidArgumentError(
                f"QuantizedTensorList.quantized_data: every QuantizedTensor must be stored in "
                f"{quantized_dtype}, got {sorted(map(str, stored_dtypes))}"
            )
    has_range = {item[1] is not None for item in items} | {item[2] is not None for item in items}
    if len(has_range) > 1:
        raise InvalidArgumentError(
            "QuantizedTensorList.quantized_data: min/max must be all None or all set, got a mix"
        )
    for tensor, _, _ in items:
        if tensor.dtype != quantized_dtype and not {tensor.dtype, quantized_dtype} <= set(
            FLOAT_DTYPES
        ):
            raise InvalidArgumentError(
                f"QuantizedTensorList.quantized_data: a {tensor.dtype} tensor cannot be stored as "
                f"{quantized_dtype} (only the float formats {list(FLOAT_DTYPES)} convert)"
            )
    return items


class DequantizeQuantizedTensorListContext(ParameterizeEnterExitContext[QuantizedTensorList]):
    """``with`` block in which a :class:`QuantizedTensorList` is dequantized.

    Calls ``dequantize_()`` on enter and ``quantize_()`` on exit (also when the body raises).

    Example:
        >>> qlist = QuantizedTensorList([(torch.ones(2), None, None)], torch.float16)
        >>> with DequantizeQuantizedTensorListContext(qlist):
        ...     qlist.dequantized_value[0].add_(1.0)
        tensor([2., 2.])
        >>> qlist.quantized_value[0]
        tensor([2., 2.], dtype=torch.float16)
    """

    def __init__(self, quantized_tensor_list: QuantizedTensorList) -> None:
        super().__init__(
            quantized_tensor_list,
            QuantizedTensorList.dequantize_,
            QuantizedTensorList.quantize_,
        )
