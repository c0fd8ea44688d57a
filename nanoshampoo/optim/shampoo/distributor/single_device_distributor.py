"""Single device: this process computes every block and updates the parameters in place."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanoshampoo.optim.shampoo.distributor.distributor import Distributor


class SingleDeviceDistributor(Distributor):
    """Every block is local; updates are added to the parameter views with one foreach call.

    Example:
        >>> w = torch.zeros(2, 2)
        >>> d = SingleDeviceDistributor([w], max_preconditioner_dim=1024, first_param_index=0)
        >>> [tuple(v.shape) for v in d.local_blocked_params]  # small dims merge into one
        [(4,)]
        >>> d.update_params([torch.ones(4)])
        >>> w
        tensor([[1., 1.],
                [1., 1.]])
    """

    @property
    def local_block_indices(self) -> tuple[int, ...]:
        return tuple(range(len(self.global_block_info_list)))

    def all_reduce_grad_sum_(self, grad_sum: torch.Tensor) -> None:
        """Nothing to reduce: this process holds every block of the group."""

    def update_params(self, local_block_updates: Sequence[torch.Tensor]) -> None:
        if local_block_updates:
            torch._foreach_add_(list(self._global_block_views), list(local_block_updates))
