"""``state_dict()`` is the reference library's nested per-parameter layout, through torch's own
``Optimizer.state_dict`` / ``load_state_dict`` (hooks, ``__setstate__``, FQN keys).

The expected dicts are written out by hand from the documented layout (``state_dict_layout.py``)
and the statistics of a step from their equations in float64; the reference library itself is
never imported.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import io
import logging
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from flat_shampoo_state import assert_same_flat_state, flat_state

from nanoshampoo.optim.shampoo import (
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    ClassicMomentumConfig,
    DefaultShampooConfig,
    DefaultSignDescentPreconditionerConfig,
    DefaultSingleDeviceDistributedConfig,
    DefaultSOAPConfig,
    DistributedShampoo,
    EigendecomposedShampooPreconditionerConfig,
    GeneralizedPrimalAveragingConfig,
    PreconditionerConfig,
    RootInvShampooPreconditionerConfig,
    ScheduleFreeConfig,
    SingleDeviceDistributedConfig,
    WeightDecayType,
)
from nanoshampoo.optim.shampoo.utils.optimizer_modules import OptimizerModule

torch.set_num_threads(1)

UNPACKED_SHAMPOO = replace(DefaultShampooConfig, use_symmetric_packing=False)
MATRIX_DIMENSIONALITY = replace(
    DefaultSingleDeviceDistributedConfig, target_parameter_dimensionality=2
)


def _packed(matrix: torch.Tensor) -> torch.Tensor:
    rows, cols = torch.triu_indices(len(matrix), len(matrix))
    return matrix[rows, cols]


def _full(packed: torch.Tensor, n: int) -> torch.Tensor:
    rows, cols = torch.triu_indices(n, n)
    full = torch.zeros(n, n, dtype=packed.dtype)
    full[rows, cols] = packed
    full[cols, rows] = packed
    return full


def _zero_model() -> torch.nn.Linear:
    model = torch.nn.Linear(5, 10, bias=False)  # (10, 5) with max dim 5: two 5x5 blocks
    with torch.no_grad():
        model.weight.zero_()
    return model


def _small_optimizer(
    model: torch.nn.Module, config: PreconditionerConfig, **overrides: Any
) -> DistributedShampoo:
    kwargs: dict[str, Any] = dict(
        lr=0.01,
        betas=(0.9, 1.0),
        epsilon=1e-12,
        weight_decay=0.0,
        max_preconditioner_dim=5,
        precondition_frequency=1,
        start_preconditioning_step=-1,
        distributed_config=MATRIX_DIMENSIONALITY,
        grafting_config=AdaGradPreconditionerConfig(epsilon=0.001),
        preconditioner_config=config,
    )
    return DistributedShampoo(model.parameters(), **{**kwargs, **overrides})


def _fresh_block(config: PreconditionerConfig) -> dict[str, Any]:
    """A block's state before any step, written out from the documented layout."""
    zeros, eye = torch.zeros(5, 5), torch.eye(5)
    factor = _packed(zeros) if getattr(config, "use_symmetric_packing", False) else zeros
    block: dict[str, Any] = {"adagrad": zeros, "filtered_grad": zeros}
    if config is DefaultSOAPConfig:
        block["shampoo"] = {
            "factor_matrices": {0: factor, 1: factor},
            "factor_matrices_eigenvectors": {0: eye, 1: eye},
            "corrected_eigenvalues": zeros,
        }
    elif isinstance(config, EigendecomposedShampooPreconditionerConfig):
        block["shampoo"] = {
            "factor_matrices": {0: factor, 1: factor},
            "factor_matrices_eigenvectors": {0: eye, 1: eye},
            "factor_matrices_eigenvalues": {0: torch.ones(5), 1: torch.ones(5)},
        }
    elif isinstance(config, RootInvShampooPreconditionerConfig):
        root = _packed(eye) if config.use_symmetric_packing else eye
        block["shampoo"] = {
            "factor_matrices": {0: factor, 1: factor},
            "inv_factor_matrices": {0: root, 1: root},
        }
    return block


