"""Two workers of one study in a real PostgreSQL server: a SIGKILLed worker's trial is retried
by the other, and every grid point trains to completion exactly once.

The test starts a throwaway cluster (``initdb``, ``pg_ctl``) in a temporary directory on a free
loopback port and stops it afterwards. PostgreSQL refuses to run as root, so under root the
server runs as ``NANOSHAMPOO_PG_USER`` (``.ci/run`` creates one), else ``postgres`` or
``nobody``. Without the server's binaries or the driver the test skips, unless
``NANOSHAMPOO_REQUIRE_POSTGRES=1`` (CI) makes that a failure.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from tune_fixtures import check_every_point_ran_once, kill_a_worker_mid_trial

pytestmark = [pytest.mark.slow, pytest.mark.service]


def _missing(reason: str) -> None:
    if os.environ.get("NANOSHAMPOO_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"{reason}, and NANOSHAMPOO_REQUIRE_POSTGRES=1")
    pytest.skip(reason)


def _server_user() -> str | None:
    """The user the server runs as: None (this one) unless this one is root."""
    if os.geteuid() != 0:
        return None
    for name in (os.environ.get("NANOSHAMPOO_PG_USER"), "postgres", "nobody"):
        try:
            if name and pwd.getpwnam(name).pw_uid != 0:
                return name
        except KeyError:
            continue
    _missing("no non-root user to run PostgreSQL as")
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A PostgreSQL server of its own, as a ``postgresql://`` URL of its ``postgres`` db."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        _missing("the PostgreSQL driver psycopg is not installed (the postgres extra)")
    binaries = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    initdb = binaries[-1] if binaries else shutil.which("initdb")
    if initdb is None:
        _missing("PostgreSQL's server binaries (initdb, pg_ctl) are not installed")
    assert initdb is not None
    pg_ctl = str(Path(initdb).with_name("pg_ctl"))
    user = _server_user()
    root = Path(tempfile.mkdtemp(prefix="nanoshampoo-pg-"))
    data, port = root / "data", _free_port()
    if user is not None:
        record = pwd.getpwnam(user)
        os.chown(root, record.pw_uid, record.pw_gid)

    def run(*argv: str) -> None:
        subprocess.run(argv, check=True, user=user, cwd=root, capture_output=True, timeout=120)

    try:
        run(initdb, "-D", str(data), "-U", "tune", "--auth=trust", "-E", "UTF8")
        run(
            pg_ctl,
            "-D",
            str(data),
            "-l",
            str(root / "server.log"),
            "-w",
            "-o",
            f"-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={root}",
            "start",
        )
        try:
            yield f"postgresql://tune@127.0.0.1:{port}/postgres"
        finally:
            run(pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_killed_workers_trial_is_retried_by_the_other_through_postgres(
    postgres_url: str, tmp_path: Path
) -> None:
    trials, victim = kill_a_worker_mid_trial(postgres_url, tmp_path)
    check_every_point_ran_once(trials, victim, tmp_path)
