import io
import logging

import pytest
import torch

from nanoshampoo.optim.shampoo.utils.commons import (
    InvalidArgumentError,
)
from nanoshampoo.optim.shampoo.utils.shampoo_block_info import BlockInfo
from nanoshampoo.optim.shampoo.utils.shampoo_quantization import (
    DequantizeQuantizedTensorListContext,
    QuantizedTensor,
    QuantizedTensorList,
)

# Unit roundoff of each storage format for values in its normal range (round to nearest).
_REL_ERROR_BOUND = {
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.float32: 0.0,
    torch.float64: 0.0,
}


def _info(shape: tuple[int, ...] = (3,)) -> BlockInfo:
    return BlockInfo(param=torch.zeros(shape), composable_block_ids=(0, "block_0"))


def _normal_values(n: int = 4096, seed: int = 0) -> torch.Tensor:
    """fp32 values whose magnitudes stay in the normal range of fp16 and bf16."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = torch.exp(
        torch.empty(n).uniform_(-9.0, 10.0, generator=generator)
    )  # 1.2e-4 .. 2.2e4
    signs = torch.randint(0, 2, (n,), generator=generator) * 2 - 1
    return magnitudes * signs


@pytest.mark.parametrize("dtype", list(_REL_ERROR_BOUND))
def test_quantized_tensor_round_trip_error_bound(dtype: torch.dtype) -> None:
    values = _normal_values()
    quantized = QuantizedTensor.init_from_dequantized_tensor(values, dtype, _info(values.shape))
    assert quantized.quantized_values.dtype == dtype
    restored = quantized.dequantize(dequantized_dtype=torch.float32)
    relative_error = ((restored - values).abs() / values.abs()).max().item()
    assert relative_error <= _REL_ERROR_BOUND[dtype]
    if dtype in (torch.float16, torch.bfloat16):
        assert relative_error > 0  # the bound is not vacuous: rounding really happened


def test_quantized_tensor_dequantize_copies_unless_formats_match() -> None:
    quantized = QuantizedTensor.init_from_dequantized_tensor(torch.ones(3), torch.bfloat16, _info())
    copy = quantized.dequantize(torch.float32)
    copy.add_(1.0)
    assert torch.equal(quantized.quantized_values, torch.ones(3, dtype=torch.bfloat16))
    # In the storage format it is the storage itself (the reference library's behaviour).
    assert quantized.dequantize(torch.bfloat16) is quantized.quantized_values


def test_quantized_tensor_quantize_rounds_in_place() -> None:
    quantized = QuantizedTensor.init_from_dequantized_tensor(torch.ones(3), torch.bfloat16, _info())
    storage = quantized.quantized_values
    update = torch.tensor([1.0 + 2.0**-10, 2.0, 3.0], dtype=torch.float64)
    quantized.quantize(dequantized_tensor=update)
    assert quantized.quantized_values is storage
    assert storage.tolist() == [1.0, 2.0, 3.0]  # 1 + 2^-10 rounds to 1 in bf16


def test_quantized_tensor_uses_block_info_allocation() -> None:
    allocations: list[tuple] = []

    def allocate(size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        allocations.append((size, dtype))
        return torch.zeros(size, dtype=dtype, device=device)

    info = BlockInfo(
        param=torch.zeros(2, 2), composable_block_ids=(1, "block_0"), allocate_zeros_tensor=allocate
    )
    QuantizedTensor.init_from_dequantized_tensor(torch.ones(2, 2), torch.float16, info)
    assert allocations == [((2, 2), torch.float16)]


@pytest.mark.parametrize("values", [torch.tensor(1.5), torch.zeros(0, 3)], ids=["0d", "empty"])
def test_quantized_tensor_edge_shapes(values: torch.Tensor) -> None:
    quantized = QuantizedTensor.init_from_dequantized_tensor(
        values, torch.bfloat16, _info(values.shape)
    )
    assert torch.equal(quantized.dequantize(torch.float32), values)


def test_quantized_tensor_state_dict_excludes_block_info() -> None:
    quantized = QuantizedTensor.init_from_dequantized_tensor(torch.ones(3), torch.float16, _info())
    assert set(quantized.state_dict(store_non_tensors=True)) == {
        "quantized_values",
        "min_value",
        "max_value",
    }
    assert set(quantized.state_dict()) == {"quantized_values"}


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int8, torch.uint8, torch.float8_e4m3fn, torch.complex64]
)
def test_unsupported_storage_builds_and_raises_not_implemented_at_conversion(
    dtype: torch.dtype,
) -> None:
    """As in the reference library: storage in another format is built, and the first
    quantize or dequantize raises (the message holds the reference's "Quantization for ... !")."""
    unsupported = rf"Quantization for {dtype} is not yet supported! Supported formats"
    with pytest.raises(NotImplementedError, match=rf"QuantizedTensor storage dtype: {unsupported}"):
        QuantizedTensor.init_from_dequantized_tensor(torch.ones(3), dtype, _info())
    quantized = QuantizedTensor(torch.zeros(3, dtype=dtype), _info())
    assert quantized.quantized_values.dtype == dtype
    with pytest.raises(NotImplementedError, match=rf"QuantizedTensor storage dtype: {unsupported}"):
        quantized.dequantize(torch.float16)
    with pytest.raises(NotImplementedError, match=rf"QuantizedTensor storage dtype: {unsupported}"):
        quantized.quantize(torch.ones(3))
    qlist = QuantizedTensorList(
        [(torch.zeros(3, dtype=dtype), None, None)] * 2, dtype, torch.float64
    )
    assert len(qlist) == 2
    storage = rf"QuantizedTensorList storage dtype: {unsupported}"
    with pytest.raises(NotImplementedError, match=storage):
        qlist.dequantize()
    with pytest.raises(NotImplementedError, match=storage):
        qlist.quantize((torch.ones(3), torch.ones(3)))
    with pytest.raises(NotImplementedError, match=storage):
        qlist.dequantize_()
    assert not qlist.is_dequantized_stored()


def test_unsupported_dequantize_dtype_raises_not_implemented() -> None:
    quantized = QuantizedTensor.init_from_dequantized_tensor(torch.ones(3), torch.float16, _info())
    with pytest.raises(
        NotImplementedError, match=r"dequantize dtype: Quantization for torch.int8 is not yet"
    ):
        quantized.dequantize(torch.int8)


def test_non_float_inputs_are_refused() -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"a torch.int64 tensor cannot be stored as torch.bfloat16"
    ):
        QuantizedTensorList([(torch.ones(3, dtype=torch.int64), None, None)], torch.bfloat16)
    quantized = QuantizedTensor.init_from_dequantized_tensor(torch.ones(3), torch.float16, _info())
    with pytest.raises(
        NotImplementedError, match="quantize input dtype: Quantization for torch.int32"
    ):
        quantized.quantize(torch.ones(3, dtype=torch.int32))
    with pytest.raises(InvalidArgumentError, match=r"expected shape \(3,\), got \(1,\)"):
        quantized.quantize(torch.ones(1))


