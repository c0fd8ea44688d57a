"""What a bench records beside its numbers: the commit it ran, the date, the machine, the
threads, torch's version and the load average (a module the bench scripts share; no command)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """The project's commit (short hash, "+changes" if the tree differs), or "unknown"."""
    try:
        head, dirty = (
            subprocess.run(
                ["git", "-C", str(ROOT), *command], capture_output=True, text=True, check=True
            ).stdout.strip()
            for command in (
                ("rev-parse", "--short", "HEAD"),
                ("status", "--porcelain", "--untracked-files=no"),
            )
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def measured_facts(threads: int | str, commit: str | None = None) -> dict[str, Any]:
    """``commit`` (default: now's), date, machine (``lscpu``'s model name), threads, torch's
    version, load average: the fields ``tools/results_tables.py`` prints above a table. Take
    the commit before a long run: the tree may change under it."""
    import torch

    from nanoshampoo.train.machine import cpu_name

    return {
        "commit": git_commit() if commit is None else commit,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": cpu_name(),
        "threads": threads,
        "torch": torch.__version__,
        "load_average": os.getloadavg()[0],
    }
