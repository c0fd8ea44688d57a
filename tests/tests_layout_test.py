"""Every test file sits where the chosen layout puts it (``docs/architecture.md``, "Tests").

- A test of a module sits beside it: ``nanoshampoo/<package>/tests/<name>_test.py``, the
  ``tests/`` folder directly inside a package (a folder with an ``__init__.py``).
- The top-level ``tests/`` holds only the checks of the whole project: the files and folders
  named in ``WHOLE_PROJECT``.
- No test folder has an ``__init__.py``, so pytest imports every test module by its bare name
  (the default ``prepend`` import mode); hence every test file and test helper module has a name
  no other one has.
- Test files sit nowhere else, and pytest's ``testpaths`` are exactly the two places above.
"""

from __future__ import annotations

import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The checks of the whole project: files directly in tests/, and folders of tests/ whose
# every file belongs there.
WHOLE_PROJECT = {
    "bench_scripts_test.py",  # every bench/ script runs
    "bench_peers_test.py",  # bench/peers.py with absent and fake peers
    "bench_train_mfu_test.py",  # bench/train_mfu.py on a run's own logs
    "bench_step_breakdown_test.py",  # bench/step_breakdown.py on a hand-built and a real trace
    "bench_train_compile_test.py",  # bench/train_compile*.py figures from logs and step times
    "bench_shampoo_floor_test.py",  # bench/shampoo_floor.py's work count and a tiny run
    "bench_study_throughput_test.py",  # bench/study_throughput.py on hand-built and real runs
    "bench_halving_replay_test.py",  # bench/halving_replay.py against real synchronous halving
    "docs_references_test.py",  # references into docs/ and the README resolve
    "docs_flags_test.py",  # flags, commands and make targets the docs name exist
    "docs_results_test.py",  # docs/results/ holds no history and no outside path
    "architecture_map_test.py",  # docs/architecture.md maps every module (tools/)
    "results_tables_test.py",  # docs/results/ tables equal their bench JSON (tools/)
    "docstring_examples_test.py",  # the examples in every docstring run
    "layers_test.py",  # imports point down the layers; file sizes
    "quick_coverage_test.py",  # make test-quick reaches every module
    "tests_layout_test.py",  # this file
    "bad_input",  # invalid input to every command and config
    "compat",  # the reference library's documented examples
}
# Top-level folders of tools and outputs, not of the project's sources.
SKIPPED_TOP = {".git", ".venv", ".hypothesis", "build", "runs", "logs", "data"}


def is_test_file(path: Path) -> bool:
    return path.suffix == ".py" and (path.stem.endswith("_test") or path.stem.startswith("test_"))


def python_files(root: Path) -> list[Path]:
    """Every ``.py`` file under ``root`` outside tool, cache and run-output folders."""
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] not in SKIPPED_TOP and "__pycache__" not in parts:
            found.append(path)
    return found


def misplaced(root: Path) -> list[str]:
    """Why each test file or test folder under ``root`` (a repository) breaks the layout."""
    problems = []
    for path in python_files(root):
        rel = path.relative_to(root)
        top = rel.parts[0]
        in_test_dir = top == "tests" or "tests" in rel.parts[:-1]
        if path.name == "__init__.py" and in_test_dir:
            problems.append(f"{rel}: a test folder has no __init__.py")
        elif not is_test_file(path):
            continue
        elif top == "nanoshampoo":
            if path.parent.name != "tests" or not (path.parent.parent / "__init__.py").exists():
                problems.append(f"{rel}: a package test sits in the tests/ folder of its package")
        elif top == "tests":
            if rel.parts[1] not in WHOLE_PROJECT:
                problems.append(f"{rel}: not a whole-project check; it belongs beside its module")
        else:
            problems.append(f"{rel}: tests sit in nanoshampoo/**/tests/ or tests/")
    return problems


def repeated_names(root: Path) -> list[str]:
    """Basenames shared by two test modules or test helper modules (``conftest.py`` aside)."""
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in python_files(root):
        rel = path.relative_to(root)
        in_test_dir = rel.parts[0] == "tests" or "tests" in rel.parts[:-1]
        if (in_test_dir or is_test_file(path)) and path.name not in {"conftest.py", "__init__.py"}:
            by_name[path.name].append(str(rel))
    return [
        f"{name}: {', '.join(paths)}" for name, paths in sorted(by_name.items()) if len(paths) > 1
    ]


def test_every_test_file_sits_in_the_layout() -> None:
    assert misplaced(ROOT) == []


def test_no_two_test_modules_share_a_name() -> None:
    assert repeated_names(ROOT) == []


def test_pytest_collects_exactly_the_two_test_roots() -> None:
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert options["testpaths"] == ["nanoshampoo", "tests"]
    assert options["python_files"] == ["*_test.py", "test_*.py"]
    assert "--import-mode" not in options.get("addopts", "")


def test_the_package_ships_no_tests() -> None:
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"][
        "find"
    ]
    assert {"*.tests", "*.tests.*"} <= set(find["exclude"])


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A repository in the layout: a package with a module and its test, one whole-project test."""
    for rel in (
        "nanoshampoo/__init__.py",
        "nanoshampoo/optim/__init__.py",
        "nanoshampoo/optim/adam.py",
        "nanoshampoo/optim/tests/adam_test.py",
        "nanoshampoo/optim/tests/conftest.py",
        "tests/layers_test.py",
        "tests/bad_input/bad_input_fixtures.py",
        "tests/bad_input/config_bad_input_test.py",
        "bench/step.py",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    return tmp_path


def test_the_checks_pass_a_tree_in_the_layout(tree: Path) -> None:
    assert misplaced(tree) == [] and repeated_names(tree) == []


@pytest.mark.parametrize(
    "rel, why",
    [
        ("tests/optim/adam_test.py", "not a whole-project check"),
        ("tests/adam_test.py", "not a whole-project check"),
        ("nanoshampoo/optim/adam_test.py", "tests/ folder of its package"),
        ("nanoshampoo/optim/tests/unit/adam_step_test.py", "tests/ folder of its package"),
        ("nanoshampoo/shampoo_tests/test_roots.py", "tests/ folder of its package"),
        ("nanoshampoo/optim/tests/__init__.py", "has no __init__.py"),
        ("tests/compat/__init__.py", "has no __init__.py"),
        ("bench/step_test.py", "tests sit in"),
    ],
)
def test_a_test_file_outside_the_layout_is_named(tree: Path, rel: str, why: str) -> None:
    (tree / rel).parent.mkdir(parents=True, exist_ok=True)
    (tree / rel).write_text("")
    (problem,) = misplaced(tree)
    assert problem.startswith(rel) and why in problem


@pytest.mark.parametrize(
    "rel",
    [
        "nanoshampoo/tests/adam_test.py",  # a test file
        "tests/compat/bad_input_fixtures.py",  # a helper module
    ],
)
def test_a_repeated_test_module_name_is_named(tree: Path, rel: str) -> None:
    (tree / rel).parent.mkdir(parents=True, exist_ok=True)
    (tree / rel).write_text("")
    (problem,) = repeated_names(tree)
    assert problem.startswith(Path(rel).name + ": ") and rel in problem
