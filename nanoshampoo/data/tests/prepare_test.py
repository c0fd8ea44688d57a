"""Corpus preparation: shards + tokenizer from text, idempotence, documents start with eot."""

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nanoshampoo.data import prepare as prepare_module
from nanoshampoo.data.documents import Document
from nanoshampoo.data.embedded_corpus import load_embedded_corpus
from nanoshampoo.data.loader import DistributedTokenLoader
from nanoshampoo.data.passages import split_all_into_passages
from nanoshampoo.data.prepare import (
    PrepareConfig,
    PreparedData,
    main,
    prepare_embedded,
    prepare_text_files,
)
from nanoshampoo.data.shards import list_shards, read_shard, write_shard
from nanoshampoo.data.tokenizer import load_tokenizer

# These corpora are a few thousand tokens: batches of 64 tokens fit (the loaders below take 32).
SMALL_BATCH_TOKENS = 64


def prepare_small(*args: Any, **kwargs: Any) -> PreparedData:
    return prepare_text_files(*args, min_batch_tokens=SMALL_BATCH_TOKENS, **kwargs)


TEXTS = {
    "hamlet.txt": "To be, or not to be, that is the question:\n" * 30,
    "genesis.txt": "In the beginning God created the heaven and the earth.\n" * 25,
    "sonnet.txt": "Shall I compare thee to a summer's day?\nThou art more lovely.\n" * 20,
    "lear.txt": "Nothing will come of nothing: speak again.\n" * 28,
}


@pytest.fixture
def text_files(tmp_path: Path) -> list[Path]:
    paths = []
    for name, text in TEXTS.items():
        path = tmp_path / "corpus" / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def _documents_in(pattern: str, eot_id: int) -> list[np.ndarray]:
    """Split the concatenated shards at end-of-text tokens; checks the stream starts with one."""
    stream = np.concatenate([np.asarray(read_shard(p)) for p in list_shards(pattern)])
    assert stream[0] == eot_id
    starts = np.flatnonzero(stream == eot_id).tolist() + [len(stream)]
    return [stream[a + 1 : b] for a, b in zip(starts[:-1], starts[1:])]


def _decoded(data: PreparedData, pattern: str) -> list[str]:
    tokenizer = load_tokenizer(data.tokenizer_path)
    return [tokenizer.decode(doc.tolist()) for doc in _documents_in(pattern, data.eot_id)]


def test_text_files_become_eot_prefixed_documents(tmp_path: Path, text_files: list[Path]) -> None:
    data = prepare_small(text_files, tmp_path / "out", vocab_size=300, val_fraction=0.25)
    assert not data.reused
    assert data.train_pattern == str(tmp_path / "out" / "fineweb_train_*.bin")
    assert data.val_pattern == str(tmp_path / "out" / "fineweb_val_*.bin")
    assert [p.name for p in list_shards(data.val_pattern)] == ["fineweb_val_000000.bin"]
    assert [p.name for p in list_shards(data.train_pattern)] == ["fineweb_train_000001.bin"]
    tokenizer = load_tokenizer(data.tokenizer_path)
    assert (tokenizer.vocab_size, tokenizer.eot_id) == (data.vocab_size, data.eot_id)
    assert data.eot_id == data.vocab_size - 1
    train, val = _decoded(data, data.train_pattern), _decoded(data, data.val_pattern)
    assert (len(train), len(val)) == (data.train_documents, data.val_documents)
    assert len(val) >= 1 and len(train) + len(val) == len(TEXTS)
    assert sorted(train + val) == sorted(TEXTS.values())
    assert data.train_tokens == sum(len(read_shard(p)) for p in list_shards(data.train_pattern))
    assert data.val_tokens == len(read_shard(tmp_path / "out" / "fineweb_val_000000.bin"))


def test_prepare_is_idempotent_and_rebuilds_on_new_settings(
    tmp_path: Path, text_files: list[Path]
) -> None:
    out = tmp_path / "out"
    first = prepare_small(text_files, out, vocab_size=300, shard_tokens=200)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = prepare_small(text_files, out, vocab_size=300, shard_tokens=200)
    assert again.reused and again == PreparedData(**{**first.__dict__, "reused": True})
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    assert len(list_shards(first.train_pattern)) > 2  # small shard_tokens: several shards

    passages = prepare_small(text_files, out, vocab_size=300, passage_chars=100)
    assert not passages.reused and passages.train_documents > first.train_documents
    rebuilt = prepare_small(text_files, out, vocab_size=300, shard_tokens=100_000)
    assert not rebuilt.reused
    # The old shards are gone: the glob sees only the new single training shard.
    assert [p.name for p in list_shards(rebuilt.train_pattern)] == ["fineweb_train_000001.bin"]
    decoded = _decoded(rebuilt, rebuilt.train_pattern) + _decoded(rebuilt, rebuilt.val_pattern)
    assert sorted(decoded) == sorted(TEXTS.values())

    (out / "fineweb_train_000001.bin").unlink()  # damaged output is rebuilt, not reused
    assert not prepare_small(text_files, out, vocab_size=300, shard_tokens=100_000).reused


def test_loader_reads_prepared_shards(tmp_path: Path, text_files: list[Path]) -> None:
    data = prepare_small(text_files, tmp_path / "out", vocab_size=300, shard_tokens=250)
    loader = DistributedTokenLoader(data.train_pattern, 2, 16, 1, 2)
    inputs, targets = loader.next_batch()
    assert inputs.shape == (1, 16)
    assert int(inputs.max()) < data.vocab_size


