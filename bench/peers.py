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
HeavyBall SOAP / Muon, compiled     ``heavyball.SOAP`` / ``heavyball.Muon``        (none)
HeavyBall SOAP / Muon, eager        the same, ``heavyball.utils.compile_mode=None`` (none)
HeavyBall PSGD-Kron (both modes)    ``heavyball.PSGDKron`` against our SOAP        (none)
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

HeavyBall (``pip install heavyball``; a bench dependency only, a missing one skips its rows) at
the settings of :func:`heavyball_rows`, compiled as it ships (its own ``torch.compile`` mode) and
eager, both in this process (it reads its compile mode at every call). Its SOAP differs from
nikhilvyas/SOAP by design where no setting reaches: a bias-corrected ``shampoo_beta`` average
seeded with the first ``G G^T``, a QR refresh with a lifted null space, Adam's epsilon outside
the bias correction. Its Muon's Newton-Schulz iterates different coefficients per step (in
bf16 with stochastic rounding). A compile time is the peer's warm-up steps minus as many
steady steps, from a cold inductor cache.

Numerics check: both sides start from the same parameters and take the warm-up steps on the
same gradients; ``update difference`` is ``||d_peer - d_ours|| / ||d_ours||`` of the
parameters' changes (for HeavyBall SOAP against nikhilvyas/SOAP when ``--soap`` is given: ours
takes its first basis at step 10, the peers at step 1, so ours differs from both before then).

Peers are found where the arguments say (a directory holding ``muon.py``, ``soap.py``, or the
``distributed_shampoo`` package): ``git -C <bare repo> archive HEAD | tar -x -C DIR``. A peer
that is not given or not there is reported and skipped. The project never imports them.

Usage:
    python bench/peers.py [--muon DIR] [--soap DIR] [--distributed-shampoo DIR]
        [--device cpu|cuda] [--threads 2] [--rounds 5]
        [--rows muon,soap,shampoo,adamw,heavyball] [--heavyball soap,muon,psgd-kron]
        [--heavyball-modes compiled,eager] [--shapes 768x768,...] [--json OUT]

Measured figures and their command: ``docs/results/peers.md``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Protocol
from unittest import mock

import torch
from bench_facts import git_commit

from nanoshampoo.io_utils import atomic_output
from nanoshampoo.matmul_speed import probe_cpu_bf16_speedup
from nanoshampoo.optim.dist_adam import DistAdam
from nanoshampoo.optim.shampoo import (
    DistributedShampoo,
    NewtonSchulzOrthogonalizationConfig,
    SpectralDescentPreconditionerConfig,
    WeightDecayType,
)
from nanoshampoo.optim.shampoo.preconditioner.spectral_descent_preconditioner import (
    resolve_newton_schulz_dtype,
)
from nanoshampoo.train.config import TrainConfig
from nanoshampoo.train.machine import cpu_name
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
ROWS = ("muon", "soap", "shampoo", "adamw", "heavyball")
HEAVYBALL_OPTIMIZERS = ("soap", "muon", "psgd-kron")
HEAVYBALL_MODES = ("compiled", "eager")


class Steppable(Protocol):
    def step(self) -> object: ...


Factory = Callable[[list[torch.nn.Parameter]], Steppable]


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
    peer_compiles: bool = False  # report the peer's compile time (its first steps' excess)
    # The numerics check compares the peer's parameters after the warm-up with ours, or with
    # this implementation of the same algorithm (run on the same gradients, untimed); None and
    # ``checked=False``: no check (different algorithms).
    reference: tuple[str, Factory] | None = None
    checked: bool = True


@dataclass
class Result:
    name: str
    peer_name: str
    peer_ms: float
    ours_ms: float
    ratio: float
    goal: float | None
    rounds: int
    # ||peer's change of the parameters - ours|| / ||ours|| after the warm-up (same start, same
    # gradients), or against the row's reference: a numerics check that both do the same work.
    update_difference: float = float("nan")
    compared_with: str = "ours"
    # The peer's warm-up steps minus as many steady steps (seconds): its compile time.
    peer_compile_s: float | None = None

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
    dtype, reason = resolve_newton_schulz_dtype("auto", torch.float32, torch.device("cpu"))
    log.append(
        f"Muon: ours' Newton-Schulz dtype on this CPU: {dtype} ({reason}; bf16 matmul "
        f"{probe_cpu_bf16_speedup():.2f}x the speed of float32 by the probe)"
    )
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


