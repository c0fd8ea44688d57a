"""Bad input to ``prepare`` and to the shard reader: exit status 2 with one line naming the flag
or file, and the existing data untouched (new data is written beside it, then swapped in)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from bad_input_fixtures import EXIT_USER_ERROR, one_error_line, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoshampoo.data.prepare import main
from nanoshampoo.data.shards import (
    HEADER_BYTES,
    ShardFormatError,
    read_shard_token_count,
    write_shard,
)

PROG = "python -m nanoshampoo.data.prepare"
# About 12,000 tokens: with --val-fraction 0.4 each split holds more than the default batch.
TEXT = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n\n" for i in range(800))


@pytest.fixture
def prepared(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, list[str]]:
    """A finished preparation in ``tmp_path/data`` and the flags that made it."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    argv = [
        "--out-dir",
        str(tmp_path / "data"),
        "--vocab-size",
        "300",
        "--passage-chars",
        "200",
        "--val-fraction",
        "0.4",
        "--text-files",
        str(corpus),
    ]
    assert main(argv) == 0
    capsys.readouterr()
    return tmp_path / "data", argv


def test_a_bad_tokenizer_file_leaves_the_old_data(
    prepared: tuple[Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, argv = prepared
    bad = tmp_path / "bad-tokenizer.json"
    bad.write_text('{"not": "a tokenizer"}')
    before = snapshot(tmp_path)
    assert main([*argv, "--tokenizer", str(bad)]) == EXIT_USER_ERROR
    one_error_line(capsys, PROG, "--tokenizer", str(bad))
    assert snapshot(tmp_path) == before


def test_a_foreign_shard_leaves_the_old_data(
    prepared: tuple[Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, argv = prepared
    write_shard(data / "fineweb_train_000099.bin", [1, 2, 3])
    before = snapshot(tmp_path)
    assert main([*argv, "--passage-chars", "300"]) == EXIT_USER_ERROR  # new settings: rebuild
    one_error_line(capsys, PROG, "--out-dir", "fineweb_train_000099.bin")
    assert snapshot(tmp_path) == before


def test_a_failure_while_writing_leaves_the_old_data(
    prepared: tuple[Path, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, argv = prepared
    before = snapshot(tmp_path)
    written: list[int] = []

    def fail_on_the_second(path: Path, tokens: np.ndarray) -> None:
        written.append(1)
        if len(written) == 2:
            raise OSError("disk full")
        write_shard(path, tokens)

    from nanoshampoo.data import prepare_output  # noqa: PLC0415 - where prepare writes shards

    monkeypatch.setattr(prepare_output, "write_shard", fail_on_the_second)
    with pytest.raises(OSError, match="disk full"):
        main([*argv, "--passage-chars", "300", "--shard-tokens", "500", "--min-batch-tokens", "64"])
    assert snapshot(tmp_path) == before  # no staging directory left either


def test_a_rebuild_swaps_in_new_data_and_keeps_the_users_files(
    prepared: tuple[Path, list[str]], tmp_path: Path
) -> None:
    data, argv = prepared
    (data / "NOTES.md").write_text("mine")
    old_manifest = json.loads((data / "manifest.json").read_text())
    assert main([*argv, "--passage-chars", "300"]) == 0
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["settings_hash"] != old_manifest["settings_hash"]
    assert sorted(p.name for p in data.iterdir()) == sorted(
        ["NOTES.md", "manifest.json", "tokenizer.json", *manifest["shard_token_counts"]]
    )
    assert (data / "NOTES.md").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "data"]


def test_a_corpus_too_small_for_one_batch_is_refused_naming_the_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("eleven tokens of text\n\nand two more\n")
    argv = ["--out-dir", str(tmp_path / "data"), "--vocab-size", "300", "--text-files", str(corpus)]
    assert main(argv) == EXIT_USER_ERROR
    line = one_error_line(capsys, PROG, "corpus too small", "training", "validation", "2049")
    assert any(word.isdigit() for word in line.replace(",", " ").split()[:8])
    assert not (tmp_path / "data").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.txt"]


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--vocab-size", "abc"], ["--vocab-size", "abc"]),
        (["--no-such-flag"], ["--no-such-flag"]),
        (["--text-files"], ["--text-files"]),
        (["--val-fraction", "2"], ["val_fraction"]),
        (["--min-batch-tokens", "0"], ["min_batch_tokens"]),
    ],
)
def test_argument_errors_are_one_line(
    argv: list[str], names: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        status = main(["--out-dir", str(tmp_path / "data"), *argv])
    except SystemExit as exc:  # argparse's own errors exit from the parser
        status = int(exc.code or 0)
    assert status == EXIT_USER_ERROR
    line = one_error_line(capsys, PROG, *names)
    assert "usage:" not in line
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize(
    "out_dir, names",
    [
        ("{tmp}/file/data", ["--out-dir", "is a file"]),
        ("{tmp}/file", ["--out-dir", "not a directory"]),
        ("/proc/x", ["--out-dir", "/proc/x"]),
        ("/sys/x", ["--out-dir", "/sys/x", "Permission denied"]),
        ("{tmp}/" + "d" * 300, ["--out-dir", "exceeds"]),
    ],
)
def test_an_out_dir_that_cannot_be_written_is_one_line(
    out_dir: str, names: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("x")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    before = snapshot(tmp_path)
    argv = [
        "--out-dir",
        out_dir.format(tmp=tmp_path),
        "--min-batch-tokens",
        "16",
        "--vocab-size",
        "300",
        "--text-files",
        str(corpus),
    ]
    assert main(argv) == EXIT_USER_ERROR
    one_error_line(capsys, PROG, *names)
    assert snapshot(tmp_path) == before


def test_the_working_directory_as_out_dir_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    assert (
        main(
            [
                "--out-dir",
                ".",
                "--val-fraction",
                "0.4",
                "--vocab-size",
                "300",
                "--text-files",
                str(corpus),
            ]
        )
        == EXIT_USER_ERROR
    )
    one_error_line(capsys, PROG, "--out-dir .", "working directory")
    assert snapshot(tmp_path) == before


@pytest.fixture(scope="module")
def good_shard(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("shard") / "s.bin"
    write_shard(path, np.arange(50) % 7)
    return path.read_bytes()


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    cut=st.integers(0, HEADER_BYTES + 100),
    flips=st.lists(st.tuples(st.integers(0, HEADER_BYTES + 99), st.integers(0, 255)), max_size=4),
    extra=st.binary(max_size=5),
)
def test_a_corrupted_shard_raises_naming_the_file_or_reads(
    cut: int,
    flips: list[tuple[int, int]],
    extra: bytes,
    good_shard: bytes,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    data = bytearray(good_shard)
    for index, value in flips:
        data[index] = value
    path = tmp_path_factory.mktemp("bad") / "fineweb_train_000001.bin"
    path.write_bytes(bytes(data[:cut]) + extra)
    try:
        count = read_shard_token_count(path)
    except ShardFormatError as exc:
        assert str(path) in str(exc) and "\n" not in str(exc)
    else:
        assert path.stat().st_size == HEADER_BYTES + 2 * count


def test_a_shard_that_is_a_directory_or_fifo_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "dir.bin").mkdir()
    os.mkfifo(tmp_path / "fifo.bin")
    for name in ("dir.bin", "fifo.bin", "missing.bin"):
        with pytest.raises(ShardFormatError, match=f"{tmp_path / name}: "):
            read_shard_token_count(tmp_path / name)


@settings(
    max_examples=10,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(shard_tokens=st.integers(1, 2048))
def test_shards_smaller_than_one_batch_are_refused_before_tokenizing(
    shard_tokens: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: --shard-tokens 1 wrote one file per token (millions of files: a hang), and any
    # shard smaller than a batch is one the trainer refuses to read.
    capsys.readouterr()
    before = snapshot(tmp_path)
    argv = ["--out-dir", str(tmp_path / "data"), "--shard-tokens", str(shard_tokens)]
    assert main(argv) == EXIT_USER_ERROR
    one_error_line(capsys, PROG, "--shard-tokens", "--min-batch-tokens 2048")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("second", ["same", "dotted", "link"])
def test_a_text_file_given_twice_is_refused(
    second: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: its documents were counted twice, so the validation split could hold text that
    # is also in the training split.
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("A line of plain text for the corpus.\n" * 400)
    other = {
        "same": corpus,
        "dotted": tmp_path / "." / "corpus.txt",
        "link": tmp_path / "link.txt",
    }[second]
    if second == "link":
        os.symlink(corpus, other)
    before = snapshot(tmp_path)
    argv = [
        "--out-dir",
        str(tmp_path / "data"),
        "--vocab-size",
        "300",
        "--min-batch-tokens",
        "16",
        "--text-files",
        str(corpus),
        str(other),
    ]
    assert main(argv) == EXIT_USER_ERROR
    one_error_line(capsys, PROG, "given twice", "corpus.txt")
    assert snapshot(tmp_path) == before


def test_a_fifo_text_file_is_refused_as_not_regular(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    before = snapshot(tmp_path)
    assert main(["--out-dir", str(tmp_path / "data"), "--text-files", str(fifo)]) == EXIT_USER_ERROR
    # Before: "does not exist", of a file that exists.
    one_error_line(capsys, PROG, "pipe.txt", "not a regular file")
    assert snapshot(tmp_path) == before
