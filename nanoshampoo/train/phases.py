"""Where a run's wall time goes: seconds per phase, written in the run's ``final`` record.

A study or a leaderboard trains many short runs, and a short run's time is mostly not its
optimizer steps. The trainer times each phase with :class:`PhaseClock` and writes
``"phases_s"`` into its ``final`` JSONL record (``bench/study_throughput.py`` sums them over
the runs of a study). The phases, in seconds of wall time:

* ``start``: from the process's start (the kernel's record, Linux only; else 0) to the
  trainer's construction: the interpreter, the malloc re-exec, the imports, the flags;
* ``data``: finding (on a first run, preparing) the token shards;
* ``probes``: the thread, bf16 and compile probes (``hardware``, ``compile_choice``);
* ``setup``: the rest of the construction (model, optimizers, checks, the log's header);
* ``first_step``: the process's first optimizer step, which holds the compilation when the
  model is compiled;
* ``steps``: every other optimizer step, decay branches' included;
* ``validation``, ``checkpoint``, ``telemetry``;
* ``logging``: writing the text and JSONL logs;
* ``other``: the rest up to the ``final`` record (the loop, branch snapshots, the header);
* ``wall``: their sum, process start to the ``final`` record.

Example:
    >>> clock = PhaseClock(process_age_s=lambda: 0.0)
    >>> with clock.phase("steps"):
    ...     pass
    >>> sorted(clock.record(logging_s=0.0))[:3]
    ['checkpoint', 'data', 'first_step']
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PHASES = (
    "start",
    "data",
    "probes",
    "setup",
    "first_step",
    "steps",
    "validation",
    "checkpoint",
    "telemetry",
    "logging",
    "other",
)


def process_age_s() -> float:
    """Seconds since this process started (``/proc/self/stat``'s start time against the boot
    clock, 10 ms resolution); 0.0 where that is not available (not Linux)."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (starttime, clock ticks since boot); the command name (field 2) may hold
            # spaces, so count from its closing parenthesis.
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


class PhaseClock:
    """Wall seconds per phase of one run (see the module doc); made when the trainer starts."""

    def __init__(self, process_age_s: Callable[[], float] = process_age_s) -> None:
        self.start_s = process_age_s()
        self.started = time.perf_counter()
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.seconds["start"] = self.start_s

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the time spent inside the ``with`` block to phase ``name``."""
        if name not in self.seconds:
            raise ValueError(f"unknown phase {name!r}: one of {PHASES}")
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - begin

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` (measured elsewhere, e.g. a timed step) to phase ``name``."""
        if name not in self.seconds:
            raise ValueError(f"unknown phase {name!r}: one of {PHASES}")
        self.seconds[name] += seconds

    def record(self, logging_s: float) -> dict[str, float]:
        """Every phase's seconds up to now, ``logging`` set to ``logging_s`` (the log's own
        count), ``other`` the rest of the wall time, and ``wall``; rounded to the millisecond."""
        wall = self.start_s + time.perf_counter() - self.started
        seconds = {**self.seconds, "logging": logging_s, "other": 0.0}
        seconds["other"] = max(0.0, wall - sum(seconds.values()))
        seconds["wall"] = wall
        return {name: round(value, 3) for name, value in seconds.items()}
