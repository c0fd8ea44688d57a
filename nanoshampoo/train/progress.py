"""Training progress on rank 0: tqdm's bar on a terminal, a few plain lines anywhere else.

On a terminal tqdm redraws one line in place. Written to a file or a pipe (``make train | tee``,
the output file of every run ``compare`` starts) the same bar is a ``\\r``-separated update per
step, tens of kilobytes per run that nobody reads. There :class:`SparseProgress` prints one line
each time the run passes another tenth of its steps, or ``every_s`` seconds after the last
line, whichever comes first::

    tiny-shampoo-s0-...: step 30/300 (10%), 10.2s, 0.34 s/step, 1m32s left, loss=4.913 tok_s=6,021
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from tqdm import tqdm

# A line at least this often (seconds) when a tenth of the run takes longer.
EVERY_S = 60.0


class SparseProgress:
    """The part of tqdm's interface the trainer uses (``update``, ``set_postfix``, ``write``,
    ``close``, ``disable``), as one line per tenth of ``total`` steps or per ``every_s``
    seconds on ``stream``.

    ``initial``: the steps already done (a resumed run); the rate and the time left count only
    the steps of this process. ``close`` prints the last position unless a line just did.
    """

    disable = False

    def __init__(
        self,
        total: int,
        initial: int = 0,
        desc: str = "",
        stream: IO[str] | None = None,
        every_s: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.n, self.desc = total, initial, desc
        self.stream = sys.stderr if stream is None else stream
        self.every_s, self.clock = every_s, clock
        self.initial = initial
        self.start = self.last_time = clock()
        self.last_printed = initial
        self.postfix = ""

    def _tenth(self, n: int) -> int:
        return math.floor(10 * n / self.total) if self.total > 0 else 0

    def update(self, n: int = 1) -> None:
        before, self.n = self.n, self.n + n
        now = self.clock()
        if self._tenth(self.n) > self._tenth(before) or now - self.last_time >= self.every_s:
            self._print(now)

    def set_postfix(self, **values: Any) -> None:
        self.postfix = " ".join(f"{key}={value}" for key, value in values.items())

    def write(self, line: str) -> None:
        print(line, flush=True)

    def close(self) -> None:
        if self.n != self.last_printed:
            self._print(self.clock())

    def line(self, now: float) -> str:
        """The progress line at time ``now``."""
        elapsed = now - self.start
        done = self.n - self.initial
        parts = [f"step {self.n}/{self.total} ({100 * self.n / max(self.total, 1):.0f}%)"]
        parts.append(f"{elapsed:.1f}s")
        if done > 0:
            per_step = elapsed / done
            parts.append(f"{per_step:.3g} s/step")
            if self.n < self.total:
                parts.append(f"{_duration(per_step * (self.total - self.n))} left")
        text = ", ".join(parts) + (f", {self.postfix}" if self.postfix else "")
        return f"{self.desc}: {text}" if self.desc else text

    def _print(self, now: float) -> None:
        print(self.line(now), file=self.stream, flush=True)
        self.last_time, self.last_printed = now, self.n


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def progress_bar(
    total: int, initial: int, enabled: bool, desc: str, stream: IO[str] | None = None
) -> Progress:
    """tqdm's bar when ``stream`` (default stderr, tqdm's) is a terminal or ``enabled`` is
    false (a disabled bar prints nothing), else :class:`SparseProgress` lines on it."""
    stream = sys.stderr if stream is None else stream
    if enabled and not stream.isatty():
        return SparseProgress(total, initial, desc, stream)
    return tqdm(
        total=total,
        initial=initial,
        disable=not enabled,
        desc=desc,
        unit="step",
        dynamic_ncols=True,
        file=stream,
    )


Progress = tqdm | SparseProgress
