"""Bad trainer flags and presets found by the second audit: exit status 2, one line naming the
flag (or the preset file), and nothing on disk changed (no log, no data, no checkpoint)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from bad_input_fixtures import (
    EXIT_USER_ERROR,
    one_error_line,
    snapshot,
    train_argv,
    write_token_shards,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoshampoo.train.cli import PROG, main
from nanoshampoo.train.setups.shampoo_family import MuonConfig


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_token_shards(tmp_path_factory.mktemp("shards"))


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], root: Path, *names: str) -> str:
    before = snapshot(root)
    assert main(argv) == EXIT_USER_ERROR
    line = one_error_line(capsys, PROG, *names)
    assert snapshot(root) == before
    return line


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--muon.lr", "0.1"], ["--muon.lr", "'adamw'", "[adamw]"]),
        (["--shampoo.epsilon", "1e-10"], ["--shampoo.epsilon"]),
        (["--custom.matrix-kwargs", '{"lr": 1}'], ["--custom.matrix-kwargs"]),
        (["--preconditioner.factor-dtype", "bfloat16"], ["--preconditioner.factor-dtype"]),
        (["--distributor.kind", "ddp"], ["--distributor.kind", "'adamw'"]),
    ],
)
def test_a_flag_of_a_table_the_setup_does_not_read_is_refused(
    flags: list[str],
    names: list[str],
    shards: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Before: accepted and ignored (the log does not even record it), so the run the user
    # thinks they changed is the default one.
    _refused([*train_argv(shards, tmp_path), *flags], capsys, tmp_path, *names)


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--muon-lr", "0.1"], ["--muon-lr is now --muon.lr"]),
        (["--precondition-frequency", "3"], ["is now --shampoo.precondition-frequency"]),
        (["--autocast-bf16", "true"], ["--autocast-bf16 is now --autocast"]),
    ],
)
def test_an_old_flag_is_refused_naming_its_new_spelling(
    flags: list[str],
    names: list[str],
    shards: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _refused([*train_argv(shards, tmp_path), *flags], capsys, tmp_path, *names)


def test_a_preset_table_that_the_setup_does_not_read_is_fine(
    shards: dict[str, str], tmp_path: Path
) -> None:
    from nanoshampoo.train.cli import config_from_args

    cfg = config_from_args(["--preset", "tiny-muon", *train_argv(shards, tmp_path)])
    assert cfg.optimizer == "adamw" and cfg.table(MuonConfig).lr == 0.02


@settings(
    max_examples=8,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(seed=st.integers(2**63, 10**40))
def test_a_seed_beyond_64_bits_is_refused(
    seed: int, shards: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: a ValueError traceback from torch.manual_seed ("Overflow when unpacking long").
    _refused(train_argv(shards, tmp_path, seed=seed), capsys, tmp_path, "--seed", str(seed))


@settings(
    max_examples=8,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(threads=st.integers(1025, 10**12))
def test_a_huge_thread_count_is_refused(
    threads: int, shards: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: --threads 100000 exhausted memory creating threads (OSError, a broken process).
    _refused(train_argv(shards, tmp_path, threads=threads), capsys, tmp_path, "--threads")


@pytest.mark.parametrize("steps", ["2", "5", "0,1,9"])
def test_profile_steps_beyond_the_run_are_refused(
    steps: str, shards: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: the run finished and no trace was written, without a word.
    _refused(
        train_argv(shards, tmp_path, profile_steps=steps, profile_dir=tmp_path / "prof"),
        capsys,
        tmp_path,
        "--profile-steps",
        "--num-iterations 2",
    )


@pytest.mark.parametrize("kind", ["dir", "fifo"])
@pytest.mark.parametrize("via", ["--preset", "extends"])
def test_a_preset_that_is_not_a_regular_file_says_so(
    kind: str, via: str, shards: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    odd = tmp_path / "odd.toml"
    os.mkdir(odd) if kind == "dir" else os.mkfifo(odd)
    preset = odd
    if via == "extends":
        preset = tmp_path / "child.toml"
        preset.write_text('extends = "odd.toml"\n')
    # Before: "preset file ... does not exist", of a file that exists.
    _refused(
        ["--preset", str(preset), *train_argv(shards, tmp_path)],
        capsys,
        tmp_path,
        "odd.toml",
        "not a regular file",
    )


def test_a_custom_optimizer_whose_step_needs_a_closure_is_refused(
    shards: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: a TypeError traceback at the first step (LBFGS.step() missing 'closure').
    _refused(
        train_argv(
            shards,
            tmp_path,
            optimizer="custom",
            **{
                "custom.matrix_optimizer": "torch.optim:LBFGS",
                "custom.matrix_kwargs": '{"lr": 0.1}',
            },
        ),
        capsys,
        tmp_path,
        "--custom.matrix-optimizer",
        "closure",
    )


def test_a_bad_resume_prepares_no_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: the embedded corpus was tokenized into --data-dir, then --resume was refused.
    argv = [
        "--preset",
        "tiny-adamw",
        "--num-iterations",
        "2",
        "--val-every",
        "0",
        "--progress",
        "false",
        "--threads",
        "1",
        "--autocast",
        "off",
        "--data-dir",
        str(tmp_path / "data"),
        "--out-dir",
        str(tmp_path / "out"),
        "--resume",
        str(tmp_path / "missing"),
    ]
    _refused(argv, capsys, tmp_path, "--resume")
