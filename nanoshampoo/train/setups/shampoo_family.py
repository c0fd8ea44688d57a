"""The ``DistributedShampoo`` setups: ``shampoo``, ``soap``, ``muon`` for the block matrices,
with AdamW (or DistAdam in ``*-distadam``) for the embedding, head and 1-D parameters.

- ``shampoo`` (the optimization-track recipe, ``[shampoo]``): root-inverse preconditioner,
  Adam grafting, decoupled weight decay; roots by ``eigh`` or warm-started QR (``root_method``).
- ``soap`` (``[soap]``): the eigenvalue-corrected preconditioner, no grafting, as in the SOAP
  paper: Adam in the eigenbasis of the Kronecker factors, bias-corrected, the basis refreshed
  by one warm-started QR step every ``precondition_frequency`` steps.
- ``muon`` (``[muon]``): spectral descent (Newton-Schulz) as in the speedrun's Muon:
  ``M <- m M + (1 - m) G``, then ``orth(m M + (1 - m) G)`` (Nesterov: the library's
  ``beta3 = m**2``, no bias correction) times ``max(1, rows / cols)**0.5``.

``[preconditioner]`` holds what the three share. A ``"float32"`` storage dtype is passed as
None (the blocks' float32 computation dtype), so the defaults build the plain optimizer. The
distributor comes from ``TrainConfig``'s ``distributor``, ``communication_dtype``,
``communicate_params``, ``parallel`` and ``fsdp_assignment``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nanoshampoo.train.setups.adam import build_rest_adamw, build_rest_distadam
from nanoshampoo.train.setups.checks import (
    check_at_least,
    check_beta,
    check_choice,
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

if TYPE_CHECKING:
    from nanoshampoo.train.config import TrainConfig

STORAGE_DTYPES = ("float32", "bfloat16")
RANK_DEFICIENT_STABILITY = ("perturbation", "pseudo-inverse")
ROOT_METHODS = ("eigh", "warm-qr")


@register_table("preconditioner")
@dataclass
class PreconditionerConfig:
    """Shared by ``shampoo``, ``soap`` and ``muon``.

    ``start_preconditioning_step`` -1: the first root at step ``precondition_frequency`` (the
    library's rule). ``amortize_roots`` (shampoo, soap): a fixed share of the roots every step
    instead of all of them every ``precondition_frequency`` steps. ``momentum_dtype``: storage
    of the filtered gradient and the momentum. ``rank_deficient_stability``: "perturbation"
    adds epsilon, "pseudo-inverse" drops numerically-zero eigenvalues (epsilon is then 0).
    ``eigenvalue_floor_rtol``: eigenvalues below it times lambda_max count as rounding noise
    (raised to it, or dropped under "pseudo-inverse"); -1: the optimizer's default, 0: none.
    """

    max_preconditioner_dim: int = 8192
    start_preconditioning_step: int = -1
    factor_dtype: str = "float32"
    amortize_roots: bool = False
    momentum_dtype: str = "float32"
    rank_deficient_stability: str = "perturbation"
    eigenvalue_floor_rtol: float = -1.0

    def __post_init__(self) -> None:
        check_types("preconditioner", self)
        check_at_least("preconditioner", self, 1, "max_preconditioner_dim")
        for name in ("factor_dtype", "momentum_dtype"):
            check_choice("preconditioner", self, name, STORAGE_DTYPES)
        check_choice("preconditioner", self, "rank_deficient_stability", RANK_DEFICIENT_STABILITY)
        floor = self.eigenvalue_floor_rtol
        if not (floor == -1.0 or 0.0 <= floor < 1.0):
            raise ValueError(f"{field_label('preconditioner', 'eigenvalue_floor_rtol')} must be "
                             f"in [0, 1), or -1 for the optimizer's default, got {floor}")


@register_table("shampoo")
@dataclass
class ShampooConfig:
    """The optimization-track Shampoo: root-inverse, Adam grafting, decoupled weight decay.

    ``root_dtype`` stores the roots, ``grafting_dtype`` the grafting's second moment;
    ``pack_factors`` keeps the factors as lower triangles (half the bytes, the same numbers).
    ``root_method`` "warm-qr": roots from the previous eigenvectors, accepted within
    ``warm_qr_tolerance`` after at most ``warm_qr_max_iterations`` QR iterations, else eigh.
    Factors of at least ``large_factor_dim`` (0: off) get their root every
    ``precondition_frequency * large_factor_frequency_multiplier`` steps.
    """

    lr: float = 0.0015
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.2
    epsilon: float = 1e-12
    precondition_frequency: int = 5
    grafting_beta2: float = 0.95
    grafting_epsilon: float = 1e-10
    grafting_dtype: str = "float32"
    root_dtype: str = "float32"
    pack_factors: bool = False
    root_method: str = "eigh"
    warm_qr_tolerance: float = 0.05
    warm_qr_max_iterations: int = 1
    large_factor_dim: int = 0
    large_factor_frequency_multiplier: int = 1

    def __post_init__(self) -> None:
        check_types("shampoo", self)
        check_finite_nonnegative("shampoo", self, "lr", "weight_decay", "warm_qr_tolerance")
        check_epsilon("shampoo", self, "epsilon", "grafting_epsilon")
        check_beta("shampoo", self, "beta1", "beta2", "grafting_beta2")
        # beta2 0 keeps no factor statistics: the root of a single outer product is singular.
        if self.beta2 == 0.0:
            raise ValueError(f"{field_label('shampoo', 'beta2')} must be in (0, 1), got 0.0")
        check_at_least("shampoo", self, 1, "precondition_frequency",
                       "large_factor_frequency_multiplier")
        check_at_least("shampoo", self, 0, "warm_qr_max_iterations", "large_factor_dim")
        for name in ("grafting_dtype", "root_dtype"):
            check_choice("shampoo", self, name, STORAGE_DTYPES)
        check_choice("shampoo", self, "root_method", ROOT_METHODS)
        check_ema_dtype("shampoo", "grafting_dtype", self.grafting_dtype, self.grafting_beta2,
                        "grafting_beta2")


@register_table("soap")
@dataclass
class SoapConfig:
    """SOAP with its paper's betas, epsilon and frequency; decoupled weight decay."""

    lr: float = 0.003
    beta1: float = 0.95
    beta2: float = 0.95
    weight_decay: float = 0.2
    epsilon: float = 1e-8
    precondition_frequency: int = 10

    def __post_init__(self) -> None:
        check_types("soap", self)
        check_finite_nonnegative("soap", self, "lr", "weight_decay")
        check_epsilon("soap", self, "epsilon")
        check_beta("soap", self, "beta1", "beta2")
        if self.beta2 == 0.0:
            raise ValueError(f"{field_label('soap', 'beta2')} must be in (0, 1), got 0.0")
        check_at_least("soap", self, 1, "precondition_frequency")


@register_table("muon")
@dataclass
class MuonConfig:
    """The speedrun's Muon: Nesterov ``momentum``, ``ns_steps`` Newton-Schulz iterations whose
    matmuls run in ``ns_dtype``: "auto" (bfloat16 where its matmuls are faster: CUDA with bf16,
    or a CPU whose probe finds it faster; float32 elsewhere; the choice is logged), or forced
    "float32" / "bfloat16"."""

    lr: float = 0.05
    momentum: float = 0.95
    weight_decay: float = 0.0
    ns_steps: int = 5
    ns_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_types("muon", self)
        check_finite_nonnegative("muon", self, "lr", "weight_decay")
        check_beta("muon", self, "momentum")
        check_at_least("muon", self, 1, "ns_steps")
        check_choice("muon", self, "ns_dtype", ("auto", "float32", "bfloat16"))


def check_ema_dtype(table: str, name: str, dtype: str, beta: float, beta_name: str) -> None:
    """A narrow EMA stalls when its new-sample weight ``1 - beta`` is below the dtype's
    epsilon (the optimizer refuses it too, naming its own field): name ours here."""
    eps = torch.finfo(getattr(torch, dtype)).eps
    if dtype != "float32" and beta > 0.0 and not 1.0 - beta >= eps:
        raise ValueError(f"{field_label(table, name)} {dtype!r} cannot hold an EMA with "
                         f"{beta_name} {beta}: 1 - beta must be >= {eps} (each step's change "
                         "would round away)")


def _frequency_and_momentum(cfg: TrainConfig) -> tuple[int, float, str]:
    spec = cfg.setup.matrix
    if spec == "shampoo":
        return cfg.table("shampoo").precondition_frequency, cfg.table("shampoo").beta1, "shampoo.beta1"
    if spec == "soap":
        return cfg.table("soap").precondition_frequency, cfg.table("soap").beta1, "soap.beta1"
    return 1, cfg.table("muon").momentum, "muon.momentum"


def check_family_config(cfg: TrainConfig) -> None:
    """Across tables: the first root no earlier than the frequency; momentum storage vs beta."""
    frequency, momentum, momentum_name = _frequency_and_momentum(cfg)
    pre: PreconditionerConfig = cfg.table("preconditioner")
    start = pre.start_preconditioning_step
    if start != -1 and start < frequency:
        raise ValueError(f"{field_label('preconditioner', 'start_preconditioning_step')} must be "
                         f"-1 or >= the precondition frequency ({frequency}), got {start}")
    check_ema_dtype("preconditioner", "momentum_dtype", pre.momentum_dtype, momentum,
                    momentum_name)


def storage_dtype(name: str) -> torch.dtype | None:
    """A storage dtype (``STORAGE_DTYPES``) as an optimizer argument: None for ``"float32"``
    (the blocks' float32 computation dtype: no extra rounding), else the torch dtype."""
    return None if name == "float32" else getattr(torch, name)


def muon_shape_scale(d_in: int, d_out: int) -> float:
    """The speedrun Muon's update scale for a ``(d_out, d_in)`` matrix: ``max(1, d_out/d_in)**0.5``.

    Tall matrices get larger steps, so that the update's RMS per entry does not shrink with the
    aspect ratio. A named function: lambdas do not pickle.
    """
    return max(1.0, d_out / d_in) ** 0.5


def distributed_config(ctx: BuildContext) -> Any:
    """DDP (each rank computes its share of the blocks) when ``distributor`` is ``ddp``, or
    ``auto`` on more than one rank; else every rank computes every block. Under ``parallel``
    fsdp2 / hsdp: the fully- / hybrid-sharded distributor with ``fsdp_assignment``."""
    from nanoshampoo.optim.shampoo import (
        DDPDistributedConfig,
        FSDPParamAssignmentStrategy,
        FullyShardDistributedConfig,
        HybridShardDistributedConfig,
        SingleDeviceDistributedConfig,
    )

    cfg = ctx.cfg
    communication_dtype = getattr(torch, cfg.communication_dtype)
    if cfg.parallel == "ddp":
        if cfg.distributor == "ddp" or (cfg.distributor == "auto" and ctx.world_size > 1):
            return DDPDistributedConfig(communication_dtype=communication_dtype,
                                        communicate_params=cfg.communicate_params)
        return SingleDeviceDistributedConfig()
    sharded = (FullyShardDistributedConfig if cfg.parallel == "fsdp2"
               else HybridShardDistributedConfig)
    return sharded(
        param_assignment_strategy=FSDPParamAssignmentStrategy[cfg.fsdp_assignment.upper()],
        communication_dtype=communication_dtype, communicate_params=cfg.communicate_params)


def common_kwargs(ctx: BuildContext) -> dict[str, Any]:
    """The ``DistributedShampoo`` arguments the three setups share."""
    from nanoshampoo.optim.shampoo import WeightDecayType

    pre: PreconditionerConfig = ctx.cfg.table("preconditioner")
    return dict(max_preconditioner_dim=pre.max_preconditioner_dim,
                start_preconditioning_step=pre.start_preconditioning_step,
                weight_decay_type=WeightDecayType.DECOUPLED,
                distributed_config=distributed_config(ctx),
                momentum_dtype=storage_dtype(pre.momentum_dtype))


def stability_config(pre: PreconditionerConfig) -> Any:
    from nanoshampoo.optim.shampoo import PerturbationConfig, PseudoInverseConfig

    floor = None if pre.eigenvalue_floor_rtol == -1.0 else pre.eigenvalue_floor_rtol
    if pre.rank_deficient_stability == "pseudo-inverse":
        return PseudoInverseConfig(rank_rtol=floor)
    return PerturbationConfig(eigenvalue_floor_rtol=floor)


def build_shampoo_matrix(ctx: BuildContext) -> torch.optim.Optimizer:
    """``DistributedShampoo``, root-inverse with Adam grafting, for the block matrices."""
    from nanoshampoo.optim.shampoo import (
        AdamPreconditionerConfig,
        DistributedShampoo,
        EigenConfig,
        RootInvShampooPreconditionerConfig,
        WarmStartedEigenConfig,
    )

    pre: PreconditionerConfig = ctx.cfg.table("preconditioner")
    hp: ShampooConfig = ctx.cfg.table("shampoo")
    stability = stability_config(pre)
    root_solver = (WarmStartedEigenConfig(max_iterations=hp.warm_qr_max_iterations,
                                          tolerance=hp.warm_qr_tolerance,
                                          rank_deficient_stability_config=stability)
                   if hp.root_method == "warm-qr"
                   else EigenConfig(rank_deficient_stability_config=stability))
    return DistributedShampoo(
        ctx.groups["matrix"], lr=hp.lr, betas=(hp.beta1, hp.beta2),
        # The pseudo-inverse adds no ridge: the library requires epsilon 0 with it.
        epsilon=0.0 if pre.rank_deficient_stability == "pseudo-inverse" else hp.epsilon,
        weight_decay=hp.weight_decay, precondition_frequency=hp.precondition_frequency,
        use_bias_correction=True,
        grafting_config=AdamPreconditionerConfig(
            beta2=hp.grafting_beta2, epsilon=hp.grafting_epsilon,
            second_moment_dtype=storage_dtype(hp.grafting_dtype)),
        preconditioner_config=RootInvShampooPreconditionerConfig(
            amortized_computation_config=root_solver,
            factor_matrix_dtype=getattr(torch, pre.factor_dtype),
            inv_factor_matrix_dtype=storage_dtype(hp.root_dtype),
            use_symmetric_packing=hp.pack_factors, large_factor_dim=hp.large_factor_dim,
            large_factor_frequency_multiplier=hp.large_factor_frequency_multiplier),
        amortize_roots=pre.amortize_roots, **common_kwargs(ctx))


def build_soap_matrix(ctx: BuildContext) -> torch.optim.Optimizer:
    """``DistributedShampoo``, eigenvalue-corrected (SOAP), no grafting, for the block matrices."""
    from nanoshampoo.optim.shampoo import (
        DistributedShampoo,
        EigenvalueCorrectedShampooPreconditionerConfig,
        QREigendecompositionConfig,
    )

    pre: PreconditionerConfig = ctx.cfg.table("preconditioner")
    hp: SoapConfig = ctx.cfg.table("soap")
    return DistributedShampoo(
        ctx.groups["matrix"], lr=hp.lr, betas=(hp.beta1, hp.beta2),
        epsilon=0.0 if pre.rank_deficient_stability == "pseudo-inverse" else hp.epsilon,
        weight_decay=hp.weight_decay, precondition_frequency=hp.precondition_frequency,
        use_bias_correction=True, grafting_config=None,
        preconditioner_config=EigenvalueCorrectedShampooPreconditionerConfig(
            amortized_computation_config=QREigendecompositionConfig(
                rank_deficient_stability_config=stability_config(pre)),
            factor_matrix_dtype=getattr(torch, pre.factor_dtype)),
        amortize_roots=pre.amortize_roots, **common_kwargs(ctx))


def build_muon_matrix(ctx: BuildContext) -> torch.optim.Optimizer:
    """``DistributedShampoo`` with spectral descent (the speedrun's Muon) for the block matrices."""
    from nanoshampoo.optim.shampoo import (
        DistributedShampoo,
        NewtonSchulzOrthogonalizationConfig,
        SpectralDescentPreconditionerConfig,
    )

    hp: MuonConfig = ctx.cfg.table("muon")
    return DistributedShampoo(
        # beta2 is unused by the stateless spectral-descent preconditioner.
        ctx.groups["matrix"], lr=hp.lr, betas=(hp.momentum, 1.0), beta3=hp.momentum**2,
        weight_decay=hp.weight_decay, precondition_frequency=1, use_bias_correction=False,
        grafting_config=None,
        preconditioner_config=SpectralDescentPreconditionerConfig(
            orthogonalization_config=NewtonSchulzOrthogonalizationConfig(
                num_iterations=hp.ns_steps, scale_by_dims_fn=muon_shape_scale,
                compute_dtype=hp.ns_dtype if hp.ns_dtype == "auto" else getattr(torch, hp.ns_dtype))),
        **common_kwargs(ctx))


MATRIX_BUILDERS = {"shampoo": build_shampoo_matrix, "soap": build_soap_matrix,
                    "muon": build_muon_matrix}


def _register_family(matrix: str) -> None:
    """Register ``MATRIX`` (AdamW for the rest) and ``MATRIX-distadam`` (DistAdam for it)."""
    build_matrix = MATRIX_BUILDERS[matrix]
    tables = ("adam", "preconditioner", matrix)

    def with_adamw(ctx: BuildContext) -> list[OptimizerPart]:
        return [build_rest_adamw(ctx), OptimizerPart(build_matrix(ctx))]

    def with_distadam(ctx: BuildContext) -> list[OptimizerPart]:
        return [*build_rest_distadam(ctx), OptimizerPart(build_matrix(ctx))]

    register_setup(matrix, tables=tables, matrix=matrix, rest="adamw",
                   check=check_family_config)(with_adamw)
    register_setup(f"{matrix}-distadam", tables=tables, matrix=matrix, rest="distadam",
                   check=check_family_config)(with_distadam)


_register_family("shampoo")
_register_family("soap")
_register_family("muon")
