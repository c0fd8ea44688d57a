"""The one atomic-output helper every writer of the project uses."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nanoshampoo.io_utils import atomic_output


def _usual_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def test_writes_in_one_piece_with_the_usual_permissions(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "out.json.gz"
    target.parent.mkdir()
    target.write_text("old")
    with atomic_output(target, suffix=".json.gz") as tmp:
        assert tmp.parent == target.parent and tmp.name.endswith(".json.gz")
        assert target.read_text() == "old"  # not replaced until the block ends
        tmp.write_text("new")
    assert target.read_text() == "new"
    assert target.stat().st_mode & 0o777 == _usual_mode()
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.json.gz"]


def test_an_error_leaves_the_target_and_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old")
    with pytest.raises(OSError, match="disk full"), atomic_output(target) as tmp:
        tmp.write_text("half")
        raise OSError("disk full")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_creates_the_parent_directory(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "out.txt"
    with atomic_output(target) as tmp:
        tmp.write_text("x")
    assert target.read_text() == "x"
