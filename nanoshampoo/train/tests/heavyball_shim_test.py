"""``docs/adding-an-optimizer.md``'s HeavyBall section, run as written: its shim runs SOAP and
PSGD-Kron through the ``custom`` setup without HeavyBall compiling anything, checkpoints their
state, and PSGD-Kron without the shim's ``precond_init_scale`` fails at step 1 in one line.

The files come from the section's ``<!-- heavyball file: NAME -->`` blocks, the command from its
``<!-- heavyball run -->`` block. Skipped where HeavyBall is not installed (it is in the ``dev``
extra)."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from adding_an_optimizer_test import DOC, TINY
from trainer_test import tiny_config

from nanoshampoo.cli import main as nanoshampoo_main
from nanoshampoo.train.checkpoint import read_checkpoint
from nanoshampoo.train.outcomes import OptimizerStepFailed
from nanoshampoo.train.trainer import Trainer

heavyball = pytest.importorskip(
    "heavyball", reason="heavyball is not installed (pip install -e '.[dev]' installs it)"
)
BLOCK = re.compile(r"<!-- heavyball (file: (?P<name>\S+)|run) -->\n```\w*\n(?P<body>.*?)```", re.S)
pytestmark = pytest.mark.usefixtures("one_thread")


def section_blocks() -> tuple[dict[str, str], list[str]]:
    """(file name -> its text, the commands of the run block)."""
    files, commands = {}, []
    for match in BLOCK.finditer(DOC.read_text(encoding="utf-8")):
        if match.group("name"):
            files[match.group("name")] = match.group("body")
        else:
            commands += [line for line in match.group("body").splitlines() if line.strip()]
    return files, commands


@pytest.fixture
def section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The section's files written into the working directory; its commands. HeavyBall's
    compile fails the test if anything calls it."""
    files, commands = section_blocks()
    assert set(files) == {"heavyball_optimizers.py", "heavyball-soap.toml", "heavyball-kron.toml"}
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)

    def no_compile(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("HeavyBall compiled a kernel despite the shim")

    monkeypatch.setattr(heavyball.utils.fusions, "compile", no_compile)
    monkeypatch.setattr(heavyball.utils, "compile_mode", heavyball.utils.compile_mode)
    return commands


@pytest.mark.parametrize("cls", ["SOAP", "PSGDKron"])
def test_the_shim_trains_and_checkpoints_without_heavyball_compiling(
    section: list[str],
    shards: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    cls: str,
) -> None:
    cfg = tiny_config(
        shards,
        tmp_path / "runs",
        num_iterations=3,
        val_every=0,
        save_final_checkpoint=True,
        **{
            "optimizer": "custom",
            "custom.matrix_optimizer": f"heavyball_optimizers.py:{cls}",
            "custom.matrix_kwargs": {"lr": 0.001},
        },
    )
    result = Trainer(cfg).run()
    # The header says what --compile governs: a library may compile its own kernels.
    assert re.search(r"\n  compile off \(.*\), for the model only\n", capsys.readouterr().out)
    assert heavyball.utils.compile_mode is None
    assert math.isfinite(result.final_val_loss)
    assert result.last_checkpoint is not None
    assert read_checkpoint(result.last_checkpoint, 0, 1).step == 3


def test_psgd_kron_without_an_initial_scale_fails_at_step_1_in_one_line(
    section: list[str], shards: dict[str, str], tmp_path: Path
) -> None:
    heavyball.utils.compile_mode = None  # what the shim does (restored by the fixture)
    cfg = tiny_config(
        shards,
        tmp_path / "runs",
        num_iterations=3,
        val_every=0,
        **{"optimizer": "custom", "custom.matrix_optimizer": "heavyball:PSGDKron"},
    )
    with pytest.raises(OptimizerStepFailed) as failed:
        Trainer(cfg).run()
    assert re.fullmatch(
        r"optimizer heavyball\.PSGDKron raised in step 1: PrecondInitError: [^\n]+",
        str(failed.value),
    ), str(failed.value)


@pytest.mark.slow
def test_the_sections_compare_puts_both_on_the_leaderboard(section: list[str]) -> None:
    (command,) = section
    argv = shlex.split(command)
    assert argv[:2] == ["nanoshampoo", "compare"]
    tiny = [arg for arg in TINY if arg not in ("--progress", "false")]
    assert nanoshampoo_main([*argv[1:], "--seeds", "1", "--", *tiny, "--compile", "false"]) == 0
    board = json.loads(Path("runs/compare/leaderboard.json").read_text())
    rows = {row["setup"]: row for row in board["rows"]}
    assert list(rows) == ["adamw", "hb-soap", "hb-kron"]
    assert all(math.isfinite(row["final_val_loss"]["mean"]) for row in rows.values())
