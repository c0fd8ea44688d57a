"""TrainConfig validation, presets and the flag parser."""

from __future__ import annotations

import tomllib

import pytest

from nanoshampoo.train import trainer
from nanoshampoo.train.cli import config_from_args, main
from nanoshampoo.train.config import RENAMED, TrainConfig, run_keys
from nanoshampoo.train.presets import PRESET_DIR, load_preset, preset_names
from nanoshampoo.train.setups import setup_names
from nanoshampoo.train.setups.adam import AdamConfig
from nanoshampoo.train.setups.shampoo_family import (
    PreconditionerConfig,
    ShampooConfig,
    SoapConfig,
)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(optimizer="sgd"), "optimizer"),
        (dict(model="huge"), "model"),
        (dict(batch_size=0), "batch_size"),
        (dict(cooldown_frac=1.5), "cooldown_frac"),
        (dict(warmup_steps=-1), "warmup_steps"),
        ({"adam.beta2": 1.0}, r"adam\.beta2 \(--adam\.beta2\)"),
        ({"shampoo.lr": -1.0}, r"shampoo\.lr"),
        (
            {"preconditioner.start_preconditioning_step": 2, "shampoo.precondition_frequency": 5},
            r"preconditioner\.start_preconditioning_step",
        ),
        (dict(dataset="shards", val_files="v*", vocab_size=10), "train_files"),
        (dict(dataset="shards", train_files="t*", val_files="v*"), "vocab_size"),
        (dict(profile_steps=(3, 4)), "profile_dir"),
        ({"distributor.kind": "fsdp"}, r"distributor\.kind \(--distributor\.kind\)"),
        (dict(autocast="fp16"), "autocast"),
        ({"preconditioner.factor_dtype": "float16"}, "factor_dtype"),
        ({"distributor.communication_dtype": "int8"}, r"distributor\.communication_dtype"),
        ({"shampoo.root_dtype": "float16"}, "root_dtype"),
        ({"shampoo.precondition_dtype": "float16"}, r"shampoo\.precondition_dtype"),
        ({"shampoo.grafting_dtype": "float64"}, "grafting_dtype"),
        ({"shampoo.grafting_dtype": "bfloat16", "shampoo.grafting_beta2": 0.999}, "grafting_dtype"),
        ({"preconditioner.momentum_dtype": "bfloat16", "shampoo.beta1": 0.995}, "momentum_dtype"),
        (
            {
                "optimizer": "muon",
                "preconditioner.momentum_dtype": "bfloat16",
                "muon.momentum": 0.999,
            },
            "momentum_dtype",
        ),
        ({"shampoo.root_method": "qr"}, "root_method"),
        ({"shampoo.warm_qr_tolerance": -0.01}, "warm_qr_tolerance"),
        ({"shampoo.warm_qr_tolerance": float("nan")}, "warm_qr_tolerance"),
        ({"shampoo.warm_qr_max_iterations": -1}, "warm_qr_max_iterations"),
        ({"shampoo.large_factor_dim": -1}, "large_factor_dim"),
        ({"shampoo.large_factor_frequency_multiplier": 0}, "large_factor_frequency_multiplier"),
        (dict(grad_accum_steps=0), "grad_accum_steps"),
        ({"muon.momentum": 1.0}, r"muon\.momentum"),
        ({"soap.lr": float("nan")}, r"soap\.lr"),
        (
            {
                "optimizer": "soap",
                "soap.precondition_frequency": 10,
                "preconditioner.start_preconditioning_step": 5,
            },
            "start_preconditioning_step",
        ),
        (dict(run_id="runs/a"), "run_id"),
        (dict(run_id=".."), "run_id"),
        (dict(preset="../../pwned"), "preset"),
        (dict(dist_timeout_s=float("inf")), "dist_timeout_s"),
        (dict(num_iterations=2.5), "num_iterations must be an int"),
        (dict(save_final_checkpoint="false"), "save_final_checkpoint must be a bool"),
        ({"muon.lrr": 0.1}, r"muon\.lrr"),
        (dict(learning_rate=0.1), "learning_rate"),
    ],
)
def test_invalid_values_raise_naming_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TrainConfig(**overrides)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--adam.eps", "inf"),
        ("--adam.eps", "0"),
        ("--shampoo.grafting-epsilon", "inf"),
        ("--shampoo.grafting-epsilon", "0"),
        ("--shampoo.lr", "inf"),
        ("--shampoo.epsilon", "0"),
        ("--shampoo.epsilon", "inf"),
        ("--shampoo.beta2", "0"),
        ("--soap.beta2", "0"),
        ("--adam.embed-lr", "inf"),
        ("--muon.lr", "nan"),
        ("--soap.epsilon", "inf"),
    ],
)
def test_non_finite_or_zero_epsilons_and_lrs_are_refused_naming_the_flag(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"({flag})" in err, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--muon-lr", "0.1"], "--muon-lr is now --muon.lr"),
        (["--matrix-lr=0.1"], "--matrix-lr is now --shampoo.lr or --adamw.lr"),
        (
            ["--max-preconditioner-dim", "64"],
            "--max-preconditioner-dim is now --preconditioner.max-preconditioner-dim",
        ),
        (["--distributor", "ddp"], "--distributor is now --distributor.kind"),
        (
            ["--communication-dtype", "bfloat16"],
            "--communication-dtype is now --distributor.communication-dtype",
        ),
        (["--autocast-bf16", "true"], "--autocast-bf16 is now --autocast (true: bf16, false: off)"),
        (
            ["--shampoo.warm_qr_tolerance", "0.1"],
            "--shampoo.warm_qr_tolerance is now --shampoo.warm-qr-tolerance",
        ),
    ],
)
def test_an_old_flag_fails_with_one_line_naming_the_new_spelling(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--seed", "1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"python -m nanoshampoo.train: error: {message}"


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(muon_lr=0.03), "TrainConfig.muon_lr is now muon.lr"),
        (
            dict(matrix_weight_decay=0.1),
            "is now shampoo.weight_decay or soap.weight_decay or adamw",
        ),
        (dict(fsdp_assignment="replicate"), "TrainConfig.fsdp_assignment is now distributor.fsdp"),
        (dict(compile=True), 'TrainConfig.compile is "true", "false" or "auto" .* write "true"'),
        (dict(distributor="ddp"), "TrainConfig.distributor is now distributor.kind"),
    ],
)
def test_an_old_keyword_fails_naming_its_new_spelling(
    values: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**values)


