"""Two workers of one study in the embedded store (SQLite, no server): a SIGKILLed worker's
trial is retried by the other, and every grid point trains to completion exactly once.

The workers are real processes running ``tune`` (``tune_fixtures.worker_main``), each
launching the fake trainer as a real subprocess, as the command line does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tune_fixtures import check_every_point_ran_once, kill_a_worker_mid_trial


@pytest.mark.slow
def test_a_killed_local_workers_trial_is_retried_by_the_other(tmp_path: Path) -> None:
    trials, victim = kill_a_worker_mid_trial(None, tmp_path)
    check_every_point_ran_once(trials, victim, tmp_path)
