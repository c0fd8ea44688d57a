"""Iterate averaging (``iterate_averaging_config``): classic momentum, GPA and Schedule-Free.

References, written the slow obvious way:

- classic momentum: ``torch.optim.SGD`` (``dampening = 0``) and a float64 loop of
  ``M <- mu M + (1 - d) P`` (``dampening > 0``, where torch starts ``M`` at ``G``, not at 0);
- GPA and Schedule-Free: a float64 loop over the three sequences of the papers (arXiv 2512.17131;
  Defazio et al. 2024, arXiv 2405.15682) with the gradient taken at ``y`` by autograd::

      z_{t+1} = z_t - lr_t P(y_t)
      x_{t+1} = mu_x x_t + (1 - mu_x) z_{t+1},  Schedule-Free: mu_x = 1 - lr_t^r / sum_{i<=t} lr_i^r
      y_{t+1} = mu_y x_{t+1} + (1 - mu_y) z_{t+1}

  Decoupled decay under primal averaging (as the reference library defines it): ``z`` shrinks by
  ``1 - lr wd`` before the step while ``y`` (the parameters) stays, so ``x`` is re-read from
  ``y`` and the shrunk ``z``.

The optimizer runs in float32 on a small MLP at epsilon 1e-12 (the settings users run).
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from flat_shampoo_state import flat_state

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    ClassicMomentumConfig,
    DistributedShampoo,
    GeneralizedPrimalAveragingConfig,
    IterateAveragingConfig,
    ScheduleFreeConfig,
    SGDPreconditionerConfig,
    UnsupportedConfigError,
    WeightDecayType,
)
from nanoshampoo.optim.shampoo.config_checks import error_field
from nanoshampoo.optim.shampoo.iterate_averaging import interp_coeffs

STEPS = 6
RTOL, ATOL = 2e-5, 1e-6


def _data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 6, generator=generator).to(dtype), torch.randn(
        16, 3, generator=generator
    ).to(dtype)


def initial_params(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """An MLP 6 -> 5 -> 3: ``[W1 (5, 6), b1 (5,), W2 (3, 5), b2 (3,)]``."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(5, 6), (5,), (3, 5), (3,)]
    return [(0.5 * torch.randn(shape, generator=generator)).to(dtype) for shape in shapes]


def loss_of(params: Sequence[torch.Tensor]) -> torch.Tensor:
    x, target = _data(params[0].dtype)
    w1, b1, w2, b2 = params
    return torch.nn.functional.mse_loss(torch.tanh(x @ w1.T + b1) @ w2.T + b2, target)


def grads_at(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    leaves = [p.detach().clone().requires_grad_(True) for p in params]
    return list(torch.autograd.grad(loss_of(leaves), leaves))


def run_shampoo(
    steps: int,
    lrs: Sequence[float] | None = None,
    params: list[torch.Tensor] | None = None,
    optimizer: DistributedShampoo | None = None,
    **settings: Any,
) -> tuple[list[torch.Tensor], DistributedShampoo]:
    params = params or [torch.nn.Parameter(p) for p in initial_params()]
    optimizer = optimizer or DistributedShampoo(params, **{"epsilon": 1e-12, **settings})
    for t in range(steps):
        if lrs is not None:
            optimizer.param_groups[0]["lr"] = lrs[t]
        optimizer.zero_grad()
        loss_of(params).backward()
        optimizer.step()
    return params, optimizer


# ------------------------------------------------------------------------------------------
# Configs
# ------------------------------------------------------------------------------------------


def test_defaults_follow_the_reference_library() -> None:
    assert ClassicMomentumConfig() == ClassicMomentumConfig(
        momentum=0.5, dampening=0.0, use_nesterov=False
    )
    gpa = GeneralizedPrimalAveragingConfig()
    assert (gpa.eval_interp_coeff, gpa.train_interp_coeff) == (0.9, 0.8)
    schedule_free = ScheduleFreeConfig()
    assert (schedule_free.train_interp_coeff, schedule_free.eval_coeff_lr_power) == (0.8, 2)
    with pytest.raises(TypeError):
        IterateAveragingConfig()
    for config in (ClassicMomentumConfig(), gpa, schedule_free):
        assert isinstance(config, IterateAveragingConfig)


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: ClassicMomentumConfig(momentum=0.0), "momentum"),
        (lambda: ClassicMomentumConfig(momentum=1.0), "momentum"),
        (lambda: ClassicMomentumConfig(dampening=1.0), "dampening"),
        (lambda: ClassicMomentumConfig(dampening=-0.1), "dampening"),
        (lambda: ClassicMomentumConfig(use_nesterov=1), "use_nesterov"),
        (lambda: GeneralizedPrimalAveragingConfig(eval_interp_coeff=1.0), "eval_interp_coeff"),
        (lambda: GeneralizedPrimalAveragingConfig(eval_interp_coeff=-0.1), "eval_interp_coeff"),
        (lambda: GeneralizedPrimalAveragingConfig(train_interp_coeff=0.0), "train_interp_coeff"),
        (lambda: GeneralizedPrimalAveragingConfig(train_interp_coeff=1.5), "train_interp_coeff"),
        (lambda: ScheduleFreeConfig(train_interp_coeff=0.0), "train_interp_coeff"),
        (lambda: ScheduleFreeConfig(eval_coeff_lr_power=-1), "eval_coeff_lr_power"),
        (lambda: ScheduleFreeConfig(eval_coeff_lr_power=math.inf), "eval_coeff_lr_power"),
        (lambda: ScheduleFreeConfig(eval_coeff_lr_power=True), "eval_coeff_lr_power"),
    ],
)
def test_invalid_config_raises_naming_the_field(make: Callable[[], Any], field: str) -> None:
    with pytest.raises(ValueError) as info:
        make()
    assert re.match(field, error_field(info.value)), str(info.value)


