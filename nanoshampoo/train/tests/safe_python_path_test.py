"""A file in the working directory never shadows a library: the trainer's re-exec and the
trainers that the evidence tools start run with ``PYTHONSAFEPATH`` and this package's own
folder on ``PYTHONPATH`` (``allocator.safe_python_environment``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import nanoshampoo
from nanoshampoo.train.allocator import safe_python_environment

CONSOLE_SCRIPT = Path(sys.executable).parent / "nanoshampoo"


def test_the_environment_keeps_the_users_paths_after_this_package() -> None:
    root = str(Path(nanoshampoo.__file__).resolve().parents[1])
    env = safe_python_environment({"PYTHONPATH": os.pathsep.join(["/a", root, "/b"]), "HOME": "/h"})
    assert env["PYTHONSAFEPATH"] == "1" and env["HOME"] == "/h"
    assert env["PYTHONPATH"].split(os.pathsep) == [root, "/a", "/b"]  # the package once, first


@pytest.mark.slow  # the trainer's process imports torch twice (its re-exec is the point)
@pytest.mark.skipif(
    not CONSOLE_SCRIPT.exists(),
    reason="the package's console script is not installed beside this Python",
)
def test_a_tqdm_py_in_the_working_directory_is_not_run_by_nanoshampoo_train(tmp_path: Path) -> None:
    (tmp_path / "tqdm.py").write_text('raise SystemExit("the working directory\'s tqdm.py ran")\n')
    done = subprocess.run(
        [str(CONSOLE_SCRIPT), "train", "--preset", "tiny-adamw", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "PYTHONSAFEPATH"))
        },
    )
    assert done.returncode == 0, done.stderr
    assert "tqdm.py ran" not in done.stdout + done.stderr
    assert "--adamw.lr" in done.stdout
