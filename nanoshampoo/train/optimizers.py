"""Optimizer setups: which optimizer updates which parameters, with which hyper-parameters.

Parameters fall into four named groups (``partition_parameters``):

- ``embed``: the token embedding;  ``head``: the output layer's matrix;
- ``scalar``: every 1-D parameter (biases, norm gains, a non-combined head bias);
- ``matrix``: every block parameter with ``ndim >= 2``.

Setups (``TrainConfig.optimizer``):

- ``shampoo`` (the optimization-track recipe): AdamW for embed/head/scalar; ``DistributedShampoo``
  with Adam grafting and decoupled weight decay for ``matrix``.
- ``adamw``: AdamW for all four groups (``matrix`` with the matrix lr, betas and weight decay).
- ``distadam``: ``DistAdam`` (sharded state, own reduce-scatter) for all four groups.
- ``shampoo-distadam``: DistAdam for embed/head/scalar, Shampoo for ``matrix``.

Gradients of every parameter not owned by a DistAdam are averaged across ranks by the trainer
before the step (``OptimizerSetup.all_reduce_params``); DistAdam reduce-scatters its own.

Example:
    >>> model = GPT(gpt_preset("tiny", vocab_size=256))
    >>> setup = build_optimizer_setup(model, TrainConfig(optimizer="adamw"), world_size=1)
    >>> [type(o).__name__ for o in setup.optimizers]
    ['AdamW']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from nanoshampoo.model.gpt import GPT, gpt_preset  # noqa: F401 - gpt_preset: docstring example
from nanoshampoo.train.config import TrainConfig

GROUP_NAMES = ("embed", "head", "scalar", "matrix")


@dataclass
class OptimizerSetup:
    """The optimizers of a run and the parameters whose gradients the trainer all-reduces."""

    optimizers: list[torch.optim.Optimizer]
    groups: dict[str, list[nn.Parameter]]
    all_reduce_params: list[nn.Parameter]


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

    if cfg.optimizer in ("shampoo", "adamw"):
        adam_groups = [dict(params=small[n], lr=lrs[n]) for n in small if small[n]]
        if cfg.optimizer == "adamw":
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
        if cfg.optimizer == "distadam":
            optimizers.append(DistAdam(groups["matrix"], lr=cfg.matrix_lr, eps=cfg.adam_eps,
                                       betas=(cfg.matrix_beta1, cfg.matrix_beta2),
                                       weight_decay=cfg.matrix_weight_decay))
            distadam_params += groups["matrix"]

    if cfg.optimizer in ("shampoo", "shampoo-distadam"):
        optimizers.append(build_shampoo(groups["matrix"], cfg, world_size))

    sharded = {id(p) for p in distadam_params}
    all_reduce = [p for p in model.parameters() if id(p) not in sharded]
    return OptimizerSetup(optimizers=optimizers, groups=groups, all_reduce_params=all_reduce)


def build_shampoo(params: list[nn.Parameter], cfg: TrainConfig,
                  world_size: int) -> torch.optim.Optimizer:
    """``DistributedShampoo`` with Adam grafting and decoupled weight decay for the matrices.

    Multi-process runs use the DDP distributor (each rank computes the roots of its share of
    the blocks, the updated parameters are exchanged in float32) unless
    ``cfg.shampoo_distributor == "single"``, which has every rank compute every block.
    """
    from nanoshampoo.optim.shampoo import (
        AdamPreconditionerConfig,
        DDPDistributedConfig,
        DistributedShampoo,
        SingleDeviceDistributedConfig,
        WeightDecayType,
    )

    distributed = world_size > 1 and cfg.shampoo_distributor != "single"
    distributed_config = (
        DDPDistributedConfig(communication_dtype=torch.float32, communicate_params=True)
        if distributed
        else SingleDeviceDistributedConfig()
    )
    return DistributedShampoo(
        params,
        lr=cfg.matrix_lr,
        betas=(cfg.matrix_beta1, cfg.matrix_beta2),
        epsilon=cfg.shampoo_epsilon,
        weight_decay=cfg.matrix_weight_decay,
        weight_decay_type=WeightDecayType.DECOUPLED,
        max_preconditioner_dim=cfg.max_preconditioner_dim,
        precondition_frequency=cfg.precondition_frequency,
        start_preconditioning_step=cfg.start_preconditioning_step,
        use_bias_correction=True,
        grafting_config=AdamPreconditionerConfig(
            beta2=cfg.grafting_beta2, epsilon=cfg.grafting_epsilon
        ),
        distributed_config=distributed_config,
    )
