"""Atomic file output: write to a temporary file beside the target, then ``os.replace``.

Every file the project writes in one piece (shards, tokenizers, checkpoints, reports, plots,
traces) goes through :func:`atomic_output`. A reader (or a crash) never sees a half-written file. The file gets the usual permissions
(``0o666`` less the umask), not the ``0o600`` of ``tempfile.mkstemp``.

Example:
    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "out.txt"
    >>> with atomic_output(target) as tmp:
    ...     _ = tmp.write_text("done")
    >>> target.read_text()
    'done'
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
