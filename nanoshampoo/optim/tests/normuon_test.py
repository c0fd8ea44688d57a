"""Muon with cautious weight decay and NorMuon against float64 steps written from their
equations (the module docstring's list), at the settings the recipe runs (float32)."""

from __future__ import annotations

import pytest
import torch

from nanoshampoo.optim.normuon import Muon, NorMuon

SHAPES = [(24, 8), (8, 24), (12, 12)]


def ns_reference(g: torch.Tensor, steps: int) -> torch.Tensor:
    """Quintic Newton-Schulz in float64, the slow way: X <- aX + (bA + cA^2)X, A = XX^T."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = g.shape[0] > g.shape[1]
    x = g.T.clone() if tall else g.clone()
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def reference_step(w: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], *,
                   lr: float, momentum: float, beta2: float, wd: float, normalize: bool,
                   cautious: bool) -> torch.Tensor:
    rows, cols = w.shape
    state["m"] = momentum * state["m"] + (1 - momentum) * g
    u = (1 - momentum) * g + momentum * state["m"]
    o = ns_reference(u, 5)
    if normalize:
        row_means = torch.tensor([[sum(float(o[i, j]) ** 2 for j in range(cols)) / cols]
                                  for i in range(rows)], dtype=torch.float64)
        state["v"] = beta2 * state["v"] + (1 - beta2) * row_means
        scaled = o / (state["v"].sqrt() + 1e-10)
        o = scaled * torch.linalg.matrix_norm(o) / (torch.linalg.matrix_norm(scaled) + 1e-10)
    d = o * max(1.0, rows / cols) ** 0.5
    if cautious:
        mask = (d * w >= 0).double()
        w = w - lr * wd * w * mask
    else:
        w = w * (1 - lr * wd)
    return w - lr * d


@pytest.mark.parametrize("cls, normalize", [(Muon, False), (NorMuon, True)])
@pytest.mark.parametrize("cautious", [False, True])
def test_three_steps_match_the_float64_equations(cls: type, normalize: bool,
                                                 cautious: bool) -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in SHAPES]
    settings = dict(lr=0.05, momentum=0.95, beta2=0.95, wd=0.1)
    opt = cls(params, lr=0.05, momentum=0.95, beta2=0.95, weight_decay=0.1,
              cautious_weight_decay=cautious)
    ref = [p.detach().double().clone() for p in params]
    states = [{"m": torch.zeros_like(r), "v": torch.zeros(r.shape[0], 1, dtype=torch.float64)}
              for r in ref]
    for _ in range(3):
        grads = [torch.randn(*shape) for shape in SHAPES]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        ref = [reference_step(r, g.double(), s, normalize=normalize, cautious=cautious,
                              **settings) for r, g, s in zip(ref, grads, states)]
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach().double(), r, rtol=0, atol=2e-5)


def test_cautious_decay_spares_the_weights_the_update_pushes_away_from_zero() -> None:
    w = torch.nn.Parameter(torch.tensor([[1.0, -1.0], [1.0, -1.0]]))
    opt = Muon([w], lr=0.1, momentum=0.0, weight_decay=0.5, cautious_weight_decay=True)
    w.grad = torch.tensor([[1.0, 1.0], [1.0, 1.0]])  # the update D has the sign of +1 everywhere
    before = w.detach().clone()
    opt.step()
    d = (before - w.detach()) / 0.1  # = D + wd * W * mask
    direction = ns_reference(torch.ones(2, 2, dtype=torch.float64), 5).float()
    # Column 0: W > 0 agrees with D > 0, decayed; column 1: W < 0 disagrees, not decayed.
    torch.testing.assert_close(d[:, 0], direction[:, 0] + 0.5 * 1.0, rtol=0, atol=1e-5)
    torch.testing.assert_close(d[:, 1], direction[:, 1], rtol=0, atol=1e-5)


def test_normuon_rows_have_equal_rms_after_normalization_from_zero_state() -> None:
    w = torch.nn.Parameter(torch.zeros(6, 4))
    opt = NorMuon([w], lr=1.0, momentum=0.0, beta2=0.0)
    torch.manual_seed(1)
    w.grad = torch.randn(6, 4) * torch.arange(1.0, 7.0)[:, None]
    opt.step()
    update = -w.detach() / 1.5 ** 0.5  # lr 1, shape scale sqrt(6 / 4)
    rms = update.square().mean(dim=1).sqrt()
    torch.testing.assert_close(rms, torch.full_like(rms, float(rms.mean())), rtol=1e-5, atol=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=float("inf")), "lr must be finite"), (dict(momentum=1.0), "momentum"),
    (dict(beta2=-0.1), "beta2"), (dict(weight_decay=-1.0), "weight_decay"),
    (dict(ns_steps=0), "ns_steps"),
])
def test_bad_settings_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NorMuon([torch.nn.Parameter(torch.ones(2, 2))], **kwargs)


def test_vectors_and_repeated_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="updates matrices"):
        Muon([torch.nn.Parameter(torch.ones(3))])
    p = torch.nn.Parameter(torch.ones(2, 2))
    with pytest.raises(ValueError, match="given twice"):
        Muon([p, p])
