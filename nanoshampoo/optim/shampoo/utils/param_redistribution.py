"""ZeRO-1-style parameter exchange for DDP Shampoo: each rank updates the blocks it owns, then
all ranks swap the results so that every rank ends with identical parameters.

Ownership comes from ``shampoo_utils.distribute_buffer_sizes``. The exchange is a sequence of
``torch.distributed.all_to_all`` rounds: in round ``k`` every rank sends its ``k``-th largest
owned block to every rank. ``all_to_all`` needs equal chunk sizes on the gloo backend, so every
chunk of round ``k`` is padded with zeros to the largest block of that round, and a rank that
owns fewer blocks than there are rounds sends an all-zero chunk (gloo in torch 2.13 moves fp32,
fp16 and bf16 this way; NCCL moves any float dtype). Sending largest-first pairs blocks of
similar size in each round, which keeps the padding small (none for the speedrun GPT at 2 and 4
ranks, see ``bench/utils_param_exchange.py``). All buffers and views are built once by
:func:`prepare_update_param_buffers`; a step only copies into the send buffer, runs the rounds
and writes everything back with one ``torch._foreach_copy_``.

Usage (on every rank of ``group``)::

    assignment = distribute_buffer_sizes(blocks, world)
    buffers = prepare_update_param_buffers(blocks, assignment, communication_dtype=torch.bfloat16)
    ...  # each step:
    new_values = [compute(blocks[i]) for i in buffers.owned_block_indices]
    redistribute_and_update_params(buffers, new_values)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class UpdateParamBuffers:
    """Persistent buffers and views for :func:`redistribute_and_update_params`.

    Built by :func:`prepare_update_param_buffers`; hold on to it for the optimizer's lifetime.

    Fields:
        group: the process group (``None``: the default group, or no communication when
            ``group_size == 1``).
        group_size: number of ranks in ``group``.
        group_rank: this rank's rank in ``group``.
        communication_dtype: dtype of the buffers (values are cast to it for the transfer).
        local_blocks: the block views that receive the exchanged values, in block order.
        owned_block_indices: indices (into ``local_blocks``) of the blocks this rank computes,
            in the order their values are passed to :func:`redistribute_and_update_params`
            (round order: largest block first, ties by index).
        send_views: one view per owned block, block-shaped, inside ``send_buffer``; a rank may
            write its new values here directly instead of passing them.
        send_buffer: flat ``(sum of round sizes,)`` buffer of ``communication_dtype``; padding
            stays zero.
        recv_buffer: flat ``(group_size * sum of round sizes,)`` buffer; round ``k`` holds the
            chunks of ranks ``0..group_size-1`` one after another. Aliases ``send_buffer`` when
            ``group_size == 1``.
        received_views: per block, the block-shaped view of ``recv_buffer`` holding its value.
        round_inputs / round_outputs: per round, the ``group_size`` input and output tensors of
            its ``all_to_all`` (the input is this rank's chunk, repeated for every peer).
    """

    group: dist.ProcessGroup | None
    group_size: int
    group_rank: int
    communication_dtype: torch.dtype
    local_blocks: tuple[torch.Tensor, ...]
    owned_block_indices: tuple[int, ...]
    send_views: tuple[torch.Tensor, ...]
    send_buffer: torch.Tensor
    recv_buffer: torch.Tensor
    received_views: tuple[torch.Tensor, ...]
    round_inputs: tuple[tuple[torch.Tensor, ...], ...]
    round_outputs: tuple[tuple[torch.Tensor, ...], ...]


def _group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(size, rank)`` of ``group``; ``(1, 0)`` without an initialized process group."""
    if dist.is_available() and dist.is_initialized():
        group_size, group_rank = dist.get_world_size(group), dist.get_rank(group)
    elif group is not None:
        raise ValueError(
            "prepare_update_param_buffers: a group was given but no process group is initialized"
        )
    else:
        group_size, group_rank = 1, 0
    if group_rank < 0:
        raise ValueError("prepare_update_param_buffers: this process is not a member of group")
    return group_size, group_rank


def _check_blocks(
    blocks: Sequence[torch.Tensor],
    owners: Sequence[int],
    group_size: int,
    communication_dtype: torch.dtype | None,
) -> tuple[torch.device, torch.dtype]:
    """The blocks' one device and the transfer dtype, after checking owners, devices, dtypes."""
    bad = [rank for rank in owners if not 0 <= rank < group_size]
    if bad:
        raise ValueError(
            "prepare_update_param_buffers: owner ranks must be in "
            f"[0, {group_size}), got {sorted(set(bad))}"
        )
    devices = {block.device for block in blocks}
    if len(devices) > 1:
        raise ValueError(
            "prepare_update_param_buffers: blocks must share one device, "
            f"got {sorted(map(str, devices))}"
        )
    if communication_dtype is None:
        dtypes = {block.dtype for block in blocks}
        if len(dtypes) > 1:
            raise ValueError(
                "prepare_update_param_buffers: blocks have several dtypes "
                f"{sorted(map(str, dtypes))}; pass communication_dtype"
            )
        communication_dtype = dtypes.pop() if dtypes else torch.float32
    if not communication_dtype.is_floating_point:
        raise ValueError(
            "prepare_update_param_buffers: communication_dtype must be a floating-point dtype, "
            f"got {communication_dtype}"
        )
    return (devices.pop() if devices else torch.device("cpu")), communication_dtype


def _plan_rounds(
    blocks: Sequence[torch.Tensor], owners: Sequence[int], group_size: int
) -> tuple[list[list[int]], list[int], list[int]]:
    """``(owned_by_rank, round_sizes, round_offsets)``: each rank sends its blocks largest
    first, so that every round pairs blocks of similar size and the zero padding up to the
    round's largest block stays small."""
    owned_by_rank: list[list[int]] = [[] for _ in range(group_size)]
    for index in sorted(range(len(blocks)), key=lambda i: (-blocks[i].numel(), i)):
        owned_by_rank[owners[index]].append(index)
    num_rounds = max((len(owned) for owned in owned_by_rank), default=0)
    round_sizes = [
        max((blocks[owned[k]].numel() for owned in owned_by_rank if k < len(owned)), default=0)
        for k in range(num_rounds)
    ]
    round_offsets = [sum(round_sizes[:k]) for k in range(num_rounds)]
    return owned_by_rank, round_sizes, round_offsets


def _exchange_buffers(
    blocks: Sequence[torch.Tensor],
    owned_by_rank: list[list[int]],
    round_sizes: list[int],
    round_offsets: list[int],
    group_rank: int,
    communication_dtype: torch.dtype,
    device: torch.device,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    tuple[torch.Tensor, ...],
    list[torch.Tensor | None],
    list[tuple[torch.Tensor, ...]],
    list[tuple[torch.Tensor, ...]],
]:
    """The send and receive buffers of the round plan, this rank's send views, every block's
    view of the receive buffer, and each round's all-to-all inputs and outputs."""
    group_size, total = len(owned_by_rank), sum(round_sizes)
    send_buffer = torch.zeros(total, dtype=communication_dtype, device=device)
    recv_buffer = (
        send_buffer
        if group_size == 1
        else torch.zeros(group_size * total, dtype=communication_dtype, device=device)
    )

    def _view(buffer: torch.Tensor, start: int, block: torch.Tensor) -> torch.Tensor:
        return buffer[start : start + block.numel()].view(block.shape)

    mine = owned_by_rank[group_rank]
    send_views = tuple(
        _view(send_buffer, round_offsets[k], blocks[index]) for k, index in enumerate(mine)
    )
    received: list[torch.Tensor | None] = [None] * len(blocks)
    for rank, owned in enumerate(owned_by_rank):
        for k, index in enumerate(owned):
            start = group_size * round_offsets[k] + rank * round_sizes[k]
            received[index] = _view(recv_buffer, start, blocks[index])

    round_inputs, round_outputs = [], []
    for offset, size in zip(round_offsets, round_sizes, strict=True):
        if size == 0 or group_size == 1:
            continue  # nothing to move: all blocks of the round are empty, or we are alone
        chunk = send_buffer[offset : offset + size]
        round_inputs.append((chunk,) * group_size)
        segment = recv_buffer[group_size * offset : group_size * (offset + size)]
        round_outputs.append(tuple(segment.split(size)))

    return send_buffer, recv_buffer, send_views, received, round_inputs, round_outputs


def prepare_update_param_buffers(
    blocks: Sequence[torch.Tensor],
    block_assignment: Sequence[tuple[int, int]],
    group: dist.ProcessGroup | None = None,
    communication_dtype: torch.dtype | None = None,
) -> UpdateParamBuffers:
    """Allocate the exchange buffers once, for a fixed list of blocks and their owners.

    Args:
        blocks: this rank's views of ALL blocks of all parameters (e.g. from
            ``multi_dim_split``), in the same order on every rank, all on one device. They may be
            non-contiguous views; they are written in place by the exchange.
        block_assignment: one ``(buffer_size, owner_rank)`` per block, as returned by
            ``distribute_buffer_sizes`` (only the owner rank is used); owners are ranks of
            ``group``.
        group: the process group; ``None`` means the default group. Without an initialized
            process group the exchange is local (group size 1).
        communication_dtype: floating dtype of the transfer; ``None`` means the blocks' dtype
            (then they must all share one).

    Returns:
        The :class:`UpdateParamBuffers` to pass to :func:`redistribute_and_update_params`.
        Memory: the receive buffer holds one copy of all blocks in ``communication_dtype`` plus
        the round padding; the send buffer is ``1 / group_size`` of that.

    Raises:
        ValueError: lengths differ, an owner rank is outside ``[0, group_size)``, blocks on
            several devices, mixed block dtypes without ``communication_dtype``, or a
            non-floating ``communication_dtype``.

    Example (one process, no process group: the exchange is local):
        >>> param = torch.zeros(4, 2)
        >>> buffers = prepare_update_param_buffers([param[:2], param[2:]], [(64, 0), (64, 0)])
        >>> buffers.group_size, buffers.owned_block_indices, buffers.send_buffer.shape
        (1, (0, 1), torch.Size([8]))
    """
    if len(block_assignment) != len(blocks):
        raise ValueError(
            "prepare_update_param_buffers: block_assignment must have one entry per block, got "
            f"len(block_assignment)={len(block_assignment)} and len(blocks)={len(blocks)}"
        )
    group_size, group_rank = _group_size_and_rank(group)
    owners = [rank for _, rank in block_assignment]
    device, communication_dtype = _check_blocks(blocks, owners, group_size, communication_dtype)
    owned_by_rank, round_sizes, round_offsets = _plan_rounds(blocks, owners, group_size)
    send_buffer, recv_buffer, send_views, received, round_inputs, round_outputs = _exchange_buffers(
        blocks, owned_by_rank, round_sizes, round_offsets, group_rank, communication_dtype, device
    )
    return UpdateParamBuffers(
        group=group,
        group_size=group_size,
        group_rank=group_rank,
        communication_dtype=communication_dtype,
        local_blocks=tuple(blocks),
        owned_block_indices=tuple(owned_by_rank[group_rank]),
        send_views=send_views,
        send_buffer=send_buffer,
        recv_buffer=recv_buffer,
        received_views=tuple(view for view in received if view is not None),
        round_inputs=tuple(round_inputs),
        round_outputs=tuple(round_outputs),
    )


@torch.no_grad()
def redistribute_and_update_params(
    buffers: UpdateParamBuffers,
    owned_values: Sequence[torch.Tensor] | None = None,
    accumulate: bool = False,
) -> None:
    """Exchange the owned blocks' values with all ranks and write them into every local block.

    Collective: every rank of ``buffers.group`` must call it with buffers prepared from the same
    blocks and assignment.

    Args:
        buffers: from :func:`prepare_update_param_buffers`.
        owned_values: new values of this rank's blocks, one per ``buffers.owned_block_indices``,
            each shaped like its block (any float dtype; cast to the communication dtype).
            ``None`` when they were already written into ``buffers.send_views``.
        accumulate: ``False``: the blocks become the received values (``_foreach_copy_``).
            ``True``: the received values are updates added to the blocks (``_foreach_add_``).

    After the call every rank holds identical blocks: the owner's values, rounded through the
    communication dtype (the owner also takes the rounded value, so ranks never drift apart).

    Raises:
        ValueError: ``owned_values`` has the wrong length or a wrong shape.

    Example (one process; with a process group every rank makes the same call):
        >>> param = torch.zeros(4, 2)
        >>> buffers = prepare_update_param_buffers([param[:2], param[2:]], [(64, 0), (64, 0)])
        >>> redistribute_and_update_params(buffers, [torch.ones(2, 2), torch.full((2, 2), 2.0)])
        >>> param
        tensor([[1., 1.],
                [1., 1.],
                [2., 2.],
                [2., 2.]])
    """
    if owned_values is not None:
        if len(owned_values) != len(buffers.send_views):
            raise ValueError(
                "redistribute_and_update_params: expected one value per owned block "
                f"({len(buffers.send_views)}), got {len(owned_values)}"
            )
        for view, value, index in zip(
            buffers.send_views, owned_values, buffers.owned_block_indices, strict=True
        ):
            if value.shape != view.shape:
                raise ValueError(
                    f"redistribute_and_update_params: value for block {index} has shape "
                    f"{tuple(value.shape)}, expected {tuple(view.shape)}"
                )
        if owned_values:
            torch._foreach_copy_(list(buffers.send_views), list(owned_values))
    for inputs, outputs in zip(buffers.round_inputs, buffers.round_outputs, strict=True):
        dist.all_to_all(list(outputs), list(inputs), group=buffers.group)
    if not buffers.local_blocks:
        return
    if accumulate:
        torch._foreach_add_(list(buffers.local_blocks), list(buffers.received_views))
    else:
        torch._foreach_copy_(list(buffers.local_blocks), list(buffers.received_views))
