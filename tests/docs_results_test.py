"""``docs/results/`` holds current answers, not a lab notebook (``docs/results/README.md``).

A results page names no session or run of the project's history ("session 9", "sessions 7-8",
"Run D", "run B's"), which stays in git, and no path outside the project (``/tmp/...``,
``/work/...``, a home folder, ``/path/to/...``): a command a reader copies works from the
project's root, with outside checkouts under the git-ignored ``runs/``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HISTORY = re.compile(r"\bsessions? \d|\b[Rr]un [A-Z]\b(?!\w)|\b[Rr]uns [A-Z] and [A-Z]\b")
OUTSIDE_PATH = re.compile(r"(?<![\w.:/])(/tmp/|/work/|/home/|/root/|/path/to/|~/)")


def problems(markdown: str) -> list[str]:
    """``line: text`` of every history marker or outside path in ``markdown``."""
    found = []
    for number, line in enumerate(markdown.splitlines(), 1):
        for pattern in (HISTORY, OUTSIDE_PATH):
            found.extend(f"{number}: {m.group(0)!r}" for m in pattern.finditer(line))
    return found


@pytest.mark.parametrize(
    "page",
    sorted((ROOT / "docs" / "results").rglob("*.md")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_a_results_page_has_no_history_and_no_outside_path(page: Path) -> None:
    assert problems(page.read_text()) == []


def test_the_markers_are_found() -> None:
    text = (
        "## Run D: an idle machine\n"
        "Earlier changes (sessions 7-8); in run B's table; in runs A and B\n"
        "git -C /work/.mirror/x archive | tar -x -C /tmp/peers; --dir /path/to/optimizers\n"
        "Run the bench; see https://example.org/tmp/x and runs/peers/ref; a Run of 3 seeds\n"
    )
    assert problems(text) == [
        "1: 'Run D'",
        "2: 'sessions 7'",
        "2: 'run B'",
        "2: 'runs A and B'",
        "3: '/work/'",
        "3: '/tmp/'",
        "3: '/path/to/'",
    ]
