"""Bad input to the ``DistributedShampoo`` API is refused, naming what is wrong, before anything
moves.

One test per case (issue 21): each asserts the exception type, that the message names the
field or the parameter, and that the parameters and the optimizer state are as they were.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from flat_shampoo_state import assert_same_flat_state, flat_state

from nanoshampoo.optim.shampoo import (
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    DistributedShampoo,
    RMSpropPreconditionerConfig,
)
from nanoshampoo.optim.shampoo.state_dict_trees import clone_tree

torch.set_num_threads(1)


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _trained(model: torch.nn.Module) -> DistributedShampoo:
    """An optimizer with two steps of state (roots, grafting, filtered gradient)."""
    optimizer = DistributedShampoo(
        model.named_parameters(),
        lr=0.1,
        betas=(0.9, 0.99),
        epsilon=1e-12,
        precondition_frequency=1,
        start_preconditioning_step=1,
        grafting_config=AdamPreconditionerConfig(epsilon=1e-8),
    )
    for step in range(2):
        model.zero_grad()
        model(torch.full((4, 3), step + 1.0)).square().sum().backward()
        optimizer.step()
    return optimizer


def _snapshot(model: torch.nn.Module, optimizer: DistributedShampoo) -> dict[str, Any]:
    state = optimizer.state_dict()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state": flat_state(state),
        "groups": [dict(g) for g in state["param_groups"]],
        "num_groups": len(optimizer.param_groups),
    }


def _assert_unchanged(
    before: dict[str, Any], model: torch.nn.Module, optimizer: DistributedShampoo
) -> None:
    after = _snapshot(model, optimizer)
    assert after["num_groups"] == before["num_groups"]
    assert after["groups"] == before["groups"]
    for got, want in zip(after["params"], before["params"]):
        assert torch.equal(got, want)
    assert_same_flat_state(after["state"], before["state"])


def _refused(
    action: Callable[[DistributedShampoo, torch.nn.Module], None],
    error: type[Exception],
    match: str,
) -> None:
    model = _model()
    optimizer = _trained(model)
    before = _snapshot(model, optimizer)
    with pytest.raises(error, match=match):
        action(optimizer, model)
    _assert_unchanged(before, model, optimizer)


def test_a_parameter_given_twice_is_refused() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.warns(UserWarning, match="duplicate parameters"):  # torch's own warning, first
        with pytest.raises(ValueError, match=r"^params\[1\] is params\[0\] again"):
            DistributedShampoo([p, p])
    extra = torch.nn.Parameter(torch.ones(2))
    with pytest.warns(UserWarning, match="duplicate parameters"):
        _refused(
            lambda opt, _: opt.add_param_group({"params": [("extra", extra), ("again", extra)]}),
            ValueError,
            r"^params\[1\] \('again'\) is params\[0\] \('extra'\) again",
        )
    assert torch.equal(p, torch.ones(3))


def test_a_typoed_group_key_is_refused_naming_it() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(
        ValueError,
        match=r"^param group keys \['learning_rate'\] are not DistributedShampoo hyperparameters",
    ):
        DistributedShampoo([{"params": [p], "learning_rate": 5.0}])
    _refused(
        lambda opt, _: opt.add_param_group(
            {"params": [("w", torch.nn.Parameter(torch.ones(2)))], "learning_rate": 5.0}
        ),
        ValueError,
        r"\['learning_rate'\]",
    )


@pytest.mark.parametrize("kind", [set, frozenset])
def test_a_set_of_parameters_is_refused(kind: type) -> None:
    params = kind([torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(
        TypeError, match=f"^params must be an ordered collection .* got a {kind.__name__}"
    ):
        DistributedShampoo(params)
    _refused(
        lambda opt, _: opt.add_param_group({"params": kind(params)}),
        TypeError,
        rf"^param_group\['params'\] must be an ordered collection .* got a {kind.__name__}",
    )


def test_a_gradient_of_another_shape_is_refused_naming_the_parameter() -> None:
    def step_with_transposed_grad(optimizer: DistributedShampoo, model: torch.nn.Module) -> None:
        model.weight.grad = torch.ones(2, 3)
        model.bias.grad = torch.ones(2)
        model.weight.grad.data = torch.ones(
            3, 2
        )  # same numel, other shape: torch lets this through
        optimizer.step()

    _refused(
        step_with_transposed_grad,
        ValueError,
        r"^the gradient of 'weight' \(shape \(2, 3\)\) has shape \(3, 2\)",
    )


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_loaded_state_with_nonfinite_tensors_is_refused(value: float) -> None:
    def load_poisoned(optimizer: DistributedShampoo, _: torch.nn.Module) -> None:
        poisoned = optimizer.state_dict()
        poisoned = {
            "state": {i: clone_tree(s) for i, s in poisoned["state"].items()},
            "param_groups": poisoned["param_groups"],
        }
        poisoned["state"][0]["block_0"]["shampoo"]["factor_matrices"][0].fill_(value)
        optimizer.load_state_dict(poisoned)

    _refused(
        load_poisoned,
        ValueError,
        r"^state_dict block state 0\.block_0\.shampoo\.factor_matrices\.0 holds NaN or Inf",
    )


def test_cpu_and_meta_parameters_mixed_are_refused_naming_the_parameter() -> None:
    cpu, meta = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3, device="meta"))
    with pytest.raises(ValueError, match=r"^params\[1\] is on meta, params\[0\] on cpu"):
        DistributedShampoo([cpu, meta])
    with pytest.raises(ValueError, match=r"^params\[0\] of param_groups\[1\] is on meta"):
        DistributedShampoo([{"params": [cpu]}, {"params": [meta]}])
    _refused(
        lambda opt, _: opt.add_param_group(
            {"params": [("m", torch.nn.Parameter(torch.ones(2, device="meta")))]}
        ),
        ValueError,
        r"^params\[0\] of param_groups\[1\] is on meta, param_groups\[0\]'s on cpu",
    )


@pytest.mark.parametrize(
    "config_class",
    [AdamPreconditionerConfig, RMSpropPreconditionerConfig, AdaGradPreconditionerConfig],
)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_nonfinite_grafting_epsilons_are_refused(config_class: type, value: float) -> None:
    with pytest.raises(
        ValueError, match=r"^Invalid epsilon value: (-?inf|nan)\. Must be (> 0\.0|finite)\.$"
    ):
        config_class(epsilon=value)


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_a_nonfinite_group_epsilon_is_refused_at_construction_and_at_the_step(value: float) -> None:
    refusal = r"^Invalid param_group\[EPSILON\]=(inf|nan)\. Must be (finite|> 0\.0)\."
    with pytest.raises(ValueError, match=refusal):
        DistributedShampoo([torch.nn.Parameter(torch.ones(3))], epsilon=value)

    def step_with(optimizer: DistributedShampoo, model: torch.nn.Module) -> None:
        optimizer.param_groups[0]["epsilon"] = value
        try:
            model(torch.ones(1, 3)).sum().backward()
            optimizer.step()
        finally:
            optimizer.param_groups[0]["epsilon"] = 1e-12

    _refused(step_with, ValueError, refusal)


@pytest.mark.parametrize("other", ["adam", "sgd"])
def test_another_optimizers_state_is_refused_as_such(other: str) -> None:
    def load_other(optimizer: DistributedShampoo, model: torch.nn.Module) -> None:
        params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        foreign = (
            torch.optim.Adam(params)
            if other == "adam"
            else torch.optim.SGD(params, lr=0.1, momentum=0.9)
        )
        for p in params:
            p.grad = torch.ones_like(p)
        foreign.step()
        optimizer.load_state_dict(foreign.state_dict())

    _refused(
        load_other, ValueError, "^state_dict is from another optimizer, not DistributedShampoo"
    )
