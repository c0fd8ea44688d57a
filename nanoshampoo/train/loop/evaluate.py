"""Validation loss on a fixed token budget, averaged over ranks.

Example:
    >>> loss = validation_loss(model, "data/embedded/fineweb_val_*.bin", global_batch_size=16,
    ...                        seq_len=128, val_tokens=32768, ctx=ctx, autocast=True)
    ...                        # doctest: +SKIP
"""

from __future__ import annotations

import torch
from torch import nn

from nanoshampoo.data.loader import validation_batches
from nanoshampoo.train.distributed import DistributedContext, all_reduce_mean_


@torch.no_grad()
def validation_loss(model: nn.Module, val_pattern: str, global_batch_size: int, seq_len: int,
                    val_tokens: int, ctx: DistributedContext, autocast: bool) -> float:
    """Mean next-token cross-entropy over the first ``val_tokens`` validation tokens.

    Every call reads the same tokens, so values are comparable across steps and runs.
    """
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float32, device=ctx.device)
    batches = validation_batches(val_pattern, global_batch_size, seq_len, ctx.rank,
                                 ctx.world_size, val_tokens)
    count = 0
    for inputs, targets in batches:
        inputs = inputs.to(ctx.device, non_blocking=True)
        targets = targets.to(ctx.device, non_blocking=True)
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=autocast):
            total += model(inputs, targets).float()
        count += 1
    model.train(was_training)
    return float(all_reduce_mean_(total / count, ctx).item())
