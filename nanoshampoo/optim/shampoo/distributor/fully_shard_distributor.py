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

``ROUND_ROBIN`` (lossless): every parameter has one owner rank, chosen by
``distribute_buffer_sizes`` over the parameters' bytes (greedy, balanced, identical on every
rank). Each step one ``all_to_all_single`` brings every owner the gradient and value shards of
its parameters (the value feeds weight decay and ``communicate_params``) into persistent
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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanoshampoo.optim.shampoo.distributor.distributor import Distributor, split_into_blocks
from nanoshampoo.optim.shampoo.shampoo_types import (
    FSDPParamAssignmentStrategy,
    FullyShardDistributedConfig,
)
from nanoshampoo.optim.shampoo.utils.shampoo_block_info import BlockInfo
from nanoshampoo.optim.shampoo.utils.shampoo_utils import distribute_buffer_sizes


def shard_row_ranges(dim0: int, num_shards: int) -> tuple[tuple[int, int], ...]:
    """FSDP2's split of dim 0: ``(start, end)`` rows per shard rank (``torch.chunk`` sizes).

    Example:
        >>> shard_row_ranges(5, 4), shard_row_ranges(2, 4)
        (((0, 2), (2, 4), (4, 5), (5, 5)), ((0, 1), (1, 2), (2, 2), (2, 2)))
    """
    chunk = -(-dim0 // num_shards)
    return tuple((min(r * chunk, dim0), min((r + 1) * chunk, dim0)) for r in range(num_shards))


@dataclass(frozen=True)
class ShardedParam:
    """One FSDP2 parameter as a distributor sees it.

    Fields:
        param: the ``DTensor`` parameter (key of the optimizer state).
        local: this rank's shard, a plain tensor aliasing the parameter's storage (contiguous,
            ``(rows[rank][1] - rows[rank][0], *shape[1:])``).
        shape: the global shape.
        rows: ``(start, end)`` rows of dim 0 per shard rank.
    """

    param: torch.Tensor
    local: torch.Tensor
    shape: tuple[int, ...]
    rows: tuple[tuple[int, int], ...]

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    def shard_shape(self, shard_rank: int) -> tuple[int, ...]:
        start, end = self.rows[shard_rank]
        return (end - start, *self.shape[1:])

    def shard_numel(self, shard_rank: int) -> int:
        start, end = self.rows[shard_rank]
        return (end - start) * self.row_numel

    def local_grad(self) -> torch.Tensor | None:
        """This rank's gradient shard (plain tensor), or None."""
        grad = self.param.grad
        if grad is None:
            return None
        return grad.to_local() if hasattr(grad, "to_local") else grad


def sharded_params(
    params: Sequence[torch.Tensor], shard_mesh_dim: int, mesh_ndim: int
) -> tuple[list[ShardedParam], object]:
    """Describe ``params`` (DTensors of one mesh, ``Shard(0)`` on ``shard_mesh_dim``, replicated
    on the other dims) and return them with their mesh.

    Raises:
        ValueError: a parameter is not a DTensor, has another mesh, mesh rank or placement, is
            0-D, or the shard disagrees with FSDP2's dim-0 split; or the dtypes differ.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = None
    result = []
    for index, param in enumerate(params):
        if not isinstance(param, DTensor):
            raise ValueError(
                f"params[{index}] must be a DTensor (a fully_shard parameter), "
                f"got {type(param).__name__}"
            )
        expected = tuple(Shard(0) if d == shard_mesh_dim else Replicate() for d in range(mesh_ndim))
        if param.device_mesh.ndim != mesh_ndim or tuple(param.placements) != expected:
            raise ValueError(
                f"params[{index}] must have placements {expected} on a {mesh_ndim}-D mesh, got "
                f"{tuple(param.placements)} on a {param.device_mesh.ndim}-D mesh"
            )
        if mesh is None:
            mesh = param.device_mesh
        elif param.device_mesh != mesh:
            raise ValueError(f"params[{index}] is on another device mesh than params[0]")
        if param.dim() == 0:
            raise ValueError(f"params[{index}] is 0-D; fully_shard shards dim 0")
        if param.dtype != params[0].dtype:
            raise ValueError(f"params[{index}] has dtype {param.dtype}, params[0] has {params[0].dtype}")
        shape = tuple(param.shape)
        rows = shard_row_ranges(shape[0], mesh.size(shard_mesh_dim))
        with torch.no_grad():
            local = param.to_local().detach()
        shard_rank = mesh.get_local_rank(shard_mesh_dim)
        start, end = rows[shard_rank]
        if tuple(local.shape) != (end - start, *shape[1:]) or not local.is_contiguous():
            raise ValueError(
                f"params[{index}]: local shard {tuple(local.shape)} is not FSDP2's contiguous "
                f"dim-0 chunk {(end - start, *shape[1:])}"
            )
        result.append(ShardedParam(param, local, shape, rows))
    return result, mesh


class AllToAllPlan:
    """One ``all_to_all_single`` over persistent flat buffers, cut into per-piece views.

    Args:
        send_numels: per destination rank, the element counts of the pieces sent to it.
        recv_numels: per source rank, the element counts of the pieces received from it.
        dtype, device: of both buffers.
        group: the process group (``None``: default); ``group_rank``: this rank in it.
        storage: optional ``(send, recv)`` flat tensors of ``dtype`` to carve the buffers from
            (another plan's buffers, free while this plan runs); they must be large enough.

    ``send_views[q][k]`` / ``recv_views[s][k]`` are flat views of the buffers.
    """

    def __init__(
        self,
        send_numels: Sequence[Sequence[int]],
        recv_numels: Sequence[Sequence[int]],
        dtype: torch.dtype,
        device: torch.device,
        group: dist.ProcessGroup | None,
        group_rank: int,
        storage: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.group = group
        self.group_rank = group_rank
        self.send_splits = [sum(pieces) for pieces in send_numels]
        self.recv_splits = [sum(pieces) for pieces in recv_numels]
        sizes = (sum(self.send_splits), sum(self.recv_splits))
        self.owns_buffers = storage is None
        if storage is None:
            storage = tuple(torch.zeros(n, dtype=dtype, device=device) for n in sizes)
        elif any(t.dtype != dtype or t.numel() < n for t, n in zip(storage, sizes)):
            raise ValueError("AllToAllPlan: storage has the wrong dtype or is too small")
        self.send_buffer, self.recv_buffer = (t[:n] for t, n in zip(storage, sizes))
        self.send_views = self._cut(self.send_buffer, send_numels)
        self.recv_views = self._cut(self.recv_buffer, recv_numels)

    @staticmethod
    def _cut(buffer: torch.Tensor, numels: Sequence[Sequence[int]]) -> list[list[torch.Tensor]]:
        views, offset = [], 0
        for pieces in numels:
            row = []
            for n in pieces:
                row.append(buffer[offset : offset + n])
                offset += n
            views.append(row)
        return views

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sends to other ranks per call (its own chunk stays local)."""
        others = sum(self.send_splits) - self.send_splits[self.group_rank]
        return others * self.send_buffer.element_size()

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the buffers this plan allocated (0 when carved from another plan's)."""
        if not self.owns_buffers:
            return 0
        return (self.send_buffer.numel() + self.recv_buffer.numel()) * self.send_buffer.element_size()

    def all_to_all_(self) -> None:
        """Collective: send ``send_buffer``'s chunks, receive into ``recv_buffer``."""
        if len(self.send_splits) == 1:
            self.recv_buffer.copy_(self.send_buffer)
            return
        dist.all_to_all_single(
            self.recv_buffer, self.send_buffer, self.recv_splits, self.send_splits, group=self.group
        )


class FullyShardDistributor(Distributor):
    """Blocks of FSDP2 parameters (see the module docstring for the three strategies).

    Args:
        params: the group's parameters, ``DTensor``s ``Shard(0)`` on a 1-D mesh, one dtype.
        max_preconditioner_dim: largest block dim (int >= 1 or ``math.inf``).
        first_param_index: index of ``params[0]`` among all of the optimizer's parameters.
        config: the :class:`FullyShardDistributedConfig`.

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
    ) -> None:
        super().__init__((), max_preconditioner_dim, first_param_index)
        sharded, mesh = sharded_params(params, self._shard_mesh_dim, self._mesh_ndim)
        self._sharded = sharded
        self._strategy = config.param_assignment_strategy
        self._communicate_params = config.communicate_params
        self._shard_group = None if mesh is None else mesh.get_group(self._shard_mesh_dim)
        self._shard_size = 1 if mesh is None else mesh.size(self._shard_mesh_dim)
        self._shard_rank = 0 if mesh is None else mesh.get_local_rank(self._shard_mesh_dim)
        n = self._shard_size
        if self._strategy == FSDPParamAssignmentStrategy.DEFAULT:
            owners: list[tuple[int, ...]] = [()] * len(sharded)
        elif self._strategy == FSDPParamAssignmentStrategy.REPLICATE:
            owners = [tuple(range(n))] * len(sharded)
        else:
            # Whole parameters are assigned, so the cost models see their full shapes.
            assignment = distribute_buffer_sizes(
                [torch.empty(p.shape, dtype=p.local.dtype, device="meta") for p in sharded], n
            )
            owners = [(rank,) for _, rank in assignment]
        # An empty parameter has no blocks: nobody computes it, nothing travels for it.
        self._owners = [ranks if math.prod(p.shape) else () for ranks, p in zip(owners, sharded)]
        self._build_blocks(first_param_index)
        lossless = self._strategy != FSDPParamAssignmentStrategy.DEFAULT
        self._work_grads = [torch.zeros_like(w) for w in self._work_params] if lossless else []
        # The updates reuse the gradient buffers: the optimizer copies the gradients into its
        # own buffers when it reads them (``local_blocked_grads``), before any update exists.
        self._work_updates = self._work_grads if lossless and not self._communicate_params else []
        self._work_update_blocks = [
            b for w in self._work_updates for b in split_into_blocks(w, max_preconditioner_dim)
        ]
        self._gather = self._plan_gather() if lossless else None
        self._scatter = (
            self._plan_scatter(config)
            if self._strategy == FSDPParamAssignmentStrategy.ROUND_ROBIN
            else None
        )

    def _build_blocks(self, first_param_index: int) -> None:
        """Global block infos (the same list on every rank), this rank's work tensors and blocks.

        ``DEFAULT``: every shard's blocks, named per shard; the work tensors are the local
        shards. Otherwise: single-device blocks of the whole parameters; the work tensors are
        new full-size buffers of the parameters this rank computes.
        """
        max_dim = self._max_preconditioner_dim
        n, me = self._shard_size, self._shard_rank

        def count(shape: tuple[int, ...]) -> int:
            return len(split_into_blocks(torch.empty(shape, device="meta"), max_dim))

        infos: list[BlockInfo] = []
        local: list[int] = []
        work_params: list[torch.Tensor] = []
        work_offsets: list[int] = []
        for offset, p in enumerate(self._sharded):
            index = first_param_index + offset
            if self._strategy == FSDPParamAssignmentStrategy.DEFAULT:
                for r in range(n):
                    blocks = count(p.shard_shape(r))
                    if r == me and blocks:
                        local.extend(range(len(infos), len(infos) + blocks))
                        work_params.append(p.local)
                        work_offsets.append(offset)
                    infos.extend(BlockInfo(p.param, (index, f"shard_{r}-block_{j}")) for j in range(blocks))
                continue
            blocks = count(p.shape)
            if me in self._owners[offset]:
                local.extend(range(len(infos), len(infos) + blocks))
                work_params.append(torch.zeros(p.shape, dtype=p.local.dtype, device=p.local.device))
                work_offsets.append(offset)
            infos.extend(BlockInfo(p.param, (index, f"block_{j}")) for j in range(blocks))
        self._infos = tuple(infos)
        self._local_indices = tuple(local)
        self._work_params = work_params
        self._work_offsets = work_offsets
        per_work = [split_into_blocks(w, max_dim) for w in work_params]
        self._work_param_blocks = [b for blocks in per_work for b in blocks]
        self._block_offsets = tuple(o for o, blocks in zip(work_offsets, per_work) for _ in blocks)

    # ----- exchange plans -------------------------------------------------------------------

    def _owned_by(self, rank: int) -> list[int]:
        return [o for o, owners in enumerate(self._owners) if rank in owners]

    def _plan_gather(self) -> AllToAllPlan:
        """Gradient then value shard of every parameter an owner computes, to that owner."""
        me, n, sharded = self._shard_rank, self._shard_size, self._sharded
        send = [[sharded[o].shard_numel(me) for o in self._owned_by(q) for _ in (0, 1)] for q in range(n)]
        mine = self._owned_by(me)
        recv = [[sharded[o].shard_numel(s) for o in mine for _ in (0, 1)] for s in range(n)]
        local = sharded[0].local
        plan = AllToAllPlan(send, recv, local.dtype, local.device, self._shard_group, me)
        work = dict(zip(self._work_offsets, zip(self._work_grads, self._work_params)))
        self._gather_targets, self._gather_sources = [], []
        for s in range(n):
            for k, o in enumerate(mine):
                start, end = self._sharded[o].rows[s]
                if start == end:
                    continue
                grad, value = work[o]
                self._gather_targets += [grad[start:end].reshape(-1), value[start:end].reshape(-1)]
                self._gather_sources += [plan.recv_views[s][2 * k], plan.recv_views[s][2 * k + 1]]
        return plan

    def _plan_scatter(self, config: FullyShardDistributedConfig) -> AllToAllPlan:
        """Rows of every owned parameter's update (or new value), to the rank holding them."""
        me, n = self._shard_rank, self._shard_size
        mine = self._owned_by(me)
        send = [[self._sharded[o].shard_numel(q) for o in mine] for q in range(n)]
        recv = [[self._sharded[o].shard_numel(me) for o in self._owned_by(s)] for s in range(n)]
        gather = self._gather
        # The gather's buffers are idle by the time of the scatter, and big enough: the gather
        # receives 2x the owned elements and sends 2x the local shard, the scatter sends 1x and
        # receives 1x of those.
        storage = (
            (gather.recv_buffer, gather.send_buffer)
            if gather is not None and gather.send_buffer.dtype == config.communication_dtype
            else None
        )
        plan = AllToAllPlan(
            send, recv, config.communication_dtype, self._sharded[0].local.device,
            self._shard_group, me, storage,
        )
        results = dict(zip(self._work_offsets, self._work_updates or self._work_params))
        self._scatter_targets, self._scatter_sources = [], []
        for q in range(n):
            for k, o in enumerate(mine):
                start, end = self._sharded[o].rows[q]
                if start < end:
                    self._scatter_targets.append(plan.send_views[q][k])
                    self._scatter_sources.append(results[o][start:end].reshape(-1))
        self._received_shards, self._received_views = [], []
        for s in range(n):
            for k, o in enumerate(self._owned_by(s)):
                if self._sharded[o].local.numel():
                    self._received_shards.append(self._sharded[o].local.view(-1))
                    self._received_views.append(plan.recv_views[s][k])
        return plan

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
        return sum(plan.bytes_sent for plan in (self._gather, self._scatter) if plan is not None)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of this rank's persistent work and exchange buffers (not the optimizer state)."""
        total = sum(plan.buffer_bytes for plan in (self._gather, self._scatter) if plan is not None)
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
                count = len(split_into_blocks(work, self._max_preconditioner_dim))
                if grad is None:
                    result.extend([None] * count)
                else:
                    result.extend(split_into_blocks(grad, self._max_preconditioner_dim))
            return tuple(result)
        plan = self._gather
        targets, sources = [], []
        for q in range(self._shard_size):
            for k, o in enumerate(self._owned_by(q)):
                p = self._sharded[o]
                if not p.local.numel():
                    continue
                grad = p.local_grad()
                if grad is None:
                    plan.send_views[q][2 * k].zero_()
                else:
                    targets.append(plan.send_views[q][2 * k])
                    sources.append(grad.reshape(-1))
                targets.append(plan.send_views[q][2 * k + 1])
                sources.append(p.local.view(-1))
        if targets:
            torch._foreach_copy_(targets, sources)
        plan.all_to_all_()
        if self._gather_targets:
            torch._foreach_copy_(self._gather_targets, self._gather_sources)
        gathered: list[torch.Tensor | None] = []
        for o, grad in zip(self._work_offsets, self._work_grads):
            has = self._sharded[o].param.grad is not None
            gathered.extend(b if has else None for b in split_into_blocks(grad, self._max_preconditioner_dim))
        return tuple(gathered)

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
        if self._scatter_targets:
            torch._foreach_copy_(self._scatter_targets, self._scatter_sources)
        self._scatter.all_to_all_()
        if self._received_shards:
            if self._communicate_params:
                torch._foreach_copy_(self._received_shards, self._received_views)
            else:
                torch._foreach_add_(self._received_shards, self._received_views)
