"""Float64 reference steps of Muon, NorMuon and SOAP-Muon, written from the papers' equations.

One matrix at a time, plain loops (rows, entries), no code shared with ``nanoshampoo.optim``:
the tests run the optimizers in float32 and float64 and compare. Each ``*_step`` takes the
parameter ``w``, gradient ``g`` and a state dict (mutated) and returns the new parameter.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import Tensor

# Keller Jordan's Muon normalizes by ||X||_F + 1e-7 before iterating.
NS_NORM_EPS = 1e-7


def newton_schulz(u: Tensor, coefficients: tuple[float, float, float], steps: int) -> Tensor:
    """``X_0 = U / (||U||_F + 1e-7)``, ``X <- a X + b A X + c A^2 X`` with ``A = X X^T``, wide."""
    a, b, c = coefficients
    x = u.T if u.shape[0] > u.shape[1] else u
    x = x / (torch.sqrt((x * x).sum()) + NS_NORM_EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + b * (gram @ x) + c * (gram @ gram @ x)
    return x.T if u.shape[0] > u.shape[1] else x


def polar_factor(u: Tensor) -> Tensor:
    """``U_r V_r^T`` of a full-rank matrix, by SVD."""
    left, _, right_t = torch.linalg.svd(u, full_matrices=False)
    return left @ right_t


def momentum_update(g: Tensor, state: dict[str, Any], mu: float, nesterov: bool) -> Tensor:
    """``M <- mu M + (1 - mu) G``; ``U = (1 - mu) G + mu M`` (Nesterov) or ``M``."""
    m = mu * state.get("m", torch.zeros_like(g)) + (1 - mu) * g
    state["m"] = m
    return (1 - mu) * g + mu * m if nesterov else m


def decayed_step(w: Tensor, o: Tensor, lr: float, wd: float, cautious: bool) -> Tensor:
    """``W - lr (O + wd W)``, the decay only where ``O W >= 0`` entry by entry if ``cautious``."""
    new = w.clone()
    for i in range(w.shape[0]):
        for j in range(w.shape[1]):
            decays = (not cautious) or float(o[i, j] * w[i, j]) >= 0.0
            new[i, j] = w[i, j] - lr * (o[i, j] + (wd * w[i, j] if decays else 0.0))
    return new


def shape_scale(w: Tensor) -> float:
    return max(1.0, w.shape[0] / w.shape[1]) ** 0.5


def muon_step(w: Tensor, g: Tensor, state: dict[str, Any], h: dict[str, Any]) -> Tensor:
    u = momentum_update(g, state, h["momentum"], h["nesterov"])
    o = newton_schulz(u, h["ns_coefficients"], h["ns_steps"]) * shape_scale(w)
    return decayed_step(w, o, h["lr"], h["weight_decay"], h["cautious_weight_decay"])


def normuon_step(w: Tensor, g: Tensor, state: dict[str, Any], h: dict[str, Any]) -> Tensor:
    """arXiv 2510.05491 Algorithm 1 (``adam_rms``), or the authors' norm-preserving ``muon``."""
    u = momentum_update(g, state, h["momentum"], h["nesterov"])
    o = newton_schulz(u, h["ns_coefficients"], h["ns_steps"])
    rows, cols = w.shape
    v = state.get("v", [0.0] * rows)
    o_hat = torch.empty_like(o)
    for i in range(rows):
        row_mean_square = sum(float(o[i, j]) ** 2 for j in range(cols)) / cols
        v[i] = h["beta2"] * v[i] + (1 - h["beta2"]) * row_mean_square
        o_hat[i] = o[i] / (v[i] ** 0.5 + h["eps"])
    state["v"] = v
    o_hat_norm = float(torch.sqrt((o_hat * o_hat).sum()))
    if h["update_scale"] == "muon":
        step = o_hat * float(torch.sqrt((o * o).sum())) / o_hat_norm * shape_scale(w)
    else:
        step = o_hat * 0.2 * (rows * cols) ** 0.5 / o_hat_norm
    return decayed_step(w, step, h["lr"], h["weight_decay"], h["cautious_weight_decay"])


def soap_muon_step(w: Tensor, g: Tensor, state: dict[str, Any], h: dict[str, Any]) -> Tensor:
    """Track 3's SOAP-Muon (records #14 / #44): SOAP in the eigenbasis, then Muon."""
    u = momentum_update(g, state, h["momentum"], h["nesterov"])
    if "q_left" in state:
        rotated = state["q_left"].T @ u @ state["q_right"]
        state["v"] = h["beta2"] * state["v"] + (1 - h["beta2"]) * rotated * rotated
        scaled = rotated.clone()
        for i in range(rotated.shape[0]):
            for j in range(rotated.shape[1]):
                scaled[i, j] = rotated[i, j] / max(float(state["v"][i, j]) ** 0.5, h["eps"])
        u = state["q_left"] @ scaled @ state["q_right"].T
    o = newton_schulz(u, h["ns_coefficients"], h["ns_steps"]) * shape_scale(w)
    new = decayed_step(w, o, h["lr"], h["weight_decay"], h["cautious_weight_decay"])
    update_soap_factors(g, state, h)
    return new


