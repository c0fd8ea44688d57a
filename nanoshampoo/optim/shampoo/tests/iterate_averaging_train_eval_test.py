"""Primal averaging's modes and state: ``train()``/``eval()`` and checkpoints (GPA, Schedule-Free).

The parameters hold ``y`` in train mode and ``x`` in eval mode; a checkpoint holds ``z`` per
block and, per group, the mode and Schedule-Free's ``sum lr^r`` (``lr_sum``). The model, loss
and settings are those of ``iterate_averaging_test.py`` (float32, epsilon 1e-12), whose float64
loops check the sequences themselves.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from flat_shampoo_state import flat_state

# The neighbouring test module (pytest puts its dir on sys.path).
from iterate_averaging_test import (
    ADAM,
    STEPS,
    WARMUP_LRS,
    initial_params,
    loss_of,
    run_shampoo,
)

from nanoshampoo.optim.shampoo import (
    ClassicMomentumConfig,
    DistributedShampoo,
    GeneralizedPrimalAveragingConfig,
    ScheduleFreeConfig,
)

SCHEDULE_FREE = dict(
    lr=0.02, iterate_averaging_config=ScheduleFreeConfig(train_interp_coeff=0.7), **ADAM
)


def test_eval_then_train_returns_to_the_training_point() -> None:
    """The switch is ``W <- W + c (z - W)`` and back: float64 parameters come back to the last
    bits of a float64 computation; float32 ones to within two float32 roundings."""
    for dtype, tolerance in (
        (torch.float64, 1e-15),
        (torch.float32, 4 * torch.finfo(torch.float32).eps),
    ):
        params = [torch.nn.Parameter(p) for p in initial_params(dtype)]
        params, optimizer = run_shampoo(3, params=params, **SCHEDULE_FREE)
        training_point = [p.detach().clone() for p in params]
        optimizer.eval()
        assert any(not torch.equal(p, q) for p, q in zip(params, training_point))
        optimizer.eval()  # already in eval mode: nothing moves
        evaluation_point = [p.detach().clone() for p in params]
        optimizer.train()
        optimizer.train()
        for p, q, e in zip(params, training_point, evaluation_point):
            scale = q.abs() + (e - q).abs()
            assert ((p.detach() - q).abs() <= tolerance * scale + 1e-30).all()


def test_z_starts_at_the_parameters_of_the_first_step() -> None:
    """Weights loaded after the optimizer is built (without its state) are where averaging
    starts; eval()/train() before the first step move nothing (x = y = z)."""
    want, _ = run_shampoo(3, **SCHEDULE_FREE)
    params = [torch.nn.Parameter(torch.zeros_like(p)) for p in initial_params()]
    optimizer = DistributedShampoo(params, **{"epsilon": 1e-12, **SCHEDULE_FREE})
    with torch.no_grad():
        for param, value in zip(params, initial_params()):
            param.copy_(value)
    optimizer.eval()
    assert all(torch.equal(p, q) for p, q in zip(params, initial_params()))
    optimizer.train()
    got, _ = run_shampoo(3, params=params, optimizer=optimizer)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_train_and_eval_do_nothing_without_primal_averaging() -> None:
    params, optimizer = run_shampoo(
        2, lr=0.02, iterate_averaging_config=ClassicMomentumConfig(), **ADAM
    )
    before = [p.detach().clone() for p in params]
    optimizer.eval()
    optimizer.train()
    assert all(torch.equal(p, q) for p, q in zip(params, before))


def test_a_step_in_eval_mode_raises_and_changes_nothing() -> None:
    params, optimizer = run_shampoo(2, **SCHEDULE_FREE)
    optimizer.eval()
    before = [p.detach().clone() for p in params]
    state = {k: v.clone() for k, v in flat_state(optimizer.state_dict())[0].items()}
    loss_of(params).backward()
    with pytest.raises(
        RuntimeError,
        match=r"not in train mode.*Call optimizer\.train\(\) before calling optimizer\.step\(\)!",
    ):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    assert all(torch.equal(flat_state(optimizer.state_dict())[0][k], v) for k, v in state.items())


def test_a_parameter_without_gradient_keeps_its_point_and_its_z() -> None:
    params, optimizer = run_shampoo(2, **SCHEDULE_FREE)
    before = params[2].detach().clone()
    z_before = flat_state(optimizer.state_dict())[2]["block_0.weight_buffer"].clone()
    optimizer.zero_grad()
    loss_of(params).backward()
    params[2].grad = None
    optimizer.step()
    assert torch.equal(params[2].detach(), before)
    assert torch.equal(flat_state(optimizer.state_dict())[2]["block_0.weight_buffer"], z_before)
    assert not torch.equal(params[0].detach(), initial_params()[0])


def test_primal_averaging_cannot_be_turned_on_or_off_but_its_coefficients_can_change() -> None:
    params, optimizer = run_shampoo(1, **SCHEDULE_FREE)
    group = optimizer.param_groups[0]
    group["iterate_averaging_config"] = GeneralizedPrimalAveragingConfig(train_interp_coeff=0.7)
    loss_of(params).backward()
    optimizer.step()
    group["iterate_averaging_config"] = ClassicMomentumConfig()
    with pytest.raises(ValueError, match="^iterate_averaging_config cannot turn primal averaging"):
        optimizer.step()


# ------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------


def _round_trip(state_dict: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("save_in_eval_mode", [False, True])
def test_a_checkpoint_mid_run_resumes_bit_identically(save_in_eval_mode: bool) -> None:
    """Steps 1-3, (eval), save model and optimizer, load both into fresh objects, (train),
    steps 4-6: the same parameters, bit for bit, as the uninterrupted run."""
    lrs = WARMUP_LRS

    def first_half() -> tuple[list[torch.Tensor], DistributedShampoo]:
        params, optimizer = run_shampoo(3, lrs=lrs, **{**SCHEDULE_FREE, "weight_decay": 0.01})
        if save_in_eval_mode:
            optimizer.eval()
        return params, optimizer

    def second_half(
        params: list[torch.Tensor], optimizer: DistributedShampoo
    ) -> list[torch.Tensor]:
        optimizer.train()
        for t in range(3, STEPS):
            optimizer.param_groups[0]["lr"] = lrs[t]
            optimizer.zero_grad()
            loss_of(params).backward()
            optimizer.step()
        return [p.detach() for p in params]

    want = second_half(*first_half())
    params, optimizer = first_half()
    checkpoint = _round_trip(
        {"model": [p.detach() for p in params], "optim": optimizer.state_dict()}
    )
    assert all(
        entry["train_mode"].item() is not save_in_eval_mode
        for entry in checkpoint["optim"]["state"].values()
    )
    fresh_params = [torch.nn.Parameter(p.clone()) for p in checkpoint["model"]]
    fresh = DistributedShampoo(
        fresh_params, **{"epsilon": 1e-12, **SCHEDULE_FREE, "weight_decay": 0.01}
    )
    fresh.load_state_dict(checkpoint["optim"])
    got = second_half(fresh_params, fresh)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "entry, value, error, match",
    [
        ("lr_sum", -1.0, ValueError, r"state\[0\]\['lr_sum'\] must be"),
        ("lr_sum", None, KeyError, r"missing state 0\.lr_sum"),
        ("train_mode", 1, ValueError, r"state\[0\]\['train_mode'\] must be"),
    ],
    ids=["negative", "missing", "int"],
)
def test_a_malformed_averaging_entry_in_a_checkpoint_raises(
    entry: str, value: Any, error: type[Exception], match: str
) -> None:
    _, optimizer = run_shampoo(2, **SCHEDULE_FREE)
    state_dict = _round_trip(optimizer.state_dict())
    for param_state in state_dict["state"].values():  # one value per group, under every parameter
        if value is None:
            del param_state[entry]
        else:
            param_state[entry] = torch.tensor(value)
    with pytest.raises(error, match=match):
        optimizer.load_state_dict(state_dict)
