"""``--tensorboard``: the scalars read back from the event file, and one line without the
package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from nanoshampoo.errors import UserError
from nanoshampoo.train import tensorboard_scalars
from nanoshampoo.train.tensorboard_scalars import INSTALL_HINT, TensorBoardScalars


def test_without_tensorboard_one_line_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        tensorboard_scalars.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    with pytest.raises(UserError) as raised:
        TensorBoardScalars(str(tmp_path), "run", enabled=True)
    assert str(raised.value) == INSTALL_HINT and "\n" not in INSTALL_HINT
    assert "pip install 'nanoshampoo[tensorboard]'" in INSTALL_HINT


def test_loss_lr_and_telemetry_are_scalars_by_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the optional extra: pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.25)
    scalars = TensorBoardScalars(str(tmp_path), "run", enabled=True)
    scalars.train(10, 4.5, [opt])
    scalars.val(10, 4.75)
    scalars.telemetry(
        [{"kind": "telemetry", "step": 10, "layer": "blocks.0.w", "update_ratio": 0.01,
          "factor0.condition_number": float("inf")}]
    )  # fmt: skip
    scalars.close()
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    read = {
        tag: [(e.step, pytest.approx(e.value)) for e in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
    }
    assert read == {
        "loss/train": [(10, 4.5)],
        "loss/val": [(10, 4.75)],
        "lr/0.0": [(10, 0.25)],
        "telemetry/update_ratio/blocks.0.w": [(10, 0.01)],
    }
    assert not TensorBoardScalars(str(tmp_path / "off"), "run", enabled=False)._writer
