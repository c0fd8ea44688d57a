"""Write the module map of ``docs/architecture.md`` from the package's module docstrings.

The map lists every module of ``nanoshampoo/`` (test folders aside), package by package, with
the summary its docstring opens with (the first paragraph, joined into one line). It sits in
``docs/architecture.md`` between the ``BEGIN`` and ``END`` marker lines, and nobody edits it by
hand: a module's summary is changed in the module, then this script rewrites the map.
``tests/architecture_map_test.py`` fails while the page differs from what this script writes.

Usage (from the project's root)::

    python tools/architecture_map.py          # rewrite the map in docs/architecture.md
    python tools/architecture_map.py --check  # exit 1 if the map is out of date
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

from nanoshampoo.io_utils import atomic_output

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
BEGIN = "<!-- module map: written by tools/architecture_map.py from the module docstrings -->"
END = "<!-- end of module map -->"
ROLE = re.compile(r":\w+:`(~?)([^`]+)`")


def modules(package: Path) -> list[Path]:
    """The package's ``.py`` files outside ``tests/`` folders, sorted by path."""
    return sorted(
        path
        for path in package.rglob("*.py")
        if "tests" not in path.relative_to(package).parts and "__pycache__" not in path.parts
    )


def summary(path: Path) -> str:
    """The first paragraph of ``path``'s module docstring, on one line (``ValueError``: none)."""
    doc = ast.get_docstring(ast.parse(path.read_text(), filename=str(path)))
    if not doc or not doc.strip():
        raise ValueError(f"{path}: no module docstring (its first paragraph is its map entry)")
    paragraph = doc.strip().split("\n\n", 1)[0]
    line = " ".join(part.strip() for part in paragraph.splitlines())
    # Sphinx roles read as plain code here: :mod:`~a.b.c` -> `c`, :class:`a.B` -> `a.B`.
    return ROLE.sub(
        lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", line
    )


def render(package: Path, root: Path) -> str:
    """The map: one table per package folder, ``| module | what it holds |``."""
    by_folder: dict[Path, list[Path]] = {}
    for path in modules(package):
        by_folder.setdefault(path.parent, []).append(path)
    parts = []
    for folder, paths in by_folder.items():
        parts.append(f"`{folder.relative_to(root).as_posix()}/`\n")
        parts.append("| module | what it holds |\n|---|---|")
        for path in paths:
            text = summary(path).replace("|", "\\|")
            parts.append(f"| `{path.name}` | {text} |")
        parts.append("")
    return "\n".join(parts)


def replace_map(page_text: str, table: str) -> str:
    """``page_text`` with the text between its ``BEGIN`` and ``END`` lines set to ``table``."""
    if page_text.count(BEGIN) != 1 or page_text.count(END) != 1:
        raise ValueError(f"{PAGE.name}: expected one {BEGIN!r} line and one {END!r} line")
    head, rest = page_text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n\n{table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the map is out of date")
    args = parser.parse_args(argv)
    current = PAGE.read_text()
    wanted = replace_map(current, render(ROOT / "nanoshampoo", ROOT))
    if args.check:
        if wanted != current:
            print(f"{PAGE.relative_to(ROOT)}: the module map is out of date; run {__file__}")
            return 1
        return 0
    if wanted != current:
        with atomic_output(PAGE) as tmp:
            tmp.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
