"""The ``lion`` setup: Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms",
arXiv 2302.06675, Algorithm 2) for the block matrices, the recipe's AdamW for the rest.

Table ``[lion]`` (:class:`LionConfig`), and ``[distributor]``. The block matrices get one
``DistributedShampoo`` with ``SignDescentPreconditionerConfig`` (``sign(Gbar)``, unit scale),
the filtered gradient set up so that ``Gbar`` is Lion's interpolation and ``M`` its momentum
(``betas=(beta2, .)``, ``beta3=beta1``, no bias correction), and decoupled weight decay::

    c = beta1 m + (1 - beta1) g
    W <- W - lr (sign(c) + wd W)
    m <- beta2 m + (1 - beta2) g

The paper's advice is an lr 3-10x smaller than AdamW's and a weight decay 3-10x larger (the
same ``lr wd``): the defaults are 1/3 and 3x ``[adamw]``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoshampoo.train.setups.adam import build_rest_adamw
from nanoshampoo.train.setups.checks import (
    check_beta,
    check_finite_nonnegative,
    check_types,
)
from nanoshampoo.train.setups.registry import (
    BuildContext,
    OptimizerPart,
    register_setup,
    register_table,
)
from nanoshampoo.train.setups.shampoo_family import check_distributor, distributed_config


@register_table("lion")
@dataclass
class LionConfig:
    """Lion for the block matrices: ``beta1`` interpolates the update's sign argument,
    ``beta2`` is the momentum's EMA (the paper's 0.9 and 0.99); decoupled ``weight_decay``."""

    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.6

    def __post_init__(self) -> None:
        check_types("lion", self)
        check_finite_nonnegative("lion", self, "lr", "weight_decay")
        check_beta("lion", self, "beta1", "beta2")


def build_lion_matrix(ctx: BuildContext) -> torch.optim.Optimizer:
    """``DistributedShampoo`` with sign descent set up as Lion, for the block matrices."""
    from nanoshampoo.optim.shampoo import (
        DistributedShampoo,
        SignDescentPreconditionerConfig,
        WeightDecayType,
    )

    hp = ctx.cfg.table(LionConfig)
    return DistributedShampoo(
        # betas[1] is unused by the stateless sign-descent preconditioner.
        ctx.groups["matrix"],
        lr=hp.lr,
        betas=(hp.beta2, 0.0),
        beta3=hp.beta1,
        weight_decay=hp.weight_decay,
        weight_decay_type=WeightDecayType.DECOUPLED,
        precondition_frequency=1,
        use_bias_correction=False,
        grafting_config=None,
        preconditioner_config=SignDescentPreconditionerConfig(),
        distributed_config=distributed_config(ctx),
    )


@register_setup(
    "lion",
    tables=("adam", "lion", "distributor"),
    matrix="lion",
    rest="adamw",
    check=check_distributor,
)
def build_lion(ctx: BuildContext) -> list[OptimizerPart]:
    return [build_rest_adamw(ctx), OptimizerPart(build_lion_matrix(ctx))]
