"""ThreadTuner: a fixed count is set once; a probed one is probed again every RETUNE_STEPS."""

from __future__ import annotations

import pytest
import torch

from nanoshampoo.train import thread_tuner
from nanoshampoo.train.distributed import DistributedContext
from nanoshampoo.train.thread_tuner import RETUNE_STEPS, ThreadTuner

CPU = DistributedContext(rank=0, world_size=1, device=torch.device("cpu"), owns_process_group=False)


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []

    def fake_cpu_threads(requested: int, local_world_size: int) -> tuple[int, str]:
        calls.append(requested)
        return 1, f"probe {len(calls)}"

    monkeypatch.setattr(thread_tuner, "cpu_threads", fake_cpu_threads)
    return calls


def test_probed_threads_are_probed_again_on_schedule(probes: list[int]) -> None:
    tuner = ThreadTuner(0, CPU)
    tuner.tune()
    for step in range(3 * RETUNE_STEPS + 1):
        tuner.before_step(step, start_step=0)
    assert probes == [0, 0, 0, 0]  # at start, then before steps 10, 20 and 30
    assert (tuner.reason, torch.get_num_threads()) == ("probe 4", 1)


def test_a_resumed_run_does_not_reprobe_at_its_first_step(probes: list[int]) -> None:
    tuner = ThreadTuner(0, CPU)
    tuner.before_step(RETUNE_STEPS, start_step=RETUNE_STEPS)
    assert probes == []


def test_fixed_threads_are_set_once(probes: list[int]) -> None:
    tuner = ThreadTuner(1, CPU)
    tuner.tune()
    for step in range(2 * RETUNE_STEPS + 1):
        tuner.before_step(step, start_step=0)
    assert (probes, tuner.retunes) == ([1], False)
