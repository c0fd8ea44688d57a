"""Every docstring example of the ``nanoshampoo`` package runs and prints what it claims.

The modules are found by walking the package (``pkgutil.walk_packages``), so a new module is
covered without being listed here; there is one case per module. A case imports the module (an
import error fails it), finds its examples with ``doctest.DocTestFinder`` and runs them with
the module's globals, ``ELLIPSIS`` and ``NORMALIZE_WHITESPACE``. The only examples not run are
those marked ``# doctest: +SKIP``. Examples run in an empty temporary working directory, so that
relative paths never write into the checkout and the result does not depend on where pytest was
started.

Test modules inside the package (``*_test.py`` in ``tests/`` folders) are left to pytest itself.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import nanoshampoo

# Every module of this layer documents its use with at least one example.
_EXAMPLES_REQUIRED_UNDER = "nanoshampoo.optim.shampoo.utils."


def _is_test_module(name: str) -> bool:
    parts = name.split(".")
    in_test_package = "tests" in parts
    return in_test_package or parts[-1].endswith("_test") or parts[-1].startswith("test_")


def _walk_package() -> tuple[list[str], list[str]]:
    """``(module names, names of packages that failed to import while walking)``."""
    failed: list[str] = []
    names = [
        info.name
        for info in pkgutil.walk_packages(
            nanoshampoo.__path__, "nanoshampoo.", onerror=failed.append
        )
    ]
    return ["nanoshampoo", *names], failed


_MODULES, _WALK_FAILURES = _walk_package()


def test_the_walk_finds_every_layer_of_the_package() -> None:
    assert _WALK_FAILURES == [], f"packages that failed to import: {_WALK_FAILURES}"
    for expected in (
        "nanoshampoo.model.gpt",
        "nanoshampoo.optim.dist_adam",
        "nanoshampoo.optim.shampoo.distributed_shampoo",
        "nanoshampoo.optim.shampoo.preconditioner.shampoo_preconditioner",
        "nanoshampoo.optim.shampoo.utils.shampoo_utils",
        "nanoshampoo.train.config",
        "nanoshampoo.evidence.stats",
        "nanoshampoo.data.shards",
    ):
        assert expected in _MODULES


@pytest.mark.parametrize(
    "name",
    [name for name in _MODULES if not _is_test_module(name)],
)
def test_docstring_examples(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(name)
    tests = [test for test in doctest.DocTestFinder().find(module) if test.examples]
    if name.startswith(_EXAMPLES_REQUIRED_UNDER):
        assert tests, f"{name} has no docstring examples"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    for test in tests:
        runner.run(test, out=report.append)
    failed = f"{runner.failures} docstring example(s) of {name} failed:\n"
    assert runner.failures == 0, failed + "".join(report)
