"""``docs/architecture.md`` maps every module of the package, as ``tools/architecture_map.py``
writes the map from the module docstrings, and every module file the page names exists."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location(
    "architecture_map", ROOT / "tools" / "architecture_map.py"
)
assert SPEC is not None and SPEC.loader is not None
architecture_map = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(architecture_map)


def test_the_module_map_is_what_the_docstrings_say() -> None:
    page = architecture_map.PAGE.read_text()
    table = architecture_map.render(ROOT / "nanoshampoo", ROOT)
    assert page == architecture_map.replace_map(page, table), (
        "docs/architecture.md's module map is out of date: run python tools/architecture_map.py"
    )


def test_every_module_of_the_package_is_in_the_map() -> None:
    page = architecture_map.PAGE.read_text()
    mapped = page.split(architecture_map.BEGIN, 1)[1].split(architecture_map.END, 1)[0]
    folder = None
    listed = set()
    for line in mapped.splitlines():
        if re.fullmatch(r"`nanoshampoo/[\w/]*`", line):
            folder = line.strip("`")
        elif (match := re.match(r"\| `(\w+\.py)` \|", line)) and folder is not None:
            listed.add(folder + match.group(1))
    wanted = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "nanoshampoo").rglob("*.py")
        if "tests" not in path.parts
    }
    assert wanted - listed == set()
    assert listed - wanted == set()


def test_every_module_file_the_page_names_exists() -> None:
    """A ``name.py`` in the hand-written parts (the layers, the step, the behaviour table) is a
    file of the package, ``bench/``, ``tools/`` or ``tests/``."""
    page = architecture_map.PAGE.read_text().split(architecture_map.BEGIN, 1)[0]
    files = {
        path.name
        for top in ("nanoshampoo", "bench", "tools", "tests")
        for path in (ROOT / top).rglob("*.py")
    }
    named = set(re.findall(r"(?<![\w.-])([\w]+\.py)\b", page))
    assert named - files == set()


def test_a_module_without_a_docstring_is_named(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub" / "tests").mkdir(parents=True)
    (package / "__init__.py").write_text('"""The package:\nits summary.\n\nMore."""\n')
    (package / "sub" / "__init__.py").write_text('"""See :mod:`~pkg.sub.a`, a | b."""\n')
    (package / "sub" / "tests" / "a_test.py").write_text("")
    assert architecture_map.render(package, tmp_path) == (
        "`pkg/`\n\n| module | what it holds |\n|---|---|\n"
        "| `__init__.py` | The package: its summary. |\n\n"
        "`pkg/sub/`\n\n| module | what it holds |\n|---|---|\n"
        "| `__init__.py` | See `a`, a \\| b. |\n"
    )
    (package / "sub" / "b.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match=r"b\.py: no module docstring"):
        architecture_map.render(package, tmp_path)


def test_the_map_replaces_only_its_section() -> None:
    begin, end = architecture_map.BEGIN, architecture_map.END
    page = f"# A\n\n{begin}\nold\n{end}\n\n## B\n"
    assert (
        architecture_map.replace_map(page, "new\n") == f"# A\n\n{begin}\n\nnew\n\n{end}\n\n## B\n"
    )
    with pytest.raises(ValueError, match="expected one"):
        architecture_map.replace_map("# A\n", "new\n")
