"""Profile chosen steps of your own loop: :class:`StepProfiler`, one Chrome trace per rank.

The profiler is the trainer's (``nanoshampoo.train.step_profiler``, the layer below evidence);
this is its name on the evidence side, next to the trace analysis
(:mod:`nanoshampoo.evidence.traces`, ``nanoshampoo trace DIR``) that reads what it writes.
``bench/dist_adam_overlap.py`` and ``bench/evidence_gloo_trace.py`` profile their own loops
with it.

Example:
    >>> from nanoshampoo.train.step_profiler import StepProfiler as TrainerProfiler
    >>> StepProfiler is TrainerProfiler
    True
"""

from __future__ import annotations

from nanoshampoo.train.step_profiler import StepProfiler

__all__ = ["StepProfiler"]
