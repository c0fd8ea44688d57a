"""``docs/results/`` holds current answers, not a lab notebook (``docs/results/README.md``).

A results page names no session or run of the project's history ("session 9", "this session",
"Run D", "run B's"), which stays in git, and no path outside the project (``/tmp/...``,
``/work/...``, a home folder, ``/path/to/...``): a command a reader copies works from the
project's root, with outside checkouts under the git-ignored ``runs/``.

Every table names its command, commit, machine and date: in its own section (the text from its
heading to the next heading) or in the introduction of a section above it (the text between
that heading and its first subheading), where one statement covers the tables below it. An
unknown one is said so ("commit unknown", "machine not recorded", "command not recorded").
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Pages whose tables are not this project's measurements, and where their provenance lives.
NOT_MEASURED = {
    # The equations' sources and the settings published elsewhere, quoted.
    "docs/results/field-optimizers.md": None,
    # Written by `nanoshampoo study`; its command, commit, machine and date are in the README.
    "docs/results/study/study.md": "docs/results/study/README.md",
}
HEADING = re.compile(r"^(#{1,6}) ")
TABLE_RULE = re.compile(r"^\|[-:| ]+\|\s*$")
PROVENANCE = {
    "command": re.compile(
        r"```|`(?:make|python|PYTHONPATH=\S+ python|nanoshampoo|bash) |command\s+not\s+recorded"
    ),
    "commit": re.compile(r"\b[Cc]ommits?\s+(?:[0-9a-f]{7,40}|unknown)\b"),
    "machine": re.compile(r"\bAMD EPYC\b|\bIntel\b|\bXeon\b|\bNVIDIA\b|machine\s+not\s+recorded"),
    "date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
}
HISTORY = re.compile(
    r"\bsessions? \d|\b(?:this|same|earlier|last|previous) session\b|\b[Ee]arlier changes\b"
    r"|\b[Rr]un [A-Z]\b(?!\w)|\b[Rr]uns [A-Z] and [A-Z]\b"
)
OUTSIDE_PATH = re.compile(r"(?<![\w.:/])(/tmp/|/work/|/home/|/root/|/path/to/|~/)")


def problems(markdown: str) -> list[str]:
    """``line: text`` of every history marker or outside path in ``markdown``."""
    found = []
    for number, line in enumerate(markdown.splitlines(), 1):
        for pattern in (HISTORY, OUTSIDE_PATH):
            found.extend(f"{number}: {m.group(0)!r}" for m in pattern.finditer(line))
    return found


def headings(lines: list[str]) -> list[tuple[int, int]]:
    """``(line index, level)`` of every Markdown heading outside code fences; the page's start
    counts as a level-0 heading."""
    found, fenced = [(0, 0)], False
    for index, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := HEADING.match(line)):
            found.append((index, len(match.group(1))))
    return found


def unsourced_tables(markdown: str) -> list[str]:
    """``heading: missing items`` of every section whose tables lack a command, commit, machine
    or date, in the section or in the introduction of a section above it."""
    lines = markdown.splitlines()
    heads = headings(lines)
    ends = [start for start, _ in heads[1:]] + [len(lines)]
    found = []
    for k, ((start, level), end) in enumerate(zip(heads, ends)):
        if not any(TABLE_RULE.match(line) for line in lines[start:end]):
            continue
        text = lines[start:end]
        for j in range(k - 1, -1, -1):  # the introductions of the sections above
            if heads[j][1] < level:
                level = heads[j][1]
                text += lines[heads[j][0] : heads[j + 1][0]]
        missing = [
            name for name, pattern in PROVENANCE.items() if not pattern.search("\n".join(text))
        ]
        if missing:
            title = lines[start] if HEADING.match(lines[start]) else "(top)"
            found.append(f"{title}: {missing}")
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
        "Earlier changes (sessions 7-8); in run B's table; in runs A and B; this session's\n"
        "git -C /work/.mirror/x archive | tar -x -C /tmp/peers; --dir /path/to/optimizers\n"
        "Run the bench; see https://example.org/tmp/x and runs/peers/ref; a Run of 3 seeds\n"
    )
    assert problems(text) == [
        "1: 'Run D'",
        "2: 'Earlier changes'",
        "2: 'sessions 7'",
        "2: 'run B'",
        "2: 'runs A and B'",
        "2: 'this session'",
        "3: '/work/'",
        "3: '/tmp/'",
        "3: '/path/to/'",
    ]


@pytest.mark.parametrize(
    "page",
    sorted(
        path
        for path in (ROOT / "docs" / "results").rglob("*.md")
        if str(path.relative_to(ROOT)) not in NOT_MEASURED
    ),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_table_names_its_command_commit_machine_and_date(page: Path) -> None:
    assert unsourced_tables(page.read_text()) == []


@pytest.mark.parametrize("source", sorted(s for s in NOT_MEASURED.values() if s))
def test_a_generated_page_has_its_provenance_beside_it(source: str) -> None:
    text = (ROOT / source).read_text()
    assert [name for name, pattern in PROVENANCE.items() if not pattern.search(text)] == []


def test_a_table_without_its_provenance_is_named() -> None:
    text = (
        "# Page\n\nCommit abcdef1, 2026-12-01, the 2-core AMD EPYC.\n\n"
        "## Covered by the page's introduction\n\n`make compare`\n\n| a |\n|---|\n| 1 |\n\n"
        "## Lacks the command\n\n| a |\n|---|\n| 1 |\n\n"
        "## Own provenance\n\n### Below it\n\nCommit unknown, 2026-01-02, machine not recorded,"
        " command not recorded.\n\n| a |\n|---|\n| 1 |\n"
    )
    assert unsourced_tables(text) == ["## Lacks the command: ['command']"]
    bare = "# Page\n\n```\n# not a heading\n```\n\n| a |\n|---|\n| 1 |\n"
    assert unsourced_tables(bare) == ["# Page: ['commit', 'machine', 'date']"]
