"""The statistics of a telemetry record, as functions of tensors (no optimizer, no ranks).

Each takes the tensor(s) of one block matrix and returns Python floats; each is tested against a
float64 computation written from its definition (``tests/telemetry_stats_test.py``).

- :func:`rms`: ``sqrt(mean(x^2))``, accumulated in float64.
- :func:`top_singular_value`: the largest singular value of a matrix by ``iterations`` steps of
  power iteration on ``M^T M`` from a fixed start: a lower bound of ``sigma_max`` that is
  exact when the iteration has converged (a spectral gap of ``r`` gains ``r^(2k)``).
- :func:`spectrum_health`: from a factor's eigenvalues ``lambda`` (negatives, which are rounding
  noise of a PSD factor, count as 0) and the group's ``epsilon``: the condition number of
  ``F + eps I``, ``(lambda_max + eps) / (lambda_min + eps)``; the effective rank
  ``exp(-sum p_i log p_i)`` with ``p = lambda / sum(lambda)`` (1 for a rank-one factor, ``n``
  for a multiple of the identity, 0 for a zero factor); the share of eigenvalues below
  ``epsilon`` (the directions where the ridge, not the statistics, sets the step).
- :func:`orthogonality_error` and :func:`singular_value_range`: how far an orthogonalizer's
  output ``U`` is from a partial isometry, ``||U^T U - I||_F / sqrt(n)`` on the smaller Gram
  matrix (``n = min(rows, cols)``), and its extreme singular values (all 1 when it is one).
- :func:`spread`: ``max / median`` of the square roots of a second moment ``v`` (the lower
  median, ``sorted(x)[(n - 1) // 2]``, as ``torch.median`` takes it).
"""

from __future__ import annotations

import math

import torch

# A fixed start for the power iteration (the same on every rank and every run, so a record is
# reproducible); its own generator leaves the training's random streams untouched.
_POWER_ITERATION_SEED = 1234


def rms(x: torch.Tensor) -> float:
    """``sqrt(mean(x^2))`` of every entry (float64 accumulation); 0 for an empty tensor."""
    if x.numel() == 0:
        return 0.0
    norm = torch.linalg.vector_norm(x, dtype=torch.float64)
    return float(norm) / math.sqrt(x.numel())


def as_matrix(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the 2-D matrix ``(d0, d1 * ... * dk)`` (a conv filter: out-channels by the rest)."""
    return x.reshape(x.shape[0], -1) if x.dim() != 2 else x


def top_singular_value(matrix: torch.Tensor, iterations: int = 8) -> float:
    """``sigma_max`` of ``matrix`` (2-D, or flattened by :func:`as_matrix`) after
    ``iterations`` >= 1 power steps ``v <- M^T M v / ||M^T M v||``; returns ``||M v||``.

    Computed in float32 (float64 input stays float64) on the matrix's device; a zero matrix
    gives 0.
    """
    m = as_matrix(matrix)
    m = m if m.dtype == torch.float64 else m.float()
    # Iterate on the smaller side: v has min(rows, cols) entries.
    if m.shape[0] < m.shape[1]:
        m = m.mT
    generator = torch.Generator(device="cpu").manual_seed(_POWER_ITERATION_SEED)
    v = torch.randn(m.shape[1], generator=generator, dtype=m.dtype).to(m.device)
    v = v / torch.linalg.vector_norm(v)
    for _ in range(iterations):
        w = m.mT @ (m @ v)
        norm = torch.linalg.vector_norm(w)
        if float(norm) == 0.0:
            return 0.0
        v = w / norm
    return float(torch.linalg.vector_norm(m @ v))


def spectrum_health(eigenvalues: torch.Tensor, epsilon: float) -> tuple[float, float, float]:
    """``(condition number, effective rank, share below epsilon)`` of one factor from its
    eigenvalues ``(n,)`` (any order; computed in float64; see the module docstring).

    The condition number is ``inf`` when ``lambda_min + eps`` is 0 (a singular factor and no
    ridge), NaN when a non-finite eigenvalue is present.
    """
    values = eigenvalues.detach().to(torch.float64).clamp(min=0.0)
    if not bool(torch.isfinite(values).all()):
        return math.nan, math.nan, math.nan
    low, high = float(values.min()) + epsilon, float(values.max()) + epsilon
    condition = high / low if low > 0.0 else math.inf
    total = float(values.sum())
    if total == 0.0:
        effective_rank = 0.0
    else:
        p = values / total
        entropy = -float(torch.where(p > 0.0, p * p.log(), torch.zeros_like(p)).sum())
        effective_rank = math.exp(entropy)
    below = float((values < epsilon).double().mean())
    return condition, effective_rank, below


def orthogonality_error(u: torch.Tensor) -> float:
    """``||G - I||_F / sqrt(n)`` with ``G`` the smaller Gram matrix of ``U`` (``U^T U`` for a
    tall ``U``, ``U U^T`` for a wide one) and ``n`` its size; float64 accumulation."""
    m = as_matrix(u).to(torch.float64)
    gram = m.mT @ m if m.shape[0] >= m.shape[1] else m @ m.mT
    n = gram.shape[0]
    identity = torch.eye(n, dtype=gram.dtype, device=gram.device)
    return float(torch.linalg.matrix_norm(gram - identity)) / math.sqrt(n)


def singular_value_range(u: torch.Tensor) -> tuple[float, float]:
    """``(sigma_min, sigma_max)`` of ``U`` (the ``min(rows, cols)`` singular values), float32."""
    m = as_matrix(u)
    values = torch.linalg.svdvals(m if m.dtype == torch.float64 else m.float())
    return float(values.min()), float(values.max())


def spread(second_moment: torch.Tensor) -> float:
    """``max(sqrt(v)) / median(sqrt(v))`` (lower median); ``inf`` when the median is 0."""
    roots = second_moment.detach().flatten().to(torch.float64).clamp(min=0.0).sqrt()
    median = float(roots.median())
    top = float(roots.max())
    return top / median if median > 0.0 else math.inf
