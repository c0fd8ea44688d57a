"""DivergenceGuard: which numbers stop a run, and what the verdict names (one process)."""

from __future__ import annotations

import pytest
import torch

from nanoshampoo.train.distributed import DistributedContext
from nanoshampoo.train.divergence import DivergenceGuard
from nanoshampoo.train.outcomes import TrainingDiverged

CTX = DistributedContext(rank=0, world_size=1, device=torch.device("cpu"), owns_process_group=False)


def guarded_model() -> tuple[torch.nn.Module, DivergenceGuard]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    model(torch.randn(4, 3)).sum().backward()
    return model, DivergenceGuard(model, list(model.parameters()), CTX)


def test_finite_numbers_pass() -> None:
    model, guard = guarded_model()
    guard.check_step(5, torch.tensor(1.25))
    guard.check_validation(5, 3.5)
    guard.check_parameters(5)


def test_a_non_finite_gradient_names_the_first_such_parameter() -> None:
    model, guard = guarded_model()
    model[1].weight.grad[0, 1] = float("inf")
    with pytest.raises(
        TrainingDiverged,
        match=r"^non-finite gradient; first non-finite "
        r"gradient: 1\.weight$",
    ) as caught:
        guard.check_step(7, torch.tensor(2.0))
    assert caught.value.step == 7


def test_a_nan_loss_names_a_non_finite_parameter_first() -> None:
    model, guard = guarded_model()
    with torch.no_grad():
        model[0].bias[1] = float("nan")
    with pytest.raises(
        TrainingDiverged,
        match=r"^train loss is nan; first non-finite "
        r"parameter: 0\.bias$",
    ):
        guard.check_step(3, torch.tensor(float("nan")))


def test_a_nan_loss_with_finite_tensors_says_so() -> None:
    _, guard = guarded_model()
    with pytest.raises(TrainingDiverged, match="parameters and gradients finite on this rank"):
        guard.check_step(3, torch.tensor(float("inf")))


def test_unchecked_gradients_are_left_to_their_optimizer() -> None:
    model, _ = guarded_model()
    guard = DivergenceGuard(model, [model[0].weight], CTX)  # the others: DistAdam's own check
    model[1].weight.grad[0, 0] = float("nan")
    guard.check_step(1, torch.tensor(1.0))
    err = guard.non_finite_gradient(1, RuntimeError("DistAdam: non-finite"))
    assert (err.step, err.reason) == (1, "non-finite gradient; first non-finite gradient: 1.weight")


def test_validation_and_checkpoint_checks() -> None:
    model, guard = guarded_model()
    with pytest.raises(TrainingDiverged, match=r"^validation loss is inf$"):
        guard.check_validation(50, float("inf"))
    with torch.no_grad():
        model[1].weight[0, 0] = float("-inf")
    with pytest.raises(
        TrainingDiverged,
        match=r"before the checkpoint; first non-finite "
        r"parameter: 1\.weight",
    ):
        guard.check_parameters(50)
