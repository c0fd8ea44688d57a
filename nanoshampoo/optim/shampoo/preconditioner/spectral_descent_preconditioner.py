"""Spectral descent (Muon): the search direction of a matrix block is ``orth(G) ~ U V^T``.

For a block ``G = U S V^T`` (reduced SVD), steepest descent under the spectral norm moves along
``U V^T``: every singular direction of the (filtered) gradient gets the same step size. Two
ways to get it, batched over a bucket of same-shape blocks:

- ``SVDOrthogonalizationConfig``: exact ``U V^T`` from ``torch.linalg.svd`` (optionally times
  the nuclear norm ``sum(S)``);
- ``NewtonSchulzOrthogonalizationConfig``: ``X_0 = G / ||G||_F`` (all singular values in
  ``(0, 1]``), then ``X <- a X + b (X X^T) X + c (X X^T)^2 X``, which maps each singular value
  ``s`` to ``p(s) = a s + b s^3 + c s^5`` and leaves ``U``, ``V`` unchanged. Iterated on the wide
  orientation so the Gram matrix ``X X^T`` is the smaller one.

Both results are multiplied by ``scale_by_dims_fn(d_in=cols, d_out=rows)``. A zero block maps to
zero (its ``U V^T`` is undefined). Stateless: nothing to checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanoshampoo.optim.shampoo.preconditioner.preconditioner import BlockBucket, Preconditioner
from nanoshampoo.optim.shampoo.shampoo_types import (
    NewtonSchulzOrthogonalizationConfig,
    SpectralDescentPreconditionerConfig,
    SVDOrthogonalizationConfig,
)

# Added to ||G||_F before dividing: keeps a zero block zero instead of NaN; far below the norm
# of any gradient block worth a step.
_NORMALIZATION_EPSILON = 1e-7


def newton_schulz_orthogonalize(
    matrices: torch.Tensor, coefficients: tuple[float, float, float], num_iterations: int
) -> torch.Tensor:
    """Approximately ``U V^T`` for each matrix of a ``(B, m, n)`` stack (quintic Newton-Schulz).

    Returns a new ``(B, m, n)`` tensor in the input's dtype.

    Example:
        >>> q = torch.linalg.qr(torch.randn(6, 4, dtype=torch.float64)).Q
        >>> x = newton_schulz_orthogonalize((q * 0.5).unsqueeze(0), (3.4445, -4.7750, 2.0315), 5)
        >>> bool((torch.linalg.svdvals(x) - 1.0).abs().max() < 0.35)
        True
    """
    a, b, c = coefficients
    tall = matrices.shape[-2] > matrices.shape[-1]
    x = matrices.mT if tall else matrices
    norms = torch.linalg.matrix_norm(x, keepdim=True)
    x = x / (norms + _NORMALIZATION_EPSILON)
    for _ in range(num_iterations):
        gram = x @ x.mT
        polynomial = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = torch.baddbmm(x, polynomial, x, beta=a)  # a X + (b A + c A^2) X
    return x.mT if tall else x


def svd_orthogonalize(matrices: torch.Tensor, scale_by_nuclear_norm: bool) -> torch.Tensor:
    """``U_r V_r^T`` (times ``sum(S)`` if asked) for each matrix of a ``(B, m, n)`` stack.

    Only the singular directions with ``s > max(m, n) * eps * s_max`` (the rank rule of
    ``torch.linalg.matrix_rank``) count: for a rank-deficient block (a rank-1 gradient, a wide
    block) the remaining singular vectors of a reduced SVD are arbitrary, picked by rounding,
    and ``U V^T`` would give them weight 1, so a float32 rank-1 direction came out wrong by
    ~120 % against float64. Dropping them is also what Newton-Schulz does (``p(0) = 0``).
    A zero block maps to zero.

    Example:
        >>> svd_orthogonalize(torch.diag(torch.tensor([3.0, -2.0])).unsqueeze(0), False)
        tensor([[[ 1.,  0.],
                 [ 0., -1.]]])
    """
    u, s, vh = torch.linalg.svd(matrices, full_matrices=False)
    tolerance = max(matrices.shape[-2:]) * torch.finfo(s.dtype).eps * s[..., :1]
    kept = (s > tolerance).to(u.dtype)
    result = (u * kept.unsqueeze(-2)) @ vh
    if scale_by_nuclear_norm:
        result = result * s.sum(dim=-1).view(-1, 1, 1)
    return result


class SpectralDescentPreconditioner(Preconditioner):
    """Orthogonalized search directions for buckets of 2-D blocks (stateless).

    Args:
        buckets: the group's block buckets; every block must be 2-D.
        config: the orthogonalization method.

    Raises:
        ValueError: naming ``preconditioner_config`` when a block is not 2-D.

    Example:
        >>> bucket = BlockBucket((3, 2), torch.float64, torch.device("cpu"), ("w block_0",))
        >>> muon = SpectralDescentPreconditioner([bucket], SpectralDescentPreconditionerConfig())
        >>> muon.precondition([torch.randn(1, 3, 2, dtype=torch.float64)], step=1)[0].shape
        torch.Size([1, 3, 2])
    """

    name = "spectral_descent"

    def __init__(
        self, buckets: Sequence[BlockBucket], config: SpectralDescentPreconditionerConfig
    ) -> None:
        super().__init__(buckets)
        for bucket in self._buckets:
            if len(bucket.shape) != 2:
                raise ValueError(
                    "preconditioner_config: SpectralDescentPreconditionerConfig needs 2-D blocks, "
                    f"but {bucket.block_labels[0]} is a block of shape {bucket.shape}; put such "
                    "parameters in a param group with another preconditioner_config (matrices "
                    "with rows * cols <= max_preconditioner_dim merge into vectors: lower it for "
                    "that group)"
                )
        self._config = config
        self._outputs = [bucket.zeros() for bucket in self._buckets]

    def update_statistics(self, grads: Sequence[torch.Tensor], step: int) -> None:
        """Nothing to accumulate."""

    def precondition(self, grads: Sequence[torch.Tensor], step: int) -> list[torch.Tensor]:
        method = self._config.orthogonalization_config
        for bucket, grad, out in zip(self._buckets, grads, self._outputs):
            if isinstance(method, NewtonSchulzOrthogonalizationConfig):
                result = newton_schulz_orthogonalize(grad, method.coefficients, method.num_iterations)
            elif isinstance(method, SVDOrthogonalizationConfig):
                result = svd_orthogonalize(grad, method.scale_by_nuclear_norm)
            else:
                raise TypeError(f"unsupported orthogonalization_config {method!r}")
            rows, cols = bucket.shape
            torch.mul(result, float(method.scale_by_dims_fn(cols, rows)), out=out)
        return self._outputs
