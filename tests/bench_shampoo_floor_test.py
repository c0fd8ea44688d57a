"""bench/shampoo_floor.py: the blocks and the work of a frequency-1 Shampoo step, against a
count of every product written out, and a tiny run of the whole bench so it cannot rot."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest
import torch
from bench_scripts_test import load_script

from nanoshampoo.train.allocator import OPT_OUT_VAR, TUNED_MALLOC_ENV
from nanoshampoo.train.machine import available_cores


@pytest.fixture(scope="module")
def floor() -> ModuleType:
    return load_script("shampoo_floor.py")


def products_of_a_step(m: int, n: int) -> list[tuple[int, int, int]]:
    """Every GEMM ``(rows, inner, cols)`` of one block's frequency-1 step."""
    return [
        (m, n, m),
        (n, m, n),  # L += G G^T, R += G^T G
        (m, m, m),
        (n, n, n),  # the roots Q diag Q^T
        (m, m, n),
        (m, n, n),
    ]  # L^(-1/4) G, then (...) R^(-1/4)


def test_gpt_small_block_work(floor: ModuleType) -> None:
    shapes = floor.parse_shapes(floor.GPT_SMALL_SHAPES)
    blocks = floor.blocks(shapes, 1024)
    assert sorted(blocks) == sorted([(768, 768)] * 4 + [(768, 1024)] * 3 + [(1024, 768)] * 3)
    sizes, step_flops, root_flops = floor.floor_work(shapes, 1024)
    assert sizes == {768: 14, 1024: 6}
    products = [(p, i) for m, n in blocks for i, p in enumerate(products_of_a_step(m, n))]
    roots = sum(2 * a * b * c for (a, b, c), i in products if i in (2, 3))
    assert root_flops == roots
    assert step_flops == sum(2 * a * b * c for (a, b, c), i in products) - roots


@pytest.mark.parametrize(
    ("size", "max_dim", "parts"), [(3072, 1024, [1024] * 3), (40, 32, [32, 8]), (16, 32, [16])]
)
def test_split_dim(floor: ModuleType, size: int, max_dim: int, parts: list[int]) -> None:
    assert floor.split_dim(size, max_dim) == parts


def test_tiny_run_reports_ours_over_its_floor(
    floor: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "floor.json"
    threads_before = torch.get_num_threads()
    try:
        result = floor.main(
            [
                "--shapes",
                "16x16,16x40",
                "--max-preconditioner-dim",
                "32",
                "--rounds",
                "2",
                "--steps",
                "2",
                "--json",
                str(out),
            ]
        )
    finally:
        torch.set_num_threads(threads_before)
    # By default the bench uses the threads a run on idle cores uses: every available core.
    assert result["threads"] == available_cores()
    printed = capsys.readouterr().out
    assert f"{available_cores()} threads" in printed.splitlines()[0]
    assert "ours / floor" in printed
    assert result["factors_per_size"] == {8: 1, 16: 4, 32: 1}
    # The floor is each part's best over the rounds, ours every window of every round.
    rounds = result["rounds"]
    assert result["floor_ms"] == pytest.approx(
        sum(min(r["eigh_ms"][s] for r in rounds) for s in (8, 16, 32))
        + min(r["step_gemm_ms"] for r in rounds)
        + min(r["root_gemm_ms"] for r in rounds)
        + min(r["elementwise_ms"] for r in rounds)
    )
    # The elementwise part: eight float32 arrays of the parameters' size.
    assert result["numel"] == 16 * 16 + 16 * 40
    assert result["elementwise_gb_s"] == pytest.approx(
        8 * result["numel"] * 4 / (result["elementwise_ms"] / 1000) / 1e9
    )

    # The typical floor: each part's median call, the median over the (two) rounds.
    def mean_of_rounds(field: str, size: int | None = None) -> float:
        values = [r[field] if size is None else r[field][size] for r in rounds]
        assert len(values) == 2
        return sum(values) / 2

    assert result["floor_median_ms"] == pytest.approx(
        sum(mean_of_rounds("eigh_median_ms", s) for s in (8, 16, 32))
        + mean_of_rounds("step_gemm_median_ms")
        + mean_of_rounds("root_gemm_median_ms")
        + mean_of_rounds("elementwise_median_ms")
    )
    for r in rounds:  # a part's fastest call is no slower than its median one
        assert r["step_gemm_ms"] <= r["step_gemm_median_ms"]
        assert r["elementwise_ms"] <= r["elementwise_median_ms"]
        assert all(r["eigh_ms"][s] <= r["eigh_median_ms"][s] for s in (8, 16, 32))
    windows = [w for r in rounds for w in r["ours_ms"]]
    assert len(windows) == 4 and result["ours_min_ms"] == min(windows)
    assert result["ours_median_over_floor_median"] == pytest.approx(
        result["ours_median_ms"] / result["floor_median_ms"]
    )
    assert result["ours_over_floor"] == pytest.approx(result["ours_median_ms"] / result["floor_ms"])
    assert result["floor_below_every_window"] == (result["floor_ms"] < min(windows))
    assert json.loads(out.read_text())["ours_over_floor"] == result["ours_over_floor"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--shapes", "16x16x3"],
        ["--shapes", "0x4"],
        ["--repeats", "0"],
        ["--rounds", "0"],
        ["--frequency", "0"],
    ],
)
def test_bad_arguments_are_refused(floor: ModuleType, argv: list[str]) -> None:
    with pytest.raises(ValueError):
        floor.main(argv)


