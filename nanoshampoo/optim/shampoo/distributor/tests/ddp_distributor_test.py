"""DDP Shampoo (``DDPDistributedConfig``) against the single-device optimizer, on gloo.

The reference is ``DistributedShampoo`` with ``SingleDeviceDistributedConfig`` (itself checked
against a dense float64 reference in ``distributed_shampoo_test.py``), fed the same gradients.
Gradients come from a seeded generator, identical on every rank (the distributor assumes
gradients already averaged across ranks) and independent of the parameters, so that with
bfloat16 communication the only difference from the reference is the rounding of what
travels, which gives a tight error bound (see ``bf16_bound``).

Each spawned run checks several configurations, because a spawn costs about 3 s.
"""

from __future__ import annotations

import io
import logging
from typing import Any

import pytest
import torch

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DDPDistributedConfig,
    DistributedShampoo,
    SingleDeviceDistributedConfig,
)
from nanoshampoo.optim.shampoo.distributor.ddp_distributor import DDPDistributor
from nanoshampoo.testing.distributed import run_on_gloo

torch.set_num_threads(1)

MAX_DIM = 8
# Uneven blocks with max_preconditioner_dim 8: (6,5); (7,); (3,4,5); (16,5) -> 2 x (8,5);
# (10,7) -> (8,7), (2,7); (2,2) -> (4,); (20,3) -> 2 x (8,3), (4,3). 11 blocks in all.
UNEVEN_SHAPES = [(6, 5), (7,), (3, 4, 5), (16, 5), (10, 7), (2, 2), (20, 3)]
# Three blocks: at world size 4 one rank owns none.
FEW_SHAPES = [(6, 5), (7,), (2, 2)]
# Sixteen equal (8, 8) blocks, for the state-memory figures.
EQUAL_SHAPES = [(32, 16)] * 2
STEPS = 6
# The parameter whose gradient is None at step NO_GRAD_STEP (its blocks' state must not move).
NO_GRAD_PARAM, NO_GRAD_STEP = 1, 3
NAN_STEP = 4
# bfloat16 keeps 8 significant bits: round-to-nearest errs by at most 2**-9 relative; the
# bound allows twice that.
BF16_RELATIVE = 2.0**-8

HYPERPARAMETERS: dict[str, Any] = dict(
    lr=0.05,
    betas=(0.9, 0.999),
    epsilon=1e-8,
    momentum=0.5,
    max_preconditioner_dim=MAX_DIM,
    precondition_frequency=2,
    start_preconditioning_step=2,
    grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-8),
)


