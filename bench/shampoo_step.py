"""Benchmark: DistributedShampoo ``step()`` against AdamW, and where the Shampoo step's time goes.

Parameters: by default one GPT-small transformer block's matrices (four 768x768, one 768x3072,
one 3072x768; ``--shapes`` changes them). AdamW (``torch.optim.AdamW``, its default
implementation for the device) is timed first, in the same process, on the same shapes. Then
for each ``max_preconditioner_dim`` in ``--max-dims`` and ``precondition_frequency`` f in
``--frequencies``: Shampoo with eigh roots, factor matrices in ``--dtype``, Adam grafting;
``--amortize-roots on|both`` times the schedule that spreads the roots over the period too.
``--root-method eigh,warm-qr`` adds rows with roots warm-started from the previous eigenvectors
(``WarmStartedEigenConfig``; the fallback column is the share of warm solves that needed a full
eigh); ``--large-factor-multiplier 1,4`` adds rows where factors of at least
``--large-factor-dim`` (default 1024: GPT-small's 3072-dims split into 1024 blocks) get their
root every ``f * 4`` steps (the window is then a multiple of ``f * 4``). ``--eigh-split off|both``
adds rows
where each stack of factors is decomposed by one batched ``eigh`` with every thread instead of
being split over the threads (``preconditioner/parallel_eigh.py``), to measure that side by side.
``--precondition-dtype float32,bfloat16`` adds rows whose preconditioning GEMMs ``X_L G X_R`` run
in bfloat16 (``precondition_dtype``; the preconditioning column is their cost).

Every step gets fresh random gradients (untimed). Warm-up runs ``--warmup`` steps past the
first root computation (step f), so every timed step is preconditioned. The timed window is
``--steps`` rounded up to whole root periods (a multiple of f), so it holds the root
computations at their natural share. Printed per config:

* median step ms; amortized mean step ms (the window's mean, roots included); max step ms and
  max/median (the spike of the steps that compute every root at once);
* x AdamW: the amortized mean over AdamW's mean step;
* state B / param B: ``optimizer_state_bytes()`` over the parameters' bytes;
* the breakdown, ms per step (window mean) and % of the mean step:
  - statistics: the Shampoo preconditioner's ``update_statistics`` (factor updates);
  - roots: its ``amortized_computation`` (eigh and the inverse roots);
  - preconditioning: its ``precondition`` (the two-sided products);
  - grafting: the grafting preconditioner's ``update_statistics`` and ``precondition`` and the
    per-block norm scaling of the grafted update;
  - rest: the step minus the above (gradient gather, finiteness check, filtering, momentum,
    weight decay, parameter update).

Phases are timed by wrapping those methods of their classes for the Shampoo runs (restored
afterwards); a wrapped call inside another counts only in the outer one. On CPU the timers are
``time.perf_counter``; on CUDA they are CUDA events recorded around each call and read after the
step's closing ``synchronize``, so timing adds no host synchronization inside the step. Each step
starts on an idle device (synchronized before), so the step's event span is its wall time.

Usage:
    python bench/shampoo_step.py [--device cpu|cuda] [--dtype float32|bfloat16] [--threads N]
        [--steps 10] [--warmup 2] [--max-dims 1024,8192] [--frequencies 1,10]
        [--amortize-roots off|on|both] [--root-method eigh,warm-qr] [--warm-tolerance 0.05]
        [--warm-max-iterations 1] [--large-factor-dim 1024] [--large-factor-multiplier 1,4]
        [--eigh-split on|off|both] [--precondition-dtype float32,bfloat16]
        [--shapes 768x768,768x3072] [--json OUT]

Cost on a 2-core AMD EPYC (fp32, 2 threads): a max_dim 1024 step takes ~0.5 s without roots
and ~2.7 s with them; the 8192 rows add eigh of 3072x3072 factors (several seconds each), so
the default runs only max_dim 1024 (about a minute and a half) and ``--max-dims 1024,8192``
asks for both.

Measured figures, with their commands: ``docs/results/shampoo-step.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanoshampoo.io_utils import atomic_output
from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DistributedShampoo,
    EigenConfig,
    RootInvShampooPreconditionerConfig,
    WarmStartedEigenConfig,
)
from nanoshampoo.optim.shampoo.group_runtime import GroupRuntime
from nanoshampoo.optim.shampoo.preconditioner import parallel_eigh
from nanoshampoo.optim.shampoo.preconditioner.adagrad_preconditioner import AdaGradPreconditioner
from nanoshampoo.optim.shampoo.preconditioner.shampoo_preconditioner import ShampooPreconditioner

GPT_SMALL_SHAPES = "768x768,768x768,768x768,768x768,768x3072,3072x768"
PHASES = ("statistics", "roots", "preconditioning", "grafting", "rest")
ROOT_METHODS = ("eigh", "warm-qr")
BF16_STATES = ("roots", "grafting", "momentum")
NAME_WIDTH = 66
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The values an on/off/both flag runs (both: one row each, side by side).
SWITCH = {"off": (False,), "on": (True,), "both": (False, True)}

# (class, method, phase): the calls the breakdown times. The grafting norm scaling lives in the
# optimizer's per-group runtime, not in a preconditioner, hence the private class.
INSTRUMENTED_METHODS: tuple[tuple[type, str, str], ...] = (
    (ShampooPreconditioner, "update_statistics", "statistics"),
    (ShampooPreconditioner, "amortized_computation", "roots"),
    (ShampooPreconditioner, "precondition", "preconditioning"),
    (AdaGradPreconditioner, "update_statistics", "grafting"),
    (AdaGradPreconditioner, "precondition", "grafting"),
    (GroupRuntime, "_graft", "grafting"),
)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"768x768,768x3072"`` -> ``[(768, 768), (768, 3072)]``; ValueError naming ``--shapes``."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes: expected ROWSxCOLS items like 768x3072, got {item!r}")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def parse_positive_ints(text: str, flag: str) -> list[int]:
    """``"1,10"`` -> ``[1, 10]``; ValueError naming ``flag`` unless every item is an int >= 1."""
    items = [item.strip() for item in text.split(",")]
    if not all(item.isdigit() and int(item) >= 1 for item in items):
        raise ValueError(f"{flag}: expected comma-separated ints >= 1, got {text!r}")
    return [int(item) for item in items]


def make_params(
    shapes: Sequence[tuple[int, int]], device: torch.device
) -> list[torch.nn.Parameter]:
    """Float32 parameters of ``shapes`` (scaled normal, seed 0), on ``device``."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(device)) for s in shapes]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """Time marks on one device: ``time.perf_counter`` on CPU, recorded CUDA events on CUDA.

    ``seconds(start, end)`` of CUDA marks is valid only after the device was synchronized.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        if self._cuda:
            return start.elapsed_time(end) / 1e3
        return end - start


