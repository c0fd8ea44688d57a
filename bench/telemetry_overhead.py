"""What telemetry costs: the mean train-step time of a preset with telemetry off and at a cadence
(default: the preset's ``val_every``, the trainer's default), measured side by side in one run.

Two copies of the preset's model and optimizers (same seed, same batches) step in turn, so
machine load hits both alike. The telemetry copy snapshots its matrices inside the step and
computes its records after it, as the trainer does (outside the timed step, like validation);
both parts are reported, and the overhead is ``(step_on + record time per step - step_off) /
step_off``. Only a machine with nothing else running gives figures worth quoting.

Run: ``python bench/telemetry_overhead.py [--presets tiny-shampoo,tiny-muon] [--steps 300]
[--every 0] [--threads 2] [--json OUT]`` (``--every 0``: the preset's ``val_every``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from nanoshampoo.model.gpt import GPT, gpt_preset
from nanoshampoo.train.config import TrainConfig
from nanoshampoo.train.distributed import DistributedContext
from nanoshampoo.train.optimizers import OptimizerSetup, build_optimizer_setup
from nanoshampoo.train.presets import load_preset
from nanoshampoo.train.telemetry import Telemetry, resolve_every

VOCAB = 4096  # the embedded corpus's vocabulary


@dataclass
class Overhead:
    preset: str
    steps: int
    every: int
    records: int
    step_off_ms: float
    step_on_ms: float
    record_ms_per_step: float
    overhead: float


def _build(cfg: TrainConfig) -> tuple[GPT, OptimizerSetup]:
    torch.manual_seed(cfg.run.seed)
    model = GPT(gpt_preset(cfg.model.name, VOCAB))
    return model, build_optimizer_setup(model, cfg, world_size=1)


def _step(model: GPT, setup: OptimizerSetup, x: torch.Tensor, telemetry: Telemetry | None) -> float:
    """One timed step (forward, backward, the optimizers); seconds."""
    start = time.perf_counter()
    model(x[:, :-1], x[:, 1:]).backward()
    if telemetry is not None:
        telemetry.snapshot()
    for opt in setup.optimizers:
        opt.step()
    for opt in setup.optimizers:
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def measure(preset: str, steps: int, every: int) -> Overhead:
    cfg = TrainConfig(**load_preset(preset), compile="false", autocast="off")
    every = every or resolve_every(cfg.run.telemetry_every, cfg.schedule.val_every)
    off_model, off_setup = _build(cfg)
    on_model, on_setup = _build(cfg)
    ctx = DistributedContext(0, 1, torch.device("cpu"), owns_process_group=False)
    telemetry = Telemetry(every, on_model, on_setup.groups["matrix"], on_setup.optimizers, [], ctx)
    generator = torch.Generator().manual_seed(0)
    off_times, on_times, record_time, records = [], [], 0.0, 0
    for step in range(steps):
        x = torch.randint(
            0, VOCAB, (cfg.data.batch_size, cfg.data.seq_len + 1), generator=generator
        )
        recorded = telemetry.due(step + 1)
        # Alternate which copy goes first, so neither always runs on a warmer cache.
        order = [(False, off_model, off_setup), (True, on_model, on_setup)]
        for on, model, setup in order if step % 2 == 0 else order[::-1]:
            seconds = _step(model, setup, x, telemetry if on and recorded else None)
            (on_times if on else off_times).append(seconds)
        if recorded:
            start = time.perf_counter()
            records += len(telemetry.record(step + 1))
            record_time += time.perf_counter() - start
    warm = slice(2, None)  # the first steps allocate state
    step_off = statistics.fmean(off_times[warm])
    step_on = statistics.fmean(on_times[warm])
    per_step = record_time / steps
    return Overhead(
        preset,
        steps,
        every,
        records,
        1000 * step_off,
        1000 * step_on,
        1000 * per_step,
        (step_on + per_step - step_off) / step_off,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="tiny-shampoo,tiny-muon")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=0, help="0: the preset's val_every")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for preset in args.presets.split(","):
        result = measure(preset, args.steps, args.every)
        results.append(result)
        print(
            f"{preset}: telemetry every {result.every} steps ({result.records} records): "
            f"step {result.step_off_ms:.1f} ms off, {result.step_on_ms:.1f} ms on, "
            f"+{result.record_ms_per_step:.2f} ms/step of records after the step; "
            f"overhead {100 * result.overhead:+.2f} %",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")


if __name__ == "__main__":
    main()
