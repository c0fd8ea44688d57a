"""Speedrun-style distributed token loader over FineWeb-format shards.

Layout of one step (the NanoGPT speedrun layout):

    B = global_batch_size // world_size                 # rows per rank
    window = shard[position : position + global_batch_size * seq_len + 1]  # contiguous
    rank r reads  window[r * B * seq_len : (r + 1) * B * seq_len + 1]
    inputs  = that slice[:-1].view(B, seq_len)          # int64
    targets = that slice[1:].view(B, seq_len)           # inputs shifted by one
    position += global_batch_size * seq_len

So the ranks' slices are disjoint, and stacking every rank's rows in rank order gives exactly
the batch a single process (``world_size=1``) reads. Only the one token shared by neighbouring
windows (the last target of a step is the first input of the next) is read twice.

Exhaustion: when the current shard has fewer than ``global_batch_size * seq_len + 1`` tokens
left, the loader moves to the start of the next shard (the unread tail is skipped, as in the
speedrun); after the last shard it wraps back to the first and ``passes`` counts completed
passes. Every shard must hold at least one full step of tokens.

The position is global (it does not depend on rank or world size), so ``state_dict()`` saved
by any rank resumes exactly, even on a different world size with the same global batch.

Example:
    >>> loader = DistributedTokenLoader("data/embedded/fineweb_train_*.bin",
    ...                                 global_batch_size=8, seq_len=256, rank=0, world_size=2)
    ...                                 # doctest: +SKIP
    >>> inputs, targets = loader.next_batch()  # two (4, 256) int64 tensors  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nanoshampoo.data.shards import list_shards, read_shard, read_shard_token_count
from nanoshampoo.validation import check_int

Batch = tuple[torch.Tensor, torch.Tensor]


def _check_layout(global_batch_size: int, seq_len: int, rank: int, world_size: int) -> None:
    for name, value in (
        ("global_batch_size", global_batch_size),
        ("seq_len", seq_len),
        ("world_size", world_size),
    ):
        check_int(name, value, at_least=1)
    check_int(f"rank (world_size={world_size})", rank, at_least=0, less_than=world_size)
    if global_batch_size % world_size:
        raise ValueError(
            f"global_batch_size={global_batch_size} must be divisible by world_size={world_size}"
        )


class DistributedTokenLoader:
    """Yield ``(inputs, targets)`` int64 batches of shape ``(global_batch_size // world_size,
    seq_len)`` for one rank, walking the shards matched by ``filename_pattern`` in sorted order.

    See the module docstring for the exact layout, the wrap-around rule and resume semantics.
    Shard headers are validated at construction; a shard with fewer than
    ``global_batch_size * seq_len + 1`` tokens raises ``ValueError`` naming it.
    """

    def __init__(
        self,
        filename_pattern: str | os.PathLike[str],
        global_batch_size: int,
        seq_len: int,
        rank: int,
        world_size: int,
    ) -> None:
        _check_layout(global_batch_size, seq_len, rank, world_size)
        self.global_batch_size = global_batch_size
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self.local_batch_size = global_batch_size // world_size
        self.tokens_per_step = global_batch_size * seq_len
        self.files: list[Path] = list_shards(filename_pattern)
        self.shard_token_counts = [read_shard_token_count(f) for f in self.files]
        for path, count in zip(self.files, self.shard_token_counts):
            if count < self.tokens_per_step + 1:
                raise ValueError(
                    f"{path}: shard has {count} tokens, fewer than the "
                    f"global_batch_size * seq_len + 1 = {self.tokens_per_step + 1} one step needs"
                )
        self.shard_index = 0
        self.position = 0
        self.passes = 0
        self._tokens: np.ndarray | None = None

    def steps_in_one_pass(self) -> int:
        """Number of ``next_batch`` calls that read every shard once (tails skipped)."""
        return sum((n - 1) // self.tokens_per_step for n in self.shard_token_counts)

    def _current_tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = read_shard(self.files[self.shard_index])
        return self._tokens

    def _advance_shard(self) -> None:
        self.shard_index += 1
        if self.shard_index == len(self.files):
            self.shard_index = 0
            self.passes += 1
        self.position = 0
        self._tokens = None

    def next_batch(self) -> Batch:
        """Return this rank's ``(inputs, targets)`` for the next step and advance one step."""
        if self.position + self.tokens_per_step + 1 > self.shard_token_counts[self.shard_index]:
            self._advance_shard()
        local_tokens = self.local_batch_size * self.seq_len
        start = self.position + self.rank * local_tokens
        window = self._current_tokens()[start : start + local_tokens + 1]
        buf = torch.from_numpy(window.astype(np.int64))
        inputs = buf[:-1].view(self.local_batch_size, self.seq_len)
        targets = buf[1:].view(self.local_batch_size, self.seq_len)
        self.position += self.tokens_per_step
        return inputs, targets

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state (ints and strings, ``torch.load(weights_only=True)``-safe)."""
        return {
            "shard_index": self.shard_index,
            "position": self.position,
            "passes": self.passes,
            "tokens_per_step": self.tokens_per_step,
            "shard_names": [f.name for f in self.files],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume exactly where ``state_dict()`` was taken.

        Raises ``ValueError`` naming the field when the state was saved for other shards or a
        different ``global_batch_size * seq_len``, or holds an out-of-range position.
        """
        names = [f.name for f in self.files]
        if list(state["shard_names"]) != names:
            raise ValueError(
                f"shard_names in the state {list(state['shard_names'])} do not match the "
                f"loader's shards {names}"
            )
        if int(state["tokens_per_step"]) != self.tokens_per_step:
            raise ValueError(
                f"tokens_per_step in the state is {state['tokens_per_step']}, but this loader "
                f"takes global_batch_size * seq_len = {self.tokens_per_step} tokens per step"
            )
        shard_index = check_int(
            f"shard_index of {len(names)} shards",
            int(state["shard_index"]),
            at_least=0,
            less_than=len(self.files),
        )
        position = check_int(
            f"position in shard {names[shard_index]}",
            int(state["position"]),
            at_least=0,
            at_most=self.shard_token_counts[shard_index],
        )
        self.shard_index = shard_index
        self.position = position
        self.passes = int(state["passes"])
        self._tokens = None


