"""Shampoo on HSDP parameters: ``fully_shard`` on a 2-D mesh, dim 0 replicate, dim 1 shard.

Parameters are ``DTensor``s with placements ``(Replicate(), Shard(0))``: the ranks of one
replica (one row of the mesh) hold disjoint dim-0 shards, and every replica holds the same
shards (FSDP all-reduces the gradients over the replicas). Two levels of work splitting:

1. Within a replica (the shard group), the work tensors and their blocks are those of
   :class:`FullyShardDistributor` with ``param_assignment_strategy`` (``DEFAULT``: the local
   shards, lossy blocking; ``ROUND_ROBIN``/``REPLICATE``: full parameters, lossless). Every
   replica does this part identically, in parallel.
2. Across the replicas (the replicate group, the same shard position in every replica), the
   work blocks are spread as :class:`DDPDistributor` spreads blocks (``distribute_buffer_sizes``
   over block bytes), and the results travel by the same ``all_to_all`` rounds
   (``prepare_update_param_buffers``) in ``communication_dtype``: updates
   (``communicate_params=False``) or updated work values (``True``). Then step 1's scatter
   brings the rows to the shards.

Optimizer state per rank: about ``1 / (replicas * shards)`` of the single-device optimizer's for
``ROUND_ROBIN`` and ``DEFAULT``, ``1 / replicas`` for ``REPLICATE``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from nanoshampoo.optim.shampoo.distributor.distributor_types import check_hsdp_device_mesh
from nanoshampoo.optim.shampoo.distributor.fully_shard_distributor import (
    FullyShardDistributor,
)
from nanoshampoo.optim.shampoo.shampoo_types import (
    FSDPParamAssignmentStrategy,
    FullyShardDistributedConfig,
    HybridShardDistributedConfig,
)
from nanoshampoo.optim.shampoo.utils.param_redistribution import (
    prepare_update_param_buffers,
    redistribute_and_update_params,
)
from nanoshampoo.optim.shampoo.utils.shampoo_block_info import BlockInfo
from nanoshampoo.optim.shampoo.utils.shampoo_utils import distribute_buffer_sizes


class HybridShardDistributor(FullyShardDistributor):
    """Work blocks of an HSDP shard split over the replicas (see the module docstring).

    Args:
        params: the group's parameters, ``DTensor``s ``(Replicate(), Shard(0))`` on one 2-D mesh.
        max_preconditioner_dim: largest block dim (int >= 1 or ``math.inf``).
        first_param_index: index of ``params[0]`` among all of the optimizer's parameters.
        config: the :class:`HybridShardDistributedConfig`.
        owner_ranks: ``ROUND_ROBIN`` only: the shard rank (position on the shard dim) that
            computes each parameter in every replica; None: computed as
            :class:`FullyShardDistributor` computes it.

    Raises:
        ValueError: ``device_mesh`` is neither None nor a 2-D ``DeviceMesh``, or not the
            parameters' mesh, or ``num_trainers_per_group`` is neither -1 nor the replicate dim's
            size (all checked before any collective); naming ``owner_ranks``, a bad map (as
            :class:`FullyShardDistributor`).
    """

    _shard_mesh_dim = 1
    _mesh_ndim = 2

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        max_preconditioner_dim: int | float,
        first_param_index: int,
        config: HybridShardDistributedConfig,
        owner_ranks: Sequence[int] | None = None,
    ) -> None:
        check_hsdp_device_mesh(config)  # the config accepts any object, as the reference's does
        mesh = params[0].device_mesh if params and hasattr(params[0], "device_mesh") else None
        if config.device_mesh is not None and mesh is not None and config.device_mesh != mesh:
            raise ValueError("device_mesh must be the parameters' device mesh")
        replicas = 1 if mesh is None else mesh.size(0)
        if config.num_trainers_per_group not in (-1, replicas):
            raise ValueError(
                f"num_trainers_per_group must be -1 or the replicate dim's size ({replicas}), "
                f"got {config.num_trainers_per_group}"
            )
        super().__init__(
            params,
            max_preconditioner_dim,
            first_param_index,
            FullyShardDistributedConfig(
                param_assignment_strategy=config.param_assignment_strategy,
                communication_dtype=config.communication_dtype,
                communicate_params=config.communicate_params,
                num_sub_groups=config.num_sub_groups,
                load_balancing_config=config.load_balancing_config,
                target_parameter_dimensionality=config.target_parameter_dimensionality,
            ),
            owner_ranks,
        )
        self._replicate_group = None if mesh is None else mesh.get_group(0)
        self._replicas = replicas
        work_blocks = self._work_param_blocks
        assignment = distribute_buffer_sizes(work_blocks, replicas, config.load_balancing_config)
        exchanged = (
            work_blocks
            if config.communicate_params or self._strategy == FSDPParamAssignmentStrategy.DEFAULT
            else self._work_update_blocks
        )
        # Always the replicate group, also when it is this rank alone: ``group=None`` would mean
        # the default (world) group, whose other ranks hold other work blocks (another shard's
        # owners under ROUND_ROBIN) and would receive this rank's results as theirs.
        self._buffers = prepare_update_param_buffers(
            exchanged,
            assignment,
            group=self._replicate_group,
            communication_dtype=config.communication_dtype,
        )
        owned = self._buffers.owned_block_indices  # exchange order: largest block first
        self._mine = tuple(sorted(owned))  # indices into the work blocks
        position = {k: i for i, k in enumerate(self._mine)}
        self._exchange_order = tuple(position[k] for k in owned)
        self._owned_work_blocks = [work_blocks[k] for k in owned]

    @property
    def local_block_indices(self) -> tuple[int, ...]:
        return tuple(self._local_indices[k] for k in self._mine)

    @property
    def local_block_info_list(self) -> tuple[BlockInfo, ...]:
        return tuple(self._infos[i] for i in self.local_block_indices)

    @property
    def local_blocked_params(self) -> tuple[torch.Tensor, ...]:
        return tuple(self._work_param_blocks[k] for k in self._mine)

    @property
    def local_block_param_offsets(self) -> tuple[int, ...]:
        return tuple(self._block_offsets[k] for k in self._mine)

    @property
    def bytes_sent_per_step(self) -> int:
        """Shard-group gather and scatter plus the replicate-group exchange rounds."""
        buffers = self._buffers
        peers = buffers.group_size - 1
        rounds = sum(
            peers * inputs[0].numel() * inputs[0].element_size() for inputs in buffers.round_inputs
        )
        return super().bytes_sent_per_step + rounds

    def local_blocked_grads(self) -> tuple[torch.Tensor | None, ...]:
        """Collective (shard group, lossless strategies): the work gradients of this rank's
        blocks."""
        grads = super().local_blocked_grads()
        return tuple(grads[k] for k in self._mine)

    def all_reduce_grad_sum_(self, grad_sum: torch.Tensor) -> None:
        """Sum over the replicas, then over the shard group (unless ``REPLICATE``)."""
        if self._replicas > 1:
            dist.all_reduce(grad_sum, group=self._replicate_group)
        super().all_reduce_grad_sum_(grad_sum)

    @torch.no_grad()
    def update_params(self, local_block_updates: Sequence[torch.Tensor]) -> None:
        """Collective (whole mesh): exchange over the replicas, then scatter to the shards."""
        updates = [local_block_updates[k] for k in self._exchange_order]
        if self._communicate_params:
            if updates:
                torch._foreach_add_(self._owned_work_blocks, updates)
            redistribute_and_update_params(self._buffers, self._owned_work_blocks)
        else:
            # DEFAULT: the work blocks are the shards, the updates are added to them directly.
            accumulate = self._strategy == FSDPParamAssignmentStrategy.DEFAULT
            redistribute_and_update_params(self._buffers, updates, accumulate=accumulate)
        self._send_results_to_shards()
