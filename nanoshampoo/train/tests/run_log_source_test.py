"""The source of what ran: stored once per distinct source beside the runs, named by each log."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from nanoshampoo.io_utils import run_record_kind
from nanoshampoo.train.config import UserError
from nanoshampoo.train.run_log import SEPARATOR, RunLog, logged_source, training_source


def start(out_dir: Path, run_id: str, embed_source: bool = False) -> RunLog:
    log = RunLog(str(out_dir), run_id, enabled=True, embed_source=embed_source)
    log.start(config_record={"kind": "config", "run_id": run_id}, environment="cpu")
    return log


def test_runs_of_the_same_code_share_one_source_file(tmp_path: Path) -> None:
    first = start(tmp_path, "a")
    stored = sorted((tmp_path / "sources").iterdir())
    digest = hashlib.sha256(training_source().encode()).hexdigest()
    assert [p.name for p in stored] == [f"{digest}.source"]
    umask = os.umask(0)
    os.umask(umask)
    assert stored[0].stat().st_mode & 0o777 == 0o666 & ~umask  # readable as any output file
    before = stored[0].stat()
    second = start(tmp_path, "b")
    assert sorted((tmp_path / "sources").iterdir()) == stored  # no second copy, no temporary
    after = stored[0].stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not rewritten
    for log in (first, second):
        lines = log.text_path.read_text().splitlines()
        assert lines[0] == f"# ===== source: sources/{digest}.source ====="
        assert lines[1] == SEPARATOR and lines[2].startswith("config: ")
        assert logged_source(log.text_path) == training_source()
        assert run_record_kind(log.text_path) == "run log"  # still refused as an output file
    assert json.loads(first.jsonl_path.read_text())["run_id"] == "a"


def test_an_embedded_source_is_read_back_the_same(tmp_path: Path) -> None:
    log = start(tmp_path, "self-contained", embed_source=True)
    text = log.text_path.read_text()
    assert text.startswith("# ===== nanoshampoo/train/")
    assert text.startswith(training_source() + "\n" + SEPARATOR + "\nconfig: ")
    assert not (tmp_path / "sources").exists()
    assert logged_source(log.text_path) == training_source()


def test_a_damaged_or_missing_source_is_one_line(tmp_path: Path) -> None:
    log = start(tmp_path, "a")
    [stored] = (tmp_path / "sources").iterdir()
    stored.write_text("edited")
    with pytest.raises(UserError, match=f"{stored}: does not hold the source"):
        logged_source(log.text_path)
    with pytest.raises(UserError, match=f"{stored}: does not hold the source"):
        start(tmp_path, "b")  # a new run does not name a file that holds other code
    stored.unlink()
    with pytest.raises(UserError, match=r"a\.txt: its source .* cannot be read"):
        logged_source(log.text_path)


def test_sources_as_a_file_is_refused_before_the_run(tmp_path: Path) -> None:
    (tmp_path / "sources").write_text("not a folder")
    log = RunLog(str(tmp_path), "a", enabled=True)
    with pytest.raises(UserError, match="sources is a file"):
        log.check_can_start()
    assert not log.text_path.exists()