class PhaseTimer:
    """Sums the time of wrapped calls per phase; calls nested inside a timed call are not
    counted separately (their time is the outer call's)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._spans: list[tuple[str, Any, Any]] = []
        self._depth = 0

    def wrap(self, function: Callable[..., Any], phase: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return function(*args, **kwargs)
            self._depth += 1
            start = self._clock.mark()
            try:
                return function(*args, **kwargs)
            finally:
                self._spans.append((phase, start, self._clock.mark()))
                self._depth -= 1

        return timed

    def collect(self) -> dict[str, float]:
        """Seconds per phase since the last call (after the device was synchronized)."""
        totals = dict.fromkeys(PHASES[:-1], 0.0)
        for phase, start, end in self._spans:
            totals[phase] += self._clock.seconds(start, end)
        self._spans.clear()
        return totals


@contextmanager
def instrumented(timer: PhaseTimer) -> Iterator[None]:
    """Route ``INSTRUMENTED_METHODS`` through ``timer`` while the context is open.

    The wrapper is set on the named class itself, also where the method is inherited (so a
    sibling class sharing the base is not timed), and removed again afterwards.
    """
    own = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in INSTRUMENTED_METHODS]
    try:
        for owner, name, phase in INSTRUMENTED_METHODS:
            setattr(owner, name, timer.wrap(getattr(owner, name), phase))
        yield
    finally:
        for owner, name, original in own:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


@dataclass
class Result:
    """Timings of one optimizer config; ``phase_ms`` is empty for AdamW."""

    name: str
    step_ms: list[float]
    state_bytes_per_param_byte: float
    phase_ms: dict[str, float] = field(default_factory=dict)
    max_preconditioner_dim: int | None = None
    precondition_frequency: int | None = None
    root_method: str = "eigh"
    large_factor_multiplier: int = 1
    # warm-qr: warm-started root solves over the whole run (warm-up included), and how many of
    # them fell back to eigh.
    warm_solves: int = 0
    fallbacks: int = 0
    # Whether eigh stacks were split over the CPU threads (parallel_eigh; False: one batched call).
    eigh_split: bool = True
    # The dtype of the preconditioning GEMMs (precondition_dtype; float32: the blocks' own).
    precondition_dtype: str = "float32"

    @property
    def fallback_rate(self) -> float | None:
        return self.fallbacks / self.warm_solves if self.warm_solves else None

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.step_ms)

    @property
    def max_ms(self) -> float:
        return max(self.step_ms)

    def to_dict(self, adamw_mean_ms: float) -> dict[str, Any]:
        record = asdict(self)
        record.update(
            median_ms=self.median_ms,
            mean_ms=self.mean_ms,
            max_ms=self.max_ms,
            max_over_median=self.max_ms / self.median_ms,
            x_adamw=self.mean_ms / adamw_mean_ms,
            fallback_rate=self.fallback_rate,
        )
        return record


def time_steps(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.nn.Parameter],
    steps: int,
    warmup: int,
    clock: Clock,
    timer: PhaseTimer | None = None,
) -> tuple[list[float], dict[str, float]]:
    """Run ``warmup + steps`` steps; return the timed steps' ms and the mean ms per phase.

    Gradients are refreshed before each step, outside the timed span. The phase means include
    ``rest`` (the step minus the timed phases) when ``timer`` is given.
    """
    device = params[0].device
    step_ms: list[float] = []
    phase_sums = dict.fromkeys(PHASES, 0.0)
    for index in range(warmup + steps):
        for p in params:
            p.grad = torch.randn_like(p).mul_(1e-3)
        synchronize(device)
        start = clock.mark()
        optimizer.step()
        end = clock.mark()
        synchronize(device)
        seconds = clock.seconds(start, end)
        phases = timer.collect() if timer is not None else {}
        if index < warmup:
            continue
        step_ms.append(seconds * 1e3)
        for phase, value in phases.items():
            phase_sums[phase] += value * 1e3
        phase_sums["rest"] += (seconds - sum(phases.values())) * 1e3
    if timer is None:
        return step_ms, {}
    return step_ms, {phase: total / steps for phase, total in phase_sums.items()}


def bench_adamw(
    shapes: Sequence[tuple[int, int]], device: torch.device, steps: int, warmup: int
) -> Result:
    params = make_params(shapes, device)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    step_ms, _ = time_steps(optimizer, params, steps, warmup, Clock(device))
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    return Result("AdamW", step_ms, state / param_bytes)


def bench_shampoo(
    shapes: Sequence[tuple[int, int]],
    device: torch.device,
    factor_dtype: torch.dtype,
    max_dim: int,
    frequency: int,
    steps: int,
    warmup: int,
    amortize_roots: bool = False,
    root_method: str = "eigh",
    warm_config: WarmStartedEigenConfig | None = None,
    large_factor_dim: int = 0,
    large_factor_multiplier: int = 1,
    eigh_split: bool = True,
    packed: bool = False,
    bf16_state: Sequence[str] = (),
    precondition_dtype: str = "float32",
) -> Result:
    """One Shampoo config: ``root_method`` ``eigh`` (``EigenConfig``) or ``warm-qr``
    (``warm_config``, default ``WarmStartedEigenConfig()``); factors of at least
    ``large_factor_dim`` (0: none) get their root every ``frequency * large_factor_multiplier``
    steps; ``eigh_split`` False decomposes each stack by one batched ``eigh`` (as before
    :mod:`parallel_eigh`), by raising its size threshold for the run. ``packed``: factors as
    upper triangles (``use_symmetric_packing``); ``bf16_state``: which of ``roots``,
    ``grafting``, ``momentum`` are stored in bfloat16; ``precondition_dtype`` (a ``DTYPES``
    name): the dtype of the preconditioning GEMMs."""
    clock = Clock(device)
    timer = PhaseTimer(clock)
    solver = EigenConfig() if root_method == "eigh" else (warm_config or WarmStartedEigenConfig())

    def narrow(state: str) -> torch.dtype | None:
        return torch.bfloat16 if state in bf16_state else None

    # A whole number of root periods (of the large factors too), so the mean carries the
    # roots at their natural share.
    period = frequency * (large_factor_multiplier if large_factor_dim else 1)
    window = math.ceil(steps / period) * period
    with instrumented(timer), eigh_split_threshold(eigh_split):
        params = make_params(shapes, device)
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        shampoo = DistributedShampoo(
            params,
            lr=1e-3,
            betas=(0.9, 0.999),
            epsilon=1e-12,
            max_preconditioner_dim=max_dim,
            precondition_frequency=frequency,
            amortize_roots=amortize_roots,
            momentum_dtype=narrow("momentum"),
            # A bfloat16 EMA needs 1 - beta2 >= 2^-7 (the library refuses 0.999): the recipe's
            # 0.95 then; the cost and the bytes do not depend on beta2.
            grafting_config=AdamPreconditionerConfig(
                beta2=0.95 if narrow("grafting") else 0.999,
                epsilon=1e-8,
                second_moment_dtype=narrow("grafting"),
            ),
            preconditioner_config=RootInvShampooPreconditionerConfig(
                amortized_computation_config=solver,
                factor_matrix_dtype=factor_dtype,
                large_factor_dim=large_factor_dim,
                large_factor_frequency_multiplier=large_factor_multiplier,
                use_symmetric_packing=packed,
                inv_factor_matrix_dtype=narrow("roots"),
                precondition_dtype=(
                    None if precondition_dtype == "float32" else DTYPES[precondition_dtype]
                ),
            ),
        )
        # start_preconditioning_step = frequency: warm up past the first root computation.
        step_ms, phase_ms = time_steps(shampoo, params, window, warmup + frequency, clock, timer)
    never_called = [
        p for p in ("statistics", "roots", "preconditioning", "grafting") if phase_ms[p] == 0.0
    ]
    if never_called:
        raise RuntimeError(
            f"breakdown: no timed call for {never_called}; the optimizer no longer calls "
            f"{[f'{o.__name__}.{n}' for o, n, p in INSTRUMENTED_METHODS if p in never_called]}"
        )
    warm_solves, fallbacks = shampoo._runtimes[0].preconditioner.warm_start_counts()
    name = f"Shampoo max_dim={max_dim} freq={frequency}"
    if large_factor_dim and large_factor_multiplier > 1:
        name += f" large x{large_factor_multiplier}"
    if root_method != "eigh":
        name += f" {root_method}"
    if packed:
        name += " packed"
    if bf16_state:
        name += " bf16 " + "+".join(bf16_state)
    if precondition_dtype != "float32":
        name += f" {precondition_dtype} GEMMs"
    return Result(
        name + (" amortized" if amortize_roots else "") + ("" if eigh_split else " unsplit"),
        step_ms,
        shampoo.optimizer_state_bytes() / param_bytes,
        phase_ms,
        max_dim,
        frequency,
        root_method,
        large_factor_multiplier,
        warm_solves,
        fallbacks,
        eigh_split,
        precondition_dtype,
    )


@contextmanager
def eigh_split_threshold(split: bool) -> Iterator[None]:
    """``split`` False: no stack is split over threads (the threshold above any size) until exit."""
    before = parallel_eigh.MIN_PARALLEL_SIZE
    if not split:
        parallel_eigh.MIN_PARALLEL_SIZE = sys.maxsize
    try:
        yield
    finally:
        parallel_eigh.MIN_PARALLEL_SIZE = before


def cpu_model_name() -> str:
    """``lscpu``'s model name (falls back to /proc/cpuinfo, then ``platform``)."""
    try:
        listing = subprocess.run(
            ["lscpu"], capture_output=True, text=True, check=True, timeout=10
        ).stdout
        for line in listing.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment(device: torch.device) -> dict[str, Any]:
    """Where the timing was taken."""
    return {
        "cpu": cpu_model_name(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
    }


def format_report(
    env: dict[str, Any], settings: dict[str, Any], adamw: Result, results: Sequence[Result]
) -> str:
    """The x AdamW table and the breakdown table, as printed."""
    where = f"cpu: {env['cpu']}" + (f" | gpu: {env['gpu']}" if env["gpu"] else "")
    lines = [
        f"{where} | torch {env['torch']} | python {env['python']} | threads {env['threads']}",
        f"device {settings['device']} | factor dtype {settings['dtype']} | "
        f"roots {settings.get('roots', 'eigh')} | "
        f"steps {settings['steps']} (rounded up to whole root periods) | warmup "
        f"{settings['warmup']} "
        f"past the first root | shapes {settings['shapes']}",
        "",
        f"{'optimizer':<{NAME_WIDTH}} {'median ms':>10} {'mean ms':>10} {'max ms':>10} "
        f"{'max/med':>8} "
        f"{'x AdamW':>8} {'state B/param B':>16} {'fallback':>9}",
    ]
    for result in (adamw, *results):
        rate = result.fallback_rate
        lines.append(
            f"{result.name:<{NAME_WIDTH}} {result.median_ms:>10.2f} {result.mean_ms:>10.2f} "
            f"{result.max_ms:>10.2f} {result.max_ms / result.median_ms:>8.2f} "
            f"{result.mean_ms / adamw.mean_ms:>8.2f} {result.state_bytes_per_param_byte:>16.2f} "
            + (f"{100 * rate:>8.1f}%" if rate is not None else f"{'-':>9}")
        )
    lines += [
        "",
        "breakdown: ms per step (window mean) and % of the mean step; fallback: share of "
        "warm-started root solves (whole run) that fell back to eigh",
        f"{'optimizer':<{NAME_WIDTH}} " + " ".join(f"{p:>17}" for p in PHASES),
    ]
    for result in results:
        cells = [
            f"{result.phase_ms[p]:>9.2f} ({100 * result.phase_ms[p] / result.mean_ms:>4.1f}%)"
            for p in PHASES
        ]
        lines.append(f"{result.name:<{NAME_WIDTH}} " + " ".join(cells))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--dtype", default="float32", choices=tuple(DTYPES), help="factor matrix dtype"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (0: torch default)"
    )
    parser.add_argument(
        "--steps", type=int, default=10, help="timed steps (rounded up to whole root periods)"
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed steps after the first root computation"
    )
    parser.add_argument(
        "--max-dims", default="1024", help="comma-separated max_preconditioner_dim values"
    )
    parser.add_argument(
        "--frequencies", default="1,10", help="comma-separated precondition_frequency values"
    )
    parser.add_argument(
        "--amortize-roots",
        default="off",
        choices=("off", "on", "both"),
        help="amortize_roots of the Shampoo runs (both: one row each)",
    )
    parser.add_argument(
        "--root-method",
        default="eigh",
        help="comma-separated root methods: eigh, warm-qr (WarmStartedEigenConfig)",
    )
    parser.add_argument(
        "--warm-tolerance",
        type=float,
        default=WarmStartedEigenConfig().tolerance,
        help="warm-qr: accepted estimated direction error",
    )
    parser.add_argument(
        "--warm-max-iterations",
        type=int,
        default=WarmStartedEigenConfig().max_iterations,
        help="warm-qr: QR iterations before the eigh fallback",
    )
    parser.add_argument(
        "--large-factor-dim",
        type=int,
        default=1024,
        help="factors of at least this size get the multiplied root period",
    )
    parser.add_argument(
        "--large-factor-multiplier",
        default="1",
        help="comma-separated multipliers of their root period (1: off)",
    )
    parser.add_argument(
        "--eigh-split",
        default="on",
        choices=("on", "off", "both"),
        help="split each eigh stack over the CPU threads (parallel_eigh; off: one "
        "batched call; both: one row each)",
    )
    parser.add_argument(
        "--pack-factors",
        default="off",
        choices=("on", "off", "both"),
        help="factors as lower triangles (pack_factor_matrices); both: side by side",
    )
    parser.add_argument(
        "--bf16-state",
        default="",
        help="comma-separated states stored in bfloat16: roots, grafting, momentum",
    )
    parser.add_argument(
        "--precondition-dtype",
        default="float32",
        help="comma-separated dtypes of the preconditioning GEMMs: float32, "
        "bfloat16 (one row each)",
    )
    parser.add_argument(
        "--shapes", default=GPT_SMALL_SHAPES, help="comma-separated ROWSxCOLS parameter shapes"
    )
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)
        max_dims = parse_positive_ints(args.max_dims, "--max-dims")
        frequencies = parse_positive_ints(args.frequencies, "--frequencies")
        multipliers = parse_positive_ints(args.large_factor_multiplier, "--large-factor-multiplier")
        methods = [m.strip() for m in args.root_method.split(",")]
        if not set(methods) <= set(ROOT_METHODS):
            raise ValueError(
                f"--root-method: expected items of {list(ROOT_METHODS)}, got {args.root_method!r}"
            )
        bf16_state = tuple(x.strip() for x in args.bf16_state.split(",") if x.strip())
        if not set(bf16_state) <= set(BF16_STATES):
            raise ValueError(
                f"--bf16-state: expected items of {list(BF16_STATES)}, got {args.bf16_state!r}"
            )
        gemm_dtypes = [d.strip() for d in args.precondition_dtype.split(",")]
        if not set(gemm_dtypes) <= set(DTYPES):
            raise ValueError(
                f"--precondition-dtype: expected items of {list(DTYPES)}, got "
                f"{args.precondition_dtype!r}"
            )
        warm_config = WarmStartedEigenConfig(
            max_iterations=args.warm_max_iterations, tolerance=args.warm_tolerance
        )
    except ValueError as exc:
        parser.error(str(exc))
    if args.large_factor_dim < 0:
        parser.error("--large-factor-dim must be >= 0")
    if args.steps < 1 or args.warmup < 0 or args.threads < 0:
        parser.error("--steps must be >= 1, --warmup and --threads >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda requested but CUDA is not available")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    env = environment(device)
    settings = {
        "device": args.device,
        "dtype": args.dtype,
        "steps": args.steps,
        "warmup": args.warmup,
        "shapes": args.shapes,
        "amortize_roots": args.amortize_roots,
        "roots": args.root_method
        + (
            f" (warm-qr tolerance {args.warm_tolerance}, max {args.warm_max_iterations} "
            "QR iterations)"
            if "warm-qr" in methods
            else ""
        ),
        "large_factor_dim": args.large_factor_dim,
        "eigh_split": args.eigh_split,
        "pack_factors": args.pack_factors,
        "bf16_state": list(bf16_state),
        "precondition_dtype": gemm_dtypes,
    }

    adamw = bench_adamw(shapes, device, args.steps, args.warmup)
    results = [
        bench_shampoo(
            shapes,
            device,
            DTYPES[args.dtype],
            max_dim,
            frequency,
            args.steps,
            args.warmup,
            amortize,
            method,
            warm_config,
            args.large_factor_dim if multiplier > 1 else 0,
            multiplier,
            split,
            packed,
            bf16_state,
            gemm_dtype,
        )
        for max_dim in max_dims
        for frequency in frequencies
        for multiplier in multipliers
        for method in methods
        for amortize in SWITCH[args.amortize_roots]
        for split in SWITCH[args.eigh_split]
        for packed in SWITCH[args.pack_factors]
        for gemm_dtype in gemm_dtypes
    ]
    print(format_report(env, settings, adamw, results))
    if args.json:
        record = {
            "environment": env,
            "settings": settings,
            "adamw": adamw.to_dict(adamw.mean_ms),
            "shampoo": [r.to_dict(adamw.mean_ms) for r in results],
        }
        with atomic_output(args.json) as tmp:
            tmp.write_text(json.dumps(record, indent=2) + "\n")
        print(f"\nwrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