def _assert_trees_equal(got: Any, want: Any, path: str = "") -> None:
    """Same nesting, same keys, every tensor equal in value and dtype."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (path, sorted(map(str, got)))
        for key in want:
            _assert_trees_equal(got[key], want[key], f"{path}.{key}")
    else:
        assert got.dtype == want.dtype and torch.equal(got, want), path


CONFIGS = {
    "shampoo": DefaultShampooConfig,
    "shampoo_unpacked": UNPACKED_SHAMPOO,
    "eigendecomposed": EigendecomposedShampooPreconditionerConfig(),
    "soap": DefaultSOAPConfig,
    "sign_descent": DefaultSignDescentPreconditionerConfig,
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_fresh_state_dict_is_the_documented_layout(name: str) -> None:
    config = CONFIGS[name]
    state_dict = _small_optimizer(_zero_model(), config).state_dict()
    block = _fresh_block(config)
    _assert_trees_equal(
        state_dict["state"], {0: {"block_0": block, "block_1": block, "step": torch.tensor(0)}}
    )
    # The groups as the reference writes them: its keys, config objects, sentinels resolved
    # (beta3 = betas[0], start_preconditioning_step = precondition_frequency).
    assert state_dict["param_groups"] == [
        {
            "lr": 0.01,
            "betas": (0.9, 1.0),
            "beta3": 0.9,
            "epsilon": 1e-12,
            "weight_decay": 0.0,
            "peak_lr": 0.01,
            "weight_decay_type": WeightDecayType.DECOUPLED,
            "max_preconditioner_dim": 5,
            "precondition_frequency": 1,
            "start_preconditioning_step": 1,
            "use_bias_correction": True,
            "iterate_averaging_config": None,
            "grafting_config": AdaGradPreconditionerConfig(epsilon=0.001),
            "use_pin_memory": False,
            "distributed_config": SingleDeviceDistributedConfig(target_parameter_dimensionality=2),
            "preconditioner_config": config,
            "params": [0],
        }
    ]


@pytest.mark.parametrize(
    "averaging",
    [
        GeneralizedPrimalAveragingConfig(eval_interp_coeff=0.5, train_interp_coeff=0.9),
        ScheduleFreeConfig(train_interp_coeff=0.9),
    ],
)
def test_primal_averaging_adds_its_scalars_and_z(averaging: Any) -> None:
    model = _zero_model()
    state_dict = _small_optimizer(
        model, DefaultShampooConfig, iterate_averaging_config=averaging
    ).state_dict()
    block = {**_fresh_block(DefaultShampooConfig), "weight_buffer": torch.zeros(5, 5)}
    _assert_trees_equal(
        state_dict["state"],
        {
            0: {
                "block_0": block,
                "block_1": block,
                "step": torch.tensor(0),
                "lr_sum": torch.tensor(0.0),  # float32, as the reference
                "train_mode": torch.tensor(True),
            }
        },
    )
    assert state_dict["param_groups"][0]["iterate_averaging_config"] == averaging


def test_our_own_entries_are_saved_only_where_they_differ_from_their_defaults() -> None:
    groups = _small_optimizer(
        _zero_model(),
        DefaultShampooConfig,
        amortize_roots=True,
        momentum_dtype=torch.bfloat16,
        iterate_averaging_config=ClassicMomentumConfig(momentum=0.5),
    ).state_dict()["param_groups"]
    assert groups[0]["amortize_roots"] is True and groups[0]["momentum_dtype"] == torch.bfloat16
    assert not {"momentum", "dampening", "use_nesterov"} & groups[0].keys()


def test_one_step_stores_the_statistics_of_its_gradient() -> None:
    """betas (0.9, 1.0), AdaGrad grafting: after step 1, per 5x5 block ``G``: ``L = G G^T``,
    ``R = G^T G`` (packed), roots ``(F + eps I)^(-1/4)`` (packed), ``adagrad = G^2``,
    ``filtered_grad = 0.1 G``, against float64."""
    model = _zero_model()
    optimizer = _small_optimizer(model, DefaultShampooConfig)
    grad = torch.randn(10, 5, generator=torch.Generator().manual_seed(0))
    model.weight.grad = grad.clone()
    optimizer.step()
    state = optimizer.state_dict()["state"][0]
    assert state["step"].dtype == torch.int64 and int(state["step"]) == 1
    for j in range(2):
        g = grad[5 * j : 5 * j + 5].double()
        block = state[f"block_{j}"]
        for dim, factor in enumerate((g @ g.T, g.T @ g)):
            torch.testing.assert_close(
                block["shampoo"]["factor_matrices"][dim].double(),
                _packed(factor),
                rtol=1e-6,
                atol=1e-6,
            )
            values, vectors = torch.linalg.eigh(factor + 1e-12 * torch.eye(5, dtype=torch.float64))
            root = (vectors * values.pow(-0.25)) @ vectors.T
            got = _full(block["shampoo"]["inv_factor_matrices"][dim], 5).double()
            torch.testing.assert_close(got, root, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(block["adagrad"].double(), g.square(), rtol=1e-6, atol=0.0)
        torch.testing.assert_close(block["filtered_grad"].double(), 0.1 * g, rtol=1e-6, atol=0.0)


def test_optimizer_state_is_readable_as_in_the_reference() -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 10, bias=False), torch.nn.Linear(10, 3, bias=False)
    )
    first, second = model.parameters()
    optimizer = DistributedShampoo(
        model.parameters(),
        lr=0.01,
        epsilon=1e-12,
        max_preconditioner_dim=5,
        iterate_averaging_config=GeneralizedPrimalAveragingConfig(),
    )
    # One tensor per group under every parameter, on the CPU, as the reference aliases them.
    for key in ("step", "lr_sum", "train_mode"):
        assert optimizer.state[first][key] is optimizer.state[second][key]
    shampoo = optimizer.state[first]["block_0"]["shampoo"]
    assert isinstance(shampoo, OptimizerModule) and shampoo.factor_matrices[0].shape == (15,)
    before = shampoo.factor_matrices[0].clone()
    model(torch.randn(4, 5)).square().sum().backward()
    optimizer.step()
    assert int(optimizer.state[second]["step"]) == 1
    assert not torch.equal(shampoo.factor_matrices[0], before)  # a view of the live state
    optimizer.eval()
    assert not bool(optimizer.state[second]["train_mode"])
    optimizer.train()
    assert bool(optimizer.state[first]["train_mode"])


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3, bias=False)
    )


def _train(model: torch.nn.Module, optimizer: DistributedShampoo, steps: range) -> None:
    for step in steps:
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(100 + step))
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def _weights_only(state_dict: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


RUNS: dict[str, dict[str, Any]] = {
    "shampoo": {},
    "shampoo_unpacked": {"preconditioner_config": UNPACKED_SHAMPOO},
    "soap": {"preconditioner_config": DefaultSOAPConfig, "grafting_config": None},
    "eigendecomposed": {"preconditioner_config": EigendecomposedShampooPreconditionerConfig()},
    "momentum": {"iterate_averaging_config": ClassicMomentumConfig(momentum=0.5)},
    "gpa": {"iterate_averaging_config": GeneralizedPrimalAveragingConfig()},
    "schedule_free": {"iterate_averaging_config": ScheduleFreeConfig()},
    # Float64 factors under float32 parameters: torch's load casts them to float32 on the way
    # in; the loader takes the saved originals, so nothing is rounded.
    "float64_factors": {
        "preconditioner_config": replace(DefaultShampooConfig, factor_matrix_dtype=torch.float64)
    },
}


def _run_optimizer(model: torch.nn.Module, name: str) -> DistributedShampoo:
    kwargs: dict[str, Any] = dict(
        lr=0.02,
        betas=(0.9, 0.99),
        epsilon=1e-12,
        weight_decay=0.01,
        max_preconditioner_dim=4,
        precondition_frequency=2,
        grafting_config=AdamPreconditionerConfig(beta2=0.99, epsilon=1e-8),
    )
    return DistributedShampoo(model.named_parameters(), **{**kwargs, **RUNS[name]})


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_saved_state_dict_continues_bit_for_bit(name: str) -> None:
    """3 steps, ``torch.save`` / ``torch.load(weights_only=True)``, a fresh optimizer, 2 more
    steps: the parameters of the uninterrupted 5-step run, bit for bit."""
    straight = _mlp()
    _train(straight, _run_optimizer(straight, name), range(5))
    model = _mlp()
    optimizer = _run_optimizer(model, name)
    _train(model, optimizer, range(3))
    saved = _weights_only(optimizer.state_dict())
    resumed = copy.deepcopy(model)
    fresh = _run_optimizer(resumed, name)
    fresh.load_state_dict(saved)
    assert_same_flat_state(flat_state(fresh.state_dict()), flat_state(optimizer.state_dict()))
    _train(resumed, fresh, range(3, 5))
    for got, want in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(got, want)


def test_fqn_keys_load_as_torch_distributed_checkpoint_hands_them_over() -> None:
    """``set_optimizer_state_dict`` gives ``load_state_dict`` parameter names for keys; torch
    matches them by position, as it matches indices."""
    straight = _mlp()
    _train(straight, _run_optimizer(straight, "shampoo"), range(5))
    model = _mlp()
    optimizer = _run_optimizer(model, "shampoo")
    _train(model, optimizer, range(3))
    saved = copy.deepcopy(optimizer.state_dict())
    names = [name for name, _ in model.named_parameters()]
    by_name = {
        "state": {names[index]: entry for index, entry in saved["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]
        ],
    }
    resumed = copy.deepcopy(model)
    fresh = _run_optimizer(resumed, "shampoo")
    fresh.load_state_dict(by_name)
    _train(resumed, fresh, range(3, 5))
    for got, want in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(got, want)


def test_torchs_state_dict_hooks_and_setstate_run() -> None:
    calls: list[str] = []

    class Recording(DistributedShampoo):
        def __setstate__(self, state: dict[str, Any]) -> None:
            calls.append("__setstate__")
            super().__setstate__(state)

    model = _mlp()
    optimizer = Recording(model.parameters(), lr=0.01, epsilon=1e-12, max_preconditioner_dim=4)
    _train(model, optimizer, range(2))
    optimizer.register_state_dict_pre_hook(lambda opt: calls.append("state_dict pre"))

    def post(opt: Any, state_dict: dict[str, Any]) -> None:
        # Runs after the optimizer's own post-hook: the nested layout, plain tensors.
        assert isinstance(
            state_dict["state"][0]["block_0"]["shampoo"]["factor_matrices"][0], torch.Tensor
        )
        calls.append("state_dict post")

    optimizer.register_state_dict_post_hook(post)
    optimizer.register_load_state_dict_pre_hook(lambda opt, sd: calls.append("load pre"))
    optimizer.register_load_state_dict_post_hook(lambda opt: calls.append("load post"))
    optimizer.load_state_dict(optimizer.state_dict())
    assert calls == ["state_dict pre", "state_dict post", "load pre", "__setstate__", "load post"]


@pytest.mark.parametrize("saved_in_eval", [True, False])
def test_a_load_keeps_the_callers_train_or_eval_mode(saved_in_eval: bool) -> None:
    """As the reference: the loaded ``train_mode`` describes the saved parameters (loaded with
    the model), and the optimizer then moves them to the mode it was in before the load."""
    model = _mlp()
    optimizer = _run_optimizer(model, "schedule_free")
    _train(model, optimizer, range(3))
    if saved_in_eval:
        optimizer.eval()
    saved = _weights_only({"model": model.state_dict(), "optim": optimizer.state_dict()})
    (optimizer.train if saved_in_eval else optimizer.eval)()  # where the original now stands

    loaded_model = _mlp(seed=1)
    loaded = _run_optimizer(loaded_model, "schedule_free")
    if not saved_in_eval:
        loaded.eval()  # before any step, x = y = z: nothing moves
    loaded_model.load_state_dict(saved["model"])
    loaded.load_state_dict(saved["optim"])
    assert all(
        bool(entry["train_mode"]) is saved_in_eval
        for entry in loaded.state_dict()["state"].values()
    )
    for got, want in zip(loaded_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def _flat_layout(state_dict: dict[str, Any], packed: bool) -> dict[str, Any]:
    """The state dict as this optimizer saved it before this layout, written out by hand:
    ``state[i]["block_j.shampoo.factor_matrices.d"]``, full roots, ``grafting.second_moment``,
    ``momentum``, zero failure counts, and the group's ``step`` in the group."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    step = 0
    for index, entry in state_dict["state"].items():
        flat: dict[str, torch.Tensor] = {}
        step = int(entry["step"])
        for block, value in entry.items():
            if not block.startswith("block_"):
                continue
            for dim, factor in value["shampoo"]["factor_matrices"].items():
                n = len(value["shampoo"]["inv_factor_matrices"][dim]) if not packed else None
                flat[f"{block}.shampoo.factor_matrices.{dim}"] = factor
                root = value["shampoo"]["inv_factor_matrices"][dim]
                if packed:
                    n = int(((8 * root.numel() + 1) ** 0.5 - 1) / 2)
                    root = _full(root, n)
                flat[f"{block}.shampoo.inv_factor_matrices.{dim}"] = root
                flat[f"{block}.shampoo.failure_counts.{dim}"] = torch.tensor(0)
                assert n is not None
            flat[f"{block}.grafting.second_moment"] = value["adagrad"]
            flat[f"{block}.filtered_grad"] = value["filtered_grad"]
        state[index] = flat
    groups = [{**g, "step": step} for g in state_dict["param_groups"]]
    return {"state": state, "param_groups": groups}


