"""Machine-dependent choices: bf16 autocast resolution and CPU thread counts."""

from __future__ import annotations

import math

import pytest
import torch

from nanoshampoo.train import hardware
from nanoshampoo.train.hardware import available_cores, cpu_threads, resolve_autocast


@pytest.mark.parametrize("choice, enabled", [("bf16", True), ("off", False)])
def test_explicit_autocast_choices_are_taken_as_given(choice: str, enabled: bool) -> None:
    resolved = resolve_autocast(choice, torch.device("cpu"))
    assert resolved.enabled is enabled and resolved.reason == f"autocast={choice}"


@pytest.mark.parametrize("speedup, enabled", [(0.03, False), (1.4, True)])
def test_auto_on_cpu_follows_the_probe(
    speedup: float, enabled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hardware, "probe_cpu_bf16_speedup", lambda: speedup)
    resolved = resolve_autocast("auto", torch.device("cpu"))
    assert resolved.enabled is enabled
    assert resolved.name == ("bf16" if enabled else "off")
    assert ("faster" if enabled else "slower") in resolved.reason


def test_probe_is_quick_and_returns_a_positive_ratio() -> None:
    import time

    start = time.perf_counter()
    speedup = hardware.probe_cpu_bf16_speedup()
    assert math.isfinite(speedup) and speedup > 0
    assert time.perf_counter() - start < 2.0  # ~50 ms on a slow 2-core CPU
    assert torch.get_num_threads() >= 1


def test_requested_threads_are_taken_as_given() -> None:
    assert cpu_threads(requested=3, local_world_size=8) == (3, "threads=3")


@pytest.mark.parametrize("speedup, expected", [(1.7, 2), (0.2, 1)])
def test_threads_share_the_cores_between_local_ranks_unless_one_is_faster(
    speedup: float, expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hardware, "available_cores", lambda: 4)
    probed: list[int] = []
    monkeypatch.setattr(
        hardware, "probe_thread_speedup", lambda threads: probed.append(threads) or speedup
    )
    threads, reason = cpu_threads(requested=0, local_world_size=2)
    assert (threads, probed) == (expected, [2])
    assert f"{speedup:.2g}x" in reason
    assert cpu_threads(requested=0, local_world_size=4)[0] == 1
    assert probed == [2]  # one core per rank: nothing to probe


def test_thread_probe_restores_the_thread_count() -> None:
    before = torch.get_num_threads()
    speedup = hardware.probe_thread_speedup(max(2, available_cores()))
    assert math.isfinite(speedup) and speedup > 0
    assert torch.get_num_threads() == before


@pytest.mark.parametrize(
    "timings, expected, rounds_run",
    [
        # A stalled round (2 threads 20x slower), then a round where 2 threads help: that wins.
        ([1.0, 20.0, 1.0, 0.5], 2.0, 2),
        # Threads help at once: one round is enough.
        ([1.0, 0.8], 1.25, 1),
        # Busy cores: every round loses, and the best of the three is still below 1.
        ([1.0, 2.0, 1.0, 4.0, 1.0, 1.25], 0.8, 3),
    ],
)
def test_thread_probe_takes_the_best_of_up_to_three_rounds(
    timings: list[float], expected: float, rounds_run: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    scripted = iter(timings)

    def fake_median(x: torch.Tensor, w: torch.Tensor, threads: int, repeats: int) -> float:
        calls.append(threads)
        return next(scripted)

    monkeypatch.setattr(hardware, "_median_linear_time", fake_median)
    before = torch.get_num_threads()
    assert hardware.probe_thread_speedup(2) == pytest.approx(expected)
    assert calls == [1, 2] * rounds_run
    assert torch.get_num_threads() == before
