"""Fixtures shared by the trainer's tests: token shards to train on and a tiny GPT.

The vocabulary is 64, the ``VOCAB`` of ``trainer_test.py`` whose ``tiny_config`` trains on
``shards``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nanoshampoo.data.shards import write_shard
from nanoshampoo.model.gpt import GPT, GPTConfig

VOCAB = 64
# The model the setup tests cut into optimizer groups: 2 blocks of width 32 (two heads of 16),
# so every role (embedding, head, matrices, 1-D parameters) is present and small.
TINY_GPT = dict(vocab_size=VOCAB, num_layers=2, model_dim=32, head_dim=16, max_seq_len=16)


def learnable_tokens(n: int, seed: int) -> np.ndarray:
    """A stream where each token mostly determines the next: t' = 5 t + 3 mod V, 10% noise."""
    rng = np.random.default_rng(seed)
    out = np.empty(n, dtype=np.int64)
    out[0] = 0
    for i in range(1, n):
        out[i] = rng.integers(VOCAB) if rng.random() < 0.1 else (5 * out[i - 1] + 3) % VOCAB
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A train shard (40,000 tokens) and a val shard (4,000) of ``learnable_tokens``, written
    once per test module; the ``TrainConfig`` fields that name them."""
    root: Path = tmp_path_factory.mktemp("shards")
    write_shard(root / "syn_train_000001.bin", learnable_tokens(40_000, seed=0))
    write_shard(root / "syn_val_000000.bin", learnable_tokens(4_000, seed=1))
    return {"train_files": str(root / "syn_train_*.bin"), "val_files": str(root / "syn_val_*.bin")}


@pytest.fixture
def tiny_gpt() -> Callable[..., GPT]:
    """A factory of the tiny GPT; keyword arguments override ``GPTConfig`` fields of ``TINY_GPT``
    (e.g. ``tiny_gpt(combined_linear=True)``)."""

    def build(**overrides: Any) -> GPT:
        return GPT(GPTConfig(**{**TINY_GPT, **overrides}))

    return build