def test_a_checkpoint_of_the_earlier_flat_layout_loads_and_continues() -> None:
    straight = _mlp()
    _train(straight, _run_optimizer(straight, "shampoo"), range(5))
    model = _mlp()
    optimizer = _run_optimizer(model, "shampoo")
    _train(model, optimizer, range(3))
    old = _flat_layout(copy.deepcopy(optimizer.state_dict()), packed=True)
    resumed = copy.deepcopy(model)
    fresh = _run_optimizer(resumed, "shampoo")
    fresh.load_state_dict(old)
    _train(resumed, fresh, range(3, 5))
    for got, want in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(got, want)


def test_a_soap_state_without_our_flags_loads_with_them_filled_from_the_step() -> None:
    """The reference's SOAP state has no ``eigenvectors_computed``, and ours leaves out flags
    that the step implies: a load fills them with ``step >= start_preconditioning_step`` (QR
    refreshes warm-start from computed bases only), and the run continues as the uninterrupted
    one."""
    straight = _mlp()
    _train(straight, _run_optimizer(straight, "soap"), range(5))
    model = _mlp()
    optimizer = _run_optimizer(model, "soap")
    _train(model, optimizer, range(3))
    saved = copy.deepcopy(optimizer.state_dict())
    for entry in saved["state"].values():
        for key, block in entry.items():
            if key.startswith("block_"):
                assert "eigenvectors_computed" not in block["shampoo"]  # implied: not saved
    resumed = copy.deepcopy(model)
    fresh = _run_optimizer(resumed, "soap")
    fresh.load_state_dict(saved)
    assert_same_flat_state(flat_state(fresh.state_dict()), flat_state(optimizer.state_dict()))
    _train(resumed, fresh, range(3, 5))
    for got, want in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(got, want)


