"""The ``kl-shampoo`` setup: its block-matrix steps against a float64 loop of KL-Shampoo with
Adam grafting and decoupled weight decay; bad values name the field; a short run trains."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from trainer_test import tiny_config

from nanoshampoo.testing.shampoo_reference import ReferenceShampoo
from nanoshampoo.train.config import TrainConfig
from nanoshampoo.train.setups import BuildContext
from nanoshampoo.train.setups.shampoo_family import build_matrix_optimizer
from nanoshampoo.train.trainer import Trainer

HP = {
    "kl_shampoo.lr": 0.01,
    "kl_shampoo.beta1": 0.9,
    "kl_shampoo.beta2": 0.95,
    "kl_shampoo.weight_decay": 0.2,
    "kl_shampoo.epsilon": 1e-12,
    "kl_shampoo.precondition_frequency": 2,
    "kl_shampoo.inverse_exponent": 0.5,
    "kl_shampoo.grafting_beta2": 0.95,
    "kl_shampoo.grafting_epsilon": 1e-10,
}
# Below the block's 30 entries: the (6, 5) block stays a matrix (not merged into one dim).
BLOCK = {"preconditioner.max_preconditioner_dim": 8}


pytestmark = pytest.mark.usefixtures("one_thread")


def kl_shampoo_grafted_float64(
    w0: np.ndarray, grads: list[np.ndarray], kl: bool = True
) -> np.ndarray:
    """``W`` after the steps: ``P_s = X_L Gbar X_R`` (KL factors, ``ReferenceShampoo``), Adam's
    ``P_g = Gbar / (sqrt(v / (1 - b2g^t)) + eps_g)`` with ``v`` the EMA of ``G^2``;
    ``P = P_g`` before the first root (step ``f``), ``P_s ||P_g|| / ||P_s||`` from it;
    ``W <- W - lr (P + wd W)``; ``kl=False``: classic Shampoo's factors."""
    h = {k.split(".")[1]: v for k, v in HP.items()}
    f, b2g = h["precondition_frequency"], h["grafting_beta2"]
    shampoo = ReferenceShampoo(
        w0.shape,
        exponents=[h["inverse_exponent"]] * 2,
        lr=1.0,
        betas=(h["beta1"], h["beta2"]),
        epsilon=h["epsilon"],
        frequency=f,
        start=f,
        kl=kl,
    )
    w, v, m = w0.copy(), np.zeros_like(w0), np.zeros_like(w0)
    for t, g in enumerate(grads, start=1):
        p_s = -shampoo.step(t, np.zeros_like(w0), g)  # lr 1 from W = 0: the direction
        m = h["beta1"] * m + (1 - h["beta1"]) * g
        v = b2g * v + (1 - b2g) * g * g
        p_g = m / (1 - h["beta1"] ** t) / (np.sqrt(v / (1 - b2g**t)) + h["grafting_epsilon"])
        p = p_g if t < f else p_s * np.linalg.norm(p_g) / np.linalg.norm(p_s)
        w = w - h["lr"] * (p + h["weight_decay"] * w)
    return w


def test_the_matrix_steps_are_kl_shampoos_grafted_onto_adam() -> None:
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(6, 5, generator=generator))
    w0 = param.detach().double().numpy().copy()
    optimizer = build_matrix_optimizer(
        BuildContext({"matrix": [param]}, TrainConfig(optimizer="kl-shampoo", **HP, **BLOCK), 1)
    )
    grads = [torch.randn(6, 5, generator=generator) for _ in range(8)]
    for g in grads:
        param.grad = g.clone()
        optimizer.step()
    want = kl_shampoo_grafted_float64(w0, [g.double().numpy() for g in grads])
    got = param.detach().double().numpy()
    assert np.linalg.norm(got - want) / np.linalg.norm(want - w0) < 1e-4
    # Not classic Shampoo: the same steps with the factors updated from G alone differ.
    plain = kl_shampoo_grafted_float64(w0, [g.double().numpy() for g in grads], kl=False)
    assert np.linalg.norm(got - plain) / np.linalg.norm(plain - w0) > 1e-2


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("beta2", 0.0, r"kl_shampoo\.beta2 \(--kl_shampoo\.beta2\) must be in \(0, 1\)"),
        ("inverse_exponent", 0.0, r"kl_shampoo\.inverse_exponent .* must be in \(0, 1\]"),
        ("epsilon", 0.0, r"kl_shampoo\.epsilon .* must be finite and > 0"),
        ("precondition_frequency", 0, r"kl_shampoo\.precondition_frequency .* must be an int >= 1"),
    ],
)
def test_bad_kl_shampoo_values_are_refused_naming_the_field(
    field: str, value: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(optimizer="kl-shampoo", **{f"kl_shampoo.{field}": value})


def test_a_start_before_the_first_root_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"preconditioner\.start_preconditioning_step .*=2\. Must be >= "
        r"param_group\[PRECONDITION_FREQUENCY\]=5\.",
    ):
        TrainConfig(optimizer="kl-shampoo", **{"preconditioner.start_preconditioning_step": 2})


def test_a_short_kl_shampoo_run_lowers_the_loss(shards: dict[str, str], tmp_path: Path) -> None:
    result = Trainer(
        tiny_config(shards, tmp_path, optimizer="kl-shampoo", num_iterations=8, val_every=8)
    ).run()
    assert result.final_val_loss < np.log(64) - 0.3