def test_text_files_are_cut_into_passages(tmp_path: Path, text_files: list[Path]) -> None:
    data = prepare_small(text_files, tmp_path / "out", vocab_size=300, passage_chars=100)
    files = [Document("text_files", str(p), p.read_text(encoding="utf-8")) for p in text_files]
    passages = split_all_into_passages(files, 100)
    assert len(passages) > 2 * len(files)
    train, val = _decoded(data, data.train_pattern), _decoded(data, data.val_pattern)
    assert sorted(train + val) == sorted(p.text for p in passages)
    assert (len(train), len(val)) == (data.train_documents, data.val_documents)
    total = sum(len(p.text) for p in passages)
    assert 0.05 * total <= sum(map(len, val)) < 0.05 * total + max(len(p.text) for p in passages)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["settings"]["passage_chars"] == 100


def test_single_file_is_cut_into_train_and_validation(tmp_path: Path) -> None:
    path = tmp_path / "one.txt"
    text = "".join(f"line {i} of a single long document\n" for i in range(200))
    path.write_text(text, encoding="utf-8")
    data = prepare_small(
        [path], tmp_path / "out", vocab_size=300, val_fraction=0.1, passage_chars=0
    )
    (train,), (val,) = _decoded(data, data.train_pattern), _decoded(data, data.val_pattern)
    assert train + val == text
    assert val.startswith("line ") and 0.05 < len(val) / len(text) < 0.15


def test_gpt2_and_existing_tokenizer_file(tmp_path: Path, text_files: list[Path]) -> None:
    gpt2 = prepare_small(text_files, tmp_path / "gpt2", tokenizer="gpt2")
    assert (gpt2.vocab_size, gpt2.eot_id) == (50257, 50256)
    assert sorted(_decoded(gpt2, gpt2.train_pattern) + _decoded(gpt2, gpt2.val_pattern)) == sorted(
        TEXTS.values()
    )
    reused_tokenizer = prepare_small(
        text_files[:2], tmp_path / "again", tokenizer=str(gpt2.tokenizer_path)
    )
    assert reused_tokenizer.eot_id == 50256
    assert _documents_in(reused_tokenizer.train_pattern, 50256)


def test_refuses_foreign_shards_in_out_dir(tmp_path: Path, text_files: list[Path]) -> None:
    out = tmp_path / "out"
    write_shard(out / "fineweb_train_000001.bin", [1, 2, 3])
    with pytest.raises(ValueError, match="not listed in a manifest"):
        prepare_small(text_files, out, vocab_size=300)
    assert (out / "fineweb_train_000001.bin").exists()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"shard_tokens": 0}, "shard_tokens"),
        ({"vocab_size": 100}, "vocab_size"),
        ({"passage_chars": -1}, "passage_chars"),
        ({"passage_chars": 2.5}, "passage_chars"),
        ({"tokenizer": "no-such-tokenizer"}, "tokenizer"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PrepareConfig(**kwargs)


def test_bad_text_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    missing = tmp_path / "missing.txt"
    cases = [(empty, "is empty"), (binary, "not valid UTF-8"), (missing, "does not exist")]
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            prepare_small([path], tmp_path / "out")


def test_cli(tmp_path: Path, text_files: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    argv = [
        "--out-dir",
        str(out),
        "--vocab-size",
        "300",
        "--min-batch-tokens",
        "64",
        "--text-files",
        *map(str, text_files),
    ]
    assert main([*argv, "--passage-chars", "0"]) == 0
    assert json.loads((out / "manifest.json").read_text())["settings"]["passage_chars"] == 0
    assert main(argv) == 0
    assert f"prepared {out}" in capsys.readouterr().out
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "reused existing preparation" in printed and "vocab_size: 300" in printed
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["settings"]["tokenizer"] == {"kind": "bpe", "vocab_size": 300}
    assert main(["--out-dir", str(out), "--val-fraction", "2"]) == 2


def test_missing_embedded_corpus_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("nanoshampoo.data.embedded_corpus.CORPUS_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="embedded corpus file .* is missing"):
        prepare_embedded(tmp_path / "out")
    assert prepare_module.EMBEDDED_SOURCES == ("shakespeare", "kjv")


@pytest.mark.slow
def test_prepare_embedded_real_corpus(tmp_path: Path) -> None:
    data = prepare_embedded(tmp_path / "embedded")
    assert (data.vocab_size, data.eot_id) == (4096, 4095)
    passages = split_all_into_passages(load_embedded_corpus(), 2000)
    assert data.train_documents + data.val_documents == len(passages) > 3000
    assert data.train_tokens > 2_000_000 and 0.03 < data.val_tokens / data.train_tokens < 0.08
    manifest = json.loads((tmp_path / "embedded" / "manifest.json").read_text())
    sources = {p.title: p.source for p in passages}
    assert {sources[t] for t in manifest["val_titles"]} == {"shakespeare", "kjv"}
    val = _documents_in(data.val_pattern, data.eot_id)
    train = _documents_in(data.train_pattern, data.eot_id)
    assert (len(train), len(val)) == (data.train_documents, data.val_documents)
    tokenizer = load_tokenizer(data.tokenizer_path)
    sample = tokenizer.decode(train[0][:200].tolist())
    assert sample and tokenizer.encode(sample) == train[0][:200].tolist()
    assert prepare_embedded(tmp_path / "embedded").reused


def test_cli_given_a_directory_says_so_in_one_line(
    tmp_path: Path, text_files: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = text_files[0].parent
    assert main(["--out-dir", str(tmp_path / "out"), "--text-files", str(corpus)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"text file {corpus} is a directory" in err
