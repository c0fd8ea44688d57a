"""Deterministic train/validation split of documents."""

import pytest

from nanoshampoo.data.document_split import split_documents
from nanoshampoo.data.documents import Document


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
    assert first[0] == again[0]
    assert sorted(d.title for d in first[1]) == sorted(d.title for d in again[1])
    # Training order interleaves the sources rather than keeping the input order.
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
