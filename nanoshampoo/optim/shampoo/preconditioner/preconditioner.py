"""The one interface every preconditioner implements, and the bucket layout it works on.

Blocks of a parameter group that share a shape and dtype form a :class:`BlockBucket`; their
gradients, states and search directions are stacked along a new leading dim, so each bucket
is processed by a few batched kernels instead of a Python loop over blocks.

A preconditioner (optax-like) has three operations, called by the optimizer in this order:

- ``update_statistics(grads, step)``: fold this step's gradients into the statistics;
- ``amortized_computation(step, share, num_shares, period)``: the expensive part (e.g. matrix
  roots), on a schedule, all at once or one share of it per step;
- ``precondition(grads, step)``: map (filtered) gradients to search directions; a step that
  does not call it calls ``complete_statistics()`` instead.

Before ``precondition`` the optimizer may call ``expect_filtered(FilteredInput(...), step)`` to
say how this step's input is made from the gradients given to ``update_statistics``; a
preconditioner that rotates its input (SOAP) uses it to update the rotated input linearly
instead of rotating it again. ``forget_filtered()`` says the optimizer's filtered state changed
outside the step (a loaded state dict, a block rolled back).

The optimizer loop does not know which preconditioner it drives.

Example:
    >>> bucket = BlockBucket(shape=(4, 3), dtype=torch.float32, device=torch.device("cpu"),
    ...                      block_labels=("w block_0", "w block_1"))
    >>> bucket.stacked_shape
    (2, 4, 3)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nanoshampoo.optim.shampoo.utils.optimizer_modules import OptimizerModule


@dataclass(frozen=True)
class BlockBucket:
    """Blocks of one shape and computation dtype, stacked along a leading dim.

    Fields:
        shape: the shape of one block (after merging small dims and splitting).
        dtype: computation dtype of the block's states and search directions.
        device: where the block's states live.
        block_labels: one human-readable label per block (parameter name and block id),
            used in error messages; its length is the number of blocks ``B``.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    block_labels: tuple[str, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.block_labels)

    @property
    def stacked_shape(self) -> tuple[int, ...]:
        """``(B, *shape)``: the shape of every per-bucket tensor."""
        return (self.num_blocks, *self.shape)

    def zeros(self) -> torch.Tensor:
        """A zero-filled ``(B, *shape)`` tensor in the bucket's dtype and device."""
        return torch.zeros(self.stacked_shape, dtype=self.dtype, device=self.device)


@dataclass(frozen=True)
class FilteredInput:
    """How the input of ``precondition(X, t)`` is made, as the optimizer promises it.

    ``X_t = M_t / divisor`` with ``M_t = M_(t-1) + (1 - beta) (G_t - M_(t-1))``, where ``G_t`` is
    the ``grads`` of ``update_statistics(grads, t)`` and ``M_(t-1)`` the ``M`` of step ``t - 1``
    (``beta = 0``: ``M_t = G_t``). Per bucket, all blocks alike.
    """

    beta: float
    divisor: float = 1.0


class BlockStateView(OptimizerModule):
    """Named views into stacked preconditioner state, for one block.

    ``state_dict()`` of this module is what a checkpoint stores for the block; loading writes
    into the stacked tensors in place (the attributes are views).
    """

    def __init__(self, **tensors: torch.Tensor | dict[int, torch.Tensor]) -> None:
        for name, value in tensors.items():
            setattr(self, name, value)


class Preconditioner(ABC):
    """A preconditioner over the buckets of one parameter group.

    ``grads`` arguments are one tensor per bucket, shaped ``bucket.stacked_shape`` and in the
    bucket's dtype. Returned search directions have the same layout; they may be buffers owned
    by the preconditioner (overwritten by the next call) or the inputs themselves, so callers
    must neither modify nor keep them.

    Attributes:
        name: the key of this preconditioner's state in a block's state dict.
    """

    name: str

    def __init__(self, buckets: Sequence[BlockBucket]) -> None:
        self._buckets = tuple(buckets)

    @abstractmethod
    def update_statistics(self, grads: Sequence[torch.Tensor], step: int) -> None:
        """Fold the step-``step`` (1-based) gradients into the statistics."""

    def amortized_computation(
        self, step: int, share: int = 0, num_shares: int = 1, period: int | None = None
    ) -> None:
        """Recompute the expensive part (e.g. roots) from the statistics; cheap ones have none.

        With ``num_shares > 1`` only share ``share`` (in ``[0, num_shares)``) of the work runs:
        a fixed, deterministic part chosen by the preconditioner, so that ``num_shares`` calls
        with shares ``0..num_shares-1`` cover everything once. ``period`` is the index of the
        precondition period the call belongs to (``step // precondition_frequency``), for work
        the preconditioner does only every few periods; None: everything is due (the first
        computation).
        """

    @abstractmethod
    def precondition(self, grads: Sequence[torch.Tensor], step: int) -> list[torch.Tensor]:
        """Search directions for ``grads`` at step ``step`` (1-based)."""

    def complete_statistics(self) -> None:
        """Finish what ``update_statistics`` deferred, for a step that calls no ``precondition``
        (the optimizer calls it then, e.g. while grafting alone steps). Nothing by default."""

    def release_step_temporaries(self) -> None:
        """Drop what ``update_statistics`` kept for the same step's ``amortized_computation``
        (the optimizer calls it after that computation, or in its place on a step without one).
        Nothing by default."""

    def expect_filtered(self, filtered: FilteredInput | None, step: int) -> None:
        """How step ``step``'s ``precondition`` input is made (None: unknown); see the module doc.
        Preconditioners that cannot use it ignore it."""

    def forget_filtered(self) -> None:
        """The optimizer's filtered state was changed outside a step: drop what was derived
        from it. Nothing by default."""

    def block_state(self, bucket_index: int, position: int) -> OptimizerModule | None:
        """The state of block ``position`` of bucket ``bucket_index`` (None: stateless)."""
        return None