def test_the_optimizer_refuses_a_bad_iterate_averaging_config_or_both_momentum_forms() -> None:
    params = [torch.nn.Parameter(p) for p in initial_params()]
    with pytest.raises(
        ValueError, match=r"^group\[ITERATE_AVERAGING_CONFIG\]=.* is not supported!"
    ):
        DistributedShampoo(params, iterate_averaging_config=SGDPreconditionerConfig())

    @dataclass(kw_only=True)
    class TailAveragingConfig(IterateAveragingConfig):
        window: int = 10

    with pytest.raises(
        UnsupportedConfigError, match=r"^group\[ITERATE_AVERAGING_CONFIG\]=.* is not supported!"
    ):
        DistributedShampoo(params, iterate_averaging_config=TailAveragingConfig())
    assert issubclass(UnsupportedConfigError, NotImplementedError)
    with pytest.raises(ValueError, match="^momentum .*ClassicMomentumConfig"):
        DistributedShampoo(params, momentum=0.9, iterate_averaging_config=ClassicMomentumConfig())


# ------------------------------------------------------------------------------------------
# Classic momentum
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize(
    "where",
    ["preconditioner", "grafting"],
    ids=["sgd_preconditioner", "shampoo_before_start_sgd_grafting"],
)
def test_classic_momentum_matches_torch_sgd(nesterov: bool, where: str) -> None:
    """SGD as the preconditioner, or as grafting before Shampoo's start step, with
    ``betas[0] = 0``: the search direction is ``G + wd W``, as in ``torch.optim.SGD``."""
    kind = (
        dict(preconditioner_config=SGDPreconditionerConfig())
        if where == "preconditioner"
        else dict(grafting_config=SGDPreconditionerConfig(), precondition_frequency=100)
    )
    ours, _ = run_shampoo(
        STEPS,
        lr=0.05,
        betas=(0.0, 0.999),
        weight_decay=1e-3,
        iterate_averaging_config=ClassicMomentumConfig(momentum=0.9, use_nesterov=nesterov),
        **kind,
    )
    theirs = [torch.nn.Parameter(p) for p in initial_params()]
    sgd = torch.optim.SGD(theirs, lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=1e-3)
    for _ in range(STEPS):
        sgd.zero_grad()
        loss_of(theirs).backward()
        sgd.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("nesterov", [False, True])
def test_classic_momentum_with_dampening_matches_a_float64_loop(nesterov: bool) -> None:
    mu, d, lr = 0.8, 0.3, 0.05
    ours, _ = run_shampoo(
        STEPS,
        lr=lr,
        betas=(0.0, 1.0),
        preconditioner_config=SGDPreconditionerConfig(),
        iterate_averaging_config=ClassicMomentumConfig(
            momentum=mu, dampening=d, use_nesterov=nesterov
        ),
    )
    w = initial_params(torch.float64)
    m = [torch.zeros_like(p) for p in w]
    for _ in range(STEPS):
        for i, g in enumerate(grads_at(w)):
            m[i] = mu * m[i] + (1 - d) * g
            step = (1 - d) * g + mu * m[i] if nesterov else m[i]
            w[i] = w[i] - lr * step
    for a, b in zip(ours, w):
        torch.testing.assert_close(a.detach().double(), b, rtol=RTOL, atol=ATOL)


