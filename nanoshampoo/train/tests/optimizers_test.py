"""Optimizer setups: the parameter partition and each group's hyper-parameters."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from nanoshampoo import matmul_speed
from nanoshampoo.model.gpt import GPT
from nanoshampoo.optim import shampoo
from nanoshampoo.optim.dist_adam import DistAdam
from nanoshampoo.train.config import TrainConfig
from nanoshampoo.train.optimizers import (
    build_optimizer_setup,
    check_parameter_partition,
    partition_parameters,
)
from nanoshampoo.train.setups import BuildContext
from nanoshampoo.train.setups.shampoo_family import build_matrix_optimizer


def build_shampoo(
    params: list[torch.nn.Parameter], cfg: TrainConfig, world_size: int
) -> torch.optim.Optimizer:
    """The setup's DistributedShampoo alone, over ``params`` as its block matrices."""
    groups = {"embed": [], "head": [], "scalar": [], "matrix": list(params)}
    return build_matrix_optimizer(BuildContext(groups, cfg, world_size))


def names_of(model: GPT, params: list[torch.nn.Parameter]) -> set[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {by_id[id(p)] for p in params}


def test_partition_by_role_and_shape(tiny_gpt: Callable[..., GPT]) -> None:
    model = tiny_gpt()
    groups = partition_parameters(model)
    assert names_of(model, groups["embed"]) == {"embed.weight"}
    assert names_of(model, groups["head"]) == {"lm_head.weight"}
    expected_matrix = {
        n for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim >= 2
    }
    assert names_of(model, groups["matrix"]) == expected_matrix
    assert len(expected_matrix) == 2 * 4
    expected_scalar = {n for n, p in model.named_parameters() if p.ndim == 1}
    assert names_of(model, groups["scalar"]) == expected_scalar
    assert "lm_head.bias" in expected_scalar and "final_norm.weight" in expected_scalar


def test_partition_with_combined_linear_has_no_linear_biases_in_scalar(
    tiny_gpt: Callable[..., GPT],
) -> None:
    model = tiny_gpt(combined_linear=True)
    groups = partition_parameters(model)
    assert all("norm" in n for n in names_of(model, groups["scalar"]))
    assert names_of(model, groups["head"]) == {"lm_head.combined_weight"}


def test_partition_check_names_duplicate_missing_and_foreign_params(
    tiny_gpt: Callable[..., GPT],
) -> None:
    model = tiny_gpt()
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


def test_adamw_setup_group_hyperparameters(tiny_gpt: Callable[..., GPT]) -> None:
    model = tiny_gpt()
    cfg = TrainConfig(optimizer="adamw", **{"adamw.lr": 0.002, "adamw.weight_decay": 0.1})
    setup = build_optimizer_setup(model, cfg, world_size=1)
    (opt,) = setup.optimizers
    assert isinstance(opt, torch.optim.AdamW)
    summary = [
        (g["lr"], g["betas"], g["weight_decay"], g["eps"], len(g["params"]))
        for g in opt.param_groups
    ]
    n_scalar = sum(1 for p in model.parameters() if p.ndim == 1)
    assert summary == [
        (0.3, (0.8, 0.95), 0.0, 1e-10, 1),
        (1 / 320, (0.8, 0.95), 0.0, 1e-10, 1),
        (0.01, (0.8, 0.95), 0.0, 1e-10, n_scalar),
        (0.002, (0.9, 0.95), 0.1, 1e-10, 8),
    ]
    assert len(setup.all_reduce_params) == len(list(model.parameters()))


def test_shampoo_setup_is_the_optimization_track_recipe(tiny_gpt: Callable[..., GPT]) -> None:
    model = tiny_gpt()
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


def test_distadam_params_are_not_all_reduced_by_the_trainer(tiny_gpt: Callable[..., GPT]) -> None:
    model = tiny_gpt()
    setup = build_optimizer_setup(model, TrainConfig(optimizer="distadam"), world_size=1)
    assert setup.all_reduce_params == []
    assert sum(len(g["params"]) for o in setup.optimizers for g in o.param_groups) == len(
        list(model.parameters())
    )


def test_soap_setup_is_the_papers_recipe(tiny_gpt: Callable[..., GPT]) -> None:
    model = tiny_gpt()
    setup = build_optimizer_setup(model, TrainConfig(optimizer="soap"), world_size=1)
    adamw, matrices = setup.optimizers
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(matrices, shampoo.DistributedShampoo)
    (group,) = matrices.param_groups
    assert group["lr"] == 0.003 and tuple(group["betas"]) == (0.95, 0.95)
    assert group["epsilon"] == 1e-8 and group["precondition_frequency"] == 10
    assert group["grafting_config"] is None and group["use_bias_correction"] is True
    config = group["preconditioner_config"]
    assert isinstance(config, shampoo.EigenvalueCorrectedShampooPreconditionerConfig)
    assert isinstance(config.amortized_computation_config, shampoo.QREigendecompositionConfig)


@pytest.mark.parametrize(
    "setup_name, kinds",
    [
        ("soap-distadam", ["DistAdam", "DistAdam", "DistAdam", "DistributedShampoo"]),
        ("muon-distadam", ["DistAdam", "DistAdam", "DistAdam", "DistributedShampoo"]),
        ("muon", ["AdamW", "DistributedShampoo"]),
    ],
)
def test_every_setup_builds(
    tiny_gpt: Callable[..., GPT], setup_name: str, kinds: list[str]
) -> None:
    # 128: no test matrix (at least 32 x 32) merges into a vector, which spectral descent refuses.
    cfg = TrainConfig(optimizer=setup_name, **{"preconditioner.max_preconditioner_dim": 128})
    setup = build_optimizer_setup(tiny_gpt(), cfg, world_size=1)
    assert [type(o).__name__ for o in setup.optimizers] == kinds


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_factor_dtype_and_distributor_fields_reach_the_optimizer(
    tiny_gpt: Callable[..., GPT], dtype: str
) -> None:
    cfg = TrainConfig(
        optimizer="shampoo",
        **{
            "preconditioner.factor_dtype": dtype,
            "distributor.kind": "ddp",
            "distributor.communication_dtype": "bfloat16",
            "distributor.communicate_params": False,
            "preconditioner.max_preconditioner_dim": 16,
            "preconditioner.start_preconditioning_step": 10,
        },
    )
    (group,) = build_shampoo(list(tiny_gpt().blocks.parameters())[:1], cfg, 1).param_groups
    assert group["preconditioner_config"].factor_matrix_dtype == getattr(torch, dtype)
    assert group["distributed_config"] == shampoo.DDPDistributedConfig(
        communication_dtype=torch.bfloat16, communicate_params=False
    )
    assert (group["max_preconditioner_dim"], group["start_preconditioning_step"]) == (16, 10)


def test_speed_and_memory_knobs_default_to_the_plain_optimizer(
    tiny_gpt: Callable[..., GPT],
) -> None:
    (group,) = build_shampoo(
        list(tiny_gpt().blocks.parameters())[:1], TrainConfig(), 1
    ).param_groups
    assert group["amortize_roots"] is False and group["momentum_dtype"] is None
    assert group["preconditioner_config"].inv_factor_matrix_dtype is None
    assert group["preconditioner_config"].use_symmetric_packing is False
    assert group["grafting_config"].second_moment_dtype is None
    config = group["preconditioner_config"]
    assert type(config.amortized_computation_config) is shampoo.EigenConfig
    assert config.large_factor_schedule() == (0, 1)


def test_root_method_and_large_factor_fields_reach_the_optimizer(
    tiny_gpt: Callable[..., GPT],
) -> None:
    cfg = TrainConfig(
        **{
            "shampoo.root_method": "warm-qr",
            "shampoo.warm_qr_tolerance": 0.02,
            "shampoo.warm_qr_max_iterations": 0,
            "shampoo.large_factor_dim": 32,
            "shampoo.large_factor_frequency_multiplier": 3,
            "preconditioner.rank_deficient_stability": "pseudo-inverse",
        },
    )
    (group,) = build_shampoo(list(tiny_gpt().blocks.parameters())[:1], cfg, 1).param_groups
    config = group["preconditioner_config"]
    assert config.amortized_computation_config == shampoo.WarmStartedEigenConfig(
        max_iterations=0,
        tolerance=0.02,
        rank_deficient_stability_config=shampoo.PseudoInverseConfig(),
    )
    assert (config.large_factor_dim, config.large_factor_frequency_multiplier) == (32, 3)


@pytest.mark.parametrize("setup_name", ["shampoo", "soap", "muon"])
def test_speed_and_memory_knobs_reach_the_optimizer(
    tiny_gpt: Callable[..., GPT], setup_name: str
) -> None:
    cfg = TrainConfig(
        optimizer=setup_name,
        **{
            "preconditioner.amortize_roots": True,
            "shampoo.root_dtype": "bfloat16",
            "shampoo.grafting_dtype": "bfloat16",
            "preconditioner.momentum_dtype": "bfloat16",
            "shampoo.pack_factors": True,
            "preconditioner.max_preconditioner_dim": 64,
        },
    )
    params = [p for p in tiny_gpt().blocks.parameters() if p.ndim == 2]
    opt = build_shampoo(params, cfg, 1)
    (group,) = opt.param_groups
    assert group["momentum_dtype"] == torch.bfloat16
    assert group["amortize_roots"] is (setup_name != "muon")
    if setup_name == "shampoo":
        assert group["preconditioner_config"].use_symmetric_packing is True
        assert group["preconditioner_config"].inv_factor_matrix_dtype == torch.bfloat16
        assert group["grafting_config"].second_moment_dtype == torch.bfloat16
    for _ in range(2 * {"shampoo": 5, "soap": 10, "muon": 1}[setup_name]):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    assert all(torch.isfinite(p).all() for p in params)
    filtered = [
        block["filtered_grad"]
        for state in opt.state_dict()["state"].values()
        for key, block in state.items()
        if key.startswith("block_")
    ]
    assert filtered and all(v.dtype == torch.bfloat16 for v in filtered)


def newton_schulz_reference(g: torch.Tensor, steps: int) -> torch.Tensor:
    """The speedrun's quintic Newton-Schulz in float64, written out: X <- aX + (bA + cA^2)X."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / g.norm()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def test_muon_setup_matches_a_hand_written_muon_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Muon as in the speedrun: buf <- lerp(buf, g, 1 - m); update = NS5(lerp(g, buf, m))
    * max(1, rows/cols)**0.5; p <- p * (1 - lr wd) - lr * update.

    Newton-Schulz in float32 (a CPU whose bf16 probe fails), so the float64 reference binds to
    2e-5; its bf16 accuracy is tested in ``optim/shampoo/tests/newton_schulz_test.py``."""
    monkeypatch.setattr(matmul_speed, "cpu_bf16_is_fast", lambda: False)
    torch.manual_seed(0)
    shapes = [(24, 8), (8, 24), (12, 12)]
    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in shapes]
    lr, momentum, wd, steps = 0.05, 0.95, 0.1, 3
    cfg = TrainConfig(
        optimizer="muon",
        **{
            "muon.lr": lr,
            "muon.momentum": momentum,
            "muon.weight_decay": wd,
            "muon.ns_steps": 5,
            "preconditioner.max_preconditioner_dim": 64,
        },
    )
    opt = build_shampoo(params, cfg, world_size=1)
    ref = [p.detach().double().clone() for p in params]
    bufs = [torch.zeros_like(r) for r in ref]
    for _ in range(steps):
        grads = [torch.randn(*shape) for shape in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(grads):
            g = g.double()
            bufs[i] = bufs[i] + (1 - momentum) * (g - bufs[i])
            nesterov = g + momentum * (bufs[i] - g)
            rows, cols = g.shape
            update = newton_schulz_reference(nesterov, 5) * max(1.0, rows / cols) ** 0.5
            ref[i] = ref[i] * (1 - lr * wd) - lr * update
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach().double(), r, rtol=0, atol=2e-5)


