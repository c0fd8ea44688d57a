"""``UserError``: what a user gave is wrong (a flag, a file it names), not the code.

The one place where a command line turns such a problem into one line. Validators raise
``UserError`` (or a subclass: ``LogFormatError``, ``TraceFormatError``, ``ShardFormatError``)
where input enters: config and preset loading, path checks, file readers, checkpoint loading.
Every entry point (``nanoshampoo.cli.main``, ``nanoshampoo.train.cli.main``,
``nanoshampoo.data.prepare.main``) runs its body through :func:`run_command`, which prints
``PROG: error: <one line>`` and returns exit status 2 for a ``UserError``. Any other exception is
a bug and keeps its traceback.

A dataclass config refuses a bad field with a plain ``ValueError`` (it is a library too, and
does not know whether a flag or a script set the field). Where a command builds a config from
its flags, :func:`user_input` marks that region: a ``ValueError`` raised there is the user's.

Example:
    >>> def body() -> int:
    ...     with user_input():
    ...         raise ValueError("lr must be > 0,\\n got -1")
    >>> import contextlib, io
    >>> with contextlib.redirect_stderr(io.StringIO()) as err:
    ...     status = run_command("prog", body)
    >>> status, err.getvalue()
    (2, 'prog: error: lr must be > 0, got -1\\n')
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

EXIT_USER_ERROR = 2


class UserError(ValueError):
    """A problem with a command's inputs (a flag's value, a file it names), not with the code.

    The message names the flag, field or file and says what is wrong. A command line prints it
    as one line, without a traceback, and exits with status 2 (:func:`run_command`).
    """


def one_line(message: str) -> str:
    """``message`` with every run of whitespace (newlines included) as one space."""
    return " ".join(message.split())


@contextmanager
def user_input(*kinds: type[Exception]) -> Iterator[None]:
    """Inside this block a ``ValueError`` (or one of ``kinds``) is re-raised as ``UserError``.

    For the code that turns flags into configs: their ``__post_init__`` raises ``ValueError``
    naming the field, and there the field is a flag the user typed.
    """
    try:
        yield
    except UserError:
        raise
    except (ValueError, *kinds) as exc:
        raise UserError(str(exc) or type(exc).__name__) from exc


def run_command(prog: str, body: Callable[[], int | None]) -> int:
    """Run a command's ``body``; a ``UserError`` prints ``PROG: error: <one line>`` and gives 2."""
    try:
        return int(body() or 0)
    except UserError as exc:
        print(f"{prog}: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_USER_ERROR
