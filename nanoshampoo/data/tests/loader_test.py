"""Speedrun-style token loader: layout per rank, wrap-around, exact resume, validation budget."""

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from nanoshampoo.data.loader import (
    DistributedTokenLoader,
    validation_batches,
    validation_token_capacity,
)
from nanoshampoo.data.shards import write_shard

SHARD_LENGTHS = (53, 40, 67)


@pytest.fixture
def shard_dir(tmp_path: Path) -> Path:
    """Three training shards whose tokens are all distinct (so slices can be identified)."""
    start = 0
    for index, length in enumerate(SHARD_LENGTHS, start=1):
        write_shard(tmp_path / f"fineweb_train_{index:06d}.bin", np.arange(start, start + length))
        start += length
    write_shard(tmp_path / "fineweb_val_000000.bin", np.arange(1000, 1000 + 61))
    return tmp_path


def _shard_lists() -> list[list[int]]:
    shards, start = [], 0
    for length in SHARD_LENGTHS:
        shards.append(list(range(start, start + length)))
        start += length
    return shards


def _reference_windows(shards: list[list[int]], step_tokens: int, steps: int) -> list[list[int]]:
    """The step windows written out by hand: whole windows of step_tokens + 1 tokens from the
    start of each shard, moving to the next shard (cyclically) when one no longer fits."""
    windows: list[list[int]] = []
    shard, start = 0, 0
    while len(windows) < steps:
        if start + step_tokens + 1 > len(shards[shard]):
            shard, start = (shard + 1) % len(shards), 0
            continue
        windows.append(shards[shard][start : start + step_tokens + 1])
        start += step_tokens
    return windows


def _pattern(directory: Path) -> str:
    return str(directory / "fineweb_train_*.bin")


