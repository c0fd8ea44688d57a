"""Root-failure handling, config validation and checkpoint resume of DistributedShampoo."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from flat_shampoo_state import flat_state, group_step

from nanoshampoo.optim.shampoo import (
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    CoupledNewtonConfig,
    DDPDistributedConfig,
    DistributedShampoo,
    EigenConfig,
    RMSpropPreconditionerConfig,
    RootInvShampooPreconditionerConfig,
)
from nanoshampoo.optim.shampoo.config_checks import error_field
from nanoshampoo.optim.shampoo.preconditioner.matrix_roots import eigh_inverse_root

torch.set_num_threads(1)


def _linear_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _backward(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    model.zero_grad()
    model(torch.randn(8, 6, generator=gen)).pow(2).mean().backward()


def _opt(model: torch.nn.Module, tolerated: int = 3, **kwargs: Any) -> DistributedShampoo:
    config = RootInvShampooPreconditionerConfig(
        num_tolerated_failed_amortized_computations=tolerated
    )
    return DistributedShampoo(
        model.named_parameters(),
        lr=0.01,
        epsilon=1e-8,
        max_preconditioner_dim=4,
        preconditioner_config=config,
        **kwargs,
    )


# ---------------------------------------------------------------------------------------------
# Failure injection
# ---------------------------------------------------------------------------------------------


def test_nonfinite_factor_keeps_previous_root_counts_and_raises_after_tolerance() -> None:
    model = _linear_model()
    opt = _opt(model, tolerated=2)
    weight = model[0].weight  # (5, 6), max dim 4 -> blocks (4, 4), (4, 2), (1, 4), (1, 2)
    _backward(model, 1)
    opt.step()
    shampoo = opt.state[weight]["block_0"]["shampoo"]
    root_after_first = shampoo.inv_factor_matrices[0].clone()
    assert not torch.equal(root_after_first, torch.eye(4))
    shampoo.factor_matrices[0].view(-1)[0] = float("nan")  # entry (0, 0), packed or not
    for expected_count in (1, 2):
        _backward(model, 1 + expected_count)
        opt.step()
        assert torch.equal(shampoo.inv_factor_matrices[0], root_after_first)
        assert int(shampoo.failure_counts[0]) == expected_count
        assert int(shampoo.failure_counts[1]) == 0  # the other factor is healthy
        assert torch.isfinite(weight).all()
    _backward(model, 9)
    with pytest.raises(RuntimeError, match=r"'0\.weight'.*block_0 dim 0.*3 consecutive"):
        opt.step()


def test_eigh_raising_keeps_roots_then_recovers(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _linear_model()
    opt = _opt(model, tolerated=5)
    bias = model[2].bias  # (3,): one 3-vector block, one 3x3 factor
    shampoo = opt.state[bias]["block_0"]["shampoo"]
    real_eigh = torch.linalg.eigh

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise torch.linalg.LinAlgError("injected failure")

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    for step in (1, 2):
        _backward(model, step)
        opt.step()
        assert torch.equal(shampoo.inv_factor_matrices[0], torch.eye(3))  # identity kept
        assert int(shampoo.failure_counts[0]) == step
    monkeypatch.setattr(torch.linalg, "eigh", real_eigh)
    _backward(model, 3)
    opt.step()
    assert int(shampoo.failure_counts[0]) == 0
    assert not torch.equal(shampoo.inv_factor_matrices[0], torch.eye(3))


def test_eigh_failure_in_float32_is_retried_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    real_eigh = torch.linalg.eigh

    def float64_only(matrices: torch.Tensor) -> Any:
        if matrices.dtype != torch.float64:
            raise torch.linalg.LinAlgError("injected float32 failure")
        return real_eigh(matrices)

    monkeypatch.setattr(torch.linalg, "eigh", float64_only)
    a = torch.diag(torch.tensor([4.0, 16.0])).unsqueeze(0)
    roots, ok = eigh_inverse_root(a, torch.tensor([0.5]), epsilon=0.0)
    assert ok.tolist() == [True]
    torch.testing.assert_close(roots[0], torch.diag(torch.tensor([0.5, 0.25])))
    _, ok = eigh_inverse_root(a, torch.tensor([0.5]), epsilon=0.0, retry_double_precision=False)
    assert ok.tolist() == [False]


def test_one_bad_matrix_does_not_fail_the_batch() -> None:
    good = torch.eye(3) * 4.0
    bad = torch.full((3, 3), float("nan"))
    roots, ok = eigh_inverse_root(torch.stack([good, bad, good]), torch.full((3,), 0.5), 0.0)
    assert ok.tolist() == [True, False, True]
    torch.testing.assert_close(roots[0], torch.eye(3) * 0.5)


# ---------------------------------------------------------------------------------------------
# Invalid configs: ValueError naming the field
# ---------------------------------------------------------------------------------------------

INVALID_OPTIMIZER_ARGS = [
    ("lr", dict(lr=-1.0)),
    ("betas", dict(betas=(0.9,))),
    (r"betas\[0\]", dict(betas=(1.0, 1.0))),
    (r"betas\[1\]", dict(betas=(0.9, -0.1))),
    ("beta3", dict(beta3=1.5)),
    ("epsilon", dict(epsilon=0.0)),
    ("momentum", dict(momentum=1.0)),
    ("dampening", dict(dampening=-0.1)),
    ("use_nesterov", dict(use_nesterov=True)),
    ("weight_decay", dict(weight_decay=-1e-4)),
    ("weight_decay_type", dict(weight_decay_type="decoupled")),
    ("max_preconditioner_dim", dict(max_preconditioner_dim=0)),
    ("max_preconditioner_dim", dict(max_preconditioner_dim=2.5)),
    ("precondition_frequency", dict(precondition_frequency=0)),
    ("start_preconditioning_step", dict(precondition_frequency=10, start_preconditioning_step=5)),
    ("start_preconditioning_step", dict(start_preconditioning_step=-2)),
    ("grafting_config", dict(grafting_config=RootInvShampooPreconditionerConfig())),
    ("preconditioner_config", dict(preconditioner_config="shampoo")),
    ("distributed_config", dict(distributed_config=None)),
    ("nonfinite_grad_policy", dict(nonfinite_grad_policy="ignore")),
]


@pytest.mark.parametrize(
    ("field", "kwargs"),
    INVALID_OPTIMIZER_ARGS,
    ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID_OPTIMIZER_ARGS)],
)
def test_invalid_optimizer_argument_names_the_field(field: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as info:
        DistributedShampoo([torch.nn.Parameter(torch.zeros(3, 3))], **kwargs)
    assert re.match(field, error_field(info.value)), str(info.value)


def test_invalid_per_group_override_names_the_field() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=r"^Invalid param_group\[LR\]=-0\.5\. Must be >= 0\.0\."):
        DistributedShampoo([{"params": params, "lr": -0.5}])


INVALID_CONFIGS = [
    ("epsilon", lambda: AdaGradPreconditionerConfig(epsilon=0.0)),
    ("beta2", lambda: RMSpropPreconditionerConfig(beta2=0.0)),
    ("epsilon", lambda: RMSpropPreconditionerConfig(epsilon=-1.0)),
    ("beta2", lambda: AdamPreconditionerConfig(beta2=1.5)),
    ("retry_double_precision", lambda: EigenConfig(retry_double_precision="yes")),
    ("max_iterations", lambda: CoupledNewtonConfig(max_iterations=0)),
    ("tolerance", lambda: CoupledNewtonConfig(tolerance=-1.0)),
    (
        "amortized_computation_config",
        lambda: RootInvShampooPreconditionerConfig(amortized_computation_config=None),
    ),
    (
        "factor_matrix_dtype",
        lambda: RootInvShampooPreconditionerConfig(factor_matrix_dtype=torch.int32),
    ),
    (
        "num_tolerated_failed_amortized_computations",
        lambda: RootInvShampooPreconditionerConfig(num_tolerated_failed_amortized_computations=-1),
    ),
    (
        "inverse_exponent_override",
        lambda: RootInvShampooPreconditionerConfig(inverse_exponent_override={-1: 0.5}),
    ),
    (
        "inverse_exponent_override",
        lambda: RootInvShampooPreconditionerConfig(inverse_exponent_override={2: {2: 0.5}}),
    ),
    (
        "inverse_exponent_override",
        lambda: RootInvShampooPreconditionerConfig(inverse_exponent_override={2: -0.25}),
    ),
    (
        "inverse_exponent_override",
        lambda: RootInvShampooPreconditionerConfig(
            amortized_computation_config=CoupledNewtonConfig(), inverse_exponent_override={2: 0.3}
        ),
    ),
    ("communication_dtype", lambda: DDPDistributedConfig(communication_dtype=torch.int8)),
    ("num_trainers_per_group", lambda: DDPDistributedConfig(num_trainers_per_group=0)),
    ("communicate_params", lambda: DDPDistributedConfig(communicate_params=1)),
]


@pytest.mark.parametrize(
    ("field", "build"),
    INVALID_CONFIGS,
    ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID_CONFIGS)],
)
def test_invalid_config_names_the_field(field: str, build: Any) -> None:
    with pytest.raises(ValueError) as info:
        build()
    assert re.match(field, error_field(info.value)), str(info.value)


def test_an_order_zero_override_is_accepted_and_a_scalar_parameter_steps_as_without_it() -> None:
    """Keys are block orders >= 0, as in the reference library. A scalar parameter is stepped as
    a 1-element vector (one 1x1 factor ``g^2``), so an order-0 entry changes nothing:
    ``w - lr g (g^2 + eps)^(-1/2)`` either way (eps 1e-8 against g^2 0.25: within 1e-8)."""
    config = RootInvShampooPreconditionerConfig(inverse_exponent_override={0: 0.5, 2: 0.25})
    assert config.inverse_exponent_override == {0: 0.5, 2: 0.25}
    steps = []
    for override in ({0: 0.5}, {}):
        scalar = torch.nn.Parameter(torch.tensor(2.0, dtype=torch.float64))
        opt = DistributedShampoo(
            [scalar],
            lr=0.1,
            betas=(0.0, 1.0),
            epsilon=1e-8,
            preconditioner_config=RootInvShampooPreconditionerConfig(
                inverse_exponent_override=override
            ),
        )
        scalar.grad = torch.tensor(0.5, dtype=torch.float64)
        opt.step()
        steps.append(scalar.detach().clone())
    assert torch.equal(steps[0], steps[1])
    assert steps[0].item() == pytest.approx(2.0 - 0.1 * 0.5 / math.sqrt(0.25), rel=1e-8)


def test_abstract_configs_cannot_be_built() -> None:
    from nanoshampoo.optim.shampoo import (
        PreconditionerConfig,
        ShampooPreconditionerConfig,
    )

    for abstract in (PreconditionerConfig, ShampooPreconditionerConfig):
        with pytest.raises(TypeError):
            abstract()


# ---------------------------------------------------------------------------------------------
# State dict round trip and bit-exact resume
# ---------------------------------------------------------------------------------------------


def _resume_opt(model: torch.nn.Module) -> DistributedShampoo:
    return DistributedShampoo(
        model.parameters(),
        lr=0.02,
        betas=(0.9, 0.99),
        epsilon=1e-8,
        momentum=0.5,
        weight_decay=0.01,
        max_preconditioner_dim=4,
        precondition_frequency=3,
        grafting_config=AdamPreconditionerConfig(beta2=0.99, epsilon=1e-8),
    )


def test_resume_from_checkpoint_is_bit_identical(tmp_path: Path) -> None:
    steps, resume_at = 8, 4
    reference = _linear_model(seed=5)
    reference_opt = _resume_opt(reference)
    for step in range(steps):
        _backward(reference, 100 + step)
        reference_opt.step()

    first = _linear_model(seed=5)
    first_opt = _resume_opt(first)
    for step in range(resume_at):
        _backward(first, 100 + step)
        first_opt.step()
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict()}, path)

    resumed = _linear_model(seed=99)  # different init: everything must come from the checkpoint
    resumed_opt = _resume_opt(resumed)
    checkpoint = torch.load(path, weights_only=True)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    assert group_step(resumed_opt, 0) == resume_at
    for step in range(resume_at, steps):
        _backward(resumed, 100 + step)
        resumed_opt.step()

    for p, q in zip(reference.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    expected_state = flat_state(reference_opt.state_dict())
    actual_state = flat_state(resumed_opt.state_dict())
    assert expected_state.keys() == actual_state.keys()
    for index in expected_state:
        assert expected_state[index].keys() == actual_state[index].keys()
        for key, value in expected_state[index].items():
            assert torch.equal(value, actual_state[index][key]), (index, key)


def test_load_state_dict_is_strict() -> None:
    model = _linear_model()
    opt = _resume_opt(model)
    state_dict = opt.state_dict()
    missing = copy.deepcopy(state_dict)
    del missing["state"][0]["block_0"]["shampoo"]["factor_matrices"][0]
    with pytest.raises(
        KeyError, match=r"missing block state 0\.block_0\.shampoo\.factor_matrices\.0"
    ):
        _resume_opt(_linear_model()).load_state_dict(missing)
    other_structure = DistributedShampoo(
        _linear_model().parameters(), max_preconditioner_dim=math.inf
    )
    with pytest.raises(ValueError, match="max_preconditioner_dim"):
        other_structure.load_state_dict(state_dict)
