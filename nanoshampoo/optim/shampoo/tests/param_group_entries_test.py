"""Param groups as the reference library writes them: sentinels resolved into the group once,
warnings for entries without effect, empty groups, and the key names ``shampoo_types`` exports."""

from __future__ import annotations

import logging

import pytest
import torch

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DefaultSignDescentPreconditionerConfig,
    DefaultSpectralDescentPreconditionerConfig,
    DistributedShampoo,
    SingleDeviceDistributedConfig,
    shampoo_types,
)

torch.set_num_threads(1)


def _weight(seed: int = 0) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(6, 5, generator=torch.Generator().manual_seed(seed)))


def test_sentinels_are_written_back_into_the_group_when_it_is_added() -> None:
    opt = DistributedShampoo(
        [{"params": [_weight()]}, {"params": [_weight(1)], "betas": (0.5, 0.99), "beta3": 0.7}],
        betas=(0.9, 0.999),
        precondition_frequency=4,
        epsilon=1e-8,
    )
    resolved = [(g["beta3"], g["start_preconditioning_step"]) for g in opt.param_groups]
    assert resolved == [(0.9, 4), (0.7, 4)]
    saved = opt.state_dict()["param_groups"]
    assert [(g["beta3"], g["start_preconditioning_step"]) for g in saved] == resolved


def test_a_sentinel_resolved_at_construction_does_not_follow_a_later_betas_change() -> None:
    """Resolved once, as in the reference: beta3 keeps betas[0]'s value at construction."""
    w = _weight()
    opt = DistributedShampoo([w], betas=(0.9, 1.0), epsilon=1e-8)
    opt.param_groups[0]["betas"] = (0.5, 1.0)
    w.grad = torch.ones_like(w)
    opt.step()
    assert opt.param_groups[0]["beta3"] == 0.9
    assert opt._runtimes[0].hyperparameters.beta3 == 0.9


@pytest.mark.parametrize(
    ("config", "name"),
    [
        (DefaultSignDescentPreconditionerConfig, "SignDescentPreconditionerConfig"),
        (DefaultSpectralDescentPreconditionerConfig, "SpectralDescentPreconditionerConfig"),
    ],
)
def test_stateless_descents_warn_about_entries_without_effect(
    config: object, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        opt = DistributedShampoo(
            [_weight()],
            betas=(0.9, 0.999),
            epsilon=1e-8,
            precondition_frequency=100,
            preconditioner_config=config,
            distributed_config=SingleDeviceDistributedConfig(target_parameter_dimensionality=2),
        )
    messages = [record.msg for record in caplog.records]  # preformatted: no %-template args
    assert messages == [
        f"param_group[BETAS][1]=0.999 does not have any effect when {name} is used.",
        f"param_group[EPSILON]=1e-08 does not have any effect when {name} is used.",
        f"param_group[PRECONDITION_FREQUENCY]=100 does not have any effect when {name} is used. "
        "Setting precondition_frequency to 1...",
    ]
    group = opt.param_groups[0]
    assert (group["precondition_frequency"], group["start_preconditioning_step"]) == (1, 1)


def test_spectral_descent_names_the_dimensionality_it_overrides(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        DistributedShampoo(
            [_weight()],
            epsilon=1e-8,
            preconditioner_config=DefaultSpectralDescentPreconditionerConfig,
            distributed_config=SingleDeviceDistributedConfig(target_parameter_dimensionality=1),
        )
    assert any(
        record.msg.startswith(
            "param_group[DISTRIBUTED_CONFIG].target_parameter_dimensionality=1 is not equal to 2."
        )
        for record in caplog.records
    )


def test_root_inverse_shampoo_logs_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        DistributedShampoo([_weight()], epsilon=1e-8, grafting_config=AdamPreconditionerConfig())
    assert caplog.records == []


def test_empty_param_groups_are_accepted_and_step_like_the_group_alone() -> None:
    alone, beside_empty = _weight(), _weight()
    optimizers = [
        DistributedShampoo([alone], lr=0.1, epsilon=1e-8),
        DistributedShampoo(
            [{"params": []}, {"params": [beside_empty]}, {"params": []}], lr=0.1, epsilon=1e-8
        ),
    ]
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        grad = torch.randn(6, 5, generator=gen)
        for w, opt in zip((alone, beside_empty), optimizers):
            w.grad = grad.clone()
            opt.step()
    assert torch.equal(alone, beside_empty) and not torch.equal(alone, _weight())
    assert [len(g["params"]) for g in optimizers[1].param_groups] == [0, 1, 0]


def test_shampoo_types_exports_the_reference_key_names() -> None:
    names = {
        name: getattr(shampoo_types, name)
        for name in ("STEP", "LR_SUM", "TRAIN_MODE", "PARAMS", "DISTRIBUTED_CONFIG")
    }
    assert names == {
        "STEP": "step",
        "LR_SUM": "lr_sum",
        "TRAIN_MODE": "train_mode",
        "PARAMS": "params",
        "DISTRIBUTED_CONFIG": "distributed_config",
    }
    assert set(names) <= set(shampoo_types.__all__)
