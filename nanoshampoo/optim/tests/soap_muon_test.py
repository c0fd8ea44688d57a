"""SOAP-Muon against the float64 reference of the speedrun track-3 records' equations.

The reference compares at square shapes: there ``L = G G^T`` and ``R = G^T G`` of a random
gradient are full rank from step 1, so their eigenvectors are defined up to sign (which the
preconditioner does not see). A non-square gradient leaves a null space in one factor whose
basis is arbitrary (rounding picks it), so non-square shapes are checked by training only.
"""

from __future__ import annotations

import pytest
import torch
from muon_family_reference import (
    random_problem,
    run_optimizer,
    run_reference,
    run_with_resume,
    soap_muon_step,
    train_least_squares,
)

import nanoshampoo.optim.muon as muon_module
from nanoshampoo.optim.muon import Muon
from nanoshampoo.optim.soap_muon import SOAPMuon

SHAPES = [(6, 6), (6, 6), (4, 4)]
STEPS = 6
HYPER = {
    "lr": 0.05,
    "momentum": 0.9,
    "nesterov": True,
    "beta2": 0.9,
    "shampoo_beta": 0.9,
    "eps": 1e-8,
    "precondition_frequency": 1,
    "weight_decay": 0.1,
    "cautious_weight_decay": False,
    "ns_steps": 5,
    "ns_coefficients": (3.4445, -4.7750, 2.0315),
}


@pytest.mark.parametrize("frequency, cautious", [(1, False), (2, True), (3, False)])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_steps_match_the_float64_reference(
    frequency: int, cautious: bool, dtype: torch.dtype, tolerance: float
) -> None:
    h = {**HYPER, "precondition_frequency": frequency, "cautious_weight_decay": cautious}
    weights, grads = random_problem(SHAPES, STEPS)
    expected = run_reference(soap_muon_step, weights, grads, h)
    got = run_optimizer(SOAPMuon, weights, grads, h, dtype)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=tolerance)


def test_first_step_is_plain_muon() -> None:
    weights, grads = random_problem(SHAPES, 1)
    muon_keys = (
        "lr",
        "momentum",
        "nesterov",
        "weight_decay",
        "cautious_weight_decay",
        "ns_steps",
        "ns_coefficients",
    )
    muon = run_optimizer(Muon, weights, grads, {k: HYPER[k] for k in muon_keys}, torch.float64)
    soap = run_optimizer(SOAPMuon, weights, grads, HYPER, torch.float64)
    for a, b in zip(soap, muon):
        assert torch.equal(a, b)


def test_same_shape_parameters_share_one_newton_schulz_call(monkeypatch) -> None:
    batches = []
    original = muon_module.newton_schulz_orthogonalize

    def counting(matrices, coefficients, num_iterations):
        batches.append(tuple(matrices.shape))
        return original(matrices, coefficients, num_iterations)

    monkeypatch.setattr(muon_module, "newton_schulz_orthogonalize", counting)
    weights, grads = random_problem([(8, 6), (8, 6), (6, 8)], 2)
    run_optimizer(SOAPMuon, weights, grads, HYPER, torch.float32)
    assert sorted(batches) == [(1, 6, 8), (1, 6, 8), (2, 8, 6), (2, 8, 6)]


def test_state_dict_round_trip_resumes_exactly() -> None:
    weights, grads = random_problem(SHAPES, 6)
    h = {**HYPER, "precondition_frequency": 2}
    straight = run_optimizer(SOAPMuon, weights, grads, h, torch.float32)
    resumed = run_with_resume(SOAPMuon, weights, grads, h, resume_at=3)
    for a, b in zip(resumed, straight):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [(12, 8), (8, 12)])
def test_reduces_a_least_squares_loss(shape: tuple[int, int]) -> None:
    # Adam in the eigenbasis makes the tiny coordinates as large as the big ones (a near-sign
    # step), so on this problem SOAP-Muon is slower than Muon: 0.05x (tall), 0.1x (wide).
    initial, final = train_least_squares(
        SOAPMuon, {"lr": 0.2, "weight_decay": 0.01}, steps=200, shape=shape
    )
    assert final < 0.15 * initial


@pytest.mark.parametrize(
    "name, value",
    [
        ("beta2", 1.0),
        ("shampoo_beta", -0.1),
        ("shampoo_beta", 1.0),
        ("eps", -1e-8),
        ("precondition_frequency", 0),
        ("precondition_frequency", 1.5),
        ("lr", float("inf")),
    ],
)
def test_invalid_hyperparameter_raises_naming_it(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{name}"):
        SOAPMuon([torch.nn.Parameter(torch.zeros(2, 2))], **{name: value})
