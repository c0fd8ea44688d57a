"""``nanoshampoo telemetry``: reading the records, the colour scale rule, the figures written,
the per-setup summary of ``compare`` / ``study``, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nanoshampoo.cli import main
from nanoshampoo.errors import UserError
from nanoshampoo.evidence.telemetry_plots import (
    read_telemetry,
    run_log_paths,
    wants_log_scale,
    write_telemetry_plots,
)
from nanoshampoo.evidence.telemetry_summary import setup_summary, telemetry_section

LAYERS = ("blocks.0.attn.qkv.weight", "blocks.0.mlp.fc.weight")


def write_run(path: Path, scale: float) -> Path:
    """A run log with a config record, a val record and telemetry at steps 5, 10 (10 twice:
    a resumed run; the last wins)."""
    lines = [{"kind": "config", "run_id": path.stem}, {"kind": "val", "step": 0, "val_loss": 5.0}]
    for step, factor in ((5, 1.0), (10, 7.0), (10, 2.0)):
        for row, layer in enumerate(LAYERS):
            lines.append(
                {
                    "kind": "telemetry",
                    "step": step,
                    "layer": layer,
                    "update_ratio": scale * factor * (row + 1),
                    "factor0.condition_number": 10.0 ** (3 * step / 5 + row),
                    "factor1.condition_number": "inf",
                }
            )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_records_become_layer_by_step_arrays_and_the_last_record_wins(tmp_path: Path) -> None:
    run = read_telemetry(write_run(tmp_path / "a.jsonl", 0.01))
    assert run.name == "a" and run.layers == LAYERS and run.steps == (5, 10)
    np.testing.assert_allclose(run.values["update_ratio"], [[0.01, 0.02], [0.02, 0.04]])
    assert np.isinf(run.values["factor1.condition_number"]).all()


def test_log_scale_only_for_positive_values_spanning_decades() -> None:
    assert wants_log_scale(np.array([1.0, 1e3, np.inf]))
    assert wants_log_scale(np.array([1.0, 50.0]))  # more than a decade
    assert not wants_log_scale(np.array([1.0, 5.0]))
    assert not wants_log_scale(np.array([0.0, 1e3]))


def test_a_run_is_named_by_its_jsonl_its_txt_its_stem_or_its_directory(tmp_path: Path) -> None:
    path = write_run(tmp_path / "r.jsonl", 1.0)
    expected = [path]
    assert run_log_paths(tmp_path / "r") == expected
    assert run_log_paths(tmp_path / "r.txt") == expected
    assert run_log_paths(tmp_path) == expected
    with pytest.raises(UserError, match="no run log"):
        run_log_paths(tmp_path / "missing")


def test_a_log_without_telemetry_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "plain.jsonl"
    path.write_text(json.dumps({"kind": "val", "step": 0, "val_loss": 1.0}) + "\n")
    with pytest.raises(UserError, match="no telemetry records .*--telemetry-every"):
        read_telemetry(path)


def test_every_statistic_gets_a_heatmap_per_run_and_one_comparison(tmp_path: Path) -> None:
    runs = [write_run(tmp_path / "a.jsonl", 0.01), write_run(tmp_path / "b.jsonl", 0.1)]
    written = write_telemetry_plots(runs, tmp_path / "out")
    names = sorted(p.name for p in written)
    stats = ("factor0.condition_number", "factor1.condition_number", "update_ratio")
    assert names == sorted(
        [f"telemetry.{run}.{stat}.png" for run in ("a", "b") for stat in stats]
        + [f"telemetry.compare.{stat}.png" for stat in stats]
    )
    assert all(p.stat().st_size > 1000 for p in written)


def test_the_command_writes_beside_the_run_and_says_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(tmp_path / "a.jsonl", 0.01)
    assert main(["telemetry", str(tmp_path / "a")]) == 0
    assert capsys.readouterr().out.strip() == f"6 figures in {tmp_path / 'a.telemetry'}"
    assert main(["telemetry", str(tmp_path / "none")]) == 2
    assert "nanoshampoo telemetry: error:" in capsys.readouterr().err


def test_the_setup_summary_takes_medians_at_each_runs_last_step(tmp_path: Path) -> None:
    a, b = write_run(tmp_path / "a.jsonl", 0.01), write_run(tmp_path / "b.jsonl", 0.1)
    summary = setup_summary([a, b])
    assert summary is not None
    # Last step (10, the later record): u/w 0.02, 0.04 (a) and 0.2, 0.4 (b); condition numbers
    # 1e6, 1e7 twice (the infinite factor 1 left out).
    assert summary["median u/w"] == pytest.approx(np.median([0.02, 0.04, 0.2, 0.4]))
    assert summary["median factor condition number"] == pytest.approx(np.median([1e6, 1e7] * 2))
    assert summary["median NS orthogonality error"] is None
    section = telemetry_section({"shampoo": [a.with_suffix(".txt")], "none": []})
    assert section[0] == "## Optimizer health at the end (telemetry)"
    assert sum(line.startswith("| shampoo") for line in section) == 1
    assert not any(line.startswith("| none") for line in section)
    assert telemetry_section({"none": [tmp_path / "missing.jsonl"]}) == []
