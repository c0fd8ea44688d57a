"""Schedule-Free and GPA under ``DDPDistributedConfig`` (gloo) against one process.

Each rank owns some blocks, keeps ``z`` only for those, and moves every parameter through the
distributor's exchange, on steps and on ``train()``/``eval()`` switches alike. The reference is
the single-device optimizer (itself checked against float64 loops of the papers' sequences in
``iterate_averaging_test.py``) fed the same gradients: seeded, identical on every rank (as DDP
leaves them after its all-reduce) and independent of the parameters.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DDPDistributedConfig,
    DistributedShampoo,
    GeneralizedPrimalAveragingConfig,
    ScheduleFreeConfig,
    SingleDeviceDistributedConfig,
)
from nanoshampoo.testing.distributed import run_on_gloo

torch.set_num_threads(1)

# With max_preconditioner_dim 8: (10, 7) -> (8, 7), (2, 7); (7,); (3, 4, 5); (6, 5): 5 blocks.
SHAPES = [(10, 7), (7,), (3, 4, 5), (6, 5)]
LRS = [0.01, 0.02, 0.03, 0.03, 0.02, 0.01]
EVAL_AFTER = 3  # eval(), a second eval(), then train() after this step
CONFIGS = {
    "schedule_free": ScheduleFreeConfig(train_interp_coeff=0.9),
    "gpa": GeneralizedPrimalAveragingConfig(eval_interp_coeff=0.8, train_interp_coeff=0.7),
}


def _settings(distributed_config: Any, averaging: Any) -> dict[str, Any]:
    return dict(
        lr=LRS[0], betas=(0.9, 0.99), epsilon=1e-12, weight_decay=0.01, max_preconditioner_dim=8,
        precondition_frequency=2, grafting_config=AdamPreconditionerConfig(beta2=0.99, epsilon=1e-8),
        iterate_averaging_config=averaging, distributed_config=distributed_config,
    )


def _grads(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def run(distributed_config: Any, averaging: Any) -> dict[str, list[torch.Tensor]]:
    """The parameters after every step, in eval mode after step ``EVAL_AFTER`` and at the end."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
    optimizer = DistributedShampoo(params, **_settings(distributed_config, averaging))
    snapshots: dict[str, list[torch.Tensor]] = {}
    for step, lr in enumerate(LRS, start=1):
        optimizer.param_groups[0]["lr"] = lr
        for param, grad in zip(params, _grads(step)):
            param.grad = grad
        optimizer.step()
        snapshots[f"step {step}"] = [p.detach().clone() for p in params]
        if step == EVAL_AFTER:
            optimizer.eval()
            optimizer.eval()
            snapshots["eval mid-run"] = [p.detach().clone() for p in params]
            optimizer.train()
    optimizer.eval()
    snapshots["eval at the end"] = [p.detach().clone() for p in params]
    return snapshots


def ddp_body(rank: int, world_size: int) -> dict[str, dict[str, list[torch.Tensor]]]:
    return {name: run(DDPDistributedConfig(), config) for name, config in CONFIGS.items()}


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_world_size_2_equals_one_process() -> None:
    results = run_on_gloo(ddp_body, 2)
    for name, config in CONFIGS.items():
        want = run(SingleDeviceDistributedConfig(), config)
        for rank_result in results:
            got = rank_result[name]
            assert got.keys() == want.keys()
            for key in want:
                for a, b in zip(got[key], want[key]):
                    torch.testing.assert_close(a, b, rtol=0.0, atol=1e-6, msg=f"{name}, {key}")
        # The averaged iterate differs from the training point (the switch did something).
        assert any(not torch.equal(a, b) for a, b in zip(want["eval mid-run"], want[f"step {EVAL_AFTER}"]))
