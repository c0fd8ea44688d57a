"""A state dict of named parameters loads into another grouping of them
(``regroup_by_param_names``).

One process, single-device Shampoo at the recipe's settings (float32, epsilon 1e-12): the blocks
and their state are the parameters', whichever group holds them, so a run saved under one
grouping and resumed under another continues bit for bit as the uninterrupted run.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from flat_shampoo_state import assert_same_flat_state, flat_state, group_step

from nanoshampoo.optim.shampoo import AdamPreconditionerConfig, DistributedShampoo
from nanoshampoo.optim.shampoo.state_dict_regrouping import regroup_by_param_names

SHAPES = ((6, 5), (4,), (3, 2, 2), (7, 3))
NAMES = ("w0", "b1", "w2", "w3")
STEPS, RESUME_AT = 5, 3
ONE_GROUP = [[0, 1, 2, 3]]
TWO_GROUPS = [[3, 0], [2, 1]]


def named_params() -> list[tuple[str, torch.nn.Parameter]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (n, torch.nn.Parameter(torch.randn(s, generator=generator))) for n, s in zip(NAMES, SHAPES)
    ]


def make_optimizer(
    named: list[tuple[str, torch.nn.Parameter]], grouping: list[list[int]], **group: Any
) -> DistributedShampoo:
    groups = [{"params": [named[i] for i in members], **group} for members in grouping]
    return DistributedShampoo(
        groups,
        lr=0.05,
        betas=(0.9, 0.99),
        epsilon=1e-12,
        weight_decay=0.01,
        max_preconditioner_dim=4,
        precondition_frequency=2,
        grafting_config=AdamPreconditionerConfig(beta2=0.99, epsilon=1e-8),
    )


def train(
    named: list[tuple[str, torch.nn.Parameter]], optimizer: DistributedShampoo, steps: range
) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(1000 + step)
        loss = sum(
            (torch.tanh(p) * torch.randn(p.shape, generator=generator)).sum() for _, p in named
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def round_trip(state_dict: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(
    "saved, loaded",
    [(ONE_GROUP, TWO_GROUPS), (TWO_GROUPS, ONE_GROUP), (TWO_GROUPS, [[1], [2, 0, 3]])],
)
def test_a_run_resumed_under_another_grouping_continues_bit_for_bit(
    saved: list[list[int]], loaded: list[list[int]]
) -> None:
    uninterrupted = named_params()
    train(uninterrupted, make_optimizer(uninterrupted, saved), range(STEPS))

    named = named_params()
    optimizer = make_optimizer(named, saved)
    train(named, optimizer, range(RESUME_AT))
    resumed = make_optimizer(named, loaded)
    resumed.load_state_dict(round_trip(optimizer.state_dict()))
    assert [group_step(resumed, g) for g in range(len(loaded))] == [RESUME_AT] * len(loaded)
    train(named, resumed, range(RESUME_AT, STEPS))
    for (_, got), (_, want) in zip(named, uninterrupted, strict=True):
        assert got.dtype == torch.float32 and torch.equal(got, want)


def test_each_parameter_takes_the_state_saved_under_its_name() -> None:
    named = named_params()
    optimizer = make_optimizer(named, ONE_GROUP)
    train(named, optimizer, range(2))
    saved = optimizer.state_dict()
    regrouped = regroup_by_param_names(saved, make_optimizer(named, TWO_GROUPS).param_groups)
    order = [i for members in TWO_GROUPS for i in members]  # parameter at each new position
    assert [g["param_names"] for g in regrouped["param_groups"]] == [
        [NAMES[i] for i in m] for m in TWO_GROUPS
    ]
    assert [g["params"] for g in regrouped["param_groups"]] == [[0, 1], [2, 3]]
    for position, index in enumerate(order):
        assert regrouped["state"][position] is saved["state"][index]
    for group in regrouped["param_groups"]:
        assert {k: v for k, v in group.items() if k not in ("params", "param_names")} == {
            k: v for k, v in saved["param_groups"][0].items() if k not in ("params", "param_names")
        }


def test_unnamed_or_identically_grouped_state_dicts_are_returned_as_given() -> None:
    named = named_params()
    optimizer = make_optimizer(named, TWO_GROUPS)
    saved = optimizer.state_dict()
    assert regroup_by_param_names(saved, optimizer.param_groups) is saved
    unnamed = DistributedShampoo([p for _, p in named])
    unnamed_saved = unnamed.state_dict()
    assert regroup_by_param_names(unnamed_saved, optimizer.param_groups) is unnamed_saved
    assert regroup_by_param_names(saved, unnamed.param_groups) is saved


def test_other_names_raise_naming_them() -> None:
    named = named_params()
    saved = make_optimizer(named, ONE_GROUP).state_dict()
    renamed = [("v0" if n == "w0" else n, p) for n, p in named]
    with pytest.raises(
        ValueError, match=r"^state_dict param_names differ .*missing \['v0'\], unexpected \['w0'\]"
    ):
        regroup_by_param_names(saved, make_optimizer(renamed, TWO_GROUPS).param_groups)


def test_renamed_parameters_grouped_alike_load_by_position() -> None:
    named = named_params()
    optimizer = make_optimizer(named, TWO_GROUPS)
    train(named, optimizer, range(2))
    saved = optimizer.state_dict()
    renamed = make_optimizer([(f"x{i}", p) for i, (_, p) in enumerate(named)], TWO_GROUPS)
    assert regroup_by_param_names(saved, renamed.param_groups) is saved
    renamed.load_state_dict(saved)
    assert_same_flat_state(flat_state(renamed.state_dict()), flat_state(saved))


def test_a_group_gathering_saved_groups_of_other_hyperparameters_raises_and_loads_nothing() -> None:
    named = named_params()
    source = make_optimizer(named, TWO_GROUPS)
    source.param_groups[1]["lr"] = 0.01
    train(named, source, range(2))
    target = make_optimizer(named, ONE_GROUP)
    before = {k: v.clone() for k, v in flat_state(target.state_dict())[0].items()}
    with pytest.raises(
        ValueError,
        match=r"^param_groups\[0\] takes parameters from saved param groups \[0, 1\], whose "
        r"entries \['lr'\] differ",
    ):
        target.load_state_dict(source.state_dict())
    for key, value in flat_state(target.state_dict())[0].items():
        assert torch.equal(value, before[key])
