"""Muon (with and without cautious weight decay) against the float64 reference of its equations."""

from __future__ import annotations

import pytest
import torch
from muon_family_reference import (
    muon_step,
    newton_schulz,
    polar_factor,
    random_problem,
    run_optimizer,
    run_reference,
    run_with_resume,
    train_least_squares,
)

import nanoshampoo.optim.muon as muon_module
from nanoshampoo.optim.muon import Muon

# Two (8, 6) matrices share one bucket; a wide and a square one get their own.
SHAPES = [(8, 6), (8, 6), (6, 8), (5, 5)]
STEPS = 5
HYPER = {
    "lr": 0.05,
    "momentum": 0.9,
    "nesterov": True,
    "weight_decay": 0.3,
    "cautious_weight_decay": True,
    "ns_steps": 5,
    "ns_coefficients": (3.4445, -4.7750, 2.0315),
}


def test_reference_newton_schulz_converges_to_the_svd_polar_factor() -> None:
    """The reference iteration is an orthogonalization: track 3's convergent (2, -1.5, 0.5)."""
    generator = torch.Generator().manual_seed(3)
    u = torch.randn(7, 4, generator=generator, dtype=torch.float64)
    got = newton_schulz(u, (2.0, -1.5, 0.5), 30)
    torch.testing.assert_close(got, polar_factor(u), rtol=0, atol=1e-12)


@pytest.mark.parametrize("cautious", [True, False])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 5e-6), (torch.float64, 1e-12)])
def test_steps_match_the_float64_reference(
    cautious: bool, nesterov: bool, dtype: torch.dtype, tolerance: float
) -> None:
    h = {**HYPER, "cautious_weight_decay": cautious, "nesterov": nesterov}
    weights, grads = random_problem(SHAPES, STEPS)
    expected = run_reference(muon_step, weights, grads, h)
    got = run_optimizer(Muon, weights, grads, h, dtype)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=tolerance)


def test_cautious_decay_spares_coordinates_where_update_and_weight_disagree() -> None:
    weights, grads = random_problem([(6, 6)], 1)
    plain = run_optimizer(
        Muon, weights, grads, {**HYPER, "cautious_weight_decay": False}, torch.float64
    )[0]
    cautious = run_optimizer(Muon, weights, grads, HYPER, torch.float64)[0]
    no_decay = run_optimizer(Muon, weights, grads, {**HYPER, "weight_decay": 0.0}, torch.float64)[0]
    decayed = (cautious - no_decay).abs() > 1e-12
    # The decay moves W towards 0, like the step, on the decayed coordinates only.
    w0 = weights[0]
    assert torch.equal(decayed, (no_decay - w0) * w0 < 0)
    assert 0 < int(decayed.sum()) < w0.numel()
    torch.testing.assert_close(cautious[decayed], plain[decayed], rtol=0, atol=1e-12)


def test_same_shape_parameters_share_one_newton_schulz_call(monkeypatch) -> None:
    batches = []
    original = muon_module.newton_schulz_orthogonalize

    def counting(matrices, coefficients, num_iterations):
        batches.append(tuple(matrices.shape))
        return original(matrices, coefficients, num_iterations)

    monkeypatch.setattr(muon_module, "newton_schulz_orthogonalize", counting)
    weights, grads = random_problem(SHAPES, 1)
    run_optimizer(Muon, weights, grads, HYPER, torch.float32)
    assert sorted(batches) == [(1, 5, 5), (1, 6, 8), (2, 8, 6)]


def test_parameter_without_gradient_is_left_alone() -> None:
    used, unused = torch.nn.Parameter(torch.ones(3, 3)), torch.nn.Parameter(torch.ones(3, 3))
    optimizer = Muon([used, unused], lr=0.1, weight_decay=0.1)
    used.grad = torch.eye(3)
    optimizer.step()
    assert torch.equal(unused.detach(), torch.ones(3, 3))
    assert unused not in optimizer.state and used in optimizer.state


def test_state_dict_round_trip_resumes_exactly() -> None:
    weights, grads = random_problem(SHAPES, 6)
    straight = run_optimizer(Muon, weights, grads, HYPER, torch.float32)
    resumed = run_with_resume(Muon, weights, grads, HYPER, resume_at=3)
    for a, b in zip(resumed, straight):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cautious", [False, True])
def test_reduces_a_least_squares_loss(cautious: bool) -> None:
    initial, final = train_least_squares(
        Muon, {"lr": 0.1, "weight_decay": 0.01, "cautious_weight_decay": cautious}, steps=200
    )
    assert final < 1e-3 * initial


@pytest.mark.parametrize(
    "name, value",
    [
        ("lr", -0.1),
        ("lr", float("nan")),
        ("momentum", 1.0),
        ("momentum", -0.1),
        ("nesterov", 1),
        ("weight_decay", -1.0),
        ("cautious_weight_decay", "yes"),
        ("ns_steps", 0),
        ("ns_steps", 2.0),
        ("ns_coefficients", (1.0, 2.0)),
        ("ns_coefficients", (1.0, float("inf"), 0.0)),
    ],
)
def test_invalid_hyperparameter_raises_naming_it(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{name}"):
        Muon([torch.nn.Parameter(torch.zeros(2, 2))], **{name: value})


def test_invalid_param_group_is_not_added() -> None:
    optimizer = Muon([torch.nn.Parameter(torch.zeros(2, 2))])
    with pytest.raises(ValueError, match="^momentum"):
        optimizer.add_param_group(
            {"params": [torch.nn.Parameter(torch.zeros(2, 2))], "momentum": 2.0}
        )
    assert len(optimizer.param_groups) == 1


def test_scheduler_setting_a_bad_lr_is_refused_at_step() -> None:
    w = torch.nn.Parameter(torch.zeros(2, 2))
    optimizer = Muon([w])
    optimizer.param_groups[0]["lr"] = -1.0
    w.grad = torch.ones(2, 2)
    with pytest.raises(ValueError, match="^lr"):
        optimizer.step()
    assert torch.equal(w.detach(), torch.zeros(2, 2))


@pytest.mark.parametrize("shape", [(4,), (2, 3, 4)])
def test_non_matrix_parameter_raises(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="^params: Muon updates 2-D"):
        Muon([torch.nn.Parameter(torch.zeros(shape))])