def test_soap_flags_that_the_step_does_not_imply_are_saved_and_load_back() -> None:
    """A basis not computed at a step past ``start_preconditioning_step`` (as after a failed
    computation): its block saves ``eigenvectors_computed`` (both of its factors' flags), the
    other block none, and a load gives the same state."""
    model = _mlp()
    optimizer = _run_optimizer(model, "soap")
    _train(model, optimizer, range(3))
    first = next(model.parameters())
    optimizer.state[first]["block_0"]["shampoo"].eigenvectors_computed[1].fill_(False)
    saved = optimizer.state_dict()
    flags = saved["state"][0]["block_0"]["shampoo"]["eigenvectors_computed"]
    assert {dim: bool(flag) for dim, flag in flags.items()} == {0: True, 1: False}
    assert all(
        "eigenvectors_computed" not in block["shampoo"]
        for index, entry in saved["state"].items()
        for key, block in entry.items()
        if key.startswith("block_") and (index, key) != (0, "block_0")
    )
    fresh = _run_optimizer(copy.deepcopy(model), "soap")
    fresh.load_state_dict(copy.deepcopy(saved))
    assert_same_flat_state(flat_state(fresh.state_dict()), flat_state(saved))


def test_a_write_to_the_step_tensor_is_the_optimizer_step() -> None:
    """As in the reference, ``state[p]["step"]`` is the step counter: a run whose counter was
    set to 7 steps as one loaded from a state dict at step 7 (bias corrections of step 8)."""
    runs = []
    for via_tensor in (True, False):
        model = _mlp()
        optimizer = _run_optimizer(model, "shampoo")
        _train(model, optimizer, range(2))
        if via_tensor:
            optimizer.state[next(model.parameters())]["step"].fill_(7)
        else:
            saved = copy.deepcopy(optimizer.state_dict())
            for entry in saved["state"].values():
                entry["step"] = torch.tensor(7)
            optimizer.load_state_dict(saved)
        _train(model, optimizer, range(2, 3))
        assert int(optimizer.state_dict()["state"][0]["step"]) == 8
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def _foreign_library() -> SimpleNamespace:
    """Configs of another library (as the reference's are): our class names and fields, other
    classes. ``extra`` is a field this library's class lacks."""

    @dataclasses.dataclass
    class AdaGradPreconditionerConfig:
        epsilon: float = 1e-10
        second_moment_dtype: torch.dtype | None = torch.float32  # ours: None, the block's dtype

    @dataclasses.dataclass
    class GeneralizedPrimalAveragingConfig:
        eval_interp_coeff: float = 0.9
        train_interp_coeff: float = 0.8
        extra: int = 0

    class WeightDecayType(enum.Enum):
        DECOUPLED = "DECOUPLED"
        L2 = "L2"

    return SimpleNamespace(
        grafting=AdaGradPreconditionerConfig,
        averaging=GeneralizedPrimalAveragingConfig,
        decay=WeightDecayType,
    )


