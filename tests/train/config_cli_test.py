"""TrainConfig validation, presets and the flag parser."""

from __future__ import annotations

import tomllib

import pytest

from nanoshampoo.train.cli import config_from_args, main
from nanoshampoo.train.config import OPTIMIZER_SETUPS, TrainConfig
from nanoshampoo.train.presets import PRESET_DIR, load_preset, preset_names


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
        (dict(distributor="fsdp"), "distributor"),
        (dict(autocast="fp16"), "autocast"),
        (dict(factor_dtype="float16"), "factor_dtype"),
        (dict(communication_dtype="int8"), "communication_dtype"),
        (dict(root_dtype="float16"), "root_dtype"),
        (dict(grafting_dtype="float64"), "grafting_dtype"),
        (dict(grafting_dtype="bfloat16", grafting_beta2=0.999), "grafting_dtype"),
        (dict(momentum_dtype="bfloat16", matrix_beta1=0.995), "momentum_dtype"),
        (dict(optimizer="muon", momentum_dtype="bfloat16", muon_momentum=0.999), "momentum_dtype"),
        (dict(root_method="qr"), "root_method"),
        (dict(warm_qr_tolerance=-0.01), "warm_qr_tolerance"),
        (dict(warm_qr_tolerance=float("nan")), "warm_qr_tolerance"),
        (dict(warm_qr_max_iterations=-1), "warm_qr_max_iterations"),
        (dict(large_factor_dim=-1), "large_factor_dim"),
        (dict(large_factor_frequency_multiplier=0), "large_factor_frequency_multiplier"),
        (dict(grad_accum_steps=0), "grad_accum_steps"),
        (dict(muon_momentum=1.0), "muon_momentum"),
        (dict(soap_lr=float("nan")), "soap_lr"),
        (dict(optimizer="soap", soap_precondition_frequency=10, start_preconditioning_step=5),
         "start_preconditioning_step"),
        (dict(run_id="runs/a"), "run_id"),
        (dict(run_id=".."), "run_id"),
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
    assert (cfg.seed, cfg.cooldown_frac, cfg.autocast) == (7, 0.5, "off")
    assert cfg.profile_steps == (5, 6, 7)
    assert (cfg.run_id, cfg.out_dir) == ("abc", "/tmp/o")
    assert cfg.num_iterations == TrainConfig().num_iterations


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
    assert main(["--optimizer", "sgd"]) == 2
    err = capsys.readouterr().err
    assert "TrainConfig.optimizer must be one of" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as info:
        main(["--seed", "x"])
    assert info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_presets_hold_only_what_differs_from_the_defaults() -> None:
    defaults = TrainConfig()
    for name in preset_names():
        raw = tomllib.loads((PRESET_DIR / f"{name}.toml").read_text())
        same = sorted(k for k, v in raw.items() if k != "extends" and getattr(defaults, k) == v)
        assert same == [], f"{name} repeats defaults {same}"
    # The tiny shampoo run is the defaults but for the matrix lr tuned on the embedded task.
    assert load_preset("tiny-shampoo") == {"preset": "tiny-shampoo", "matrix_lr": 0.003}
    assert {name: load_preset(name)["optimizer"] for name in preset_names()
            if name.startswith("tiny-") and name != "tiny-shampoo"} == {
        f"tiny-{setup}": setup for setup in OPTIMIZER_SETUPS if setup != "shampoo"}


def test_extends_starts_from_the_named_preset(tmp_path) -> None:  # type: ignore[no-untyped-def]
    adamw = load_preset("gpt2-124m-adamw")
    assert adamw == {**load_preset("gpt2-124m-shampoo"), "optimizer": "adamw",
                     "preset": "gpt2-124m-adamw"}
    loop = tmp_path / "loop.toml"
    loop.write_text(f'extends = "{loop}"\n')
    with pytest.raises(ValueError, match="loops back"):
        load_preset(str(loop))


def test_help_shows_the_presets_values(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        config_from_args(["--preset", "tiny-muon", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--optimizer OPTIMIZER (preset tiny-muon: 'muon'; default 'shampoo')" in text
    assert "--muon-lr MUON_LR (preset tiny-muon: 0.02; default 0.05)" in text
    assert "--soap-lr SOAP_LR (default 0.003)" in text


def test_autocast_bf16_flag_is_an_alias() -> None:
    assert config_from_args(["--autocast-bf16", "true"]).autocast == "bf16"
    assert config_from_args(["--autocast-bf16", "no"]).autocast == "off"
    assert config_from_args([]).autocast == "auto"
