"""CPU intra-op threads of a training run: fixed, or probed at the start and again during it.

With ``threads=0`` on CPU the count is probed (:func:`hardware.cpu_threads`) and re-probed every
``RETUNE_STEPS`` steps, outside the timed step: other processes may take or free cores during a
run. Rank 0 decides for every rank, so that all ranks reduce in the same order. Fix ``threads``
for bitwise-reproducible runs.

Example:
    >>> import torch
    >>> from nanoshampoo.train.distributed import DistributedContext
    >>> ctx = DistributedContext(rank=0, world_size=1, device=torch.device("cpu"),
    ...                          owns_process_group=False)
    >>> tuner = ThreadTuner(requested=1, ctx=ctx)
    >>> tuner.tune(); (torch.get_num_threads(), tuner.reason, tuner.retunes)
    (1, 'threads=1', False)
"""

from __future__ import annotations

import torch

from nanoshampoo.train.distributed import DistributedContext, broadcast_object, local_world_size
from nanoshampoo.train.hardware import cpu_threads

# Other processes take and free cores during a run, and a run on busy cores with too many
# threads is many times slower (docs/results/cpu-choices.md); the probe is cheap enough to
# repeat this often.
RETUNE_STEPS = 10


class ThreadTuner:
    """Sets ``torch``'s intra-op threads for a CPU run: ``requested`` (> 0), or probed (0)."""

    def __init__(self, requested: int, ctx: DistributedContext) -> None:
        self.requested = requested
        self.ctx = ctx
        self.reason = "CUDA run"

    @property
    def retunes(self) -> bool:
        """Whether the count is probed again during the run (CPU, ``threads=0``)."""
        return self.ctx.device.type == "cpu" and self.requested == 0

    def tune(self) -> None:
        """Choose and set the thread count (rank 0's choice on every rank); ``reason`` says why."""
        choice = cpu_threads(self.requested, local_world_size()) if self.ctx.is_main else None
        threads, self.reason = broadcast_object(choice, self.ctx)  # type: ignore[misc]
        torch.set_num_threads(threads)

    def before_step(self, step: int, start_step: int) -> None:
        """Re-probe every ``RETUNE_STEPS`` steps after the first (only when :attr:`retunes`)."""
        if self.retunes and step > start_step and step % RETUNE_STEPS == 0:
            self.tune()