def test_to_dict_rebuilds_the_config_and_holds_only_the_setups_tables() -> None:
    cfg = TrainConfig(optimizer="muon", **{"muon.lr": 0.03, "adam.head_lr": 0.01})
    data = cfg.to_dict()
    assert data["muon.lr"] == 0.03 and data["adam.head_lr"] == 0.01
    assert {key.split(".")[0] for key in data if "." in key} == {
        "adam",
        "preconditioner",
        "muon",
        "distributor",
    }
    assert TrainConfig(**data) == cfg


def test_defaults_are_the_optimization_track_shampoo_recipe() -> None:
    cfg = TrainConfig()
    adam, shampoo, pre = (
        cfg.table(AdamConfig),
        cfg.table(ShampooConfig),
        cfg.table(PreconditionerConfig),
    )
    assert (adam.embed_lr, adam.head_lr, adam.scalar_lr) == (0.3, 1 / 320, 0.01)
    assert (adam.beta1, adam.beta2, adam.eps) == (0.8, 0.95, 1e-10)
    assert (shampoo.lr, shampoo.beta1, shampoo.beta2) == (0.0015, 0.9, 0.95)
    assert shampoo.weight_decay == 0.2
    assert (pre.max_preconditioner_dim, shampoo.precondition_frequency) == (8192, 5)
    assert pre.start_preconditioning_step == -1
    assert (shampoo.grafting_beta2, shampoo.grafting_epsilon) == (0.95, 1e-10)
    assert cfg.schedule.cooldown_frac == 0.7


def test_every_preset_loads_into_a_valid_config() -> None:
    names = preset_names()
    assert {"tiny-shampoo", "tiny-adamw", "gpt2-124m-shampoo"} <= set(names)
    for name in names:
        cfg = TrainConfig(**load_preset(name))
        assert cfg.run.preset == name


