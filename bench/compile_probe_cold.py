"""Benchmark: what the inductor probe adds to a first compiled step, with an empty cache.

``--compile auto`` first compiles a one-line probe (``train/compile_choice.py``); on a fresh
clone the inductor cache is empty, and the probe then takes seconds. Is that time added to
the first training step's compilation, or does the step reuse what the probe built (the C++
toolchain's first start, inductor's headers)? Each sample is a fresh process with an empty
``TORCHINDUCTOR_CACHE_DIR``: torch and inductor imported (not timed), then optionally the probe,
then the first forward and backward of the ``tiny`` GPT under bf16 autocast, compiled, on one
thread. With and without the probe alternate. Printed: each sample's probe and first-step
seconds, and the mean totals.

Usage:
    python bench/compile_probe_cold.py [--samples 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

SAMPLE = """
import sys, time
import torch
import torch._dynamo, torch._inductor.compile_fx
from nanoshampoo.model.gpt import GPT, gpt_preset
from nanoshampoo.train.compile_choice import probe_inductor

torch.set_num_threads(1)
start = time.perf_counter()
if sys.argv[1] == "probe":
    assert probe_inductor(torch.device("cpu")) is None
probed = time.perf_counter()
torch.manual_seed(0)
forward = torch.compile(GPT(gpt_preset("tiny", 4096)))
x = torch.randint(0, 4096, (8, 256))
with torch.autocast("cpu", dtype=torch.bfloat16):
    loss = forward(x, x)
loss.backward()
print(probed - start, time.perf_counter() - probed)
"""


def sample(with_probe: bool) -> tuple[float, float]:
    """(probe seconds, first-step seconds) of one fresh process with an empty cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        mode = "probe" if with_probe else "none"
        out = subprocess.run(
            [sys.executable, "-c", SAMPLE, mode], env=env, capture_output=True, text=True
        )
    if out.returncode:
        raise SystemExit(f"sample failed: {out.stderr.strip().splitlines()[-1:]}")
    probe, step = (float(v) for v in out.stdout.split())
    return probe, step


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=2, help="samples of each, alternating")
    args = parser.parse_args(argv)
    if args.samples < 1:
        raise SystemExit(f"--samples: at least 1, got {args.samples}")
    totals: dict[bool, list[float]] = {True: [], False: []}
    for index in range(2 * args.samples):
        with_probe = (index % 4) in (0, 3)  # probe, none, none, probe, ...: neither always first
        begin = time.perf_counter()
        probe, step = sample(with_probe)
        totals[with_probe].append(probe + step)
        print(
            f"{'probe' if with_probe else 'none '}: probe {probe:.1f} s, first step {step:.1f} s"
            f" (sample {time.perf_counter() - begin:.0f} s)",
            flush=True,
        )
    probe_mean, none_mean = (statistics.mean(totals[k]) for k in (True, False))
    print(
        f"mean probe + first step: {probe_mean:.1f} s with the probe, {none_mean:.1f} s "
        f"without: the probe adds {probe_mean - none_mean:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
