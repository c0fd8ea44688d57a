"""The DDP example without torchrun: a world of one process trains, and its check that every
rank holds rank 0's parameters runs and passes."""

from __future__ import annotations

import re
import socket

import pytest
import torch.distributed as dist

from nanoshampoo.optim.shampoo.examples.ddp_example import main


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_example_trains_as_a_world_of_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A port of its own: the example's default one may be taken by a test running beside it.
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    try:
        main(["--steps", "20"])
    finally:
        if dist.is_initialized():  # main failed before it left the group
            dist.destroy_process_group()
    out = capsys.readouterr().out
    losses = [float(loss) for loss in re.findall(r"^step \d+/20 loss (\S+)$", out, re.M)]
    assert len(losses) == 3 and losses[-1] < losses[0], out  # steps 1, 10 and 20
    assert "rank 0: max |param - rank 0 param| = 0\n" in out
    assert re.search(r"^optimizer state bytes per rank: \[\d+\]$", out, re.M), out
