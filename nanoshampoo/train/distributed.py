"""Process-group setup for training and the DDP-style gradient average.

One entry point serves a plain process (world size 1) and ``torchrun`` (env:// rendezvous):
NCCL when the device is CUDA, gloo on CPU. A plain process that needs a group (``fully_shard``
needs one even for one rank) gets a one-rank group on an in-memory store. A process group
that already exists (e.g. one made by ``nanoshampoo.testing.distributed.run_on_gloo``) is used
as is. A group made here has a timeout: a collective waiting on a dead or hung rank fails after
it instead of hanging.

Example:
    >>> ctx = setup_distributed("cpu")
    >>> (ctx.rank, ctx.world_size, ctx.device.type)
    (0, 1, 'cpu')
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

# Gradients are averaged in flat buckets of at most this many elements: few collectives,
# bounded extra memory.
ALL_REDUCE_BUCKET_NUMEL = 2**25


@dataclass(frozen=True)
class DistributedContext:
    rank: int
    world_size: int
    device: torch.device
    owns_process_group: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(
    device: str, timeout_s: float = 600.0, need_process_group: bool = False
) -> DistributedContext:
    """Pick the device and join (or create) the process group described by the environment.

    ``timeout_s`` bounds how long a collective of a group created here waits for the others.
    ``need_process_group``: also create a group for a single process (``torchrun`` with one
    rank uses its env:// rendezvous; a plain process a one-rank group on an in-memory store).
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("TrainConfig.device is 'cuda' but CUDA is not available")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch_device = torch.device("cuda", local_rank) if device == "cuda" else torch.device("cpu")
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    owns = False
    backend = "nccl" if torch_device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
        owns = True
    elif not dist.is_initialized() and need_process_group:
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        else:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        owns = True
    if dist.is_initialized():
        return DistributedContext(dist.get_rank(), dist.get_world_size(), torch_device, owns)
    return DistributedContext(0, 1, torch_device, owns)


def teardown_distributed(ctx: DistributedContext) -> None:
    """Destroy the process group if this context created it (also after an error)."""
    if ctx.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()


def local_world_size() -> int:
    """Processes of this run on this machine (``torchrun`` sets ``LOCAL_WORLD_SIZE``)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def first_error_on_any_rank(error: str | None, ctx: DistributedContext) -> str | None:
    """Every rank learns the lowest rank's error message (``None`` if no rank has one).

    A start-up check that fails on one rank must stop every rank: otherwise the others wait in
    their next collective until the timeout. Collective; call it on every rank.
    """
    if ctx.world_size == 1:
        return error
    errors: list[str | None] = [None] * ctx.world_size
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


def any_rank_true(flag: bool, ctx: DistributedContext) -> bool:
    """Whether ``flag`` is true on any rank (one tiny all-reduce; collective)."""
    if ctx.world_size == 1:
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0], device=ctx.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def broadcast_object(value: object, ctx: DistributedContext) -> object:
    """Rank 0's ``value`` on every rank (collective)."""
    if ctx.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(ctx: DistributedContext) -> None:
    if ctx.world_size > 1:
        dist.barrier()


def all_reduce_mean_(tensor: torch.Tensor, ctx: DistributedContext) -> torch.Tensor:
    """Average ``tensor`` over ranks in place (SUM then divide: gloo has no AVG)."""
    if ctx.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor.div_(ctx.world_size)
    return tensor


def all_reduce_gradients(params: list[torch.nn.Parameter], ctx: DistributedContext) -> None:
    """Average the gradients of ``params`` over ranks, as DDP does, in flat buckets.

    A parameter without a gradient contributes zeros (and gets them), so that every rank
    issues the same collectives.
    """
    if ctx.world_size == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket: list[torch.nn.Parameter] = []
    numel = 0
    for p in params:
        if bucket and numel + p.numel() > ALL_REDUCE_BUCKET_NUMEL:
            _all_reduce_bucket(bucket, ctx)
            bucket, numel = [], 0
        bucket.append(p)
        numel += p.numel()
    if bucket:
        _all_reduce_bucket(bucket, ctx)


def _all_reduce_bucket(bucket: list[torch.nn.Parameter], ctx: DistributedContext) -> None:
    grads = [p.grad for p in bucket]
    flat = torch.cat([g.reshape(-1) for g in grads])  # type: ignore[union-attr]
    all_reduce_mean_(flat, ctx)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))  # type: ignore[union-attr]
        offset += g.numel()  # type: ignore[union-attr]


def shard_model(
    model: torch.nn.Module,
    blocks: torch.nn.ModuleList,
    ctx: DistributedContext,
    parallel: str,
    hsdp_shard_size: int,
    bf16_params: bool,
) -> None:
    """``fully_shard`` each of ``blocks``, then the root ``model`` (parameters become DTensors).

    ``parallel``: ``fsdp2`` shards over all ranks (1-D mesh); ``hsdp`` on a 2-D mesh
    ``(world / hsdp_shard_size) x hsdp_shard_size`` (replicate x shard; ``0``: the local world
    size). With ``bf16_params`` the forward/backward run on bfloat16 copies of the parameters
    and gradients are reduced in float32; the sharded parameters stay float32. FSDP averages
    the gradients over every rank of the mesh, so the trainer reduces none itself.
    Collective; raises ``UserError`` when the shard size does not divide the world size.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from nanoshampoo.errors import UserError

    if parallel == "hsdp":
        shard = hsdp_shard_size or local_world_size()
        if ctx.world_size % shard:
            raise UserError(
                f"--hsdp-shard-size {shard}: must divide the world size ({ctx.world_size})"
            )
        mesh = init_device_mesh(
            ctx.device.type, (ctx.world_size // shard, shard), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("shard",))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16_params
        else MixedPrecisionPolicy()
    )
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: the local shard of a DTensor, a plain tensor as is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


@torch.no_grad()
def broadcast_parameters(model: nn.Module, ctx: DistributedContext) -> None:
    """Make every rank start from rank 0's weights (seeding already agrees; this guarantees it)."""
    if ctx.world_size > 1:
        for p in model.parameters():
            dist.broadcast(p, src=0)


def synchronize_device(ctx: DistributedContext) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def peak_memory_mib(ctx: DistributedContext) -> tuple[float, float]:
    """CUDA: the caching allocator's peaks. CPU: the process's peak resident set, for both."""
    if ctx.device.type == "cuda":
        return (
            torch.cuda.max_memory_allocated(ctx.device) / 2**20,
            torch.cuda.max_memory_reserved(ctx.device) / 2**20,
        )
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    return peak_rss, peak_rss