def test_another_librarys_configs_in_the_groups_load_as_ours() -> None:
    """A reference state dict's groups hold the reference's config objects. Those of entries a
    step reads load as this library's (same class name and fields); at an entry fixed at
    construction the optimizer keeps its own (the other library's spells the same blocks in its
    own defaults, and the state is checked block by block)."""
    foreign = _foreign_library()
    model = _zero_model()
    averaging = GeneralizedPrimalAveragingConfig(eval_interp_coeff=0.5, train_interp_coeff=0.9)
    optimizer = _small_optimizer(model, DefaultShampooConfig, iterate_averaging_config=averaging)
    saved = copy.deepcopy(optimizer.state_dict())
    saved["param_groups"][0].update(
        grafting_config=foreign.grafting(epsilon=0.001),
        iterate_averaging_config=foreign.averaging(eval_interp_coeff=0.5, train_interp_coeff=0.9),
        weight_decay_type=foreign.decay.DECOUPLED,
    )
    optimizer.load_state_dict(saved)
    group = optimizer.param_groups[0]
    assert type(group["grafting_config"]) is AdaGradPreconditionerConfig  # the optimizer's own
    assert group["grafting_config"] == AdaGradPreconditionerConfig(epsilon=0.001)
    assert type(group["iterate_averaging_config"]) is GeneralizedPrimalAveragingConfig
    assert group["iterate_averaging_config"] == averaging
    assert group["weight_decay_type"] is WeightDecayType.DECOUPLED

    saved["param_groups"][0]["iterate_averaging_config"] = foreign.averaging(0.5, 0.9, extra=3)
    with pytest.raises(
        ValueError, match=r"GeneralizedPrimalAveragingConfig\.extra=3 has no counterpart"
    ):
        optimizer.load_state_dict(saved)


