"""Shampoo on FSDP2 parameters: ``DTensor``s that ``fully_shard`` sharded on dim 0.

FSDP2 splits dim 0 of every parameter like ``torch.chunk``: ``ceil(d0 / n)`` rows per rank,
the trailing ranks shorter or empty (:func:`shard_row_ranges`). Gradients arrive sharded the
same way (FSDP has already reduce-scattered them). Three ways to run Shampoo on them
(:class:`FSDPParamAssignmentStrategy`):

``DEFAULT`` (lossy, no communication): every rank blocks its own local shard ``(rows_r, *rest)``
exactly as single-device Shampoo blocks a whole parameter (merge small dims, split dims at
``max_preconditioner_dim``) and preconditions those blocks. Blocks therefore never cross a shard
boundary: a ``(1000, 512)`` weight on 4 ranks is four ``(250, 512)`` blocks, each with its own
``250 x 250`` and ``512 x 512`` factors, where a single device keeps one ``(1000, 512)`` block.
The result equals single-device Shampoo run on the local shards as separate parameters.
Block names are ``shard_{r}-block_{j}``, so its checkpoints load only at the same shard count.

``ROUND_ROBIN`` (lossless): every parameter has one owner rank, the group's ``owner_ranks``
map (``split_param_groups`` attaches it: greedy longest-first over the parameters' bytes,
balanced, identical on every rank) or, for a group without one, the same map computed here.
Each step one ``all_to_all_single`` brings every owner the gradient and value shards of its
parameters (the value feeds weight decay and ``communicate_params``) into persistent
full-size buffers of those parameters only; the owner runs single-device Shampoo on their
blocks; a second ``all_to_all_single`` sends each rank its rows of the update ``-lr * P``
(``communicate_params=False``) or of the updated parameter (``True``) in
``communication_dtype``. Block names are single-device ones (``block_{j}``), so a
``torch.distributed.checkpoint`` loads at any world size, or into a single-device optimizer.
Memory per rank, in parameter bytes ``B``: the owned parameters' full values and gradients
(the gradient buffers later hold the updates), about ``2B / n``, and the gather's send and
receive buffers (gradient and value: about ``2B / n`` each), which the scatter reuses: about
``6B / n`` in all (``bench/shampoo_fsdp.py`` measures it).

``REPLICATE`` (lossless, the baseline): every rank gathers every gradient and value (the same
``all_to_all_single`` with every rank an owner of everything, i.e. an all-gather) and computes
every block; each rank then applies its own rows of the update, without a second exchange.

Collective: the constructor, every :meth:`local_blocked_grads`, :meth:`all_reduce_grad_sum_`
and :meth:`update_params` must be called on every rank of the shard group, in the same order
(the optimizer does so: every rank gathers and updates, with or without local blocks).
``all_to_all_single`` with uneven splits runs on gloo (float32/float64/bfloat16, torch 2.13) and
NCCL.

The buffers, owners and copy lists are planned once in ``fully_shard_plan.py``; this module
holds the distributor and the exchanges that run every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from nanoshampoo.optim.shampoo.distributor.distributor import Distributor
from nanoshampoo.optim.shampoo.distributor.fully_shard_plan import (
    AllToAllPlan,
    assign_owners,
    owned_by,
    plan_gather,
    plan_scatter,
    plan_work,
    round_robin_owner_map,
    sharded_params,
)
from nanoshampoo.optim.shampoo.shampoo_types import (
    FSDPParamAssignmentStrategy,
    FullyShardDistributedConfig,
)
from nanoshampoo.optim.shampoo.utils.shampoo_block_info import BlockInfo


def all_to_all_(plan: AllToAllPlan) -> None:
    """Collective: send ``plan.send_buffer``'s chunks, receive into ``plan.recv_buffer``."""
    if len(plan.send_splits) == 1:
        plan.recv_buffer.copy_(plan.send_buffer)
        return
    dist.all_to_all_single(
        plan.recv_buffer, plan.send_buffer, plan.recv_splits, plan.send_splits, group=plan.group
    )


