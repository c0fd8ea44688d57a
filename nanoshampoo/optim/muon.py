"""Muon with optional cautious weight decay, and the step loop NorMuon and SOAP-Muon share.

Muon (Jordan et al., https://kellerjordan.github.io/posts/muon/; the modded-nanogpt speedrun's
``Muon``), per 2-D parameter ``W`` of shape ``(m, n)`` with gradient ``G`` at each step::

    M <- mu M + (1 - mu) G                      momentum (an EMA)
    U = (1 - mu) G + mu M    (nesterov)   or   U = M
    O = NS(U) * max(1, m / n) ** 0.5            Newton-Schulz ~ U_r V_r^T, times the
                                                speedrun's aspect-ratio scale
    W <- W - lr * (O + lam * W)                                 (decoupled weight decay)
    W <- W - lr * (O + lam * 1[O * W >= 0] * W)    (cautious_weight_decay=True)

Cautious weight decay (Chen et al., "Cautious Weight Decay", arXiv 2510.12402, the update rule
``x <- x - lr (u + lam I(u * x >= 0) * x)``) decays only the coordinates where the update ``O``
(the direction subtracted) has the parameter's sign, i.e. where the step already moves the
weight towards zero; where the two disagree the decay would fight the step. As in the paper and
the speedrun's track-1 ``NorMuonAndAdam`` the test is ``>= 0`` and the learning rate multiplies
the decay (track 3's record #46 uses ``> 0``: they differ only where ``O * W`` is exactly 0).

``OrthogonalizedMomentum`` is the shared loop: validation of every group's hyperparameters,
same-shape parameters of a group stacked into one ``(B, m, n)`` bucket (one batched
Newton-Schulz per bucket), the momentum, the weight decay and the parameter update. A subclass
supplies ``direction`` (``U -> O``) and may extend ``validate_group``, ``bucket_key`` and
``after_update``. State is kept per parameter (``momentum_buffer`` of the parameter's shape and
dtype), so ``state_dict`` / ``load_state_dict`` are torch's own. For inspection (telemetry),
``keep_orthogonalized()`` makes the next step keep a copy of each parameter's Newton-Schulz
output ``NS(U)``, which ``pop_orthogonalized()`` hands over; otherwise nothing is kept.

Example:
    >>> w = torch.nn.Parameter(torch.ones(4, 3))
    >>> opt = Muon([w], lr=0.1, weight_decay=0.5, cautious_weight_decay=True)
    >>> w.grad = torch.ones(4, 3)
    >>> opt.step()
    >>> # rank 1: NS maps the singular value 1 to p(p(p(p(p(1))))) = 0.6964, so every entry of O
    >>> # is 0.6964 / sqrt(12) * sqrt(4 / 3) = 0.2321 > 0, same sign as W: all of W decays.
    >>> round(float(w.detach()[0, 0]), 4)  # 1 - 0.1 * (0.2321 + 0.5 * 1)
    0.9268
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from nanoshampoo.optim.shampoo.config_checks import (
    check_bool,
    check_int,
    check_open_closed_unit,
    check_optional_tolerance,
)
from nanoshampoo.optim.shampoo.preconditioner.spectral_descent_preconditioner import (
    newton_schulz_orthogonalize,
)
from nanoshampoo.validation import is_real

# Keller Jordan's quintic Muon coefficients: singular values land in about [0.7, 1.2] in 5 steps.
MUON_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(updates: Tensor, coefficients: Sequence[float], num_iterations: int) -> Tensor:
    """``NS(U)`` for a ``(B, m, n)`` stack, in the stack's dtype (a new tensor).

    ``X_0 = U / ||U||_F``, then ``X <- a X + b (X X^T) X + c (X X^T)^2 X`` on the wide
    orientation (``nanoshampoo.optim.shampoo``'s batched Newton-Schulz). A zero matrix maps to 0.
    """
    a, b, c = (float(x) for x in coefficients)
    return newton_schulz_orthogonalize(updates, (a, b, c), num_iterations)


def muon_shape_scale(rows: int, cols: int) -> float:
    """The speedrun Muon's ``max(1, rows / cols) ** 0.5``: tall matrices get larger steps."""
    return max(1.0, rows / cols) ** 0.5


class OrthogonalizedMomentum(torch.optim.Optimizer):
    """Momentum, an orthogonalized direction, (cautious) decoupled weight decay: the shared loop.

    Group hyperparameters (all validated at construction, in ``add_param_group`` and at every
    ``step``; a ``ValueError`` names the argument): ``lr`` (finite, >= 0), ``momentum`` in
    ``[0, 1)``, ``nesterov`` (bool), ``weight_decay`` (finite, >= 0),
    ``cautious_weight_decay`` (bool), ``ns_steps`` (int >= 1), ``ns_coefficients`` (three finite
    floats). Every parameter must be a 2-D floating tensor. Parameters without a gradient are
    skipped: their state does not change. A subclass's ``direction`` orthogonalizes with
    :meth:`newton_schulz`, so that :meth:`keep_orthogonalized` sees its Newton-Schulz output.
    """

    # Armed by keep_orthogonalized() for one step: parameter -> a copy of its NS(U).
    _kept_orthogonalized: dict[Tensor, Tensor] | None = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate the group (with the defaults filled in), then add it; nothing half-added."""
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        merged = {**self.defaults, **param_group, "params": params}
        for p in params:
            if not isinstance(p, Tensor) or p.ndim != 2 or not p.is_floating_point():
                shape = tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__
                raise ValueError(
                    f"params: {type(self).__name__} updates 2-D floating-point matrices, got "
                    f"{shape}; give 1-D parameters, embeddings and heads to AdamW"
                )
        self.validate_group(merged)
        super().add_param_group(merged)

    def validate_group(self, group: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming the first bad hyperparameter of ``group``."""
        check_optional_tolerance("lr", group["lr"], allow_none=False)
        check_open_closed_unit("momentum", group["momentum"], low_open=False, high_open=True)
        check_bool("nesterov", group["nesterov"])
        check_optional_tolerance("weight_decay", group["weight_decay"], allow_none=False)
        check_bool("cautious_weight_decay", group["cautious_weight_decay"])
        check_int("ns_steps", group["ns_steps"], minimum=1)
        coefficients = group["ns_coefficients"]
        if not (
            isinstance(coefficients, (tuple, list))
            and len(coefficients) == 3
            and all(is_real(c) and math.isfinite(c) for c in coefficients)
        ):
            raise ValueError(f"ns_coefficients must be three finite floats, got {coefficients!r}")

    def keep_orthogonalized(self) -> None:
        """Make the next :meth:`step` keep a copy of every stepped parameter's ``NS(U)``."""
        self._kept_orthogonalized = {}

    def pop_orthogonalized(self) -> dict[Tensor, Tensor]:
        """Per parameter stepped since :meth:`keep_orthogonalized`, its Newton-Schulz output
        ``NS(U)`` ``(m, n)`` in the parameter's dtype (before any scaling or normalization);
        stops keeping. Empty when nothing was kept."""
        kept, self._kept_orthogonalized = self._kept_orthogonalized, None
        return kept or {}

    def newton_schulz(self, group: dict[str, Any], params: list[Tensor], updates: Tensor) -> Tensor:
        """``NS(U)`` of a bucket's ``(B, m, n)`` stack with the group's coefficients and steps
        (a new tensor); a copy per parameter is kept when :meth:`keep_orthogonalized` asked."""
        out = orthogonalize(updates, group["ns_coefficients"], group["ns_steps"])
        if self._kept_orthogonalized is not None:
            for p, o in zip(params, out.unbind(0)):
                self._kept_orthogonalized[p] = o.clone()
        return out

    def bucket_key(self, param: Tensor) -> tuple[Any, ...]:
        """Parameters of a group with equal keys are stacked and stepped together."""
        return (tuple(param.shape), param.dtype, param.device)

    def direction(
        self, group: dict[str, Any], params: list[Tensor], updates: Tensor, grads: Tensor
    ) -> Tensor:
        """The ``(B, m, n)`` step direction ``O`` (subtracted, times ``lr``) from ``U``."""
        raise NotImplementedError

    def after_update(self, group: dict[str, Any], params: list[Tensor], grads: Tensor) -> None:
        """Called once per bucket after the parameters moved (SOAP-Muon updates its factors)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step of every parameter that has a gradient; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self.validate_group(group)
        for group in self.param_groups:
            for params in self._buckets(group):
                self._step_bucket(group, params)
        return loss

    def _buckets(self, group: dict[str, Any]) -> list[list[Tensor]]:
        buckets: dict[tuple[Any, ...], list[Tensor]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise ValueError(f"params: {type(self).__name__} does not take sparse gradients")
            buckets.setdefault(self.bucket_key(p), []).append(p)
        return list(buckets.values())

    def _step_bucket(self, group: dict[str, Any], params: list[Tensor]) -> None:
        grads = [p.grad for p in params]
        buffers = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(
                    p, memory_format=torch.contiguous_format
                )
            buffers.append(state["momentum_buffer"])
        mu = group["momentum"]
        torch._foreach_lerp_(buffers, grads, 1.0 - mu)
        # Nesterov: the gradient moved a further mu of the way to the new momentum.
        updates = torch._foreach_lerp(grads, buffers, mu) if group["nesterov"] else buffers
        stacked_grads = torch.stack(grads)
        direction = self.direction(group, params, torch.stack(updates), stacked_grads)
        apply_update(
            params, direction, group["lr"], group["weight_decay"], group["cautious_weight_decay"]
        )
        self.after_update(group, params, stacked_grads)


def apply_update(
    params: list[Tensor], direction: Tensor, lr: float, weight_decay: float, cautious: bool
) -> None:
    """``W <- W - lr (O + wd W)``, or with the decay masked to ``O * W >= 0`` when ``cautious``.

    ``direction`` is the ``(B, m, n)`` stack of ``O`` for ``params`` (each ``(m, n)``), in place.
    """
    directions = list(direction.unbind(0))
    if weight_decay == 0.0:
        torch._foreach_add_(params, directions, alpha=-lr)
        return
    if not cautious:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
        torch._foreach_add_(params, directions, alpha=-lr)
        return
    for p, o in zip(params, directions):
        mask = (o * p) >= 0
        p.sub_(torch.addcmul(o, p, mask, value=weight_decay), alpha=lr)


class Muon(OrthogonalizedMomentum):
    """Muon (Nesterov momentum, Newton-Schulz, aspect-ratio scale) with (cautious) weight decay.

    The equations are the module docstring's. Defaults are the speedrun's Muon (lr 0.02,
    momentum 0.95, Nesterov, Keller Jordan's 5-step quintic coefficients) with no weight decay;
    track 3's tuned baseline uses ``lr=0.025, weight_decay=0.05`` and the convergent
    ``ns_coefficients=(2, -1.5, 0.5), ns_steps=12``.

    Args:
        params: 2-D parameters or param groups (each group may override any argument below).
        lr: learning rate, >= 0.
        momentum: ``mu`` in ``[0, 1)``.
        nesterov: use ``(1 - mu) G + mu M`` instead of ``M``.
        weight_decay: ``lam`` >= 0 (multiplied by ``lr``).
        cautious_weight_decay: decay only where ``O * W >= 0`` (arXiv 2510.12402).
        ns_steps: Newton-Schulz iterations, >= 1.
        ns_coefficients: ``(a, b, c)`` of the Newton-Schulz polynomial.

    Raises:
        ValueError: naming the argument that is out of range, or ``params`` for a parameter
            that is not a 2-D floating-point tensor.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        cautious_weight_decay: bool = False,
        ns_steps: int = 5,
        ns_coefficients: Sequence[float] = MUON_NS_COEFFICIENTS,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "cautious_weight_decay": cautious_weight_decay,
            "ns_steps": ns_steps,
            "ns_coefficients": ns_coefficients,
        }
        super().__init__(params, defaults)

    def direction(
        self, group: dict[str, Any], params: list[Tensor], updates: Tensor, grads: Tensor
    ) -> Tensor:
        rows, cols = updates.shape[-2:]
        return self.newton_schulz(group, params, updates).mul_(muon_shape_scale(rows, cols))
