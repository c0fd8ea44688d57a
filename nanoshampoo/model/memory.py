"""How much memory training a GPT needs, estimated before any tensor is allocated.

The parameters are counted exactly by building the model on the ``meta`` device (shapes only,
no storage). The estimate of one training process is then, in bytes::

    16 * parameters                                   weights, gradients, two Adam moments (fp32)
  + 3 * 4 * local_batch * seq_len * vocab_size        logits, their softmax and its gradient

It leaves out the block activations and the optimizers' other state, so it is a lower bound:
a run it refuses cannot fit, one it admits may still not.

Example:
    >>> from nanoshampoo.model.gpt import gpt_preset
    >>> estimate = training_memory_estimate(gpt_preset("tiny", 4096), local_batch=8, seq_len=256)
    >>> estimate.parameters, round(estimate.total_bytes / 2**20)
    (1845120, 124)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoshampoo.model.gpt import GPT, GPTConfig

# fp32 weight + gradient + Adam's two moments.
BYTES_PER_PARAMETER = 16
# fp32 logits, their softmax and the logits' gradient.
LOGIT_COPIES = 3


@dataclass(frozen=True)
class MemoryEstimate:
    """A lower bound of one training process's memory, in bytes, with its parts."""

    parameters: int
    parameter_bytes: int
    logit_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.parameter_bytes + self.logit_bytes


def parameter_count(config: GPTConfig) -> int:
    """The exact number of parameters of ``GPT(config)``, without allocating them."""
    with torch.device("meta"):
        model = GPT(config)
    return sum(p.numel() for p in model.parameters())


def training_memory_estimate(config: GPTConfig, local_batch: int, seq_len: int) -> MemoryEstimate:
    """The estimate of the module docstring for ``local_batch`` sequences of ``seq_len``."""
    parameters = parameter_count(config)
    logits = LOGIT_COPIES * 4 * local_batch * seq_len * config.vocab_size
    return MemoryEstimate(parameters, BYTES_PER_PARAMETER * parameters, logits)
