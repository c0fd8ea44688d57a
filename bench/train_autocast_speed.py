"""Median train-step time of the tiny GPT (AdamW) with and without bf16 autocast, on CPU, and
what the trainer's ``autocast="auto"`` probe decides on this machine (the two should agree).

Run: ``python bench/train_autocast_speed.py [--threads 2] [--steps 20] [--model tiny]``.
Alternates the two settings step by step so machine load affects both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nanoshampoo.model.gpt import GPT, gpt_preset
from nanoshampoo.train.hardware import resolve_autocast


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT(gpt_preset(args.model, args.vocab_size))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len))
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(2 * (args.steps + 2)):
        bf16 = i % 2 == 0
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 4:  # the first step of each setting warms up
            times[bf16].append(time.perf_counter() - start)
    tokens = args.batch_size * args.seq_len
    for bf16, ts in times.items():
        med = statistics.median(ts)
        print(
            f"autocast {'bf16' if bf16 else 'off'}: median step {1000 * med:.1f} ms, "
            f"{tokens / med:,.0f} tok/s"
        )
    print(
        f"speedup of bf16: {statistics.median(times[False]) / statistics.median(times[True]):.2f}x"
    )
    choice = resolve_autocast("auto", torch.device("cpu"))
    print(f"trainer's autocast=auto: {choice.name} ({choice.reason})")


if __name__ == "__main__":
    main()
