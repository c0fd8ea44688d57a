"""The distributor interface: which blocks this rank computes, and how their updates land.

A distributor is built per parameter group. It cuts every parameter into blocks (squeeze
size-1 dims, merge small dims from the back while the product stays within
``max_preconditioner_dim`` and more than ``target_parameter_dimensionality`` dims remain, split
every dim into chunks of ``max_preconditioner_dim``), decides which blocks this rank
computes (:attr:`Distributor.local_block_indices`), hands the optimizer those blocks'
gradients, completes the optimizer's gradient finiteness check over the ranks
(:meth:`Distributor.all_reduce_grad_sum_`), and applies the updates ``-lr * P`` the optimizer
computed for them (:meth:`Distributor.update_params`), exchanging them with other ranks where
needed. The optimizer uses only this interface: a new distributor implements it and is added to
``build_distributor`` in ``distributed_shampoo.py``.

Blocks are numbered globally within the group in parameter order, then block order; the
``BlockInfo.composable_block_ids`` of a block is ``(param_index, f"block_{j}")`` with
``param_index`` counted over the whole optimizer and ``j`` within the parameter.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from nanoshampoo.optim.shampoo.utils.shampoo_block_info import BlockInfo
from nanoshampoo.optim.shampoo.utils.shampoo_utils import (
    merge_small_dims,
    multi_dim_split,
)


def block_shape_plan(
    shape: Sequence[int],
    max_preconditioner_dim: int | float,
    target_dimensionality: int | float = 1,
) -> tuple[int, ...]:
    """The shape a parameter is viewed as before splitting:
    ``merge_small_dims(shape, max_preconditioner_dim, target_dimensionality)``.

    Example:
        >>> block_shape_plan((32, 3, 3), 1024), block_shape_plan((32, 3, 3), 1024, 2)
        ((288,), (32, 9))
    """
    return merge_small_dims(tuple(shape), max_preconditioner_dim, target_dimensionality)


def split_into_blocks(
    tensor: torch.Tensor,
    max_preconditioner_dim: int | float,
    target_dimensionality: int | float = 1,
) -> tuple[torch.Tensor, ...]:
    """Views of ``tensor`` (contiguous, or a gradient) as the blocks of its parameter.

    Example:
        >>> [tuple(b.shape) for b in split_into_blocks(torch.zeros(768, 3072), 1024)]
        [(768, 1024), (768, 1024), (768, 1024)]
    """
    merged = block_shape_plan(tensor.shape, max_preconditioner_dim, target_dimensionality)
    if 0 in merged:
        return ()
    return multi_dim_split(tensor.reshape(merged), max_preconditioner_dim)


class Distributor(ABC):
    """Blocks of one parameter group and the rank-local part of the work.

    Args:
        params: the group's parameters, contiguous.
        max_preconditioner_dim: largest block dim (int >= 1 or ``math.inf``).
        first_param_index: index of ``params[0]`` among all of the optimizer's parameters.
        target_dimensionality: how far small dims merge (the distributed config's
            ``target_parameter_dimensionality``; :func:`block_shape_plan`).

    Example:
        >>> from nanoshampoo.optim.shampoo.distributor.single_device_distributor import (
        ...     SingleDeviceDistributor)
        >>> w = torch.zeros(6, 4)
        >>> d = SingleDeviceDistributor([w], max_preconditioner_dim=4, first_param_index=0)
        >>> [b.composable_block_ids for b in d.local_block_info_list]
        [(0, 'block_0'), (0, 'block_1')]
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        max_preconditioner_dim: int | float,
        first_param_index: int,
        target_dimensionality: int | float = 1,
    ) -> None:
        self._params = tuple(params)
        self._max_preconditioner_dim = max_preconditioner_dim
        self._target_dimensionality = target_dimensionality
        infos: list[BlockInfo] = []
        views: list[torch.Tensor] = []
        owners: list[int] = []
        positions: list[int] = []
        for offset, param in enumerate(self._params):
            if not param.is_contiguous():
                raise ValueError(
                    f"params[{offset}] (shape {tuple(param.shape)}) must be contiguous: Shampoo "
                    "updates its blocks through views"
                )
            for j, view in enumerate(self._split(param.detach())):
                infos.append(
                    BlockInfo(
                        param=param, composable_block_ids=(first_param_index + offset, f"block_{j}")
                    )
                )
                views.append(view)
                owners.append(offset)
                positions.append(j)
        self._global_block_info_list = tuple(infos)
        self._global_block_views = tuple(views)
        self._global_block_owners = tuple(owners)
        self._global_block_positions = tuple(positions)

    def _split(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``tensor`` (a parameter, its gradient or a buffer of its shape) as this group's
        blocks."""
        return split_into_blocks(tensor, self._max_preconditioner_dim, self._target_dimensionality)

    @property
    def global_block_info_list(self) -> tuple[BlockInfo, ...]:
        """Every block of the group, on every rank."""
        return self._global_block_info_list

    @property
    @abstractmethod
    def local_block_indices(self) -> tuple[int, ...]:
        """Indices into :attr:`global_block_info_list` of the blocks this rank computes."""

    @property
    def local_block_info_list(self) -> tuple[BlockInfo, ...]:
        return tuple(self._global_block_info_list[i] for i in self.local_block_indices)

    @property
    def local_blocked_params(self) -> tuple[torch.Tensor, ...]:
        """Views of the parameters as this rank's blocks (writing to them writes the params)."""
        return tuple(self._global_block_views[i] for i in self.local_block_indices)

    @property
    def local_block_param_offsets(self) -> tuple[int, ...]:
        """For each local block, the index of its parameter within the group."""
        return tuple(self._global_block_owners[i] for i in self.local_block_indices)

    def local_blocked_grads(self) -> tuple[torch.Tensor | None, ...]:
        """This rank's blocks of the current gradients (None where a parameter has no grad)."""
        blocked: dict[int, tuple[torch.Tensor, ...] | None] = {}
        result: list[torch.Tensor | None] = []
        for index in self.local_block_indices:
            owner = self._global_block_owners[index]
            if owner not in blocked:
                grad = self._params[owner].grad
                blocked[owner] = None if grad is None else self._split(grad)
            grads = blocked[owner]
            result.append(None if grads is None else grads[self._global_block_positions[index]])
        return tuple(result)

    @abstractmethod
    def all_reduce_grad_sum_(self, grad_sum: torch.Tensor) -> None:
        """Sum ``grad_sum`` in place over every rank that holds blocks of this group (collective).

        The optimizer detects NaN/Inf gradients from one float64 scalar: the sum of this rank's
        local block gradients. After this call the scalar covers every block of the group, so
        all ranks agree on whether to step, skip or raise (none may skip an exchange that the
        others enter). A single device holds every block: the scalar is already complete.

        Args:
            grad_sum: a float64 scalar tensor on the parameters' device.
        """

    @abstractmethod
    def update_params(self, local_block_updates: Sequence[torch.Tensor]) -> None:
        """Apply ``W <- W + update`` for every block of the group on every rank.

        Args:
            local_block_updates: one tensor per local block (same order as
                :attr:`local_block_indices`), the block's shape, in any float dtype; the
                optimizer passes ``-lr * P`` (zeros for blocks without a gradient this step).
        """
