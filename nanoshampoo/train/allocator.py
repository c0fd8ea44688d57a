"""glibc malloc settings for training on CPU, applied by re-executing the entry point once
(the trainer's; a benchmark that times what a run computes re-executes itself the same way).

Why: glibc serves every allocation above its mmap threshold (dynamic, at most 32 MiB) with a
fresh ``mmap`` and gives it back with ``munmap`` on free, and trims the heap top eagerly; a
training step allocates and frees the same large activations every step (e.g. the
``(B, T, vocab)`` logits), so each step page-faults them in anew: most of a tiny run's wall
time went to the kernel (``docs/results/cpu-choices.md``). Freed memory up to the thresholds
is kept for reuse instead.

These settings can only come from the environment before the process starts (``mallopt`` caps
the mmap threshold at 32 MiB), hence the re-exec. It keeps the process id, so it is safe under
``torchrun``. Set ``NANOSHAMPOO_KEEP_MALLOC=1`` to opt out; values already in the environment
are respected.

Example:
    >>> tuned_environment({"PATH": "/bin"}, libc="glibc")["MALLOC_MMAP_THRESHOLD_"]
    '268435456'
    >>> tuned_environment({"NANOSHAMPOO_KEEP_MALLOC": "1"}, libc="glibc") is None
    True
"""

from __future__ import annotations

import os
import platform
import site
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

TUNED_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(256 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
}
OPT_OUT_VAR = "NANOSHAMPOO_KEEP_MALLOC"


def tuned_environment(environ: Mapping[str, str], libc: str) -> dict[str, str] | None:
    """The environment to re-execute with, or None when no re-exec is wanted.

    None when ``libc`` is not ``"glibc"`` (the variables mean nothing elsewhere), when the user
    opted out with ``NANOSHAMPOO_KEEP_MALLOC``, or when every variable is already set (by the
    user, or by an earlier re-exec: this is what stops a loop). Otherwise a copy of ``environ``
    with the missing variables added; variables the user set keep their values.
    """
    if libc != "glibc" or environ.get(OPT_OUT_VAR):
        return None
    missing = {k: v for k, v in TUNED_MALLOC_ENV.items() if k not in environ}
    if not missing:
        return None
    return {**environ, **missing}


def safe_python_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of a Python process this package starts (``python -m nanoshampoo...``,
    torchrun's ranks included): ``PYTHONSAFEPATH`` set, so the working directory does not go
    first on ``sys.path`` (a ``tqdm.py`` there would shadow the library), and, unless this
    package is installed in a site-packages folder, the folder holding it first on
    ``PYTHONPATH``, so the new process imports this same ``nanoshampoo`` (an editable install
    or a source checkout)."""
    root = str(Path(__file__).resolve().parents[2])
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    installed = {
        str(Path(p).resolve()) for p in (*site.getsitepackages(), site.getusersitepackages())
    }
    if root not in installed:
        paths.insert(0, root)
    return {**environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": os.pathsep.join(paths)}


def exec_with_tuned_malloc(module: str, args: Sequence[str]) -> None:
    """Replace this process by ``python -m module *args`` with :data:`TUNED_MALLOC_ENV` set.

    Returns (doing nothing) when :func:`tuned_environment` says no re-exec is wanted. Call it
    first thing in an entry point, before any work whose output could be duplicated.
    """
    environment = tuned_environment(os.environ, platform.libc_ver()[0])
    if environment is None:
        return
    _exec([sys.executable, "-m", module, *args], safe_python_environment(environment))


def exec_script_with_tuned_malloc(script: str | Path, args: Sequence[str]) -> None:
    """Replace this process by ``python script *args`` with :data:`TUNED_MALLOC_ENV` set: a
    benchmark script that times what a training run computes, under the run's allocator.

    As :func:`exec_with_tuned_malloc`, but the environment is otherwise the caller's: the
    script's folder stays first on ``sys.path`` (a bench imports its sibling modules).
    """
    environment = tuned_environment(os.environ, platform.libc_ver()[0])
    if environment is None:
        return
    _exec([sys.executable, str(script), *args], environment)


def _exec(argv: list[str], environment: Mapping[str, str]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, dict(environment))