def test_soap_bases_are_saved_in_ascending_order_with_their_corrected_eigenvalues() -> None:
    """A state dict holds each computed SOAP basis as the reference stores it: columns by
    ascending eigenvalue (``q_j^T F q_j`` increasing in ``j``, in float64 from the saved factor),
    and ``D`` indexed by those columns (the live state keeps them descending, ``D`` reversed)."""
    model = _mlp()
    optimizer = _run_optimizer(model, "soap")
    _train(model, optimizer, range(3))
    saved = optimizer.state_dict()["state"][0]["block_0"]["shampoo"]
    live = optimizer.state[next(model.parameters())]["block_0"]["shampoo"]
    corrected = live.corrected_eigenvalues
    for dim, basis in saved["factor_matrices_eigenvectors"].items():
        n = len(basis)
        factor = _full(saved["factor_matrices"][dim], n).double()
        rayleigh = torch.diagonal(basis.double().T @ factor @ basis.double())
        assert bool((rayleigh[1:] >= rayleigh[:-1] - 1e-9 * rayleigh.abs().max()).all()), rayleigh
        assert torch.equal(basis, live.factor_matrices_eigenvectors[dim].flip(-1))
        corrected = corrected.flip(dim)
    assert torch.equal(saved["corrected_eigenvalues"], corrected)


