"""What telemetry costs: step time with telemetry off and at a cadence, side by side in one run.

Two measurements, each interleaved so that machine load hits both sides alike:

1. ``steps`` (always): two copies of a preset's model and optimizers (same seed, same batches,
   fp32, no compile) step in turn, the order alternating every step. A *round* is one
   telemetry period (``every`` steps, default the preset's ``val_every``, the trainer's
   default cadence): the telemetry copy snapshots its matrices inside its recorded step and
   computes the records after it, as the trainer does. A round's sample is its mean time per
   step (the records' time included) on each side, both wall time and the CPU time of the
   process's one compute thread (``time.thread_time``, with ``--threads 1``: the work done,
   which other processes on a shared machine barely move); over ``--rounds`` rounds it reports
   mean and std of each side, the overhead ``mean_on / mean_off - 1``, the per-round ratios'
   mean and std, and Welch's two-sided p (``scipy.stats.ttest_ind(equal_var=False)``).
2. ``runs`` (``--runs N``): ``make train``'s command (``python -m nanoshampoo.train --preset
   P``) with the default telemetry and with ``--telemetry-every 0``, ``N`` runs each, the two
   alternating (which goes first alternates too); per run the process's wall time and the
   trainer's ``train_time_ms``, the same statistics, and whether every pair ended at the same
   final validation loss (telemetry must not change the training).

Only a machine with nothing else running gives figures worth quoting; on a shared one the
spread says how much the load moved them. Run::

    python bench/telemetry_overhead.py [--presets tiny-shampoo,tiny-muon] [--rounds 8]
        [--every 0] [--threads 1] [--runs 0] [--run-preset tiny-shampoo] [--json OUT]

``--every 0``: the preset's ``val_every``. ``--json`` also writes the figures with the command,
commit, machine and date; the commands and what they found: docs/results/telemetry.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from bench_facts import measured_facts
from scipy import stats

from nanoshampoo.io_utils import atomic_output
from nanoshampoo.model.gpt import GPT, gpt_preset
from nanoshampoo.train.config import TrainConfig
from nanoshampoo.train.distributed import DistributedContext
from nanoshampoo.train.machine import available_cores
from nanoshampoo.train.optimizers import OptimizerSetup, build_optimizer_setup
from nanoshampoo.train.presets import load_preset
from nanoshampoo.train.telemetry import Telemetry, resolve_every

VOCAB = 4096  # the embedded corpus's vocabulary
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Comparison:
    """Samples of one quantity with telemetry off and on, interleaved, and their statistics."""

    off: list[float]
    on: list[float]
    mean_off: float
    std_off: float
    mean_on: float
    std_on: float
    overhead: float  # mean_on / mean_off - 1
    ratio_mean: float  # mean of the paired (interleaved) on / off ratios, minus 1
    ratio_std: float
    welch_p: float

    @classmethod
    def of(cls, off: list[float], on: list[float]) -> Comparison:
        ratios = [b / a - 1.0 for a, b in zip(off, on)]
        return cls(
            off,
            on,
            statistics.fmean(off),
            statistics.stdev(off),
            statistics.fmean(on),
            statistics.stdev(on),
            statistics.fmean(on) / statistics.fmean(off) - 1.0,
            statistics.fmean(ratios),
            statistics.stdev(ratios),
            float(stats.ttest_ind(on, off, equal_var=False).pvalue),
        )


@dataclass
class StepOverhead:
    """Measurement 1 for one preset: per-round ms/step samples (records included on)."""

    preset: str
    every: int
    rounds: int
    records_per_round: int
    ms_per_step: Comparison
    cpu_ms_per_step: Comparison
    record_ms_per_round: float  # mean wall time of one round's records, after its recorded step


@dataclass
class RunOverhead:
    """Measurement 2: whole runs of ``make train``'s command, default telemetry against off."""

    preset: str
    runs: int
    command: str
    wall_s: Comparison
    train_time_s: Comparison
    same_final_val_loss: bool


