"""Optimizer setups: which optimizer updates which parameters, with which hyper-parameters.

Parameters fall into four named groups (``partition_parameters``):

- ``embed``: the token embedding;  ``head``: the output layer's matrix;
- ``scalar``: every 1-D parameter (biases, norm gains, a non-combined head bias);
- ``matrix``: every block parameter with ``ndim >= 2``.

Setups (``TrainConfig.optimizer``; ``config.OPTIMIZER_SETUPS``): the embed/head/scalar groups
use AdamW, or DistAdam in the ``*-distadam`` setups and ``distadam``; ``matrix`` uses

- ``shampoo`` (the optimization-track recipe): ``DistributedShampoo``, root-inverse
  preconditioner, Adam grafting, decoupled weight decay (``matrix_*``, ``shampoo_*`` fields);
- ``soap``: ``DistributedShampoo`` with the eigenvalue-corrected preconditioner and no grafting,
  as in the SOAP paper: Adam in the eigenbasis of the Kronecker factors, bias-corrected, basis
  refreshed by one warm-started QR step every ``soap_precondition_frequency`` steps;
- ``muon``: ``DistributedShampoo`` with spectral descent (Newton-Schulz), as in the speedrun's
  Muon: ``M <- m M + (1 - m) G``, then the direction ``orth(m M + (1 - m) G)`` (Nesterov: the
  library's ``beta3 = m**2``, no bias correction) times ``max(1, rows / cols)**0.5``;
- ``adamw`` / ``distadam``: AdamW / DistAdam with the ``matrix_*`` lr, betas and weight decay.

The shampoo-family setups share ``max_preconditioner_dim``, ``start_preconditioning_step``,
``factor_dtype``, ``rank_deficient_stability`` and ``eigenvalue_floor_rtol`` (shampoo and soap), ``amortize_roots`` (shampoo and
soap), ``momentum_dtype`` and the distributor fields; ``root_dtype``, ``pack_factors`` and ``grafting_dtype`` are
shampoo's (its roots and its Adam grafting), as are ``root_method`` (``warm-qr``:
``WarmStartedEigenConfig`` with ``warm_qr_*``) and the ``large_factor_*`` root schedule. A ``"float32"`` storage dtype is passed as None (the
blocks' float32 computation dtype), so the defaults build exactly the optimizer they always did.
Gradients of every parameter not owned by a DistAdam are averaged across ranks by the trainer
before the step (``OptimizerSetup.all_reduce_params``); DistAdam reduce-scatters its own.
Under ``parallel`` ``fsdp2`` / ``hsdp`` the parameters are DTensors whose gradients FSDP has
already averaged: the trainer reduces none, AdamW steps the local shards, and the Shampoo family
uses ``FullyShardDistributedConfig`` / ``HybridShardDistributedConfig`` with the
``fsdp_assignment`` strategy (``round_robin``: lossless, each parameter's owner gathers it).

Example:
    >>> model = GPT(gpt_preset("tiny", vocab_size=256))
    >>> setup = build_optimizer_setup(model, TrainConfig(optimizer="adamw"), world_size=1)
    >>> [type(o).__name__ for o in setup.optimizers]
    ['AdamW']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nanoshampoo.model.gpt import GPT, gpt_preset  # noqa: F401 - gpt_preset: docstring example
from nanoshampoo.train.config import SHAMPOO_FAMILY, TrainConfig

GROUP_NAMES = ("embed", "head", "scalar", "matrix")


@dataclass
class OptimizerSetup:
    """The optimizers of a run and the parameters whose gradients the trainer all-reduces."""

    optimizers: list[torch.optim.Optimizer]
    groups: dict[str, list[nn.Parameter]]
    all_reduce_params: list[nn.Parameter]

    def set_gradient_sync(self, enabled: bool) -> None:
        """Whether this backward's gradients start syncing across ranks (DistAdam's hooks).

        False on the micro-batches that only accumulate; True on the last one.
        """
        for opt in self.optimizers:
            if hasattr(opt, "should_sync"):
                opt.should_sync = enabled


def partition_parameters(model: GPT) -> dict[str, list[nn.Parameter]]:
    """Split the model's parameters into the groups ``embed``, ``head``, ``scalar``, ``matrix``."""
    head_ids = {id(p) for p in model.lm_head.parameters()}
    block_ids = {id(p) for p in model.blocks.parameters()}
    groups: dict[str, list[nn.Parameter]] = {name: [] for name in GROUP_NAMES}
    for p in model.parameters():
        if p is model.embed.weight:
            groups["embed"].append(p)
        elif p.ndim < 2:
            groups["scalar"].append(p)
        elif id(p) in head_ids:
            groups["head"].append(p)
        elif id(p) in block_ids:
            groups["matrix"].append(p)
    check_parameter_partition(model, groups)
    return groups