def validation_token_capacity(
    filename_pattern: str | os.PathLike[str], global_batch_size: int, seq_len: int
) -> int:
    """Largest ``val_tokens`` that ``validation_batches`` accepts for this batch layout.

    A multiple of ``global_batch_size * seq_len``: one pass over the validation shards.
    """
    loader = DistributedTokenLoader(filename_pattern, global_batch_size, seq_len, 0, 1)
    return loader.steps_in_one_pass() * loader.tokens_per_step


def validation_batches(
    filename_pattern: str | os.PathLike[str],
    global_batch_size: int,
    seq_len: int,
    rank: int,
    world_size: int,
    val_tokens: int,
) -> Iterator[Batch]:
    """Return an iterator over a fixed validation budget of ``val_tokens`` tokens.

    It yields ``val_tokens // (global_batch_size * seq_len)`` batches read from the start of
    the validation shards with the same layout as ``DistributedTokenLoader``, so every call
    (and every run) sees the same tokens. Arguments are checked eagerly: ``val_tokens`` must
    be a positive multiple of ``global_batch_size * seq_len`` and fit in one pass over the
    shards (see ``validation_token_capacity``), else ``ValueError`` naming ``val_tokens``.

    Example:
        >>> for inputs, targets in validation_batches(  # doctest: +SKIP
        ...         "data/embedded/fineweb_val_*.bin", 8, 256, rank, world_size, 8 * 256 * 4):
        ...     loss += model(inputs, targets)
    """
    loader = DistributedTokenLoader(filename_pattern, global_batch_size, seq_len, rank, world_size)
    step = loader.tokens_per_step
    check_int("val_tokens", val_tokens, at_least=1)
    if val_tokens % step:
        raise ValueError(
            f"val_tokens={val_tokens} must be a multiple of global_batch_size * seq_len = {step}"
        )
    capacity = loader.steps_in_one_pass() * step
    if val_tokens > capacity:
        raise ValueError(
            f"val_tokens={val_tokens} exceeds the {capacity} tokens that the shards matching "
            f"{os.fspath(filename_pattern)!r} supply in one pass at {step} tokens per step"
        )
    return (loader.next_batch() for _ in range(val_tokens // step))
