"""``docs/adding-an-optimizer.md``, run as written: a user's Lion in a file outside the package
trains from a preset alone and appears on the ``compare`` leaderboard.

The files come from the page's code blocks (``<!-- file: NAME -->``), the commands from its
``<!-- run -->`` blocks; only a tiny budget is added to each command.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest
import torch

from nanoshampoo.cli import main as nanoshampoo_main
from nanoshampoo.train.cli import main as train_main

REPO = Path(__file__).resolve().parents[3]
DOC = REPO / "docs" / "adding-an-optimizer.md"
BLOCK = re.compile(r"<!-- (file: (?P<name>\S+)|run) -->\n```\w*\n(?P<body>.*?)```", re.S)
TINY = [
    "--num-iterations",
    "3",
    "--val-every",
    "1",
    "--val-tokens",
    "256",
    "--batch-size",
    "2",
    "--seq-len",
    "64",
    "--autocast",
    "off",
    "--threads",
    "1",
    "--progress",
    "false",
    "--data-dir",
    str(REPO / "data" / "embedded"),
]


def doc_blocks() -> tuple[dict[str, str], list[str]]:
    """(file name -> its text, the commands of the run blocks)."""
    files, commands = {}, []
    for match in BLOCK.finditer(DOC.read_text(encoding="utf-8")):
        if match.group("name"):
            files[match.group("name")] = match.group("body")
        else:
            commands += [line for line in match.group("body").splitlines() if line.strip()]
    return files, commands


def test_the_page_has_the_files_and_commands_of_the_walkthrough() -> None:
    files, commands = doc_blocks()
    assert set(files) == {"lion.py", "lion.toml"}
    assert [shlex.split(c)[:3] for c in commands] == [
        ["python", "-m", "nanoshampoo.train"],
        ["nanoshampoo", "compare", "--setups"],
    ]


@pytest.mark.slow
def test_the_walkthrough_trains_lion_and_compares_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    files, commands = doc_blocks()
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)
    train, compare = (shlex.split(c) for c in commands)
    assert train_main([*train[3:], *TINY, "--run-id", "lion"]) == 0
    assert "final val_loss" in capsys.readouterr().out
    log = [json.loads(line) for line in (tmp_path / "runs" / "lion.jsonl").read_text().splitlines()]
    assert log[0]["optimizer"] == "custom"
    assert log[0]["config"]["custom.matrix_optimizer"] == "lion.py:Lion"
    assert log[0]["config"]["custom.matrix_kwargs"] == {
        "lr": 0.0003,
        "betas": [0.9, 0.99],
        "weight_decay": 0.1,
    }
    assert math.isfinite(log[-1]["val_loss"]) and log[-1]["kind"] == "final"

    tiny = [arg for arg in TINY if arg not in ("--progress", "false")]
    assert nanoshampoo_main([*compare[1:], "--", *tiny]) == 0
    board = json.loads((tmp_path / "runs" / "compare" / "leaderboard.json").read_text())
    rows = {row["setup"]: row for row in board["rows"]}
    assert list(rows) == ["adamw", "lion"] and rows["lion"]["preset"] == "lion.toml"
    assert rows["lion"]["runs"] == 3 and rows["lion"]["diverged"] == 0
    assert math.isfinite(rows["lion"]["final_val_loss"]["mean"])
    assert rows["lion"]["welch_p"] is not None  # three seeds a side: the test ran
