"""Model FLOPs utilisation (MFU): the model's matmul FLOPs per step / step time / matmul peak.

FLOPs (:func:`gpt_matmul_flops_per_token`): per token, forward and backward of every matmul
of the GPT, counted from its shapes (C = ``model_dim``, L layers, T = ``seq_len``, V vocab):

- linear layers, per layer ``2 (3C^2 + C^2 + 4C^2 + 4C^2) = 24 C^2`` (qkv, attention output,
  MLP in and out); the head ``2 C V``;
- attention, per layer ``4 T C`` (``Q K^T`` and ``P V`` over all T keys: the PaLM convention;
  a causal kernel may skip half);
- backward is twice forward (the gradients of both matmul inputs): ``3x`` in all.

Embedding lookups, norms, softmax, rotary and the optimizer are not matmuls of the model and
count nothing. The count equals ``torch.utils.flop_counter.FlopCounterMode`` on the model
(``nanoshampoo/train/tests/throughput_test.py``).

Peak: ``nanoshampoo.matmul_speed.matmul_flops_per_second`` in the dtype the matmuls run in
(bf16 under autocast, else float32; on CUDA float32 includes TF32 when torch allows it),
with the run's thread count, times the number of devices.

Example:
    >>> from nanoshampoo.model.gpt import gpt_preset
    >>> gpt_matmul_flops_per_token(gpt_preset("tiny", vocab_size=4096), seq_len=256)
    9437184
    >>> meter = MfuMeter(flops_per_step=10**9, peak_flops_per_second=1e11, dtype_name="float32")
    >>> meter.of_step(0.05)
    0.2
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nanoshampoo.matmul_speed import PEAK_REPEATS, PEAK_SHAPE, matmul_flops_per_second
from nanoshampoo.model.gpt import GPTConfig
from nanoshampoo.train.probe_cache import ProbeCache


def gpt_matmul_flops_per_token(config: GPTConfig, seq_len: int) -> int:
    """Forward + backward matmul FLOPs per token of a GPT of ``config`` at ``seq_len``."""
    width = config.model_dim
    inner = config.num_heads * config.head_dim
    linear = 2 * (width * 3 * inner + inner * width + width * 4 * width + 4 * width * width)
    attention = 2 * 2 * seq_len * inner
    head = 2 * width * config.vocab_size
    return 3 * (config.num_layers * (linear + attention) + head)


@dataclass(frozen=True)
class MfuMeter:
    """A run's FLOPs per optimizer step and the peak it is a fraction of.

    Fields:
        flops_per_step: matmul FLOPs of one optimizer step (every token of the global batch).
        peak_flops_per_second: the probed matmul rate of one device times the device count.
        dtype_name: the matmul dtype the peak was probed in.
    """

    flops_per_step: int
    peak_flops_per_second: float
    dtype_name: str

    def of_step(self, seconds: float) -> float:
        """MFU of a step that took ``seconds`` (a fraction, not a percentage); NaN for a time
        that is not positive (a resumed run with no step left, or a checkpoint's recorded
        training time of 0), where there is no rate to report."""
        if not seconds > 0:
            return math.nan
        return self.flops_per_step / seconds / self.peak_flops_per_second

    @property
    def header(self) -> str:
        """One line for the run header: what the MFU figures are relative to."""
        return (
            f"MFU of {self.flops_per_step / 1e9:.3g} GFLOP/step (model matmuls, fwd+bwd) "
            f"against a {self.dtype_name} matmul peak of "
            f"{self.peak_flops_per_second / 1e9:.4g} GFLOP/s (probed)"
        )


def mfu_meter(
    config: GPTConfig,
    seq_len: int,
    tokens_per_step: int,
    device: torch.device,
    bf16: bool,
    num_devices: int = 1,
    cache: ProbeCache | None = None,
) -> MfuMeter:
    """Count the FLOPs of a step and probe the peak (~50 ms) of ``device`` in the run's dtype.

    ``bf16``: the matmuls run under bf16 autocast; ``tokens_per_step``: the global batch's
    tokens; ``num_devices``: the ranks sharing the step (the peak is per device); ``cache``:
    where the peak may come from and goes (``probe_cache``; on CPU only, keyed by dtype and
    threads: a GPU's peak depends on which GPU, which the machine key does not name).
    """
    dtype = torch.bfloat16 if bf16 else torch.float32
    settings = {
        "dtype": str(dtype),
        "threads": torch.get_num_threads(),
        "shape": list(PEAK_SHAPE),
        "repeats": PEAK_REPEATS,
    }
    cached = cache if device.type == "cpu" else None
    rate, _ = (cached or ProbeCache(None)).answer(
        "matmul_peak", settings, lambda: matmul_flops_per_second(dtype, device)
    )
    peak = rate * num_devices
    flops = gpt_matmul_flops_per_token(config, seq_len) * tokens_per_step
    return MfuMeter(flops, peak, str(dtype).removeprefix("torch."))