# ----------------------------------------------------------------------------- QuantizedTensorList
def _fp32_list(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in [(40, 40), (7,), (3, 5)]]


def test_bf16_storage_halves_the_bytes_of_fp32() -> None:
    tensors = _fp32_list()
    fp32 = QuantizedTensorList([(t, None, None) for t in tensors], torch.float32)
    bf16 = QuantizedTensorList([(t, None, None) for t in tensors], torch.bfloat16)
    expected_fp32 = sum(t.numel() * 4 for t in tensors)
    assert fp32.storage_bytes == expected_fp32
    assert bf16.storage_bytes * 2 == expected_fp32
    assert all(q.dtype == torch.bfloat16 for q in bf16.quantized_value)
    assert fp32.quantized_value[0] is tensors[0]  # already in storage format: no copy


@pytest.mark.parametrize("quantized_dtype", list(_REL_ERROR_BOUND))
@pytest.mark.parametrize("computation_dtype", [torch.float32, torch.float64])
def test_list_dequantize_update_quantize_cycle(
    quantized_dtype: torch.dtype, computation_dtype: torch.dtype
) -> None:
    tensors = [_normal_values(1000, seed=s) for s in range(3)]
    # fp32 storage aliases its inputs, so give it copies and keep the originals for reference.
    qlist = QuantizedTensorList(
        [(t.clone(), None, None) for t in tensors], quantized_dtype, computation_dtype
    )
    with DequantizeQuantizedTensorListContext(qlist):
        assert qlist.is_dequantized_stored()
        assert all(t.dtype == computation_dtype for t in qlist.dequantized_value)
        for t in qlist.dequantized_value:
            t.mul_(1.5)
    assert not qlist.is_dequantized_stored()
    for stored, original in zip(qlist.quantized_value, tensors, strict=True):
        assert stored.dtype == quantized_dtype
        expected = original.double() * 1.5
        relative_error = ((stored.double() - expected).abs() / expected.abs()).max().item()
        # Two roundings (initial storage, write-back); 1.5x stays inside the fp16 range.
        assert relative_error <= 2 * _REL_ERROR_BOUND[quantized_dtype] + 2.0**-23


def test_list_cache_aliases_storage_when_formats_match() -> None:
    qlist = QuantizedTensorList([(torch.ones(2), None, None)], torch.float32, torch.float32)
    qlist.dequantize_()
    assert qlist.dequantized_value[0] is qlist.quantized_value[0]
    qlist.quantize_()


