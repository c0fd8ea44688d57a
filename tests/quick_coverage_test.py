"""``make test-quick`` reaches every module of the package.

The quick tests are the ones the Makefile's ``test-quick`` selects (its ``-m`` expression: not
``slow``, not ``distributed``). A module is reached when a file holding a quick test imports
it, or when a module so reached imports it, at its top or inside a function (the optimizer
imports its distributors and preconditioners where it builds them). The test helpers and the
``conftest.py`` files a test file sees count as part of it. A module without code (a folder of
data files and a docstring) has nothing to reach. The imports are read from the sources, so the
answer does not depend on which tests ran before this one.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "nanoshampoo"
# The markers test-quick leaves out (its -m expression is checked to say exactly this).
SLOW_MARKS = ("slow", "distributed")
QUICK = "not slow and not distributed"


def quick_expression() -> str:
    """The ``-m`` expression of the Makefile's ``test-quick`` recipe."""
    recipe = re.search(r"^test-quick:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert recipe is not None, "the Makefile has no test-quick recipe"
    marks = re.search(r'-m "([^"]+)"', recipe.group(1))
    assert marks is not None, f"test-quick selects no markers: {recipe.group(1)}"
    return marks.group(1)


def package_modules() -> dict[str, Path]:
    """Every module of the package outside its test folders: dotted name -> source file."""
    modules = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if "tests" in parts:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def holds_code(path: Path) -> bool:
    """Whether the module has a statement besides its docstring."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return any(
        not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) for node in body
    )


def imported_names(path: Path, package: str) -> set[str]:
    """Dotted names the file imports anywhere in it (``from a import b`` gives ``a`` and
    ``a.b``), relative imports resolved against ``package``, the file's own package."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return names


def reached(names: set[str], modules: dict[str, Path]) -> set[str]:
    """The package modules ``names`` import (each with its parent packages), closed under the
    imports of the modules themselves."""
    found: set[str] = set()
    todo = sorted(names)
    while todo:
        parts = todo.pop().split(".")
        for end in range(1, len(parts) + 1):
            name = ".".join(parts[:end])
            if name in modules and name not in found:
                found.add(name)
                path = modules[name]
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                todo += imported_names(path, package)
    return found


def imports_of_test_file(test_file: Path) -> set[str]:
    """What a test file imports, with the helpers beside it that it imports by their bare
    names and the ``conftest.py`` files of its folder and the folders above it."""
    names: set[str] = set()
    files = [test_file] + [
        folder / "conftest.py"
        for folder in [test_file.parent, *test_file.parent.parents]
        if folder.is_relative_to(ROOT) and (folder / "conftest.py").is_file()
    ]
    seen: set[Path] = set()
    while files:
        path = files.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in imported_names(path, ""):
            helper = path.parent / f"{name}.py"
            if "." not in name and helper.is_file():
                files.append(helper)
            names.add(name)
        names |= programs(path)
    return names


def programs(path: Path) -> set[str]:
    """The package's modules the file runs as programs: a string that is a dotted name in the
    package (``[sys.executable, "-m", "nanoshampoo.train"]``) runs its ``__main__``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(rf"{PACKAGE}(\.\w+)*", node.value):
                names |= {node.value, f"{node.value}.__main__"}
    return names


def collected_whole_suite(config: pytest.Config, quick: str) -> bool:
    """Whether this session collected every test of ``testpaths``, selected at most by the
    quick expression (``make test`` or ``make test-quick``)."""
    testpaths = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"
    ]["testpaths"]
    args = {(config.rootpath / arg).resolve() for arg in config.args}
    return (
        args == {ROOT / path for path in testpaths}
        and config.option.markexpr in ("", quick)
        and not config.option.keyword
        and not config.option.deselect
    )


def quick_test_files(request: pytest.FixtureRequest, quick: str) -> set[Path]:
    """The files holding a quick test: from this session's own collection when it collected the
    whole suite, else from a collection of the quick tests."""
    if collected_whole_suite(request.config, quick):
        return {
            Path(item.path)
            for item in request.session.items
            if not any(item.get_closest_marker(mark) for mark in SLOW_MARKS)
        }
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + ["-m", quick],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return {ROOT / line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}


def test_the_quick_tests_reach_every_module(request: pytest.FixtureRequest) -> None:
    quick = quick_expression()
    assert quick == QUICK
    modules = package_modules()
    files = quick_test_files(request, quick)
    assert len(files) > 100  # a collection that went wrong is not an answer
    names = set().union(*(imports_of_test_file(path) for path in files))
    missing = {name for name, path in modules.items() if holds_code(path)} - reached(names, modules)
    assert not missing, f"modules no quick test reaches: {sorted(missing)}"


def test_an_unreached_module_is_named(tmp_path: Path) -> None:
    """The closure follows imports and nothing else: a module nobody imports stays out."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""A package."""\n')
    (package / "a.py").write_text("def f():\n    from . import b\n")
    (package / "b.py").write_text("import os\n")
    (package / "c.py").write_text("X = 1\n")
    modules = {"pkg": package / "__init__.py"} | {f"pkg.{n}": package / f"{n}.py" for n in "abc"}
    assert reached({"pkg.a"}, modules) == {"pkg", "pkg.a", "pkg.b"}
    assert not holds_code(package / "__init__.py") and holds_code(package / "c.py")
