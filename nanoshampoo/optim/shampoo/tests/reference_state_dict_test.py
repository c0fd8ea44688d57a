"""State dicts in the reference library's layout load into DistributedShampoo, and back.

The reference-layout dicts here are written out by hand from its documented key layout
(``reference_state_dict.py``): per parameter ``{"block_j": {"shampoo": {"factor_matrices": {d: F},
"inv_factor_matrices": {d: R}}, "adagrad": V, "filtered_grad": M}, "step": tensor(t)}`` (under
primal averaging also ``"weight_buffer": z`` in each block and ``"lr_sum"``, ``"train_mode"``
beside ``"step"``), factors and roots packed as row-major upper triangles, groups without ``step``. The reference library
itself is never imported.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from nanoshampoo.optim.shampoo import AdamPreconditionerConfig, DistributedShampoo
from nanoshampoo.optim.shampoo.reference_state_dict import is_reference_layout

torch.set_num_threads(1)

STEPS, SAVED_AT = 5, 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3, bias=False))


def _optimizer(model: torch.nn.Module) -> DistributedShampoo:
    return DistributedShampoo(
        model.parameters(), lr=0.01, betas=(0.9, 0.999), epsilon=1e-12, max_preconditioner_dim=4,
        precondition_frequency=1, start_preconditioning_step=1, weight_decay=0.01,
        grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
    )


def _train(model: torch.nn.Module, optimizer: DistributedShampoo, steps: range) -> None:
    x = torch.randn(16, 5, generator=torch.Generator().manual_seed(1))
    for step in steps:
        model.zero_grad()
        model(x * (1 + 0.1 * step)).square().sum().backward()
        optimizer.step()


def _upper(matrix: torch.Tensor) -> torch.Tensor:
    rows, cols = torch.triu_indices(len(matrix), len(matrix))
    return matrix[rows, cols].clone()


def _symmetric(packed: torch.Tensor, n: int) -> torch.Tensor:
    rows, cols = torch.triu_indices(n, n)
    full = torch.zeros(n, n, dtype=packed.dtype)
    full[rows, cols] = packed
    full[cols, rows] = packed
    return full


def _by_hand(optimizer: DistributedShampoo) -> dict[str, Any]:
    """Our state written out in the reference's layout, entry by entry."""
    ours = optimizer.state_dict()
    step = ours["param_groups"][0]["step"]
    state: dict[int, dict[str, Any]] = {}
    for index, entries in ours["state"].items():
        blocks: dict[str, Any] = {}
        for key, value in entries.items():
            block, _, rest = key.partition(".")
            node = blocks.setdefault(block, {"shampoo": {"factor_matrices": {}, "inv_factor_matrices": {}}})
            kind, _, dim = rest.rpartition(".")
            if kind == "shampoo.factor_matrices":
                node["shampoo"]["factor_matrices"][int(dim)] = value.clone()  # already packed alike
            elif kind == "shampoo.inv_factor_matrices":
                node["shampoo"]["inv_factor_matrices"][int(dim)] = _upper(value)
            elif rest == "grafting.second_moment":
                node["adagrad"] = value.clone()
            elif rest in ("filtered_grad", "weight_buffer"):
                node[rest] = value.clone()
            else:
                assert kind == "shampoo.failure_counts", key  # not in the reference's state
        state[index] = {**blocks, "step": torch.tensor(step, dtype=torch.int64)}
        if "lr_sum" in ours["param_groups"][0]:  # primal averaging: its scalars, per parameter
            state[index]["lr_sum"] = torch.tensor(ours["param_groups"][0]["lr_sum"], dtype=torch.float32)
            state[index]["train_mode"] = torch.tensor(ours["param_groups"][0]["train_mode"])
    scalars = ("step", "lr_sum", "train_mode")
    group = {k: v for k, v in ours["param_groups"][0].items() if k not in scalars}
    # The reference's groups also carry its config objects and its own keys (None: no averaging).
    averaging = object() if "lr_sum" in ours["param_groups"][0] else None
    group.update(peak_lr=0.01, iterate_averaging_config=averaging, preconditioner_config=object())
    return {"state": state, "param_groups": [group]}


def _saved() -> tuple[torch.nn.Module, DistributedShampoo]:
    model = _model()
    optimizer = _optimizer(model)
    _train(model, optimizer, range(SAVED_AT))
    return model, optimizer


