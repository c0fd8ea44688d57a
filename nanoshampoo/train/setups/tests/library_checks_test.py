"""The Shampoo-family setups ask the optimizer's configs to validate: a bad value is refused by
the library's rule, held once, and the message names the trainer's field and flag too."""

from __future__ import annotations

import re

import pytest
import torch

from nanoshampoo.optim.shampoo import UnsupportedConfigError, group_validation
from nanoshampoo.optim.shampoo.preconditioner import preconditioner_types
from nanoshampoo.train.config import TrainConfig
from nanoshampoo.train.setups import BuildContext
from nanoshampoo.train.setups.library_checks import check_shampoo_group, with_trainer_label
from nanoshampoo.train.setups.shampoo_family import (
    PreconditionerConfig,
    ShampooConfig,
    build_matrix_optimizer,
)

GRAFTING_BF16_SLOW_EMA = {"shampoo.grafting_dtype": "bfloat16", "shampoo.grafting_beta2": 0.999}
EARLY_FIRST_ROOT = {
    "preconditioner.start_preconditioning_step": 2,
    "shampoo.precondition_frequency": 5,
}


@pytest.mark.parametrize(
    "overrides, trainer, library",
    [
        (
            GRAFTING_BF16_SLOW_EMA,
            "shampoo.grafting_dtype (--shampoo.grafting-dtype)",
            "AdamPreconditionerConfig.second_moment_dtype torch.bfloat16 cannot hold this EMA",
        ),
        (
            EARLY_FIRST_ROOT,
            "preconditioner.start_preconditioning_step "
            "(--preconditioner.start-preconditioning-step)",
            "DistributedShampoo.start_preconditioning_step: Invalid "
            "param_group[START_PRECONDITIONING_STEP]=2. Must be >= "
            "param_group[PRECONDITION_FREQUENCY]=5.",
        ),
        (
            {"preconditioner.momentum_dtype": "bfloat16", "shampoo.beta1": 0.995},
            "preconditioner.momentum_dtype (--preconditioner.momentum-dtype)",
            "DistributedShampoo.momentum_dtype torch.bfloat16 cannot hold this EMA: 1 - betas[0]",
        ),
        (
            {
                "optimizer": "muon",
                "preconditioner.momentum_dtype": "bfloat16",
                "muon.momentum": 0.999,
            },
            "preconditioner.momentum_dtype (--preconditioner.momentum-dtype)",
            "DistributedShampoo.momentum_dtype torch.bfloat16",
        ),
        (
            {
                "optimizer": "soap-distadam",
                "soap.precondition_frequency": 10,
                "preconditioner.start_preconditioning_step": 5,
            },
            "preconditioner.start_preconditioning_step "
            "(--preconditioner.start-preconditioning-step)",
            "=5. Must be >= param_group[PRECONDITION_FREQUENCY]=10.",
        ),
    ],
)
def test_a_library_rule_reaches_the_user_naming_the_trainer_flag(
    overrides: dict, trainer: str, library: str
) -> None:
    with pytest.raises(ValueError) as raised:
        TrainConfig(**overrides)
    message = str(raised.value)
    assert message.startswith(trainer + ": "), message
    assert library in message, message


def test_lifting_the_librarys_ema_rule_lifts_the_trainers(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="grafting_dtype"):
        TrainConfig(**GRAFTING_BF16_SLOW_EMA)
    monkeypatch.setattr(preconditioner_types, "check_ema_storage_dtype", lambda *args: None)
    cfg = TrainConfig(**GRAFTING_BF16_SLOW_EMA)
    assert cfg.table(ShampooConfig).grafting_dtype == "bfloat16"


def test_lifting_the_librarys_schedule_rule_lifts_the_trainers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match="start_preconditioning_step"):
        TrainConfig(**EARLY_FIRST_ROOT)
    monkeypatch.setattr(group_validation, "_validate_schedule", lambda group: None)
    assert (
        TrainConfig(**EARLY_FIRST_ROOT).table(PreconditionerConfig).start_preconditioning_step == 2
    )


