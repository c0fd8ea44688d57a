"""Bad input to ``nanoshampoo tune``, ``compare``, ``repeat``, ``stats`` and ``trace`` found by
the second audit: exit status 2, one line naming the flag or field, nothing on disk changed,
and no run started."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from bad_input_fixtures import (
    EXIT_USER_ERROR,
    one_error_line,
    snapshot,
    write_run_group,
    write_trace,
    x_event,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nanoshampoo.cli import main

# Train flags of a run that would start if a refusal came too late (it never gets that far).
TRAIN = ["--", "--num-iterations", "2", "--val-every", "0", "--progress", "false"]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # tune and compare default to runs/ under the working directory


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], root: Path, *names: str) -> str:
    before = snapshot(root)
    assert main(argv) == EXIT_USER_ERROR
    line = one_error_line(capsys, f"nanoshampoo {argv[0]}", *names)
    assert snapshot(root) == before
    return line


@pytest.mark.parametrize(
    "search, names",
    [
        ("", ["search", "KEY=V1,V2"]),
        ("adamw.lr=", ["search", "adamw.lr="]),
        ("adamw.lr=,", ["search", "adamw.lr"]),
        ("adamw.lr=0.1,0.1", ["search", "repeated"]),
        ("adamw.lr=log:1:0.1", ["search", "0 < LO < HI"]),
        ("adamw.lr=log:a:1", ["search", "log:LO:HI"]),
        ("adamw.nosuch=1", ["--adamw.nosuch"]),
        ("nosuch=1", ["--nosuch"]),
        ("muon.lr=0.1", ["muon.lr", "adamw"]),
        ("num_iterations=1,2", ["num_iterations", "budget", "cannot be searched"]),
        (
            "num-iterations=1,2",
            ["search: num-iterations", "num_iterations", "budget", "cannot be searched"],
        ),
        ("batch-size=8,16", ["search: batch-size", "batch_size", "budget", "cannot be searched"]),
        ("run-id=a,b", ["search: run-id", "run_id", "set by tune for each run"]),
        ("batch_size=log:1:8", ["batch_size", "cannot be searched"]),
        ("seq_len=64,128", ["seq_len", "cannot be searched"]),
        ("grad_accum_steps=1,2", ["grad_accum_steps", "cannot be searched"]),
        ("adamw.weight-decay=0,0.1", ["search: write adamw.weight_decay, not adamw.weight-decay"]),
        ("matrix_lr=0.01,0.02", ["search: matrix_lr is now shampoo.lr or adamw.lr"]),
        ("distributor=ddp", ["search: distributor is now distributor.kind"]),
        ("adamw=1,2", ["search", "adamw is a table", "adamw.FIELD"]),
        ("adamw.lr.x=1,2", ["adamw.lr", "not a table of keyword arguments"]),
        (
            'custom.matrix_kwargs={"lr": 0.1}',
            ["custom.matrix_kwargs", "one entry", "custom.matrix_kwargs.lr="],
        ),
        ("adamw..lr=1", ["search", "empty name"]),
        ("adamw.lr=abc,0.1", ["--adamw.lr", "abc"]),
    ],
)
def test_tune_refuses_a_bad_search_in_one_line(
    search: str, names: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _refused(["tune", "--setup", "adamw", "--search", search, *TRAIN], capsys, tmp_path, *names)


def test_tune_refuses_an_absurd_grid_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    values = ",".join(f"{i + 1}e-4" for i in range(300))
    _refused(
        [
            "tune",
            "--setup",
            "adamw",
            "--search",
            f"adamw.lr={values}",
            "--search",
            f"adamw.weight_decay={values}",
            *TRAIN,
        ],
        capsys,
        tmp_path,
        "300 x 300 = 90000 trials",
        "more than 10000",
    )


def test_tune_refuses_an_absurd_trial_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    search = ["tune", "--setup", "adamw", "--search", "adamw.lr=log:0.001:0.1"]
    _refused(
        [*search, "--trials", "1000000000", *TRAIN],
        capsys,
        tmp_path,
        "trials",
        "1000000000",
        "more than 10000",
    )
    with pytest.raises(SystemExit) as refused:  # not an integer: argparse's own one line
        main([*search, "--trials", "1e9", *TRAIN])
    assert refused.value.code == EXIT_USER_ERROR
    one_error_line(capsys, "nanoshampoo tune", "--trials", "1e9")


@pytest.mark.parametrize(
    "rungs, names",
    [
        ("0.3,0.5", ["rungs", "1/eta^m"]),
        ("0.5,0.25", ["rungs", "ascending"]),
        ("x", ["--rungs", "fractions"]),
        ("0.25,0.5", ["rungs", "2 steps", "step count"]),
    ],
)
def test_tune_refuses_bad_rungs(
    rungs: str, names: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _refused(
        ["tune", "--setup", "adamw", "--search", "adamw.lr=0.001,0.01", "--rungs", rungs, *TRAIN],
        capsys,
        tmp_path,
        *names,
    )


def test_tune_refuses_a_study_name_that_is_not_plain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _refused(
        ["tune", "--setup", "adamw", "--search", "adamw.lr=0.001,0.01", "--study", "a/b", *TRAIN],
        capsys,
        tmp_path,
        "study",
        "'a/b'",
    )


def test_tune_refuses_a_storage_that_is_not_a_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _refused(
        [
            "tune",
            "--setup",
            "adamw",
            "--search",
            "adamw.lr=0.001,0.01",
            "--storage",
            "study.db",
            *TRAIN,
        ],
        capsys,
        tmp_path,
        "--storage",
        "expected a URL",
    )


def test_tune_refuses_a_log_range_over_a_kwargs_entry_that_is_not_real(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    preset = tmp_path / "sgd.toml"
    preset.write_text(
        'extends = "tiny-adamw"\noptimizer = "custom"\n\n[custom]\n'
        'matrix_optimizer = "torch.optim:SGD"\n'
        "matrix_kwargs = {lr = 0.05, nesterov = false, momentum = 0.9}\n"
    )
    _refused(
        [
            "tune",
            "--setup",
            f"sgd={preset}",
            "--search",
            "custom.matrix_kwargs.nesterov=log:0.1:1",
            "--trials",
            "2",
            *TRAIN,
        ],
        capsys,
        tmp_path,
        "custom.matrix_kwargs.nesterov",
        "real numbers",
        "grid",
    )


def test_compare_tune_checks_every_spec_before_any_trial_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: AdamW's trials trained before the malformed Muon spec was reached.
    _refused(
        [
            "compare",
            "--setups",
            "adamw,muon",
            "--tune",
            "adamw:adamw.lr=0.001,0.003",
            "--tune",
            "muon:muon.nosuch=0.01,0.02",
            *TRAIN,
        ],
        capsys,
        tmp_path,
        "--muon.nosuch",
    )
    _refused(
        [
            "compare",
            "--setups",
            "adamw,muon",
            "--tune",
            "adamw:adamw.lr=0.001,0.003",
            "--tune",
            "muon:muon.lr=0.01,x",
            *TRAIN,
        ],
        capsys,
        tmp_path,
        "--muon.lr",
        "'x'",
    )
    _refused(
        [
            "compare",
            "--setups",
            "adamw,muon",
            "--tune",
            "adamw:adamw.lr=log:0.001:0.1",
            "--tune",
            "muon:muon.lr=log:0.01:0.1",
            "--tune-trials",
            "1000000000",
            *TRAIN,
        ],
        capsys,
        tmp_path,
        "trials",
        "more than 10000",
    )


@pytest.mark.parametrize("trials", ["0", "-1"])
def test_tune_refuses_a_range_without_positive_trials(
    trials: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _refused(
        [
            "tune",
            "--setup",
            "adamw",
            "--search",
            "adamw.lr=log:0.01:0.1",
            "--trials",
            trials,
            *TRAIN,
        ],
        capsys,
        tmp_path,
        "trials",
    )


@pytest.mark.parametrize(
    "key",
    ["seed", "run_id", "out_dir", "resume", "optimizer", "preset", "decay_branches"],
)
def test_tune_refuses_to_search_a_field_it_sets_for_each_run(
    key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Searching the seed "tunes" noise: the best seed is written as a tuned preset.
    _refused(
        ["tune", "--setup", "adamw", "--search", f"{key}=1,2", *TRAIN],
        capsys,
        tmp_path,
        "search",
        key.replace("-", "_"),
        "set by tune",
    )


def test_tune_refuses_a_log_range_over_an_integer_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _refused(
        [
            "tune",
            "--setup",
            "shampoo",
            "--search",
            "shampoo.precondition_frequency=log:1:10",
            "--trials",
            "2",
            *TRAIN,
        ],
        capsys,
        tmp_path,
        "shampoo.precondition_frequency",
        "int",
        "grid",
    )


def test_tune_refuses_several_setups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(
        ["tune", "--setup", "adamw,muon", "--search", "adamw.lr=0.1", *TRAIN],
        capsys,
        tmp_path,
        "setup",
        "adamw,muon",
    )


@pytest.mark.parametrize(
    "command",
    [
        ["tune", "--setup", "adamw", "--search", "adamw.lr=0.1"],
        ["compare", "--setups", "adamw"],
    ],
)
@pytest.mark.parametrize("out_dir", ["{tmp}/file", "{tmp}/file/sub", "/proc/x"])
def test_an_unusable_out_dir_is_refused_before_any_run(
    command: list[str], out_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("not a directory")
    _refused(
        [*command, "--out-dir", out_dir.format(tmp=tmp_path), *TRAIN], capsys, tmp_path, "out-dir"
    )


@settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    spec=st.one_of(
        st.text(st.sampled_from("=,:;log.-ae1 "), max_size=12),
        st.builds(
            lambda k, v: f"{k}={v}",
            st.sampled_from(["adamw.lr", "adamw.beta1", "lr", ""]),
            st.text(st.sampled_from(",:abcinf-1.0log"), max_size=10),
        ),
    )
)
# Python 3.11's argparse hands "--search=--" over as an empty list, not the string "--".
@example(spec="--")
def test_tune_on_a_generated_search_refuses_in_one_line_or_is_a_valid_search(
    spec: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No generated ``--search`` reaches the user as a traceback or changes the disk; the few
    valid ones are checked to parse and are not run here."""
    from nanoshampoo.evidence.tune import parse_search

    try:
        search = parse_search(spec)
    except ValueError:
        search = None
    if search is not None and search.key == "adamw.lr":
        try:
            valid = search.is_range or all(0 <= float(v) < float("inf") for v in search.values)
        except ValueError:
            valid = False
        if valid:
            return  # a real grid or range: tune would train it
    capsys.readouterr()
    before = snapshot(tmp_path)
    status = main(["tune", "--setup", "adamw", f"--search={spec}", "--trials", "1", *TRAIN])
    assert status == EXIT_USER_ERROR
    one_error_line(capsys, "nanoshampoo tune")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "argv", [["compare", "--setups=--"], ["tune", "--setup", "adamw", "--search=--"]]
)
def test_a_flag_given_dashes_as_its_value_is_refused_in_one_line(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse (3.11) would hand the command an empty list for ``--FLAG=--``."""
    flag = next(a for a in argv if a.endswith("=--")).partition("=")[0]
    _refused([*argv, *TRAIN], capsys, tmp_path, flag, "expected a value, got '--'")


def test_compare_refuses_a_table_flag_that_a_setup_does_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _refused(
        ["compare", "--setups", "adamw", *TRAIN, "--muon.lr", "0.1"],
        capsys,
        tmp_path,
        "--muon.lr",
        "adamw",
    )


@pytest.mark.parametrize(
    "argv, names",
    [
        ([*TRAIN, "--muon-lr", "0.1"], ["train flags: --muon-lr is now --muon.lr"]),
        (
            ["--tune", "adamw:matrix_lr=0.1,0.2", *TRAIN],
            ["search: matrix_lr is now shampoo.lr or adamw.lr"],
        ),
    ],
)
def test_compare_refuses_an_old_name_naming_its_new_spelling(
    argv: list[str], names: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _refused(["compare", "--setups", "adamw", *argv], capsys, tmp_path, *names)


@pytest.mark.parametrize("flag", ["--seed", "--run-id", "--out-dir", "--resume"])
def test_repeat_refuses_a_flag_it_sets_in_one_line(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: a ValueError traceback (and --resume started every seed from one checkpoint).
    _refused(["repeat", "-n", "2", *TRAIN, flag, "x"], capsys, tmp_path, flag, "repeat")


@pytest.mark.parametrize("confidence", ["0", "1", "1.5", "-0.1", "nan", "inf"])
@pytest.mark.parametrize("groups", [1, 2])
def test_stats_refuses_a_confidence_outside_0_1(
    confidence: str, groups: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # With one group no interval is computed: the flag was silently ignored.
    dirs = [str(write_run_group(tmp_path / f"g{i}")) for i in range(groups)]
    _refused(["stats", *dirs, "--confidence", confidence], capsys, tmp_path, "--confidence")


@pytest.mark.parametrize("second", ["same", "link", "dotted"])
def test_trace_refuses_one_file_given_twice(
    second: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given twice, one rank's trace counted as two ranks in the report.
    trace = write_trace(tmp_path / "t.json", [x_event("aten::mm", 0.0, 5.0)])
    other = {"same": trace, "dotted": tmp_path / "." / "t.json", "link": tmp_path / "l.json"}[
        second
    ]
    if second == "link":
        os.symlink(trace, other)
    _refused(["trace", str(trace), str(other)], capsys, tmp_path, "given twice")
