"""Primal averaging (GPA, Schedule-Free) state in the reference library's layout, and back.

The reference keeps ``step``, ``lr_sum`` (``sum_t lr_t^r``) and ``train_mode`` as one tensor per
group aliased under every parameter, ``state[i] = {"block_j": {..., "weight_buffer": z},
"step": tensor(t), "lr_sum": tensor(s), "train_mode": tensor(True)}``; ours keeps them in the
group. The dicts are written by hand from that layout (``_by_hand``); the reference is never
imported. Schedule-Free's next step reads ``lr_sum``: ``mu_x = 1 - lr^r / (s + lr^r)``, so a
continuation from a dict whose ``lr_sum`` were lost (0: ``mu_x = 0``, ``x`` jumps to ``z``)
differs, and one from the mapped dict matches the uninterrupted run.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from reference_state_dict_test import SAVED_AT, STEPS, _assert_refused, _by_hand, _model, _train

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DistributedShampoo,
    GeneralizedPrimalAveragingConfig,
    ScheduleFreeConfig,
)
from nanoshampoo.optim.shampoo.reference_state_dict import is_reference_layout

torch.set_num_threads(1)

AVERAGING = {"gpa": GeneralizedPrimalAveragingConfig, "schedule_free": ScheduleFreeConfig}


def _optimizer(model: torch.nn.Module, kind: str) -> DistributedShampoo:
    return DistributedShampoo(
        model.parameters(), lr=0.01, betas=(0.9, 0.999), epsilon=1e-12, max_preconditioner_dim=4,
        precondition_frequency=1, start_preconditioning_step=1, weight_decay=0.01,
        grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
        iterate_averaging_config=AVERAGING[kind](),
    )


def _saved(kind: str) -> tuple[torch.nn.Module, DistributedShampoo]:
    model = _model()
    optimizer = _optimizer(model, kind)
    _train(model, optimizer, range(SAVED_AT))
    return model, optimizer


def _continued(kind: str, saved: dict[str, Any], model: torch.nn.Module) -> list[torch.Tensor]:
    fresh = _optimizer(model, kind)
    fresh.load_state_dict(saved)
    _train(model, fresh, range(SAVED_AT, STEPS))
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", sorted(AVERAGING))
def test_a_reference_averaging_state_loads_and_continues_like_the_run_it_came_from(kind: str) -> None:
    straight_model, straight = _saved(kind)
    start = copy.deepcopy(straight_model)
    reference_layout = _by_hand(straight)
    assert is_reference_layout(reference_layout)
    lr_sum = straight.state_dict()["param_groups"][0]["lr_sum"]
    _train(straight_model, straight, range(SAVED_AT, STEPS))
    want = [p.detach() for p in straight_model.parameters()]

    got = _continued(kind, reference_layout, copy.deepcopy(start))
    # The reference's lr_sum is float32: the continuation is exact up to that rounding.
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=0.0)
    if kind == "schedule_free":
        assert lr_sum == pytest.approx(SAVED_AT * 0.01**2)
        lost = copy.deepcopy(reference_layout)
        for entries in lost["state"].values():
            entries["lr_sum"] = torch.tensor(0.0)
        differs = _continued(kind, lost, copy.deepcopy(start))
        gap = max(float((d - w).abs().max() / w.abs().max()) for d, w in zip(differs, want))
        assert gap > 1e-3


@pytest.mark.parametrize("kind", sorted(AVERAGING))
def test_reference_state_dict_writes_the_group_scalars_under_every_parameter(kind: str) -> None:
    _, optimizer = _saved(kind)
    optimizer.eval()
    group = optimizer.state_dict()["param_groups"][0]
    saved = optimizer.reference_state_dict()
    assert not {"step", "lr_sum", "train_mode"} & saved["param_groups"][0].keys()
    for index, entries in saved["state"].items():
        assert entries["step"].dtype == torch.int64 and int(entries["step"]) == SAVED_AT
        assert float(entries["lr_sum"]) == pytest.approx(group["lr_sum"], rel=1e-7)
        assert entries["train_mode"].dtype == torch.bool and not bool(entries["train_mode"])
        for block in (k for k in entries if k.startswith("block_")):
            ours = optimizer.state_dict()["state"][index][f"{block}.weight_buffer"]
            assert torch.equal(entries[block]["weight_buffer"], ours)


@pytest.mark.parametrize("kind", sorted(AVERAGING))
def test_ours_through_the_reference_layout_and_back_continues_as_before(kind: str) -> None:
    """Exact for GPA (its lr_sum stays 0); Schedule-Free's passes the reference's float32."""
    straight_model, straight = _saved(kind)
    start = copy.deepcopy(straight_model)
    saved = copy.deepcopy(straight.reference_state_dict())
    assert all(entries["lr_sum"].dtype == torch.float32 for entries in saved["state"].values())
    _train(straight_model, straight, range(SAVED_AT, STEPS))
    for got, want in zip(_continued(kind, saved, start), straight_model.parameters()):
        if kind == "gpa":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=0.0)


def test_eval_mode_is_carried() -> None:
    model, optimizer = _saved("gpa")
    optimizer.eval()
    saved = _by_hand(optimizer)
    fresh = _optimizer(copy.deepcopy(model), "gpa")
    fresh.load_state_dict(saved)
    assert fresh.state_dict()["param_groups"][0]["train_mode"] is False


def test_lr_sums_that_differ_within_a_group_are_refused_and_nothing_changes() -> None:
    def skew(sd: dict[str, Any]) -> None:
        sd["state"][1]["lr_sum"] = torch.tensor(1.0)

    _assert_refused(
        skew, r"param_groups\[0\] have different lr_sum values", lambda: _saved("schedule_free")
    )
