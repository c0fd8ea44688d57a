"""What a run prints: a header of labelled lines, then (off a terminal) sparse progress lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nanoshampoo.train.config import TrainConfig
from nanoshampoo.train.trainer import Trainer


def test_the_header_is_labelled_lines_and_the_progress_is_sparse(
    shards: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = TrainConfig(
        preset="test",
        model="tiny",
        dataset="shards",
        vocab_size=64,
        seq_len=32,
        batch_size=4,
        num_iterations=20,
        val_every=0,
        val_tokens=256,
        progress=True,  # pytest's captured stderr is not a terminal: lines, not a bar
        out_dir=str(tmp_path),
        run_id="out",
        save_final_checkpoint=False,
        autocast="off",
        compile="false",
        threads=1,
        optimizer="adamw",
        **shards,
    )
    Trainer(cfg).run()
    captured = capsys.readouterr()
    header = captured.out.splitlines()[:6]
    assert re.fullmatch(
        r"run out: adamw, model tiny \([\d,]+ non-embedding parameters, .*\)", header[0]
    )
    assert [line.split()[0] for line in header[1:]] == [
        "device",
        "threads",
        "autocast",
        "compile",
        "MFU",
    ]
    assert header[1] == "  device cpu x1 (ddp)"
    assert header[2].startswith("  threads 1 (")
    assert header[3].startswith("  autocast off (")
    assert header[4].startswith("  compile off (") and header[4].endswith(", for the model only")
    assert "\r" not in captured.err
    progress = [line for line in captured.err.splitlines() if line.startswith("out: step ")]
    assert [line.split()[2] for line in progress] == [f"{n}/20" for n in range(2, 21, 2)]
    assert progress[-1].startswith("out: step 20/20 (100%), ")
