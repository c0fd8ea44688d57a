"""Where ``prepare`` writes: the output directory's layout, its checks, and the atomic swap.

A preparation is written whole into a staging directory beside ``out_dir``
(``.<name>.staging-*``) and only then swapped in (:func:`staged_output`): ``out_dir`` is renamed
aside, the staging directory renamed to ``out_dir``, and the old one removed. So the old data
stays complete until the new data is complete, and a failure at any point before the swap
leaves ``out_dir`` exactly as it was. Files in ``out_dir`` that ``prepare`` did not write
(anything but the manifest, the tokenizer and the shards it lists) move into the new directory.

Before any of that, :func:`check_out_dir` refuses an ``out_dir`` that cannot be written, the
working directory or one above it (the swap would move it away), and one holding shard files
that no manifest of this tool lists (they would mix into the data).

Example:
    >>> import tempfile, pathlib
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "data"
    >>> with staged_output(out) as staging:
    ...     _ = (staging / "manifest.json").write_text("{}")
    >>> sorted(p.name for p in out.iterdir())
    ['manifest.json']
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from nanoshampoo.data.shards import ShardFormatError, read_shard_token_count, write_shard
from nanoshampoo.io_utils import check_output_dir

MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
TRAIN_PREFIX = "fineweb_train_"
VAL_PREFIX = "fineweb_val_"


def read_manifest(out_dir: Path) -> dict[str, Any] | None:
    """The manifest of a previous preparation in ``out_dir``; None if absent or unreadable."""
    path = out_dir / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError):
        return None
    return manifest if isinstance(manifest, dict) else None


def listed_files(manifest: dict[str, Any] | None) -> set[str]:
    """The file names a manifest says this tool wrote (none for a damaged manifest)."""
    counts = (manifest or {}).get("shard_token_counts")
    if not isinstance(counts, dict):
        return set()
    return {Path(str(name)).name for name in counts} | {MANIFEST_NAME, TOKENIZER_NAME}


def manifest_files_intact(out_dir: Path, manifest: dict[str, Any]) -> bool:
    """Whether every file the manifest lists is there with its recorded token count."""
    counts = manifest.get("shard_token_counts")
    if not isinstance(counts, dict) or not counts or not (out_dir / TOKENIZER_NAME).is_file():
        return False
    for name, count in counts.items():
        path = out_dir / name
        try:
            if not path.is_file() or read_shard_token_count(path) != count:
                return False
        except (ShardFormatError, OSError):
            return False
    return True


def check_out_dir(out_dir: Path, manifest: dict[str, Any] | None) -> None:
    """``ValueError`` (one line) if ``out_dir`` cannot take a new preparation; changes nothing."""
    check_output_dir(out_dir, "--out-dir")
    cwd = Path.cwd().resolve()
    if out_dir.resolve() in (cwd, *cwd.parents):
        raise ValueError(
            f"--out-dir {out_dir}: is the working directory or above it, which the "
            "swap to the new data would move away; give a directory below it"
        )
    if not out_dir.is_dir():
        return
    listed = listed_files(manifest)
    foreign = sorted(
        p.name
        for prefix in (TRAIN_PREFIX, VAL_PREFIX)
        for p in out_dir.glob(f"{prefix}*.bin")
        if p.name not in listed
    )
    if foreign:
        raise ValueError(
            f"--out-dir {out_dir}: holds shard files not listed in a manifest of this tool "
            f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); they would be "
            f"mixed into the new data: choose an empty out_dir or remove them"
        )


def write_shards(
    stream: np.ndarray, directory: Path, prefix: str, first_index: int, shard_tokens: int
) -> list[str]:
    """Cut ``stream`` into shards of at most ``shard_tokens``, numbered from ``first_index``."""
    names = []
    for k, start in enumerate(range(0, len(stream), shard_tokens)):
        name = f"{prefix}{first_index + k:06d}.bin"
        write_shard(directory / name, stream[start : start + shard_tokens])
        names.append(name)
    return names


@contextmanager
def staged_output(out_dir: Path, previous: dict[str, Any] | None = None) -> Iterator[Path]:
    """Yield an empty staging directory beside ``out_dir``; on success swap it in.

    ``previous`` is the old manifest: the files it lists are dropped with the old directory,
    every other file of ``out_dir`` moves into the new one. On an exception the staging
    directory is removed and ``out_dir`` is untouched.
    """
    out_dir = out_dir.resolve()  # "data/" and "data" alike: the staging goes beside it
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.staging-"))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    # Past this point the staging directory may hold the user's files: never removed.
    os.chmod(staging, 0o777 & ~_umask())
    _swap_in(staging, out_dir, listed_files(previous))


def _swap_in(staging: Path, out_dir: Path, replaced: set[str]) -> None:
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    for path in out_dir.iterdir():  # the user's own files go along with the new data
        if path.name not in replaced and not (staging / path.name).exists():
            path.rename(staging / path.name)
    old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-"))
    out_dir.rename(old / out_dir.name)
    staging.rename(out_dir)
    shutil.rmtree(old)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
