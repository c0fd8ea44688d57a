"""SOAP-Muon: Adam in the Shampoo eigenbasis preconditions Muon's momentum before Newton-Schulz.

As the modded-nanogpt optimization track (track 3) uses it: record #14 (PR 278, "SOAP
preconditioning before Muon orthogonalization, as in SOAP-Muon", N. Vyas,
nikhilvyas.github.io/SOAP_Muon.pdf) and record #44 (PR 321, every hidden matrix,
``precondition_frequency=1``), ``records/track_3_optimization/README.md`` and the records'
``soap_precondition_momentum`` / ``soap_update_preconditioner``. Per 2-D parameter ``W`` of
shape ``(m, n)`` with gradient ``G``, at step ``t``::

    M <- mu M + (1 - mu) G;   U = (1 - mu) G + mu M      (Nesterov, as Muon)
    if the bases Q_L, Q_R exist (t >= 2):
        U' = Q_L^T U Q_R                                 U in the eigenbasis
        V <- beta2 V + (1 - beta2) U'^2                  Adam's second moment there
        U <- Q_L (U' / max(sqrt(V), eps)) Q_R^T
    O = NS(U) * max(1, m / n) ** 0.5                     Muon's direction
    W <- W - lr * (O + lam * W)                           (or the cautious decay)
    L <- b L + (1 - b) G G^T;   R <- b R + (1 - b) G^T G  (b = shampoo_beta), after the step
    t = 1: Q_L, Q_R = eigenvectors of L, R, eigenvalues descending
    t - 1 a multiple of precondition_frequency: reorder the columns of Q_L (Q_R) and the rows
        (columns) of V by the estimated eigenvalues diag(Q^T L Q) descending, then
        Q_L <- QR(L Q_L).Q, Q_R <- QR(R Q_R).Q           (one warm-started power step, as SOAP)

So step ``t`` preconditions with bases built from the gradients of steps ``1 .. t-1``, and step 1
is plain Muon. No bias correction (the records have none). The records also rescale the
preconditioned ``U`` to the raw one's norm; ``NS`` normalizes its input first, so that rescaling
changes nothing and is left out. Left out too, as separate techniques of those records: the
attention trust gate, the u/w floor, the radial brake and Contra-Muon.

Example:
    >>> w = torch.nn.Parameter(torch.zeros(3, 3))
    >>> opt = SOAPMuon([w], lr=0.1)
    >>> for _ in range(3):
    ...     w.grad = torch.randn(3, 3)
    ...     opt.step()
    >>> sorted(opt.state[w])  # doctest: +NORMALIZE_WHITESPACE
    ['exp_avg_sq', 'left_basis', 'left_factor', 'momentum_buffer', 'right_basis',
     'right_factor', 'soap_step']
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from nanoshampoo.optim.muon import (
    MUON_NS_COEFFICIENTS,
    OrthogonalizedMomentum,
    muon_shape_scale,
)
from nanoshampoo.optim.shampoo.config_checks import (
    check_int,
    check_open_closed_unit,
    check_positive,
)


def eigenbasis_precondition(
    updates: Tensor, left: Tensor, right: Tensor, exp_avg_sq: Tensor, beta2: float, eps: float
) -> Tensor:
    """``Q_L (U' / max(sqrt(V), eps)) Q_R^T`` with ``U' = Q_L^T U Q_R``, after updating ``V``.

    ``updates``, ``exp_avg_sq``: ``(B, m, n)``; ``left``: ``(B, m, m)``; ``right``:
    ``(B, n, n)``, orthonormal columns. ``exp_avg_sq`` is updated in place.
    """
    rotated = left.mT @ updates @ right
    exp_avg_sq.mul_(beta2).addcmul_(rotated, rotated, value=1.0 - beta2)
    return left @ (rotated / exp_avg_sq.sqrt().clamp_min(eps)) @ right.mT


def refresh_basis(
    factor: Tensor, basis: Tensor, exp_avg_sq: Tensor, dim: int
) -> tuple[Tensor, Tensor]:
    """One warm-started QR step of ``basis`` towards ``factor``'s eigenvectors.

    Columns of ``basis`` (``(B, k, k)``) are reordered by ``diag(Q^T F Q)`` descending, and
    ``exp_avg_sq``'s ``dim`` (``-2`` for the left basis, ``-1`` for the right) the same way;
    then ``Q <- QR(F Q).Q``. Returns the new ``(basis, exp_avg_sq)``.
    """
    estimates = (basis * (factor @ basis)).sum(dim=-2)  # diag(Q^T F Q), (B, k)
    order = torch.argsort(estimates, dim=-1, descending=True)
    basis = torch.take_along_dim(basis, order.unsqueeze(-2), dim=-1)
    index = order.unsqueeze(-1) if dim == -2 else order.unsqueeze(-2)
    exp_avg_sq = torch.take_along_dim(exp_avg_sq, index, dim=dim)
    return torch.linalg.qr(factor @ basis).Q, exp_avg_sq


def descending_eigenvectors(factor: Tensor) -> Tensor:
    """Eigenvectors of each symmetric matrix of a ``(B, k, k)`` stack, eigenvalues descending."""
    return torch.linalg.eigh(factor).eigenvectors.flip(-1)


class SOAPMuon(OrthogonalizedMomentum):
    """SOAP-Muon as track 3 of the speedrun runs it: the module docstring's equations, batched.

    Defaults are record #44's SOAP core (``beta2 = shampoo_beta = 0.9``, ``eps = 1e-8``,
    ``precondition_frequency = 1``) on Muon's defaults (lr 0.02, momentum 0.95, Nesterov, 5-step
    quintic Newton-Schulz) with no weight decay (the records replace it by a u/w floor). State per
    parameter: ``momentum_buffer`` and ``exp_avg_sq`` ``(m, n)``, ``left_factor`` and
    ``left_basis`` ``(m, m)``, ``right_factor`` and ``right_basis`` ``(n, n)`` (the bases from
    the first step on), ``soap_step`` (factor updates so far).

    Args:
        params, lr, momentum, nesterov, weight_decay, cautious_weight_decay, ns_steps,
            ns_coefficients: as ``nanoshampoo.optim.muon.Muon``.
        beta2: EMA weight of ``V``, in ``[0, 1)``.
        shampoo_beta: EMA weight of ``L`` and ``R``, in ``[0, 1)``.
        eps: floor of ``sqrt(V)``, > 0.
        precondition_frequency: steps between basis refreshes, int >= 1.

    Raises:
        ValueError: naming the argument that is out of range.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        beta2: float = 0.9,
        shampoo_beta: float = 0.9,
        eps: float = 1e-8,
        precondition_frequency: int = 1,
        weight_decay: float = 0.0,
        cautious_weight_decay: bool = False,
        ns_steps: int = 5,
        ns_coefficients: Sequence[float] = MUON_NS_COEFFICIENTS,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "beta2": beta2,
            "shampoo_beta": shampoo_beta,
            "eps": eps,
            "precondition_frequency": precondition_frequency,
            "weight_decay": weight_decay,
            "cautious_weight_decay": cautious_weight_decay,
            "ns_steps": ns_steps,
            "ns_coefficients": ns_coefficients,
        }
        super().__init__(params, defaults)

    def validate_group(self, group: dict[str, Any]) -> None:
        super().validate_group(group)
        check_open_closed_unit("beta2", group["beta2"], low_open=False, high_open=True)
        check_open_closed_unit(
            "shampoo_beta", group["shampoo_beta"], low_open=False, high_open=True
        )
        check_positive("eps", group["eps"])
        check_int("precondition_frequency", group["precondition_frequency"], minimum=1)

    def bucket_key(self, param: Tensor) -> tuple[Any, ...]:
        # Whether a bucket has bases, or refreshes them, depends on its step count.
        return (*super().bucket_key(param), self.state[param].get("soap_step", 0))

    def direction(
        self, group: dict[str, Any], params: list[Tensor], updates: Tensor, grads: Tensor
    ) -> Tensor:
        rows, cols = updates.shape[-2:]
        states = [self.state[p] for p in params]
        if "left_basis" in states[0]:
            exp_avg_sq = torch.stack([s["exp_avg_sq"] for s in states])
            updates = eigenbasis_precondition(
                updates,
                torch.stack([s["left_basis"] for s in states]),
                torch.stack([s["right_basis"] for s in states]),
                exp_avg_sq,
                group["beta2"],
                group["eps"],
            )
            torch._foreach_copy_([s["exp_avg_sq"] for s in states], list(exp_avg_sq.unbind(0)))
        return self.newton_schulz(group, params, updates).mul_(muon_shape_scale(rows, cols))

    def after_update(self, group: dict[str, Any], params: list[Tensor], grads: Tensor) -> None:
        states = [self.state[p] for p in params]
        for s, p in zip(states, params):
            if "soap_step" not in s:
                rows, cols = p.shape
                s["soap_step"] = 0
                s["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                s["left_factor"] = p.new_zeros(rows, rows)
                s["right_factor"] = p.new_zeros(cols, cols)
        weight = 1.0 - group["shampoo_beta"]
        left = torch.stack([s["left_factor"] for s in states]).lerp_(grads @ grads.mT, weight)
        right = torch.stack([s["right_factor"] for s in states]).lerp_(grads.mT @ grads, weight)
        step = states[0]["soap_step"]
        if step == 0:
            left_basis, right_basis = descending_eigenvectors(left), descending_eigenvectors(right)
            exp_avg_sq = None
        elif step % group["precondition_frequency"] == 0:
            exp_avg_sq = torch.stack([s["exp_avg_sq"] for s in states])
            left_basis, exp_avg_sq = refresh_basis(
                left, torch.stack([s["left_basis"] for s in states]), exp_avg_sq, dim=-2
            )
            right_basis, exp_avg_sq = refresh_basis(
                right, torch.stack([s["right_basis"] for s in states]), exp_avg_sq, dim=-1
            )
        else:
            left_basis = right_basis = exp_avg_sq = None
        for i, s in enumerate(states):
            s["left_factor"].copy_(left[i])
            s["right_factor"].copy_(right[i])
            if left_basis is not None:
                s["left_basis"], s["right_basis"] = left_basis[i].clone(), right_basis[i].clone()
            if exp_avg_sq is not None:
                s["exp_avg_sq"].copy_(exp_avg_sq[i])
            s["soap_step"] = step + 1
