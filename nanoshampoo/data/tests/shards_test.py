"""FineWeb shard format: round trip, header validation, token range on write, glob listing."""

from pathlib import Path

import numpy as np
import pytest
import torch

from nanoshampoo.data.shards import (
    HEADER_BYTES,
    SHARD_MAGIC,
    ShardFormatError,
    list_shards,
    read_shard,
    read_shard_token_count,
    write_shard,
)


def _raw_shard(path: Path, header_values: dict[int, int], tokens: list[int]) -> Path:
    """A shard written the obvious way with struct-like NumPy calls, header fields overridable."""
    header = np.zeros(256, dtype="<i4")
    header[0], header[1], header[2] = SHARD_MAGIC, 1, len(tokens)
    for index, value in header_values.items():
        header[index] = value
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes())
    return path


@pytest.mark.parametrize(
    "tokens",
    [[], [0], [50256, 15496, 995], list(range(0, 65536, 97)) + [65535]],
    ids=["empty", "single", "gpt2", "full-range"],
)
def test_round_trip(tmp_path: Path, tokens: list[int]) -> None:
    path = tmp_path / "fineweb_train_000001.bin"
    write_shard(path, tokens)
    data = read_shard(path)
    assert data.dtype == np.uint16
    assert data.tolist() == tokens
    raw = path.read_bytes()
    header = np.frombuffer(raw[:HEADER_BYTES], dtype="<i4")
    assert header[:3].tolist() == [SHARD_MAGIC, 1, len(tokens)]
    assert not header[3:].any()
    assert np.frombuffer(raw[HEADER_BYTES:], dtype="<u2").tolist() == tokens


def test_write_accepts_numpy_and_tensor_and_leaves_no_temp_files(tmp_path: Path) -> None:
    write_shard(tmp_path / "a.bin", np.array([1, 2, 3], dtype=np.int64))
    write_shard(tmp_path / "b.bin", torch.tensor([4, 5], dtype=torch.int32))
    assert read_shard(tmp_path / "a.bin").tolist() == [1, 2, 3]
    assert read_shard(tmp_path / "b.bin").tolist() == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.bin"]


def test_read_matches_raw_writer(tmp_path: Path) -> None:
    path = _raw_shard(tmp_path / "x.bin", {}, [7, 8, 9])
    assert read_shard(path).tolist() == [7, 8, 9]
    assert read_shard_token_count(path) == 3


@pytest.mark.parametrize(
    ("header_values", "tokens", "extra", "problem"),
    [
        ({0: 12345}, [1, 2], b"", "wrong magic number 12345"),
        ({1: 2}, [1, 2], b"", "unsupported version 2"),
        ({2: -1}, [], b"", "negative token count -1"),
        ({2: 5}, [1, 2], b"", "truncated"),
        ({}, [1, 2], b"\x00\x00", "2 trailing bytes"),
        ({}, [1, 2], b"\x00", "1 trailing bytes"),
    ],
    ids=["magic", "version", "negative-count", "truncated", "trailing", "odd-trailing"],
)
def test_malformed_header_names_file_and_problem(
    tmp_path: Path, header_values: dict[int, int], tokens: list[int], extra: bytes, problem: str
) -> None:
    path = _raw_shard(tmp_path / "bad.bin", header_values, tokens)
    path.write_bytes(path.read_bytes() + extra)
    with pytest.raises(ShardFormatError, match=problem) as info:
        read_shard(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("size", [0, 4, HEADER_BYTES - 1])
def test_file_shorter_than_header(tmp_path: Path, size: int) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"\x00" * size)
    with pytest.raises(ShardFormatError, match="shorter than the 1024-byte") as info:
        read_shard(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, 65536, 2], r"tokens\[1\] = 65536"),
        ([5, 6, -3], r"tokens\[2\] = -3"),
        ([70000], r"tokens\[0\] = 70000"),
    ],
)
def test_write_refuses_out_of_range_tokens(tmp_path: Path, tokens: list[int], message: str) -> None:
    path = tmp_path / "out.bin"
    with pytest.raises(ValueError, match=message):
        write_shard(path, tokens)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("tokens", "message"),
    [(np.array([1.5, 2.0]), "must be integers"), (np.zeros((2, 2), dtype=int), "one-dimensional")],
)
def test_write_refuses_non_integer_or_multidimensional(
    tmp_path: Path, tokens: np.ndarray, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        write_shard(tmp_path / "out.bin", tokens)


def test_write_replaces_existing_file_atomically(tmp_path: Path) -> None:
    path = tmp_path / "s.bin"
    write_shard(path, [1, 2, 3])
    write_shard(path, [9])
    assert read_shard(path).tolist() == [9]


def test_list_shards_sorted_and_empty_pattern_is_an_error(tmp_path: Path) -> None:
    for name in ["fineweb_train_000002.bin", "fineweb_train_000001.bin", "fineweb_val_000000.bin"]:
        write_shard(tmp_path / name, [1])
    train = list_shards(tmp_path / "fineweb_train_*.bin")
    assert [p.name for p in train] == ["fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert [p.name for p in list_shards(str(tmp_path / "fineweb_val_*.bin"))] == [
        "fineweb_val_000000.bin"
    ]
    with pytest.raises(FileNotFoundError, match="no shard files match"):
        list_shards(tmp_path / "nothing_*.bin")
