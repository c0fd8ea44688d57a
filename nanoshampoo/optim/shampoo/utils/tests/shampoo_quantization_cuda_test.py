"""Quantization on CUDA: round trips, and ``quantize_`` gives freed memory back to the device."""

import pytest
import torch

from nanoshampoo.optim.shampoo.utils.shampoo_quantization import (
    DequantizeQuantizedTensorListContext,
    QuantizedTensorList,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_quantize_empties_the_cuda_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[None] = []
    real_empty_cache = torch.cuda.empty_cache
    monkeypatch.setattr(
        torch.cuda, "empty_cache", lambda: (calls.append(None), real_empty_cache())[1]
    )
    tensors = [torch.randn(256, 256, device="cuda") for _ in range(3)]
    qlist = QuantizedTensorList([(t, None, None) for t in tensors], torch.bfloat16)
    with DequantizeQuantizedTensorListContext(qlist):
        for t in qlist.dequantized_value:
            t.mul_(2.0)
    assert len(calls) == 1
    for stored, original in zip(qlist.quantized_value, tensors, strict=True):
        assert stored.is_cuda and stored.dtype == torch.bfloat16
        torch.testing.assert_close(
            stored.float(), (original * 2).bfloat16().float(), rtol=0, atol=0
        )


def test_dequantized_copies_are_released_after_quantize() -> None:
    tensors = [torch.randn(1024, 1024, device="cuda") for _ in range(2)]
    qlist = QuantizedTensorList([(t, None, None) for t in tensors], torch.bfloat16, torch.float32)
    del tensors
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    qlist.dequantize_()
    during = torch.cuda.memory_allocated()
    qlist.quantize_()
    after = torch.cuda.memory_allocated()
    assert during - before >= 2 * 1024 * 1024 * 4  # two fp32 copies existed
    assert after == before
