"""TrainConfig validation, presets and the flag parser."""

from __future__ import annotations

import pytest

from nanoshampoo.train.cli import config_from_args, main
from nanoshampoo.train.config import TrainConfig
from nanoshampoo.train.presets import load_preset, preset_names


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(optimizer="sgd"), "optimizer"),
        (dict(model="huge"), "model"),
        (dict(batch_size=0), "batch_size"),
        (dict(cooldown_frac=1.5), "cooldown_frac"),
        (dict(adam_beta2=1.0), "adam_beta2"),
        (dict(matrix_lr=-1.0), "matrix_lr"),
        (dict(start_preconditioning_step=2, precondition_frequency=5), "start_preconditioning_step"),
        (dict(dataset="shards", val_files="v*", vocab_size=10), "train_files"),
        (dict(dataset="shards", train_files="t*", val_files="v*"), "vocab_size"),
        (dict(profile_steps=(3, 4)), "profile_dir"),
        (dict(shampoo_distributor="fsdp"), "shampoo_distributor"),
    ],
)
def test_invalid_values_raise_naming_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TrainConfig(**overrides)  # type: ignore[arg-type]


def test_defaults_are_the_optimization_track_shampoo_recipe() -> None:
    cfg = TrainConfig()
    assert (cfg.embed_lr, cfg.head_lr, cfg.scalar_lr) == (0.3, 1 / 320, 0.01)
    assert (cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps) == (0.8, 0.95, 1e-10)
    assert (cfg.matrix_lr, cfg.matrix_beta1, cfg.matrix_beta2) == (0.0015, 0.9, 0.95)
    assert cfg.matrix_weight_decay == 0.2
    assert (cfg.max_preconditioner_dim, cfg.precondition_frequency) == (8192, 5)
    assert cfg.start_preconditioning_step == -1
    assert (cfg.grafting_beta2, cfg.grafting_epsilon) == (0.95, 1e-10)
    assert cfg.cooldown_frac == 0.7


def test_every_preset_loads_into_a_valid_config() -> None:
    names = preset_names()
    assert {"tiny-shampoo", "tiny-adamw", "gpt2-124m-shampoo"} <= set(names)
    for name in names:
        cfg = TrainConfig(**load_preset(name))
        assert cfg.preset == name


def test_flags_override_the_preset_with_typed_values() -> None:
    cfg = config_from_args([
        "--preset", "tiny-adamw", "--seed", "7", "--cooldown-frac", "0.5",
        "--autocast-bf16", "false", "--profile-steps", "5,6,7", "--profile-dir", "/tmp/p",
        "--run-id", "abc", "--out-dir", "/tmp/o",
    ])
    assert cfg.preset == "tiny-adamw" and cfg.optimizer == "adamw"
    assert (cfg.seed, cfg.cooldown_frac, cfg.autocast_bf16) == (7, 0.5, False)
    assert cfg.profile_steps == (5, 6, 7)
    assert (cfg.run_id, cfg.out_dir) == ("abc", "/tmp/o")
    assert cfg.num_iterations == load_preset("tiny-adamw")["num_iterations"]


def test_bad_flag_value_and_unknown_preset_are_rejected(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        config_from_args(["--autocast-bf16", "maybe"])
    with pytest.raises(ValueError, match="unknown preset"):
        config_from_args(["--preset", "no-such-preset"])
    bad = tmp_path / "bad.toml"
    bad.write_text('optimizer = "adamw"\nlearning_rate = 3\n')
    with pytest.raises(ValueError, match=r"bad\.toml.*learning_rate"):
        load_preset(str(bad))


def test_cli_reports_an_invalid_value_as_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--optimizer", "sgd"])
    assert info.value.code == 2
    assert "TrainConfig.optimizer must be one of" in capsys.readouterr().err
