"""Every reference into the documentation names a file and a heading that exist.

References are written ``README "Heading"``, ``docs/path.md "Heading"`` or a bare ``docs/path``
(a file or a folder), in the package's code and presets, in ``bench/``, the Makefile and CI
(the quoted heading may start on the next line, after a ``#`` or the docstring's indent).
A heading matches when it is a Markdown heading of that file, ``#`` marks stripped, exactly.
The README and every page under ``docs/`` must also have no relative Markdown link to a file
that does not exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# `docs/...` not preceded by a word, slash or dot (so no URL like https://pytorch.org/docs/...).
REFERENCE = re.compile(
    r"(?<![\w/.])(README(?:\.md)?|docs/[\w./-]*[\w/])"
    r'(?:[ \t]*\n?[ \t]*#?[ \t]*"([^"\n]+)")?'
)
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)


def referring_files() -> list[Path]:
    files = [ROOT / "Makefile", ROOT / ".ci" / "run"]
    for pattern in ("nanoshampoo/**/*.py", "nanoshampoo/**/*.toml", "bench/**/*"):
        files.extend(p for p in ROOT.glob(pattern) if p.is_file() and p.suffix != ".pyc")
    return sorted(f for f in files if f.exists())


def references(text: str) -> list[tuple[str, str | None]]:
    """``(target, heading or None)`` for every documentation reference in ``text``.

    A bare ``README`` (no quoted heading after it) is not a reference: the word is also used
    for other folders' READMEs.
    """
    found = []
    for match in REFERENCE.finditer(text):
        target, heading = match.group(1), match.group(2)
        if target.startswith("README") and heading is None:
            continue
        found.append(("README.md" if target.startswith("README") else target, heading))
    return found


def headings(markdown: str) -> set[str]:
    """The heading texts of a Markdown file, outside fenced code blocks."""
    outside = re.sub(r"^```.*?^```", "", markdown, flags=re.MULTILINE | re.DOTALL)
    return {m.group(1) for m in HEADING.finditer(outside)}


def broken(target: str, heading: str | None, root: Path = ROOT) -> str | None:
    """Why ``(target, heading)`` does not resolve under ``root``, or None when it does."""
    path = root / target
    if not path.exists():
        return f"{target} does not exist"
    if heading is None:
        return None
    if not path.is_file():
        return f"{target} is a folder, it has no heading {heading!r}"
    if heading not in headings(path.read_text()):
        return f"{target} has no heading {heading!r}"
    return None


@pytest.mark.parametrize("path", referring_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documentation_reference_resolves(path: Path) -> None:
    problems = [
        f"{why} (referenced as {target} {heading!r})"
        for target, heading in references(path.read_text(errors="replace"))
        if (why := broken(target, heading)) is not None
    ]
    assert problems == []


def documentation_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", documentation_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_of_the_documentation_resolves(page: Path) -> None:
    links = [m.group(1).split("#")[0] for m in MARKDOWN_LINK.finditer(page.read_text())]
    relative = [link for link in links if link and "://" not in link]
    assert [link for link in relative if not (page.parent / link).exists()] == []


def test_the_references_the_code_uses_are_found() -> None:
    text = (
        '# tuned (docs/results/leaderboard.md "Tuning"): 0.003\n'
        "# see docs/results/shampoo-state.md\n"
        '# "Which bf16 state costs loss?".\n'
        '    Measured: README "Performance of a Shampoo step".\n'
        "    See the corpus README here; https://pytorch.org/docs/stable/ is not ours.\n"
        "    Folder: docs/results/.\n"
    )
    assert references(text) == [
        ("docs/results/leaderboard.md", "Tuning"),
        ("docs/results/shampoo-state.md", "Which bf16 state costs loss?"),
        ("README.md", "Performance of a Shampoo step"),
        ("docs/results/", None),
    ]


def test_a_missing_file_or_heading_is_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "# Page\n\n## Tuning\n\n```bash\n# not a heading\n```\n"
    )
    assert broken("docs/page.md", "Tuning", tmp_path) is None
    assert broken("docs/page.md", "Page", tmp_path) is None
    assert broken("docs/page.md", "not a heading", tmp_path) == (
        "docs/page.md has no heading 'not a heading'"
    )
    assert broken("docs/page.md", "Tun", tmp_path) == "docs/page.md has no heading 'Tun'"
    assert broken("docs/other.md", None, tmp_path) == "docs/other.md does not exist"
    assert broken("docs", "Tuning", tmp_path) == "docs is a folder, it has no heading 'Tuning'"
