"""Read and write token shards in the FineWeb format used by the NanoGPT speedrun.

A shard file is a 1024-byte header of 256 little-endian int32 followed by the tokens:

    header[0] = 20240520  (magic)
    header[1] = 1         (version)
    header[2] = N         (number of tokens, N >= 0)
    header[3:] = 0        (reserved)
    then N little-endian uint16 tokens, and nothing after them.

Documents inside a shard are concatenated, each starting with the end-of-text token (50256
for the GPT-2 vocabulary). A dataset is a directory of shards named like
``fineweb_val_000000.bin`` (validation) and ``fineweb_train_000001.bin ...`` (training); the
loaders take a glob pattern and walk its matches in sorted order.

Example:
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "fineweb_train_000001.bin"
    >>> write_shard(path, [50256, 15496, 995])
    >>> read_shard(path).tolist()
    [50256, 15496, 995]
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike

from nanoshampoo.errors import UserError
from nanoshampoo.io_utils import atomic_output

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
# The header stores the count as int32; tokens are uint16.
MAX_SHARD_TOKENS = 2**31 - 1
MAX_TOKEN_ID = 2**16 - 1


class ShardFormatError(UserError):
    """A shard file is malformed; the message names the file and what is wrong."""


def read_shard_token_count(path: str | os.PathLike[str]) -> int:
    """Validate a shard's header and size and return its token count, without reading tokens.

    Raises ``ShardFormatError`` for a missing or non-regular file (a directory, a FIFO), one
    that cannot be read, one shorter than the header, a wrong magic or version, a negative
    count, or a file size that does not equal ``1024 + 2 * count`` (truncated or trailing
    bytes).
    """
    path = Path(path)
    if not path.is_file():
        what = "no such file" if not path.exists() else "not a regular file"
        raise ShardFormatError(f"{path}: {what} (a shard is a plain file)")
    try:
        size = path.stat().st_size
        header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    except OSError as exc:
        raise ShardFormatError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    if size < HEADER_BYTES:
        raise ShardFormatError(
            f"{path}: file is {size} bytes, shorter than the {HEADER_BYTES}-byte shard header"
        )
    magic, version, count = (int(v) for v in header[:3])
    if magic != SHARD_MAGIC:
        raise ShardFormatError(f"{path}: wrong magic number {magic}, expected {SHARD_MAGIC}")
    if version != SHARD_VERSION:
        raise ShardFormatError(f"{path}: unsupported version {version}, expected {SHARD_VERSION}")
    if count < 0:
        raise ShardFormatError(f"{path}: negative token count {count} in header")
    expected = HEADER_BYTES + count * TOKEN_DTYPE.itemsize
    if size < expected:
        raise ShardFormatError(
            f"{path}: truncated: header promises {count} tokens ({expected} bytes) "
            f"but the file has {size} bytes"
        )
    if size > expected:
        raise ShardFormatError(
            f"{path}: {size - expected} trailing bytes after the {count} tokens the header promises"
        )
    return count


def read_shard(path: str | os.PathLike[str]) -> np.ndarray:
    """Return a shard's tokens as a read-only memory-mapped uint16 array of shape ``(N,)``.

    The header and file size are validated first (see ``read_shard_token_count``). Nothing
    is read into memory until the array is indexed.
    """
    count = read_shard_token_count(path)
    if count == 0:
        # np.memmap cannot map zero bytes.
        return np.empty(0, dtype=TOKEN_DTYPE)
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(count,))


def _as_token_array(tokens: ArrayLike) -> np.ndarray:
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {array.shape}")
    if array.size and (array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer)):
        raise ValueError(f"tokens must be integers, got dtype {array.dtype}")
    if array.size == 0:
        return np.empty(0, dtype=TOKEN_DTYPE)
    bad = np.flatnonzero((array < 0) | (array > MAX_TOKEN_ID))
    if bad.size:
        index = int(bad[0])
        raise ValueError(
            f"tokens must lie in [0, {MAX_TOKEN_ID}] to fit in uint16: "
            f"tokens[{index}] = {int(array[index])}"
        )
    if array.size > MAX_SHARD_TOKENS:
        raise ValueError(f"a shard holds at most {MAX_SHARD_TOKENS} tokens, got {array.size}")
    return array.astype(TOKEN_DTYPE, copy=False)


def write_shard(path: str | os.PathLike[str], tokens: ArrayLike) -> None:
    """Write ``tokens`` (1-D integers in ``[0, 65535]``) as a shard at ``path``, atomically.

    ``tokens`` is anything ``np.asarray`` takes: a list, a NumPy array, a CPU tensor.
    The file is written beside ``path`` and moved into place (``atomic_output``), so a reader
    never sees a half-written shard. A negative token or one
    >= 65536 raises ``ValueError`` naming its index and value; nothing is written then.
    """
    path = Path(path)
    array = _as_token_array(tokens)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (SHARD_MAGIC, SHARD_VERSION, array.size)
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(array.tobytes())


def list_shards(filename_pattern: str | os.PathLike[str]) -> list[Path]:
    """Return the files matching a glob pattern such as ``data/fineweb_train_*.bin``, sorted.

    Sorting by name makes the order (and so the token stream) the same on every machine.
    Raises ``FileNotFoundError`` naming the pattern when nothing matches.
    """
    pattern = os.fspath(filename_pattern)
    files = sorted(Path(p) for p in glob.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no shard files match the pattern {pattern!r}")
    return files