def _build(cfg: TrainConfig) -> tuple[GPT, OptimizerSetup]:
    torch.manual_seed(cfg.run.seed)
    model = GPT(gpt_preset(cfg.model.name, VOCAB))
    return model, build_optimizer_setup(model, cfg, world_size=1)


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


def _since(start: tuple[float, float]) -> tuple[float, float]:
    """Wall and thread-CPU seconds since ``start`` (a :func:`_clocks` reading)."""
    wall, cpu = _clocks()
    return wall - start[0], cpu - start[1]


def _step(
    model: GPT, setup: OptimizerSetup, x: torch.Tensor, telemetry: Telemetry | None
) -> tuple[float, float]:
    """One step (forward, backward, the optimizers; the snapshot when ``telemetry``): wall and
    thread-CPU seconds."""
    start = _clocks()
    model(x[:, :-1], x[:, 1:]).backward()
    if telemetry is not None:
        telemetry.snapshot()
    for opt in setup.optimizers:
        opt.step()
    for opt in setup.optimizers:
        opt.zero_grad(set_to_none=True)
    return _since(start)


def measure_steps(preset: str, rounds: int, every: int) -> StepOverhead:
    """Measurement 1 (module docstring) for ``preset``: ``rounds`` rounds of ``every`` steps."""
    cfg = TrainConfig(**load_preset(preset), compile="false", autocast="off")
    every = every or resolve_every(cfg.run.telemetry_every, cfg.schedule.val_every)
    off_model, off_setup = _build(cfg)
    on_model, on_setup = _build(cfg)
    ctx = DistributedContext(0, 1, torch.device("cpu"), owns_process_group=False)
    telemetry = Telemetry(every, on_model, on_setup.groups["matrix"], on_setup.optimizers, [], ctx)
    generator = torch.Generator().manual_seed(0)

    def batch() -> torch.Tensor:
        return torch.randint(
            0, VOCAB, (cfg.data.batch_size, cfg.data.seq_len + 1), generator=generator
        )

    for _ in range(2):  # the first steps allocate the optimizers' state: not measured
        x = batch()
        _step(off_model, off_setup, x, None)
        _step(on_model, on_setup, x, None)
    # Per round and side: [wall ms/step, CPU ms/step].
    off_ms: list[list[float]] = []
    on_ms: list[list[float]] = []
    record_s, records, step = [], 0, 0
    for _ in range(rounds):
        off_total, on_total = [0.0, 0.0], [0.0, 0.0]

        def add(total: list[float], seconds: tuple[float, float]) -> None:
            total[0] += seconds[0]
            total[1] += seconds[1]

        for _ in range(every):
            x = batch()
            step += 1
            on_telemetry = telemetry if step % every == 0 else None
            # Alternate which copy goes first, so neither always runs on a warmer cache.
            if step % 2 == 0:
                add(off_total, _step(off_model, off_setup, x, None))
                add(on_total, _step(on_model, on_setup, x, on_telemetry))
            else:
                add(on_total, _step(on_model, on_setup, x, on_telemetry))
                add(off_total, _step(off_model, off_setup, x, None))
            if on_telemetry is not None:
                start = _clocks()
                records = len(telemetry.record(step))
                seconds = _since(start)
                record_s.append(seconds[0])
                add(on_total, seconds)
        off_ms.append([1000 * t / every for t in off_total])
        on_ms.append([1000 * t / every for t in on_total])
    return StepOverhead(
        preset,
        every,
        rounds,
        records,
        Comparison.of([w for w, _ in off_ms], [w for w, _ in on_ms]),
        Comparison.of([c for _, c in off_ms], [c for _, c in on_ms]),
        1000 * statistics.fmean(record_s),
    )


def _one_run(base: list[str], out_dir: Path, run_id: str, off: bool) -> tuple[float, float, float]:
    """``(wall s, train_time s, final val loss)`` of one trainer run."""
    command = [*base, "--out-dir", str(out_dir), "--run-id", run_id]
    if off:
        command += ["--telemetry-every", "0"]
    start = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out_dir / f"{run_id}.jsonl").read_text().splitlines()]
    train_ms = max(r["train_time_ms"] for r in records if r["kind"] == "train")
    val = [r["val_loss"] for r in records if r["kind"] == "val"][-1]
    return wall, train_ms / 1000, val


