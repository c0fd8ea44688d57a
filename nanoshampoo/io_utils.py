"""Safe file output: atomic writes, and checks that a write replaces nothing it must not.

Every file the project writes in one piece (shards, tokenizers, checkpoints, reports, plots,
traces) goes through :func:`atomic_output`: a temporary file beside the target, then
``os.replace``. A reader (or a crash) never sees a half-written file. The file gets the usual
permissions (``0o666`` less the umask), not the ``0o600`` of ``tempfile.mkstemp``. A target
whose directory cannot be made or written raises :class:`OutputPathError` naming it.

Commands check their outputs before doing any work (:func:`check_output_file`,
:func:`check_output_dir`): an output may not be one of the command's own inputs, nor a run's
log or checkpoint (:func:`run_record_kind`), nor lie under a file, in a directory that cannot
be written, or have a name longer than the file system allows. Each refusal is one
``OutputPathError`` line naming the flag and the path.

Example:
    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "out.txt"
    >>> with atomic_output(target) as tmp:
    ...     _ = tmp.write_text("done")
    >>> target.read_text()
    'done'
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from nanoshampoo.errors import UserError

# The first line of a trainer's text log (the source header) and of its JSONL (the config).
_TEXT_LOG_START = "# ===== "
_CHECKPOINT_SUFFIX = ".ckpt"


class OutputPathError(UserError):
    """An output path that cannot or must not be written; the message names the flag and path."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_output(path: str | os.PathLike[str], suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path in ``path``'s directory; on normal exit move it onto ``path``.

    ``suffix`` ends the temporary file's name, for writers that choose the format by the
    extension (``".png"`` for matplotlib, ``".json.gz"`` for a gzip-compressed Chrome trace).
    The parent directory is created. On an exception the temporary file is removed and
    ``path`` is left untouched.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    except OSError as exc:
        raise OutputPathError(f"{path}: cannot write here ({exc.strerror or exc})") from exc
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def run_record_kind(path: Path) -> str | None:
    """``"run log"`` or ``"checkpoint"`` if ``path`` is one of a training run's files, else None.

    A run log is a ``.txt`` starting with the trainer's source header or a ``.jsonl`` whose
    first record is a ``config`` record; a checkpoint is anything inside a ``*.ckpt`` directory
    or such a directory itself.
    """
    if any(part.endswith(_CHECKPOINT_SUFFIX) for part in path.parts):
        return "checkpoint"
    if not path.is_file() or path.suffix not in (".txt", ".jsonl"):
        return None
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            first = f.readline(1 << 16)
    except OSError:
        return None
    if path.suffix == ".txt":
        return "run log" if first.startswith(_TEXT_LOG_START) else None
    try:
        record = json.loads(first)
    except (ValueError, RecursionError):
        return None
    return "run log" if isinstance(record, dict) and record.get("kind") == "config" else None


def check_output_file(
    path: str | os.PathLike[str], flag: str, inputs: Iterable[str | os.PathLike[str]] = ()
) -> None:
    """Refuse (``OutputPathError``) to write ``path`` for ``flag`` unless it is safe.

    Not an existing directory, not one of ``inputs`` (compared by identity on disk), not a
    run's log or checkpoint, and creatable (see :func:`check_output_dir`).
    """
    path = Path(path)
    check_name_lengths(path, flag)
    if path.is_dir():
        raise OutputPathError(f"{flag} {path}: is a directory; give a file name")
    if path.exists():
        for source in map(Path, inputs):
            if source.exists() and os.path.samefile(path, source):
                raise OutputPathError(
                    f"{flag} {path}: is one of this command's inputs; write the output elsewhere"
                )
        kind = run_record_kind(path)
        if kind is not None:
            raise OutputPathError(
                f"{flag} {path}: is a training run's {kind}; outputs never "
                "replace one, write elsewhere"
            )
    _check_creatable(path, flag)


def check_output_dir(path: str | os.PathLike[str], flag: str) -> None:
    """Refuse (``OutputPathError``) a directory ``flag`` could not create or write into.

    It must not be a file, lie under a file, be unwritable, or have a component longer than
    the file system's name limit; a missing directory must be creatable where it would go.
    Nothing is created: the check writes and removes one probe file in the nearest existing
    ancestor.
    """
    path = Path(path)
    check_name_lengths(path, flag)
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"{flag} {path}: is a file, not a directory")
    _check_creatable(path / "probe", flag, shown=path)


def check_name_lengths(path: str | os.PathLike[str], flag: str) -> None:
    """``OutputPathError`` if a component of ``path`` is longer than file names may be.

    Check before any ``stat``: a too-long component makes ``Path.exists`` itself raise.
    """
    path = Path(path)
    limit = os.pathconf(path.anchor or ".", "PC_NAME_MAX")
    too_long = next((part for part in path.parts if len(os.fsencode(part)) > limit), None)
    if too_long is not None:
        raise OutputPathError(
            f"{flag} {path}: a file name of {len(os.fsencode(too_long))} "
            f"bytes exceeds the file system's limit of {limit}"
        )


def _check_creatable(path: Path, flag: str, shown: Path | None = None) -> None:
    shown = path if shown is None else shown
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputPathError(f"{flag} {shown}: {ancestor} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=ancestor, prefix=".write-probe-")
    except OSError as exc:
        raise OutputPathError(
            f"{flag} {shown}: cannot write in {ancestor} ({exc.strerror or exc})"
        ) from exc
    os.close(fd)
    os.unlink(probe)
