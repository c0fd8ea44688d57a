"""Profile chosen training steps and export one Chrome trace per rank.

:class:`StepProfiler` wraps ``torch.profiler.profile`` with a schedule keyed on the
trainer's own step indices: the step before the first chosen one warms the profiler up, the
chosen steps are recorded, and the trace is written when the last chosen step ends (or when
the profiler exits, whichever is first). Traces are ``<out_dir>/rank{rank}.json.gz`` and open
in Perfetto (https://ui.perfetto.dev) or ``chrome://tracing``; ``nanoshampoo trace out_dir``
measures communication/computation overlap in them.

CPU activity is always recorded, CUDA activity when CUDA is available. Step ``i`` appears in
the trace as the annotation ``ProfilerStep#i``.

It lives in the trainer's layer because the trainer records with it; the evidence layer above
reads its traces (``nanoshampoo.evidence.traces``) and re-exports it as
``nanoshampoo.evidence.profiling.StepProfiler`` for scripts that profile outside the trainer.

Example:
    >>> with StepProfiler("profile/", steps=range(5, 8), rank=rank) as profiler:  # doctest: +SKIP
    ...     for step in range(total_steps):
    ...         profiler.step(step)  # before the work of `step`
    ...         train_one_step()
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile

from nanoshampoo.io_utils import atomic_output


class StepProfiler:
    """Record the consecutive training steps ``steps`` of one rank into a Chrome trace.

    Call :meth:`step` with the index of each step *before* running it (every step, chosen or
    not), inside the ``with`` block. ``steps`` must be non-empty, non-negative and
    consecutive (one trace file per rank holds one window).
    """

    def __init__(
        self,
        out_dir: str | Path,
        steps: Iterable[int],
        rank: int = 0,
        record_shapes: bool = False,
        with_stack: bool = False,
    ) -> None:
        chosen = sorted(set(int(s) for s in steps))
        if not chosen:
            raise ValueError("steps: choose at least one step to profile")
        if chosen[0] < 0:
            raise ValueError(f"steps: step indices must be >= 0, got {chosen[0]}")
        if chosen[-1] - chosen[0] + 1 != len(chosen):
            raise ValueError(f"steps: must be consecutive step indices, got {chosen}")
        if rank < 0:
            raise ValueError(f"rank: must be >= 0, got {rank}")
        self.out_dir = Path(out_dir)
        self.steps = tuple(chosen)
        self.rank = rank
        self.trace_path = self.out_dir / f"rank{rank}.json.gz"
        self._last_step: int | None = None
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(
            activities=activities,
            schedule=self._action,
            on_trace_ready=self._export,
            record_shapes=record_shapes,
            with_stack=with_stack,
        )

    def _action(self, step: int) -> ProfilerAction:
        """Profiler schedule on training step indices (``step_num`` is kept equal to them)."""
        if self._last_step is None:
            # torch asks once before any step() (with step 0); that is the time before the
            # first training step, index -1: the warm-up when step 0 is chosen.
            step = -1
        first, last = self.steps[0], self.steps[-1]
        if step == first - 1:
            return ProfilerAction.WARMUP
        if first <= step < last:
            return ProfilerAction.RECORD
        if step == last:
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.NONE

    def _export(self, prof: profile) -> None:
        with atomic_output(self.trace_path, suffix=".json.gz") as tmp:
            prof.export_chrome_trace(str(tmp))  # gzip-compressed because of the .gz suffix

    def __enter__(self) -> StepProfiler:
        self._profiler.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._profiler.__exit__(exc_type, exc, tb)

    def step(self, step_index: int) -> None:
        """Mark the start of training step ``step_index`` (strictly increasing by one)."""
        if self._last_step is not None and step_index != self._last_step + 1:
            raise ValueError(
                f"step_index: expected {self._last_step + 1} after {self._last_step}, got "
                f"{step_index}"
            )
        self._last_step = step_index
        # torch.profiler increments step_num and then asks the schedule; aligning step_num with
        # the trainer's index keys the schedule and the ProfilerStep#i labels on real steps.
        self._profiler.step_num = step_index - 1
        self._profiler.step()
