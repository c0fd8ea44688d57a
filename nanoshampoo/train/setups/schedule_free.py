"""The ``schedule-free`` setup: Schedule-Free AdamW (Defazio et al. 2024, "The Road Less
Scheduled", arXiv 2405.15682) for the block matrices, the recipe's AdamW for the rest.

Table ``[schedule_free]`` (:class:`ScheduleFreeAdamWConfig`), and ``[distributor]``. The block
matrices get one
``DistributedShampoo`` with an Adam preconditioner (bias-corrected second moment, no first
moment: ``betas=(0.0, beta2)``) and ``ScheduleFreeConfig``; per block, with ``P`` the
preconditioned gradient at the training point ``y`` (the parameters while training)::

    v <- beta2 v + (1 - beta2) g^2;        P = g / (sqrt(v / (1 - beta2^t)) + epsilon)
    mu_x = 1 - lr^r / sum_{i<=t} lr_i^r                       (r = eval_coeff_lr_power)
    z <- (1 - lr wd) z
    y <- y + (1 - mu_x)(z - y) - (1 - mu_x beta1) lr P;     z <- z - lr P

so that the average ``x = (y - (1 - beta1) z) / beta1`` is the ``lr^r``-weighted mean of the
``z``, and ``y = beta1 x + (1 - beta1) z``. The parameters hold ``x`` after
``optimizer.eval()``: the trainer validates and checkpoints there
(``OptimizerSetup.evaluation_point``). Two departures from the paper's Algorithm 1, both the
reference library's: the decay shrinks ``z`` (the paper adds ``wd y`` to the step of ``z``),
and the trainer's lr schedule (constant, then the cooldown every setup shares) still applies;
the ``lr^r`` weights give the cooldown's small steps little weight in ``x``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoshampoo.train.setups.adam import build_rest_adamw
from nanoshampoo.train.setups.checks import (
    check_at_least,
    check_beta,
    check_epsilon,
    check_finite_nonnegative,
    check_types,
    field_label,
)
from nanoshampoo.train.setups.registry import (
    BuildContext,
    OptimizerPart,
    register_setup,
    register_table,
)
from nanoshampoo.train.setups.shampoo_family import check_distributor, distributed_config


@register_table("schedule_free")
@dataclass
class ScheduleFreeAdamWConfig:
    """Schedule-Free AdamW for the block matrices: ``beta1`` is the interpolation ``y = beta1
    x + (1 - beta1) z`` (the library's ``train_interp_coeff``), ``beta2`` Adam's second moment,
    ``eval_coeff_lr_power`` the ``r`` of the ``lr^r`` weights of the average (the paper's 2)."""

    lr: float = 0.006
    beta1: float = 0.9
    beta2: float = 0.95
    epsilon: float = 1e-8
    weight_decay: float = 0.2
    eval_coeff_lr_power: int = 2

    def __post_init__(self) -> None:
        check_types("schedule_free", self)
        check_finite_nonnegative("schedule_free", self, "lr", "weight_decay")
        check_epsilon("schedule_free", self, "epsilon")
        check_beta("schedule_free", self, "beta2")
        # y = beta1 x + (1 - beta1) z: beta1 0 would evaluate where no gradient is taken.
        if not 0.0 < self.beta1 <= 1.0:
            raise ValueError(
                f"{field_label('schedule_free', 'beta1')} must be in (0, 1], got {self.beta1}"
            )
        check_at_least("schedule_free", self, 0, "eval_coeff_lr_power")


def build_schedule_free_matrix(ctx: BuildContext) -> torch.optim.Optimizer:
    """``DistributedShampoo``: Adam preconditioner and ``ScheduleFreeConfig``, block matrices."""
    from nanoshampoo.optim.shampoo import (
        AdamPreconditionerConfig,
        DistributedShampoo,
        ScheduleFreeConfig,
        WeightDecayType,
    )

    hp = ctx.cfg.table(ScheduleFreeAdamWConfig)
    return DistributedShampoo(
        ctx.groups["matrix"],
        lr=hp.lr,
        betas=(0.0, hp.beta2),
        epsilon=hp.epsilon,
        weight_decay=hp.weight_decay,
        weight_decay_type=WeightDecayType.DECOUPLED,
        precondition_frequency=1,
        use_bias_correction=True,
        grafting_config=None,
        preconditioner_config=AdamPreconditionerConfig(beta2=hp.beta2, epsilon=hp.epsilon),
        iterate_averaging_config=ScheduleFreeConfig(
            train_interp_coeff=hp.beta1, eval_coeff_lr_power=hp.eval_coeff_lr_power
        ),
        distributed_config=distributed_config(ctx),
    )


@register_setup(
    "schedule-free",
    tables=("adam", "schedule_free", "distributor"),
    matrix="schedule-free",
    rest="adamw",
    check=check_distributor,
)
def build_schedule_free(ctx: BuildContext) -> list[OptimizerPart]:
    return [build_rest_adamw(ctx), OptimizerPart(build_schedule_free_matrix(ctx))]
