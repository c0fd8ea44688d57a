"""MFU: the FLOP count against torch's FlopCounterMode, and the meter's arithmetic."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from nanoshampoo.model.gpt import GPT, GPTConfig
from nanoshampoo.train.throughput import MfuMeter, gpt_matmul_flops_per_token, mfu_meter

CONFIGS = [
    GPTConfig(vocab_size=64, num_layers=2, model_dim=32, head_dim=16, max_seq_len=16),
    GPTConfig(vocab_size=100, num_layers=3, model_dim=48, head_dim=8, max_seq_len=24),
]


def counted_flops(config: GPTConfig, batch: int, seq_len: int, math_attention: bool) -> int:
    """FlopCounterMode's total over one forward and backward of the loss."""
    torch.manual_seed(0)
    model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (batch, seq_len))
    # The math backend runs attention as matmuls, which the counter sees; the CPU flash kernel
    # has no counter formula, so without it only the linear layers are counted.
    backend = SDPBackend.MATH if math_attention else SDPBackend.FLASH_ATTENTION
    with sdpa_kernel(backend), FlopCounterMode(display=False) as counter:
        model(idx, targets=idx).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("config", CONFIGS, ids=["2x32", "3x48"])
def test_flops_per_token_match_the_flop_counter(config: GPTConfig) -> None:
    batch, seq_len = 2, config.max_seq_len
    expected = gpt_matmul_flops_per_token(config, seq_len) * batch * seq_len
    assert counted_flops(config, batch, seq_len, math_attention=True) == expected


@pytest.mark.parametrize("config", CONFIGS, ids=["2x32", "3x48"])
def test_attention_is_four_t_c_per_layer_and_token_forward(config: GPTConfig) -> None:
    batch, seq_len = 2, config.max_seq_len
    linear_only = counted_flops(config, batch, seq_len, math_attention=False)
    attention = 3 * config.num_layers * 4 * seq_len * config.model_dim * batch * seq_len
    assert linear_only == gpt_matmul_flops_per_token(config, seq_len) * batch * seq_len - attention


def test_the_meter_divides_flops_by_time_and_peak() -> None:
    meter = MfuMeter(flops_per_step=3 * 10**9, peak_flops_per_second=2e11, dtype_name="bfloat16")
    assert math.isclose(meter.of_step(0.1), 3e9 / 0.1 / 2e11)
    assert math.isnan(meter.of_step(0.0)) and math.isnan(meter.of_step(-1.0))
    assert "3 GFLOP/step" in meter.header and "bfloat16 matmul peak of 200 GFLOP/s" in meter.header


# bf16: a matmul probe that takes seconds on a CPU without bf16 kernels.
@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_meter_probes_the_run_dtype_per_device(bf16: bool) -> None:
    config = CONFIGS[0]
    meter = mfu_meter(
        config, seq_len=16, tokens_per_step=64, device=torch.device("cpu"), bf16=bf16, num_devices=2
    )
    assert meter.dtype_name == ("bfloat16" if bf16 else "float32")
    assert meter.flops_per_step == gpt_matmul_flops_per_token(config, 16) * 64
    assert math.isfinite(meter.peak_flops_per_second) and meter.peak_flops_per_second > 0
