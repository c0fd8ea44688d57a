"""DistributedShampoo.load_state_dict (torch's own, through the optimizer's hooks and
``__setstate__``) checks the whole state dict before it writes anything."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from flat_shampoo_state import assert_same_flat_state, flat_state

from nanoshampoo.optim.shampoo import AdamPreconditionerConfig, DistributedShampoo

torch.set_num_threads(1)

# Several parameters and blocks, so that a defect in the last one would come after earlier
# blocks were written by a loader that writes as it checks.
SHAPES = [(6, 5), (7,), (10, 3), (3, 4, 5)]


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _optimizer(params: list[torch.nn.Parameter], **overrides: Any) -> DistributedShampoo:
    kwargs: dict[str, Any] = dict(
        lr=0.01,
        betas=(0.9, 0.99),
        epsilon=1e-8,
        momentum=0.5,
        weight_decay=0.01,
        max_preconditioner_dim=8,
        grafting_config=AdamPreconditionerConfig(),
    )
    return DistributedShampoo(params, **{**kwargs, **overrides})


def _train(
    opt: DistributedShampoo, params: list[torch.nn.Parameter], seed: int, steps: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def _snapshot(opt: DistributedShampoo) -> dict[str, Any]:
    state_dict = opt.state_dict()
    return {
        "state": flat_state(state_dict),
        "param_groups": copy.deepcopy(state_dict["param_groups"]),
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert_same_flat_state(a["state"], b["state"])


def _last_block(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The last parameter's last block (``block_0`` of the (3, 4, 5) parameter)."""
    entry = state_dict["state"][max(state_dict["state"])]
    return entry[max(k for k in entry if k.startswith("block_"))]


def _missing_key(sd: dict[str, Any]) -> None:
    del _last_block(sd)["filtered_grad"]


def _unexpected_key(sd: dict[str, Any]) -> None:
    _last_block(sd)["extra"] = torch.zeros(1)


def _wrong_shape(sd: dict[str, Any]) -> None:
    block = _last_block(sd)
    block["momentum_buffer"] = torch.zeros(block["momentum_buffer"].numel() + 1)


def _wrong_dtype(sd: dict[str, Any]) -> None:
    _last_block(sd)["adagrad"] = _last_block(sd)["adagrad"].double()


def _not_a_tensor(sd: dict[str, Any]) -> None:
    _last_block(sd)["filtered_grad"] = 1.0


def _nan_lr(sd: dict[str, Any]) -> None:
    sd["param_groups"][0]["lr"] = math.nan


def _scalar_betas(sd: dict[str, Any]) -> None:
    sd["param_groups"][0]["betas"] = 0.9


def _negative_step(sd: dict[str, Any]) -> None:
    for entry in sd["state"].values():
        entry["step"] = torch.tensor(-1)


def _other_blocking(sd: dict[str, Any]) -> None:
    sd["param_groups"][0]["max_preconditioner_dim"] = 4


def _momentum_off(sd: dict[str, Any]) -> None:
    # The state still holds momentum, which a group without momentum does not have.
    sd["param_groups"][0]["momentum"] = 0.0


CORRUPTIONS: list[tuple[Callable[[dict[str, Any]], None], type[Exception], str]] = [
    (_missing_key, KeyError, r"missing block state 3\.block_0\.filtered_grad"),
    (_unexpected_key, KeyError, r"unexpected block state in state_dict: \['3\.block_0\.extra'\]"),
    (
        _wrong_shape,
        ValueError,
        r"3\.block_0\.momentum_buffer must be a torch.float32 tensor of shape \(3, 4, 5\)",
    ),
    (_wrong_dtype, ValueError, r"3\.block_0\.adagrad must be a torch.float32 tensor"),
    (_not_a_tensor, ValueError, "got float"),
    (_nan_lr, ValueError, r"Invalid param_group\[LR\]=nan\. Must be >= 0\.0\."),
    (_scalar_betas, ValueError, "betas must be a pair"),
    (_negative_step, ValueError, r"state\[0\]\['step'\] must be"),
    (_other_blocking, ValueError, "max_preconditioner_dim"),
    (_momentum_off, KeyError, "unexpected block state.*momentum_buffer"),
]


@pytest.mark.parametrize(
    ("corrupt", "error", "match"), CORRUPTIONS, ids=[c.__name__[1:] for c, _, _ in CORRUPTIONS]
)
def test_a_bad_state_dict_raises_and_leaves_every_block_bit_identical(
    corrupt: Callable[[dict[str, Any]], None], error: type[Exception], match: str
) -> None:
    source_params = _params(0)
    source = _optimizer(
        source_params, lr=0.02
    )  # another lr: a loader that writes groups early shows
    _train(source, source_params, seed=1, steps=3)
    saved = copy.deepcopy(source.state_dict())
    corrupt(saved)

    target_params = _params(0)
    target = _optimizer(target_params)
    _train(target, target_params, seed=2, steps=2)  # state differs from the source's everywhere
    before = _snapshot(target)
    with pytest.raises(error, match=match):
        target.load_state_dict(saved)
    _assert_same(_snapshot(target), before)


def test_checkpoint_after_hyperparameter_changes_resumes_bit_identically() -> None:
    """A checkpoint saved after momentum was turned on and epsilon/betas changed loads into a
    fresh optimizer built with the original values; the continuation equals the uninterrupted
    run."""

    def run(
        params: list[torch.nn.Parameter], opt: DistributedShampoo, first: int, last: int
    ) -> None:
        for step in range(first, last):
            if step == 2:
                opt.param_groups[0].update(momentum=0.9, epsilon=1e-6, betas=(0.95, 0.999))
            _train(opt, params, seed=100 + step, steps=1)

    reference_params = _params(0)
    reference = _optimizer(reference_params, momentum=0.0, betas=(0.0, 0.99))
    run(reference_params, reference, 0, 6)

    first_params = _params(0)
    first = _optimizer(first_params, momentum=0.0, betas=(0.0, 0.99))
    run(first_params, first, 0, 4)
    checkpoint = copy.deepcopy(first.state_dict())
    assert "momentum_buffer" in checkpoint["state"][0]["block_0"]

    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in first_params]
    resumed = _optimizer(resumed_params, momentum=0.0, betas=(0.0, 0.99))
    resumed.load_state_dict(checkpoint)
    assert (
        resumed.param_groups[0]["betas"] == (0.95, 0.999)
        and resumed.param_groups[0]["momentum"] == 0.9
    )
    run(resumed_params, resumed, 4, 6)
    for p, q in zip(reference_params, resumed_params, strict=True):
        assert torch.equal(p, q)
    _assert_same(_snapshot(resumed), _snapshot(reference))
