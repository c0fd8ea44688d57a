"""The ``normuon``, ``muon-cwd`` and ``soap-muon`` setups: NorMuon
(``nanoshampoo.optim.normuon``), Muon with cautious weight decay (``nanoshampoo.optim.muon``) and
SOAP-Muon (``nanoshampoo.optim.soap_muon``) for the block matrices, the recipe's AdamW for the
rest.

Tables ``[normuon]`` (:class:`NorMuonConfig`), ``[muon_cwd]`` (:class:`MuonCwdConfig`) and
``[soap_muon]`` (:class:`SoapMuonConfig`). All are plain single-process optimizers: the trainer
averages their gradients across ranks. Their equations and sources:
docs/results/field-optimizers.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoshampoo.train.setups.adam import build_rest_adamw
from nanoshampoo.train.setups.checks import (
    check_at_least,
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

    hp = ctx.cfg.table(NorMuonConfig)
    matrix = NorMuon(
        ctx.groups["matrix"],
        lr=hp.lr,
        momentum=hp.momentum,
        beta2=hp.beta2,
        weight_decay=hp.weight_decay,
        ns_steps=hp.ns_steps,
        cautious_weight_decay=hp.cautious_weight_decay,
    )
    return [build_rest_adamw(ctx), OptimizerPart(matrix)]


@register_setup("muon-cwd", tables=("adam", "muon_cwd"), matrix="muon-cwd", rest="adamw")
def build_muon_cwd(ctx: BuildContext) -> list[OptimizerPart]:
    from nanoshampoo.optim.muon import Muon

    hp = ctx.cfg.table(MuonCwdConfig)
    matrix = Muon(
        ctx.groups["matrix"],
        lr=hp.lr,
        momentum=hp.momentum,
        weight_decay=hp.weight_decay,
        ns_steps=hp.ns_steps,
        cautious_weight_decay=True,
    )
    return [build_rest_adamw(ctx), OptimizerPart(matrix)]


@register_table("soap_muon")
@dataclass
class SoapMuonConfig:
    """SOAP-Muon as the speedrun's optimization track runs it (Adam in the Shampoo eigenbasis on
    Muon's Nesterov momentum, before Newton-Schulz). Defaults: track 3's records #14/#44 (lr
    0.0375, ``beta2 = shampoo_beta = 0.9``, no weight decay) with record #14's basis refresh
    every 10 steps, which keeps a CPU run in minutes; not tuned on the embedded task."""

    lr: float = 0.0375
    momentum: float = 0.95
    beta2: float = 0.9
    shampoo_beta: float = 0.9
    eps: float = 1e-8
    precondition_frequency: int = 10
    weight_decay: float = 0.0
    ns_steps: int = 5

    def __post_init__(self) -> None:
        check_types("soap_muon", self)
        check_finite_nonnegative("soap_muon", self, "lr", "weight_decay")
        check_beta("soap_muon", self, "momentum", "beta2", "shampoo_beta")
        check_epsilon("soap_muon", self, "eps")
        check_at_least("soap_muon", self, 1, "precondition_frequency", "ns_steps")


@register_setup("soap-muon", tables=("adam", "soap_muon"), matrix="soap-muon", rest="adamw")
def build_soap_muon(ctx: BuildContext) -> list[OptimizerPart]:
    from nanoshampoo.optim.soap_muon import SOAPMuon

    hp = ctx.cfg.table(SoapMuonConfig)
    matrix = SOAPMuon(
        ctx.groups["matrix"],
        lr=hp.lr,
        momentum=hp.momentum,
        beta2=hp.beta2,
        shampoo_beta=hp.shampoo_beta,
        eps=hp.eps,
        precondition_frequency=hp.precondition_frequency,
        weight_decay=hp.weight_decay,
        ns_steps=hp.ns_steps,
    )
    return [build_rest_adamw(ctx), OptimizerPart(matrix)]
