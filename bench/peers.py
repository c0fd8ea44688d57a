"""Benchmark: each of our optimizers' steps against the implementation a user would pick instead.

Side by side in one process, on the same parameter shapes (default: one GPT-small block, four
768x768, one 768x3072, one 3072x768), the same fresh random gradients for both (untimed), in
interleaved rounds (the order alternates every round), medians over rounds:

==================================  =============================================  ==========
row                                 peer (a user's alternative)                    goal
==================================  =============================================  ==========
Muon, bf16 NS                       KellerJordan/Muon ``SingleDeviceMuon``         <= 0.8x
Muon, fp32 NS                       the same, its ``.bfloat16()`` cast -> float32  <= 0.8x
SOAP, mean of 10 steps              nikhilvyas/SOAP ``SOAP``                       <= 0.7x
SOAP, refresh step                  the same, the window's slowest step            <= 0.8x
Shampoo, freq 1 / freq 10           the reference ``distributed_shampoo``          <= 0.6x
AdamW                               ``torch.optim.AdamW`` fused / foreach          (none)
==================================  =============================================  ==========

Ours: Muon is ``DistributedShampoo`` with spectral descent at the trainer's Muon settings
(``train/optimizers.py``: momentum 0.95, Nesterov, 5 Newton-Schulz steps, Muon's shape scale),
its Newton-Schulz dtype automatic (bf16 where bf16 matmuls are fast) or forced to float32
against the fp32 peer; SOAP is the trainer's ``soap`` setup (``build_matrix_optimizer``) and the
peer gets
the same lr, betas, epsilon, weight decay and frequency; Shampoo is built with identical keyword
arguments from both libraries (their public names are the same): eigh roots, Adam grafting,
``max_preconditioner_dim`` 1024; AdamW is DistAdam (one process). One sample is a window of
steps (10 for SOAP and Shampoo freq 10: exactly one basis refresh / root computation each,
after warm-up past the first), its mean; SOAP's refresh row is the window's slowest step.

Peers are found where the arguments say (a directory holding ``muon.py``, ``soap.py``, or the
``distributed_shampoo`` package): ``git -C <bare repo> archive HEAD | tar -x -C DIR``. A peer
that is not given or not there is reported and skipped. The project never imports them.

Usage:
    python bench/peers.py [--muon DIR] [--soap DIR] [--distributed-shampoo DIR]
        [--device cpu|cuda] [--threads 2] [--rounds 5] [--rows muon,soap,shampoo,adamw]
        [--shapes 768x768,...] [--json OUT]

Measured figures and their command: ``docs/results/peers.md``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import torch

from nanoshampoo.io_utils import atomic_output
from nanoshampoo.optim.dist_adam import DistAdam
from nanoshampoo.optim.shampoo import (
    DistributedShampoo,
    NewtonSchulzOrthogonalizationConfig,
    SpectralDescentPreconditionerConfig,
    WeightDecayType,
)
from nanoshampoo.train.config import TrainConfig
from nanoshampoo.train.hardware import cpu_name
from nanoshampoo.train.setups.adam import AdamConfig, AdamWConfig
from nanoshampoo.train.setups.registry import BuildContext
from nanoshampoo.train.setups.shampoo_family import (
    MuonConfig,
    PreconditionerConfig,
    SoapConfig,
    build_matrix_optimizer,
    muon_shape_scale,
)

GPT_SMALL_SHAPES = "768x768,768x768,768x768,768x768,768x3072,3072x768"
ROWS = ("muon", "soap", "shampoo", "adamw")
Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class Figure:
    """One line of the table: a statistic of the timed windows, and its goal."""

    name: str
    statistic: str  # "mean": a window's mean step; "max": its slowest step
    goal: float | None


@dataclass(frozen=True)
class Row:
    """One comparison: our optimizer and the peer, timed over windows of ``window`` steps;
    each figure is read off the same windows."""

    peer_name: str
    ours: Factory
    peer: Factory
    window: int
    warmup: int
    figures: tuple[Figure, ...]


@dataclass
class Result:
    name: str
    peer_name: str
    peer_ms: float
    ours_ms: float
    ratio: float
    goal: float | None
    rounds: int

    @property
    def verdict(self) -> str:
        if self.goal is None:
            return "-"
        return "met" if self.ratio <= self.goal else "NOT met"


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``"768x768,4x3x3"`` -> ``[(768, 768), (4, 3, 3)]``; ValueError naming ``--shapes``."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes: expected items like 768x3072, got {item!r}")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def load_file_module(
    directory: Path | None, filename: str, flag: str, patch: tuple[str, str] | None = None
) -> tuple[ModuleType | None, str]:
    """Import ``directory/filename`` as a fresh module, or say why not: ``(module, message)``.

    ``patch = (old, new)`` replaces one exact source text first (the fp32 variant of a peer
    that hard-codes its dtype); a peer whose source lacks it is skipped, not half-patched.
    """
    if directory is None:
        return None, f"{flag} not given: skipped"
    path = directory / filename
    if not path.is_file():
        return None, f"{flag} {directory}: no {filename} there: skipped"
    source = path.read_text()
    if patch is not None:
        if source.count(patch[0]) != 1:
            return None, f"{path}: {patch[0]!r} not found once: fp32 variant skipped"
        source = source.replace(*patch)
    module = ModuleType(f"peer_{path.stem}_{len(sys.modules)}")
    module.__file__ = str(path)
    exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 - the user's peer
    return module, f"loaded {path}" + (" (float32 variant)" if patch else "")


def load_package(directory: Path | None, package: str, flag: str) -> tuple[ModuleType | None, str]:
    """Import ``package`` from ``directory`` (put first on ``sys.path``), or say why not."""
    if directory is None:
        return None, f"{flag} not given: skipped"
    if not (directory / package / "__init__.py").is_file():
        return None, f"{flag} {directory}: no {package}/ package there: skipped"
    sys.path.insert(0, str(directory))
    try:
        return importlib.import_module(package), f"loaded {directory / package}"
    finally:
        sys.path.remove(str(directory))


def ours_muon(compute_dtype: torch.dtype | str | None) -> Factory:
    """The trainer's Muon (its ``muon`` setup) with a given Newton-Schulz dtype."""
    cfg = TrainConfig(optimizer="muon")
    muon, pre = cfg.table(MuonConfig), cfg.table(PreconditionerConfig)

    def build(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        method = NewtonSchulzOrthogonalizationConfig(
            num_iterations=muon.ns_steps,
            scale_by_dims_fn=muon_shape_scale,
            compute_dtype=compute_dtype,
        )
        return DistributedShampoo(
            params,
            lr=muon.lr,
            betas=(muon.momentum, 1.0),
            beta3=muon.momentum**2,
            weight_decay=muon.weight_decay,
            precondition_frequency=1,
            use_bias_correction=False,
            grafting_config=None,
            max_preconditioner_dim=pre.max_preconditioner_dim,
            weight_decay_type=WeightDecayType.DECOUPLED,
            preconditioner_config=SpectralDescentPreconditionerConfig(method),
        )

    return build


def muon_rows(directory: Path | None, log: list[str]) -> list[Row]:
    muon = TrainConfig(optimizer="muon").table(MuonConfig)
    rows = []
    for label, patch, dtype in (
        ("bf16 NS, its default", None, "auto"),
        ("fp32 NS", ("X = G.bfloat16()", "X = G.float()"), torch.float32),
    ):
        module, message = load_file_module(directory, "muon.py", "--muon", patch)
        log.append(f"Muon ({label}): {message}")
        if module is None:
            continue
        peer = module.SingleDeviceMuon
        rows.append(
            Row(
                f"KellerJordan/Muon ({label})",
                ours_muon(dtype),
                lambda ps, peer=peer: peer(
                    ps, lr=muon.lr, weight_decay=muon.weight_decay, momentum=muon.momentum
                ),
                window=1,
                warmup=2,
                figures=(Figure(f"Muon, {label.split(',')[0]}", "mean", 0.8),),
            )
        )
    return rows


def soap_rows(directory: Path | None, log: list[str]) -> list[Row]:
    module, message = load_file_module(directory, "soap.py", "--soap")
    log.append(f"SOAP: {message}")
    if module is None:
        return []
    cfg = TrainConfig(optimizer="soap")
    soap = cfg.table(SoapConfig)
    frequency = soap.precondition_frequency

    def ours(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return build_matrix_optimizer(BuildContext({"matrix": params}, cfg, world_size=1), "soap")

    def peer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return module.SOAP(
            params,
            lr=soap.lr,
            betas=(soap.beta1, soap.beta2),
            eps=soap.epsilon,
            weight_decay=soap.weight_decay,
            precondition_frequency=frequency,
        )

    # Warm-up past both first bases (ours at step `frequency`, the peer's eigh at step 1) and
    # the peer's first QR refresh (its step frequency + 1).
    figures = (
        Figure(f"SOAP, mean of {frequency} steps", "mean", 0.7),
        Figure("SOAP, refresh step", "max", 0.8),
    )
    return [
        Row("nikhilvyas/SOAP", ours, peer, window=frequency, warmup=frequency + 2, figures=figures)
    ]


def shampoo_rows(directory: Path | None, log: list[str]) -> list[Row]:
    reference, message = load_package(directory, "distributed_shampoo", "--distributed-shampoo")
    log.append(f"Shampoo: {message}")
    if reference is None:
        return []
    ours = importlib.import_module("nanoshampoo.optim.shampoo")

    def factory(library: ModuleType, frequency: int) -> Factory:
        def build(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            return library.DistributedShampoo(
                params,
                lr=0.01,
                betas=(0.9, 0.999),
                epsilon=1e-12,
                weight_decay=0.0,
                max_preconditioner_dim=1024,
                precondition_frequency=frequency,
                start_preconditioning_step=frequency,
                use_bias_correction=True,
                grafting_config=library.AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
                preconditioner_config=library.RootInvShampooPreconditionerConfig(
                    amortized_computation_config=library.EigenConfig()
                ),
            )

        return build

    return [
        Row(
            "reference Distributed Shampoo",
            factory(ours, f),
            factory(reference, f),
            window=f,
            warmup=f + 1,
            figures=(Figure(f"Shampoo, freq {f}", "mean", 0.6),),
        )
        for f in (1, 10)
    ]


def adamw_rows(device: torch.device, log: list[str]) -> list[Row]:
    cfg = TrainConfig(optimizer="adamw")
    adamw = cfg.table(AdamWConfig)
    options = dict(
        lr=adamw.lr,
        betas=(adamw.beta1, adamw.beta2),
        eps=cfg.table(AdamConfig).eps,
        weight_decay=adamw.weight_decay,
    )

    def ours(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return DistAdam(params, launch="step", **options)

    log.append("AdamW: torch.optim.AdamW")
    return [
        Row(
            f"torch.optim.AdamW({impl}=True)",
            ours,
            lambda ps, impl=impl: torch.optim.AdamW(ps, **options, **{impl: True}),
            window=1,
            warmup=2,
            figures=(Figure(f"AdamW (DistAdam) vs {impl}", "mean", None),),
        )
        for impl in ("fused", "foreach")
    ]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_window(
    opt: torch.optim.Optimizer,
    params: Sequence[torch.nn.Parameter],
    grads: Sequence[Sequence[torch.Tensor]],
    device: torch.device,
) -> list[float]:
    """Seconds of each ``opt.step()`` over ``grads`` (one list of gradients per step)."""
    times = []
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        synchronize(device)
        start = time.perf_counter()
        opt.step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def run_row(
    row: Row, shapes: Sequence[tuple[int, ...]], device: torch.device, rounds: int
) -> list[Result]:
    """Warm both up, then ``rounds`` interleaved windows each; per figure, the medians over
    rounds of its window statistic."""
    gen = torch.Generator().manual_seed(0)
    initial = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    sides = {}
    for side, factory in (("ours", row.ours), ("peer", row.peer)):
        params = [torch.nn.Parameter(w.clone().to(device)) for w in initial]
        sides[side] = (params, factory(params))

    def gradients(steps: int) -> list[list[torch.Tensor]]:
        return [[torch.randn(s, generator=gen).to(device) for s in shapes] for _ in range(steps)]

    warmup = gradients(row.warmup)
    for params, opt in sides.values():
        time_window(opt, params, warmup, device)
    windows: dict[str, list[list[float]]] = {"ours": [], "peer": []}
    for index in range(rounds):
        grads = gradients(row.window)
        order = ("ours", "peer") if index % 2 == 0 else ("peer", "ours")
        for side in order:
            params, opt = sides[side]
            windows[side].append(time_window(opt, params, grads, device))
    results = []
    for figure in row.figures:
        reduce = statistics.fmean if figure.statistic == "mean" else max
        ours_s, peer_s = (
            statistics.median(reduce(w) for w in windows[side]) for side in ("ours", "peer")
        )
        results.append(
            Result(
                figure.name,
                row.peer_name,
                1e3 * peer_s,
                1e3 * ours_s,
                ours_s / peer_s,
                figure.goal,
                rounds,
            )
        )
    return results


def format_table(results: Sequence[Result]) -> str:
    lines = [
        "| optimizer | peer | peer ms | ours ms | ours / peer | goal | |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        goal = "-" if r.goal is None else f"<= {r.goal}x"
        lines.append(
            f"| {r.name} | {r.peer_name} | {r.peer_ms:.1f} | {r.ours_ms:.1f} | "
            f"{r.ratio:.2f}x | {goal} | {r.verdict} |"
        )
    return "\n".join(lines)


def build_rows(args: argparse.Namespace, device: torch.device, log: list[str]) -> list[Row]:
    builders: dict[str, Callable[[], list[Row]]] = {
        "muon": lambda: muon_rows(args.muon, log),
        "soap": lambda: soap_rows(args.soap, log),
        "shampoo": lambda: shampoo_rows(args.distributed_shampoo, log),
        "adamw": lambda: adamw_rows(device, log),
    }
    return [row for name in args.rows for row in builders[name]()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--muon", type=Path, help="directory holding KellerJordan/Muon's muon.py")
    parser.add_argument("--soap", type=Path, help="directory holding nikhilvyas/SOAP's soap.py")
    parser.add_argument(
        "--distributed-shampoo",
        type=Path,
        help="directory holding the reference distributed_shampoo package",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}"
    )
    parser.add_argument("--shapes", default=GPT_SMALL_SHAPES)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    args.shapes = parse_shapes(args.shapes)
    args.rows = [r.strip() for r in args.rows.split(",")]
    unknown = sorted(set(args.rows) - set(ROWS))
    if unknown or args.rounds < 1:
        parser.error(f"--rows: unknown {unknown}" if unknown else "--rounds must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> list[Result]:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    log: list[str] = []
    rows = build_rows(args, device, log)
    name = cpu_name() if device.type == "cpu" else torch.cuda.get_device_name(device)
    header = (
        f"device {device}: {name}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"shapes {args.shapes}, {args.rounds} rounds"
    )
    print(header)
    print("\n".join(log), flush=True)
    results = []
    for row in rows:
        for result in run_row(row, args.shapes, device, args.rounds):
            results.append(result)
            print(
                f"{result.name}: ours {result.ours_ms:.1f} ms, peer {result.peer_ms:.1f} ms",
                flush=True,
            )
    print(format_table(results))
    if args.json is not None:
        with atomic_output(args.json) as tmp:
            tmp.write_text(
                json.dumps(
                    {
                        "header": header,
                        "log": log,
                        "results": [asdict(r) | {"verdict": r.verdict} for r in results],
                    },
                    indent=2,
                )
            )
    return results


if __name__ == "__main__":
    main()
