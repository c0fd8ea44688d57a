"""Deterministic train/validation split and order of documents and passages."""

import hashlib
import itertools

import pytest

from nanoshampoo.data.document_split import split_documents
from nanoshampoo.data.documents import Document
from nanoshampoo.data.embedded_corpus import load_embedded_corpus
from nanoshampoo.data.passages import split_all_into_passages


def _docs() -> list[Document]:
    plays = [Document("plays", f"play {i}", f"play {i} text\n" * (10 + i)) for i in range(12)]
    books = [Document("books", f"book {i}", f"book {i} verse\n" * (5 + 2 * i)) for i in range(9)]
    return plays + books


@pytest.mark.parametrize("val_fraction", [0.05, 0.2, 0.5])
def test_split_per_source_reaches_fraction_with_whole_documents(val_fraction: float) -> None:
    docs = _docs()
    train, val = split_documents(docs, val_fraction)
    assert sorted(train + val, key=lambda d: d.title) == sorted(docs, key=lambda d: d.title)
    for source in ("plays", "books"):
        total = sum(len(d.text) for d in docs if d.source == source)
        val_chars = [len(d.text) for d in val if d.source == source]
        # Enough characters, and removing the last chosen document would fall short.
        assert sum(val_chars) >= val_fraction * total
        assert sum(val_chars) - max(val_chars) < val_fraction * total
        assert any(d.source == source for d in train)


def test_split_is_deterministic_and_independent_of_input_order() -> None:
    docs = _docs()
    first = split_documents(docs, 0.2)
    again = split_documents(list(reversed(docs)), 0.2)
    assert first == again
    # Both splits are in the order of a keyed hash (a fixed shuffle), not the input order.
    for split in first:
        keys = [hashlib.sha256(f"order\0{d.source}\0{d.title}".encode()).hexdigest() for d in split]
        assert keys == sorted(keys)
    assert [d.source for d in first[0]] != sorted(d.source for d in first[0])


def test_single_document_is_cut_at_a_line_break() -> None:
    text = "".join(f"line {i}\n" for i in range(100))
    (train,), (val,) = split_documents([Document("one", "only", text)], 0.1)
    assert train.text + val.text == text
    assert train.text.endswith("\n") and val.text.startswith("line ")
    assert val.title == "only (validation part)"


@pytest.mark.parametrize("val_fraction", [0.0, 1.0, -0.1])
def test_invalid_fraction(val_fraction: float) -> None:
    with pytest.raises(ValueError, match="val_fraction"):
        split_documents(_docs(), val_fraction)


def _work(passage: Document) -> str:
    return passage.title.rsplit(", passage ", 1)[0]


def test_embedded_passages_split_samples_every_source_and_mixes_the_training_order() -> None:
    docs = load_embedded_corpus()
    passages = split_all_into_passages(docs, 2000)
    train, val = split_documents(passages, 0.05)
    assert sorted(train + val, key=lambda p: p.title) == sorted(passages, key=lambda p: p.title)
    longest = max(len(p.text) for p in passages)
    for source in ("shakespeare", "kjv"):
        total = sum(len(p.text) for p in passages if p.source == source)
        val_chars = sum(len(p.text) for p in val if p.source == source)
        assert 0.05 * total <= val_chars < 0.05 * total + longest
        assert any(p.source == source for p in train)
    # Validation is a sample of passages from many works, not a few whole works; any prefix
    # of it (the trainer evaluates the first val_tokens) mixes both sources.
    assert len({_work(p) for p in val}) > 50
    assert {p.source for p in val[:20]} == {"shakespeare", "kjv"}
    # The first 100 training passages come from many works, never more than 3 in a row.
    head = [_work(p) for p in train[:100]]
    assert max(len(list(run)) for _, run in itertools.groupby(head)) <= 3
    assert len(set(head)) > 40 and {p.source for p in train[:100]} == {"shakespeare", "kjv"}
