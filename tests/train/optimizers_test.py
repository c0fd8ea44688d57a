"""Optimizer setups: the parameter partition and each group's hyper-parameters."""

from __future__ import annotations

import pytest
import torch

from nanoshampoo.model.gpt import GPT, GPTConfig
from nanoshampoo.train.config import TrainConfig
from nanoshampoo.train.optimizers import (
    build_optimizer_setup,
    check_parameter_partition,
    partition_parameters,
)


def tiny_model(combined_linear: bool = False) -> GPT:
    return GPT(GPTConfig(vocab_size=64, num_layers=2, model_dim=32, head_dim=16, max_seq_len=16,
                         combined_linear=combined_linear))


def names_of(model: GPT, params: list[torch.nn.Parameter]) -> set[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {by_id[id(p)] for p in params}


def test_partition_by_role_and_shape() -> None:
    model = tiny_model()
    groups = partition_parameters(model)
    assert names_of(model, groups["embed"]) == {"embed.weight"}
    assert names_of(model, groups["head"]) == {"lm_head.weight"}
    expected_matrix = {n for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim >= 2}
    assert names_of(model, groups["matrix"]) == expected_matrix
    assert len(expected_matrix) == 2 * 4
    expected_scalar = {n for n, p in model.named_parameters() if p.ndim == 1}
    assert names_of(model, groups["scalar"]) == expected_scalar
    assert "lm_head.bias" in expected_scalar and "final_norm.weight" in expected_scalar


def test_partition_with_combined_linear_has_no_linear_biases_in_scalar() -> None:
    pytest.importorskip("nanoshampoo.optim.shampoo.utils.shampoo_model_utils")
    model = tiny_model(combined_linear=True)
    groups = partition_parameters(model)
    assert all("norm" in n for n in names_of(model, groups["scalar"]))
    assert names_of(model, groups["head"]) == {"lm_head.combined_weight"}


def test_partition_check_names_duplicate_missing_and_foreign_params() -> None:
    model = tiny_model()
    groups = partition_parameters(model)
    check_parameter_partition(model, groups)  # the real partition passes
    broken = {k: list(v) for k, v in groups.items()}
    broken["head"].append(model.embed.weight)  # duplicate
    broken["scalar"] = [p for p in broken["scalar"] if p is not model.final_norm.weight]  # missing
    broken["matrix"].append(torch.nn.Parameter(torch.zeros(3, 5)))  # foreign
    with pytest.raises(ValueError) as info:
        check_parameter_partition(model, broken)
    message = str(info.value)
    assert "embed.weight is in both 'embed' and 'head'" in message
    assert "final_norm.weight is in no group" in message
    assert "shape (3, 5)" in message


def test_adamw_setup_group_hyperparameters() -> None:
    model = tiny_model()
    cfg = TrainConfig(optimizer="adamw", matrix_lr=0.002, matrix_weight_decay=0.1)
    setup = build_optimizer_setup(model, cfg, world_size=1)
    (opt,) = setup.optimizers
    assert isinstance(opt, torch.optim.AdamW)
    summary = [(g["lr"], g["betas"], g["weight_decay"], g["eps"], len(g["params"]))
               for g in opt.param_groups]
    n_scalar = sum(1 for p in model.parameters() if p.ndim == 1)
    assert summary == [
        (0.3, (0.8, 0.95), 0.0, 1e-10, 1),
        (1 / 320, (0.8, 0.95), 0.0, 1e-10, 1),
        (0.01, (0.8, 0.95), 0.0, 1e-10, n_scalar),
        (0.002, (0.9, 0.95), 0.1, 1e-10, 8),
    ]
    assert len(setup.all_reduce_params) == len(list(model.parameters()))


def test_shampoo_setup_is_the_optimization_track_recipe() -> None:
    shampoo = pytest.importorskip("nanoshampoo.optim.shampoo")
    model = tiny_model()
    setup = build_optimizer_setup(model, TrainConfig(optimizer="shampoo"), world_size=1)
    adamw, matrices = setup.optimizers
    assert isinstance(adamw, torch.optim.AdamW) and len(adamw.param_groups) == 3
    assert [g["lr"] for g in adamw.param_groups] == [0.3, 1 / 320, 0.01]
    assert all(g["weight_decay"] == 0.0 and g["betas"] == (0.8, 0.95) for g in adamw.param_groups)
    assert isinstance(matrices, shampoo.DistributedShampoo)
    (group,) = matrices.param_groups
    assert names_of(model, group["params"]) == names_of(model, setup.groups["matrix"])
    assert group["lr"] == 0.0015 and tuple(group["betas"]) == (0.9, 0.95)
    assert group["weight_decay"] == 0.2
    assert group["weight_decay_type"] == shampoo.WeightDecayType.DECOUPLED
    assert group["max_preconditioner_dim"] == 8192 and group["precondition_frequency"] == 5
    assert group["grafting_config"] == shampoo.AdamPreconditionerConfig(beta2=0.95, epsilon=1e-10)


def test_distadam_params_are_not_all_reduced_by_the_trainer() -> None:
    pytest.importorskip("nanoshampoo.optim.dist_adam")
    model = tiny_model()
    setup = build_optimizer_setup(model, TrainConfig(optimizer="distadam"), world_size=1)
    assert setup.all_reduce_params == []
    assert sum(len(g["params"]) for o in setup.optimizers for g in o.param_groups) == len(
        list(model.parameters()))