def test_distadam_gradient_sync_follows_set_gradient_sync(tiny_gpt: Callable[..., GPT]) -> None:
    setup = build_optimizer_setup(tiny_gpt(), TrainConfig(optimizer="distadam"), world_size=1)
    setup.set_gradient_sync(False)
    assert all(isinstance(o, DistAdam) and not o.should_sync for o in setup.optimizers)
    setup.set_gradient_sync(True)
    assert all(o.should_sync for o in setup.optimizers)


# Each setup with a rank_deficient_stability choice, and the choices it takes: SOAP only the
# perturbation (the library's SOAP config refuses a PseudoInverseConfig, as the reference's does).
STABILITY_CHOICES = [
    ("shampoo", "perturbation"),
    ("shampoo", "pseudo-inverse"),
    ("kl-shampoo", "perturbation"),
    ("kl-shampoo", "pseudo-inverse"),
    ("soap", "perturbation"),
]


@pytest.mark.parametrize("setup_name, choice", STABILITY_CHOICES)
def test_rank_deficient_stability_choice_reaches_the_solver(
    tiny_gpt: Callable[..., GPT], setup_name: str, choice: str
) -> None:
    cfg = TrainConfig(optimizer=setup_name, **{"preconditioner.rank_deficient_stability": choice})
    (group,) = build_shampoo(list(tiny_gpt().blocks.parameters())[:1], cfg, 1).param_groups
    solver = group["preconditioner_config"].amortized_computation_config
    pseudo_inverse = choice == "pseudo-inverse"
    config_type = shampoo.PseudoInverseConfig if pseudo_inverse else shampoo.PerturbationConfig
    assert isinstance(solver.rank_deficient_stability_config, config_type)
    recipe_epsilon = cfg.tables[setup_name.replace("-", "_")].epsilon
    assert group["epsilon"] == (0.0 if pseudo_inverse else recipe_epsilon)


