"""bench/peers.py: peers missing are reported and skipped; fake peers run every row end to end.

The fakes stand in for the real single files and the reference package (which the project's
tests never need): a ``muon.py`` whose ``SingleDeviceMuon`` is SGD and carries the bf16 cast the
fp32 variant patches, a ``soap.py`` whose ``SOAP`` is Adam, and a ``distributed_shampoo``
package that re-exports our own library (same public names, so identical keyword arguments).
"""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch
from bench_scripts_test import load_script

TINY = "96x96,96x192,192x96"  # 96 * 96 > 8192: stays a matrix at max_preconditioner_dim 8192

FAKE_MUON = """
import torch

def zeropower(G):
    X = G.bfloat16()
    return X

class SingleDeviceMuon(torch.optim.SGD):
    def __init__(self, params, lr=0.02, weight_decay=0, momentum=0.95):
        super().__init__(params, lr=lr, weight_decay=weight_decay, momentum=momentum)
"""

FAKE_SOAP = """
import torch

class SOAP(torch.optim.Adam):
    def __init__(self, params, lr, betas, eps, weight_decay, precondition_frequency):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
"""


@pytest.fixture(scope="module")
def peers():
    return load_script("peers.py")


def test_missing_peers_are_reported_and_skipped(
    peers, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = peers.main(
        ["--shapes", TINY, "--rounds", "1", "--rows", "muon,soap,shampoo", "--soap", str(tmp_path)]
    )
    assert results == []
    out = capsys.readouterr().out
    assert "Muon (bf16 NS, its default): --muon not given: skipped" in out
    assert f"SOAP: --soap {tmp_path}: no soap.py there: skipped" in out
    assert "Shampoo: --distributed-shampoo not given: skipped" in out


def test_fake_peers_run_every_row(peers, tmp_path: Path) -> None:
    (tmp_path / "muon.py").write_text(FAKE_MUON)
    (tmp_path / "soap.py").write_text(FAKE_SOAP)
    package = tmp_path / "distributed_shampoo"
    package.mkdir()
    (package / "__init__.py").write_text("from nanoshampoo.optim.shampoo import *\n")
    out = tmp_path / "peers.json"
    results = peers.main(
        [
            "--shapes",
            TINY,
            "--rounds",
            "2",
            "--muon",
            str(tmp_path),
            "--soap",
            str(tmp_path),
            "--distributed-shampoo",
            str(tmp_path),
            "--rows",
            "muon,soap,shampoo,adamw",
            "--json",
            str(out),
        ]
    )
    assert [r.name for r in results] == [
        "Muon, bf16 NS",
        "Muon, fp32 NS",
        "SOAP, mean of 10 steps",
        "SOAP, refresh step",
        "Shampoo, freq 1",
        "Shampoo, freq 10",
        "AdamW (DistAdam) vs fused",
        "AdamW (DistAdam) vs foreach",
    ]
    for r in results:
        assert math.isfinite(r.ratio) and r.ratio > 0 and r.ours_ms > 0 and r.peer_ms > 0
        assert math.isclose(r.ratio, r.ours_ms / r.peer_ms, rel_tol=1e-9)
    saved = json.loads(out.read_text())
    assert [r["name"] for r in saved["results"]] == [r.name for r in results]
    assert saved["complete"] is True
    assert "(float32 variant)" in " ".join(saved["log"])


def test_an_fp32_variant_without_the_cast_is_skipped_not_half_patched(
    peers, tmp_path: Path
) -> None:
    (tmp_path / "muon.py").write_text(FAKE_MUON.replace("G.bfloat16()", "G.half()"))
    log: list[str] = []
    rows = peers.muon_rows(tmp_path, log)
    assert [f.name for r in rows for f in r.figures] == ["Muon, bf16 NS"]
    assert "not found once: fp32 variant skipped" in log[-1]


@pytest.mark.parametrize(
    "ratio, goal, verdict", [(0.5, 0.6, "met"), (0.7, 0.6, "NOT met"), (3.0, None, "-")]
)
def test_verdict_compares_the_ratio_with_the_goal(
    peers, ratio: float, goal: float | None, verdict: str
) -> None:
    result = peers.Result("x", "y", peer_ms=1.0, ours_ms=ratio, ratio=ratio, goal=goal, rounds=1)
    assert result.verdict == verdict
    assert f"| {ratio:.2f}x |" in peers.format_table([result])


def test_bad_shapes_name_the_flag(peers) -> None:
    with pytest.raises(ValueError, match="^--shapes"):
        peers.parse_shapes("768x0")


def test_heavyball_rows_run_eager_with_their_numerics_check(peers, tmp_path: Path) -> None:
    """HeavyBall's three optimizers eager (compiling them takes minutes: the bench's job, not
    a test's), at TINY shapes; its SOAP checked against the single file (here the Adam fake),
    its Muon against ours, PSGD-Kron against nothing (no optimizer of ours computes it)."""
    pytest.importorskip("heavyball")
    (tmp_path / "soap.py").write_text(FAKE_SOAP)
    out = tmp_path / "peers.json"
    results = peers.main(
        [
            "--shapes",
            TINY,
            "--rounds",
            "1",
            "--rows",
            "heavyball",
            "--heavyball-modes",
            "eager",
            "--soap",
            str(tmp_path),
            "--json",
            str(out),
        ]
    )
    assert [(r.name, r.compared_with) for r in results] == [
        ("HeavyBall SOAP, eager (ours)", "nikhilvyas/SOAP"),
        ("HeavyBall Muon, eager (ours)", "ours"),
        ("HeavyBall PSGD-Kron, eager (our SOAP)", "-"),
    ]
    for r in results:
        assert r.peer_compile_s is None and r.ours_ms > 0 and r.peer_ms > 0
    # Muon: the same update direction; the Newton-Schulz polynomials differ (0.2 at 1e-3 lr).
    assert 0 < results[1].update_difference < 0.5
    assert math.isnan(results[2].update_difference)
    saved = json.loads(out.read_text())
    assert saved["threads"] >= 1 and saved["machine"] and saved["date"]


def test_missing_heavyball_skips_its_rows_with_one_line(peers, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "heavyball", None)  # import heavyball raises ImportError
    log: list[str] = []
    assert peers.heavyball_rows(["soap", "muon"], ["compiled"], None, log) == []
    assert log == ["HeavyBall: not installed (pip install heavyball): skipped"]


def test_compile_mode_step_sets_the_mode_for_its_step_only(peers) -> None:
    seen = []

    class Optimizer:
        def step(self) -> None:
            seen.append(utils.compile_mode)
            raise RuntimeError("boom")

    utils = types.SimpleNamespace(compile_mode="max-autotune")
    with pytest.raises(RuntimeError, match="boom"):
        peers.CompileModeStep(utils, Optimizer(), None).step()
    assert seen == [None] and utils.compile_mode == "max-autotune"


def test_update_difference_against_float64(peers) -> None:
    initial = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    ours = [torch.nn.Parameter(torch.tensor([1.5, 2.0])), torch.nn.Parameter(torch.tensor([[2.0]]))]
    peer = [torch.nn.Parameter(torch.tensor([1.0, 2.5])), torch.nn.Parameter(torch.tensor([[2.0]]))]
    # d_ours = (0.5, 0, -1), d_peer = (0, 0.5, -1): ||(-0.5, 0.5, 0)|| / ||(0.5, 0, -1)||
    expected = math.sqrt(0.5) / math.sqrt(1.25)
    assert peers.update_difference(initial, ours, peer) == pytest.approx(expected, rel=1e-12)