def test_flags_override_the_preset_with_typed_values() -> None:
    cfg = config_from_args(
        [
            "--preset",
            "tiny-adamw",
            "--seed",
            "7",
            "--cooldown-frac",
            "0.5",
            "--autocast",
            "off",
            "--profile-steps",
            "5,6,7",
            "--profile-dir",
            "/tmp/p",
            "--run-id",
            "abc",
            "--out-dir",
            "/tmp/o",
            "--decay-branches",
            "0.25,0.5,0.75",
        ]
    )
    assert cfg.run.preset == "tiny-adamw" and cfg.optimizer == "adamw"
    assert (cfg.run.seed, cfg.schedule.cooldown_frac, cfg.parallel.autocast) == (7, 0.5, "off")
    assert cfg.run.profile_steps == (5, 6, 7)
    assert cfg.schedule.decay_branches == (0.25, 0.5, 0.75)
    assert (cfg.run.run_id, cfg.run.out_dir) == ("abc", "/tmp/o")
    assert cfg.schedule.num_iterations == TrainConfig().schedule.num_iterations


def test_precondition_dtype_flag_sets_the_shampoo_table() -> None:
    cfg = config_from_args(["--shampoo.precondition-dtype", "bfloat16"])
    assert cfg.table(ShampooConfig).precondition_dtype == "bfloat16"
    assert config_from_args([]).table(ShampooConfig).precondition_dtype == "float32"


