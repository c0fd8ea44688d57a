"""The embedded default corpus: public-domain English text shipped inside the package.

Two sources, stored as gzip JSON lines in ``nanoshampoo/data/corpus/`` (about 3.3 MB
compressed, 9.4 M characters; provenance in that folder's README.md):

* ``"shakespeare"``: 42 works of William Shakespeare (plays and poems), one document each.
* ``"kjv"``: the 66 books of the King James Bible, one document each.

Nothing is downloaded: if a file is missing (a broken install), loading raises
``FileNotFoundError`` saying how to restore it.

Example:
    >>> docs = load_embedded_corpus(("shakespeare",))
    >>> len(docs), docs[0].source
    (42, 'shakespeare')
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from nanoshampoo.data.documents import Document, read_documents
from nanoshampoo.validation import check_choice

EMBEDDED_SOURCES: tuple[str, ...] = ("shakespeare", "kjv")
CORPUS_DIR = Path(__file__).parent / "corpus"


def embedded_corpus_path(source: str) -> Path:
    """Path of one source's corpus file; ``ValueError`` for an unknown source name,
    ``FileNotFoundError`` when the file is missing from the installed package."""
    check_choice("source", source, EMBEDDED_SOURCES)
    path = CORPUS_DIR / f"{source}.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(
            f"embedded corpus file {path} is missing: reinstall nanoshampoo (the file ships "
            f"with the package), or rebuild it with python -m nanoshampoo.data.corpus_build"
        )
    return path


def load_embedded_corpus(sources: Sequence[str] = EMBEDDED_SOURCES) -> list[Document]:
    """Documents of the requested sources, in source order then their stored order."""
    if not sources:
        raise ValueError("sources must name at least one embedded source")
    return [doc for source in sources for doc in read_documents(embedded_corpus_path(source))]