def test_deprecated_momentum_arguments_warn_and_take_the_classic_momentum_step() -> None:
    settings = dict(
        lr=0.02, betas=(0.9, 0.99), grafting_config=AdamPreconditionerConfig(), weight_decay=0.01
    )
    with pytest.warns(DeprecationWarning, match="ClassicMomentumConfig"):
        legacy, _ = run_shampoo(STEPS, momentum=0.9, dampening=0.1, **settings)
    config = ClassicMomentumConfig(momentum=0.9, dampening=0.1)
    current, optimizer = run_shampoo(STEPS, iterate_averaging_config=config, **settings)
    for a, b in zip(legacy, current):
        assert torch.equal(a, b)
    assert "block_0.momentum_buffer" in flat_state(optimizer.state_dict())[0]
    with pytest.warns(DeprecationWarning, match="ClassicMomentumConfig"):
        DistributedShampoo([{"params": [torch.nn.Parameter(torch.zeros(3))], "momentum": 0.5}])


# ------------------------------------------------------------------------------------------
# GPA and Schedule-Free against the papers' sequences
# ------------------------------------------------------------------------------------------


def primal_averaging_reference(
    config: GeneralizedPrimalAveragingConfig | ScheduleFreeConfig,
    lrs: Sequence[float],
    direction: Callable[[int, list[torch.Tensor]], list[torch.Tensor]],
    weight_decay: float = 0.0,
    decay_per_lr: Callable[[float], float] = lambda lr: 1.0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Float64 ``(y, x)`` after ``len(lrs)`` steps; ``direction(t, grads)`` is ``P``; ``z``
    shrinks by ``1 - lr wd decay_per_lr(lr)`` (``CORRECTED``: ``lr / peak_lr``)."""
    mu_y = config.train_interp_coeff
    z = initial_params(torch.float64)
    x = [p.clone() for p in z]
    y = [p.clone() for p in z]
    weights: list[float] = []
    for t, lr in enumerate(lrs, start=1):
        if isinstance(config, ScheduleFreeConfig):
            weights.append(lr**config.eval_coeff_lr_power)
            mu_x = 1.0 - weights[-1] / sum(weights) if sum(weights) > 0 else 1.0
        else:
            mu_x = config.eval_interp_coeff
        p = direction(t, grads_at(y))
        for i in range(len(z)):
            z[i] = (1.0 - lr * weight_decay * decay_per_lr(lr)) * z[i]
            x[i] = (y[i] - (1.0 - mu_y) * z[i]) / mu_y
            z[i] = z[i] - lr * p[i]
            x[i] = mu_x * x[i] + (1.0 - mu_x) * z[i]
            y[i] = mu_y * x[i] + (1.0 - mu_y) * z[i]
    return y, x


def sgd_direction(t: int, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return grads


class AdamDirection:
    """Float64 ``Mhat / (sqrt(Vhat) + eps)``: the filtered gradient through diagonal Adam."""

    def __init__(self, beta1: float, beta2: float, epsilon: float) -> None:
        self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon
        self.m: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def __call__(self, t: int, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.m:
            self.m = [torch.zeros_like(g) for g in grads]
            self.v = [torch.zeros_like(g) for g in grads]
        out = []
        for i, g in enumerate(grads):
            self.m[i] = self.beta1 * self.m[i] + (1 - self.beta1) * g
            self.v[i] = self.beta2 * self.v[i] + (1 - self.beta2) * g * g
            m_hat, v_hat = self.m[i] / (1 - self.beta1**t), self.v[i] / (1 - self.beta2**t)
            out.append(m_hat / (v_hat.sqrt() + self.epsilon))
        return out


ADAM = dict(
    betas=(0.9, 0.99), preconditioner_config=AdamPreconditionerConfig(beta2=0.99, epsilon=1e-8)
)
SGD = dict(betas=(0.0, 1.0), preconditioner_config=SGDPreconditionerConfig())
WARMUP_LRS = [0.01, 0.02, 0.04, 0.04, 0.03, 0.01]

CASES = {
    "gpa_sgd": (
        GeneralizedPrimalAveragingConfig(eval_interp_coeff=0.9, train_interp_coeff=0.8),
        SGD,
        0.0,
    ),
    "gpa_heavy_ball_adam_decay": (
        GeneralizedPrimalAveragingConfig(eval_interp_coeff=0.7, train_interp_coeff=1.0),
        ADAM,
        0.1,
    ),
    "schedule_free_sgd": (ScheduleFreeConfig(train_interp_coeff=0.9), SGD, 0.0),
    "schedule_free_adam_decay_power_1": (
        ScheduleFreeConfig(train_interp_coeff=0.8, eval_coeff_lr_power=1),
        ADAM,
        0.1,
    ),
}


def test_corrected_decay_under_schedule_free_shrinks_z_by_lr_squared_over_peak_lr() -> None:
    config = ScheduleFreeConfig(train_interp_coeff=0.8)
    ours, _ = run_shampoo(
        STEPS,
        lrs=WARMUP_LRS,
        lr=0.04,
        iterate_averaging_config=config,
        weight_decay=0.5,
        weight_decay_type=WeightDecayType.CORRECTED,
        **ADAM,
    )
    direction = AdamDirection(0.9, 0.99, 1e-8)
    y, _ = primal_averaging_reference(config, WARMUP_LRS, direction, 0.5, lambda lr: lr / 0.04)
    for a, b in zip(ours, y):
        torch.testing.assert_close(a.detach().double(), b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", list(CASES))
def test_primal_averaging_follows_the_papers_sequences(name: str) -> None:
    """After each step the parameters are ``y``; after ``eval()`` they are ``x``."""
    config, kind, wd = CASES[name]
    ours, optimizer = run_shampoo(
        STEPS, lrs=WARMUP_LRS, iterate_averaging_config=config, weight_decay=wd, **kind
    )
    direction = sgd_direction if kind is SGD else AdamDirection(0.9, 0.99, 1e-8)
    y, x = primal_averaging_reference(config, WARMUP_LRS, direction, wd)
    for a, b in zip(ours, y):
        torch.testing.assert_close(a.detach().double(), b, rtol=RTOL, atol=ATOL)
    optimizer.eval()
    for a, b in zip(ours, x):
        torch.testing.assert_close(a.detach().double(), b, rtol=RTOL, atol=ATOL)


def test_gpa_heavy_ball_at_lr_over_one_minus_mu_is_sgd_momentum() -> None:
    """``mu_y = 1``, ``lr = lr_sgd / (1 - mu)``: the steps of ``torch.optim.SGD(lr_sgd, mu)``."""
    config = GeneralizedPrimalAveragingConfig(eval_interp_coeff=0.9, train_interp_coeff=1.0)
    ours, _ = run_shampoo(STEPS, lr=0.05 / (1 - 0.9), iterate_averaging_config=config, **SGD)
    theirs = [torch.nn.Parameter(p) for p in initial_params()]
    sgd = torch.optim.SGD(theirs, lr=0.05, momentum=0.9)
    for _ in range(STEPS):
        sgd.zero_grad()
        loss_of(theirs).backward()
        sgd.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_schedule_free_with_a_zero_lr_warmup_start_stays_finite() -> None:
    """lr 0 at the first steps: nothing enters the average (no 0/0), then the average starts."""
    lrs = [0.0, 0.0, 0.02, 0.02, 0.01, 0.01]
    config = ScheduleFreeConfig(train_interp_coeff=0.9)
    ours, optimizer = run_shampoo(STEPS, lrs=lrs, iterate_averaging_config=config, **ADAM)
    y, _ = primal_averaging_reference(config, lrs, AdamDirection(0.9, 0.99, 1e-8))
    for a, b in zip(ours, y):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.detach().double(), b, rtol=RTOL, atol=ATOL)
    assert optimizer.state_dict()["state"][0]["lr_sum"].item() == pytest.approx(
        2 * 0.02**2 + 2 * 0.01**2
    )


@pytest.mark.parametrize(
    "config",
    [
        ScheduleFreeConfig(train_interp_coeff=0.9),
        GeneralizedPrimalAveragingConfig(),
        ClassicMomentumConfig(momentum=0.9),
    ],
    ids=["schedule_free", "gpa", "classic"],
)
def test_root_inverse_shampoo_on_rank_one_gradients_stays_finite(
    config: IterateAveragingConfig,
) -> None:
    """float32, epsilon 1e-12, Shampoo preconditioning from step 2 on rank-1 gradients (one
    sample per step: every factor matrix rank-deficient): 20 steps, then eval(), all finite."""
    params = [torch.nn.Parameter(p) for p in initial_params()]
    optimizer = DistributedShampoo(
        params,
        lr=0.01,
        betas=(0.9, 0.999),
        epsilon=1e-12,
        precondition_frequency=2,
        grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
        iterate_averaging_config=config,
    )
    x, target = _data(torch.float32)
    for step in range(20):
        optimizer.zero_grad()
        w1, b1, w2, b2 = params
        sample = slice(step % 16, step % 16 + 1)
        prediction = torch.tanh(x[sample] @ w1.T + b1) @ w2.T + b2
        torch.nn.functional.mse_loss(prediction, target[sample]).backward()
        optimizer.step()
        assert all(torch.isfinite(p).all() for p in params)
    optimizer.eval()
    assert all(torch.isfinite(p).all() for p in params)
    assert not torch.equal(params[0].detach(), initial_params()[0])


# ------------------------------------------------------------------------------------------
# Schedule-Free's sum of lr^r in a state dict
# ------------------------------------------------------------------------------------------


def _trainer_schedule(steps: int, lr: float = 0.006, cooldown_frac: float = 0.7) -> list[float]:
    """The trainer's lr schedule at the schedule-free setup's lr: constant, then a linear
    cooldown to 0 over the last ``cooldown_frac`` of the steps."""
    start = steps * (1.0 - cooldown_frac)
    return [lr * min(1.0, (steps - t) / (steps - start)) for t in range(steps)]


def test_the_sum_of_lr_powers_is_kept_in_float64_because_a_float32_sum_drifts() -> None:
    """Over 3,000 steps of the trainer's schedule (r = 2), ``1 - mu_x = lr^r / sum`` from a
    float32 running sum (the reference's) is off by more than 1e-6 relative; ours stays within
    1e-12 of the exact sum (``math.fsum``). This is why ``lr_sum`` is summed in float64 and a
    state dict carries the float64 value beside the reference's float32 one."""
    config = ScheduleFreeConfig(eval_coeff_lr_power=2.0)
    ours, as_float32, exact_terms = 0.0, torch.zeros((), dtype=torch.float32), []
    worst_ours, worst_float32 = 0.0, 0.0
    for lr in _trainer_schedule(3000):
        weight = lr**2
        exact_terms.append(weight)
        if weight == 0.0:
            continue
        _, _, ours = interp_coeffs(config, lr, ours)  # the sum that mu_x = 1 - lr^r / sum uses
        as_float32 += weight
        exact = weight / math.fsum(exact_terms)
        worst_ours = max(worst_ours, abs(weight / ours / exact - 1.0))
        worst_float32 = max(worst_float32, abs(weight / float(as_float32) / exact - 1.0))
    assert worst_ours < 1e-12
    assert worst_float32 > 1e-6


def test_lr_sum_is_saved_as_the_references_float32_and_a_resume_continues_bit_for_bit() -> None:
    """``lr_sum`` is a float32 tensor, as the reference's; the group carries the float64 sum
    (``lr_sum_float64``: here 3 x 0.01^2 in float64, which float32 does not hold), so a
    save / ``weights_only`` load / 2 more steps equal 5 steps, bit for bit."""
    settings: dict[str, Any] = {
        "lr": 0.01,
        "iterate_averaging_config": ScheduleFreeConfig(train_interp_coeff=0.9),
        **ADAM,
    }
    straight, _ = run_shampoo(5, **settings)
    params, optimizer = run_shampoo(3, **settings)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    lr_sum = saved["state"][0]["lr_sum"]
    assert lr_sum.dtype == torch.float32 and optimizer.state[params[0]]["lr_sum"] is not lr_sum
    assert saved["param_groups"][0]["lr_sum_float64"] == 0.01**2 + 0.01**2 + 0.01**2
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = DistributedShampoo(resumed, **{"epsilon": 1e-12, **settings})
    fresh.load_state_dict(saved)
    assert "lr_sum_float64" not in fresh.param_groups[0]
    run_shampoo(2, params=resumed, optimizer=fresh)
    for got, want in zip(resumed, straight, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("lr", [0.5, 0.01])
def test_a_float64_sum_beside_another_lr_sum_is_ignored(lr: float) -> None:
    """The float64 sum is used only while it rounds to the saved ``lr_sum``: a dict whose
    ``lr_sum`` was written since (or that another library saved back) loads its ``lr_sum``. At
    lr 0.5 the sum is exact in float32 and the group carries none."""
    settings: dict[str, Any] = {
        "lr": lr,
        "iterate_averaging_config": ScheduleFreeConfig(train_interp_coeff=0.9),
        **ADAM,
    }
    _, optimizer = run_shampoo(2, **settings)
    saved = optimizer.state_dict()
    assert ("lr_sum_float64" in saved["param_groups"][0]) == (lr == 0.01)
    saved["param_groups"][0]["lr_sum_float64"] = 0.75 + 1e-12
    for entry in saved["state"].values():
        entry["lr_sum"] = torch.tensor(0.25)
    params, fresh = run_shampoo(0, **settings)
    fresh.load_state_dict(saved)
    assert fresh.state[params[0]]["lr_sum"].item() == 0.25
    assert "lr_sum_float64" not in fresh.state_dict()["param_groups"][0]  # the sum is 0.25
