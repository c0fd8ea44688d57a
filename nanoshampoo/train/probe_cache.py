"""The probes' verdicts, kept for the next runs on the same machine: one probe per question.

Every run asks the machine the same questions: is bf16 faster than float32 here (``hardware``),
does inductor compile here (``compile_choice``), what is the matmul peak that MFU is a fraction
of (``throughput``). A study or a leaderboard of many short runs pays those probes in every
run. :class:`ProbeCache` keeps each answer in a JSON file, under the question and a key that
names the machine and the probe: host name, CPU model, available cores, torch and Python
versions, and the probe's own settings (shape, dtype, threads). A verdict is reused only when
its key matches exactly and it is younger than :data:`MAX_AGE_S`; otherwise the probe runs
again and its verdict replaces the old one when the run calls :meth:`ProbeCache.save`
(the trainer does once its checks passed: a refused run writes nothing). A run that reuses a
verdict says so, with the file and the verdict's age, in the reason its header and log record;
a file that cannot be read is named there too, and replaced.

The file is ``probes.json`` in the run's ``--out-dir``, or ``$NANOSHAMPOO_PROBE_CACHE``:
``compare``, ``tune`` and ``study`` set that to their own out dir's file, so all their runs
share one. Writes are atomic (a temporary file renamed over the old one); two runs writing at
once lose at most one verdict, which the next run probes again.

Example:
    >>> cache = ProbeCache(None)  # no file: every question is probed
    >>> cache.answer("question", {"shape": [2, 2]}, lambda: 1.5)
    (1.5, '')
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from nanoshampoo.io_utils import OutputPathError, atomic_output

CACHE_VAR = "NANOSHAMPOO_PROBE_CACHE"
CACHE_NAME = "probes.json"
# A machine's kernels do not change within a day; its software may (a driver, a BIOS setting,
# a torch reinstalled at the same version), so a verdict older than this is measured again.
MAX_AGE_S = 24 * 3600.0
FORMAT = 1

T = TypeVar("T")


def cache_path(out_dir: str | Path) -> Path:
    """``$NANOSHAMPOO_PROBE_CACHE`` when set, else ``OUT_DIR/probes.json``."""
    override = os.environ.get(CACHE_VAR)
    return Path(override) if override else Path(out_dir) / CACHE_NAME


def machine_key() -> dict[str, Any]:
    """What a verdict is only valid for: this host, CPU, cores, torch and Python."""
    # Here, not at the top: the evidence tools import this module for its names alone, without
    # torch, and hardware imports this module.
    import torch

    from nanoshampoo.train.machine import available_cores, cpu_name

    return {
        "host": socket.gethostname(),
        "cpu": cpu_name(),
        "cores": available_cores(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


class ProbeCache:
    """Verdicts of the probes in ``path`` (``None``: no file, every question is probed)."""

    def __init__(self, path: Path | None, now: Callable[[], float] = time.time) -> None:
        self.path = path
        self.now = now
        self.machine = machine_key()
        self.measured: dict[str, Any] = {}  # new verdicts, written by save()

    def answer(
        self, question: str, settings: Mapping[str, Any], probe: Callable[[], T]
    ) -> tuple[T, str]:
        """The verdict on ``question`` asked with ``settings`` (JSON-able), and a note: empty
        when ``probe()`` ran now, else where the reused verdict came from and how old it is
        (or, after a probe, why a stored one was not used). The verdict must be JSON-able."""
        key = {**self.machine, **settings}
        entries, trouble = self._read()
        stored = entries.get(question)
        if isinstance(stored, dict) and stored.get("key") == key:
            age = self.now() - float(stored.get("measured_at", -1e18))
            if 0 <= age <= MAX_AGE_S:
                return stored["verdict"], f"cached in {self.path}, measured {_age(age)} ago"
            trouble = trouble or f"the verdict in {self.path} was {_age(age)} old"
        elif stored is not None:
            trouble = trouble or f"the verdict in {self.path} was for another machine or probe"
        verdict = probe()
        self.measured[question] = {"key": key, "verdict": verdict, "measured_at": self.now()}
        return verdict, (f"probed; {trouble}" if trouble else "")

    def save(self) -> None:
        """Write the verdicts probed since the last save over the file's (atomically; a file
        that cannot be written costs the next run a probe, nothing more)."""
        if self.path is None or not self.measured:
            return
        entries = {**self._read()[0], **self.measured}
        try:
            with atomic_output(self.path) as tmp:
                tmp.write_text(
                    json.dumps({"format": FORMAT, "verdicts": entries}, indent=1) + "\n",
                    encoding="utf-8",
                )
        except (OSError, OutputPathError):
            return
        self.measured = {}

    def _read(self) -> tuple[dict[str, Any], str]:
        """The stored entries, and why none could be read (empty when fine or absent)."""
        if self.path is None or not self.path.exists():
            return {}, ""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return {}, f"{self.path} could not be read ({type(exc).__name__})"
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return {}, f"{self.path} is not a probe cache of format {FORMAT}"
        entries = data.get("verdicts")
        return (dict(entries), "") if isinstance(entries, dict) else ({}, "")


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
