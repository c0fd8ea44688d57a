"""Benchmark: DistributedShampoo ``step()`` time on GPT-small shaped parameters vs AdamW.

Parameters: four 768x768, one 768x3072, one 3072x768 (one transformer block's matrices).
For each ``max_preconditioner_dim`` in (1024, 8192) and ``precondition_frequency`` in (1, 10):
median and mean ``step()`` time over ``--steps`` timed steps (fresh random gradients each step;
warm-up excluded and running past the first root computation, so every timed step is
preconditioned; the mean includes the amortized root computations), the median's ratio to
``torch.optim.AdamW`` on the same parameters in the same run, and the optimizer-state bytes per
parameter byte.

Usage:
    python bench/shampoo_step.py [--device cpu|cuda] [--steps 20] [--warmup 3] [--threads N]
        [--max-dims 1024,8192] [--frequencies 1,10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nanoshampoo.optim.shampoo import AdamPreconditionerConfig, DistributedShampoo

GPT_SMALL_SHAPES = [(768, 768)] * 4 + [(768, 3072), (3072, 768)]


def make_params(device: torch.device) -> list[torch.nn.Parameter]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(device)) for s in GPT_SMALL_SHAPES]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_seconds(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int, warmup: int
) -> list[float]:
    """Wall times of ``optimizer.step()``; gradients are refreshed (untimed) before each."""
    device = params[0].device
    times = []
    for index in range(warmup + steps):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        synchronize(device)
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return times


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of distinct tensor storages held in the optimizer's state dict."""
    seen: dict[int, int] = {}
    for per_param in optimizer.state_dict()["state"].values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    parser.add_argument("--max-dims", default="1024,8192", help="comma-separated max_preconditioner_dim values")
    parser.add_argument("--frequencies", default="1,10", help="comma-separated precondition_frequency values")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda requested but CUDA is not available")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    params = make_params(device)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    adamw = torch.optim.AdamW(params, lr=1e-3)
    adamw_seconds = statistics.median(step_seconds(adamw, params, args.steps, args.warmup))
    adamw_state = sum(
        t.numel() * t.element_size() for s in adamw.state.values() for t in s.values() if t.dim() > 0
    )
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} steps={args.steps}")
    print(f"{'optimizer':<34} {'median step ms':>14} {'x AdamW':>8} {'mean step ms':>12} {'state B / param B':>18}")
    print(
        f"{'AdamW':<34} {adamw_seconds * 1e3:>14.2f} {1.0:>8.2f} {adamw_seconds * 1e3:>12.2f} "
        f"{adamw_state / param_bytes:>18.2f}"
    )
    for max_dim in (int(v) for v in args.max_dims.split(",")):
        for frequency in (int(v) for v in args.frequencies.split(",")):
            params = make_params(device)
            shampoo = DistributedShampoo(
                params, lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12,
                max_preconditioner_dim=max_dim, precondition_frequency=frequency,
                grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
            )
            # Warm up past start_preconditioning_step (= frequency) so every timed step is
            # preconditioned and the timed window holds roots at their natural frequency.
            times = step_seconds(shampoo, params, args.steps, args.warmup + frequency)
            seconds, mean = statistics.median(times), statistics.fmean(times)
            name = f"Shampoo max_dim={max_dim} freq={frequency}"
            print(
                f"{name:<34} {seconds * 1e3:>14.2f} {seconds / adamw_seconds:>8.2f} {mean * 1e3:>12.2f} "
                f"{state_bytes(shampoo) / param_bytes:>18.2f}"
            )


if __name__ == "__main__":
    main()
