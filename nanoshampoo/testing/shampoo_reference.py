"""A slow float64 reference of classic Shampoo for one block, written from the equations.

Used by the tests of the Shampoo variants (eigendecomposed roots, KL-Shampoo, trace scaling,
a dropped weighting factor). One block ``W`` of order ``k`` (no blocking, no grafting), numpy
float64, dense, plain loops. Step ``t`` (1-based), ``s`` the start step, ``f`` the frequency:

1. factors: ``F_i <- b2 F_i + w H_(i) H_(i)^T`` with ``H = G`` (Shampoo) or, for KL-Shampoo,
   ``H = G x_j X_j`` over every preconditioned ``j != i`` (the other factors' current roots);
   ``w = 1`` for ``b2 == 1`` or a dropped weighting factor, else ``1 - b2``;
2. roots when ``(t % f == 0 and t > s) or t == s``: ``A = F_i / bc2`` (``bc2 = 1 - b2^t`` with
   bias correction, else 1), with trace scaling ``A <- A max(tr A, eps)^(-a)``, then
   ``X_i = Q diag((max(lambda, 0) + eps)^(-e_i)) Q^T`` from ``A = Q diag(lambda) Q^T``, or
   with ``pseudo_inverse`` weight 0 where ``lambda <= 1e-10 lambda_max`` (numerically zero: the
   exact zeros of a rank-deficient factor come out near ``1e-16 lambda_max`` in float64, the
   others are far above); before the first, ``X_i = I``;
3. ``M <- b1 M + (1 - b1) G``, ``Gbar = M / (1 - b1^t)``; ``W <- W - lr Gbar x_1 X_1 ... x_k X_k``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def multiply_along(x: np.ndarray, matrix: np.ndarray, dim: int) -> np.ndarray:
    """``x`` with dim ``dim`` multiplied by the symmetric ``matrix`` (``matrix @ x_(dim)``)."""
    return np.moveaxis(np.tensordot(matrix, x, axes=([1], [dim])), 0, dim)


def unfold(x: np.ndarray, dim: int) -> np.ndarray:
    """``x_(dim)``: ``(n_dim, prod(other dims))``."""
    return np.moveaxis(x, dim, 0).reshape(x.shape[dim], -1)


@dataclass
class ReferenceShampoo:
    """One block's float64 Shampoo state and step (module docstring)."""

    shape: tuple[int, ...]
    exponents: list[float]
    lr: float = 0.05
    betas: tuple[float, float] = (0.9, 0.95)
    epsilon: float = 1e-12
    frequency: int = 1
    start: int = 1
    kl: bool = False
    drop_weighting_factor: bool = False
    trace_scaling_exponent: float | None = None
    pseudo_inverse: bool = False
    factors: list[np.ndarray] = field(init=False)
    roots: list[np.ndarray] = field(init=False)
    momentum: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.factors = [np.zeros((n, n)) for n in self.shape]
        self.roots = [np.eye(n) for n in self.shape]
        self.momentum = np.zeros(self.shape)

    def _statistics_sources(self, g: np.ndarray) -> list[np.ndarray]:
        """Per dim, ``H``: ``G``, or for KL-Shampoo ``G`` times the other factors' roots."""
        if not self.kl:
            return [g] * len(self.shape)
        sources = []
        for i in range(len(self.shape)):
            h = g
            for j, root in enumerate(self.roots):
                if j != i and self.exponents[j] > 0.0:
                    h = multiply_along(h, root, j)
            sources.append(h)
        return sources

    def _root(self, a: np.ndarray, exponent: float) -> np.ndarray:
        lam, q = np.linalg.eigh(a)
        if self.pseudo_inverse:
            kept = lam > 1e-10 * lam[-1]
            weights = np.where(kept, np.where(kept, lam + self.epsilon, 1.0) ** (-exponent), 0.0)
        else:
            weights = (np.maximum(lam, 0.0) + self.epsilon) ** (-exponent)
        return (q * weights) @ q.T

    def step(self, t: int, w: np.ndarray, g: np.ndarray) -> np.ndarray:
        b1, b2 = self.betas
        weight = 1.0 if b2 == 1.0 or self.drop_weighting_factor else 1.0 - b2
        for i, h in enumerate(self._statistics_sources(g)):
            if self.exponents[i] > 0.0:
                self.factors[i] = b2 * self.factors[i] + weight * unfold(h, i) @ unfold(h, i).T
        bc2 = 1.0 if b2 == 1.0 or self.drop_weighting_factor else 1.0 - b2**t
        if (t % self.frequency == 0 and t > self.start) or t == self.start:
            for i, factor in enumerate(self.factors):
                if self.exponents[i] == 0.0:
                    continue
                a = factor / bc2
                if self.trace_scaling_exponent is not None:
                    a = a * max(np.trace(a), self.epsilon) ** (-self.trace_scaling_exponent)
                self.roots[i] = self._root(a, self.exponents[i])
        self.momentum = b1 * self.momentum + (1 - b1) * g
        p = self.momentum / (1.0 - b1**t)
        for i, root in enumerate(self.roots):
            if self.exponents[i] > 0.0:
                p = multiply_along(p, root, i)
        return w - self.lr * p


def run_reference(
    weights: np.ndarray, grads: list[np.ndarray], **hyperparameters: object
) -> np.ndarray:
    """The weights after one :meth:`ReferenceShampoo.step` per gradient (default exponents
    ``1 / (2k)`` unless ``exponents`` is given)."""
    shape = tuple(weights.shape)
    hyperparameters.setdefault("exponents", [1.0 / (2 * len(shape))] * len(shape))
    block = ReferenceShampoo(shape, **hyperparameters)  # type: ignore[arg-type]
    w = weights.copy()
    for t, g in enumerate(grads, start=1):
        w = block.step(t, w, g)
    return w
