"""Version-stable names for the two tensor collectives every sharded optimizer here uses.

torch 2.13 renamed ``dist.reduce_scatter_tensor`` / ``dist.all_gather_into_tensor`` to
``dist.reduce_scatter_single`` / ``dist.all_gather_single`` and made the old names emit a
``FutureWarning``; torch 2.11 (the GPU machines) has only the old names. Both generations take the
same positional arguments, ``(output, input, op, group, async_op)`` and
``(output, input, group, async_op)``, so this module binds whichever exists once, at import.

Facts measured on torch 2.13 CPU with gloo, which shape how callers wait:
- gloo's reduce-scatter runs (SUM and AVG) but its ``Work`` has no future:
  ``work.get_future()`` raises "Work::getFuture not implemented". All-gather and all-reduce do
  return futures. ``wait_work`` therefore waits on the ``Work`` itself, which every backend
  supports (on NCCL it makes the current CUDA stream wait rather than blocking the host).
- gloo executes reduce-scatter as a full all-reduce followed by a local slice, so on CPU it moves
  as many bytes as an all-reduce.

Example (a one-rank gloo group, so that it runs anywhere; rank ``r`` of ``W`` keeps rows
``[r*n, (r+1)*n)``):
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> grad = torch.arange(6.0).reshape(3, 2)
    >>> out = torch.empty(grad.shape[0] // dist.get_world_size(), *grad.shape[1:])
    >>> work = reduce_scatter_tensor(out, grad, async_op=True)
    >>> wait_work(work)
    >>> torch.equal(out, grad)
    True
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp, Work

# Prefer the new names so torch 2.13+ raises no deprecation warning; fall back for torch < 2.13.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp.RedOpType = ReduceOp.AVG,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``input`` over the group with ``op`` and keep this rank's dim-0 slice in ``output``.

    ``input`` has shape ``(world_size * n, *rest)`` (or ``(world_size, n, *rest)``), ``output``
    has shape ``(n, *rest)``, same dtype and device. Rank ``r`` receives rows ``[r*n, (r+1)*n)``
    of the reduction. Returns the ``Work`` when ``async_op`` is true (wait on it with
    ``wait_work``; gloo's has no future), else ``None``. The default op is ``AVG``, not torch's
    ``SUM``, because averaging data-parallel gradients is what callers here want.
    """
    return _reduce_scatter(output, input, op, group, async_op)


def all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Concatenate every rank's ``input`` along dim 0 into ``output``.

    ``input`` has shape ``(n, *rest)``, ``output`` ``(world_size * n, *rest)``. ``input`` may be
    this rank's own slice of ``output`` (in-place gather, supported by gloo and NCCL). Returns the
    ``Work`` when ``async_op`` is true, else ``None``.
    """
    return _all_gather(output, input, group, async_op)


def wait_work(work: Work | None) -> None:
    """Wait for an async collective; ``None`` (a synchronous or skipped collective) is a no-op.

    Uses ``Work.wait`` rather than ``Work.get_future().wait`` because gloo's reduce-scatter has
    no future.
    """
    if work is not None:
        work.wait()


def wait_all(works: Iterable[Work | None]) -> None:
    """Wait for every collective in ``works``, in order."""
    for work in works:
        wait_work(work)
