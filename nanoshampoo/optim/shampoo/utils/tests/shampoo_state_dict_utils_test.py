import logging

import pytest
import torch
from torch import nn

from nanoshampoo.optim.shampoo.utils.optimizer_modules import OptimizerModule
from nanoshampoo.optim.shampoo.utils.shampoo_state_dict_utils import (
    extract_state_dict_content,
    update_param_state_dict_object,
)


class _Accumulator(OptimizerModule):
    def __init__(self, value: float = 0.0) -> None:
        self.sums = [torch.full((2,), value)]
        self.steps = 0


def _live_state() -> dict:
    return {
        "acc": _Accumulator(),
        "nested": {"momentum": torch.zeros(3), "inner": {"acc": _Accumulator()}},
        "linear": nn.Linear(2, 1),
        "step": 0,
        "lr": [0.1],
    }


def test_extract_state_dict_content_replaces_modules_and_recurses() -> None:
    state = _live_state()
    extracted = extract_state_dict_content(state)
    assert torch.equal(extracted["acc"]["sums"][0], torch.zeros(2))
    assert set(extracted["nested"]["inner"]["acc"]) == {"sums"}
    assert extracted["nested"]["momentum"] is state["nested"]["momentum"]
    assert extracted["linear"] is state["linear"]  # not an OptimizerModule: kept
    assert extracted["step"] == 0 and extracted["lr"] == [0.1]
    assert extract_state_dict_content({}) == {}


def test_update_param_state_dict_object_round_trip_in_place() -> None:
    saved_from = _live_state()
    saved_from["acc"].sums[0].fill_(2.0)
    saved_from["nested"]["momentum"].fill_(3.0)
    saved_from["nested"]["inner"]["acc"].sums[0].fill_(4.0)
    saved_from["step"] = 7
    saved = extract_state_dict_content(saved_from)
    saved["linear"] = saved_from["linear"].state_dict()

    live = _live_state()
    momentum = live["nested"]["momentum"]
    update_param_state_dict_object(live, saved)
    assert live["nested"]["momentum"] is momentum and torch.equal(momentum, torch.full((3,), 3.0))
    assert torch.equal(live["acc"].sums[0], torch.full((2,), 2.0))
    assert torch.equal(live["nested"]["inner"]["acc"].sums[0], torch.full((2,), 4.0))
    assert torch.equal(live["linear"].weight, saved_from["linear"].weight)
    assert live["step"] == 7
    saved["lr"].append(0.2)
    assert live["lr"] == [0.1]  # deep-copied, not aliased


def test_missing_key_of_the_current_state_raises_when_checked() -> None:
    # The check runs over the current state's keys, as in the reference library.
    with pytest.raises(KeyError, match=r"Key b not found in state dict to load\. Loaded keys"):
        update_param_state_dict_object({"a": 1, "b": 2}, {"a": 3})
    with pytest.raises(KeyError, match=r"Key y not found in state dict to load"):
        update_param_state_dict_object({"n": {"y": 1}}, {"n": {"x": 2}})


def test_extra_loaded_keys_are_ignored() -> None:
    live = {"a": torch.zeros(1)}
    update_param_state_dict_object(live, {"a": torch.ones(1), "extra": 3})
    assert set(live) == {"a"} and torch.equal(live["a"], torch.ones(1))


def test_missing_key_is_logged_and_kept_when_unchecked(caplog: pytest.LogCaptureFixture) -> None:
    live = {"a": torch.zeros(1), "acc": _Accumulator(1.0)}
    with caplog.at_level(logging.WARNING):
        update_param_state_dict_object(live, {"a": torch.ones(1)}, enable_missing_key_check=False)
    assert torch.equal(live["a"], torch.ones(1))
    assert torch.equal(live["acc"].sums[0], torch.full((2,), 1.0))  # left as it was
    assert "Key acc not found in state dict to load" in caplog.text


@pytest.mark.parametrize(
    ("loaded", "message"),
    [
        ({"t": torch.zeros(3), "d": {}}, r"'t': expected a tensor of shape \(2,\), got \(3,\)"),
        ({"t": 1.0, "d": {}}, r"'t': expected a tensor of shape \(2,\), got float"),
        ({"t": torch.zeros(2), "d": 5}, r"'d': expected a mapping to load into a dict, got int"),
    ],
)
def test_value_mismatches_raise_value_error(loaded: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        update_param_state_dict_object({"t": torch.zeros(2), "d": {}}, loaded)
