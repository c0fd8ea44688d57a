"""Choices that depend on the machine the run lands on: bf16 autocast and CPU threads.

bf16 autocast: on a CPU without bf16 kernels it is slower than float32 by an order of
magnitude or more, on one with them faster or about as fast (the measurements:
``docs/results/cpu-choices.md``). So ``autocast="auto"`` uses
bf16 on CUDA when the GPU supports it, and on a CPU only when :func:`probe_cpu_bf16_speedup`
finds bf16 matmuls faster than float32 ones (the probe lives in ``nanoshampoo/matmul_speed.py``,
where spectral descent's Newton-Schulz dtype choice uses it too).

Threads: torch's default is the machine's physical core count, which oversubscribes a process
pinned to fewer cores (``taskset``, cgroup cpusets) and every rank of a multi-process CPU run;
and on cores that other processes keep busy, one thread beats several (see :func:`cpu_threads`).

Example:
    >>> choice = resolve_autocast("off", torch.device("cpu"))
    >>> (choice.enabled, choice.reason)
    (False, 'autocast=off')
    >>> cpu_threads(requested=3, local_world_size=1)
    (3, 'threads=3')
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoshampoo.matmul_speed import PROBE_REPEATS, PROBE_SHAPE, probe_cpu_bf16_speedup
from nanoshampoo.train.machine import available_cores
from nanoshampoo.train.probe_cache import ProbeCache


@dataclass(frozen=True)
class AutocastChoice:
    """Whether the forward runs under bf16 autocast, and why (printed and logged)."""

    enabled: bool
    reason: str

    @property
    def name(self) -> str:
        return "bf16" if self.enabled else "off"


def resolve_autocast(
    choice: str, device: torch.device, cache: ProbeCache | None = None
) -> AutocastChoice:
    """Resolve ``TrainConfig.autocast`` (``auto|bf16|off``) for ``device``; see the module doc.
    ``cache``: where the CPU probe's verdict may come from and goes (``probe_cache``)."""
    if choice == "bf16":
        return AutocastChoice(True, "autocast=bf16")
    if choice == "off":
        return AutocastChoice(False, "autocast=off")
    if device.type == "cuda":
        supported = torch.cuda.is_bf16_supported()
        return AutocastChoice(
            supported,
            "auto: CUDA device " + ("supports bf16" if supported else "without bf16 support"),
        )
    settings = {"shape": list(PROBE_SHAPE), "repeats": PROBE_REPEATS}
    speedup, note = (cache or ProbeCache(None)).answer(
        "cpu_bf16_speedup", settings, probe_cpu_bf16_speedup
    )
    verdict = "faster" if speedup > 1.0 else "slower"
    return AutocastChoice(
        speedup > 1.0,
        f"auto: bf16 matmuls are {verdict} than float32 on this "
        f"CPU (probe: {speedup:.2g}x float32's speed{'; ' + note if note else ''})",
    )


def _median_linear_time(x: torch.Tensor, w: torch.Tensor, threads: int, repeats: int) -> float:
    """Median seconds of ``F.linear(x, w)`` on ``threads`` intra-op threads (after a warm-up)."""
    torch.set_num_threads(threads)
    F.linear(x, w)  # warm-up: wakes the thread pool
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        F.linear(x, w)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def probe_thread_speedup(
    threads: int, shape: tuple[int, int, int] = PROBE_SHAPE, repeats: int = 7, rounds: int = 3
) -> float:
    """Median ``F.linear`` time on 1 thread over the time on ``threads`` (> 1: threads help).

    Medians, not minima: on a machine whose cores are busy with other processes, most
    multi-threaded products wait for a descheduled thread, and that typical case is what a run
    meets. Up to ``rounds`` rounds (each times 1 thread, then ``threads``) and the best round's
    ratio, stopping at the first round where threads help: on an idle virtual machine a single
    round now and then finds 2 threads 20x slower than 1 (a stalled virtual core), and a run
    that believed it would spend its whole length on half the machine. Busy cores lose every
    round, so they still get one thread.
    """
    rows, d_in, d_out = shape
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d_in, generator=generator)
    w = torch.randn(d_out, d_in, generator=generator)
    before = torch.get_num_threads()
    best = 0.0
    try:
        for _ in range(max(1, rounds)):
            one = _median_linear_time(x, w, 1, repeats)
            best = max(best, one / _median_linear_time(x, w, threads, repeats))
            if best > 1.0:
                break
        return best
    finally:
        torch.set_num_threads(before)


def cpu_threads(requested: int, local_world_size: int) -> tuple[int, str]:
    """Intra-op threads per process and why: ``requested``, or for 0 the available cores shared
    evenly by the ranks on this machine, unless a probe finds one thread faster.

    On a machine whose cores other processes keep busy, one thread is faster by far, and on
    idle ones several are (``docs/results/cpu-choices.md``); the probe tells them apart.
    """
    if requested > 0:
        return requested, "threads=" + str(requested)
    share = max(1, available_cores() // max(1, local_world_size))
    if share == 1:
        return 1, f"{available_cores()} cores for {local_world_size} local ranks"
    speedup = probe_thread_speedup(share)
    if speedup > 1.0:
        return share, f"{share} threads run a matmul {speedup:.2g}x as fast as 1"
    return 1, f"{share} threads run a matmul {speedup:.2g}x as fast as 1 (busy cores?)"
