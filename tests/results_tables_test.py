"""The result tables of ``docs/results/`` that a bench's JSON backs are what
``tools/results_tables.py`` renders from that JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location(
    "results_tables", ROOT / "tools" / "results_tables.py"
)
assert SPEC is not None and SPEC.loader is not None
results_tables = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(results_tables)

BEGIN = "<!-- table: rendered by tools/results_tables.py from {} -->\n"
END = "<!-- end of table -->"


@pytest.mark.parametrize(
    "page",
    sorted((ROOT / "docs" / "results").rglob("*.md")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_rendered_table_is_what_its_json_says(page: Path) -> None:
    text = page.read_text()
    assert results_tables.render_page(text, page.parent) == text, (
        f"{page.relative_to(ROOT)}: a table differs from its JSON; run tools/results_tables.py"
    )


def test_every_renderer_has_its_table() -> None:
    pages = "".join(p.read_text() for p in (ROOT / "docs" / "results").rglob("*.md"))
    assert [n for n in results_tables.RENDERERS if BEGIN.format(n) not in pages] == []


def branches_json(same: dict[str, bool]) -> dict[str, object]:
    row = {
        "branched_steps": 130,
        "separate_steps": 160,
        "expected_ratio": 0.8125,
        "branched_wall_s": 105.87,
        "separate_wall_s": 114.2,
        "measured_ratio": 0.9271,
        "measured_cpu_ratio": 0.9262,
        "measured_train_time_ratio": 0.84049,
        "same_final_loss": same,
    }
    return {"fractions": [0.25, 0.5, 0.75], "results": {"0.7": row}}


def test_the_decay_branches_table_is_rendered_from_its_fields(tmp_path: Path) -> None:
    (tmp_path / "decay-branches.json").write_text(
        json.dumps(branches_json({"16": True, "32": False}))
    )
    page = f"# Q\n\n{BEGIN.format('decay-branches.json')}| stale |\n{END}\n\ntext\n"
    assert results_tables.render_page(page, tmp_path) == (
        f"# Q\n\n{BEGIN.format('decay-branches.json')}"
        "| cooldown | branched run | 4 separate runs | wall ratio | CPU-time ratio "
        "| training-time ratio | step ratio (exact) | same final losses |\n"
        "|---|---|---|---|---|---|---|---|\n"
        "| 0.7 | 105.9 s, 130 steps | 114.2 s, 160 steps | 0.927 | 0.926 | 0.840 | 0.81 "
        "| 16 steps: yes; 32 steps: no |\n"
        f"{END}\n\ntext\n"
    )


def test_an_unknown_or_missing_json_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="other.json: no renderer"):
        results_tables.render_page(f"{BEGIN.format('other.json')}{END}", tmp_path)
    with pytest.raises(ValueError, match="decay-branches.json: missing"):
        results_tables.render_page(f"{BEGIN.format('decay-branches.json')}{END}", tmp_path)


RUN = {"commit": "abc1234", "date": "2026-12-02", "machine": "AMD EPYC", "threads": 2}
RUN |= {"torch": "2.13.0+cpu", "load_average": 3.04}


def test_the_peers_table_is_rendered_from_its_fields() -> None:
    row = {
        "name": "HeavyBall SOAP, compiled (ours)",
        "peer_name": "HeavyBall SOAP (compiled)",
        "peer_ms": 812.34,
        "ours_ms": 406.17,
        "ratio": 0.5,
        "goal": None,
        "verdict": "-",
        "update_difference": 0.2812,
        "compared_with": "nikhilvyas/SOAP",
        "peer_compile_s": 88.6,
    }
    unchecked = row | {"goal": 0.7, "verdict": "met", "compared_with": "-"}
    log = ["Muon (fp32 NS): loaded", "Muon: ours' Newton-Schulz dtype on this CPU: torch.float32"]
    results = [row, unchecked | {"peer_compile_s": None}]
    text = results_tables.peers(RUN | {"results": results, "log": log})
    assert text.splitlines()[0] == (
        "Commit abc1234, 2026-12-02, `AMD EPYC`, 2 threads, torch 2.13.0+cpu, load average 3.0."
    )
    assert text.splitlines()[-4:] == [
        "| HeavyBall SOAP, compiled (ours) | HeavyBall SOAP (compiled) | 812.3 | 406.2 | 0.50x "
        "| - | - | 0.28 vs nikhilvyas/SOAP | 89 s |",
        "| HeavyBall SOAP, compiled (ours) | HeavyBall SOAP (compiled) | 812.3 | 406.2 | 0.50x "
        "| <= 0.7x | met | - | - |",
        "",
        "Muon: ours' Newton-Schulz dtype on this CPU: torch.float32",
    ]


def test_the_shampoo_floor_table_is_rendered_from_its_fields() -> None:
    data = RUN | {
        "frequency": 10,
        "factors_per_size": {"768": 14, "1024": 6},
        "eigh_ms": {"768": 300.0, "1024": 400.0},
        "eigh_ms_per_step": 70.0,
        "gemm_gflop": 50.88,
        "gemm_gflop_s": 254.4,
        "gemm_ms": 200.0,
        "floor_ms": 270.0,
        "ours_median_ms": 297.0,
        "ours_min_ms": 280.0,
        "ours_over_floor": 1.1,
        "ours_min_over_floor": 1.037,
        "floor_below_every_window": True,
        "rounds_run": 3,
        "windows_per_round": 2,
    }
    lines = results_tables.shampoo_floor(data).splitlines()
    assert lines[4] == (
        "| `eigh`: 14 factors of 768 (300.0 ms) + 6 factors of 1024 (400.0 ms), once per 10 "
        "steps | 70.0 |"
    )
    assert lines[5:] == [
        "| GEMMs: 50.88 GFLOP, each at its shape (254.4 GFLOP/s) | 200.0 |",
        "| **floor** (each part's best of 3 rounds) | **270.0** |",
        "| **ours**, median of 6 windows (fastest) | **297.0** (280.0) |",
        "| **ours / floor**, median (fastest) | **1.10x** (1.04x) |",
        "| floor below every window | yes |",
    ]
    malloc = {"MALLOC_MMAP_THRESHOLD_": "268435456", "MALLOC_TRIM_THRESHOLD_": "default"}
    typical = {"floor_median_ms": 300.0, "ours_median_over_floor_median": 0.99}
    assert results_tables.shampoo_floor(data | typical | {"malloc": malloc}).splitlines()[-3:] == [
        "| typical: the floor's parts at their median call | 300.0 |",
        "| **ours / floor, typical** (ours' median over the parts' medians) | **0.99x** |",
        "| glibc malloc (a training run's: freed memory kept) | "
        "`MALLOC_MMAP_THRESHOLD_=268435456`, `MALLOC_TRIM_THRESHOLD_=default` |",
    ]


def test_the_pruning_table_is_rendered_from_its_fields() -> None:
    def point(lr: str, value: float, state: str, rungs: dict[str, float]) -> dict[str, object]:
        return {"params": {"muon.lr": lr}, "grid_value": value, "state": state, "rungs": rungs}

    muon = {
        "points": [
            point("0.01", 4.08, "pruned", {"64": 5.2}),
            point("0.02", 4.04, "complete", {"64": 5.1, "128": 4.6}),
        ],
        "grid_best": {"muon.lr": "0.02"},
        "grid_best_value": 4.04,
        "pruned_best": {"muon.lr": "0.02"},
        "pruned_best_in_grid": 4.04,
        "gap": 0.0,
        "grid_steps": 1024,
        "pruned_steps": 600,
        "compute_share": 600 / 1024,
        "trials": 2,
        "pruned_trials": 1,
    }
    data = RUN | {"halving": "sync", "noise": {"muon": 0.01}, "results": {"muon": muon}}
    lines = results_tables.pruning(data).splitlines()
    assert lines[2:6] == [
        "| muon: point | grid final loss | rung 64 steps | rung 128 steps | halving |",
        "|---|---|---|---|---|",
        "| lr 0.01 | 4.0800 | 5.2000 | - | pruned |",
        "| lr 0.02 | **4.0400** | 5.1000 | 4.6000 | complete |",
    ]
    assert lines[-1] == (
        "| muon | lr 0.02: 4.0400 (1024) | lr 0.02: 4.0400 (600) | **59 %** of the grid's "
        "| 1 of 2 | the same point |"
    )
    assert lines[-3].startswith("| setup | grid: best point") and "synchronous halving" in lines[-3]


def test_the_telemetry_overhead_table_is_rendered_from_its_fields() -> None:
    def comparison(off: float, on: float) -> dict[str, float]:
        return {
            "mean_off": off,
            "std_off": 1.0,
            "mean_on": on,
            "std_on": 2.0,
            "overhead": on / off - 1,
            "ratio_mean": 0.0009,
            "ratio_std": 0.0076,
            "welch_p": 0.94,
        }

    step = {
        "preset": "tiny-muon",
        "every": 50,
        "rounds": 8,
        "records_per_round": 16,
        "record_ms_per_round": 158.2,
        "ms_per_step": comparison(659.3, 659.9),
    }
    runs = {
        "command": "python -m nanoshampoo.train --preset tiny-shampoo",
        "runs": 3,
        "wall_s": comparison(200.0, 201.0),
        "train_time_s": comparison(150.0, 150.3),
        "same_final_val_loss": True,
    }
    lines = results_tables.telemetry_overhead(RUN | {"steps": [step], "runs": runs}).splitlines()
    assert lines[4] == (
        "| tiny-muon, wall ms/step, telemetry every 50 steps (16 records, 158 ms a round) "
        "| 8 rounds | 659.3 ± 1.0 ms | 659.9 ± 2.0 ms | **+0.09 %** | +0.09 ± 0.76 % | 0.94 |"
    )
    assert lines[5].startswith(
        "| `python -m nanoshampoo.train --preset tiny-shampoo`, wall (same final val loss) "
        "| 3 runs | 200.0 ± 1.0 s | 201.0 ± 2.0 s | **+0.50 %**"
    )


def test_the_halving_replay_table_is_rendered_from_its_fields() -> None:
    def row(pick: str, gap: float, within: bool) -> dict[str, object]:
        return {
            "rungs": [0.125, 0.25, 0.5],
            "size": "tiny",
            "setup": "muon",
            "grid_best": {"muon.lr": "0.02", "muon.weight_decay": "0.1"},
            "grid_best_value": 4.7933,
            "pick": {"muon.lr": pick, "muon.weight_decay": "0.1"},
            "pick_value": 4.7933 + gap,
            "gap": gap,
            "noise": 0.0012,
            "within_noise": within,
            "kept": [9, 4, 2, 1],
            "compute_share": 0.4123,
            "num_iterations": 128,
        }

    data = {
        "commit": "abc1234",
        "date": "2026-12-07",
        "results": [row("0.04", 0.0495, False), row("0.02", 0.0, True)],
        "grids": [],
    }
    lines = results_tables.halving_replay(data).splitlines()
    assert lines[0] == "Commit abc1234, 2026-12-07; replayed from the grids' records, no training."
    assert lines[4] == (
        "| 16, 32, 64 | tiny | muon | lr 0.02, weight_decay 0.1: 4.7933 | lr 0.04, "
        "weight_decay 0.1: 4.8428 | 0.0495 / 0.0012 (**beyond**) | 9 → 4 → 2 → 1 | 41 % |"
    )
    assert "| the same point |" in lines[5]


def test_the_halving_replays_grids_are_tables_of_every_points_budgets() -> None:
    grid = {
        "size": "gpt-0.2m",
        "setup": "adamw",
        "noise": 0.0061,
        "trials": [
            {"params": {"adamw.lr": "0.008"}, "rungs": {"128": 5.48, "256": 4.87}, "value": 4.08},
            {"params": {"adamw.lr": "0.002"}, "rungs": {"128": 4.97, "256": 4.51}, "value": 4.09},
        ],
    }
    data = {"commit": "abc1234", "date": "2026-12-07", "results": [], "grids": [grid]}
    lines = results_tables.halving_replay(data).splitlines()
    assert lines[4:] == [
        "",
        "adamw at gpt-0.2m: each grid point's decay-branch losses and final loss (one seed; the "
        "best point's seed std 0.0061; bold: the best at each budget)",
        "",
        "| point | 128 steps | 256 steps | final |",
        "|---|---|---|---|",
        "| lr 0.008 | 5.4800 | 4.8700 | **4.0800** |",
        "| lr 0.002 | **4.9700** | **4.5100** | 4.0900 |",
    ]