@pytest.mark.parametrize("setup_name", ["soap", "soap-distadam"])
def test_soap_refuses_the_pseudo_inverse_in_one_line_naming_the_field(setup_name: str) -> None:
    with pytest.raises(ValueError) as refused:
        TrainConfig(
            optimizer=setup_name, **{"preconditioner.rank_deficient_stability": "pseudo-inverse"}
        )
    message = str(refused.value)
    assert message.startswith(
        "preconditioner.rank_deficient_stability (--preconditioner.rank-deficient-stability) "
        "must be 'perturbation' for SOAP, got 'pseudo-inverse'"
    )
    assert "\n" not in message


@pytest.mark.parametrize("setup_name, choice", STABILITY_CHOICES)
def test_eigenvalue_floor_rtol_reaches_the_solver(
    tiny_gpt: Callable[..., GPT], setup_name: str, choice: str
) -> None:
    def tolerance(cfg: TrainConfig) -> float | None:
        (group,) = build_shampoo(list(tiny_gpt().blocks.parameters())[:1], cfg, 1).param_groups
        stability = group[
            "preconditioner_config"
        ].amortized_computation_config.rank_deficient_stability_config
        return (
            stability.rank_rtol if choice == "pseudo-inverse" else stability.eigenvalue_floor_rtol
        )

    assert (
        tolerance(
            TrainConfig(optimizer=setup_name, **{"preconditioner.rank_deficient_stability": choice})
        )
        is None
    )
    assert (
        tolerance(
            TrainConfig(
                optimizer=setup_name,
                **{
                    "preconditioner.rank_deficient_stability": choice,
                    "preconditioner.eigenvalue_floor_rtol": 0.0078,
                },
            )
        )
        == 0.0078
    )
    assert (
        tolerance(
            TrainConfig(
                optimizer=setup_name,
                **{
                    "preconditioner.rank_deficient_stability": choice,
                    "preconditioner.eigenvalue_floor_rtol": 0.0,
                },
            )
        )
        == 0.0
    )


@pytest.mark.parametrize("value", [-0.5, 1.0, float("nan"), float("inf")])
def test_eigenvalue_floor_rtol_out_of_range_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match="eigenvalue_floor_rtol"):
        TrainConfig(**{"preconditioner.eigenvalue_floor_rtol": value})
