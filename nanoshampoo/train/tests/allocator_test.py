"""Tuned glibc malloc settings: when the entry point re-executes, and that it really does."""

import os
import platform
import subprocess
import sys

import pytest

from nanoshampoo.train.allocator import OPT_OUT_VAR, TUNED_MALLOC_ENV, tuned_environment


def test_adds_the_missing_variables_and_keeps_the_rest() -> None:
    env = tuned_environment({"PATH": "/bin", "RANK": "1"}, libc="glibc")
    assert env == {"PATH": "/bin", "RANK": "1", **TUNED_MALLOC_ENV}


def test_a_value_the_user_set_is_kept() -> None:
    env = tuned_environment({"MALLOC_MMAP_THRESHOLD_": "12345"}, libc="glibc")
    assert env is not None
    assert env["MALLOC_MMAP_THRESHOLD_"] == "12345"
    assert env["MALLOC_TRIM_THRESHOLD_"] == TUNED_MALLOC_ENV["MALLOC_TRIM_THRESHOLD_"]


@pytest.mark.parametrize(
    ("environ", "libc"),
    [
        (dict(TUNED_MALLOC_ENV), "glibc"),  # already tuned: this is what stops a re-exec loop
        ({OPT_OUT_VAR: "1"}, "glibc"),
        ({}, ""),  # not glibc (macOS, musl): the variables mean nothing there
    ],
)
def test_no_reexec(environ: dict[str, str], libc: str) -> None:
    assert tuned_environment(environ, libc=libc) is None


PROBE = """
import os, sys
from nanoshampoo.train.allocator import exec_with_tuned_malloc
if __name__ == "__main__":
    print("pid", os.getpid(), os.environ.get("MALLOC_MMAP_THRESHOLD_"), sys.argv[1:], flush=True)
    exec_with_tuned_malloc("probe_module", sys.argv[1:])
    print("done", os.getpid(), flush=True)
"""


def _untuned_run(command: list[str], paths: list[str]) -> list[list[str]]:
    """``python *command`` without the malloc variables, ``paths`` first on ``PYTHONPATH``;
    its stdout's lines, split into words."""
    env = {k: v for k, v in os.environ.items() if k not in TUNED_MALLOC_ENV and k != OPT_OUT_VAR}
    env["PYTHONPATH"] = os.pathsep.join([*paths, *sys.path])
    out = subprocess.run(
        [sys.executable, *command], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    return [line.split() for line in out.stdout.splitlines()]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_reexec_runs_the_module_once_more_in_the_same_process(tmp_path) -> None:
    (tmp_path / "probe_module.py").write_text(PROBE)
    first, second, done = _untuned_run(["-m", "probe_module", "--seed", "3"], [str(tmp_path)])
    assert first[2] == "None" and second[2] == TUNED_MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]
    assert first[1] == second[1] == done[1]  # execve keeps the pid: safe under torchrun
    assert first[3:] == second[3:] == ["['--seed',", "'3']"]


SCRIPT = """
import os, sys
import sibling  # the script's own folder is still on sys.path after the re-exec
from nanoshampoo.train.allocator import exec_script_with_tuned_malloc
if __name__ == "__main__":
    print("pid", os.getpid(), os.environ.get("MALLOC_TRIM_THRESHOLD_"), sys.argv[1:], flush=True)
    exec_script_with_tuned_malloc(__file__, sys.argv[1:])
    print("done", os.getpid(), flush=True)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_a_script_reexecutes_once_with_its_folder_on_the_path(tmp_path) -> None:
    (tmp_path / "probe_script.py").write_text(SCRIPT)
    (tmp_path / "sibling.py").write_text("")
    first, second, done = _untuned_run([str(tmp_path / "probe_script.py"), "--rounds", "2"], [])
    assert first[2] == "None" and second[2] == TUNED_MALLOC_ENV["MALLOC_TRIM_THRESHOLD_"]
    assert first[1] == second[1] == done[1]
    assert second[3:] == ["['--rounds',", "'2']"]