def test_a_stricter_library_rule_refuses_the_trainers_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trainer has no copy of the grafting epsilon's rule: tightening the library's
    (epsilon > 1e-9, say) refuses the recipe's 1e-10, naming the trainer's flag."""
    TrainConfig()

    def at_least_1e_9(value: float) -> None:
        if value <= 1e-9:
            raise ValueError(f"epsilon must be > 1e-9, got {value!r}")

    monkeypatch.setattr(preconditioner_types, "_check_diagonal_epsilon", at_least_1e_9)
    with pytest.raises(ValueError) as raised:
        TrainConfig()
    assert str(raised.value) == (
        "shampoo.grafting_epsilon (--shampoo.grafting-epsilon): "
        "AdamPreconditionerConfig.epsilon must be > 1e-9, got 1e-10"
    )


def test_a_setup_that_does_not_run_shampoo_does_not_ask_it() -> None:
    # The EMA rule is the library's: an AdamW run never builds those configs.
    assert TrainConfig(optimizer="adamw", **GRAFTING_BF16_SLOW_EMA).setup.matrix == "adamw"


def test_an_unknown_library_field_is_blamed_on_every_trainer_field_behind_the_config() -> None:
    err = with_trainer_label(
        ValueError("mystery must be 1, got 2"),
        "SomeConfig",
        {"a": "t.a (--t.a)", "b": "t.b (--t.b)", "c": "t.a (--t.a)"},
    )
    assert str(err) == "t.a (--t.a), t.b (--t.b): SomeConfig.mystery must be 1, got 2"


def test_the_librarys_error_class_is_kept() -> None:
    err = with_trainer_label(
        UnsupportedConfigError("x is not supported, got 1"), "C", {"x": "t.x (--t.x)"}
    )
    assert isinstance(err, UnsupportedConfigError) and str(err).startswith("t.x (--t.x): C.x ")


def test_an_indexed_library_field_finds_its_trainer_field() -> None:
    with pytest.raises(
        ValueError, match=re.escape("shampoo.beta1 (--b1): DistributedShampoo.betas[0]")
    ):
        check_shampoo_group({"betas": (1.5, 0.9)}, {"betas[0]": "shampoo.beta1 (--b1)"})


def test_an_argument_that_is_no_group_entry_is_a_programming_error() -> None:
    with pytest.raises(TypeError, match="nonfinite_grad_policy"):
        check_shampoo_group({"nonfinite_grad_policy": "skip"}, {})


@pytest.mark.parametrize("optimizer", ["shampoo", "soap-distadam", "muon", "kl-shampoo"])
def test_the_builder_passes_on_the_configs_the_check_built(optimizer: str) -> None:
    """The library's configs are built once, where the config is validated: the optimizer's
    group holds those very objects, not copies rebuilt from the tables."""
    cfg = TrainConfig(optimizer=optimizer)
    assert cfg.setup_arguments is not None
    built = cfg.setup_arguments.kwargs()
    param = torch.nn.Parameter(torch.randn(8, 4))
    group = build_matrix_optimizer(BuildContext({"matrix": [param]}, cfg, 1)).param_groups[0]
    for name in ("preconditioner_config", "grafting_config"):
        assert group[name] is built[name], name


def test_a_setup_without_library_configs_keeps_none() -> None:
    assert TrainConfig(optimizer="adamw").setup_arguments is None


def test_the_muon_setup_builds_without_the_librarys_no_effect_warnings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The library warns that spectral descent ignores betas[1], epsilon and the frequency (as
    the reference does), and still does for a user's own construction; the trainer's ``muon``
    setup, which chose those entries itself, builds without those lines."""
    param = torch.nn.Parameter(torch.randn(8, 6))
    cfg = TrainConfig(optimizer="muon")
    with caplog.at_level("WARNING"):
        build_matrix_optimizer(BuildContext({"matrix": [param]}, cfg, 1))
    assert not [r for r in caplog.records if "does not have any effect" in r.getMessage()]
    assert not [r for r in caplog.records if "target_parameter_dimensionality" in r.getMessage()]
    kwargs = cfg.setup_arguments.kwargs()  # the same arguments, built outside the trainer
    with caplog.at_level("WARNING"):
        from nanoshampoo.optim.shampoo import DistributedShampoo

        DistributedShampoo([torch.nn.Parameter(torch.randn(8, 6))], **kwargs)
    assert [r for r in caplog.records if "does not have any effect" in r.getMessage()]
