"""Deterministic train/validation split and order of documents (usually passages).

Documents here are normally the passages of ``passages`` (a few thousand characters each),
so the rule below draws a random sample of passages from every work; with whole works it
holds out whole works. The rule, applied to each ``source`` separately so every source
appears in both splits:

* A source with several documents gives documents to validation, taken in the order of the
  SHA-256 of ``("split", source, title)`` (a fixed-key shuffle), until validation holds at
  least ``val_fraction`` of the source's characters (at least one document stays in
  training). The validation share thus exceeds ``val_fraction`` by less than one document.
* A source with a single document is cut at the first line break at or after
  ``(1 - val_fraction)`` of its text; the tail becomes the validation document.

Both splits are then ordered by the SHA-256 of ``("order", source, title)``: another
fixed-key shuffle, which interleaves sources and works in the training stream (read
sequentially by the loader) and makes any prefix of the validation stream (the trainer
evaluates the first ``val_tokens``) a random sample of it. Passage titles carry the work
title and the passage number, so the keys are hashes of source, work and passage index. The
split and order depend only on the documents, never on a random seed or the input order, so
every run and machine gets the same ones.

Example:
    >>> docs = [Document("s", f"doc {i}", "x" * 100) for i in range(10)]
    >>> train, val = split_documents(docs, val_fraction=0.2)
    >>> len(train), len(val)
    (8, 2)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from nanoshampoo.data.documents import Document
from nanoshampoo.validation import check_float


def _hash_key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode("utf-8")).hexdigest()


def _cut_single_document(document: Document, val_fraction: float) -> tuple[Document, Document]:
    text = document.text
    target = max(1, min(len(text) - 1, round(len(text) * (1.0 - val_fraction))))
    newline = text.find("\n", target - 1)
    # Cut after a newline when one lies in the tail; never leave either part empty.
    cut = newline + 1 if 0 <= newline < len(text) - 1 else target
    return (
        Document(document.source, document.title, text[:cut]),
        Document(document.source, f"{document.title} (validation part)", text[cut:]),
    )


def split_documents(
    documents: Sequence[Document], val_fraction: float
) -> tuple[list[Document], list[Document]]:
    """Return ``(train, val)`` by the rule in the module docstring, each in its stream order.

    ``val_fraction`` must lie in ``(0, 1)``. A single-document source must have at least two
    characters.
    """
    check_float("val_fraction", val_fraction, greater_than=0.0, less_than=1.0)
    if not documents:
        raise ValueError("documents must not be empty")
    by_source: dict[str, list[Document]] = {}
    for document in documents:
        by_source.setdefault(document.source, []).append(document)
    train: list[Document] = []
    val: list[Document] = []
    for source, group in by_source.items():
        if len(group) == 1:
            if len(group[0].text) < 2:
                raise ValueError(f"source {source!r} has one document of under two characters")
            train_part, val_part = _cut_single_document(group[0], val_fraction)
            train.append(train_part)
            val.append(val_part)
            continue
        target = val_fraction * sum(len(d.text) for d in group)
        val_chars = 0
        chosen: set[int] = set()
        split_order = sorted(
            range(len(group)),
            key=lambda i: (_hash_key("split", source, group[i].title), group[i].text),
        )
        for index in split_order:
            if val_chars >= target or len(chosen) == len(group) - 1:
                break
            chosen.add(index)
            val_chars += len(group[index].text)
        val += [d for i, d in enumerate(group) if i in chosen]
        train += [d for i, d in enumerate(group) if i not in chosen]
    # The text breaks ties between equal titles, so the input order never matters.
    train.sort(key=lambda d: (_hash_key("order", d.source, d.title), d.text))
    val.sort(key=lambda d: (_hash_key("order", d.source, d.title), d.text))
    return train, val
