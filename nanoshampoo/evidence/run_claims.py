"""Claims on the runs a ``compare`` trains: one trainer per run, however many commands share
an out dir, and whichever of them was killed.

Before a run trains, the command claims it: an exclusive ``flock`` on the run's claim file
(:func:`claim_path`: named by the run's identity, so every command that wants the same run
claims the same file). The holder writes its pid, host and start time into the file, for the
others' messages. The kernel releases a flock when its holder dies, however it dies (SIGKILL
included): a dead claimant's claim is free at once, and its trainer died with it
(``trainer_process``). A trainer started while a claim is held holds it too (it inherits the
claim's descriptor: :func:`held_claim_fds`), so where no parent-death signal stops an orphaned
trainer, its run stays claimed until it ends. A command that finds a run claimed trains the
others first, then waits for the claim and reuses the run if its log ended (or trains it, if
its claimant failed).

Claim files stay: removing one would race with a command opening it to claim the run. They
are hidden (``.`` first) and hold no result.

Example:
    >>> claim = RunClaim(Path("runs/cmp/adamw/.adamw-s0-1a2b3c4d.claim"))  # doctest: +SKIP
    >>> claim.try_take() or claim.wait()  # doctest: +SKIP
    >>> claim.release()  # doctest: +SKIP
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

CLAIM_SUFFIX = ".claim"
# The descriptors of the claims this process holds: a trainer it starts inherits them.
_HELD_FDS: set[int] = set()


def held_claim_fds() -> tuple[int, ...]:
    """The descriptors of the claims this process holds, for a child to inherit (``pass_fds``):
    a flock is released when the last descriptor of its file description closes, so the claim
    stays held while the child lives, whatever becomes of this process."""
    return tuple(sorted(_HELD_FDS))


def claim_path(directory: Path, base_run_id: str) -> Path:
    """The claim file of the run ``base_run_id`` (its identity) in its setup ``directory``.

    Hidden, so that ``repeat.fresh_run_id`` (which looks for ``<run_id>.*``) never sees it.
    """
    return directory / f".{base_run_id}{CLAIM_SUFFIX}"


class RunClaim:
    """An exclusive claim on one run, held by this process until :meth:`release` (or death).

    Two ``RunClaim`` objects on one path exclude each other even in one process (each opens
    its own file description, which is what a flock belongs to).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_take(self) -> bool:
        """Claim the run if nobody holds it; ``False`` (and nothing held) if somebody does."""
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._hold(fd)
        return True

    def wait(self) -> None:
        """Block until the holder releases the claim (or dies), then hold it."""
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:  # Ctrl-C while waiting: nothing held
            os.close(fd)
            raise
        self._hold(fd)

    def release(self) -> None:
        """Give the claim up (a no-op when not held); the file stays, emptied."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        _HELD_FDS.discard(fd)
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the last descriptor of the description releases the flock

    def holder(self) -> str:
        """Who holds the claim, as its holder wrote it: ``pid 123 on host since 07:01:02``."""
        try:
            record = json.loads(self.path.read_text(encoding="utf-8"))
            since = time.strftime("%H:%M:%S", time.localtime(float(record["since"])))
            return f"pid {int(record['pid'])} on {record['host']} since {since}"
        except (OSError, ValueError, KeyError, TypeError):
            return "another process"  # it holds the lock but has not written its name yet

    def _open(self) -> int:
        if self._fd is not None:
            raise RuntimeError(f"{self.path}: this claim is already held")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)

    def _hold(self, fd: int) -> None:
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self._fd = fd
        _HELD_FDS.add(fd)