def update_soap_factors(g: Tensor, state: dict[str, Any], h: dict[str, Any]) -> None:
    b = h["shampoo_beta"]
    state["L"] = b * state.get("L", torch.zeros(g.shape[0], g.shape[0], dtype=g.dtype)) + (
        1 - b
    ) * (g @ g.T)
    state["R"] = b * state.get("R", torch.zeros(g.shape[1], g.shape[1], dtype=g.dtype)) + (
        1 - b
    ) * (g.T @ g)
    t = state.get("t", 0)
    if t == 0:
        state["q_left"] = torch.linalg.eigh(state["L"]).eigenvectors.flip(-1)
        state["q_right"] = torch.linalg.eigh(state["R"]).eigenvectors.flip(-1)
        state["v"] = torch.zeros_like(g)
    elif t % h["precondition_frequency"] == 0:
        for side, factor in (("q_left", state["L"]), ("q_right", state["R"])):
            q = state[side]
            estimates = [float(q[:, k] @ factor @ q[:, k]) for k in range(q.shape[1])]
            order = sorted(range(q.shape[1]), key=lambda k: -estimates[k])
            q = q[:, order]
            state["v"] = state["v"][order, :] if side == "q_left" else state["v"][:, order]
            state[side] = torch.linalg.qr(factor @ q).Q
    state["t"] = t + 1


def random_problem(
    shapes: list[tuple[int, int]], steps: int, seed: int = 0
) -> tuple[list[Tensor], list[list[Tensor]]]:
    """Float64 initial weights and ``steps`` gradients per weight (drawn, not from a loss)."""
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]
    grads = [
        [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]
        for _ in range(steps)
    ]
    return weights, grads


def run_reference(
    step, weights: list[Tensor], grads: list[list[Tensor]], h: dict[str, Any]
) -> list[Tensor]:
    """The weights after every step of ``step`` (a ``*_step`` above), one matrix at a time."""
    states: list[dict[str, Any]] = [{} for _ in weights]
    current = [w.clone() for w in weights]
    for step_grads in grads:
        current = [step(w, g, s, h) for w, g, s in zip(current, step_grads, states)]
    return current


def run_optimizer(
    optimizer_class,
    weights: list[Tensor],
    grads: list[list[Tensor]],
    h: dict[str, Any],
    dtype: torch.dtype,
) -> list[Tensor]:
    """The weights after ``optimizer_class(**h)`` took every step, in ``dtype``."""
    params = [torch.nn.Parameter(w.to(dtype, copy=True)) for w in weights]
    optimizer = optimizer_class(params, **h)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(dtype)
        optimizer.step()
    return [p.detach().to(torch.float64) for p in params]


def run_with_resume(
    optimizer_class,
    weights: list[Tensor],
    grads: list[list[Tensor]],
    h: dict[str, Any],
    resume_at: int,
) -> list[Tensor]:
    """``run_optimizer`` in float32, but saved after ``resume_at`` steps (``torch.save``, loaded
    with ``weights_only=True``) and finished by a new optimizer built with other defaults."""
    params = [torch.nn.Parameter(w.float()) for w in weights]
    first = optimizer_class(params, **h)
    for step_grads in grads[:resume_at]:
        for p, g in zip(params, step_grads):
            p.grad = g.float()
        first.step()
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "optim": first.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_params = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
    resumed = optimizer_class(resumed_params, lr=1.0)  # the loaded groups bring back h
    resumed.load_state_dict(saved["optim"])
    for step_grads in grads[resume_at:]:
        for p, g in zip(resumed_params, step_grads):
            p.grad = g.float()
        resumed.step()
    return [p.detach().to(torch.float64) for p in resumed_params]


def least_squares_loss(w: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``||A W - B||_F^2 / rows``: the tiny problem every optimizer must make progress on."""
    return ((a @ w - b) ** 2).sum() / a.shape[0]


def train_least_squares(
    optimizer_class, h: dict[str, Any], steps: int, shape: tuple[int, int] = (12, 8)
) -> tuple[float, float]:
    """(initial, final) float32 full-batch loss of ``A W = B`` from ``W = 0``, training on
    minibatches of 16 of its 64 rows, ``h["lr"]`` decayed linearly to 0 over ``steps``."""
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(64, shape[0], generator=generator) / 8**0.5
    b = a @ torch.randn(shape, generator=generator)
    w = torch.nn.Parameter(torch.zeros(shape))
    optimizer = optimizer_class([w], **h)
    initial = float(least_squares_loss(w.detach(), a, b))
    for step in range(steps):
        # A fixed-norm (orthogonalized) step needs the decay to settle.
        for group in optimizer.param_groups:
            group["lr"] = h["lr"] * (1 - step / steps)
        rows = torch.randint(0, 64, (16,), generator=generator)
        optimizer.zero_grad()
        least_squares_loss(w, a[rows], b[rows]).backward()
        optimizer.step()
    return initial, float(least_squares_loss(w.detach(), a, b))