def check_parameter_partition(model: nn.Module, groups: Mapping[str, Sequence[torch.Tensor]]) -> None:
    """Raise ``ValueError`` unless the groups are disjoint and hold exactly the model's params.

    The message names every offending parameter: those in two groups, those in no group, and
    those that do not belong to the model.
    """
    names = {id(p): name for name, p in model.named_parameters()}
    owner: dict[int, str] = {}
    problems = []
    for group, params in groups.items():
        for p in params:
            if id(p) not in names:
                problems.append(f"group {group!r} holds a tensor of shape {tuple(p.shape)} "
                                "that is not a parameter of the model")
            elif id(p) in owner:
                problems.append(f"{names[id(p)]} is in both {owner[id(p)]!r} and {group!r}")
            else:
                owner[id(p)] = group
    problems += [f"{name} is in no group" for pid, name in names.items() if pid not in owner]
    if problems:
        raise ValueError("optimizer parameter groups must partition the model: "
                         + "; ".join(problems))


def build_optimizer_setup(model: GPT, cfg: TrainConfig, world_size: int) -> OptimizerSetup:
    groups = partition_parameters(model)
    small = {name: groups[name] for name in ("embed", "head", "scalar")}
    lrs = {"embed": cfg.embed_lr, "head": cfg.head_lr, "scalar": cfg.scalar_lr}
    optimizers: list[torch.optim.Optimizer] = []
    distadam_params: list[nn.Parameter] = []

    if cfg.small_params_optimizer == "adamw":
        adam_groups = [dict(params=small[n], lr=lrs[n]) for n in small if small[n]]
        if cfg.matrix_optimizer == "adamw":
            adam_groups.append(dict(params=groups["matrix"], lr=cfg.matrix_lr,
                                    betas=(cfg.matrix_beta1, cfg.matrix_beta2),
                                    weight_decay=cfg.matrix_weight_decay))
        optimizers.append(torch.optim.AdamW(adam_groups, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                            eps=cfg.adam_eps, weight_decay=0.0))
    else:
        from nanoshampoo.optim.dist_adam import DistAdam

        for name, params in small.items():
            if params:
                optimizers.append(DistAdam(params, lr=lrs[name], eps=cfg.adam_eps,
                                           betas=(cfg.adam_beta1, cfg.adam_beta2)))
                distadam_params += params
        if cfg.matrix_optimizer == "distadam":
            optimizers.append(DistAdam(groups["matrix"], lr=cfg.matrix_lr, eps=cfg.adam_eps,
                                       betas=(cfg.matrix_beta1, cfg.matrix_beta2),
                                       weight_decay=cfg.matrix_weight_decay))
            distadam_params += groups["matrix"]

    if cfg.matrix_optimizer in SHAMPOO_FAMILY:
        optimizers.append(build_shampoo(groups["matrix"], cfg, world_size))

    sharded = {id(p) for p in distadam_params}
    # FSDP reduces every gradient itself under fsdp2 / hsdp.
    all_reduce = [p for p in model.parameters()
                  if id(p) not in sharded and cfg.parallel == "ddp"]
    return OptimizerSetup(optimizers=optimizers, groups=groups, all_reduce_params=all_reduce)


def muon_shape_scale(d_in: int, d_out: int) -> float:
    """The speedrun Muon's update scale for a ``(d_out, d_in)`` matrix: ``max(1, d_out/d_in)**0.5``.

    Tall matrices (more rows than columns) get larger steps, so that the update's RMS per entry
    does not shrink with the aspect ratio. A named function: lambdas do not pickle.
    """
    return max(1.0, d_out / d_in) ** 0.5


def storage_dtype(name: str) -> torch.dtype | None:
    """A ``TrainConfig`` storage dtype (``STORAGE_DTYPES``) as an optimizer argument: None for
    ``"float32"`` (the blocks' float32 computation dtype: no extra rounding, the default code
    path), else the torch dtype."""
    return None if name == "float32" else getattr(torch, name)


