"""Reading speedrun .txt logs and .jsonl metrics, and grouping runs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from evidence_fixtures import TOTAL_STEPS, write_group, write_jsonl, write_txt

from nanoshampoo.evidence.grouping import groups_by_directory, groups_from_specs, regroup
from nanoshampoo.evidence.logs import LogFormatError, read_run


def test_txt_and_jsonl_give_the_same_run(tmp_path: Path) -> None:
    txt = read_run(write_txt(tmp_path / "a.txt", 3.2775, 140.909))
    jsonl = read_run(write_jsonl(tmp_path / "b.jsonl", 3.2775, 140.909, seed=7))
    for run in (txt, jsonl):
        assert run.total_steps == TOTAL_STEPS
        assert run.final_val_loss == pytest.approx(3.2775)
        assert run.train_time_ms == pytest.approx(140909.0)
        assert run.step_avg_ms == pytest.approx(1409.09)
        assert [p.step for p in run.curve] == [0, 25, 50, 75, 100]
    assert txt.peak_memory_mib == 321.0 and txt.seed is None
    assert (jsonl.seed, jsonl.optimizer, jsonl.preset, jsonl.run_id) == (7, "adam", "tiny", "b")


def test_modded_nanogpt_record_line_parses(tmp_path: Path) -> None:
    path = tmp_path / "record.txt"
    path.write_text(
        "code...\nstep:0/1750 val_loss:10.8258 train_time:0ms step_avg:0.03ms\n"
        "step:1750/1750 val_loss:3.2781 train_time:140909ms step_avg:80.52ms\n"
    )
    run = read_run(path)
    assert (run.final_val_loss, run.train_time_ms, run.step_avg_ms) == (3.2781, 140909.0, 80.52)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("empty.txt", "", "no validation lines"),
        (
            "partial.txt",
            "step:10/100 val_loss:4.0 train_time:5ms step_avg:0.5ms\n",
            "incomplete run",
        ),
        ("bad.jsonl", '{"kind": "config"}\nnot json\n', r"bad.jsonl:2: invalid JSON"),
        (
            "nofinal.jsonl",
            '{"kind": "val", "step": 1, "val_loss": 3.0, "train_time_ms": 1.0}\n',
            "no 'final' or 'diverged' record",
        ),
        (
            "field.jsonl",
            '{"kind": "final", "step": 1, "total_steps": 1, "train_time_ms": 1}\n',
            "lacks field 'val_loss'",
        ),
        ("log.csv", "x", "unknown run log type"),
    ],
)
def test_malformed_logs_name_the_file(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(LogFormatError, match=message) as info:
        read_run(path)
    assert str(path) in str(info.value)


def test_groups_by_directory_prefers_jsonl(tmp_path: Path) -> None:
    write_group(tmp_path / "a", [3.27, 3.28], [10.0, 11.0], fmt="txt")
    write_group(tmp_path / "a", [3.27, 3.28], [10.0, 11.0], fmt="jsonl")
    write_group(tmp_path / "b", [3.26], [9.0], fmt="txt")
    groups = groups_by_directory([tmp_path / "a", tmp_path / "b" / "run_seed0.txt"])
    assert list(groups) == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert [r.path.suffix for r in groups[str(tmp_path / "a")]] == [".jsonl", ".jsonl"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(LogFormatError, match="no run logs"):
        groups_by_directory([tmp_path / "empty"])
    with pytest.raises(LogFormatError, match="no such file"):
        groups_by_directory([tmp_path / "missing"])


def test_groups_from_specs_and_regroup(tmp_path: Path) -> None:
    write_group(tmp_path / "x1", [3.27, 3.28], [10.0, 11.0])
    write_group(tmp_path / "x2", [3.25], [9.0])
    groups = groups_from_specs([f"all={tmp_path}/x*", f"one={tmp_path}/x2/*.jsonl"])
    assert {k: len(v) for k, v in groups.items()} == {"all": 3, "one": 1}
    assert {k: len(v) for k, v in regroup(groups, "optimizer").items()} == {"optimizer=adam": 4}
    assert list(regroup(groups, "lr")) == ["lr=0.01"]
    with pytest.raises(ValueError, match="NAME=GLOB"):
        groups_from_specs(["nolabel"])
    with pytest.raises(LogFormatError, match="matches no run logs"):
        groups_from_specs([f"none={tmp_path}/nothing*"])


def _jsonl(path: Path, records: list[str]) -> Path:
    path.write_text("\n".join(records) + "\n")
    return path


CONFIG = (
    '{"kind": "config", "run_id": "r", "seed": 0, "preset": "tiny", "optimizer": "adamw", '
    '"world_size": 1}'
)


@pytest.mark.parametrize("nan", ["null", '"nan"', "NaN", '"inf"', "Infinity", '"-inf"'])
def test_non_finite_final_loss_in_every_spelling_reads_as_diverged(
    tmp_path: Path, nan: str
) -> None:
    # What the trainer wrote for `--embed-lr inf` before it stopped diverged runs: it ran to the
    # end and logged a non-finite loss (as null; other writers use "nan" or bare NaN).
    path = _jsonl(
        tmp_path / "r.jsonl",
        [
            CONFIG,
            f'{{"kind": "train", "step": 10, "total_steps": 20, "train_loss": {nan}, '
            '"train_time_ms": 5.0}',
            '{"kind": "val", "step": 0, "total_steps": 20, "val_loss": 7.0, "train_time_ms": 0.0}',
            f'{{"kind": "val", "step": 10, "total_steps": 20, "val_loss": {nan}, '
            '"train_time_ms": 5.0}',
            f'{{"kind": "final", "step": 20, "total_steps": 20, "val_loss": {nan}, '
            '"train_time_ms": 10.0,'
            f' "step_avg_ms": 0.5, "peak_memory_mib": {nan}}}',
        ],
    )
    run = read_run(path)
    assert run.diverged and run.diverged_step == 10 and math.isnan(run.final_val_loss)
    assert run.train_time_ms == 10.0 and run.total_steps == 20
    assert not math.isfinite(run.curve[1].val_loss)


def test_diverged_record_ends_a_run(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "d.jsonl",
        [
            CONFIG,
            '{"kind": "val", "step": 0, "total_steps": 300, "val_loss": 7.0, "train_time_ms": 0.0}',
            '{"kind": "val", "step": 50, "total_steps": 300, "val_loss": 5.0, "train_time_ms": '
            "1000.0}",
            '{"kind": "train", "step": 60, "total_steps": 300, "train_loss": "inf", '
            '"train_time_ms": 1200.0}',
            '{"kind": "diverged", "step": 61, "total_steps": 300, "reason": "non-finite loss; first'
            ' non-finite gradient: blocks.0.attn.qkv.weight", "train_time_ms": 1220.0}',
        ],
    )
    run = read_run(path)
    assert (run.diverged_step, run.total_steps, run.train_time_ms) == (61, 300, 1220.0)
    assert run.diverged_reason.endswith("blocks.0.attn.qkv.weight")
    assert run.step_avg_ms == pytest.approx(1220.0 / 61)
    assert [p.step for p in run.curve] == [0, 50] and math.isnan(run.final_val_loss)
    assert (run.seed, run.optimizer) == (0, "adamw")


def test_text_log_diverged_line(tmp_path: Path) -> None:
    path = tmp_path / "d.txt"
    path.write_text(
        "source...\n"
        "step:0/300 val_loss:7.0000 train_time:0ms step_avg:0.00ms\n"
        "step:10/300 train_loss:nan train_time:200ms step_avg:20.00ms\n"
        "diverged at step:11/300: loss is nan at step 11\n"
    )
    run = read_run(path)
    assert (run.diverged_step, run.diverged_reason, run.total_steps) == (
        11,
        "loss is nan at step 11",
        300,
    )
    assert run.train_time_ms == 200.0 and run.step_avg_ms == 20.0
    assert [p.step for p in run.curve] == [0]


def test_text_log_with_nan_final_loss_is_diverged(tmp_path: Path) -> None:
    path = tmp_path / "n.txt"
    path.write_text(
        "step:0/20 val_loss:7.0000 train_time:0ms step_avg:0.00ms\n"
        "step:20/20 val_loss:nan train_time:10ms step_avg:0.50ms\n"
    )
    run = read_run(path)
    assert run.diverged_step == 20 and math.isnan(run.final_val_loss)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (
            '{"kind": "val", "step": 0, "total_steps": 1, "val_loss": "low", "train_time_ms": 0}',
            "field 'val_loss' is not a number: 'low'",
        ),
        (
            '{"kind": "diverged", "step": 1.5, "total_steps": 2, "reason": "x", "train_time_ms": '
            "0}",
            "field 'step' is not an integer",
        ),
        (
            '{"kind": "diverged", "step": 1, "total_steps": 2, "reason": "x"}',
            "lacks field 'train_time_ms'",
        ),
    ],
)
def test_bad_numbers_name_the_line(tmp_path: Path, record: str, message: str) -> None:
    path = _jsonl(tmp_path / "b.jsonl", [CONFIG, record])
    with pytest.raises(LogFormatError, match=message) as info:
        read_run(path)
    assert f"{path}:2" in str(info.value)


def test_a_diverged_run_resumed_to_the_end_is_finished(tmp_path: Path) -> None:
    # The trainer appends on resume: a second config record, then the steps from the checkpoint.
    path = _jsonl(
        tmp_path / "r.jsonl",
        [
            CONFIG,
            '{"kind": "val", "step": 0, "total_steps": 100, "val_loss": 7.0, "train_time_ms": 0.0}',
            '{"kind": "val", "step": 50, "total_steps": 100, "val_loss": 5.0, "train_time_ms": '
            "500.0}",
            '{"kind": "diverged", "step": 60, "total_steps": 100, "reason": "loss is nan", '
            '"train_time_ms": 600.0}',
            CONFIG.replace("}", ', "resumed_from": {"step": 50}}'),
            '{"kind": "val", "step": 50, "total_steps": 100, "val_loss": 4.9, "train_time_ms": '
            "510.0}",
            '{"kind": "final", "step": 100, "total_steps": 100, "val_loss": 4.0, "train_time_ms": '
            "1000.0,"
            ' "step_avg_ms": 10.0, "peak_memory_mib": 1.0}',
        ],
    )
    run = read_run(path)
    assert not run.diverged and run.final_val_loss == 4.0
    assert [(p.step, p.val_loss) for p in run.curve] == [(0, 7.0), (50, 4.9), (100, 4.0)]
    # Resumed but not (yet) ended: not a finished run, whatever the first segment said.
    _jsonl(path, path.read_text().splitlines()[:-1])
    with pytest.raises(LogFormatError, match="no 'final' or 'diverged' record"):
        read_run(path)


def test_text_log_resumed_after_divergence(tmp_path: Path) -> None:
    path = tmp_path / "r.txt"
    path.write_text(
        "step:0/20 val_loss:7.0000 train_time:0ms step_avg:0.00ms\n"
        "diverged at step:12/20: loss is nan\n"
        "resumed from runs/r.ckpt/step_000010 at step 10\n"
        "step:20/20 val_loss:4.0000 train_time:10ms step_avg:0.50ms\n"
    )
    run = read_run(path)
    assert not run.diverged and run.final_val_loss == 4.0
