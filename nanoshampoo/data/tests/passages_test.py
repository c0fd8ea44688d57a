"""Cutting documents into passages at paragraph boundaries."""

import random

import pytest

from nanoshampoo.data.documents import Document
from nanoshampoo.data.embedded_corpus import load_embedded_corpus
from nanoshampoo.data.passages import (
    HEADING_MAX_CHARS,
    LINE_CUT_FACTOR,
    passage_cuts,
    split_all_into_passages,
    split_into_passages,
)


def _reference_cuts(text: str, min_chars: int) -> list[int]:
    """The rule written the slow way: list the lines, mark each allowed cut, then walk."""
    lines = text.split("\n")
    # Offsets of the lines; a trailing "\n" leaves an empty last entry that starts no line.
    offsets, position = [], 0
    for line in lines:
        offsets.append(position)
        position += len(line) + 1
    if text.endswith("\n"):
        lines, offsets = lines[:-1], offsets[:-1]
    blank = [not line.strip() for line in lines]
    paragraph_cut = [False] * len(lines)
    for i in range(1, len(lines)):
        if blank[i] or not blank[i - 1]:
            continue
        j = i - 1
        while j >= 0 and blank[j]:
            j -= 1
        first = j
        while first > 0 and not blank[first - 1]:
            first -= 1
        # j < 0: only blank lines before; otherwise the paragraph is lines first..j.
        heading = j >= 0 and first == j and len(lines[j]) + 1 < HEADING_MAX_CHARS
        paragraph_cut[i] = j >= 0 and not heading
    cuts = [0]
    for i in range(1, len(lines)):
        size = offsets[i] - cuts[-1]
        if not blank[i] and (
            (paragraph_cut[i] and size >= min_chars) or size >= LINE_CUT_FACTOR * min_chars
        ):
            cuts.append(offsets[i])
    if len(cuts) > 1 and len(text) - cuts[-1] < min_chars / 2:
        cuts.pop()
    return cuts


def _random_text(rng: random.Random) -> str:
    pieces = []
    for _ in range(rng.randrange(1, 400)):
        kind = rng.random()
        if kind < 0.25:
            pieces.append(rng.choice(["\n", "  \n", "\t\n", "\r\n"]))
        else:
            width = rng.choice([3, 20, 60, 90, 300])
            pieces.append("".join(rng.choice("ab é,.;") for _ in range(rng.randrange(width))))
            pieces.append("\r\n" if kind > 0.95 else "\n")
    text = "".join(pieces)
    return text if rng.random() < 0.8 else text.rstrip("\n") + "x"


@pytest.mark.parametrize("seed", range(60))
def test_random_texts_match_the_reference_and_cover_the_text(seed: int) -> None:
    rng = random.Random(seed)
    text = _random_text(rng)
    min_chars = rng.choice([1, 50, 200, 1000])
    cuts = passage_cuts(text, min_chars)
    assert cuts == _reference_cuts(text, min_chars)
    parts = split_into_passages(Document("s", "T", text), min_chars)
    assert "".join(p.text for p in parts) == text
    assert [p.title for p in parts] == [f"T, passage {k}" for k in range(1, len(parts) + 1)]
    assert all(text[c - 1] == "\n" for c in cuts[1:])  # never inside a line
    assert all(len(p.text) >= min_chars for p in parts[:-1])
    assert len(parts) == 1 or len(parts[-1].text) >= min_chars / 2


def test_chapters_keep_their_heading() -> None:
    chapters = [
        f"Chapter {c}\n\n" + "".join(f"{c}:{v} verse text here.\n" for v in range(1, 6)) + "\n"
        for c in range(1, 7)
    ]
    text = "Genesis\n\n" + "".join(chapters)
    starts = [text.index(f"Chapter {c}\n") for c in range(1, 7)]
    # A chapter is 121-ish characters; each passage takes two chapters (the heading lines
    # "Genesis" and "Chapter N" never end a passage).
    assert len(chapters[0]) < 150 < len(chapters[0]) + len(chapters[1])
    assert passage_cuts(text, 150) == [0, starts[2], starts[4]]


def test_speeches_are_cut_between_speakers() -> None:
    speeches = [f"SPEAKER{i % 3}.\nA line of verse, number {i}.\nAnd more.\n\n" for i in range(12)]
    text = "".join(speeches)
    cuts = passage_cuts(text, 100)
    assert cuts[1:] and all(text[c:].startswith("SPEAKER") for c in cuts[1:])
    assert cuts == _reference_cuts(text, 100)


def test_text_without_blank_lines_is_cut_between_lines() -> None:
    line = "line without any paragraphs\n"
    assert len(line) == 28 and LINE_CUT_FACTOR == 4
    # Cut at the first line start at or after 4 * 20 = 80 characters: every 3 lines (84).
    assert passage_cuts(line * 100, 20) == [84 * k for k in range(34)]
    # 101 lines: the 2-line tail (56 >= 20 / 2 characters) stays a passage of its own...
    assert passage_cuts(line * 101, 20) == [84 * k for k in range(34)]
    # ...but a tail under min_chars / 2 joins the passage before it.
    assert passage_cuts(line * 99 + "end\n", 20) == [84 * k for k in range(33)]


def test_one_long_line_and_short_text_stay_whole() -> None:
    assert passage_cuts("x" * 10_000, 100) == [0]
    assert passage_cuts("short\n\ntext\n", 100) == [0]


@pytest.mark.parametrize("min_chars", [0, -1, True, 2.5])
def test_invalid_min_chars(min_chars: object) -> None:
    with pytest.raises(ValueError, match="min_chars"):
        passage_cuts("text\n", min_chars)  # type: ignore[arg-type]


def test_zero_keeps_whole_documents() -> None:
    docs = [Document("s", "a", "one\n\ntwo\n" * 50), Document("s", "b", "three\n")]
    assert split_all_into_passages(docs, 0) == docs
    parts = split_all_into_passages(docs, 20)
    assert [p.title for p in parts][-1] == "b, passage 1" and len(parts) > 3
    with pytest.raises(ValueError, match="min_chars"):
        split_all_into_passages(docs, -5)


def test_embedded_corpus_passages() -> None:
    docs = load_embedded_corpus()
    for doc in docs:
        parts = split_into_passages(doc, 2000)
        assert "".join(p.text for p in parts) == doc.text, doc.title
        assert all(len(p.text) >= 2000 for p in parts[:-1]), doc.title
        assert all(p.text.split("\n")[0].strip() for p in parts), doc.title  # non-blank
    kjv = [split_into_passages(d, 2000) for d in docs if d.source == "kjv"]
    # Bible passages start at a chapter heading, except where the chapter outgrew
    # LINE_CUT_FACTOR * 2000 characters and the passage before was cut between verses.
    for parts in kjv:
        for before, part in zip(parts, parts[1:]):
            assert part.text.startswith("Chapter ") or len(before.text) >= 8000, part.title
    assert sum(p.text.startswith("Chapter ") for parts in kjv for p in parts[1:]) > 900