def _unregistered_scale(grad: torch.Tensor) -> float:
    """A named module-level function: it pickles, but ``weights_only=True`` refuses it until
    it is registered."""
    return 1.0


@dataclasses.dataclass
class _UnregisteredSignConfig(type(DefaultSignDescentPreconditionerConfig)):  # type: ignore[misc]
    """A config class of the user's own, not registered."""


def _warnings_at_state_dict(
    optimizer: DistributedShampoo, value: Any, caplog: pytest.LogCaptureFixture
) -> list[str]:
    optimizer.param_groups[0]["preconditioner_config"] = value
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nanoshampoo.optim.shampoo.distributed_shampoo"):
        optimizer.state_dict()
    return [record.getMessage() for record in caplog.records]


def test_every_group_entry_that_weights_only_would_refuse_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Not only a lambda: a named function or a config class not registered with
    ``add_safe_globals`` saves, but ``torch.load(weights_only=True)`` refuses it; the warning
    (the reference's sentence first) names the part. Registered ones load back, unwarned."""
    optimizer = _small_optimizer(_zero_model(), DefaultSignDescentPreconditionerConfig)
    sentence = (
        "Note that lambda function cannot be pickled. torch.save() cannot serialize lambda "
        "functions, because it relies on Python's pickle module for serialization, and pickle "
        "does not support lambda functions."
    )
    cases = [
        (
            replace(DefaultSignDescentPreconditionerConfig, scale_fn=_unregistered_scale),
            f"preconditioner_config.scale_fn is {__name__}._unregistered_scale, not registered; "
            "register it, to checkpoint it.",
        ),
        (
            _UnregisteredSignConfig(),
            f"preconditioner_config is a {__name__}._UnregisteredSignConfig, a class not "
            "registered; register it, to checkpoint it.",
        ),
        (
            replace(DefaultSignDescentPreconditionerConfig, scale_fn=lambda grad: 1.0),
            "preconditioner_config.scale_fn is a lambda; use a named function, registered, to "
            "checkpoint it.",
        ),
    ]
    for value, part in cases:
        (message,) = _warnings_at_state_dict(optimizer, value, caplog)
        assert message.startswith(f"Found preconditioner_config={value!r}. {sentence} ")
        assert message.endswith(f"torch.serialization.add_safe_globals: {part}")
        assert "\n" not in message
    # The defaults (our own registered function) and a registered function of the user's.
    assert _warnings_at_state_dict(optimizer, DefaultSignDescentPreconditionerConfig, caplog) == []
    registered = replace(DefaultSignDescentPreconditionerConfig, scale_fn=_unregistered_scale)
    with torch.serialization.safe_globals([_unregistered_scale]):
        assert _warnings_at_state_dict(optimizer, registered, caplog) == []
        buffer = io.BytesIO()
        torch.save(optimizer.state_dict(), buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
    assert loaded["param_groups"][0]["preconditioner_config"] == registered


def test_a_group_entry_holding_a_lambda_is_warned_about_at_state_dict(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``torch.save`` cannot pickle a lambda: ``state_dict()`` says which entry holds one."""
    optimizer = _small_optimizer(_zero_model(), DefaultSignDescentPreconditionerConfig)
    caplog.clear()  # the constructor's warnings about entries without effect
    with caplog.at_level(logging.WARNING, logger="nanoshampoo.optim.shampoo.distributed_shampoo"):
        optimizer.state_dict()
    assert caplog.records == []
    optimizer.param_groups[0]["preconditioner_config"] = replace(
        DefaultSignDescentPreconditionerConfig, scale_fn=lambda grad: 1.0
    )
    with caplog.at_level(logging.WARNING, logger="nanoshampoo.optim.shampoo.distributed_shampoo"):
        optimizer.state_dict()
    assert any(
        record.msg.startswith("Found preconditioner_config=SignDescentPreconditionerConfig(")
        and "Note that lambda function cannot be pickled" in record.msg
        for record in caplog.records
    )
