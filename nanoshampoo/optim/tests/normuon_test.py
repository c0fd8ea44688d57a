"""NorMuon against the float64 reference of arXiv 2510.05491 (Algorithm 1 and the authors' code)."""

from __future__ import annotations

import pytest
import torch
from muon_family_reference import (
    normuon_step,
    random_problem,
    run_optimizer,
    run_reference,
    run_with_resume,
    train_least_squares,
)

import nanoshampoo.optim.muon as muon_module
from nanoshampoo.optim.normuon import NorMuon

SHAPES = [(8, 6), (8, 6), (6, 8), (5, 5)]
STEPS = 5
HYPER = {
    "lr": 0.05,
    "momentum": 0.9,
    "nesterov": True,
    "beta2": 0.95,
    "eps": 1e-10,
    "update_scale": "muon",
    "weight_decay": 0.3,
    "cautious_weight_decay": False,
    "ns_steps": 5,
    "ns_coefficients": (3.4445, -4.7750, 2.0315),
}


@pytest.mark.parametrize(
    "update_scale, nesterov, cautious",
    [
        ("muon", True, False),  # the authors' released code
        ("adam_rms", False, False),  # the paper's Algorithm 1
        ("muon", True, True),
        ("adam_rms", True, True),
    ],
)
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 5e-6), (torch.float64, 1e-12)])
def test_steps_match_the_float64_reference(
    update_scale: str, nesterov: bool, cautious: bool, dtype: torch.dtype, tolerance: float
) -> None:
    h = {
        **HYPER,
        "update_scale": update_scale,
        "nesterov": nesterov,
        "cautious_weight_decay": cautious,
    }
    weights, grads = random_problem(SHAPES, STEPS)
    expected = run_reference(normuon_step, weights, grads, h)
    got = run_optimizer(NorMuon, weights, grads, h, dtype)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=tolerance)


@pytest.mark.parametrize("update_scale", ["muon", "adam_rms"])
def test_first_step_gives_every_row_the_same_norm(update_scale: str) -> None:
    """At step 1 ``v`` is each row's own mean square: every row of the step has one norm."""
    weights, grads = random_problem([(8, 6)], 1)
    h = {**HYPER, "weight_decay": 0.0, "update_scale": update_scale}
    step = run_optimizer(NorMuon, weights, grads, h, torch.float64)[0] - weights[0]
    row_norms = torch.linalg.vector_norm(step, dim=1)
    torch.testing.assert_close(row_norms, row_norms.mean().expand(8), rtol=1e-9, atol=0)
    if update_scale == "adam_rms":  # Algorithm 1: an RMS of 0.2 per entry, times lr
        rms = float(torch.sqrt((step * step).mean()))
        assert rms == pytest.approx(0.2 * h["lr"], rel=1e-12)


def test_zero_gradient_gives_a_zero_step() -> None:
    w = torch.nn.Parameter(torch.ones(4, 3))
    optimizer = NorMuon([w], lr=0.1)
    w.grad = torch.zeros(4, 3)
    optimizer.step()
    assert torch.equal(w.detach(), torch.ones(4, 3))


def test_same_shape_parameters_share_one_newton_schulz_call(monkeypatch) -> None:
    batches = []
    original = muon_module.newton_schulz_orthogonalize

    def counting(matrices, coefficients, num_iterations):
        batches.append(tuple(matrices.shape))
        return original(matrices, coefficients, num_iterations)

    monkeypatch.setattr(muon_module, "newton_schulz_orthogonalize", counting)
    weights, grads = random_problem(SHAPES, 1)
    run_optimizer(NorMuon, weights, grads, HYPER, torch.float32)
    assert sorted(batches) == [(1, 5, 5), (1, 6, 8), (2, 8, 6)]


def test_state_dict_round_trip_resumes_exactly() -> None:
    weights, grads = random_problem(SHAPES, 6)
    straight = run_optimizer(NorMuon, weights, grads, HYPER, torch.float32)
    resumed = run_with_resume(NorMuon, weights, grads, HYPER, resume_at=3)
    for a, b in zip(resumed, straight):
        assert torch.equal(a, b)


@pytest.mark.parametrize("update_scale, lr", [("muon", 0.1), ("adam_rms", 0.2)])
def test_reduces_a_least_squares_loss(update_scale: str, lr: float) -> None:
    initial, final = train_least_squares(
        NorMuon, {"lr": lr, "weight_decay": 0.01, "update_scale": update_scale}, steps=200
    )
    assert final < 1e-3 * initial


@pytest.mark.parametrize(
    "name, value",
    [
        ("beta2", 1.0),
        ("beta2", -0.5),
        ("eps", 0.0),
        ("update_scale", "adam"),
        ("lr", -1.0),
        ("momentum", 1.5),
        ("ns_steps", 0),
    ],
)
def test_invalid_hyperparameter_raises_naming_it(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{name}"):
        NorMuon([torch.nn.Parameter(torch.zeros(2, 2))], **{name: value})
