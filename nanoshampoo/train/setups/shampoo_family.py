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
None (the blocks' float32 computation dtype), so the defaults build the plain optimizer.
``[distributor]`` (:class:`DistributorConfig`) says how every setup built on
``DistributedShampoo`` (these, ``kl-shampoo``, ``schedule-free``, ``lion``) spreads its work
over the ranks, with the run's ``parallel`` mode.

Where the rules live: a table's ``__post_init__`` checks what its fields must be whatever the
setup (types, choices, finite learning rates, betas in [0, 1)), without importing the optimizer,
so an unused table is checked too. The optimizer's own rules (storage dtypes that cannot hold an
EMA, the first root vs the precondition frequency, every config field) are not repeated here:
each setup's check builds the library's configs once and validates the group they make, for the
setup that runs, and the error names the trainer's flag (``library_checks``); the config keeps
what it built (``SetupArguments``) and the builder passes it to the optimizer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

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
from nanoshampoo.train.setups.library_checks import check_shampoo_group, library_config
from nanoshampoo.train.setups.registry import (
    BuildContext,
    OptimizerPart,
    SetupArguments,
    SetupInputs,
    register_setup,
    register_table,
)

STORAGE_DTYPES = ("float32", "bfloat16")
DISTRIBUTOR_KINDS = ("auto", "single", "ddp")
# FSDPParamAssignmentStrategy of the sharded Shampoo (see its docstring): "round_robin" and
# "replicate" are lossless, "default" preconditions each rank's shard on its own.
FSDP_ASSIGNMENTS = ("default", "round_robin", "replicate")
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
    adds epsilon, "pseudo-inverse" drops numerically-zero eigenvalues (epsilon is then 0;
    Shampoo and KL-Shampoo only: SOAP refuses it, as the library's SOAP config does).
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
            raise ValueError(
                f"{field_label('preconditioner', 'eigenvalue_floor_rtol')} must be "
                f"in [0, 1), or -1 for the optimizer's default, got {floor}"
            )


@register_table("distributor")
@dataclass
class DistributorConfig:
    """How ``DistributedShampoo`` spreads its work over the ranks (every setup built on it).

    ``kind`` "auto": DDP (each rank computes its share of the blocks) when the world size is
    above 1; "single": every rank computes every block; "ddp": DDP always. Under ``parallel``
    fsdp2 / hsdp the sharding decides (``kind`` must stay "auto") and ``fsdp_assignment`` says
    which rank preconditions which block. ``communication_dtype`` carries the blocks' updates
    between ranks; ``communicate_params`` sends the updated parameters rather than the updates.
    """

    kind: str = "auto"
    communication_dtype: str = "float32"
    communicate_params: bool = True
    fsdp_assignment: str = "round_robin"

    def __post_init__(self) -> None:
        check_types("distributor", self)
        check_choice("distributor", self, "kind", DISTRIBUTOR_KINDS)
        check_choice("distributor", self, "communication_dtype", STORAGE_DTYPES)
        check_choice("distributor", self, "fsdp_assignment", FSDP_ASSIGNMENTS)


def check_distributor(cfg: SetupInputs) -> None:
    """``[distributor]`` against the run's ``parallel`` mode (``ValueError`` naming the field)."""
    kind = cfg.table(DistributorConfig).kind
    if cfg.parallel.mode != "ddp" and kind != "auto":
        raise ValueError(
            f"{field_label('distributor', 'kind')} must be 'auto' under parallel="
            f"{cfg.parallel.mode!r} (the sharding decides), got {kind!r}"
        )


@register_table("shampoo")
@dataclass
class ShampooConfig:
    """The optimization-track Shampoo: root-inverse, Adam grafting, decoupled weight decay.

    ``root_dtype`` stores the roots, ``grafting_dtype`` the grafting's second moment;
    ``pack_factors`` keeps the factors as upper triangles (half the bytes, the same numbers).
    ``precondition_dtype`` "bfloat16" runs the preconditioning GEMMs ``X_L G X_R`` in bfloat16
    (the library's ``precondition_dtype``; roots and factors keep their dtypes).
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
    precondition_dtype: str = "float32"
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
        check_at_least(
            "shampoo", self, 1, "precondition_frequency", "large_factor_frequency_multiplier"
        )
        check_at_least("shampoo", self, 0, "warm_qr_max_iterations", "large_factor_dim")
        for name in ("grafting_dtype", "root_dtype", "precondition_dtype"):
            check_choice("shampoo", self, name, STORAGE_DTYPES)
        check_choice("shampoo", self, "root_method", ROOT_METHODS)


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


def labels(table: str, **library_to_trainer: str) -> dict[str, str]:
    """Library field -> trainer label: ``labels("shampoo",
    inv_factor_matrix_dtype="root_dtype")``."""
    return {lib: field_label(table, ours) for lib, ours in library_to_trainer.items()}


def group_labels(matrix: str) -> dict[str, str]:
    """The trainer fields behind each ``DistributedShampoo`` group entry of setup ``matrix``."""
    shared = labels(
        "preconditioner",
        max_preconditioner_dim="max_preconditioner_dim",
        start_preconditioning_step="start_preconditioning_step",
        momentum_dtype="momentum_dtype",
        amortize_roots="amortize_roots",
    )
    if matrix == "muon":
        # betas[0] and beta3 (its square) both come from the momentum.
        own = labels(
            "muon",
            lr="lr",
            weight_decay="weight_decay",
            beta3="momentum",
            **{"betas[0]": "momentum"},
        )
    else:
        own = labels(
            matrix,
            lr="lr",
            weight_decay="weight_decay",
            epsilon="epsilon",
            precondition_frequency="precondition_frequency",
            **{"betas[0]": "beta1", "betas[1]": "beta2"},
        )
    return shared | own


def storage_dtype(name: str) -> torch.dtype | None:
    """A dtype of ``STORAGE_DTYPES`` (a storage dtype, or the GEMM dtype ``precondition_dtype``)
    as an optimizer argument: None for ``"float32"`` (the blocks' float32 computation dtype: no
    extra rounding), else the torch dtype."""
    return None if name == "float32" else getattr(torch, name)


def muon_shape_scale(d_in: int, d_out: int) -> float:
    """The speedrun Muon's update scale for a ``(d_out, d_in)`` matrix: ``max(1, d_out/d_in)**0.5``.

    Tall matrices get larger steps, so that the update's RMS per entry does not shrink with the
    aspect ratio. A named function: lambdas do not pickle. The optimizer's state dict holds it
    (its config is in ``param_groups``), so it is registered for ``torch.load(weights_only=True)``.
    """
    return max(1.0, d_out / d_in) ** 0.5


torch.serialization.add_safe_globals([muon_shape_scale])


def distributed_config(ctx: BuildContext) -> Any:
    """The library's distributor config, as ``[distributor]`` and the run's ``parallel`` say
    (see :class:`DistributorConfig`)."""
    from nanoshampoo.optim.shampoo import (
        DDPDistributedConfig,
        FSDPParamAssignmentStrategy,
        FullyShardDistributedConfig,
        HybridShardDistributedConfig,
        SingleDeviceDistributedConfig,
    )

    dist = ctx.cfg.table(DistributorConfig)
    communication_dtype = getattr(torch, dist.communication_dtype)
    if ctx.cfg.parallel.mode == "ddp":
        if dist.kind == "ddp" or (dist.kind == "auto" and ctx.world_size > 1):
            return DDPDistributedConfig(
                communication_dtype=communication_dtype, communicate_params=dist.communicate_params
            )
        return SingleDeviceDistributedConfig()
    sharded = (
        FullyShardDistributedConfig
        if ctx.cfg.parallel.mode == "fsdp2"
        else HybridShardDistributedConfig
    )
    return sharded(
        param_assignment_strategy=FSDPParamAssignmentStrategy[dist.fsdp_assignment.upper()],
        communication_dtype=communication_dtype,
        communicate_params=dist.communicate_params,
    )


def common_kwargs(pre: PreconditionerConfig) -> dict[str, Any]:
    """The ``DistributedShampoo`` arguments the three setups share, but the distributor."""
    from nanoshampoo.optim.shampoo import WeightDecayType

    return dict(
        max_preconditioner_dim=pre.max_preconditioner_dim,
        start_preconditioning_step=pre.start_preconditioning_step,
        weight_decay_type=WeightDecayType.DECOUPLED,
        momentum_dtype=storage_dtype(pre.momentum_dtype),
    )


def stability_config(pre: PreconditionerConfig) -> Any:
    from nanoshampoo.optim.shampoo import PerturbationConfig, PseudoInverseConfig

    floor = None if pre.eigenvalue_floor_rtol == -1.0 else pre.eigenvalue_floor_rtol
    if pre.rank_deficient_stability == "pseudo-inverse":
        return library_config(
            PseudoInverseConfig,
            labels("preconditioner", rank_rtol="eigenvalue_floor_rtol"),
            rank_rtol=floor,
        )
    return library_config(
        PerturbationConfig,
        labels("preconditioner", eigenvalue_floor_rtol="eigenvalue_floor_rtol"),
        eigenvalue_floor_rtol=floor,
    )


def _epsilon(pre: PreconditionerConfig, epsilon: float) -> float:
    # The pseudo-inverse adds no ridge: the library requires epsilon 0 with it.
    return 0.0 if pre.rank_deficient_stability == "pseudo-inverse" else epsilon


def shampoo_kwargs(pre: PreconditionerConfig, hp: ShampooConfig) -> dict[str, Any]:
    """``DistributedShampoo`` arguments (no parameters, no distributor): root-inverse with
    Adam grafting. Builds, and so validates, the library's configs."""
    from nanoshampoo.optim.shampoo import (
        AdamPreconditionerConfig,
        EigenConfig,
        RootInvShampooPreconditionerConfig,
        WarmStartedEigenConfig,
    )

    stability = stability_config(pre)
    root_solver = (
        library_config(
            WarmStartedEigenConfig,
            labels(
                "shampoo", max_iterations="warm_qr_max_iterations", tolerance="warm_qr_tolerance"
            ),
            max_iterations=hp.warm_qr_max_iterations,
            tolerance=hp.warm_qr_tolerance,
            rank_deficient_stability_config=stability,
        )
        if hp.root_method == "warm-qr"
        else EigenConfig(rank_deficient_stability_config=stability)
    )
    grafting = library_config(
        AdamPreconditionerConfig,
        labels(
            "shampoo",
            beta2="grafting_beta2",
            epsilon="grafting_epsilon",
            second_moment_dtype="grafting_dtype",
        ),
        beta2=hp.grafting_beta2,
        epsilon=hp.grafting_epsilon,
        second_moment_dtype=storage_dtype(hp.grafting_dtype),
    )
    preconditioner = library_config(
        RootInvShampooPreconditionerConfig,
        labels(
            "shampoo",
            inv_factor_matrix_dtype="root_dtype",
            precondition_dtype="precondition_dtype",
            use_symmetric_packing="pack_factors",
            large_factor_dim="large_factor_dim",
            large_factor_frequency_multiplier="large_factor_frequency_multiplier",
        )
        | labels("preconditioner", factor_matrix_dtype="factor_dtype"),
        amortized_computation_config=root_solver,
        factor_matrix_dtype=getattr(torch, pre.factor_dtype),
        inv_factor_matrix_dtype=storage_dtype(hp.root_dtype),
        precondition_dtype=storage_dtype(hp.precondition_dtype),
        use_symmetric_packing=hp.pack_factors,
        large_factor_dim=hp.large_factor_dim,
        large_factor_frequency_multiplier=hp.large_factor_frequency_multiplier,
    )
    return dict(
        lr=hp.lr,
        betas=(hp.beta1, hp.beta2),
        epsilon=_epsilon(pre, hp.epsilon),
        weight_decay=hp.weight_decay,
        precondition_frequency=hp.precondition_frequency,
        use_bias_correction=True,
        grafting_config=grafting,
        preconditioner_config=preconditioner,
        amortize_roots=pre.amortize_roots,
        **common_kwargs(pre),
    )


def soap_kwargs(pre: PreconditionerConfig, hp: SoapConfig) -> dict[str, Any]:
    """``DistributedShampoo`` arguments: eigenvalue-corrected (SOAP), no grafting."""
    from nanoshampoo.optim.shampoo import (
        EigenvalueCorrectedShampooPreconditionerConfig,
        QREigendecompositionConfig,
    )

    if pre.rank_deficient_stability != "perturbation":
        # The library's SOAP config refuses a PseudoInverseConfig (as the reference's does):
        # SOAP adds epsilon to its corrected eigenvalues. Said here in the trainer's terms.
        raise ValueError(
            f"{field_label('preconditioner', 'rank_deficient_stability')} must be "
            f"'perturbation' for SOAP, got {pre.rank_deficient_stability!r}: SOAP adds epsilon "
            "to its corrected eigenvalues and has no pseudo-inverse (shampoo and kl-shampoo "
            "have one)"
        )
    preconditioner = library_config(
        EigenvalueCorrectedShampooPreconditionerConfig,
        labels("preconditioner", factor_matrix_dtype="factor_dtype"),
        # The trainer's SOAP keeps this library's robust refresh (docs/compat.md, "SOAP's
        # eigenbases"): the first basis by eigh, as nikhilvyas/SOAP computes it, then one QR step
        # on the descending basis unless it is already within 1 % of diagonal. The reference
        # library's default (a QR step from the identity first) is a poorer first basis.
        amortized_computation_config=QREigendecompositionConfig(
            rank_deficient_stability_config=stability_config(pre),
            tolerance=0.01,
            keep_descending_order=True,
        ),
        factor_matrix_dtype=getattr(torch, pre.factor_dtype),
        # Full factors, as the trainer's SOAP has always run (the library packs by default: its
        # QR refresh then differs in the last bits on rank-deficient factors).
        use_symmetric_packing=False,
    )
    return dict(
        lr=hp.lr,
        betas=(hp.beta1, hp.beta2),
        epsilon=hp.epsilon,
        weight_decay=hp.weight_decay,
        precondition_frequency=hp.precondition_frequency,
        use_bias_correction=True,
        grafting_config=None,
        preconditioner_config=preconditioner,
        amortize_roots=pre.amortize_roots,
        **common_kwargs(pre),
    )


def muon_kwargs(pre: PreconditionerConfig, hp: MuonConfig) -> dict[str, Any]:
    """``DistributedShampoo`` arguments: spectral descent (the speedrun's Muon)."""
    from nanoshampoo.optim.shampoo import (
        NewtonSchulzOrthogonalizationConfig,
        SpectralDescentPreconditionerConfig,
    )

    orthogonalization = library_config(
        NewtonSchulzOrthogonalizationConfig,
        labels("muon", num_iterations="ns_steps"),
        num_iterations=hp.ns_steps,
        scale_by_dims_fn=muon_shape_scale,
        compute_dtype=hp.ns_dtype if hp.ns_dtype == "auto" else getattr(torch, hp.ns_dtype),
    )
    # beta2 is unused by the stateless spectral-descent preconditioner.
    return dict(
        lr=hp.lr,
        betas=(hp.momentum, 1.0),
        beta3=hp.momentum**2,
        weight_decay=hp.weight_decay,
        precondition_frequency=1,
        use_bias_correction=False,
        grafting_config=None,
        preconditioner_config=SpectralDescentPreconditionerConfig(
            orthogonalization_config=orthogonalization
        ),
        **common_kwargs(pre),
    )


# Each matrix setup: its table's class and the DistributedShampoo arguments it makes.
MATRIX_KWARGS: dict[str, tuple[type, Any]] = {
    "shampoo": (ShampooConfig, shampoo_kwargs),
    "soap": (SoapConfig, soap_kwargs),
    "muon": (MuonConfig, muon_kwargs),
}


def matrix_kwargs(cfg: SetupInputs, matrix: str) -> dict[str, Any]:
    """The ``DistributedShampoo`` arguments of setup ``matrix`` (no parameters, no
    distributor), from ``[preconditioner]`` and ``[MATRIX]``."""
    table, kwargs = MATRIX_KWARGS[matrix]
    return kwargs(cfg.table(PreconditionerConfig), cfg.table(table))


def build_matrix_optimizer(ctx: BuildContext) -> torch.optim.Optimizer:
    """``DistributedShampoo`` for the block matrices, from the arguments the setup's check built
    from its tables when the config was validated (``setup_arguments``: not rebuilt here)."""
    from nanoshampoo.optim.shampoo import DistributedShampoo

    arguments = ctx.cfg.setup_arguments
    if arguments is None:
        raise TypeError("the setup's check built no DistributedShampoo arguments to build from")
    with _quiet_about_the_setups_own_settings():
        return DistributedShampoo(
            ctx.groups["matrix"], distributed_config=distributed_config(ctx), **arguments.kwargs()
        )


# What the library warns a user of when sign or spectral descent ignores an entry (as the
# reference library does). The trainer's setups choose those entries themselves, so a run would
# print four such lines every time with nothing for the user to change.
_SETUP_CHOSEN = ("does not have any effect when", "Setting target_parameter_dimensionality to 2")
_WARNING_LOGGERS = (
    "nanoshampoo.optim.shampoo.group_validation",
    "nanoshampoo.optim.shampoo.component_builders",
)


class _SetupChosenFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in _SETUP_CHOSEN)


