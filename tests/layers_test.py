"""The package's layers point one way, its modules import each other in no cycle, and its
files stay small.

Layers, lowest first (``docs/architecture.md``, "Layers"): the foundation (the root package,
``io_utils``, ``errors``, ``matmul_speed``, ``validation``, ``testing``), ``optim``, ``model``,
``data``, ``train``, ``evidence``, ``cli``
(``nanoshampoo/cli.py`` and ``__main__.py``). A module may import from its own layer or a lower
one. Every ``import`` statement counts, also those inside functions (a lazy import is still a
dependency). The imports are read with ``ast``, so nothing is executed. Test modules in the
package (``<package>/tests/``) are exempt (``docs/architecture.md``, "Tests").
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nanoshampoo"
LAYERS = ("foundation", "optim", "model", "data", "train", "evidence", "cli")
# Top-level names of the package and their layer; a new top-level module or package must be
# placed here (the test below fails on one that is not).
LAYER_OF = {
    "": "foundation",
    "io_utils": "foundation",
    "errors": "foundation",
    "matmul_speed": "foundation",
    "validation": "foundation",
    "testing": "foundation",
    "optim": "optim",
    "model": "model",
    "data": "data",
    "train": "train",
    "evidence": "evidence",
    "cli": "cli",
    "__main__": "cli",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool) -> list[str]:
    """Absolute names of every module that ``source``, the text of ``module``, imports
    (relative imports resolved; ``is_package``: the text is the module's ``__init__.py``)."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            names.append(".".join(base + ([node.module] if node.module else [])))
    return names


def layer(module: str) -> str:
    """The layer of a ``nanoshampoo`` module name (KeyError: an unplaced top-level name)."""
    parts = module.split(".")
    return LAYER_OF[parts[1] if len(parts) > 1 else ""]


def package_files() -> list[Path]:
    """The package's code modules. Test modules (everything in a ``tests/`` folder beside a
    module) are exempt from both rules: a specification may drive any layer (the evidence tests
    run the ``nanoshampoo`` command), and no module imports a test."""
    return sorted(p for p in PACKAGE.rglob("*.py") if "tests" not in p.relative_to(PACKAGE).parts)


def upward_imports(path: Path) -> list[str]:
    own = LAYERS.index(layer(module_name(path)))
    return [
        f"{module_name(path)} ({layer(module_name(path))}) imports {name} ({layer(name)})"
        for name in imported_modules(
            path.read_text(), module_name(path), path.name == "__init__.py"
        )
        if (name == "nanoshampoo" or name.startswith("nanoshampoo."))
        and LAYERS.index(layer(name)) > own
    ]


def test_every_top_level_module_has_a_layer() -> None:
    tops = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in package_files()}
    tops = {"" if top == "__init__" else top for top in tops}
    assert sorted(tops - set(LAYER_OF)) == []


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_higher_layer(path: Path) -> None:
    assert upward_imports(path) == []


def test_the_check_sees_relative_and_lazy_imports() -> None:
    """The checker itself, on the inversion this project once had (train -> evidence)."""
    source = (
        "from ..evidence import traces\n"
        "from . import schedule\n"
        "def later():\n"
        "    import nanoshampoo.cli\n"
        "from nanoshampoo.optim import collectives\n"
    )
    names = imported_modules(source, "nanoshampoo.train.probe", is_package=False)
    assert sorted(names) == [
        "nanoshampoo.cli",
        "nanoshampoo.evidence",
        "nanoshampoo.optim",
        "nanoshampoo.train",
    ]
    higher = {n for n in names if LAYERS.index(layer(n)) > LAYERS.index("train")}
    assert higher == {"nanoshampoo.cli", "nanoshampoo.evidence"}
    assert imported_modules("from . import x", "nanoshampoo.train", is_package=True) == [
        "nanoshampoo.train"
    ]


# A function's length is counted in statements (every statement node inside it, nested ones
# included), which the formatter cannot change, rather than in physical lines. The functions
# allowed past the limit, each with a comment in its body saying why it stays long.
LONG_FUNCTIONS = {
    ("train/config.py", "__post_init__"),
}
MAX_FUNCTION_STATEMENTS = 45


def statements(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    return sum(isinstance(node, ast.stmt) for node in ast.walk(function)) - 1


def long_functions() -> set[tuple[str, str]]:
    found = set()
    for path in package_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if statements(node) > MAX_FUNCTION_STATEMENTS:
                    found.add((path.relative_to(PACKAGE).as_posix(), node.name))
    return found


def test_the_statement_count_counts_nested_statements_and_not_lines() -> None:
    tree = ast.parse(
        "def f(x):\n    if x:\n        y = (\n            1\n        )\n    return x\n"
    )
    assert statements(tree.body[0]) == 3


def test_at_most_three_functions_are_over_45_statements_and_each_is_named_here() -> None:
    assert len(LONG_FUNCTIONS) <= 3
    assert long_functions() <= LONG_FUNCTIONS, sorted(long_functions() - LONG_FUNCTIONS)


# --- No import cycle anywhere in the package -----------------------------------------------
# Every import statement counts, lazy ones and those under ``if TYPE_CHECKING:`` included: a
# cycle that only runs lazily is still two modules that cannot be read, or changed, apart.
# ``from package import name`` depends on the submodule ``package.name`` when there is one, else
# on the package; a module's implicit import of its parent package is not an edge (Python runs
# the parent first, which is no cycle of the code's making).


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` (under ``root``) it imports; test modules out."""
    paths = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (root / package).rglob("*.py")
        if "tests" not in p.relative_to(root / package).parts
    }
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        is_package = path.name == "__init__.py"
        base = module.split(".") if is_package else module.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                parent = base[: len(base) - node.level + 1] if node.level else []
                source = ".".join(parent + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.add(sub if sub in paths else source)
        graph[module] = {t for t in targets if t in paths and t != module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (each sorted), found by Tarjan's
    algorithm: each is at least one cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            members = []
            while True:
                member = stack.pop()
                members.append(member)
                if member == module:
                    break
            if len(members) > 1:
                cycles.append(sorted(members))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(cycles)


def test_no_import_cycle_in_the_package() -> None:
    graph = import_graph(PACKAGE.parent, "nanoshampoo")
    assert "nanoshampoo.train.setups" in graph["nanoshampoo.train.config"]
    assert import_cycles(graph) == []


def test_the_cycle_check_sees_lazy_type_checking_and_from_package_imports(
    tmp_path: Path,
) -> None:
    """The checker itself: a cycle through a lazy import, one through ``TYPE_CHECKING``, one
    through ``from package import module``; and an acyclic chain that is not one."""
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "def later():\n    from pkg import b\n",
        "pkg/b.py": "from . import a\n",
        "pkg/c.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.d import X\n"
        ),
        "pkg/d.py": "from pkg.sub import e\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/e.py": "from ..c import Y\n",
        "pkg/f.py": "import pkg.a\nfrom pkg.sub import e\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.f"] == {"pkg.a", "pkg.sub.e"}
    assert import_cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d", "pkg.sub.e"]]
