"""A trainer started by an evidence tool never outlives it: a tool (here: ``compare``'s
launcher in a process of its own) killed with SIGKILL takes its trainer with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# A stand-in for the tool: it launches a long "trainer" through compare's launcher, which
# writes its pid, then waits for it.
TOOL = """
import sys
from pathlib import Path
from nanoshampoo.evidence.compare import launch_subprocess
out = Path(sys.argv[1])
launch_subprocess([sys.executable, "-c",
                   "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
                   "time.sleep(120)", str(out / "trainer.pid")], out / "trainer.out")
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (killed, not yet reaped by init) is not running.
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split(")")[-1].split()[0] != "Z"


def _trainer_pid(pid_file: Path) -> int:
    """The pid the tool's trainer writes into ``pid_file`` once it runs (within 60 s)."""
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline, "the trainer never started"
        time.sleep(0.1)
    return int(pid_file.read_text())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_tool_killed_with_sigkill_takes_its_trainer_with_it(tmp_path: Path) -> None:
    tool = subprocess.Popen([sys.executable, "-c", TOOL, str(tmp_path)])
    trainer = _trainer_pid(tmp_path / "trainer.pid")
    assert _alive(trainer)
    tool.send_signal(signal.SIGKILL)
    tool.wait()
    deadline = time.monotonic() + 10
    while _alive(trainer):
        assert time.monotonic() < deadline, f"trainer {trainer} outlived the killed tool"
        time.sleep(0.1)


# The same tool on a platform without a parent-death signal (``sys.platform`` says so): it
# claims a run first, as ``compare`` does before it trains one.
CLAIMING_TOOL = """
import sys
from pathlib import Path
sys.platform = "darwin"
from nanoshampoo.evidence.compare import launch_subprocess
from nanoshampoo.evidence.run_claims import RunClaim
out = Path(sys.argv[1])
assert RunClaim(out / ".run.claim").try_take()
launch_subprocess([sys.executable, "-c",
                   "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
                   "time.sleep(120)", str(out / "trainer.pid")], out / "trainer.out")
"""


def test_an_orphaned_trainer_keeps_its_run_claimed_until_it_ends(tmp_path: Path) -> None:
    """Without a parent-death signal the trainer outlives a killed tool; it holds the tool's
    claim on its run, so a re-run cannot train that run while the orphan does."""
    from nanoshampoo.evidence.run_claims import RunClaim

    tool = subprocess.Popen([sys.executable, "-c", CLAIMING_TOOL, str(tmp_path)])
    trainer = _trainer_pid(tmp_path / "trainer.pid")
    tool.send_signal(signal.SIGKILL)
    tool.wait()
    claim = RunClaim(tmp_path / ".run.claim")
    try:
        assert _alive(trainer)
        assert not claim.try_take()  # the orphan holds it
        os.killpg(trainer, signal.SIGKILL)  # the trainer leads its own session
        deadline = time.monotonic() + 10
        while not claim.try_take():
            assert time.monotonic() < deadline, "the claim outlived the trainer"
            time.sleep(0.1)
    finally:
        claim.release()
        if _alive(trainer):
            os.killpg(trainer, signal.SIGKILL)