def test_the_layouts_are_told_apart() -> None:
    _, optimizer = _saved()
    assert is_reference_layout(_by_hand(optimizer))
    assert is_reference_layout(optimizer.reference_state_dict())
    assert not is_reference_layout(optimizer.state_dict())
    adam = torch.optim.Adam(_model().parameters())
    assert not is_reference_layout(adam.state_dict())


def test_a_reference_state_loads_and_continues_like_the_run_it_came_from() -> None:
    straight_model, straight = _saved()
    model = copy.deepcopy(straight_model)
    reference_layout = _by_hand(straight)
    _train(straight_model, straight, range(SAVED_AT, STEPS))

    fresh = _optimizer(model)
    fresh.load_state_dict(reference_layout)
    assert fresh.state_dict()["param_groups"][0]["step"] == SAVED_AT
    for index, entries in fresh.state_dict()["state"].items():
        for key, value in entries.items():
            if "failure_counts" in key:
                assert int(value) == 0  # not in the reference's state: start from zero
            elif "inv_factor_matrices" in key:
                dim = int(key.rpartition(".")[2])
                packed = reference_layout["state"][index][key.partition(".")[0]]["shampoo"]["inv_factor_matrices"][dim]
                assert torch.equal(value, _symmetric(packed, len(value)))
    _train(model, fresh, range(SAVED_AT, STEPS))
    # Frequency 1: every root is recomputed from the (exactly restored) factors before use.
    for got, want in zip(model.parameters(), straight_model.parameters()):
        assert torch.equal(got, want)


def test_reference_state_dict_is_the_documented_layout() -> None:
    _, optimizer = _saved()
    saved = optimizer.reference_state_dict()
    by_hand = _by_hand(optimizer)
    assert "step" not in saved["param_groups"][0]
    assert saved["state"].keys() == by_hand["state"].keys()

    def leaves(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for k, v in tree.items():
            out.update(leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    for index in by_hand["state"]:
        got, want = leaves(saved["state"][index]), leaves(by_hand["state"][index])
        assert got.keys() == want.keys()
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (index, key)


def test_ours_through_the_reference_layout_and_back_continues_identically() -> None:
    straight_model, straight = _saved()
    model = copy.deepcopy(straight_model)
    saved = copy.deepcopy(straight.reference_state_dict())  # its tensors are views, as state_dict()'s
    _train(straight_model, straight, range(SAVED_AT, STEPS))
    fresh = _optimizer(model)
    fresh.load_state_dict(saved)
    _train(model, fresh, range(SAVED_AT, STEPS))
    for got, want in zip(model.parameters(), straight_model.parameters()):
        assert torch.equal(got, want)


def _assert_refused(mutate: Any, match: str, saved: Any = None) -> None:
    """Loading ``_by_hand`` of a saved run, changed by ``mutate``, raises ``match`` and changes
    nothing; ``saved`` makes the run (default :func:`_saved`)."""
    saved = saved or _saved
    _, source = saved()
    bad = _by_hand(source)
    mutate(bad)
    _, target = saved()
    before = copy.deepcopy(target.state_dict())
    with pytest.raises((ValueError, KeyError), match=match):
        target.load_state_dict(bad)
    after = target.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for index, entries in before["state"].items():
        for key, value in entries.items():
            assert torch.equal(after["state"][index][key], value), key


def test_steps_that_differ_within_a_group_are_refused() -> None:
    def skew(sd: dict[str, Any]) -> None:
        sd["state"][1]["step"] = torch.tensor(SAVED_AT + 1)

    _assert_refused(skew, r"param_groups\[0\] have different step values \[3, 4\]")


def test_an_entry_without_a_counterpart_is_refused_naming_it() -> None:
    def add_eigenvectors(sd: dict[str, Any]) -> None:
        sd["state"][0]["block_0"]["shampoo"]["factor_matrices_eigenvectors"] = {0: torch.eye(4)}

    _assert_refused(add_eigenvectors, r"0\.block_0\.shampoo\.factor_matrices_eigenvectors\.0")


def test_a_root_of_the_wrong_size_is_refused() -> None:
    def shrink(sd: dict[str, Any]) -> None:
        sd["state"][0]["block_0"]["shampoo"]["inv_factor_matrices"][0] = torch.zeros(6)

    _assert_refused(shrink, "inv_factor_matrices")
