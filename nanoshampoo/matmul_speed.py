"""Measured matmul speed of this machine: is bf16 faster than float32, and the peak FLOP/s.

Three users: the trainer's bf16 autocast choice (``train/hardware.py``), the Newton-Schulz
compute dtype of spectral descent (``spectral_descent_preconditioner.py``) and model FLOPs
utilisation (``train/throughput.py``). It sits below all of them (it imports
only torch), so the optimizer does not import the trainer.

bf16 ran 3.5x float32's rate on a CPU with AMX and a small fraction of it on CPUs without bf16
kernels (``docs/results/cpu-choices.md``): the answer has to be measured on the machine.

Example:
    >>> rate = matmul_flops_per_second(torch.float32, torch.device("cpu"), shape=(64, 64, 64))
    >>> rate > 0
    True
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

# The autocast probe runs ``F.linear`` on a (256, 128) input and a (512, 128) weight: the tiny
# model's MLP shape at a quarter of its rows, 33.6 MFLOP, small enough that a bf16 product is
# quick to time even on a CPU without bf16 kernels. One thread: the probe compares kernels, not
# thread scheduling (on a loaded 2-core machine two threads made a float32 product of this size
# 40x slower, at random).
PROBE_SHAPE = (256, 128, 512)
PROBE_REPEATS = 5
# The peak probe's product: large enough that the kernel, not the call, sets the rate (on the
# project's Xeon with AMX, 1024^3 ran at 94 % of 3072x768x3072's bf16 rate), small enough to
# take ~10 ms.
PEAK_SHAPE = (1024, 1024, 1024)
PEAK_REPEATS = 7


def probe_cpu_bf16_speedup(
    shape: tuple[int, int, int] = PROBE_SHAPE, repeats: int = PROBE_REPEATS
) -> float:
    """float32 ``F.linear`` time over its bf16-autocast time on this CPU (> 1: bf16 is faster).

    ``shape = (rows, in_features, out_features)``. Best of ``repeats`` timed products each,
    after one warm-up, on one thread, the two dtypes alternating so that both meet the same
    load; bf16 stops early once 3 of its products were all 10x slower than float32's best (no
    point timing a hopeless case long). On a shared machine (load average 9 on 2 cores) a
    single bf16 sample that waited for the core once made the probe return 0.0096 where the
    kernels run at 3.6: hence the 3 samples before giving up, and the alternation.
    """
    rows, d_in, d_out = shape
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d_in, generator=generator)
    w = torch.randn(d_out, d_in, generator=generator)

    def seconds(bf16: bool) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            start = time.perf_counter()
            F.linear(x, w)
            return time.perf_counter() - start

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds(False), seconds(True)  # warm-up: kernel selection, first touch of the output
        fp32 = bf16 = float("inf")
        for sample in range(repeats):
            fp32 = min(fp32, seconds(False))
            bf16 = min(bf16, seconds(True))
            if sample >= 2 and bf16 > 10 * fp32:
                break
    finally:
        torch.set_num_threads(threads)
    return fp32 / bf16


@functools.cache
def cpu_bf16_is_fast() -> bool:
    """Whether :func:`probe_cpu_bf16_speedup` finds bf16 faster than float32 (probed once per
    process, ~50 ms)."""
    return probe_cpu_bf16_speedup() > 1.0


def matmul_flops_per_second(
    dtype: torch.dtype,
    device: torch.device,
    shape: tuple[int, int, int] = PEAK_SHAPE,
    repeats: int = PEAK_REPEATS,
) -> float:
    """The best rate of an ``(m, k) @ (k, n)`` product in ``dtype`` on ``device``, in FLOP/s.

    ``shape = (m, k, n)``, ``2 m k n`` FLOPs per product; best of ``repeats`` after a warm-up,
    with the process's current thread count (what the run itself uses). Best, not median: it
    estimates what the hardware can do, the peak that a utilisation is a fraction of.
    """
    m, k, n = shape
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=generator).to(device=device, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * m * k * n / best
