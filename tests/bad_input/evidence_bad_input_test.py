"""Bad input to ``nanoshampoo stats``, ``trace`` and ``repeat``: exit status 2, one line naming
the flag or file, and nothing on disk changed."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import threading
from pathlib import Path

import pytest
from bad_input_fixtures import (
    EXIT_USER_ERROR,
    one_error_line,
    snapshot,
    write_run_group,
    write_run_log,
    write_trace,
    x_event,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoshampoo.cli import main

DEEP = "[" * 100_000 + "]" * 100_000


def test_stats_json_over_one_of_its_inputs_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = write_run_group(tmp_path / "A")
    before = snapshot(tmp_path)
    assert main(["stats", str(runs), "--json", str(runs / "r_seed0.jsonl")]) == EXIT_USER_ERROR
    one_error_line(capsys, "nanoshampoo stats", "--json", "r_seed0.jsonl", "input")
    assert snapshot(tmp_path) == before


def test_stats_json_over_another_runs_log_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = write_run_group(tmp_path / "A")
    other = write_run_log(tmp_path / "B" / "b.jsonl")
    before = snapshot(tmp_path)
    assert main(["stats", str(runs), "--json", str(other)]) == EXIT_USER_ERROR
    one_error_line(capsys, "nanoshampoo stats", "--json", "b.jsonl", "run log")
    assert snapshot(tmp_path) == before


def test_trace_json_over_its_trace_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "t.json", [x_event("aten::mm", 0.0, 5.0)])
    before = snapshot(tmp_path)
    assert main(["trace", str(trace), "--json", str(trace)]) == EXIT_USER_ERROR
    one_error_line(capsys, "nanoshampoo trace", "--json", "t.json")
    assert snapshot(tmp_path) == before


def test_stats_refuses_to_average_runs_of_different_lengths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run_log(tmp_path / "A" / "short.jsonl", total_steps=100)
    write_run_log(tmp_path / "A" / "long.jsonl", total_steps=1000)
    before = snapshot(tmp_path)
    assert main(["stats", str(tmp_path / "A")]) == EXIT_USER_ERROR
    one_error_line(
        capsys,
        "nanoshampoo stats",
        "different lengths",
        "100 steps",
        "1000 steps",
        "short.jsonl",
        "long.jsonl",
    )
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("target", ["nan", "inf", "-inf"])
def test_stats_refuses_a_non_finite_target(
    target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = write_run_group(tmp_path / "A")
    before = snapshot(tmp_path)
    assert main(["stats", str(runs), f"--target={target}"]) == EXIT_USER_ERROR
    one_error_line(capsys, "nanoshampoo stats", "--target")
    assert snapshot(tmp_path) == before


@pytest.mark.timeout(30)
@pytest.mark.parametrize("command, name", [("stats", "run.jsonl"), ("trace", "trace.json")])
def test_a_fifo_input_is_refused_instead_of_hanging(
    command: str, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / name
    os.mkfifo(fifo)
    status: list[int] = []
    worker = threading.Thread(target=lambda: status.append(main([command, str(fifo)])), daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # unblock the reader so the thread ends, then fail
        with open(fifo, "w"):
            pass
        pytest.fail(f"{command} blocked on a FIFO")
    assert status == [EXIT_USER_ERROR]
    one_error_line(capsys, f"nanoshampoo {command}", name, "regular file")


def test_stats_on_deeply_nested_json_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "deep.jsonl").write_text(DEEP + "\n")
    before = snapshot(tmp_path)
    assert main(["stats", str(tmp_path / "deep.jsonl")]) == EXIT_USER_ERROR
    one_error_line(capsys, "nanoshampoo stats", "deep.jsonl", "nested")
    assert snapshot(tmp_path) == before


def test_trace_on_deeply_nested_json_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "deep.json").write_text(DEEP)
    before = snapshot(tmp_path)
    assert main(["trace", str(tmp_path / "deep.json")]) == EXIT_USER_ERROR
    one_error_line(capsys, "nanoshampoo trace", "deep.json", "nested")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "ts, dur", [(float("nan"), 1.0), (0.0, float("nan")), (float("inf"), 1.0), (True, 1.0)]
)
def test_trace_refuses_non_finite_timestamps(
    ts: float, dur: float, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(
        tmp_path / "t.json", [x_event("aten::mm", 0.0, 5.0), x_event("aten::add", ts, dur)]
    )
    before = snapshot(tmp_path)
    assert main(["trace", str(trace)]) == EXIT_USER_ERROR
    one_error_line(capsys, "nanoshampoo trace", "t.json", "traceEvents[1]", "'ts'")
    assert snapshot(tmp_path) == before


def test_stats_json_under_proc_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = write_run_group(tmp_path / "A")
    before = snapshot(tmp_path)
    assert main(["stats", str(runs), "--json", "/proc/x/r.json"]) == EXIT_USER_ERROR
    one_error_line(capsys, "nanoshampoo stats", "--json", "/proc/x/r.json")
    assert snapshot(tmp_path) == before


def test_stats_plot_into_a_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = write_run_group(tmp_path / "A")
    (tmp_path / "plots").write_text("not a directory")
    before = snapshot(tmp_path)
    assert main(["stats", str(runs), "--plot", str(tmp_path / "plots")]) == EXIT_USER_ERROR
    one_error_line(capsys, "nanoshampoo stats", "--plot", "plots", "not a directory")
    assert snapshot(tmp_path) == before


def test_stats_json_under_a_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = write_run_group(tmp_path / "A")
    (tmp_path / "f").write_text("x")
    before = snapshot(tmp_path)
    assert main(["stats", str(runs), "--json", str(tmp_path / "f" / "r.json")]) == EXIT_USER_ERROR
    one_error_line(capsys, "nanoshampoo stats", "--json", "is a file")
    assert snapshot(tmp_path) == before


def test_stats_json_name_too_long_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = write_run_group(tmp_path / "A")
    before = snapshot(tmp_path)
    assert main(["stats", str(runs), "--json", str(tmp_path / ("r" * 300 + ".json"))]) == 2
    one_error_line(capsys, "nanoshampoo stats", "--json", "limit")
    assert snapshot(tmp_path) == before


def test_repeat_out_dir_that_is_a_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "out").write_text("a file")
    before = snapshot(tmp_path)
    assert (
        main(
            ["repeat", "-n", "1", "--out-dir", str(tmp_path / "out"), "--", "--num-iterations", "1"]
        )
        == EXIT_USER_ERROR
    )
    one_error_line(capsys, "nanoshampoo repeat", "out", "not a directory")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--num-iterations", "0"], ["num_iterations"]),
        (["--no-such-flag", "1"], ["unrecognized", "--no-such-flag"]),
        (["--preset", "tiny-nope"], ["tiny-nope"]),
    ],
)
def test_repeat_refuses_a_bad_train_flag_before_creating_anything(
    flags: list[str], words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(tmp_path)
    assert main(["repeat", "-n", "2", "--out-dir", str(tmp_path / "o"), "--", *flags]) == 2
    one_error_line(capsys, "nanoshampoo repeat", *words)
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "o").exists()


def test_repeat_refuses_a_nan_target_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(tmp_path)
    assert main(["repeat", "-n", "1", "--out-dir", str(tmp_path / "o"), "--target", "nan"]) == 2
    one_error_line(capsys, "nanoshampoo repeat", "--target")
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "o").exists()


def _corrupt(lines: list[str], index: int, replacement: str) -> str:
    lines = list(lines)
    lines[index % len(lines)] = replacement
    return "\n".join(lines) + "\n"


@settings(
    max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    index=st.integers(0, 20),
    replacement=st.one_of(
        st.text(max_size=40),
        st.builds(
            json.dumps,
            st.dictionaries(
                st.sampled_from(
                    [
                        "kind",
                        "step",
                        "total_steps",
                        "val_loss",
                        "train_time_ms",
                        "seed",
                        "world_size",
                        "step_avg_ms",
                        "config",
                    ]
                ),
                st.one_of(
                    st.integers(-3, 10**12),
                    st.floats(allow_nan=True),
                    st.text(max_size=5),
                    st.none(),
                    st.sampled_from(["val", "final", "config", "diverged"]),
                ),
                max_size=6,
            ),
        ),
    ),
)
def test_stats_on_a_corrupted_log_succeeds_or_names_the_file(index: int, replacement: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        log = write_run_log(Path(tmp) / "A" / "run.jsonl")
        log.write_text(_corrupt(log.read_text().splitlines(), index, replacement))
        before = snapshot(Path(tmp))
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            status = main(["stats", str(log)])
        assert snapshot(Path(tmp)) == before
    if status != 0:
        lines = err.getvalue().splitlines()
        assert status == EXIT_USER_ERROR and len(lines) == 1, err.getvalue()
        assert lines[0].startswith("nanoshampoo stats: error: ") and "run.jsonl" in lines[0]


@pytest.mark.parametrize("command", ["stats", "trace"])
def test_an_input_name_too_long_is_one_line(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "x" * 300 + (".jsonl" if command == "stats" else ".json")
    before = snapshot(tmp_path)
    assert main([command, str(tmp_path / name)]) == EXIT_USER_ERROR
    one_error_line(capsys, f"nanoshampoo {command}", "x" * 50)
    assert snapshot(tmp_path) == before


EVENT_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 10**6),
    st.floats(),
    st.text(max_size=6),
    st.lists(st.integers(), max_size=2),
)


@settings(max_examples=40, deadline=None, database=None)
@given(
    events=st.lists(
        st.dictionaries(
            st.sampled_from(["ph", "name", "cat", "ts", "dur", "pid", "tid", "args"]),
            st.one_of(
                EVENT_VALUES,
                st.sampled_from(["X", "M", "gloo:all_reduce", "aten::mm", "cpu_op", "kernel"]),
            ),
            max_size=8,
        ),
        max_size=6,
    )
)
def test_trace_on_generated_events_reports_or_names_the_file(events: list[dict]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "t.json"
        trace.write_text(json.dumps({"traceEvents": events}))
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            status = main(["trace", str(trace)])
    if status == 0:
        assert "nan" not in out.getvalue().split("\n", 2)[1]  # the figures of the rank's row
    else:
        lines = err.getvalue().splitlines()
        assert status == EXIT_USER_ERROR and len(lines) == 1, err.getvalue()
        assert lines[0].startswith("nanoshampoo trace: error: ") and "t.json" in lines[0]


@settings(max_examples=30, deadline=None, database=None)
@given(
    target=st.lists(
        st.sampled_from(["A", "B", "r_seed0.jsonl", "b.jsonl", "f", "new", "x.json", "."]),
        min_size=1,
        max_size=4,
    )
)
def test_stats_json_anywhere_writes_a_new_file_or_refuses_changing_nothing(
    target: list[str],
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        runs = write_run_group(root / "A")
        write_run_log(root / "B" / "b.jsonl")
        (root / "f").write_text("a file")
        out = root.joinpath(*target)
        before = snapshot(root)
        existed = out.exists()
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            status = main(["stats", str(runs), "--json", str(out)])
        after = snapshot(root)
        if status == 0:
            assert json.loads(out.read_text())["groups"]
            written = out.resolve().relative_to(root.resolve())
            made_dirs = {str(p) for p in written.parents if str(p) not in before} - {"."}
            changed = {k for k in after if after.get(k) != before.get(k)}
            assert changed <= {str(written)} | made_dirs  # the report and its new directories
            assert not existed or before[str(written)][0] != "dir"
        else:
            assert status == EXIT_USER_ERROR and len(err.getvalue().splitlines()) == 1
            assert err.getvalue().startswith("nanoshampoo stats: error: --json")
            assert after == before


TXT_LINES = [
    "step:0/100 val_loss:6.0000 train_time:0ms step_avg:0.00ms",
    "step:50/100 train_loss:4.1000 train_time:500ms step_avg:10.00ms",
    "step:100/100 val_loss:3.5000 train_time:1000ms step_avg:10.00ms",
    "peak memory allocated: 12 MiB reserved: 16 MiB",
]


@settings(max_examples=40, deadline=None, database=None)
@given(
    lines=st.lists(
        st.one_of(
            st.sampled_from(
                TXT_LINES
                + [
                    "diverged at step:7/100: loss is nan",
                    "resumed from x at step 50",
                    "step:100/90 val_loss:nan train_time:1ms step_avg:1ms",
                ]
            ),
            st.text(max_size=30),
        ),
        max_size=8,
    )
)
def test_stats_on_a_generated_text_log_reports_or_names_the_file(lines: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "run.txt"
        log.write_text("\n".join(lines) + "\n")
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            status = main(["stats", str(log)])
    if status != 0:
        out = err.getvalue().splitlines()
        assert status == EXIT_USER_ERROR and len(out) == 1, err.getvalue()
        assert out[0].startswith("nanoshampoo stats: error: ") and "run.txt" in out[0]