def single_file_soap(module: ModuleType) -> Factory:
    """nikhilvyas/SOAP's ``SOAP`` at the trainer's ``soap`` settings."""
    soap = TrainConfig(optimizer="soap").table(SoapConfig)

    def build(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return module.SOAP(
            params,
            lr=soap.lr,
            betas=(soap.beta1, soap.beta2),
            eps=soap.epsilon,
            weight_decay=soap.weight_decay,
            precondition_frequency=soap.precondition_frequency,
        )

    return build


def ours_soap(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The trainer's ``soap`` setup."""
    context = BuildContext({"matrix": params}, TrainConfig(optimizer="soap"), world_size=1)
    return build_matrix_optimizer(context)


def soap_rows(directory: Path | None, log: list[str]) -> list[Row]:
    module, message = load_file_module(directory, "soap.py", "--soap")
    log.append(f"SOAP: {message}")
    if module is None:
        return []
    frequency = TrainConfig(optimizer="soap").table(SoapConfig).precondition_frequency
    # Warm-up past both first bases (ours at step `frequency`, the peer's eigh at step 1) and
    # the peer's first QR refresh (its step frequency + 1).
    figures = (
        Figure(f"SOAP, mean of {frequency} steps", "mean", 0.7),
        Figure("SOAP, refresh step", "max", 0.8),
    )
    return [
        Row(
            "nikhilvyas/SOAP",
            ours_soap,
            single_file_soap(module),
            window=frequency,
            warmup=frequency + 2,
            figures=figures,
        )
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


class CompileModeStep:
    """A HeavyBall optimizer stepped in one compile mode. HeavyBall reads its module-level
    ``heavyball.utils.compile_mode`` at every call of its fused functions (None: eager), so a
    compiled and an eager instance alternate in one process, each under its own mode."""

    def __init__(self, utils: ModuleType, optimizer: torch.optim.Optimizer, mode: str | None):
        self._utils, self._optimizer, self._mode = utils, optimizer, mode

    def step(self) -> object:
        previous = self._utils.compile_mode
        self._utils.compile_mode = self._mode
        try:
            return self._optimizer.step()
        finally:
            self._utils.compile_mode = previous


def heavyball_rows(
    optimizers: Sequence[str], modes: Sequence[str], soap_directory: Path | None, log: list[str]
) -> list[Row]:
    """HeavyBall's SOAP, Muon and PSGD-Kron, compiled as it intends and eager, against ours.

    Settings (the docstring's table says where they differ from ours): SOAP at the trainer's
    ``soap`` lr, betas (``shampoo_beta`` = beta2, as nikhilvyas/SOAP), epsilon, weight decay,
    frequency and block size (``max_precond_dim`` 8192: every GPT dim preconditioned, as ours);
    Muon at the trainer's lr, momentum and weight decay, with Nesterov heavy-ball momentum (the
    update direction of KellerJordan/Muon); PSGD-Kron at its defaults with its preconditioner
    updated every ``precondition_frequency`` steps (probability 1/F, accumulated, so exactly
    periodic) and a triangular factor for every dim (``max_size_triangular`` 8192), against our
    SOAP: no optimizer of ours computes PSGD's preconditioner.
    """
    try:
        heavyball = importlib.import_module("heavyball")
    except ImportError:
        log.append("HeavyBall: not installed (pip install heavyball): skipped")
        return []
    utils = heavyball.utils
    compiled_mode = utils.compile_mode
    log.append(
        f"HeavyBall {importlib.metadata.version('heavyball')}: compiled = its compile_mode "
        f"{compiled_mode!r}, eager = compile_mode None"
    )
    soap = TrainConfig(optimizer="soap").table(SoapConfig)
    muon = TrainConfig(optimizer="muon").table(MuonConfig)
    frequency = soap.precondition_frequency
    single_file, message = load_file_module(soap_directory, "soap.py", "--soap")
    soap_reference = (
        None if single_file is None else ("nikhilvyas/SOAP", single_file_soap(single_file))
    )
    log.append(
        "HeavyBall SOAP's numerics against "
        + ("nikhilvyas/SOAP" if single_file else f"ours ({message})")
    )
    # name -> (label, ours, HeavyBall's optimizer, window, numerics reference, checked)
    builders: dict[str, tuple[str, Factory, Factory, int, tuple[str, Factory] | None, bool]] = {
        "soap": (
            "SOAP",
            ours_soap,
            lambda ps: heavyball.SOAP(
                ps,
                lr=soap.lr,
                betas=(soap.beta1, soap.beta2),
                shampoo_beta=soap.beta2,
                eps=soap.epsilon,
                weight_decay=soap.weight_decay,
                precondition_frequency=frequency,
                max_precond_dim=8192,
            ),
            frequency,
            soap_reference,
            True,
        ),
        "muon": (
            "Muon",
            ours_muon("auto"),
            lambda ps: heavyball.Muon(
                ps,
                lr=muon.lr,
                betas=(muon.momentum, 0.99),  # its beta2 is unused by Muon
                weight_decay=muon.weight_decay,
                nesterov=True,
                heavyball_momentum=True,
            ),
            1,
            None,
            True,
        ),
        "psgd-kron": (
            "PSGD-Kron",
            ours_soap,
            lambda ps: heavyball.PSGDKron(
                ps, preconditioner_update_probability=1.0 / frequency, max_size_triangular=8192
            ),
            frequency,
            None,
            False,
        ),
    }
    rows = []
    for name in optimizers:
        label, ours, build_peer, window, reference, checked = builders[name]
        for mode in modes:
            compile_mode = compiled_mode if mode == "compiled" else None
            ours_label = "our SOAP" if name == "psgd-kron" else "ours"
            rows.append(
                Row(
                    f"HeavyBall {label} ({mode})",
                    ours,
                    lambda ps, build=build_peer, m=compile_mode: CompileModeStep(
                        utils, build(ps), m
                    ),
                    window=window,
                    warmup=window + 2,
                    figures=(Figure(f"HeavyBall {label}, {mode} ({ours_label})", "mean", None),),
                    peer_compiles=mode == "compiled",
                    reference=reference,
                    checked=checked,
                )
            )
    return rows


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


def update_difference(
    initial: Sequence[torch.Tensor],
    ours: Sequence[torch.nn.Parameter],
    peer: Sequence[torch.nn.Parameter],
) -> float:
    """``||d_peer - d_ours|| / ||d_ours||`` for the parameters' changes ``d`` since ``initial``,
    all parameters as one vector (float64)."""
    d_ours, d_peer = (
        torch.cat([(p.detach().cpu().double() - w.double()).flatten() for p, w in zip(ps, initial)])
        for ps in (ours, peer)
    )
    return float((d_peer - d_ours).norm() / d_ours.norm())


def run_row(
    row: Row, shapes: Sequence[tuple[int, ...]], device: torch.device, rounds: int
) -> list[Result]:
    """Warm both up on the same gradients (then compare what they did to the parameters), then
    ``rounds`` interleaved windows each; per figure, the medians over rounds of its window
    statistic."""
    gen = torch.Generator().manual_seed(0)
    initial = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    sides = {}
    for side, factory in (("ours", row.ours), ("peer", row.peer)):
        params = [torch.nn.Parameter(w.clone().to(device)) for w in initial]
        sides[side] = (params, factory(params))

    def gradients(steps: int) -> list[list[torch.Tensor]]:
        return [[torch.randn(s, generator=gen).to(device) for s in shapes] for _ in range(steps)]

    warmup = gradients(row.warmup)
    warmup_s = {
        side: time_window(opt, params, warmup, device) for side, (params, opt) in sides.items()
    }
    compared_with, difference = "ours", update_difference(initial, *(sides[s][0] for s in sides))
    if row.reference is not None:
        compared_with, factory = row.reference
        params = [torch.nn.Parameter(w.clone().to(device)) for w in initial]
        time_window(factory(params), params, warmup, device)
        difference = update_difference(initial, params, sides["peer"][0])
    elif not row.checked:
        compared_with, difference = "-", float("nan")
    windows: dict[str, list[list[float]]] = {"ours": [], "peer": []}
    for index in range(rounds):
        grads = gradients(row.window)
        order = ("ours", "peer") if index % 2 == 0 else ("peer", "ours")
        for side in order:
            params, opt = sides[side]
            windows[side].append(time_window(opt, params, grads, device))
    compile_s = None
    if row.peer_compiles:
        steady = statistics.median(statistics.fmean(w) for w in windows["peer"])
        compile_s = sum(warmup_s["peer"]) - len(warmup_s["peer"]) * steady
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
                difference,
                compared_with,
                compile_s,
            )
        )
    return results


def format_table(results: Sequence[Result]) -> str:
    lines = [
        "| optimizer | peer | peer ms | ours ms | ours / peer | goal | | update difference "
        "| against | peer compile s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        goal = "-" if r.goal is None else f"<= {r.goal}x"
        compile_s = "-" if r.peer_compile_s is None else f"{r.peer_compile_s:.1f}"
        lines.append(
            f"| {r.name} | {r.peer_name} | {r.peer_ms:.1f} | {r.ours_ms:.1f} | "
            f"{r.ratio:.2f}x | {goal} | {r.verdict} | {r.update_difference:.2g} | "
            f"{r.compared_with} | {compile_s} |"
        )
    return "\n".join(lines)


def build_rows(args: argparse.Namespace, device: torch.device, log: list[str]) -> list[Row]:
    builders: dict[str, Callable[[], list[Row]]] = {
        "muon": lambda: muon_rows(args.muon, log),
        "soap": lambda: soap_rows(args.soap, log),
        "shampoo": lambda: shampoo_rows(args.distributed_shampoo, log),
        "adamw": lambda: adamw_rows(device, log),
        "heavyball": lambda: heavyball_rows(args.heavyball, args.heavyball_modes, args.soap, log),
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
    parser.add_argument(
        "--heavyball",
        default=",".join(HEAVYBALL_OPTIMIZERS),
        help=f"HeavyBall optimizers of the heavyball rows, a subset of "
        f"{','.join(HEAVYBALL_OPTIMIZERS)}",
    )
    parser.add_argument(
        "--heavyball-modes",
        default=",".join(HEAVYBALL_MODES),
        help="compiled (HeavyBall's default compile_mode) and/or eager (compile_mode None)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    args.shapes = parse_shapes(args.shapes)
    for flag, allowed in (
        ("rows", ROWS),
        ("heavyball", HEAVYBALL_OPTIMIZERS),
        ("heavyball_modes", HEAVYBALL_MODES),
    ):
        chosen = [r.strip() for r in getattr(args, flag).split(",")]
        unknown = sorted(set(chosen) - set(allowed))
        if unknown:
            parser.error(f"--{flag.replace('_', '-')}: unknown {unknown}, choose from {allowed}")
        setattr(args, flag, chosen)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
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
    with ExitStack() as stack:
        if any(row.peer_compiles for row in rows) and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            # A compile time is a cold compile's: no kernels cached by an earlier run.
            cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="peers-inductor-"))
            stack.enter_context(mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": cache}))
            log.append("compile times: a cold inductor cache (a new TORCHINDUCTOR_CACHE_DIR)")
            print(log[-1], flush=True)
        commit = git_commit()  # of the code this run imported, not of a later checkout
        results = run_rows(
            rows, args, device, lambda done: write_json(args, header, commit, log, done)
        )
    print(format_table(results))
    return results


def write_json(
    args: argparse.Namespace, header: str, commit: str, log: list[str], results: Sequence[Result]
) -> None:
    """The results so far to ``--json`` (atomically, after every row: a stopped run keeps its
    finished rows; ``complete`` says whether every row ran)."""
    if args.json is None:
        return
    record = {
        "header": header,
        "machine": cpu_name() if args.device == "cpu" else torch.cuda.get_device_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "commit": commit,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "load_average": os.getloadavg()[0],
        "shapes": [list(s) for s in args.shapes],
        "log": log,
        "complete": len(results) == args.expected_results,
        "results": [asdict(r) | {"verdict": r.verdict} for r in results],
    }
    with atomic_output(args.json) as tmp:
        tmp.write_text(json.dumps(record, indent=2))


def run_rows(
    rows: Sequence[Row],
    args: argparse.Namespace,
    device: torch.device,
    after_row: Callable[[list[Result]], None],
) -> list[Result]:
    results: list[Result] = []
    args.expected_results = sum(len(row.figures) for row in rows)
    after_row(results)
    for row in rows:
        for result in run_row(row, args.shapes, device, args.rounds):
            results.append(result)
            print(
                f"{result.name}: ours {result.ours_ms:.1f} ms, peer {result.peer_ms:.1f} ms, "
                f"update difference {result.update_difference:.2g}"
                + (
                    ""
                    if result.peer_compile_s is None
                    else f", peer compile {result.peer_compile_s:.1f} s"
                ),
                flush=True,
            )
        after_row(results)
    return results


if __name__ == "__main__":
    main()
