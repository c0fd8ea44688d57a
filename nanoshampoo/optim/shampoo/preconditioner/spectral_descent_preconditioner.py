"""Spectral descent (Muon): the search direction of a matrix block is ``orth(G) ~ U V^T``.

For a block ``G = U S V^T`` (reduced SVD), steepest descent under the spectral norm moves along
``U V^T``: every singular direction of the (filtered) gradient gets the same step size. Two
ways to get it:

- ``SVDOrthogonalizationConfig``: exact ``U V^T`` from ``torch.linalg.svd`` (optionally times
  the nuclear norm ``sum(S)``), batched per bucket;
- ``NewtonSchulzOrthogonalizationConfig``: ``X_0 = G / ||G||_F`` (all singular values in
  ``(0, 1]``), then ``X <- a X + b (X X^T) X + c (X X^T)^2 X``, which maps each singular value
  ``s`` to ``p(s) = a s + b s^3 + c s^5`` and leaves ``U``, ``V`` unchanged. Iterated on the wide
  orientation so the Gram matrix ``X X^T`` is the smaller one; every block of one wide shape
  (a ``(768, 3072)`` and a transposed ``(3072, 768)`` alike) joins one stack, so each iteration
  is three batched products per shape, where the reference Muon loops over parameters. In
  float32 a block at least twice as wide as tall iterates in Gram space instead (the same
  iterates from ``r x r`` products, :func:`_iterate_in_gram_space`): 25 instead of 45 ``r^3``
  for a 768x3072 block.

Newton-Schulz dtype (:func:`resolve_newton_schulz_dtype`): float32 blocks iterate in bfloat16
where bf16 matmuls are fast, as the reference Muon always does. Measured on a 2-core Intel Xeon
with ``amx_bf16`` (2 threads): a 768x768x768 product ran at 1362 GFLOP/s in bf16 and 393 in
float32. The normalization by ``||G||_F`` is computed in the block dtype before rounding to bf16.

A block of more than 2 dims ``(d0, d1, ..., dk)`` is orthogonalized as the matrix
``(d0, d1 * ... * dk)`` (a conv filter: out-channels by the rest), as the reference library's
merge to 2 dims and the reference Muon do. Results are multiplied by
``scale_by_dims_fn(d_in=cols, d_out=rows)`` of that matrix. A zero block maps to zero (its
``U V^T`` is undefined). Stateless: nothing to checkpoint.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nanoshampoo.optim.shampoo.preconditioner.preconditioner import (
    BlockBucket,
    Preconditioner,
)
from nanoshampoo.optim.shampoo.shampoo_types import (
    NewtonSchulzOrthogonalizationConfig,
    SpectralDescentPreconditionerConfig,
    SVDOrthogonalizationConfig,
)

logger = logging.getLogger(__name__)

# Added to ||G||_F before dividing: keeps a zero block zero instead of NaN; far below the norm
# of any gradient block worth a step.
_NORMALIZATION_EPSILON = 1e-7


def resolve_newton_schulz_dtype(
    requested: torch.dtype | str | None, block_dtype: torch.dtype, device: torch.device
) -> tuple[torch.dtype, str]:
    """The dtype Newton-Schulz iterates in for blocks of ``block_dtype`` on ``device``, and why.

    ``requested`` (``NewtonSchulzOrthogonalizationConfig.compute_dtype``): a dtype is taken as
    given; None is the block dtype (the reference library's numbers); ``"auto"``: float32 blocks
    use bfloat16 on a CUDA device that supports it, and on a CPU where
    ``nanoshampoo.matmul_speed.cpu_bf16_is_fast`` (the trainer's autocast probe, run once per
    process) finds bf16 matmuls faster than float32; other blocks (float64, bf16) keep their dtype.

    Example:
        >>> resolve_newton_schulz_dtype("auto", torch.float64, torch.device("cpu"))
        (torch.float64, 'auto: float64 blocks keep float64')
    """
    kept = str(block_dtype).removeprefix("torch.")
    if requested is None:
        return block_dtype, f"compute_dtype=None: the block dtype ({kept})"
    if requested != "auto":
        return requested, f"compute_dtype={str(requested).removeprefix('torch.')}"
    if block_dtype != torch.float32:
        return block_dtype, f"auto: {kept} blocks keep {kept}"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: CUDA device supports bf16"
        return torch.float32, "auto: CUDA device without bf16 support"
    if device.type == "cpu":
        from nanoshampoo.matmul_speed import cpu_bf16_is_fast

        if cpu_bf16_is_fast():
            return torch.bfloat16, "auto: bf16 matmuls are faster than float32 on this CPU"
        return torch.float32, "auto: bf16 matmuls are not faster than float32 on this CPU"
    return torch.float32, f"auto: no bf16 probe for device type {device.type!r}"


def _normalize_into(matrices: torch.Tensor, out: torch.Tensor) -> None:
    """``out <- matrices / (||matrices||_F + 1e-7)`` per matrix, the norm in the input's dtype,
    the quotient rounded once to ``out``'s dtype."""
    norms = torch.linalg.matrix_norm(matrices, keepdim=True)
    torch.div(matrices, norms + _NORMALIZATION_EPSILON, out=out)


def _iterate_wide(
    x: torch.Tensor, coefficients: tuple[float, float, float], num_iterations: int
) -> torch.Tensor:
    """``num_iterations`` quintic steps on a ``(B, r, c)`` stack with ``r <= c``, in its dtype.

    In float32/float64, when it needs fewer products, the iteration runs in Gram space
    (:func:`_iterate_in_gram_space`); otherwise on ``X`` itself: per step ``A = X X^T``,
    ``X <- a X + (b A + c A^2) X``, ``2 r^2 c + r^3 + 2 r^2 c`` multiply-adds.
    """
    rows, cols = x.shape[-2:]
    ratio = cols / rows
    # Products of r^3 multiply-adds: n (2 ratio + 1) on X against 2 ratio + 4 n - 3 in Gram space.
    if x.dtype in (torch.float32, torch.float64) and (
        num_iterations * (2 * ratio + 1) > 2 * ratio + 4 * num_iterations - 3
    ):
        return _iterate_in_gram_space(x, coefficients, num_iterations)
    a, b, c = coefficients
    for _ in range(num_iterations):
        gram = torch.bmm(x, x.mT)
        polynomial = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = torch.baddbmm(x, polynomial, x, beta=a)  # a X + (b A + c A^2) X
    return x


def _iterate_in_gram_space(
    x: torch.Tensor, coefficients: tuple[float, float, float], num_iterations: int
) -> torch.Tensor:
    """The same iterates as on ``X``, computed with ``r x r`` products: ``X_n = Q X_0``.

    Every iterate is ``X_k = Q_k X_0`` with ``Q_k`` a polynomial in ``A_0 = X_0 X_0^T``, so with
    ``P_k = a I + b A_k + c A_k^2``: ``Q_{k+1} = P_k Q_k`` and ``A_{k+1} = P_k A_k P_k^T = P_k^2
    A_k`` (all commute). Cost: ``4 r^2 c`` for ``A_0`` and ``Q X_0``, then ``4 n - 3`` products
    of ``r^3``: for GPT-small's 768x3072 blocks 25 r^3 instead of 45 r^3; measured 2.0x faster
    in float32 (interleaved, 2 threads). Not in bf16: rounding ``A_k`` to 8 bits drives its
    near-null eigenvalues off, and the orthogonality bound of the tests fails (0.82).
    """
    gram = torch.bmm(x, x.mT)
    polynomial = _gram_polynomial(gram, coefficients)
    transform = polynomial
    for _ in range(num_iterations - 1):
        gram = torch.bmm(polynomial, torch.bmm(polynomial, gram))
        polynomial = _gram_polynomial(gram, coefficients)
        transform = torch.bmm(polynomial, transform)
    return torch.bmm(transform, x)


def _gram_polynomial(gram: torch.Tensor, coefficients: tuple[float, float, float]) -> torch.Tensor:
    """``a I + b A + c A^2`` for a ``(B, r, r)`` stack ``A``."""
    a, b, c = coefficients
    polynomial = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
    polynomial.diagonal(dim1=-2, dim2=-1).add_(a)
    return polynomial


def newton_schulz_orthogonalize(
    matrices: torch.Tensor,
    coefficients: tuple[float, float, float],
    num_iterations: int,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Approximately ``U V^T`` for each matrix of a ``(B, m, n)`` stack (quintic Newton-Schulz).

    The products run in ``compute_dtype`` (None: the input's). Returns a new ``(B, m, n)``
    tensor in the input's dtype.

    Example:
        >>> q = torch.linalg.qr(torch.randn(6, 4, dtype=torch.float64)).Q
        >>> x = newton_schulz_orthogonalize((q * 0.5).unsqueeze(0), (3.4445, -4.7750, 2.0315), 5)
        >>> bool((torch.linalg.svdvals(x) - 1.0).abs().max() < 0.35)
        True
    """
    tall = matrices.shape[-2] > matrices.shape[-1]
    wide = matrices.mT if tall else matrices
    x = torch.empty(wide.shape, dtype=compute_dtype or matrices.dtype, device=matrices.device)
    _normalize_into(wide, x)
    x = _iterate_wide(x, coefficients, num_iterations).to(matrices.dtype)
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


def block_matrix_shape(bucket: BlockBucket) -> tuple[int, int]:
    """``(d0, d1 * ... * dk)``: the matrix a block of ``bucket.shape`` is orthogonalized as.

    Raises:
        ValueError: naming ``preconditioner_config`` when the block has fewer than 2 dims.
    """
    if len(bucket.shape) < 2:
        raise ValueError(
            "preconditioner_config: SpectralDescentPreconditionerConfig needs blocks of >= 2 "
            f"dims, but {bucket.block_labels[0]} is a block of shape {bucket.shape}; put such "
            "parameters in a param group with another preconditioner_config (matrices "
            "with rows * cols <= max_preconditioner_dim merge into vectors: lower it for "
            "that group)"
        )
    return bucket.shape[0], math.prod(bucket.shape[1:])


@dataclass(frozen=True)
class _WideStack:
    """The buckets whose matrices share one wide shape ``(r, c)``, ``r <= c``, in one dtype.

    ``members``: ``(bucket index, transposed)``; a tall bucket joins transposed. ``buffer``:
    ``(sum of their block counts, r, c)`` in the compute dtype, the iteration's input.
    """

    members: tuple[tuple[int, bool], ...]
    buffer: torch.Tensor
    reason: str


class SpectralDescentPreconditioner(Preconditioner):
    """Orthogonalized search directions for buckets of blocks of >= 2 dims (stateless).

    Args:
        buckets: the group's block buckets; every block has >= 2 dims.
        config: the orthogonalization method.

    Attributes:
        compute_dtype_reasons: for Newton-Schulz, one line per wide shape: the dtype it
            iterates in and why (also logged at INFO); empty for SVD.

    Raises:
        ValueError: naming ``preconditioner_config`` when a block is a vector.

    Example:
        >>> bucket = BlockBucket((3, 2), torch.float64, torch.device("cpu"), ("w block_0",))
        >>> muon = SpectralDescentPreconditioner([bucket], SpectralDescentPreconditionerConfig())
        >>> muon.precondition([torch.randn(1, 3, 2, dtype=torch.float64)], step=1)[0].shape
        torch.Size([1, 3, 2])
        >>> muon.compute_dtype_reasons
        ('(2, 3) x1: float64, compute_dtype=None: the block dtype (float64)',)
    """

    name = "spectral_descent"

    def __init__(
        self, buckets: Sequence[BlockBucket], config: SpectralDescentPreconditionerConfig
    ) -> None:
        super().__init__(buckets)
        self._matrix_shapes = [block_matrix_shape(bucket) for bucket in self._buckets]
        self._config = config
        self._outputs = [bucket.zeros() for bucket in self._buckets]
        method = config.orthogonalization_config
        self._stacks: list[_WideStack] = []
        if isinstance(method, NewtonSchulzOrthogonalizationConfig):
            self._stacks = self._wide_stacks(method.compute_dtype)
        self.compute_dtype_reasons = tuple(
            f"{tuple(stack.buffer.shape[1:])} x{stack.buffer.shape[0]}: "
            f"{str(stack.buffer.dtype).removeprefix('torch.')}, {stack.reason}"
            for stack in self._stacks
        )
        for line in self.compute_dtype_reasons:
            logger.info(f"spectral descent Newton-Schulz {line}")

    def _wide_stacks(self, requested: torch.dtype | str | None) -> list[_WideStack]:
        groups: dict[tuple[int, int, torch.dtype, torch.device], list[tuple[int, bool]]] = {}
        for index, (bucket, (rows, cols)) in enumerate(zip(self._buckets, self._matrix_shapes)):
            key = (min(rows, cols), max(rows, cols), bucket.dtype, bucket.device)
            groups.setdefault(key, []).append((index, rows > cols))
        stacks = []
        for (short, long, dtype, device), members in groups.items():
            compute_dtype, reason = resolve_newton_schulz_dtype(requested, dtype, device)
            count = sum(self._buckets[index].num_blocks for index, _ in members)
            buffer = torch.empty(count, short, long, dtype=compute_dtype, device=device)
            stacks.append(_WideStack(tuple(members), buffer, reason))
        return stacks

    def update_statistics(self, grads: Sequence[torch.Tensor], step: int) -> None:
        """Nothing to accumulate."""

    def precondition(self, grads: Sequence[torch.Tensor], step: int) -> list[torch.Tensor]:
        method = self._config.orthogonalization_config
        if isinstance(method, NewtonSchulzOrthogonalizationConfig):
            for stack in self._stacks:
                self._newton_schulz(stack, grads, method)
        elif isinstance(method, SVDOrthogonalizationConfig):
            for index, grad in enumerate(grads):
                rows, cols = self._matrix_shapes[index]
                matrices = grad.reshape(-1, rows, cols)
                result = svd_orthogonalize(matrices, method.scale_by_nuclear_norm)
                self._write_output(index, result, method)
        else:
            raise TypeError(f"unsupported orthogonalization_config {method!r}")
        return self._outputs

    def last_directions(self) -> list[torch.Tensor]:
        """Per bucket, the ``(B, rows, cols)`` orthogonalized directions of the last
        :meth:`precondition` before the ``scale_by_dims_fn`` factor (``orth(G)``), for
        inspection: a new tensor divided from the kept outputs, nothing recomputed."""
        method = self._config.orthogonalization_config
        directions = []
        for output, (rows, cols) in zip(self._outputs, self._matrix_shapes):
            scale = float(method.scale_by_dims_fn(cols, rows))
            directions.append(output.view(-1, rows, cols) / scale)
        return directions

    def _newton_schulz(
        self,
        stack: _WideStack,
        grads: Sequence[torch.Tensor],
        method: NewtonSchulzOrthogonalizationConfig,
    ) -> None:
        """Normalize the stack's gradients into its buffer, iterate once, scatter the results."""
        parts = []
        offset = 0
        for index, transposed in stack.members:
            rows, cols = self._matrix_shapes[index]
            matrices = grads[index].reshape(-1, rows, cols)
            part = stack.buffer[offset : offset + matrices.shape[0]]
            _normalize_into(matrices.mT if transposed else matrices, part)
            parts.append(matrices.shape[0])
            offset += matrices.shape[0]
        result = _iterate_wide(stack.buffer, method.coefficients, method.num_iterations)
        for (index, transposed), part in zip(stack.members, result.split(parts)):
            self._write_output(index, part.mT if transposed else part, method)

    def _write_output(
        self,
        index: int,
        result: torch.Tensor,
        method: NewtonSchulzOrthogonalizationConfig | SVDOrthogonalizationConfig,
    ) -> None:
        """``outputs[index] <- result * scale_by_dims_fn(cols, rows)``, cast to the bucket dtype."""
        rows, cols = self._matrix_shapes[index]
        out = self._outputs[index].view(-1, rows, cols)
        torch.mul(result, float(method.scale_by_dims_fn(cols, rows)), out=out)