def build_shampoo(params: list[nn.Parameter], cfg: TrainConfig,
                  world_size: int) -> torch.optim.Optimizer:
    """``DistributedShampoo`` for the block matrices, configured for ``cfg.matrix_optimizer``.

    ``shampoo``: root-inverse, Adam grafting; ``soap``: eigenvalue-corrected, no grafting;
    ``muon``: spectral descent (see the module docstring). The distributor is DDP (each rank
    computes its share of the blocks, results travel in ``communication_dtype``) when
    ``cfg.distributor`` is ``ddp``, or ``auto`` on more than one rank; otherwise every rank
    computes every block. Under ``cfg.parallel`` ``fsdp2`` / ``hsdp`` (``params`` are
    ``fully_shard`` DTensors) it is the fully-sharded / hybrid-sharded distributor with the
    ``cfg.fsdp_assignment`` strategy.
    """
    from nanoshampoo.optim.shampoo import (
        AdamPreconditionerConfig,
        DDPDistributedConfig,
        DistributedConfig,
        DistributedShampoo,
        EigenConfig,
        EigenvalueCorrectedShampooPreconditionerConfig,
        FSDPParamAssignmentStrategy,
        FullyShardDistributedConfig,
        HybridShardDistributedConfig,
        NewtonSchulzOrthogonalizationConfig,
        PerturbationConfig,
        PseudoInverseConfig,
        QREigendecompositionConfig,
        RootInvConfig,
        RootInvShampooPreconditionerConfig,
        SingleDeviceDistributedConfig,
        SpectralDescentPreconditionerConfig,
        WarmStartedEigenConfig,
        WeightDecayType,
    )

    factor_dtype = getattr(torch, cfg.factor_dtype)
    pseudo_inverse = cfg.rank_deficient_stability == "pseudo-inverse"
    floor = None if cfg.eigenvalue_floor_rtol == -1.0 else cfg.eigenvalue_floor_rtol
    stability = (PseudoInverseConfig(rank_rtol=floor) if pseudo_inverse
                 else PerturbationConfig(eigenvalue_floor_rtol=floor))
    communication_dtype = getattr(torch, cfg.communication_dtype)
    distributed_config: DistributedConfig
    if cfg.parallel == "ddp":
        distributed = cfg.distributor == "ddp" or (cfg.distributor == "auto" and world_size > 1)
        distributed_config = (
            DDPDistributedConfig(communication_dtype=communication_dtype,
                                 communicate_params=cfg.communicate_params)
            if distributed
            else SingleDeviceDistributedConfig()
        )
    else:
        sharded_config = (FullyShardDistributedConfig if cfg.parallel == "fsdp2"
                          else HybridShardDistributedConfig)
        distributed_config = sharded_config(
            param_assignment_strategy=FSDPParamAssignmentStrategy[cfg.fsdp_assignment.upper()],
            communication_dtype=communication_dtype, communicate_params=cfg.communicate_params)
    common: dict[str, Any] = dict(
        max_preconditioner_dim=cfg.max_preconditioner_dim,
        start_preconditioning_step=cfg.start_preconditioning_step,
        weight_decay_type=WeightDecayType.DECOUPLED,
        distributed_config=distributed_config,
        momentum_dtype=storage_dtype(cfg.momentum_dtype),
    )
    kind = cfg.matrix_optimizer
    if kind == "shampoo":
        root_solver: RootInvConfig = (
            WarmStartedEigenConfig(max_iterations=cfg.warm_qr_max_iterations,
                                   tolerance=cfg.warm_qr_tolerance,
                                   rank_deficient_stability_config=stability)
            if cfg.root_method == "warm-qr"
            else EigenConfig(rank_deficient_stability_config=stability))
        return DistributedShampoo(
            params, lr=cfg.matrix_lr, betas=(cfg.matrix_beta1, cfg.matrix_beta2),
            # The pseudo-inverse adds no ridge: the library requires epsilon 0 with it.
            epsilon=0.0 if pseudo_inverse else cfg.shampoo_epsilon,
            weight_decay=cfg.matrix_weight_decay,
            precondition_frequency=cfg.precondition_frequency, use_bias_correction=True,
            grafting_config=AdamPreconditionerConfig(
                beta2=cfg.grafting_beta2, epsilon=cfg.grafting_epsilon,
                second_moment_dtype=storage_dtype(cfg.grafting_dtype)),
            preconditioner_config=RootInvShampooPreconditionerConfig(
                amortized_computation_config=root_solver,
                factor_matrix_dtype=factor_dtype,
                inv_factor_matrix_dtype=storage_dtype(cfg.root_dtype),
                pack_factor_matrices=cfg.pack_factors,
                large_factor_dim=cfg.large_factor_dim,
                large_factor_frequency_multiplier=cfg.large_factor_frequency_multiplier),
            amortize_roots=cfg.amortize_roots,
            **common,
        )
    if kind == "soap":
        return DistributedShampoo(
            params, lr=cfg.soap_lr, betas=(cfg.soap_beta1, cfg.soap_beta2),
            epsilon=0.0 if pseudo_inverse else cfg.soap_epsilon,
            weight_decay=cfg.matrix_weight_decay,
            precondition_frequency=cfg.soap_precondition_frequency, use_bias_correction=True,
            grafting_config=None,
            preconditioner_config=EigenvalueCorrectedShampooPreconditionerConfig(
                amortized_computation_config=QREigendecompositionConfig(
                    rank_deficient_stability_config=stability),
                factor_matrix_dtype=factor_dtype),
            amortize_roots=cfg.amortize_roots,
            **common,
        )
    if kind == "muon":
        momentum = cfg.muon_momentum
        return DistributedShampoo(
            # beta2 is unused by the stateless spectral-descent preconditioner.
            params, lr=cfg.muon_lr, betas=(momentum, 1.0), beta3=momentum**2,
            weight_decay=cfg.muon_weight_decay, precondition_frequency=1,
            use_bias_correction=False, grafting_config=None,
            preconditioner_config=SpectralDescentPreconditionerConfig(
                orthogonalization_config=NewtonSchulzOrthogonalizationConfig(
                    num_iterations=cfg.muon_ns_steps, scale_by_dims_fn=muon_shape_scale)),
            **common,
        )
    raise ValueError(f"TrainConfig.optimizer {cfg.optimizer!r} has no DistributedShampoo matrix "
                     "optimizer")
