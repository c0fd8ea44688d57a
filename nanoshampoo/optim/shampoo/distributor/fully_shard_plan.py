"""The buffer planning of Shampoo on FSDP2 parameters: who computes what, into which buffers.

Everything here is decided once, at construction, and is identical on every rank; nothing here
talks to another rank (the exchanges themselves are ``fully_shard_distributor.py``'s):

- :func:`sharded_params` describes ``fully_shard`` parameters (:class:`ShardedParam`, with
  FSDP2's dim-0 split :func:`shard_row_ranges`);
- :func:`assign_owners` picks the ranks that compute each parameter, per
  :class:`FSDPParamAssignmentStrategy` (under ``ROUND_ROBIN`` from the group's ``owner_ranks``
  map, :func:`check_owner_ranks`, or the same map computed here for a group without one);
- :func:`plan_work` lists the global blocks and this rank's work tensors and blocks
  (:class:`WorkLayout`);
- :func:`plan_gather` and :func:`plan_scatter` lay out the flat send and receive buffers of the
  two ``all_to_all_single`` exchanges (:class:`AllToAllPlan`) and the copy lists between those
  buffers and the work tensors (:class:`GatherPlan`, :class:`ScatterPlan`). The scatter reuses
  the gather's buffers when their dtype matches, so the exchanges cost about ``4B / n`` of
  buffer bytes per rank for parameter bytes ``B`` (``bench/shampoo_fsdp.py`` measures it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanoshampoo.optim.shampoo.config_checks import field_error
from nanoshampoo.optim.shampoo.shampoo_types import FSDPParamAssignmentStrategy
from nanoshampoo.optim.shampoo.utils.load_balancing_utils import LoadBalancingConfig
from nanoshampoo.optim.shampoo.utils.shampoo_block_info import BlockInfo
from nanoshampoo.optim.shampoo.utils.shampoo_utils import owner_ranks_by_bucket
from nanoshampoo.validation import is_int


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


def _check_placement(param: torch.Tensor, index: int, shard_mesh_dim: int, mesh_ndim: int) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        raise ValueError(
            f"params[{index}] must be a DTensor (a fully_shard parameter), got "
            f"{type(param).__name__}"
        )
    expected = tuple(Shard(0) if d == shard_mesh_dim else Replicate() for d in range(mesh_ndim))
    if param.device_mesh.ndim != mesh_ndim or tuple(param.placements) != expected:
        raise ValueError(
            f"params[{index}] must have placements {expected} on a {mesh_ndim}-D mesh, got "
            f"{tuple(param.placements)} on a {param.device_mesh.ndim}-D mesh"
        )


def sharded_params(
    params: Sequence[torch.Tensor], shard_mesh_dim: int, mesh_ndim: int
) -> tuple[list[ShardedParam], object]:
    """Describe ``params`` (DTensors of one mesh, ``Shard(0)`` on ``shard_mesh_dim``, replicated
    on the other dims) and return them with their mesh.

    Raises:
        ValueError: a parameter is not a DTensor, has another mesh, mesh rank or placement, is
            0-D, or the shard disagrees with FSDP2's dim-0 split; or the dtypes differ.
    """
    mesh = None
    result = []
    for index, param in enumerate(params):
        _check_placement(param, index, shard_mesh_dim, mesh_ndim)
        if mesh is None:
            mesh = param.device_mesh
        elif param.device_mesh != mesh:
            raise ValueError(f"params[{index}] is on another device mesh than params[0]")
        if param.dim() == 0:
            raise ValueError(f"params[{index}] is 0-D; fully_shard shards dim 0")
        if param.dtype != params[0].dtype:
            raise ValueError(
                f"params[{index}] has dtype {param.dtype}, params[0] has {params[0].dtype}"
            )
        shape = tuple(param.shape)
        rows = shard_row_ranges(shape[0], mesh.size(shard_mesh_dim))
        with torch.no_grad():
            local = param.to_local().detach()
        start, end = rows[mesh.get_local_rank(shard_mesh_dim)]
        if tuple(local.shape) != (end - start, *shape[1:]) or not local.is_contiguous():
            raise ValueError(
                f"params[{index}]: local shard {tuple(local.shape)} is not FSDP2's contiguous "
                f"dim-0 chunk {(end - start, *shape[1:])}"
            )
        result.append(ShardedParam(param, local, shape, rows))
    return result, mesh


def check_owner_ranks(owner_ranks: object, num_params: int, num_ranks: int) -> list[int]:
    """``owner_ranks`` (a group's ``ROUND_ROBIN`` owner map) as a list, checked.

    Raises:
        ValueError: naming ``owner_ranks``, unless it is a list or tuple of ``num_params`` ints
            (not bools), each ``0 <= rank < num_ranks``.
    """
    if not isinstance(owner_ranks, (list, tuple)):
        raise field_error(
            "owner_ranks",
            f"owner_ranks must be a list of one owner rank per parameter of the group, got "
            f"{type(owner_ranks).__name__}",
        )
    if len(owner_ranks) != num_params:
        raise field_error(
            "owner_ranks",
            f"owner_ranks has {len(owner_ranks)} entries for the group's {num_params} params "
            "(one owner rank per parameter, in the group's order)",
        )
    for i, rank in enumerate(owner_ranks):
        if not is_int(rank) or not 0 <= rank < num_ranks:
            raise field_error(
                "owner_ranks",
                f"owner_ranks[{i}]={rank!r} is not a shard rank: it must be an int in "
                f"[0, {num_ranks}) for a shard group of {num_ranks} ranks",
            )
    return [int(rank) for rank in owner_ranks]


def round_robin_owner_map(
    sharded: Sequence[ShardedParam],
    num_shards: int,
    load_balancing_config: LoadBalancingConfig | None = None,
    owner_ranks: Sequence[int] | None = None,
) -> list[int]:
    """The ``ROUND_ROBIN`` owner of each parameter: ``owner_ranks`` checked
    (:func:`check_owner_ranks`), or without it the map ``split_param_groups`` attaches to an
    unsplit group, :func:`owner_ranks_by_bucket` of the whole parameters as one bucket."""
    if owner_ranks is not None:
        return check_owner_ranks(owner_ranks, len(sharded), num_shards)
    # Whole parameters are assigned, so the cost models see their full (global) shapes.
    buckets = [[p.param for p in sharded]]
    return owner_ranks_by_bucket(buckets, num_shards, load_balancing_config)[0]


def assign_owners(
    sharded: Sequence[ShardedParam],
    strategy: FSDPParamAssignmentStrategy,
    num_shards: int,
    load_balancing_config: LoadBalancingConfig | None = None,
    owner_ranks: Sequence[int] | None = None,
) -> list[tuple[int, ...]]:
    """Per parameter, the shard ranks that compute its whole blocks (``()``: none).

    ``DEFAULT``: nobody (every rank computes its own shard's blocks instead). ``REPLICATE``:
    every rank. ``ROUND_ROBIN``: one owner each, :func:`round_robin_owner_map` (the group's
    ``owner_ranks``, or computed as ``split_param_groups`` computes it, balanced by
    ``load_balancing_config``'s cost model, default bytes).

    Raises:
        ValueError: naming ``owner_ranks``, a map under another strategy or a bad map.
    """
    if owner_ranks is not None and strategy != FSDPParamAssignmentStrategy.ROUND_ROBIN:
        raise field_error(
            "owner_ranks",
            f"owner_ranks is read under param_assignment_strategy=ROUND_ROBIN only, got "
            f"{strategy.name}: leave it out of the group",
        )
    if strategy == FSDPParamAssignmentStrategy.DEFAULT:
        owners: list[tuple[int, ...]] = [()] * len(sharded)
    elif strategy == FSDPParamAssignmentStrategy.REPLICATE:
        owners = [tuple(range(num_shards))] * len(sharded)
    else:
        ranks = round_robin_owner_map(sharded, num_shards, load_balancing_config, owner_ranks)
        owners = [(r,) for r in ranks]
    # An empty parameter has no blocks: nobody computes it, nothing travels for it.
    return [ranks if math.prod(p.shape) else () for ranks, p in zip(owners, sharded)]


def owned_by(owners: Sequence[tuple[int, ...]], rank: int) -> list[int]:
    """Offsets of the parameters that ``rank`` computes."""
    return [o for o, ranks in enumerate(owners) if rank in ranks]


@dataclass
class WorkLayout:
    """The global blocks and what this rank computes on.

    Fields:
        infos: every block of the group, the same list on every rank.
        local_indices: indices into ``infos`` of this rank's blocks.
        work_params: the tensors this rank computes on (local shards, or full-size buffers).
        work_offsets: per work tensor, the offset of its parameter in the group.
        work_param_blocks: the blocks of the work tensors, in ``local_indices`` order.
        block_offsets: per work block, the offset of its parameter.
    """

    infos: tuple[BlockInfo, ...]
    local_indices: tuple[int, ...]
    work_params: list[torch.Tensor]
    work_offsets: list[int]
    work_param_blocks: list[torch.Tensor]
    block_offsets: tuple[int, ...]


def plan_work(
    sharded: Sequence[ShardedParam],
    owners: Sequence[tuple[int, ...]],
    strategy: FSDPParamAssignmentStrategy,
    shard_rank: int,
    num_shards: int,
    split: Callable[[torch.Tensor], tuple[torch.Tensor, ...]],
    first_param_index: int,
) -> WorkLayout:
    """Global block infos, this rank's work tensors and blocks.

    ``DEFAULT``: every shard's blocks, named ``shard_{r}-block_{j}``; the work tensors are the
    local shards. Otherwise: single-device blocks (``block_{j}``) of the whole parameters; the
    work tensors are new zero full-size buffers of the parameters this rank computes. ``split``
    cuts a tensor into the group's blocks (``Distributor._split``).
    """

    def count(shape: tuple[int, ...]) -> int:
        return len(split(torch.empty(shape, device="meta")))

    infos: list[BlockInfo] = []
    local: list[int] = []
    work_params: list[torch.Tensor] = []
    work_offsets: list[int] = []
    for offset, p in enumerate(sharded):
        index = first_param_index + offset
        if strategy == FSDPParamAssignmentStrategy.DEFAULT:
            for r in range(num_shards):
                blocks = count(p.shard_shape(r))
                if r == shard_rank and blocks:
                    local.extend(range(len(infos), len(infos) + blocks))
                    work_params.append(p.local)
                    work_offsets.append(offset)
                infos.extend(
                    BlockInfo(p.param, (index, f"shard_{r}-block_{j}")) for j in range(blocks)
                )
            continue
        blocks = count(p.shape)
        if shard_rank in owners[offset]:
            local.extend(range(len(infos), len(infos) + blocks))
            work_params.append(torch.zeros(p.shape, dtype=p.local.dtype, device=p.local.device))
            work_offsets.append(offset)
        infos.extend(BlockInfo(p.param, (index, f"block_{j}")) for j in range(blocks))
    per_work = [split(w) for w in work_params]
    return WorkLayout(
        infos=tuple(infos),
        local_indices=tuple(local),
        work_params=work_params,
        work_offsets=work_offsets,
        work_param_blocks=[b for blocks in per_work for b in blocks],
        block_offsets=tuple(o for o, blocks in zip(work_offsets, per_work) for _ in blocks),
    )


class AllToAllPlan:
    """The persistent flat buffers of one ``all_to_all_single``, cut into per-piece views.

    Args:
        send_numels: per destination rank, the element counts of the pieces sent to it.
        recv_numels: per source rank, the element counts of the pieces received from it.
        dtype, device: of both buffers.
        group: the process group (``None``: default); ``group_rank``: this rank in it.
        storage: optional ``(send, recv)`` flat tensors of ``dtype`` to carve the buffers from
            (another plan's buffers, free while this plan runs); they must be large enough.

    ``send_views[q][k]`` / ``recv_views[s][k]`` are flat views of the buffers;
    ``send_splits`` / ``recv_splits`` are the per-rank element counts the collective takes.
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
        return (
            self.send_buffer.numel() + self.recv_buffer.numel()
        ) * self.send_buffer.element_size()


@dataclass
class GatherPlan:
    """Gradient then value shard of every parameter an owner computes, to that owner.

    Fields:
        exchange: the buffers; per destination ``q``, piece ``2k`` / ``2k + 1`` is the gradient
            / value shard of the ``k``-th parameter ``q`` owns.
        targets, sources: after the exchange, ``targets[i].copy_(sources[i])`` fills the rows
            of the work gradients and values from the received pieces.
    """

    exchange: AllToAllPlan
    targets: list[torch.Tensor]
    sources: list[torch.Tensor]


def plan_gather(
    sharded: Sequence[ShardedParam],
    owners: Sequence[tuple[int, ...]],
    layout: WorkLayout,
    work_grads: Sequence[torch.Tensor],
    shard_rank: int,
    num_shards: int,
    group: dist.ProcessGroup | None,
) -> GatherPlan:
    """Lay out the gather (``ROUND_ROBIN`` and ``REPLICATE``)."""
    me, n = shard_rank, num_shards
    send = [
        [sharded[o].shard_numel(me) for o in owned_by(owners, q) for _ in (0, 1)] for q in range(n)
    ]
    mine = owned_by(owners, me)
    recv = [[sharded[o].shard_numel(s) for o in mine for _ in (0, 1)] for s in range(n)]
    local = sharded[0].local
    exchange = AllToAllPlan(send, recv, local.dtype, local.device, group, me)
    work = dict(zip(layout.work_offsets, zip(work_grads, layout.work_params)))
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    for s in range(n):
        for k, o in enumerate(mine):
            start, end = sharded[o].rows[s]
            if start == end:
                continue
            grad, value = work[o]
            targets += [grad[start:end].reshape(-1), value[start:end].reshape(-1)]
            sources += [exchange.recv_views[s][2 * k], exchange.recv_views[s][2 * k + 1]]
    return GatherPlan(exchange, targets, sources)


@dataclass
class ScatterPlan:
    """Rows of every owned parameter's update (or new value), to the rank holding them.

    Fields:
        exchange: the buffers (carved from the gather's where the dtype allows).
        targets, sources: before the exchange, ``targets[i].copy_(sources[i])`` packs the rows
            of the owned results into the send buffer.
        received_shards, received_views: after it, each local shard (flat) and the received
            piece that updates it.
    """

    exchange: AllToAllPlan
    targets: list[torch.Tensor]
    sources: list[torch.Tensor]
    received_shards: list[torch.Tensor]
    received_views: list[torch.Tensor]


def plan_scatter(
    sharded: Sequence[ShardedParam],
    owners: Sequence[tuple[int, ...]],
    layout: WorkLayout,
    results: Sequence[torch.Tensor],
    gather: GatherPlan | None,
    communication_dtype: torch.dtype,
    shard_rank: int,
    num_shards: int,
    group: dist.ProcessGroup | None,
) -> ScatterPlan:
    """Lay out the scatter (``ROUND_ROBIN``); ``results`` are the work tensors that travel."""
    me, n = shard_rank, num_shards
    mine = owned_by(owners, me)
    send = [[sharded[o].shard_numel(q) for o in mine] for q in range(n)]
    recv = [[sharded[o].shard_numel(me) for o in owned_by(owners, s)] for s in range(n)]
    # The gather's buffers are idle by the time of the scatter, and big enough: the gather
    # receives 2x the owned elements and sends 2x the local shard, the scatter sends 1x and
    # receives 1x of those.
    storage = None
    if gather is not None and gather.exchange.send_buffer.dtype == communication_dtype:
        storage = (gather.exchange.recv_buffer, gather.exchange.send_buffer)
    exchange = AllToAllPlan(
        send, recv, communication_dtype, sharded[0].local.device, group, me, storage
    )
    by_offset = dict(zip(layout.work_offsets, results))
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    for q in range(n):
        for k, o in enumerate(mine):
            start, end = sharded[o].rows[q]
            if start < end:
                targets.append(exchange.send_views[q][k])
                sources.append(by_offset[o][start:end].reshape(-1))
    shards: list[torch.Tensor] = []
    views: list[torch.Tensor] = []
    for s in range(n):
        for k, o in enumerate(owned_by(owners, s)):
            if sharded[o].local.numel():
                shards.append(sharded[o].local.view(-1))
                views.append(exchange.recv_views[s][k])
    return ScatterPlan(exchange, targets, sources, shards, views)
