"""The ``kl-shampoo`` setup: KL-Shampoo (Lin et al. 2025, arXiv 2509.03378) for the block
matrices, with the optimization-track Shampoo recipe around it (Adam grafting, decoupled weight
decay, bias-corrected momentum), the recipe's AdamW for the rest.

Table ``[kl_shampoo]`` (:class:`KLShampooConfig`), and the shared ``[preconditioner]`` and
``[distributor]``. The
block matrices get one ``DistributedShampoo`` with ``RootInvKLShampooPreconditionerConfig``:
each factor is updated from the gradient preconditioned by the other factor's current root,
``L <- b2 L + (1 - b2) G X_R^2 G^T``, ``R <- b2 R + (1 - b2) G^T X_L^2 G``, and the roots are
``X = (F / (1 - b2^t) + epsilon I)^(-inverse_exponent)`` (the paper's 1/2: ``X_R^2`` is then
the other factor's inverse), by ``eigh`` every ``precondition_frequency`` steps. The search
direction ``X_L Gbar X_R`` is grafted onto Adam's norm per block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    SetupArguments,
    SetupInputs,
    register_setup,
    register_table,
)
from nanoshampoo.train.setups.shampoo_family import (
    PreconditionerConfig,
    build_matrix_optimizer,
    check_shampoo_setup,
    common_kwargs,
    stability_config,
)


@register_table("kl_shampoo")
@dataclass
class KLShampooConfig:
    """KL-Shampoo with Adam grafting: ``inverse_exponent`` is each factor's root exponent for a
    matrix (the paper's 1/2; classic Shampoo's is 1/4); the rest as ``[shampoo]``'s."""

    lr: float = 0.003
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.2
    epsilon: float = 1e-12
    precondition_frequency: int = 5
    inverse_exponent: float = 0.5
    grafting_beta2: float = 0.95
    grafting_epsilon: float = 1e-10

    def __post_init__(self) -> None:
        check_types("kl_shampoo", self)
        check_finite_nonnegative("kl_shampoo", self, "lr", "weight_decay")
        check_epsilon("kl_shampoo", self, "epsilon", "grafting_epsilon")
        check_beta("kl_shampoo", self, "beta1", "beta2", "grafting_beta2")
        # beta2 0 keeps no factor statistics: the root of a single outer product is singular.
        if self.beta2 == 0.0:
            raise ValueError(f"{field_label('kl_shampoo', 'beta2')} must be in (0, 1), got 0.0")
        if not 0.0 < self.inverse_exponent <= 1.0:
            raise ValueError(
                f"{field_label('kl_shampoo', 'inverse_exponent')} must be in "
                f"(0, 1], got {self.inverse_exponent}"
            )
        check_at_least("kl_shampoo", self, 1, "precondition_frequency")


def kl_shampoo_kwargs(pre: PreconditionerConfig, hp: KLShampooConfig) -> dict[str, Any]:
    """The ``DistributedShampoo`` arguments (but the parameters and the distributor):
    root-inverse KL-Shampoo with Adam grafting."""
    from nanoshampoo.optim.shampoo import (
        AdamPreconditionerConfig,
        EigenConfig,
        RootInvKLShampooPreconditionerConfig,
    )

    return dict(
        lr=hp.lr,
        betas=(hp.beta1, hp.beta2),
        # The pseudo-inverse adds no ridge: the library requires epsilon 0 with it.
        epsilon=0.0 if pre.rank_deficient_stability == "pseudo-inverse" else hp.epsilon,
        weight_decay=hp.weight_decay,
        precondition_frequency=hp.precondition_frequency,
        use_bias_correction=True,
        grafting_config=AdamPreconditionerConfig(
            beta2=hp.grafting_beta2, epsilon=hp.grafting_epsilon
        ),
        preconditioner_config=RootInvKLShampooPreconditionerConfig(
            amortized_computation_config=EigenConfig(
                rank_deficient_stability_config=stability_config(pre)
            ),
            factor_matrix_dtype=getattr(torch, pre.factor_dtype),
            inverse_exponent_override={2: hp.inverse_exponent},
        ),
        amortize_roots=pre.amortize_roots,
        **common_kwargs(pre),
    )


def check_kl_config(cfg: SetupInputs) -> SetupArguments:
    """The setup's ``DistributedShampoo`` arguments, built once and checked by the optimizer's
    own group rules (errors naming the trainer's fields), kept for the builder."""
    kwargs = kl_shampoo_kwargs(cfg.table(PreconditionerConfig), cfg.table(KLShampooConfig))
    # The [kl_shampoo] table names its fields as [shampoo] does, so the family's labels fit.
    return check_shampoo_setup(cfg, kwargs, "kl_shampoo")


@register_setup(
    "kl-shampoo",
    tables=("adam", "preconditioner", "kl_shampoo", "distributor"),
    matrix="kl-shampoo",
    rest="adamw",
    check=check_kl_config,
)
def build_kl_shampoo(ctx: BuildContext) -> list[OptimizerPart]:
    return [build_rest_adamw(ctx), OptimizerPart(build_matrix_optimizer(ctx))]
