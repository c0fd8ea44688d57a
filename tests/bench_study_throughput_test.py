"""``bench/study_throughput.py``: its study slice is the embedded study's, narrowed; its table
counts identical losses and ratios from the passes it measured."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from nanoshampoo.evidence.study_definition import load_definition

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "bench") not in sys.path:  # the scripts import bench/bench_facts.py
    sys.path.insert(0, str(ROOT / "bench"))


def load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bench = load(ROOT / "bench" / "study_throughput.py", "bench_study_throughput")
tables = load(ROOT / "tools" / "results_tables.py", "results_tables_for_throughput")


def test_the_slice_is_the_embedded_study_narrowed(tmp_path: Path) -> None:
    path = tmp_path / "slice.toml"
    path.write_text(bench.slice_definition(["adamw", "muon"], "gpt-0.2m", 2, 32))
    narrowed, embedded = load_definition(str(path)), load_definition("cpu")
    assert narrowed.sizes == ("gpt-0.2m",) and narrowed.seeds == 2
    assert narrowed.budgets == embedded.budgets and narrowed.baseline == embedded.baseline
    # The bench sums whole runs, which only asynchronous halving leaves.
    assert narrowed.halving == "async"
    flags = list(embedded.train_args)
    flags[flags.index("--num-iterations") + 1] = "32"
    assert list(narrowed.train_args) == flags
    for setup in narrowed.setups:
        full = embedded.setup(setup.name)
        key, values = setup.search[0].split("=")
        assert setup.preset == full.preset and full.search[0].startswith(f"{key}=")
        assert len(values.split(",")) == 2


def test_with_threads_replaces_only_the_thread_count() -> None:
    argv = ["--threads", "1", "--seed", "0"]
    assert bench.with_threads(argv, 2) == ["--threads", "2", "--seed", "0"]
    assert bench.with_threads(argv, None) == argv


def pass_record(mode: str, wall: float, processes: int, losses: dict[str, Any]) -> dict[str, Any]:
    phases = dict.fromkeys(tables.PHASE_LABELS, 1.0)
    return {
        "mode": mode,
        "wall_s": wall,
        "processes": processes,
        "runs": len(losses),
        "pruned_runs": ["p.pruned.json"],
        "runs_per_hour": 3600 * len(losses) / wall,
        "phases_s": phases,
        "overhead_s": processes * wall - 11.0,
        "losses": losses,
    }


def test_table_ratios_and_loss_verdicts() -> None:
    same = {"a": [4.25, {"0.5": 5.0}], "b": [4.5, {}]}
    data = {
        "passes": [
            pass_record("engine", 60.0, 2, same),
            pass_record("baseline", 100.0, 1, same),
            pass_record("two-threads", 80.0, 1, {"a": [4.375, {}], "b": [4.5, {}]}),
        ]
    }
    rows = {
        line.split(" | ")[0].lstrip("| "): line
        for line in tables.study_throughput(data).splitlines()
    }
    assert rows["wall time / baseline's"].split(" | ")[1:] == ["0.60", "1.00", "0.80 |"]
    assert "identical (2/2 runs, every branch)" in rows["final and branch losses"]
    assert "1/2 identical (largest final-loss difference 0.12)" in rows["final and branch losses"]
    # 1 s of 60 s x 2 processes, of 100 s x 1
    assert rows["validation"].split(" | ")[1:3] == ["1.0 s (1 %)", "1.0 s (1 %)"]


@pytest.mark.parametrize("argv", [["--setups", "muon"], ["--setups", "adamw,lamb"]])
def test_setups_must_be_known_and_hold_the_baseline(argv: list[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--setups"):
        bench.main([*argv, "--out-dir", str(tmp_path / "out")])