def measure_runs(preset: str, runs: int) -> RunOverhead:
    """Measurement 2 (module docstring): ``runs`` runs with and without telemetry, alternating."""
    base = [sys.executable, "-m", "nanoshampoo.train", "--preset", preset, "--progress", "false"]
    # make train's threads, all cores, pinned: the trainer's thread probe, left to itself, may
    # pick 1 thread in one run and 2 in the next on a noisy machine, which changes both the
    # time and the rounding, and telemetry would be blamed for it.
    base += ["--save-final-checkpoint", "false", "--threads", str(available_cores())]
    walls: dict[str, list[float]] = {"off": [], "on": []}
    trains: dict[str, list[float]] = {"off": [], "on": []}
    losses: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            for side in ("on", "off") if i % 2 == 0 else ("off", "on"):
                wall, train, val = _one_run(base, Path(tmp), f"{side}-{i}", off=side == "off")
                walls[side].append(wall)
                trains[side].append(train)
                losses[side].append(val)
    return RunOverhead(
        preset,
        runs,
        shlex.join(["python", *base[1:]]) + " [--telemetry-every 0]",
        Comparison.of(walls["off"], walls["on"]),
        Comparison.of(trains["off"], trains["on"]),
        losses["off"] == losses["on"],
    )


def _line(name: str, c: Comparison, unit: str) -> str:
    return (
        f"{name}: off {c.mean_off:.1f} ± {c.std_off:.1f} {unit}, on {c.mean_on:.1f} ± "
        f"{c.std_on:.1f} {unit} (n = {len(c.off)} each); overhead {100 * c.overhead:+.2f} % "
        f"(paired {100 * c.ratio_mean:+.2f} ± {100 * c.ratio_std:.2f} %), Welch p {c.welch_p:.2g}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="tiny-shampoo,tiny-muon")
    parser.add_argument("--rounds", type=int, default=8, help="telemetry periods per preset")
    parser.add_argument("--every", type=int, default=0, help="0: the preset's val_every")
    parser.add_argument(
        "--threads", type=int, default=1, help="threads of the step copies (--runs: all cores)"
    )
    parser.add_argument("--runs", type=int, default=0, help="trainer runs per side (0: none)")
    parser.add_argument("--run-preset", default="tiny-shampoo", help="the preset of --runs")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.rounds < 2 or args.runs == 1 or args.runs < 0:
        parser.error("--rounds must be at least 2 and --runs 0 or at least 2 (a std needs two)")
    torch.set_num_threads(args.threads)
    facts = measured_facts(args.threads)  # the commit of the code measured, before it runs
    steps = []
    for preset in args.presets.split(","):
        result = measure_steps(preset, args.rounds, args.every)
        steps.append(result)
        print(
            f"{preset}, telemetry every {result.every} steps ({result.records_per_round} records,"
            f" {result.record_ms_per_round:.0f} ms each round): "
            + _line("wall ms/step", result.ms_per_step, "ms")
            + "; "
            + _line("CPU ms/step", result.cpu_ms_per_step, "ms"),
            flush=True,
        )
    runs = None
    if args.runs:
        runs = measure_runs(args.run_preset, args.runs)
        print(
            f"{runs.command}: "
            + _line("wall", runs.wall_s, "s")
            + "; "
            + _line("train_time", runs.train_time_s, "s")
            + f"; same final val loss: {runs.same_final_val_loss}",
            flush=True,
        )
    if args.json:
        data = {
            "command": shlex.join(["python", "bench/telemetry_overhead.py", *sys.argv[1:]]),
            **facts,
            "steps": [asdict(s) for s in steps],
            "runs": None if runs is None else asdict(runs),
        }
        with atomic_output(args.json) as tmp:
            tmp.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