def test_a_table_field_flag_is_spelled_with_dashes(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config_from_args(
        [
            "--preset",
            "tiny-soap",
            "--soap.precondition-frequency",
            "7",
            "--preconditioner.start-preconditioning-step",
            "14",
        ]
    )
    assert cfg.table(SoapConfig).precondition_frequency == 7
    assert cfg.table(PreconditionerConfig).start_preconditioning_step == 14
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--soap.precondition-frequency" in out and "--soap.precondition_frequency" not in out


def test_bad_flag_value_and_unknown_preset_are_rejected(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        config_from_args(["--save-final-checkpoint", "maybe"])
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


def test_soap_with_a_pseudo_inverse_is_a_one_line_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_training(cfg: object) -> None:
        raise AssertionError("the config was accepted")

    monkeypatch.setattr(trainer, "Trainer", no_training)
    flags = ["--optimizer", "soap", "--preconditioner.rank-deficient-stability", "pseudo-inverse"]
    assert main(flags) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "error: preconditioner.rank_deficient_stability " in line
    assert "must be 'perturbation' for SOAP, got 'pseudo-inverse'" in line


def test_presets_hold_only_what_differs_from_the_defaults() -> None:
    defaults = TrainConfig()
    for name in preset_names():
        raw = tomllib.loads((PRESET_DIR / f"{name}.toml").read_text())
        same = sorted(
            k
            for k, v in raw.items()
            if k != "extends" and not isinstance(v, dict) and run_keys()[k].read(defaults) == v
        )
        same += sorted(
            f"{table}.{k}"
            for table, values in raw.items()
            if isinstance(values, dict)
            for k, v in values.items()
            if getattr(defaults.tables[table], k) == v
        )
        assert same == [], f"{name} repeats defaults {same}"
    # The tiny shampoo run is the defaults but for the matrix lr tuned on the embedded task.
    assert load_preset("tiny-shampoo") == {"preset": "tiny-shampoo", "shampoo": {"lr": 0.003}}
    assert {
        name: load_preset(name)["optimizer"]
        for name in preset_names()
        if name.startswith("tiny-") and name != "tiny-shampoo"
    } == {f"tiny-{setup}": setup for setup in setup_names() if setup not in ("shampoo", "custom")}


def test_shipped_presets_use_the_table_spelling() -> None:
    for name in preset_names():
        raw = tomllib.loads((PRESET_DIR / f"{name}.toml").read_text())
        assert not set(raw) & set(RENAMED), name


def test_extends_starts_from_the_named_preset(tmp_path) -> None:  # type: ignore[no-untyped-def]
    adamw = load_preset("gpt2-124m-adamw")
    assert adamw == {
        **load_preset("gpt2-124m-shampoo"),
        "optimizer": "adamw",
        "preset": "gpt2-124m-adamw",
    }
    loop = tmp_path / "loop.toml"
    loop.write_text(f'extends = "{loop}"\n')
    with pytest.raises(ValueError, match="loops back"):
        load_preset(str(loop))


def test_help_shows_the_presets_values(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        config_from_args(["--preset", "tiny-muon", "--help"])
    out = capsys.readouterr().out
    text = " ".join(out.split())
    assert "--optimizer OPTIMIZER (preset tiny-muon: 'muon'; default 'shampoo')" in text
    assert "--muon.lr FLOAT (preset tiny-muon: 0.02; default 0.05)" in text
    assert "--soap.lr FLOAT (default 0.003)" in text
    assert "--custom.matrix-kwargs JSON (default {})" in text
    assert "--decay-branches DECAY_BRANCHES (default ())" in text
    assert "--distributor.kind STR (default 'auto')" in text
    assert "--muon-lr" not in text and "--autocast-bf16" not in text  # one spelling


@pytest.mark.parametrize(
    "text, message",
    [
        ('save_final_checkpoint = "false"\n', "save_final_checkpoint must be a bool, got 'false'"),
        ("num_iterations = 2.5\n", "num_iterations must be an int, got 2.5"),
        ('num_iterations = "abc"\n', "num_iterations must be an int"),
        ("muon_lr = 0.1\n", r"muon_lr is now \[muon\] lr$"),
        ("matrix_lr = 0.1\n", r"matrix_lr is now \[shampoo\] lr or \[adamw\] lr$"),
        ('distributor = "ddp"\n', r"distributor is now \[distributor\] kind$"),
        ("compile = true\n", r'compile is "true", "false" or "auto" \(a string\), got True: write'),
        ('profile_steps = "5"\n', "profile_steps must be a list of integers"),
        ('decay_branches = [0.5, "x"]\n', "decay_branches must be a list of numbers"),
        ("resume = 5\n", "resume must be a str"),
        ('[muon]\nlr = "0.02"\n', r"\[muon\] lr must be a float"),
        ("[muon]\nlrr = 0.02\n", r"unknown field \[muon\] lrr"),
        ("extends = 3\n", "'extends' must be a preset name or path"),
    ],
)
def test_preset_values_are_type_checked_naming_the_file_and_key(
    text: str, message: str, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    preset = tmp_path / "bad.toml"
    preset.write_text(text)
    with pytest.raises(ValueError, match=f"bad\\.toml: {message}"):
        load_preset(str(preset))
    out = tmp_path / "out"
    assert main(["--preset", str(preset), "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.toml" in err
    assert not out.exists()  # refused before anything was written


def test_a_non_utf8_preset_names_its_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    preset = tmp_path / "latin1.toml"
    preset.write_bytes(b'# caf\xe9\noptimizer = "adamw"\n')
    with pytest.raises(ValueError, match=r"latin1\.toml: cannot read preset"):
        load_preset(str(preset))


def test_preset_names_resolve_only_among_the_shipped_presets(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    evil = tmp_path / "x" / "evil.toml"
    evil.parent.mkdir()
    evil.write_text('optimizer = "adamw"\n')
    monkeypatch.chdir(tmp_path / "x")
    with pytest.raises(ValueError, match="unknown preset 'evil'"):
        load_preset("evil")  # a name is never a file in the working directory
    with pytest.raises(ValueError, match=r"preset path '\.\./x/evil' must end in \.toml"):
        load_preset("../x/evil")
    assert load_preset("evil.toml")["optimizer"] == "adamw"  # a path, given as a path
    assert load_preset(str(evil))["preset"] == "evil"
    child = tmp_path / "x" / "child.toml"
    child.write_text('extends = "../x/evil"\n')
    with pytest.raises(ValueError, match=r"child\.toml: extends: preset path .* must end in"):
        load_preset(str(child))
    child.write_text('extends = "evil.toml"\nseed = 3\n')  # relative to the extending file
    monkeypatch.chdir(tmp_path)
    assert load_preset(str(child)) == {"optimizer": "adamw", "seed": 3, "preset": "child"}
    child.write_text('extends = "evil"\n')
    with pytest.raises(ValueError, match="extends: unknown preset 'evil'"):
        load_preset(str(child))


def test_a_preset_name_that_would_escape_the_out_dir_is_refused(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    preset = tmp_path / "p.toml"
    preset.write_text('preset = "../../pwned"\n')
    out = tmp_path / "a" / "b" / "runs"
    assert main(["--preset", str(preset), "--out-dir", str(out)]) == 2
    assert (
        "TrainConfig.preset (--preset) must not contain a path separator" in capsys.readouterr().err
    )
    assert list(tmp_path.rglob("*.jsonl")) == []


@pytest.mark.parametrize("field", ["run_id", "preset"])
def test_an_overlong_run_id_or_preset_name_is_refused(field: str) -> None:
    flag = "--" + field.replace("_", "-")
    with pytest.raises(
        ValueError, match=rf"TrainConfig.{field} \({flag}\) is too long: at most 100 characters"
    ):
        TrainConfig(**{field: "r" * 101})