def test_tiny_run_at_frequency_3_spreads_the_roots(floor: ModuleType) -> None:
    result = floor.main(
        [
            "--shapes",
            "16x16,16x40",
            "--max-preconditioner-dim",
            "32",
            "--frequency",
            "3",
            "--rounds",
            "1",
            "--steps",
            "1",
        ]
    )
    assert result["frequency"] == 3
    assert result["eigh_ms_per_step"] == pytest.approx(sum(result["eigh_ms"].values()) / 3)
    rounds = result["rounds"]
    assert result["gemm_ms"] == pytest.approx(
        min(r["step_gemm_ms"] for r in rounds) + min(r["root_gemm_ms"] for r in rounds) / 3
    )
    _, step_flops, root_flops = floor.floor_work(floor.parse_shapes("16x16,16x40"), 32)
    assert result["gemm_gflop"] == pytest.approx((step_flops + root_flops / 3) / 1e9)


def test_the_floor_times_every_product_of_a_step_at_its_shape(
    floor: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GEMM part times, per block shape (blocks stacked) and per factor size, exactly the
    products that ``products_of_a_step`` writes out: the updates both ways (full and tiles,
    these without mirror copies), the roots both ways (Q row-major and column-major)."""
    timed: list[tuple[int, int, int, int]] = []

    def record(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        timed.append((a.shape[0], a.shape[1], a.shape[2], b.shape[2]))
        return torch.zeros(a.shape[0], a.shape[1], b.shape[2])

    mirrors: list[bool] = []

    def tiled_update(
        f: torch.Tensor, u: torch.Tensor, beta: float, alpha: float, mirror: bool = True
    ) -> torch.Tensor:
        mirrors.append(mirror)
        return record(u, u.mT)

    monkeypatch.setattr(floor.torch, "bmm", record)
    monkeypatch.setattr(floor, "symmetric_rank_update_", tiled_update)
    shapes = [(16, 16), (16, 16), (16, 40)]
    floor.gemm_seconds(shapes, 32, torch.Generator().manual_seed(0), repeats=1)
    counted = Counter(timed)  # one untimed call and one timed one per product
    expected: Counter[tuple[int, int, int, int]] = Counter()
    for (m, n), count in Counter(floor.blocks(shapes, 32)).items():
        for i, (rows, inner, cols) in enumerate(products_of_a_step(m, n)):
            if i in (2, 3):
                continue  # roots: per factor size below
            # the factor updates are timed twice (full product and tiles)
            expected[(count, rows, inner, cols)] += 4 if i < 2 else 2
    sizes, _, _ = floor.floor_work(shapes, 32)
    for size, count in sizes.items():
        expected[(count, size, size, size)] += 4
    assert counted == expected
    # The tiles as a packed factor is updated: without the mirror copies.
    assert mirrors and not any(mirrors)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_run_as_a_script_it_times_under_a_training_runs_malloc(tmp_path: Path) -> None:
    """Started without the settings, the script re-executes itself with the trainer's
    (``TUNED_MALLOC_ENV``), and the JSON names them."""
    out = tmp_path / "floor.json"
    env = {k: v for k, v in os.environ.items() if k not in TUNED_MALLOC_ENV and k != OPT_OUT_VAR}
    script = Path(__file__).resolve().parents[1] / "bench" / "shampoo_floor.py"
    args = ["--shapes", "16x16", "--max-preconditioner-dim", "32", "--rounds", "1"]
    args += ["--steps", "1", "--repeats", "1", "--threads", "1", "--json", str(out)]
    subprocess.run(
        [sys.executable, str(script), *args], env=env, check=True, capture_output=True, timeout=300
    )
    assert json.loads(out.read_text())["malloc"] == TUNED_MALLOC_ENV
