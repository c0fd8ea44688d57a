"""bench/peers.py: peers missing are reported and skipped; fake peers run every row end to end.

The fakes stand in for the real single files and the reference package (which the project's
tests never need): a ``muon.py`` whose ``SingleDeviceMuon`` is SGD and carries the bf16 cast the
fp32 variant patches, a ``soap.py`` whose ``SOAP`` is Adam, and a ``distributed_shampoo``
package that re-exports our own library (same public names, so identical keyword arguments).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
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
    assert "(float32 variant)" in " ".join(saved["log"])


def test_an_fp32_variant_without_the_cast_is_skipped_not_half_patched(
    peers, tmp_path: Path
) -> None:
    (tmp_path / "muon.py").write_text(FAKE_MUON.replace("G.bfloat16()", "G.half()"))
    log: list[str] = []
    rows = peers.muon_rows(tmp_path, log)
    assert [f.name for r in rows for f in r.figures] == ["Muon, bf16 NS"]
    assert "not found once: fp32 variant skipped" in log[1]


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
