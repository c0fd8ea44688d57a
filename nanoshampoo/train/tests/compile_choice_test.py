"""``--compile auto|true|false``: where "auto" compiles and the reason it gives, the config's
spellings, and a compiled run that trains like the eager one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from nanoshampoo.train import compile_choice
from nanoshampoo.train.compile_choice import (
    COMPILE_PAYS_AFTER_STEPS,
    CompileChoice,
    probe_inductor,
    resolve_compile,
)
from nanoshampoo.train.config import TrainConfig
from nanoshampoo.train.presets import load_preset
from nanoshampoo.train.trainer import Trainer

CPU = torch.device("cpu")
LONG = COMPILE_PAYS_AFTER_STEPS


@pytest.mark.parametrize(("choice", "enabled"), [("true", True), ("false", False)])
def test_true_and_false_decide_without_a_probe(
    choice: str, enabled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compile_choice, "probe_inductor", pytest.fail)
    for device in (CPU, torch.device("cuda")):
        assert resolve_compile(choice, device, 4, 10) == CompileChoice(enabled, f"compile={choice}")


@pytest.mark.parametrize(
    ("device", "world_size", "steps", "reason"),
    [
        ("cuda", 1, LONG, "auto: off on cuda (not measured; --compile true compiles)"),
        ("cpu", 2, LONG, "auto: off for 2 processes (measured in one)"),
        (
            "cpu",
            1,
            LONG - 1,
            f"auto: off for a run of {LONG - 1} steps (compiling pays after ~{LONG} on CPU)",
        ),
    ],
)
def test_auto_stays_eager_where_compiling_was_not_measured_to_pay(
    device: str, world_size: int, steps: int, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compile_choice, "probe_inductor", pytest.fail)  # not even probed
    assert resolve_compile("auto", torch.device(device), world_size, steps) == CompileChoice(
        False, reason
    )


def test_auto_compiles_a_long_cpu_run_where_inductor_works(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_choice, "probe_inductor", lambda device: None)
    # `make train` (tiny-shampoo, the default 300 steps) is such a run.
    assert TrainConfig(**load_preset("tiny-shampoo")).schedule.num_iterations >= LONG
    assert resolve_compile("auto", CPU, 1, 300) == CompileChoice(
        True,
        f"auto: a 300-step run on CPU (compiling pays after ~{LONG} steps, ~15 from "
        "inductor's cache)",
    )
    monkeypatch.setattr(
        compile_choice,
        "probe_inductor",
        lambda device: "InvalidCxxCompiler: No working C++ compiler found",
    )
    assert resolve_compile("auto", CPU, 1, 300) == CompileChoice(
        False,
        "auto: off, inductor cannot compile here (InvalidCxxCompiler: No working C++ "
        "compiler found)",
    )


def test_probe_reports_a_compiler_failure_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> object:
        def call(x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("no compiler\nmore detail")

        return call

    monkeypatch.setattr(torch, "compile", broken)
    assert probe_inductor(CPU) == "RuntimeError: no compiler"


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="no C++ compiler: inductor cannot compile on CPU",
)
def test_probe_passes_with_a_cpp_compiler() -> None:
    assert probe_inductor(CPU) is None


def test_config_spellings() -> None:
    assert TrainConfig().parallel.compile == "auto"
    assert TrainConfig(compile="true").parallel.compile == "true"
    assert load_preset("gpt2-124m-shampoo")["compile"] == "true"
    with pytest.raises(ValueError, match=r'TrainConfig.compile is "true", .* write "false"'):
        TrainConfig(compile=False)  # the field's type before it took "auto"
    with pytest.raises(
        ValueError,
        match=r"TrainConfig.compile must be one of \['auto', "
        r"'true', 'false'\], got 'yes'",
    ):
        TrainConfig(compile="yes")
    with pytest.raises(ValueError, match="compile"):
        resolve_compile("yes", CPU, 1, 300)


@pytest.mark.slow
def test_a_compiled_run_trains_like_the_eager_one(
    shards: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = dict(
        preset="test",
        model="gpt-0.2m",  # the smallest size: inductor compiles half the layers of tiny's
        dataset="shards",
        vocab_size=64,
        seq_len=32,
        batch_size=4,
        num_iterations=3,
        val_every=0,
        val_tokens=256,
        progress=False,
        out_dir=str(tmp_path),
        save_final_checkpoint=False,
        autocast="off",
        threads=1,
        optimizer="adamw",
        **shards,
    )
    eager = Trainer(TrainConfig(**common, run_id="eager", compile="auto")).run()
    assert "compile off (auto: off for a run of 3 steps" in capsys.readouterr().out
    compiled = Trainer(TrainConfig(**common, run_id="compiled", compile="true")).run()
    assert "compile on (compile=true)" in capsys.readouterr().out
    # Fused kernels round differently; three steps stay within float32 noise.
    assert compiled.final_val_loss == pytest.approx(eager.final_val_loss, rel=1e-4)