class FullyShardDistributor(Distributor):
    """Blocks of FSDP2 parameters (see the module docstring for the three strategies).

    Args:
        params: the group's parameters, ``DTensor``s ``Shard(0)`` on a 1-D mesh, one dtype.
        max_preconditioner_dim: largest block dim (int >= 1 or ``math.inf``).
        first_param_index: index of ``params[0]`` among all of the optimizer's parameters.
        config: the :class:`FullyShardDistributedConfig`.
        owner_ranks: ``ROUND_ROBIN`` only: the shard rank that computes each parameter (the
            group's ``owner_ranks`` entry); None: computed (:func:`round_robin_owner_map`).

    Raises:
        ValueError: naming ``owner_ranks``: not one int in ``[0, shard size)`` per parameter,
            or given under another strategy.

    "Work tensors" are the tensors this rank computes on: its local shards (``DEFAULT``) or
    full-size buffers of the parameters it owns (``ROUND_ROBIN``) or of all of them
    (``REPLICATE``); the local blocks are their blocks.
    """

    _shard_mesh_dim = 0
    _mesh_ndim = 1

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        max_preconditioner_dim: int | float,
        first_param_index: int,
        config: FullyShardDistributedConfig,
        owner_ranks: Sequence[int] | None = None,
    ) -> None:
        super().__init__(
            (), max_preconditioner_dim, first_param_index, config.target_parameter_dimensionality
        )
        sharded, mesh = sharded_params(params, self._shard_mesh_dim, self._mesh_ndim)
        self._sharded = sharded
        self._strategy = config.param_assignment_strategy
        self._communicate_params = config.communicate_params
        self._shard_group = None if mesh is None else mesh.get_group(self._shard_mesh_dim)
        self._shard_size = 1 if mesh is None else mesh.size(self._shard_mesh_dim)
        self._shard_rank = 0 if mesh is None else mesh.get_local_rank(self._shard_mesh_dim)
        balancing = config.load_balancing_config
        # ROUND_ROBIN: the group's owner map (split_param_groups attaches one), or the same map
        # computed here for a group without one; any other strategy refuses a map.
        self._owner_map = (
            round_robin_owner_map(sharded, self._shard_size, balancing, owner_ranks)
            if self._strategy == FSDPParamAssignmentStrategy.ROUND_ROBIN
            else None
        )
        self._owners = assign_owners(
            sharded, self._strategy, self._shard_size, balancing, self._owner_map or owner_ranks
        )
        layout = plan_work(
            sharded,
            self._owners,
            self._strategy,
            self._shard_rank,
            self._shard_size,
            self._split,
            first_param_index,
        )
        self._infos = layout.infos
        self._local_indices = layout.local_indices
        self._work_params = layout.work_params
        self._work_offsets = layout.work_offsets
        self._work_param_blocks = layout.work_param_blocks
        self._block_offsets = layout.block_offsets
        lossless = self._strategy != FSDPParamAssignmentStrategy.DEFAULT
        self._work_grads = [torch.zeros_like(w) for w in self._work_params] if lossless else []
        # The updates reuse the gradient buffers: the optimizer copies the gradients into its
        # own buffers when it reads them (``local_blocked_grads``), before any update exists.
        self._work_updates = self._work_grads if lossless and not self._communicate_params else []
        self._work_update_blocks = [b for w in self._work_updates for b in self._split(w)]
        group, me, n = self._shard_group, self._shard_rank, self._shard_size
        self._gather = (
            plan_gather(sharded, self._owners, layout, self._work_grads, me, n, group)
            if lossless
            else None
        )
        self._scatter = (
            plan_scatter(
                sharded,
                self._owners,
                layout,
                self._work_updates or self._work_params,
                self._gather,
                config.communication_dtype,
                me,
                n,
                group,
            )
            if self._strategy == FSDPParamAssignmentStrategy.ROUND_ROBIN
            else None
        )

    @property
    def owner_ranks(self) -> list[int] | None:
        """``ROUND_ROBIN``: the owner (shard rank) of each parameter, in the group's order (an
        empty parameter keeps its map entry though nobody computes it); else None."""
        if self._strategy != FSDPParamAssignmentStrategy.ROUND_ROBIN:
            return None
        return list(self._owner_map)

    # ----- the Distributor interface -------------------------------------------------------

    @property
    def global_block_info_list(self) -> tuple[BlockInfo, ...]:
        return self._infos

    @property
    def local_block_indices(self) -> tuple[int, ...]:
        return self._local_indices

    @property
    def local_block_info_list(self) -> tuple[BlockInfo, ...]:
        return tuple(self._infos[i] for i in self._local_indices)

    @property
    def local_blocked_params(self) -> tuple[torch.Tensor, ...]:
        """Blocks of the work tensors (``ROUND_ROBIN``/``REPLICATE``: refreshed by the gather)."""
        return tuple(self._work_param_blocks)

    @property
    def local_block_param_offsets(self) -> tuple[int, ...]:
        return self._block_offsets

    @property
    def strategy(self) -> FSDPParamAssignmentStrategy:
        return self._strategy

    @property
    def owned_param_offsets(self) -> tuple[int, ...]:
        """Offsets (in the group) of the parameters whose blocks this rank computes."""
        return tuple(self._work_offsets)

    @property
    def bytes_sent_per_step(self) -> int:
        """Bytes this rank sends to other ranks per step (gather plus scatter)."""
        return sum(
            plan.exchange.bytes_sent for plan in (self._gather, self._scatter) if plan is not None
        )

    @property
    def buffer_bytes(self) -> int:
        """Bytes of this rank's persistent work and exchange buffers (not the optimizer state)."""
        total = sum(
            plan.exchange.buffer_bytes for plan in (self._gather, self._scatter) if plan is not None
        )
        tensors = self._work_params + self._work_grads
        if self._strategy != FSDPParamAssignmentStrategy.DEFAULT:
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total

    @torch.no_grad()
    def local_blocked_grads(self) -> tuple[torch.Tensor | None, ...]:
        """Collective (lossless strategies): gather gradient and value shards to their owners.

        A parameter without a gradient on this rank has none on any rank (FSDP2 reduces
        gradients collectively); its blocks are reported as None and zeros travel.
        """
        if self._strategy == FSDPParamAssignmentStrategy.DEFAULT:
            result: list[torch.Tensor | None] = []
            for o, work in zip(self._work_offsets, self._work_params):
                grad = self._sharded[o].local_grad()
                count = len(self._split(work))
                if grad is None:
                    result.extend([None] * count)
                else:
                    result.extend(self._split(grad))
            return tuple(result)
        self._all_to_all_shards_to_owners()
        gathered: list[torch.Tensor | None] = []
        for o, grad in zip(self._work_offsets, self._work_grads):
            has = self._sharded[o].param.grad is not None
            gathered.extend(b if has else None for b in self._split(grad))
        return tuple(gathered)

    def _all_to_all_shards_to_owners(self) -> None:
        """Collective: every gradient (zeros where none) and value shard -> the work tensors."""
        exchange = self._gather.exchange
        targets, sources = [], []
        for q in range(self._shard_size):
            for k, o in enumerate(owned_by(self._owners, q)):
                p = self._sharded[o]
                if not p.local.numel():
                    continue
                grad = p.local_grad()
                if grad is None:
                    exchange.send_views[q][2 * k].zero_()
                else:
                    targets.append(exchange.send_views[q][2 * k])
                    sources.append(grad.reshape(-1))
                targets.append(exchange.send_views[q][2 * k + 1])
                sources.append(p.local.view(-1))
        if targets:
            torch._foreach_copy_(targets, sources)
        all_to_all_(exchange)
        if self._gather.targets:
            torch._foreach_copy_(self._gather.targets, self._gather.sources)

    def all_reduce_grad_sum_(self, grad_sum: torch.Tensor) -> None:
        """Sum over the shard group (``REPLICATE``: every rank already sees every block)."""
        if self._strategy != FSDPParamAssignmentStrategy.REPLICATE and self._shard_size > 1:
            dist.all_reduce(grad_sum, group=self._shard_group)

    @torch.no_grad()
    def update_params(self, local_block_updates: Sequence[torch.Tensor]) -> None:
        """Collective (``ROUND_ROBIN``): apply the updates of this rank's blocks to the shards."""
        if self._communicate_params or self._strategy == FSDPParamAssignmentStrategy.DEFAULT:
            if local_block_updates:
                torch._foreach_add_(self._work_param_blocks, list(local_block_updates))
        elif local_block_updates:
            torch._foreach_copy_(self._work_update_blocks, list(local_block_updates))
        self._send_results_to_shards()

    def _send_results_to_shards(self) -> None:
        """Work results (updates, or updated values) -> every rank's local shard."""
        if self._strategy == FSDPParamAssignmentStrategy.DEFAULT:
            return  # the work tensors are the shards
        if self._strategy == FSDPParamAssignmentStrategy.REPLICATE:
            shards, rows = [], []
            results = self._work_updates or self._work_params
            for o, result in zip(self._work_offsets, results):
                p = self._sharded[o]
                start, end = p.rows[self._shard_rank]
                if start < end:
                    shards.append(p.local)
                    rows.append(result[start:end])
            if shards:
                if self._communicate_params:
                    torch._foreach_copy_(shards, rows)
                else:
                    torch._foreach_add_(shards, rows)
            return
        scatter = self._scatter
        if scatter.targets:
            torch._foreach_copy_(scatter.targets, scatter.sources)
        all_to_all_(scatter.exchange)
        if scatter.received_shards:
            if self._communicate_params:
                torch._foreach_copy_(scatter.received_shards, scatter.received_views)
            else:
                torch._foreach_add_(scatter.received_shards, scatter.received_views)
