"""What the Shampoo layers need to know about one block of one parameter."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def allocate_zeros_on_device(
    size: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Default :attr:`BlockInfo.allocate_zeros_tensor`: a plain ``torch.zeros`` on ``device``.

    Example:
        >>> allocate_zeros_on_device((2,), torch.float16, torch.device("cpu"))
        tensor([0., 0.], dtype=torch.float16)
    """
    return torch.zeros(size, dtype=dtype, device=device)


def identity_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Default :attr:`BlockInfo.get_tensor`: the stored tensor is already the local tensor.

    Example:
        >>> t = torch.ones(2)
        >>> identity_tensor(t) is t
        True
    """
    return tensor


@dataclass
class BlockInfo:
    """One block of a parameter, as the preconditioners and distributors see it.

    Fields:
        param: the parameter (``nn.Parameter`` or tensor) the block belongs to; preconditioner
            state for the block lives on ``param.device``.
        composable_block_ids: ``(param_index, block_name)``, e.g. ``(3, "block_1")``; the pair is
            unique within an optimizer and is used as the key of the block's state.
        allocate_zeros_tensor: ``(size, dtype, device) -> Tensor`` that allocates a zero-filled
            state tensor for the block. A distributor may replace it (e.g. to allocate inside a
            shared buffer); the default allocates with ``torch.zeros``.
        get_tensor: maps a tensor made by ``allocate_zeros_tensor`` to the local dense tensor to
            compute with. The default is the identity.

    Example:
        >>> p = torch.zeros(4, 3)
        >>> info = BlockInfo(param=p, composable_block_ids=(0, "block_0"))
        >>> info.allocate_zeros_tensor((4, 4), torch.float32, p.device).shape
        torch.Size([4, 4])
    """

    param: torch.Tensor
    composable_block_ids: tuple[int, str]
    allocate_zeros_tensor: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = (
        allocate_zeros_on_device
    )
    get_tensor: Callable[[torch.Tensor], torch.Tensor] = identity_tensor
