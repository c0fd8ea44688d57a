"""NorMuon: Muon's orthogonalized momentum, then a per-neuron (row-wise) Adam-style normalization.

Li, Liu, Liang, Chen, Zhao, "NorMuon: Making Muon more efficient and scalable", arXiv 2510.05491
(Algorithm 1), and the authors' released ``normuon.py`` (github.com/zichongli5/NorMuon). Per 2-D
parameter ``W`` of shape ``(m, n)`` (an ``nn.Linear`` weight: one row per output neuron)::

    M <- mu M + (1 - mu) G
    U = (1 - mu) G + mu M    (nesterov, the authors' code)   or   U = M   (Algorithm 1)
    O = NS(U)
    v <- beta2 v + (1 - beta2) mean_j O[:, j]^2        v in R^m: one second moment per row
    O_hat = O / (sqrt(v) + eps)                        each row divided by its RMS
    update_scale="muon"    (the authors' code and the speedrun):
        D = O_hat * ||O||_F / ||O_hat||_F * max(1, m / n) ** 0.5
    update_scale="adam_rms" (Algorithm 1):
        D = O_hat * 0.2 * sqrt(m n) / ||O_hat||_F      (an update RMS of 0.2, as AdamW's)
    W <- W - lr * (D + lam * W)      (or the cautious decay of ``nanoshampoo.optim.muon``)

There is no bias correction of ``v``, in the paper or the code: the last rescaling divides by
``||O_hat||_F``, so the scalar ``1 / (1 - beta2^t)`` would cancel (up to ``eps``). Both
rescalings fix the Frobenius norm of ``D``: the row normalization only redistributes the step
between neurons. The speedrun's track-1/3 ports normalize along the longer side (columns of a
wide matrix); this class follows the paper and the authors' code: always rows.

Example:
    >>> grad = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    >>> for optimizer_class in (Muon, NorMuon):
    ...     w = torch.nn.Parameter(torch.zeros(3, 2))
    ...     w.grad = grad.clone()
    ...     optimizer_class([w], lr=0.1).step()
    ...     print(optimizer_class.__name__, torch.linalg.vector_norm(w.detach(), dim=1))
    Muon tensor([0.0763, 0.0381, 0.1353])
    NorMuon tensor([0.0923, 0.0923, 0.0923])

    Same Frobenius norm (0.1599), but NorMuon gives every neuron (row) the same share.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from nanoshampoo.optim.muon import (  # noqa: F401 - Muon: docstring example
    MUON_NS_COEFFICIENTS,
    Muon,
    OrthogonalizedMomentum,
    muon_shape_scale,
)
from nanoshampoo.optim.shampoo.config_checks import (
    check_open_closed_unit,
    check_positive,
)

UPDATE_SCALES = ("muon", "adam_rms")
# Algorithm 1's target RMS per entry of the update (the 0.2 of Moonlight's Adam-matched Muon).
ADAM_MATCHED_RMS = 0.2
# Floor of ||O_hat||_F: a zero gradient gives a zero step, not 0 / 0.
_NORM_FLOOR = 1e-10


def normalize_rows(directions: Tensor, second_moment: Tensor, beta2: float, eps: float) -> Tensor:
    """``O / (sqrt(v) + eps)`` after ``v <- beta2 v + (1 - beta2) mean_j O[:, j]^2``.

    ``directions`` is ``(B, m, n)``; ``second_moment`` is the ``(B, m, 1)`` stack of ``v``,
    updated in place. Returns a new ``(B, m, n)`` tensor.
    """
    second_moment.lerp_(directions.square().mean(dim=-1, keepdim=True), 1.0 - beta2)
    return directions / (second_moment.sqrt() + eps)


class NorMuon(OrthogonalizedMomentum):
    """NorMuon (arXiv 2510.05491): the module docstring's equations, batched per shape.

    Defaults are the authors' released code (lr 0.02, momentum 0.95, Nesterov, beta2 0.95,
    ``update_scale="muon"``, eps 1e-10, no weight decay); ``nesterov=False,
    update_scale="adam_rms"`` is the paper's Algorithm 1. State per parameter:
    ``momentum_buffer`` ``(m, n)`` and ``second_moment`` ``(m, 1)``, in the parameter's dtype.

    Args:
        params, lr, momentum, nesterov, weight_decay, cautious_weight_decay, ns_steps,
            ns_coefficients: as ``nanoshampoo.optim.muon.Muon``.
        beta2: EMA weight of the per-row second moment, in ``[0, 1)``.
        eps: added to ``sqrt(v)``, > 0.
        update_scale: ``"muon"`` or ``"adam_rms"`` (see the module docstring).

    Raises:
        ValueError: naming the argument that is out of range.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        beta2: float = 0.95,
        eps: float = 1e-10,
        update_scale: str = "muon",
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
            "eps": eps,
            "update_scale": update_scale,
            "weight_decay": weight_decay,
            "cautious_weight_decay": cautious_weight_decay,
            "ns_steps": ns_steps,
            "ns_coefficients": ns_coefficients,
        }
        super().__init__(params, defaults)

    def validate_group(self, group: dict[str, Any]) -> None:
        super().validate_group(group)
        check_open_closed_unit("beta2", group["beta2"], low_open=False, high_open=True)
        check_positive("eps", group["eps"])
        if group["update_scale"] not in UPDATE_SCALES:
            raise ValueError(
                f"update_scale must be one of {UPDATE_SCALES}, got {group['update_scale']!r}"
            )

    def direction(
        self, group: dict[str, Any], params: list[Tensor], updates: Tensor, grads: Tensor
    ) -> Tensor:
        rows, cols = updates.shape[-2:]
        orthogonal = self.newton_schulz(group, params, updates)
        moments = []
        for p in params:
            state = self.state[p]
            if "second_moment" not in state:
                state["second_moment"] = torch.zeros(rows, 1, dtype=p.dtype, device=p.device)
            moments.append(state["second_moment"])
        second_moment = torch.stack(moments)
        normalized = normalize_rows(orthogonal, second_moment, group["beta2"], group["eps"])
        torch._foreach_copy_(moments, list(second_moment.unbind(0)))
        normalized_norm = torch.linalg.matrix_norm(normalized, keepdim=True).clamp_min(_NORM_FLOOR)
        if group["update_scale"] == "muon":
            target = torch.linalg.matrix_norm(orthogonal, keepdim=True)
            target = target * muon_shape_scale(rows, cols)
        else:
            target = ADAM_MATCHED_RMS * (rows * cols) ** 0.5
        return normalized.mul_(target / normalized_norm)
