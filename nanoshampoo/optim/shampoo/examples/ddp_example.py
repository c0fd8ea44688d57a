"""Train a small model with DDP gradients and DistributedShampoo(DDPDistributedConfig).

Run on 2 processes (gloo on CPU, NCCL when CUDA is available, one GPU per process)::

    torchrun --standalone --nproc_per_node=2 -m nanoshampoo.optim.shampoo.examples.ddp_example

Options: ``--steps N``, ``--communication-dtype {float32,bfloat16}``, ``--communicate-params``,
``--num-trainers-per-group K``. Without torchrun it runs as a world of one process.

Each rank draws its own batches; ``DistributedDataParallel`` averages the gradients, which is
what ``DDPDistributedConfig`` expects. Shampoo then computes the update of each rank's own
blocks only and exchanges the results, so rank 0 prints the loss and every rank checks that it
holds exactly the same parameters as rank 0.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DDPDistributedConfig,
    DistributedShampoo,
)

COMMUNICATION_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--communication-dtype", choices=sorted(COMMUNICATION_DTYPES), default="float32"
    )
    parser.add_argument("--communicate-params", action="store_true")
    parser.add_argument("--num-trainers-per-group", type=int, default=-1)
    return parser.parse_args(argv)


def init_distributed() -> torch.device:
    """Join the torchrun process group (or a world of one); NCCL on CUDA, gloo on CPU."""
    defaults = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531"}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 1),
    ).to(device)
    ddp_model = DistributedDataParallel(model)
    optimizer = DistributedShampoo(
        model.parameters(),
        lr=1e-2,
        betas=(0.9, 0.999),
        epsilon=1e-10,
        max_preconditioner_dim=32,
        precondition_frequency=5,
        grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
        distributed_config=DDPDistributedConfig(
            communication_dtype=COMMUNICATION_DTYPES[args.communication_dtype],
            num_trainers_per_group=args.num_trainers_per_group,
            communicate_params=args.communicate_params,
        ),
    )
    target = torch.randn(32, 1, generator=torch.Generator().manual_seed(1)).to(device)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    for step in range(1, args.steps + 1):
        inputs = torch.randn(64, 32, generator=data).to(device)
        labels = torch.tanh(inputs @ target / 4)
        loss = torch.nn.functional.mse_loss(ddp_model(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages the gradients across ranks
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if rank == 0 and (step == 1 or step % 10 == 0 or step == args.steps):
            print(f"step {step}/{args.steps} loss {mean_loss.item() / world_size:.5f}", flush=True)

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    difference = (flat - reference).abs().max().item()
    state = torch.tensor([optimizer.optimizer_state_bytes()], device=device)
    states = [torch.zeros_like(state) for _ in range(world_size)]
    dist.all_gather(states, state)
    if rank == 0:
        print(f"optimizer state bytes per rank: {[int(s.item()) for s in states]}")
    print(f"rank {rank}: max |param - rank 0 param| = {difference:g}", flush=True)
    dist.destroy_process_group()
    if difference != 0.0:
        raise SystemExit(f"rank {rank}: parameters differ from rank 0's")


if __name__ == "__main__":
    main()
