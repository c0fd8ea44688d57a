"""End-to-end training runs: loss goes down, logs parse, resume is exact, ranks stay identical."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from nanoshampoo.evidence.logs import read_run
from nanoshampoo.model.gpt import gpt_preset
from nanoshampoo.testing.distributed import run_on_gloo
from nanoshampoo.train import thread_tuner
from nanoshampoo.train.cli import main as cli_main
from nanoshampoo.train.config import TrainConfig, UserError
from nanoshampoo.train.run_log import logged_source
from nanoshampoo.train.setups import setup_names
from nanoshampoo.train.throughput import gpt_matmul_flops_per_token
from nanoshampoo.train.trainer import Trainer

VOCAB = 64
STEP_LINE = re.compile(
    r"^step:(\d+)/(\d+) (val_loss|train_loss):(\d+\.\d{4}) train_time:(\d+)ms "
    r"step_avg:(\d+\.\d{2})ms$"
)
JSONL_KEYS = {
    "config": {
        "kind",
        "run_id",
        "seed",
        "preset",
        "optimizer",
        "world_size",
        "autocast",
        "autocast_reason",
        "compile",
        "compile_reason",
        "threads",
        "threads_reason",
        "resumed_from",
        "mfu",
        "non_embedding_params",
        "telemetry_every",
        "config",
    },
    "train": {
        "kind",
        "step",
        "total_steps",
        "train_loss",
        "train_time_ms",
        "step_avg_ms",
        "tokens_per_s",
        "mfu",
    },
    "val": {"kind", "step", "total_steps", "val_loss", "train_time_ms", "step_avg_ms"},
    "final": {
        "kind",
        "step",
        "total_steps",
        "val_loss",
        "train_time_ms",
        "step_avg_ms",
        "peak_memory_mib",
        "mfu",
        "phases_s",
    },
}


def tiny_config(shards: dict[str, str], out_dir: Path, **overrides: Any) -> TrainConfig:
    fields: dict[str, Any] = dict(
        preset="test",
        model="tiny",
        dataset="shards",
        vocab_size=VOCAB,
        seq_len=32,
        batch_size=4,
        num_iterations=8,
        val_every=4,
        val_tokens=512,
        log_every=1,
        progress=False,
        out_dir=str(out_dir),
        run_id="run",
        save_final_checkpoint=False,
        autocast="off",
        threads=1,
        **{"shampoo.precondition_frequency": 2},
        **shards,
    )
    fields.update(overrides)
    return TrainConfig(**fields)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def flat_params(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in trainer.model.parameters()])


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
def test_cli_run_lowers_the_loss_and_writes_both_logs(
    shards: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--preset",
        "tiny-shampoo",
        "--dataset",
        "shards",
        "--vocab-size",
        str(VOCAB),
        "--train-files",
        shards["train_files"],
        "--val-files",
        shards["val_files"],
        "--seq-len",
        "32",
        "--batch-size",
        "8",
        "--num-iterations",
        "40",
        "--val-every",
        "20",
        "--val-tokens",
        "1024",
        "--log-every",
        "5",
        "--out-dir",
        str(tmp_path),
        "--run-id",
        "e2e",
        "--seed",
        "3",
        "--save-final-checkpoint",
        "false",
        "--threads",
        "1",
    ]
    assert cli_main(argv) == 0
    assert "final val_loss" in capsys.readouterr().out

    records = read_jsonl(tmp_path / "e2e.jsonl")
    for record in records:
        if record["kind"] != "telemetry":  # keys by setup: telemetry_test.py
            assert set(record) == JSONL_KEYS[record["kind"]], record
    config = records[0]
    assert config["kind"] == "config" and config["optimizer"] == "shampoo"
    assert (config["run_id"], config["seed"], config["world_size"]) == ("e2e", 3, 1)
    assert config["non_embedding_params"] == 792448  # tiny (gpt_test's formula)
    assert (
        TrainConfig(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in config["config"].items()}
        ).schedule.num_iterations
        == 40
    )
    vals = [r for r in records if r["kind"] == "val"]
    assert [r["step"] for r in vals] == [0, 20, 40]
    # Telemetry by default at each validation, after the step that ends there.
    assert sorted({r["step"] for r in records if r["kind"] == "telemetry"}) == [20, 40]
    assert vals[-1]["val_loss"] < vals[0]["val_loss"] - 1.0  # from ~ln(64) = 4.16
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(5, 41, 5))
    assert records[-1]["kind"] == "final" and records[-1]["val_loss"] == vals[-1]["val_loss"]
    # MFU: the model's matmul FLOPs per step (8 x 32 tokens) over the step time and the peak.
    meter = config["mfu"]
    flops = gpt_matmul_flops_per_token(gpt_preset("tiny", VOCAB), 32) * 8 * 32
    assert meter["flops_per_step"] == flops and meter["peak_flops_per_second"] > 0
    final = records[-1]
    assert final["mfu"] == pytest.approx(
        flops / (final["train_time_ms"] / 1000 / 40) / meter["peak_flops_per_second"]
    )
    for record in (r for r in records if r["kind"] == "train"):
        assert 0 < record["mfu"] < 1
    assert read_run(tmp_path / "e2e.jsonl").mfu == final["mfu"]  # the leaderboard's MFU column

    text = (tmp_path / "e2e.txt").read_text()
    source = logged_source(tmp_path / "e2e.txt")  # stored once beside the runs, named by hash
    assert source.startswith("# ===== nanoshampoo/train/")
    trainer_source = Path(Trainer.__module__.replace(".", "/") + ".py")
    assert f"# ===== {trainer_source.as_posix()} =====" in source
    assert "# ===== nanoshampoo/model/gpt.py =====" in source
    # The optimizer under study is part of the code that ran; its tests are not.
    assert "# ===== nanoshampoo/optim/shampoo/distributed_shampoo.py =====" in source
    assert "/tests/" not in "".join(
        line for line in source.splitlines() if line.startswith("# =====")
    )
    assert Path(__import__("nanoshampoo.model.gpt").model.gpt.__file__).read_text() in source
    lines = text.splitlines()
    step_lines = [m for m in map(STEP_LINE.match, lines) if m]
    assert len(step_lines) == 3 + 8
    val_lines = [m for m in step_lines if m.group(3) == "val_loss"]
    assert [float(m.group(4)) for m in val_lines] == [round(r["val_loss"], 4) for r in vals]
    assert re.fullmatch(r"peak memory allocated: \d+ MiB reserved: \d+ MiB", lines[-1])
    assert re.fullmatch(r"# ===== source: sources/[0-9a-f]{64}\.source =====", lines[0])
    assert "class Trainer" in source


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "shampoo"])
def test_resume_from_checkpoint_repeats_the_uninterrupted_losses(
    optimizer: str, shards: dict[str, str], tmp_path: Path
) -> None:
    full = Trainer(
        tiny_config(
            shards,
            tmp_path,
            optimizer=optimizer,
            run_id="full",
            checkpoint_every=4,
            autocast="bf16",
        )
    ).run()
    resumed = Trainer(
        tiny_config(
            shards,
            tmp_path,
            optimizer=optimizer,
            run_id="resumed",
            autocast="bf16",
            resume=str(tmp_path / "full.ckpt" / "step_000004"),
        )
    ).run()

    def losses(path: Path) -> dict[tuple[str, int], float]:
        return {
            (r["kind"], r["step"]): r.get("train_loss", r.get("val_loss"))
            for r in read_jsonl(path)
            if r["kind"] in ("train", "val")
        }

    before, after = losses(full.jsonl_log), losses(resumed.jsonl_log)
    assert sorted(after) == [("train", s) for s in range(5, 9)] + [("val", 4), ("val", 8)]
    assert after == {key: before[key] for key in after}
    assert resumed.final_val_loss == full.final_val_loss
    assert full.last_checkpoint == tmp_path / "full.ckpt" / "step_000008"
    # MFU of the average step over the whole run: the resumed time counts all 8 steps.
    records = read_jsonl(resumed.jsonl_log)
    meter, final = records[0]["mfu"], records[-1]
    assert final["mfu"] == pytest.approx(
        meter["flops_per_step"]
        / (final["train_time_ms"] / 1000 / 8)
        / meter["peak_flops_per_second"]
    )


def test_resume_rejects_a_checkpoint_of_another_setup(
    shards: dict[str, str], tmp_path: Path
) -> None:
    Trainer(
        tiny_config(
            shards,
            tmp_path,
            optimizer="adamw",
            num_iterations=1,
            val_every=0,
            save_final_checkpoint=True,
        )
    ).run()
    checkpoint = tmp_path / "run.ckpt" / "step_000001"
    assert (checkpoint / "rank0.pt").is_file()
    with pytest.raises(ValueError, match="optimizers"):
        Trainer(tiny_config(shards, tmp_path, optimizer="shampoo", resume=str(checkpoint)))
    with pytest.raises(UserError, match="step_000099"):
        Trainer(tiny_config(shards, tmp_path, resume=str(tmp_path / "run.ckpt" / "step_000099")))


def test_profile_steps_write_one_chrome_trace(shards: dict[str, str], tmp_path: Path) -> None:
    trace_dir = tmp_path / "trace"
    Trainer(
        tiny_config(
            shards,
            tmp_path,
            optimizer="adamw",
            num_iterations=4,
            val_every=0,
            profile_steps=(1, 2),
            profile_dir=str(trace_dir),
        )
    ).run()
    assert (trace_dir / "rank0.json.gz").is_file()


# (run id, optimizer setup, Shampoo distributor): "auto" is the DDP distributor on 2 ranks.
RUNS = (
    ("adamw", "adamw", "auto"),
    ("shampoo-ddp", "shampoo", "auto"),
    ("shampoo-single", "shampoo", "single"),
    ("distadam", "distadam", "auto"),
    ("shampoo-distadam", "shampoo-distadam", "auto"),
)
RESUMED = ("shampoo-ddp", "distadam")  # setups whose optimizer state differs per rank
# The smallest model size (2 layers, width 96): the ranks' agreement needs no larger one.
TWO_RANK_MODEL = "gpt-0.2m"


def train_every_setup_on_rank(
    rank: int, world_size: int, shards: dict[str, str], out_dir: str
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for run_id, optimizer, distributor in RUNS:
        cfg = tiny_config(
            shards,
            Path(out_dir),
            optimizer=optimizer,
            run_id=run_id,
            **{"distributor.kind": distributor},
            checkpoint_every=4,
            model=TWO_RANK_MODEL,
        )
        trainer = Trainer(cfg)
        result = trainer.run()
        results[run_id] = {
            "params": flat_params(trainer),
            "val_loss": torch.tensor(result.final_val_loss),
        }
    for run_id, optimizer, distributor in RUNS:
        if run_id in RESUMED:
            resumed = Trainer(
                tiny_config(
                    shards,
                    Path(out_dir),
                    optimizer=optimizer,
                    run_id=f"{run_id}-resumed",
                    **{"distributor.kind": distributor},
                    resume=str(Path(out_dir) / f"{run_id}.ckpt" / "step_000004"),
                    model=TWO_RANK_MODEL,
                )
            )
            resumed.run()
            results[f"{run_id}-resumed"] = {"params": flat_params(resumed)}
    return results


@pytest.mark.slow
@pytest.mark.distributed
def test_two_rank_runs_keep_ranks_identical_and_match_one_process(
    shards: dict[str, str], tmp_path: Path
) -> None:
    rank0, rank1 = run_on_gloo(train_every_setup_on_rank, 2, shards, str(tmp_path))
    assert set(rank0) == {run_id for run_id, _, _ in RUNS} | {f"{r}-resumed" for r in RESUMED}
    for name in rank0:
        torch.testing.assert_close(rank0[name]["params"], rank1[name]["params"], rtol=0, atol=0)
    # Resuming per-rank optimizer state (DistAdam shards, DDP Shampoo's owned blocks) from
    # per-rank checkpoint files continues the same run bit for bit.
    for name in RESUMED:
        torch.testing.assert_close(
            rank0[f"{name}-resumed"]["params"], rank0[name]["params"], rtol=0, atol=0
        )
    # Distributing Shampoo's blocks over ranks computes the same update as every rank doing all.
    torch.testing.assert_close(
        rank0["shampoo-ddp"]["params"], rank0["shampoo-single"]["params"], rtol=0, atol=1e-6
    )
    # The 2-rank run sees the same global batches as one process: same result up to rounding
    # (Adam with eps 1e-10 turns rounding-level gradient differences of near-zero entries into
    # update differences of up to ~1e-4, measured 9.0e-6 at gpt-0.2m; a real averaging bug moves
    # parameters by ~lr = 0.3).
    single = Trainer(
        tiny_config(shards, tmp_path / "single", optimizer="adamw", model=TWO_RANK_MODEL)
    )
    single_result = single.run()
    torch.testing.assert_close(rank0["adamw"]["params"], flat_params(single), rtol=0, atol=2e-4)
    assert abs(rank0["adamw"]["val_loss"].item() - single_result.final_val_loss) < 1e-4
    # The 2-rank log is written by rank 0 only and records the world size.
    config = read_jsonl(tmp_path / "adamw.jsonl")[0]
    assert config["world_size"] == 2


def params_after(shards: dict[str, str], out_dir: Path, **overrides: Any) -> torch.Tensor:
    trainer = Trainer(tiny_config(shards, out_dir, num_iterations=3, val_every=0, **overrides))
    trainer.run()
    return flat_params(trainer)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "shampoo", "distadam"])
def test_grad_accumulation_equals_one_large_batch(
    optimizer: str, shards: dict[str, str], tmp_path: Path
) -> None:
    # eps 1e-8 (Shampoo: 1e-6), not the recipe's 1e-10 (1e-12): Adam divides by sqrt(v) + eps
    # and Shampoo inverts rank-deficient factors + eps I; both turn rounding-level
    # gradient differences of near-zero entries into large update differences.
    eps = {"adam.eps": 1e-8, "shampoo.grafting_epsilon": 1e-8, "shampoo.epsilon": 1e-6}
    one = params_after(shards, tmp_path, optimizer=optimizer, run_id="k1", **eps)
    four = params_after(
        shards, tmp_path, optimizer=optimizer, run_id="k4", grad_accum_steps=4, **eps
    )
    # Only float rounding separates them (micro-batch gradients are summed in another order):
    # up to ~4e-5 on the embedding (lr 0.3); a real error moves parameters by ~lr (>= 1.5e-3).
    torch.testing.assert_close(four, one, rtol=0, atol=1e-4)
    # The loss (and so the gradient) is scaled by 1/K: step 1's loss is the full batch's mean.
    losses = [
        [r["train_loss"] for r in read_jsonl(tmp_path / f"{run}.jsonl") if r["kind"] == "train"]
        for run in ("k1", "k4")
    ]
    assert losses[1][0] == pytest.approx(losses[0][0], abs=1e-6)
    assert not torch.equal(
        one,
        params_after(shards, tmp_path, optimizer=optimizer, run_id="other", batch_size=2, **eps),
    )


def accumulate_on_rank(
    rank: int, world_size: int, shards: dict[str, str], out_dir: str
) -> dict[str, torch.Tensor]:
    return {
        f"{optimizer}-k{k}": params_after(
            shards,
            Path(out_dir),
            optimizer=optimizer,
            run_id=f"{optimizer}-k{k}",
            grad_accum_steps=k,
            model=TWO_RANK_MODEL,
            **{"adam.eps": 1e-8, "shampoo.grafting_epsilon": 1e-8, "shampoo.epsilon": 1e-6},
        )
        for optimizer in ("distadam", "shampoo")
        for k in (1, 2)
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_grad_accumulation_on_two_ranks_equals_one_large_batch(
    shards: dict[str, str], tmp_path: Path
) -> None:
    rank0, rank1 = run_on_gloo(accumulate_on_rank, 2, shards, str(tmp_path))
    for optimizer in ("distadam", "shampoo"):
        torch.testing.assert_close(
            rank0[f"{optimizer}-k2"], rank0[f"{optimizer}-k1"], rtol=0, atol=1e-4
        )
        torch.testing.assert_close(
            rank0[f"{optimizer}-k2"], rank1[f"{optimizer}-k2"], rtol=0, atol=0
        )


@pytest.mark.parametrize(
    "optimizer, extra",
    [
        *[(setup, {}) for setup in setup_names() if setup != "custom"],  # custom: its own test
        ("shampoo", {"preconditioner.rank_deficient_stability": "pseudo-inverse"}),
        ("kl-shampoo", {"preconditioner.rank_deficient_stability": "pseudo-inverse"}),
        ("soap", {"preconditioner.factor_dtype": "bfloat16"}),
    ],
)
def test_every_setup_trains(
    optimizer: str, extra: dict[str, str], shards: dict[str, str], tmp_path: Path
) -> None:
    result = Trainer(
        tiny_config(shards, tmp_path, optimizer=optimizer, num_iterations=3, val_every=0, **extra)
    ).run()
    assert math.log(VOCAB) - 1.0 < result.final_val_loss < math.log(VOCAB) + 0.5


def test_cpu_threads_are_reprobed_during_the_run(
    shards: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def fake_cpu_threads(requested: int, local_world_size: int) -> tuple[int, str]:
        calls.append(requested)
        return 1, "probed"

    monkeypatch.setattr(thread_tuner, "cpu_threads", fake_cpu_threads)
    Trainer(
        tiny_config(shards, tmp_path, optimizer="adamw", threads=0, num_iterations=21, val_every=0)
    ).run()
    assert calls == [0, 0, 0]  # at start, before steps 10 and 20
    calls.clear()
    Trainer(
        tiny_config(
            shards,
            tmp_path,
            optimizer="adamw",
            run_id="fixed",
            threads=1,
            num_iterations=11,
            val_every=0,
        )
    ).run()
    assert calls == [1]  # a fixed count is set once
