"""The ``normuon`` and ``muon-cwd`` setups: ``nanoshampoo.optim.normuon``'s NorMuon and Muon
with cautious weight decay for the block matrices, the recipe's AdamW for the rest.

Tables ``[normuon]`` (:class:`NorMuonConfig`) and ``[muon_cwd]`` (:class:`MuonCwdConfig`). Both
are plain single-process optimizers: the trainer averages their gradients across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoshampoo.train.setups.adam import build_rest_adamw
from nanoshampoo.train.setups.checks import (
    check_at_least,
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


@register_table("normuon")
@dataclass
class NorMuonConfig:
    """NorMuon (arXiv 2510.05491): Muon with per-row normalized updates (``beta2``: the rows'
    second-moment EMA); decoupled weight decay, cautious when ``cautious_weight_decay``."""

    lr: float = 0.02
    momentum: float = 0.95
    beta2: float = 0.95
    weight_decay: float = 0.1
    ns_steps: int = 5
    cautious_weight_decay: bool = True

    def __post_init__(self) -> None:
        check_types("normuon", self)
        check_finite_nonnegative("normuon", self, "lr", "weight_decay")
        check_beta("normuon", self, "momentum", "beta2")
        check_at_least("normuon", self, 1, "ns_steps")


@register_table("muon_cwd")
@dataclass
class MuonCwdConfig:
    """The speedrun's Muon with cautious weight decay (decay only where update and weight
    agree in sign)."""

    lr: float = 0.02
    momentum: float = 0.95
    weight_decay: float = 0.1
    ns_steps: int = 5

    def __post_init__(self) -> None:
        check_types("muon_cwd", self)
        check_finite_nonnegative("muon_cwd", self, "lr", "weight_decay")
        check_beta("muon_cwd", self, "momentum")
        check_at_least("muon_cwd", self, 1, "ns_steps")


@register_setup("normuon", tables=("adam", "normuon"), matrix="normuon", rest="adamw")
def build_normuon(ctx: BuildContext) -> list[OptimizerPart]:
    from nanoshampoo.optim.normuon import NorMuon

    hp: NorMuonConfig = ctx.cfg.table("normuon")
    matrix = NorMuon(ctx.groups["matrix"], lr=hp.lr, momentum=hp.momentum, beta2=hp.beta2,
                     weight_decay=hp.weight_decay, ns_steps=hp.ns_steps,
                     cautious_weight_decay=hp.cautious_weight_decay)
    return [build_rest_adamw(ctx), OptimizerPart(matrix)]


@register_setup("muon-cwd", tables=("adam", "muon_cwd"), matrix="muon-cwd", rest="adamw")
def build_muon_cwd(ctx: BuildContext) -> list[OptimizerPart]:
    from nanoshampoo.optim.normuon import Muon

    hp: MuonCwdConfig = ctx.cfg.table("muon_cwd")
    matrix = Muon(ctx.groups["matrix"], lr=hp.lr, momentum=hp.momentum,
                  weight_decay=hp.weight_decay, ns_steps=hp.ns_steps, cautious_weight_decay=True)
    return [build_rest_adamw(ctx), OptimizerPart(matrix)]
