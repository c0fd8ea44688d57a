"""Cut long documents (a play, a Bible book, a text file) into passages of moderate size.

A passage becomes its own document (prefixed with the end-of-text token), like a web page in
FineWeb, so the validation set can be a random sample of passages from every work and the
training stream can interleave many works instead of reading one work for tens of thousands
of tokens.

The rule is language-agnostic and works on lines (split at ``"\\n"``); a cut always falls at
the start of a line, so no line is ever divided, and concatenating the passages of a document
gives its text back exactly:

* A *paragraph* starts at a non-blank line that follows a blank (whitespace-only) line.
* A passage ends before the first paragraph start at which it holds at least ``min_chars``
  characters, so passages end at speech, stanza, chapter or paragraph boundaries.
* No cut is made right after a paragraph that is a single line of under
  ``HEADING_MAX_CHARS`` characters: such a line is most likely a heading (``Chapter 3``,
  ``SCENE 2. A room in the palace.``, a sonnet's number) and stays with what it introduces.
* Where no such boundary comes soon enough (a long Bible chapter, text without blank
  lines), the passage ends before the first non-blank line at which it holds at least
  ``LINE_CUT_FACTOR * min_chars`` characters.
* A last passage shorter than ``min_chars / 2`` joins the one before it, so only the last
  passage of a document may be under ``min_chars``, and then only when it is at least half
  of it or the document's only passage. A single line longer than everything else stays
  whole, however long.

Example:
    >>> doc = Document("demo", "Tale", "".join(f"Para {i}.\\nMore.\\n\\n" for i in range(30)))
    >>> parts = split_into_passages(doc, min_chars=100)
    >>> [p.title for p in parts[:2]], "".join(p.text for p in parts) == doc.text
    (['Tale, passage 1', 'Tale, passage 2'], True)
    >>> min(len(p.text) for p in parts[:-1]) >= 100
    True
"""

from __future__ import annotations

from collections.abc import Sequence

from nanoshampoo.data.documents import Document
from nanoshampoo.validation import check_int

# A one-line paragraph shorter than this is treated as a heading of the text after it.
HEADING_MAX_CHARS = 80
# Passages grow to this many times min_chars before a cut between lines of one paragraph:
# large enough that most Bible chapters and long speeches stay whole.
LINE_CUT_FACTOR = 4


def _line_starts(text: str) -> list[int]:
    """Offsets at which lines begin (the first character after each ``"\\n"``), from 0."""
    starts = [0]
    position = text.find("\n")
    while 0 <= position < len(text) - 1:
        starts.append(position + 1)
        position = text.find("\n", position + 1)
    return starts


def passage_cuts(text: str, min_chars: int) -> list[int]:
    """Offsets where passages start by the module's rule: ``[0, c1, c2, ...]``, increasing,
    each a line start. ``min_chars`` must be positive."""
    check_int("min_chars", min_chars, at_least=1)
    starts = _line_starts(text)
    ends = starts[1:] + [len(text)]
    cuts = [0]
    previous_blank = False
    # The paragraph just before the current line: its number of lines and first line length.
    paragraph_lines = 0
    paragraph_first_line = 0
    for start, end in zip(starts, ends):
        blank = not text[start:end].strip()
        size = start - cuts[-1]
        if not blank and start > 0:
            heading = paragraph_lines == 1 and paragraph_first_line < HEADING_MAX_CHARS
            # Blank lines alone before this line are no paragraph to end a passage with.
            at_paragraph = previous_blank and paragraph_lines > 0 and not heading
            if (at_paragraph and size >= min_chars) or size >= LINE_CUT_FACTOR * min_chars:
                cuts.append(start)
        if blank:
            previous_blank = True
        elif previous_blank or paragraph_lines == 0:
            paragraph_lines, paragraph_first_line = 1, end - start
            previous_blank = False
        else:
            paragraph_lines += 1
    if len(cuts) > 1 and len(text) - cuts[-1] < min_chars / 2:
        cuts.pop()
    return cuts


def split_into_passages(document: Document, min_chars: int) -> list[Document]:
    """The passages of ``document`` (same ``source``; titles ``"<title>, passage <k>"``
    numbered from 1), whose texts concatenate to ``document.text``."""
    cuts = passage_cuts(document.text, min_chars)
    bounds = zip(cuts, cuts[1:] + [len(document.text)])
    return [
        Document(document.source, f"{document.title}, passage {k}", document.text[a:b])
        for k, (a, b) in enumerate(bounds, start=1)
    ]


def split_all_into_passages(documents: Sequence[Document], min_chars: int) -> list[Document]:
    """Every document's passages, in document order then text order; ``min_chars == 0``
    keeps each document whole (unchanged, title included)."""
    check_int("min_chars (0: whole documents)", min_chars, at_least=0)
    if min_chars == 0:
        return list(documents)
    return [passage for doc in documents for passage in split_into_passages(doc, min_chars)]
