"""Trainer processes that the evidence tools start, and that never outlive them.

A trainer runs in a session of its own (so it and the processes it starts, torchrun's ranks
included, are stopped together by their process group) and, on Linux, asks the kernel to kill
it when the tool that started it dies (``PR_SET_PDEATHSIG``): a ``compare``, ``tune`` or
``repeat`` killed with SIGKILL leaves no trainer behind to write into a run that a re-run would
start again. The wrapper checks that its parent is still the tool after arming the signal, so a
tool killed in between leaves nothing running either. Where there is no such signal, the
trainer inherits the run claims its tool holds (``run_claims.held_claim_fds``): an orphaned
trainer keeps its run claimed until it ends, so a re-run waits for it instead of training the
run again. Its Python never puts the working directory first on ``sys.path``
(``allocator.safe_python_environment``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from nanoshampoo.evidence.run_claims import held_claim_fds
from nanoshampoo.train.allocator import safe_python_environment
from nanoshampoo.train.probe_cache import CACHE_NAME, CACHE_VAR

# Runs the command after it (argv[2:]) once the kernel kills it with its parent (argv[1] is the
# parent's pid: if that is gone already, the exec never happens). prctl option 1 is
# PR_SET_PDEATHSIG, signal 9 SIGKILL; the signal survives exec.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 9); "
    "os.getppid() == int(sys.argv[1]) or os._exit(1); "
    "os.execvp(sys.argv[2], sys.argv[2:])"
)
# Seconds a stopped trainer gets to exit on SIGTERM before SIGKILL.
KILL_GRACE_S = 10.0


@contextmanager
def shared_probe_cache(out_dir: Path) -> Iterator[None]:
    """Inside, every trainer this process starts shares one probe cache, ``OUT_DIR/probes.json``
    (``train/probe_cache.py``): the bf16, inductor and matmul-peak probes run once per machine,
    not once per run. A file the user named in ``$NANOSHAMPOO_PROBE_CACHE`` is kept."""
    if os.environ.get(CACHE_VAR):
        yield
        return
    os.environ[CACHE_VAR] = str(Path(out_dir).resolve() / CACHE_NAME)
    try:
        yield
    finally:
        os.environ.pop(CACHE_VAR, None)


def spawn_trainer(command: Sequence[str], output: Path | None = None) -> subprocess.Popen[bytes]:
    """Start ``command`` in its own session, to die with this process; its stdout and stderr
    go to ``output`` (a new file), or to this process's own when ``None``."""
    argv = list(command)
    if sys.platform.startswith("linux"):
        argv = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]
    environment = safe_python_environment(os.environ)
    claims = held_claim_fds()
    if output is None:
        return subprocess.Popen(argv, start_new_session=True, env=environment, pass_fds=claims)
    out: IO[str]
    with output.open("x", encoding="utf-8") as out:
        return subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=environment,
            pass_fds=claims,
        )


def stop_trainer(process: subprocess.Popen[bytes]) -> None:
    """Stop the trainer and every process it started (its session's process group)."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue


def run_trainer(command: Sequence[str], output: Path | None = None) -> int:
    """Run ``command`` to its end (see :func:`spawn_trainer`); return its exit status. Ctrl-C
    (or any exception while waiting) stops it before it propagates."""
    process = spawn_trainer(command, output)
    try:
        return process.wait()
    finally:
        if process.poll() is None:
            stop_trainer(process)
