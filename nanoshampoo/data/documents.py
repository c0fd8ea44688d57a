"""Documents (one play, one book, one file) and their gzip JSON-lines storage.

A corpus file is gzip-compressed JSON lines, one object per document:
``{"source": "shakespeare", "title": "Hamlet, Prince of Denmark", "text": "..."}``.
Files are written with a zero gzip timestamp so the same documents give the same bytes.

Example:
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "tiny.jsonl.gz"
    >>> write_documents(path, [Document("demo", "One", "Some text.")])
    >>> read_documents(path)[0].title
    'One'
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from nanoshampoo.io_utils import atomic_output


@dataclass(frozen=True)
class Document:
    """One document: tokenized as a unit and prefixed with the end-of-text token."""

    source: str
    title: str
    text: str

    def __post_init__(self) -> None:
        for name in ("source", "title", "text"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")


def write_documents(path: str | os.PathLike[str], documents: Sequence[Document]) -> None:
    """Write ``documents`` as gzip JSON lines at ``path`` atomically and reproducibly."""
    with (
        atomic_output(path) as tmp,
        open(tmp, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as f,
    ):
        for document in documents:
            f.write(json.dumps(asdict(document), ensure_ascii=False).encode("utf-8"))
            f.write(b"\n")


def read_documents(path: str | os.PathLike[str]) -> list[Document]:
    """Read a gzip JSON-lines corpus file; a malformed line raises ``ValueError`` naming the
    file and line number."""
    path = Path(path)
    documents = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            try:
                row = json.loads(line)
                documents.append(Document(row["source"], row["title"], row["text"]))
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(
                    f"{path}: line {line_number}: malformed document: {error}"
                ) from error
    return documents
