"""AdamW and DistAdam: the embedding / head / 1-D optimizer of every recipe, and the ``adamw``
and ``distadam`` setups, where they also update the block matrices.

Tables: ``[adam]`` (:class:`AdamConfig`: the embedding, head and 1-D parameters, every setup)
and ``[adamw]`` (:class:`AdamWConfig`: the block matrices of ``adamw`` / ``distadam``).

``adamw`` is one ``torch.optim.AdamW`` over four param groups (embed, head, scalar, matrix);
``distadam`` one ``DistAdam`` per group, each reduce-scattering its own gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nanoshampoo.train.setups.checks import (
    check_beta,
    check_epsilon,
    check_finite_nonnegative,
    check_types,
)
from nanoshampoo.train.setups.registry import (
    BuildContext,
    OptimizerPart,
    register_setup,
    register_table,
)

REST_GROUPS = ("embed", "head", "scalar")


@register_table("adam")
@dataclass
class AdamConfig:
    """Adam for the embedding, the head and every 1-D parameter (the speedrun's lrs and betas).

    AdamW without weight decay, or DistAdam in the ``*-distadam`` setups.
    """

    embed_lr: float = 0.3
    head_lr: float = 1.0 / 320
    scalar_lr: float = 0.01
    beta1: float = 0.8
    beta2: float = 0.95
    eps: float = 1e-10

    def __post_init__(self) -> None:
        check_types("adam", self)
        check_finite_nonnegative("adam", self, "embed_lr", "head_lr", "scalar_lr")
        check_beta("adam", self, "beta1", "beta2")
        check_epsilon("adam", self, "eps")

    def lrs(self) -> dict[str, float]:
        return {"embed": self.embed_lr, "head": self.head_lr, "scalar": self.scalar_lr}


@register_table("adamw")
@dataclass
class AdamWConfig:
    """AdamW (DistAdam) for the block matrices in the ``adamw`` (``distadam``) setup."""

    lr: float = 0.0015
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.2

    def __post_init__(self) -> None:
        check_types("adamw", self)
        check_finite_nonnegative("adamw", self, "lr", "weight_decay")
        check_beta("adamw", self, "beta1", "beta2")


def rest_param_groups(ctx: BuildContext) -> list[dict[str, Any]]:
    """The embed / head / scalar param groups (the non-empty ones) at the ``[adam]`` lrs."""
    lrs = ctx.cfg.table(AdamConfig).lrs()
    return [dict(params=ctx.groups[name], lr=lrs[name]) for name in REST_GROUPS if ctx.groups[name]]


def build_rest_adamw(
    ctx: BuildContext, extra_groups: list[dict[str, Any]] | None = None
) -> OptimizerPart:
    """One AdamW over the embed / head / scalar groups (and ``extra_groups``), no weight decay
    but where a group sets its own."""
    adam = ctx.cfg.table(AdamConfig)
    groups = rest_param_groups(ctx) + list(extra_groups or [])
    return OptimizerPart(
        torch.optim.AdamW(groups, betas=(adam.beta1, adam.beta2), eps=adam.eps, weight_decay=0.0)
    )


def build_rest_distadam(ctx: BuildContext) -> list[OptimizerPart]:
    """One DistAdam per non-empty embed / head / scalar group (sharded over the ranks)."""
    from nanoshampoo.optim.dist_adam import DistAdam

    adam = ctx.cfg.table(AdamConfig)
    return [
        OptimizerPart(
            DistAdam(group["params"], lr=group["lr"], eps=adam.eps, betas=(adam.beta1, adam.beta2)),
            reduces_own_gradients=True,
        )
        for group in rest_param_groups(ctx)
    ]


@register_setup("adamw", tables=("adam", "adamw"), matrix="adamw", rest="adamw")
def build_adamw(ctx: BuildContext) -> list[OptimizerPart]:
    """AdamW for every parameter; the block matrices at the ``[adamw]`` hyper-parameters."""
    matrix = ctx.cfg.table(AdamWConfig)
    group = dict(
        params=ctx.groups["matrix"],
        lr=matrix.lr,
        betas=(matrix.beta1, matrix.beta2),
        weight_decay=matrix.weight_decay,
    )
    return [build_rest_adamw(ctx, [group])]


@register_setup("distadam", tables=("adam", "adamw"), matrix="distadam", rest="distadam")
def build_distadam(ctx: BuildContext) -> list[OptimizerPart]:
    """DistAdam for every parameter; the block matrices at the ``[adamw]`` hyper-parameters."""
    from nanoshampoo.optim.dist_adam import DistAdam

    adam = ctx.cfg.table(AdamConfig)
    matrix = ctx.cfg.table(AdamWConfig)
    blocks = DistAdam(
        ctx.groups["matrix"],
        lr=matrix.lr,
        eps=adam.eps,
        betas=(matrix.beta1, matrix.beta2),
        weight_decay=matrix.weight_decay,
    )
    return [*build_rest_distadam(ctx), OptimizerPart(blocks, reduces_own_gradients=True)]