def test_single_rank_matches_reference_including_wrap(shard_dir: Path) -> None:
    global_batch_size, seq_len, steps = 2, 6, 12
    loader = DistributedTokenLoader(_pattern(shard_dir), global_batch_size, seq_len, 0, 1)
    windows = _reference_windows(_shard_lists(), global_batch_size * seq_len, steps)
    for window in windows:
        inputs, targets = loader.next_batch()
        assert inputs.dtype == torch.int64 and targets.dtype == torch.int64
        assert inputs.shape == targets.shape == (global_batch_size, seq_len)
        assert inputs.flatten().tolist() == window[:-1]
        assert targets.flatten().tolist() == window[1:]
    # 4 + 3 + 5 steps fit in the shards of 53, 40, 67 tokens: exactly one pass, then wrap.
    assert loader.steps_in_one_pass() == 12
    assert loader.passes == 0
    inputs, _ = loader.next_batch()
    assert loader.passes == 1 and loader.shard_index == 0
    assert inputs.flatten().tolist() == _shard_lists()[0][:12]


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_are_disjoint_and_stack_to_the_single_rank_batch(
    shard_dir: Path, world_size: int
) -> None:
    global_batch_size, seq_len = 4, 3
    single = DistributedTokenLoader(_pattern(shard_dir), global_batch_size, seq_len, 0, 1)
    ranks = [
        DistributedTokenLoader(_pattern(shard_dir), global_batch_size, seq_len, r, world_size)
        for r in range(world_size)
    ]
    for _ in range(9):  # crosses both shard boundaries
        expected_inputs, expected_targets = single.next_batch()
        batches = [loader.next_batch() for loader in ranks]
        for inputs, targets in batches:
            assert inputs.shape == (global_batch_size // world_size, seq_len)
            assert torch.equal(inputs[:, 1:], targets[:, :-1])
        seen = [set(inputs.flatten().tolist()) for inputs, _ in batches]
        for a in range(world_size):
            for b in range(a + 1, world_size):
                assert not seen[a] & seen[b]
        assert torch.equal(torch.cat([i for i, _ in batches]), expected_inputs)
        assert torch.equal(torch.cat([t for _, t in batches]), expected_targets)


def _save_load(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("resume_world_size", [1, 2])
def test_state_dict_resumes_exactly(shard_dir: Path, resume_world_size: int) -> None:
    pattern = _pattern(shard_dir)
    original = DistributedTokenLoader(pattern, 2, 5, 0, 1)
    for _ in range(7):
        original.next_batch()
    state = _save_load(original.state_dict())
    resumed = [
        DistributedTokenLoader(pattern, 2, 5, r, resume_world_size)
        for r in range(resume_world_size)
    ]
    for loader in resumed:
        loader.load_state_dict(state)
    for _ in range(15):  # past the end of the last shard and around again
        expected_inputs, expected_targets = original.next_batch()
        batches = [loader.next_batch() for loader in resumed]
        assert torch.equal(torch.cat([i for i, _ in batches]), expected_inputs)
        assert torch.equal(torch.cat([t for _, t in batches]), expected_targets)
    assert all(loader.state_dict() == original.state_dict() for loader in resumed)


def test_load_state_dict_rejects_other_layouts(shard_dir: Path) -> None:
    loader = DistributedTokenLoader(_pattern(shard_dir), 2, 5, 0, 1)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="tokens_per_step"):
        DistributedTokenLoader(_pattern(shard_dir), 2, 4, 0, 1).load_state_dict(state)
    two_shards = DistributedTokenLoader(str(shard_dir / "fineweb_train_00000[12].bin"), 2, 5, 0, 1)
    with pytest.raises(ValueError, match="shard_names"):
        two_shards.load_state_dict(state)
    with pytest.raises(ValueError, match="position"):
        loader.load_state_dict({**state, "position": 10_000})
    with pytest.raises(ValueError, match="shard_index"):
        loader.load_state_dict({**state, "shard_index": 3})


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((3, 4, 0, 2), "global_batch_size=3 must be divisible by world_size=2"),
        ((0, 4, 0, 1), "global_batch_size"),
        ((2, 0, 0, 1), "seq_len"),
        ((2, 4, 0, 0), "world_size"),
        ((2, 4, 2, 2), "rank"),
        ((2, 4, -1, 2), "rank"),
    ],
)
def test_invalid_arguments_name_the_field(shard_dir: Path, args: tuple, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DistributedTokenLoader(_pattern(shard_dir), *args)


def test_shard_too_small_for_one_step_and_missing_pattern(shard_dir: Path) -> None:
    with pytest.raises(ValueError, match="fineweb_train_000002.bin: shard has 40 tokens"):
        DistributedTokenLoader(_pattern(shard_dir), 4, 10, 0, 1)
    with pytest.raises(FileNotFoundError, match="no shard files match"):
        DistributedTokenLoader(str(shard_dir / "missing_*.bin"), 2, 4, 0, 1)


def test_validation_budget_is_fixed_and_deterministic(shard_dir: Path) -> None:
    val_pattern = str(shard_dir / "fineweb_val_*.bin")
    # 61 tokens, 12 per step: 5 whole steps (60 + 1 tokens) in one pass.
    assert validation_token_capacity(val_pattern, 2, 6) == 60
    val = list(range(1000, 1061))
    for world_size in (1, 2):
        runs = [
            [
                list(validation_batches(val_pattern, 2, 6, r, world_size, 36))
                for r in range(world_size)
            ]
            for _ in range(2)
        ]
        assert all(len(per_rank) == 3 for per_rank in runs[0])
        for step in range(3):
            first = torch.cat([runs[0][r][step][0] for r in range(world_size)])
            again = torch.cat([runs[1][r][step][0] for r in range(world_size)])
            assert torch.equal(first, again)
            assert first.flatten().tolist() == val[12 * step : 12 * step + 12]


@pytest.mark.parametrize(
    ("val_tokens", "message"),
    [
        (30, "must be a multiple of"),
        (0, r"val_tokens must be an int >= 1"),
        (72, "exceeds the 60 tokens"),
    ],
)
def test_validation_budget_errors_name_val_tokens(
    shard_dir: Path, val_tokens: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as info:
        validation_batches(str(shard_dir / "fineweb_val_*.bin"), 2, 6, 0, 1, val_tokens)
    assert "val_tokens" in str(info.value)