def initial_params(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def step_grads(shapes: list[tuple[int, ...]], step: int) -> list[torch.Tensor | None]:
    """The (already averaged) gradients of ``step``: same on every rank, independent of W."""
    generator = torch.Generator().manual_seed(1000 + step)
    grads: list[torch.Tensor | None] = [torch.randn(shape, generator=generator) for shape in shapes]
    if step == NO_GRAD_STEP:
        grads[NO_GRAD_PARAM] = None
    return grads


def make_optimizer(params: list[torch.Tensor], config: Any, **overrides: Any) -> DistributedShampoo:
    settings = {**HYPERPARAMETERS, "distributed_config": config, **overrides}
    return DistributedShampoo(params, **settings)


def train(
    shapes: list[tuple[int, ...]],
    config: Any,
    steps: range,
    params: list[torch.Tensor] | None = None,
    optimizer: DistributedShampoo | None = None,
    **overrides: Any,
) -> tuple[list[torch.Tensor], DistributedShampoo, list[list[torch.Tensor]]]:
    """Run ``steps``; returns params, optimizer and the params after every step."""
    if params is None:
        params = [torch.nn.Parameter(p) for p in initial_params(shapes)]
    if optimizer is None:
        optimizer = make_optimizer(params, config, **overrides)
    history = []
    for step in steps:
        for param, grad in zip(params, step_grads(shapes, step), strict=True):
            param.grad = grad
        optimizer.step()
        history.append([p.detach().clone() for p in params])
    return params, optimizer, history


def block_keys(optimizer: DistributedShampoo) -> list[str]:
    """``"<param_index>.<block_j>"`` of every block whose state this rank holds."""
    state = optimizer.state_dict()["state"]
    return sorted(
        {
            f"{index}.{key}"
            for index, entries in state.items()
            for key in entries
            if key.startswith("block_")
        }
    )


def round_trip(state_dict: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def resumed_params(shapes: list[tuple[int, ...]], config: Any) -> list[torch.Tensor]:
    """Train 3 steps, save this rank's state, load it into a fresh optimizer, train 3 more."""
    params, optimizer, _ = train(shapes, config, range(1, 4))
    saved = round_trip(optimizer.state_dict())
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = make_optimizer(copies, config)
    fresh.load_state_dict(saved)
    train(shapes, config, range(4, STEPS + 1), params=copies, optimizer=fresh)
    return [p.detach() for p in copies]


def skipped_nan_params(config: Any) -> list[torch.Tensor]:
    """Train with policy "skip"; at step NAN_STEP one entry of the last parameter's grad is NaN."""
    params = [torch.nn.Parameter(p) for p in initial_params(UNEVEN_SHAPES)]
    optimizer = make_optimizer(params, config, nonfinite_grad_policy="skip")
    for step in range(1, STEPS + 1):
        grads = step_grads(UNEVEN_SHAPES, step)
        if step == NAN_STEP:
            grads[-1][-1, -1] = float("nan")
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        optimizer.step()
    return [p.detach() for p in params]


# Hyperparameters set on the group after step 3 (momentum and filtering start from zero, a new
# epsilon/beta2 rebuilds the preconditioner).
CHANGED_AFTER_STEP_3: dict[str, Any] = dict(
    momentum=0.5, betas=(0.9, 0.99), epsilon=1e-6, weight_decay=0.01, lr=0.02
)


def changed_hyperparameters_run(
    shapes: list[tuple[int, ...]], config: Any
) -> tuple[list[torch.Tensor], str, bool]:
    """Steps 1-3 without momentum or filtering; an lr of inf is refused at step 4 on every rank
    (nothing moves); then CHANGED_AFTER_STEP_3 for steps 4-6.

    Returns the final params, the refusal message and whether the refused step left the
    params unchanged.
    """
    params, optimizer, history = train(
        shapes, config, range(1, 4), momentum=0.0, betas=(0.0, 0.999)
    )
    for param, grad in zip(params, step_grads(shapes, 4), strict=True):
        param.grad = grad
    optimizer.param_groups[0]["lr"] = float("inf")
    try:
        optimizer.step()
        message = ""
    except ValueError as error:
        message = str(error)
    unchanged = all(torch.equal(p, h) for p, h in zip(params, history[-1], strict=True))
    optimizer.param_groups[0].update(CHANGED_AFTER_STEP_3)
    train(shapes, config, range(4, STEPS + 1), params=params, optimizer=optimizer)
    return [p.detach() for p in params], message, unchanged


# (name, shapes, config) run on every rank; the parent compares each against the reference.
def cases(world_size: int) -> list[tuple[str, list[tuple[int, ...]], DDPDistributedConfig]]:
    half = max(world_size // 2, 1)
    return [
        ("fp32_updates", UNEVEN_SHAPES, DDPDistributedConfig()),
        ("fp32_params", UNEVEN_SHAPES, DDPDistributedConfig(communicate_params=True)),
        ("bf16_updates", UNEVEN_SHAPES, DDPDistributedConfig(communication_dtype=torch.bfloat16)),
        (
            "bf16_params",
            UNEVEN_SHAPES,
            DDPDistributedConfig(communication_dtype=torch.bfloat16, communicate_params=True),
        ),
        ("fp32_half_groups", UNEVEN_SHAPES, DDPDistributedConfig(num_trainers_per_group=half)),
        ("few_blocks_updates", FEW_SHAPES, DDPDistributedConfig()),
        ("few_blocks_params", FEW_SHAPES, DDPDistributedConfig(communicate_params=True)),
    ]


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def ddp_body(rank: int, world_size: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    logger = logging.getLogger("nanoshampoo.optim.shampoo.distributed_shampoo")
    for name, shapes, config in cases(world_size):
        warnings = _Warnings()
        logger.addHandler(warnings)
        try:
            params, optimizer, _ = train(shapes, config, range(1, STEPS + 1))
        finally:
            logger.removeHandler(warnings)
        result[name] = {
            "params": [p.detach() for p in params],
            "keys": block_keys(optimizer),
            "idle_warning": any(
                m.startswith("There is no params assigned to the current rank.")
                for m in warnings.messages
            ),
        }
    config = DDPDistributedConfig()
    result["resumed"] = resumed_params(UNEVEN_SHAPES, config)
    result["skipped_nan"] = skipped_nan_params(config)
    result["changed"] = {
        name: changed_hyperparameters_run(shapes, config)
        for name, shapes in (("uneven", UNEVEN_SHAPES), ("few", FEW_SHAPES))
    }
    equal_params = [torch.nn.Parameter(p) for p in initial_params(EQUAL_SHAPES)]
    result["equal_state_bytes"] = make_optimizer(equal_params, config).optimizer_state_bytes()
    try:
        make_optimizer(equal_params, DDPDistributedConfig(num_trainers_per_group=3))
        result["bad_group_error"] = ""
    except ValueError as error:
        result["bad_group_error"] = str(error)
    return result


def reference(
    shapes: list[tuple[int, ...]],
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Single-device params after STEPS steps, and the params before step 1 and after each step."""
    params, _, history = train(shapes, SingleDeviceDistributedConfig(), range(1, STEPS + 1))
    return [p.detach() for p in params], [initial_params(shapes)] + history


def bf16_bound(history: list[list[torch.Tensor]], communicate_params: bool) -> list[torch.Tensor]:
    """Elementwise bound on |DDP - reference| after bf16 communication.

    Updates travel (``False``): every step adds ``round(u_t)`` instead of ``u_t``, so the error
    is at most ``sum_t |u_t| * 2**-8``. Parameters travel (``True``): every step rounds the new
    parameter, so the error is at most ``sum_t |W_t| * 2**-8`` (to first order; the gradients do
    not depend on W, so errors do not feed back).
    """
    bounds = []
    for index in range(len(history[0])):
        if communicate_params:
            terms = [history[t][index].abs() for t in range(1, len(history))]
        else:
            terms = [
                (history[t][index] - history[t - 1][index]).abs() for t in range(1, len(history))
            ]
        bounds.append(BF16_RELATIVE * torch.stack(terms).sum(0))
    return bounds


def expected_keys(shapes: list[tuple[int, ...]]) -> list[str]:
    params = [torch.nn.Parameter(p) for p in initial_params(shapes)]
    return block_keys(make_optimizer(params, SingleDeviceDistributedConfig()))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_matches_single_device(world_size: int) -> None:
    results = run_on_gloo(ddp_body, world_size)
    references = {"uneven": reference(UNEVEN_SHAPES), "few": reference(FEW_SHAPES)}
    for name, shapes, config in cases(world_size):
        ref_params, history = references["uneven" if shapes is UNEVEN_SHAPES else "few"]
        per_rank = [result[name]["params"] for result in results]
        for rank_params in per_rank[1:]:  # ranks hold identical parameters, bit for bit
            for a, b in zip(per_rank[0], rank_params, strict=True):
                assert torch.equal(a, b), name
        if config.communication_dtype == torch.float32:
            for got, want in zip(per_rank[0], ref_params, strict=True):
                torch.testing.assert_close(got, want, rtol=0.0, atol=1e-6, msg=name)
        else:
            bounds = bf16_bound(history, config.communicate_params)
            for got, want, bound in zip(per_rank[0], ref_params, bounds, strict=True):
                assert bool(((got - want).abs() <= bound + 1e-7).all()), name
            assert any(not torch.equal(g, w) for g, w in zip(per_rank[0], ref_params)), name

        # Each trainer group holds every block exactly once; groups are replicas.
        trainers = config.num_trainers_per_group
        group_size = world_size if trainers == -1 else trainers
        for first in range(0, world_size, group_size):
            keys = [results[r][name]["keys"] for r in range(first, first + group_size)]
            flat = [key for rank_keys in keys for key in rank_keys]
            assert sorted(flat) == expected_keys(shapes), name
            assert keys == [results[r][name]["keys"] for r in range(group_size)], name
        if shapes is FEW_SHAPES and world_size > len(expected_keys(shapes)):
            assert any(result[name]["keys"] == [] for result in results), "a rank owns no block"
        # A rank that computes no block says so, in the reference's words; the others do not.
        for result in results:
            assert result[name]["idle_warning"] == (result[name]["keys"] == []), name

    # Resume from a per-rank state dict continues exactly like the uninterrupted run.
    for result in results:
        for got, want in zip(result["resumed"], result["fp32_updates"]["params"], strict=True):
            assert torch.equal(got, want)

    # Optimizer state per rank shrinks with the world size (16 equal blocks).
    params = [torch.nn.Parameter(p) for p in initial_params(EQUAL_SHAPES)]
    single = make_optimizer(params, SingleDeviceDistributedConfig()).optimizer_state_bytes()
    limit = {2: 0.6, 4: 0.35}[world_size]
    for result in results:
        assert 0 < result["equal_state_bytes"] <= limit * single
    assert sum(result["equal_state_bytes"] for result in results) == single

    for result in results:  # 3 divides neither 2 nor 4
        assert "num_trainers_per_group" in result["bad_group_error"]

    # Hyperparameters changed between steps: refused (lr inf) on every rank before anything
    # moves, applied (momentum, filtering, epsilon, beta2, decay) like on one device, also on
    # a rank that owns no block (FEW_SHAPES at world size 4).
    for name, shapes in (("uneven", UNEVEN_SHAPES), ("few", FEW_SHAPES)):
        want, _, _ = changed_hyperparameters_run(shapes, SingleDeviceDistributedConfig())
        for result in results:
            got, message, unchanged = result["changed"][name]
            assert (
                message.startswith("Invalid param_group[LR]=inf. Must be finite.") and unchanged
            ), (
                name,
                message,
            )
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=0.0, atol=1e-6, msg=name)

    # A NaN gradient seen by one rank's block makes every rank skip the step.
    want = skipped_nan_params(SingleDeviceDistributedConfig())
    for result in results:
        for got, expected in zip(result["skipped_nan"], want, strict=True):
            torch.testing.assert_close(got, expected, rtol=0.0, atol=1e-6)


def test_ddp_without_process_group_equals_single_device() -> None:
    """No process group: a world of one that owns every block, in either mode."""
    want, _ = reference(UNEVEN_SHAPES)
    for communicate_params in (False, True):
        config = DDPDistributedConfig(communicate_params=communicate_params)
        params, optimizer, _ = train(UNEVEN_SHAPES, config, range(1, STEPS + 1))
        for got, expected in zip(params, want, strict=True):
            torch.testing.assert_close(got.detach(), expected, rtol=0.0, atol=1e-6)
        assert block_keys(optimizer) == expected_keys(UNEVEN_SHAPES)


def test_num_trainers_per_group_must_divide_world_size() -> None:
    with pytest.raises(ValueError, match="num_trainers_per_group"):
        DDPDistributor([torch.zeros(4)], MAX_DIM, 0, DDPDistributedConfig(num_trainers_per_group=2))


def test_bytes_sent_without_peers_is_zero() -> None:
    distributor = DDPDistributor([torch.zeros(16, 5)], MAX_DIM, 0, DDPDistributedConfig())
    assert distributor.bytes_sent_per_step == 0
    assert distributor.communication_buffer_bytes == 16 * 5 * 4