@pytest.mark.parametrize("caught", [RuntimeError, AssertionError])
def test_list_lifecycle_errors(caught: type[Exception]) -> None:
    qlist = QuantizedTensorList([(torch.ones(2), None, None)], torch.bfloat16)
    with pytest.raises(caught, match="no dequantized cache"):
        _ = qlist.dequantized_value
    qlist.dequantize_()
    with pytest.raises(caught, match="quantize_\\(\\) before compressing"):
        qlist.compress([True])
    qlist.quantize_()


def test_list_lifecycle_misuse_warns_like_the_reference(caplog: pytest.LogCaptureFixture) -> None:
    qlist = QuantizedTensorList([(torch.ones(2), None, None)], torch.bfloat16, torch.float64)
    with caplog.at_level(logging.WARNING):
        qlist.quantize_()  # nothing cached: a warning, nothing written
    assert caplog.messages == [
        "No stored dequantized values self.dequantized_value_list=None. "
        "Must first call dequantize_()."
    ]
    assert qlist.quantized_value[0].tolist() == [1.0, 1.0]
    qlist.dequantize_()
    qlist.dequantized_value[0].fill_(3.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        qlist.dequantize_()  # replaces the cache: the 3.0 written to it is dropped
    assert caplog.messages == ["Dequantized values are already stored; overwriting these values..."]
    assert qlist.dequantized_value[0].tolist() == [1.0, 1.0]
    qlist.quantize_()
    assert not qlist.is_dequantized_stored() and qlist.quantized_value[0].tolist() == [1.0, 1.0]


def test_context_quantizes_back_when_body_raises() -> None:
    qlist = QuantizedTensorList([(torch.ones(2), None, None)], torch.float16)
    with pytest.raises(ZeroDivisionError):
        with DequantizeQuantizedTensorListContext(qlist):
            qlist.dequantized_value[0].fill_(5.0)
            raise ZeroDivisionError
    assert not qlist.is_dequantized_stored()
    assert qlist.quantized_value[0].tolist() == [5.0, 5.0]


def test_compress_selects_and_shares_storage() -> None:
    tensors = [torch.full((2,), float(i)) for i in range(4)]
    mins = [torch.tensor(float(i)) for i in range(4)]
    qlist = QuantizedTensorList(
        [(t, m, m + 1) for t, m in zip(tensors, mins, strict=True)], torch.float32, torch.float64
    )
    selected = qlist.compress([True, False, False, True])
    assert len(selected) == 2
    assert selected.quantized_value[1] is tensors[3]
    assert [m.item() for m in selected.min_values] == [0.0, 3.0]
    assert [m.item() for m in selected.max_values] == [1.0, 4.0]
    assert selected.computation_dtype == torch.float64
    with pytest.raises(InvalidArgumentError, match=r"len\(complete_list\)=4 and len\(selector\)=3"):
        qlist.compress([True, False, True])


def test_list_from_quantized_tensors_and_empty_list() -> None:
    quantized = [
        QuantizedTensor.init_from_dequantized_tensor(torch.ones(3), torch.float16, _info())
        for _ in range(2)
    ]
    qlist = QuantizedTensorList(quantized, torch.float16)
    assert qlist.quantized_value[1] is quantized[1].quantized_values
    empty = QuantizedTensorList([], torch.bfloat16)
    with DequantizeQuantizedTensorListContext(empty):
        assert empty.dequantized_value == ()
    assert len(empty) == 0 and empty.storage_bytes == 0


def _quantized(dtype: torch.dtype) -> QuantizedTensor:
    return QuantizedTensor.init_from_dequantized_tensor(torch.ones(3), dtype, _info())


_ONE = (torch.ones(1), None, None)
_RANGED = (torch.ones(1), torch.zeros(()), torch.ones(()))


@pytest.mark.parametrize(
    ("items", "computation_dtype", "message"),
    [
        (
            [_ONE],
            torch.int32,
            r"computation_dtype=torch.int32 is not supported! It must be one of \(torch.float16, "
            r"torch.bfloat16, torch.float32, torch.float64\)!",
        ),
        ([_ONE], torch.float8_e4m3fn, r"computation_dtype=torch.float8_e4m3fn is not supported"),
        ([(torch.ones(1), torch.zeros(()), None)], torch.float32, r"min/max must be all None or"),
        ([_ONE, _RANGED], torch.float32, r"min/max must be all None or all set"),
        (
            [_ONE, _quantized(torch.bfloat16)],
            torch.float32,
            r"all \(tensor, min, max\) tuples or all",
        ),
        (
            [_quantized(torch.float16)],
            torch.float32,
            r"every QuantizedTensor must be stored in torch.bfloat16, got \['torch.float16'\]",
        ),
    ],
)
def test_list_rejects_bad_construction(
    items: list, computation_dtype: torch.dtype, message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        QuantizedTensorList(items, torch.bfloat16, computation_dtype)


@pytest.mark.parametrize("bad", [torch.ones(1), (torch.ones(1), None), [torch.ones(1), None, None]])
def test_list_refuses_an_item_that_is_no_triple_with_the_reference_sentence(bad: object) -> None:
    """A bare tensor, a pair or a list where a ``(tensor, min, max)`` tuple belongs: the
    reference's ``TypeError`` sentence, then which item is wrong (not an IndexError later)."""
    with pytest.raises(TypeError) as info:
        QuantizedTensorList([_ONE, bad], torch.float32, torch.float32)
    assert str(info.value).startswith(
        "quantized_data must be collections.abc.Sequence[tuple[torch.Tensor, torch.Tensor | None, "
        "torch.Tensor | None]] | collections.abc.Sequence["
        "nanoshampoo.optim.shampoo.utils.shampoo_quantization.QuantizedTensor] but get "
        "<class 'list'>: item 1 is a "
    )


def test_list_state_dict_round_trip_excludes_cache() -> None:
    source = QuantizedTensorList([(t, None, None) for t in _fp32_list(1)], torch.bfloat16)
    target = QuantizedTensorList(
        [(torch.zeros_like(t), None, None) for t in _fp32_list(1)], torch.bfloat16
    )
    source.dequantize_()
    state = source.state_dict()
    assert set(state) == {"quantized_values"}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    target.load_state_dict(torch.load(buffer, weights_only=True))
    for mine, theirs in zip(target.quantized_value, source.quantized_value, strict=True):
        assert torch.equal(mine, theirs)
    source.quantize_()


@pytest.mark.parametrize("quantized_dtype", list(_REL_ERROR_BOUND))
def test_list_dequantize_and_quantize_by_hand(quantized_dtype: torch.dtype) -> None:
    tensors = [_normal_values(500, seed=s).reshape(20, 25) for s in range(2)]
    qlist = QuantizedTensorList(
        [(t.clone(), None, None) for t in tensors], quantized_dtype, torch.float64
    )
    values = qlist.dequantize()
    assert not qlist.is_dequantized_stored()  # by hand: no cache
    for value, stored in zip(values, qlist.quantized_value, strict=True):
        assert value.dtype == torch.float64
        assert torch.equal(value, stored.double())  # widening is exact
    before = [stored.to(torch.float64, copy=True) for stored in qlist.quantized_value]
    qlist.quantize(tuple(v * 0.75 + 1.0 for v in values))
    for stored, old in zip(qlist.quantized_value, before, strict=True):
        # The float64 update rounded once, to nearest, into the storage format.
        assert stored.dtype == quantized_dtype
        assert torch.equal(stored, (old * 0.75 + 1.0).to(quantized_dtype))


def test_list_dequantize_is_the_storage_when_formats_match() -> None:
    tensors = [torch.ones(2, dtype=torch.float16), torch.zeros(3, dtype=torch.float16)]
    qlist = QuantizedTensorList([(t, None, None) for t in tensors], torch.float16, torch.float16)
    values = qlist.dequantize()
    assert values[0] is tensors[0] and values[1] is tensors[1]
    qlist.quantize(values)  # writing the storage onto itself is a no-op
    assert tensors[0].tolist() == [1.0, 1.0]


def test_list_quantize_warns_when_a_cache_exists(caplog: pytest.LogCaptureFixture) -> None:
    qlist = QuantizedTensorList([(torch.ones(2), None, None)], torch.bfloat16)
    qlist.dequantize_()
    with caplog.at_level(logging.WARNING):
        qlist.quantize((torch.full((2,), 4.0),))
    assert caplog.messages == [
        "Existing stored dequantized values.\nWriting quantized values with input tensor_list "
        "without using these stored dequantized values..."
    ]
    assert qlist.quantized_value[0].tolist() == [4.0, 4.0]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        qlist.quantize(qlist.dequantized_value)  # the cache itself: no warning
    assert caplog.messages == [] and qlist.quantized_value[0].tolist() == [1.0, 1.0]
    qlist.quantize_()


@pytest.mark.parametrize(
    ("tensor_list", "message"),
    [
        ((torch.ones(2),), r"expected 2 tensors, got 1"),
        ((torch.ones(2), torch.ones(4)), r"tensor 1 has shape \(4,\), its entry \(3,\)"),
    ],
)
def test_list_quantize_rejects_mismatched_tensors_before_writing(
    tensor_list: tuple[torch.Tensor, ...], message: str
) -> None:
    qlist = QuantizedTensorList(
        [(torch.zeros(2), None, None), (torch.zeros(3), None, None)], torch.bfloat16
    )
    with pytest.raises(InvalidArgumentError, match=message):
        qlist.quantize(tensor_list)
    assert qlist.quantized_value[0].tolist() == [0.0, 0.0]
