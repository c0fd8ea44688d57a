"""What machine this is: the CPU's model name and the cores this process may use (what a probe's
verdict is keyed by, and what a bench names)."""

from __future__ import annotations

import os
import platform


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else the architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask; all cores where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
