"""DDP, ZeRO-1 style: each rank computes the Shampoo update of its own blocks only, then the
results are exchanged so that every rank ends the step with identical parameters.

Gradients: the distributor assumes they are already averaged across ranks (as they are after
``DistributedDataParallel``'s all-reduce, or a manual ``all_reduce(AVG)`` of every ``.grad``).
It never communicates gradients; each rank reads its own blocks of the (identical) gradients.

Who owns what: the ranks are split into groups of ``num_trainers_per_group`` consecutive ranks
(``-1``: one group of the whole world). Inside a group every block of the parameter group is
assigned to one rank by ``distribute_buffer_sizes`` (greedy, balanced by block bytes,
deterministic, so every rank computes the same assignment without communicating). Every group
holds a full copy of the optimizer state (replicated across groups), so the state memory per
rank is about ``1 / num_trainers_per_group`` of the single-device optimizer's.

How results travel (``redistribute_and_update_params``, ``all_to_all`` rounds inside the group):

- ``communicate_params=False``: the updates ``-lr * P`` travel in ``communication_dtype`` and
  every rank (the owner too) adds the received, rounded update to its parameter.
- ``communicate_params=True``: the owner adds the update in the parameter's dtype and the
  updated parameter travels in ``communication_dtype``; every rank (the owner too) copies it.
  With a ``communication_dtype`` narrower than the parameters this rounds the parameters
  themselves every step, which loses small updates; prefer ``False`` with bfloat16.

Either way every rank applies the same rounded values, so ranks never drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from nanoshampoo.optim.shampoo.distributor.distributor import Distributor
from nanoshampoo.optim.shampoo.shampoo_types import DDPDistributedConfig
from nanoshampoo.optim.shampoo.utils.param_redistribution import (
    prepare_update_param_buffers,
    redistribute_and_update_params,
)
from nanoshampoo.optim.shampoo.utils.shampoo_utils import distribute_buffer_sizes


def new_trainer_group(num_trainers_per_group: int) -> tuple[dist.ProcessGroup | None, int]:
    """The process group of this rank's trainers and its size (collective: call on every rank).

    ``num_trainers_per_group`` ``-1`` or the world size: the default group (``None``).
    Smaller: ``dist.new_subgroups`` splits the world into groups of consecutive ranks; every
    rank must call this in the same order (it is, when every rank builds the same optimizer).
    Without an initialized process group the world is this one process.

    Raises:
        ValueError: ``num_trainers_per_group`` does not divide the world size.

    Example (no process group: a world of one):
        >>> new_trainer_group(-1)
        (None, 1)
    """
    initialized = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if initialized else 1
    size = world_size if num_trainers_per_group == -1 else num_trainers_per_group
    if size < 1 or world_size % size != 0:
        raise ValueError(
            f"num_trainers_per_group must divide the world size ({world_size}), "
            f"got {num_trainers_per_group}"
        )
    if size == world_size:
        return None, world_size
    group, _ = dist.new_subgroups(group_size=size)
    return group, size


class DDPDistributor(Distributor):
    """Blocks spread over the ranks of a trainer group; results exchanged by ``all_to_all``.

    Args:
        params: the parameter group's parameters, contiguous, identical on every rank.
        max_preconditioner_dim: largest block dim (int >= 1 or ``math.inf``).
        first_param_index: index of ``params[0]`` among all of the optimizer's parameters.
        config: the :class:`DDPDistributedConfig`.

    Collective: the constructor (when it creates subgroups) and every :meth:`update_params`
    must be called on every rank, in the same order. The exchange buffers are allocated once:
    a send buffer of about ``1 / group_size`` of the parameters and a receive buffer of about
    one copy of them, both in ``communication_dtype``.

    Example (no process group: one rank owns every block):
        >>> w = torch.zeros(6, 4)
        >>> d = DDPDistributor([w], 4, 0, DDPDistributedConfig(communication_dtype=torch.bfloat16))
        >>> d.group_size, d.local_block_indices
        (1, (0, 1))
        >>> d.update_params([torch.ones(4, 4), torch.full((2, 4), 2.0)])
        >>> w.sum().item()
        32.0
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        max_preconditioner_dim: int | float,
        first_param_index: int,
        config: DDPDistributedConfig,
    ) -> None:
        super().__init__(
            params,
            max_preconditioner_dim,
            first_param_index,
            config.target_parameter_dimensionality,
        )
        self._communicate_params = config.communicate_params
        group, group_size = new_trainer_group(config.num_trainers_per_group)
        blocks = self._global_block_views
        assignment = distribute_buffer_sizes(blocks, group_size, config.load_balancing_config)
        self._buffers = prepare_update_param_buffers(
            blocks, assignment, group=group, communication_dtype=config.communication_dtype
        )
        owned = self._buffers.owned_block_indices  # exchange order: largest block first
        self._local_block_indices = tuple(sorted(owned))
        position = {index: k for k, index in enumerate(self._local_block_indices)}
        self._exchange_order = tuple(position[index] for index in owned)
        self._owned_param_views = [blocks[index] for index in owned]

    @property
    def local_block_indices(self) -> tuple[int, ...]:
        """This rank's blocks, in block order (the exchange sends them largest first)."""
        return self._local_block_indices

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The trainer group the blocks are spread over (``None``: the default group)."""
        return self._buffers.group

    @property
    def group_size(self) -> int:
        return self._buffers.group_size

    @property
    def communication_buffer_bytes(self) -> int:
        """Bytes of the persistent send and receive buffers on this rank."""
        buffers = self._buffers
        total = buffers.send_buffer.numel() * buffers.send_buffer.element_size()
        if buffers.recv_buffer is not buffers.send_buffer:
            total += buffers.recv_buffer.numel() * buffers.recv_buffer.element_size()
        return total

    @property
    def bytes_sent_per_step(self) -> int:
        """Bytes this rank sends to other ranks per step: its chunk of every round, padding
        included, once per peer (the chunk addressed to itself does not leave the rank)."""
        buffers = self._buffers
        peers = buffers.group_size - 1
        return sum(
            peers * inputs[0].numel() * inputs[0].element_size() for inputs in buffers.round_inputs
        )

    def all_reduce_grad_sum_(self, grad_sum: torch.Tensor) -> None:
        """Sum ``grad_sum`` (a float64 scalar) over the trainer group, in place (collective).

        The optimizer sums the gradients of its local blocks to detect NaN/Inf; the sum over
        the group covers every block, so all ranks agree on whether to skip or raise.
        """
        if self._buffers.group_size > 1:
            dist.all_reduce(grad_sum, group=self._buffers.group)

    @torch.no_grad()
    def update_params(self, local_block_updates: Sequence[torch.Tensor]) -> None:
        """Collective: exchange this rank's block results and update every block on every rank.

        Args:
            local_block_updates: ``-lr * P`` per local block, in :attr:`local_block_indices`
                order (empty on a rank that owns no block: it still takes part).
        """
        updates = [local_block_updates[k] for k in self._exchange_order]
        if not self._communicate_params:
            redistribute_and_update_params(self._buffers, updates, accumulate=True)
            return
        if updates:
            torch._foreach_add_(self._owned_param_views, updates)
        redistribute_and_update_params(self._buffers, self._owned_param_views)
