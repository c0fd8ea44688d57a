"""Muon with cautious weight decay, and NorMuon: single-process ``torch.optim`` optimizers for
matrices (``ndim == 2``), as the NanoGPT speedrun's optimization track uses them.

Per matrix ``W`` (``(rows, cols)``, float32) with gradient ``G``, one step does, in order:

1. momentum, Nesterov: ``M <- momentum * M + (1 - momentum) * G``;
   ``U = (1 - momentum) * G + momentum * M``;
2. orthogonalize: ``O = NS(U)``, ``ns_steps`` quintic Newton-Schulz iterations
   ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, ``(a, b, c) = (3.4445, -4.7750, 2.0315)``,
   from ``X = U / (||U||_F + 1e-7)`` (on the transpose of a tall matrix);
3. NorMuon only (arXiv 2510.05491): a per-row second moment of the orthogonalized update,
   ``v <- beta2 * v + (1 - beta2) * mean_j(O_ij^2)`` (shape ``(rows, 1)``), then
   ``O <- (O / (sqrt(v) + 1e-10)) * ||O||_F / (||O / (sqrt(v) + 1e-10)||_F + 1e-10)``: every
   row (neuron) normalized, the update's Frobenius norm kept;
4. shape scale: ``D = O * max(1, rows / cols) ** 0.5``;
5. weight decay, decoupled: ``W <- W - lr * wd * W``; with ``cautious_weight_decay`` only
   where the update and the weight agree in sign, ``W <- W - lr * wd * W * [D * W >= 0]``
   (Chen et al. 2025, "Cautious Weight Decay"), so the decay never pulls against the update;
6. ``W <- W - lr * D``.

Both are one class (:class:`OrthogonalizedMomentum`); ``NorMuon`` only turns on step 3.
Gradients must already be averaged across ranks (the trainer does it for these).

Example:
    >>> w = torch.nn.Parameter(torch.ones(4, 3))
    >>> opt = NorMuon([w], lr=0.02, weight_decay=0.1, cautious_weight_decay=True)
    >>> w.grad = torch.arange(12.0).reshape(4, 3); opt.step()
    >>> tuple(opt.state[w]["second_moment"].shape)
    (4, 1)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(update: torch.Tensor, steps: int) -> torch.Tensor:
    """The speedrun's quintic Newton-Schulz orthogonalization of a ``(rows, cols)`` matrix,
    in its dtype (``US'V^T`` with ``S'`` near 1, not exactly ``UV^T``)."""
    a, b, c = NS_COEFFICIENTS
    tall = update.shape[0] > update.shape[1]
    x = update.T if tall else update
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def normalize_rows(update: torch.Tensor, second_moment: torch.Tensor, beta2: float) -> torch.Tensor:
    """NorMuon's step 3: update ``second_moment`` (``(rows, 1)``) in place, return the
    row-normalized update with ``update``'s Frobenius norm."""
    second_moment.lerp_(update.square().mean(dim=1, keepdim=True), 1 - beta2)
    normalized = update / (second_moment.sqrt() + 1e-10)
    return normalized * (update.norm() / (normalized.norm() + 1e-10))


def _check_matrices(owner: str, params: list[torch.Tensor]) -> None:
    """Every parameter 2-D and given once (before the base class sees them)."""
    seen: set[int] = set()
    for p in params:
        if p.ndim != 2:
            raise ValueError(f"{owner} updates matrices; got a parameter of shape "
                             f"{tuple(p.shape)}")
        if id(p) in seen:
            raise ValueError(f"{owner}: a parameter of shape {tuple(p.shape)} is given twice")
        seen.add(id(p))


class OrthogonalizedMomentum(torch.optim.Optimizer):
    """Muon (``normalize=False``) or NorMuon (``normalize=True``); see the module docstring.

    Param-group settings: ``lr``, ``momentum`` and ``beta2`` in [0, 1), ``weight_decay`` >= 0,
    ``ns_steps`` >= 1, ``cautious_weight_decay``. Parameters must be 2-D and distinct.
    """

    normalize = False

    def __init__(self, params: Iterable[Any], lr: float = 0.02, momentum: float = 0.95,
                 beta2: float = 0.95, weight_decay: float = 0.0, ns_steps: int = 5,
                 cautious_weight_decay: bool = False) -> None:
        for name, value in (("lr", lr), ("weight_decay", weight_decay)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        for name, value in (("momentum", momentum), ("beta2", beta2)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
            raise ValueError(f"ns_steps must be an int >= 1, got {ns_steps!r}")
        entries = [dict(entry, params=list(entry["params"])) if isinstance(entry, dict) else entry
                   for entry in params]
        _check_matrices(type(self).__name__, [
            p for entry in entries for p in (entry["params"] if isinstance(entry, dict) else [entry])])
        super().__init__(entries, dict(lr=lr, momentum=momentum, beta2=beta2,
                                       weight_decay=weight_decay, ns_steps=ns_steps,
                                       cautious_weight_decay=bool(cautious_weight_decay)))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
            if self.normalize:
                state["second_moment"] = torch.zeros_like(p[:, :1])
        momentum, lr = group["momentum"], group["lr"]
        buffer = state["momentum_buffer"]
        buffer.lerp_(p.grad, 1 - momentum)
        update = newton_schulz(p.grad.lerp(buffer, momentum), group["ns_steps"])
        if self.normalize:
            update = normalize_rows(update, state["second_moment"], group["beta2"])
        update = update * max(1.0, p.shape[0] / p.shape[1]) ** 0.5
        decay = lr * group["weight_decay"]
        if decay:
            if group["cautious_weight_decay"]:
                p.sub_(p * (update * p >= 0), alpha=decay)
            else:
                p.mul_(1 - decay)
        p.sub_(update, alpha=lr)


class Muon(OrthogonalizedMomentum):
    """The speedrun's Muon; ``cautious_weight_decay=True`` is its cautious-decay variant."""


class NorMuon(OrthogonalizedMomentum):
    """NorMuon (arXiv 2510.05491): Muon with per-row (neuron-wise) normalized updates."""

    normalize = True
