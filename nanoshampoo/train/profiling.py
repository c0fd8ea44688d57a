"""The trainer's profiler component: ``StepProfiler`` when steps are chosen, else a no-op.

Both are context managers around the step loop with ``.step(step_index)`` called before each
optimizer step's work; ``StepProfiler`` (``nanoshampoo.train.step_profiler``) records only the
chosen steps and writes ``<profile_dir>/rank{r}.json.gz``.

Example:
    >>> with make_step_profiler((), "", rank=0) as profiler:
    ...     profiler.step(0)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class NoProfiler:
    def __enter__(self) -> NoProfiler:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def step(self, step_index: int) -> None:
        return None


def make_step_profiler(steps: Sequence[int], out_dir: str, rank: int) -> Any:
    if not steps:
        return NoProfiler()
    # Imported only when steps are profiled: the run log records the source of every imported
    # nanoshampoo module, and most runs profile nothing.
    from nanoshampoo.train.step_profiler import StepProfiler

    return StepProfiler(out_dir, steps, rank)
