"""Fixtures shared by the trainer's tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from nanoshampoo.model.gpt import GPT, GPTConfig

# The model the setup tests cut into optimizer groups: 2 blocks of width 32 (two heads of 16),
# so every role (embedding, head, matrices, 1-D parameters) is present and small.
TINY_GPT = dict(vocab_size=64, num_layers=2, model_dim=32, head_dim=16, max_seq_len=16)


@pytest.fixture
def tiny_gpt() -> Callable[..., GPT]:
    """A factory of the tiny GPT; keyword arguments override ``GPTConfig`` fields of ``TINY_GPT``
    (e.g. ``tiny_gpt(combined_linear=True)``)."""

    def build(**overrides: Any) -> GPT:
        return GPT(GPTConfig(**{**TINY_GPT, **overrides}))

    return build