@contextmanager
def _quiet_about_the_setups_own_settings() -> Iterator[None]:
    """Drop the library's "has no effect" warnings while a setup builds its optimizer."""
    loggers = [logging.getLogger(name) for name in _WARNING_LOGGERS]
    quiet = _SetupChosenFilter()
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


def check_shampoo_setup(cfg: SetupInputs, kwargs: dict[str, Any], matrix: str) -> SetupArguments:
    """A setup's ``DistributedShampoo`` arguments ``kwargs`` (their library configs already
    built, and so validated) checked by the optimizer's own group rules (``library_checks``),
    errors naming the trainer's field; then ``[distributor]`` against the parallel mode. The
    arguments, kept on the config for the builder."""
    check_shampoo_group(kwargs, group_labels(matrix))
    check_distributor(cfg)
    return SetupArguments.of(kwargs)


def _register_family(matrix: str) -> None:
    """Register ``MATRIX`` (AdamW for the rest) and ``MATRIX-distadam`` (DistAdam for it)."""
    tables = ("adam", "preconditioner", matrix, "distributor")

    def check(cfg: SetupInputs) -> SetupArguments:
        return check_shampoo_setup(cfg, matrix_kwargs(cfg, matrix), matrix)

    def with_adamw(ctx: BuildContext) -> list[OptimizerPart]:
        return [build_rest_adamw(ctx), OptimizerPart(build_matrix_optimizer(ctx))]

    def with_distadam(ctx: BuildContext) -> list[OptimizerPart]:
        return [*build_rest_distadam(ctx), OptimizerPart(build_matrix_optimizer(ctx))]

    register_setup(matrix, tables=tables, matrix=matrix, rest="adamw", check=check)(with_adamw)
    register_setup(
        f"{matrix}-distadam", tables=tables, matrix=matrix, rest="distadam", check=check
    )(with_distadam)


_register_family("shampoo")
_register_family("soap")
_register_family("muon")
