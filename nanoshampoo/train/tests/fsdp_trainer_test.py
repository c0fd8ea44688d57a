"""The trainer's sharded modes (``--parallel fsdp2`` / ``hsdp``) on 2 gloo ranks.

Specification:

- fsdp2 and hsdp runs give the losses and parameters of the ddp run of the same seed, up to
  float32 rounding (FSDP reduce-scatters where DDP all-reduces; Shampoo ``round_robin`` and AdamW
  on DTensor shards compute the unsharded updates); so do fsdp2 and ddp with grad accumulation;
- a sharded (DCP) checkpoint written at world 2 resumes at world 2 and at world 1 and continues
  with the uninterrupted run's losses and parameters;
- a DistAdam setup, a distributor other than auto, or a ddp checkpoint is refused in one line.

One spawn runs every 2-rank case (spawning dominates the time on 2 shared cores).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_test import read_jsonl, tiny_config

from nanoshampoo.testing.distributed import run_on_gloo
from nanoshampoo.train.cli import main as cli_main
from nanoshampoo.train.config import TrainConfig, UserError
from nanoshampoo.train.distributed import local_tensor
from nanoshampoo.train.trainer import Trainer

STEPS, RESUME_AT = 6, 3
# Room for float32 rounding of FSDP's reduce-scatter vs the trainer's all-reduce (measured: none
# at 2 ranks, where both add two values and halve). A wrong reduction or update moves the loss
# by ~1e-2 and the parameters by ~lr (ddp shampoo vs ddp adamw after 6 steps: 0.50).
LOSS_TOLERANCE = 1e-5
PARAM_TOLERANCE = 1e-5
# The world-1 resume averages the whole batch, not two half-batch means: rounding-level gradient
# differences, which Adam with eps 1e-10 turns into update differences of near-zero entries
# (measured: at most 4.2e-6 over the 235,872 parameters of gpt-0.2m).
WORLD_1_PARAM_TOLERANCE = 2e-4


def config(shards: dict[str, str], out_dir: Path, **overrides: Any) -> TrainConfig:
    """The smallest model size (2 layers, width 96): every mode's agreement with ddp, measured
    exact at 6 steps, needs no larger one."""
    fields: dict[str, Any] = dict(
        num_iterations=STEPS, val_every=RESUME_AT, checkpoint_every=RESUME_AT, model="gpt-0.2m"
    )
    fields.update(overrides)
    return tiny_config(shards, out_dir, **fields)


def full_params(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter, gathered whole (collective for DTensors), flattened in float32."""
    tensors = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def losses(jsonl: Path) -> dict[tuple[str, int], float]:
    return {
        (r["kind"], r["step"]): r.get("train_loss", r.get("val_loss"))
        for r in read_jsonl(jsonl)
        if r["kind"] in ("train", "val")
    }


def train(cfg: TrainConfig) -> dict[str, Any]:
    trainer = Trainer(cfg)
    result = trainer.run()
    return {
        "params": full_params(trainer.model),
        "local_numel": sum(local_tensor(p).numel() for p in trainer.model.parameters()),
        "losses": losses(result.jsonl_log) if trainer.ctx.is_main else {},
    }


def train_every_mode_on_rank(
    rank: int, world_size: int, shards: dict[str, str], out_dir: str
) -> dict[str, Any]:
    out = Path(out_dir)
    results = {
        "ddp": train(config(shards, out, run_id="ddp")),
        "fsdp2": train(config(shards, out, run_id="fsdp2", parallel="fsdp2")),
        "hsdp": train(config(shards, out, run_id="hsdp", parallel="hsdp", hsdp_shard_size=1)),
        "hsdp-1x2": train(
            config(
                shards,
                out,
                run_id="hsdp-1x2",
                parallel="hsdp",
                hsdp_shard_size=2,
                checkpoint_every=0,
            )
        ),
        "fsdp2-accum": train(
            config(
                shards,
                out,
                run_id="fsdp2-accum",
                parallel="fsdp2",
                grad_accum_steps=2,
                checkpoint_every=0,
            )
        ),
        "ddp-accum": train(
            config(shards, out, run_id="ddp-accum", grad_accum_steps=2, checkpoint_every=0)
        ),
        "fsdp2-adamw": train(
            config(
                shards,
                out,
                run_id="fsdp2-adamw",
                parallel="fsdp2",
                optimizer="adamw",
                checkpoint_every=0,
            )
        ),
        "ddp-adamw": train(
            config(shards, out, run_id="ddp-adamw", optimizer="adamw", checkpoint_every=0)
        ),
    }
    checkpoint = out / "fsdp2.ckpt" / f"step_{RESUME_AT:06d}"
    results["fsdp2-resumed"] = train(
        config(shards, out, run_id="fsdp2-resumed", parallel="fsdp2", resume=str(checkpoint))
    )
    try:
        Trainer(config(shards, out, run_id="wrong", resume=str(checkpoint)))
    except UserError as exc:
        results["ddp-resume-error"] = str(exc)
    return results


def assert_close_losses(
    actual: dict[tuple[str, int], float], expected: dict[tuple[str, int], float], tolerance: float
) -> None:
    assert sorted(actual) == sorted(expected)
    for key in expected:
        assert abs(actual[key] - expected[key]) <= tolerance, (key, actual[key], expected[key])


@pytest.fixture(scope="module")
def two_rank_results(
    shards: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[Any]]:
    out = tmp_path_factory.mktemp("fsdp_runs")
    return out, run_on_gloo(train_every_mode_on_rank, 2, shards, str(out))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["fsdp2", "hsdp", "fsdp2-adamw"])
def test_sharded_runs_match_ddp(mode: str, two_rank_results: tuple[Path, list[Any]]) -> None:
    _, (rank0, rank1) = two_rank_results
    reference = "ddp-adamw" if mode == "fsdp2-adamw" else "ddp"
    assert_close_losses(rank0[mode]["losses"], rank0[reference]["losses"], LOSS_TOLERANCE)
    torch.testing.assert_close(
        rank0[mode]["params"], rank0[reference]["params"], rtol=0, atol=PARAM_TOLERANCE
    )
    # Both ranks hold the same gathered model.
    torch.testing.assert_close(rank0[mode]["params"], rank1[mode]["params"], rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.distributed
def test_hsdp_one_replica_matches_ddp(two_rank_results: tuple[Path, list[Any]]) -> None:
    _, (rank0, _) = two_rank_results
    torch.testing.assert_close(
        rank0["hsdp-1x2"]["params"], rank0["ddp"]["params"], rtol=0, atol=PARAM_TOLERANCE
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_grad_accumulation_matches_ddp(two_rank_results: tuple[Path, list[Any]]) -> None:
    """FSDP reduces once, after the last micro-batch, the sum of the scaled micro-batch
    gradients, as the trainer's all-reduce does under ddp."""
    _, (rank0, _) = two_rank_results
    assert_close_losses(
        rank0["fsdp2-accum"]["losses"], rank0["ddp-accum"]["losses"], LOSS_TOLERANCE
    )
    torch.testing.assert_close(
        rank0["fsdp2-accum"]["params"], rank0["ddp-accum"]["params"], rtol=0, atol=PARAM_TOLERANCE
    )
    # Accumulation changes only the rounding of the step-1 loss (the full batch's mean).
    step1 = ("train", 1)
    assert abs(rank0["fsdp2-accum"]["losses"][step1] - rank0["fsdp2"]["losses"][step1]) < 1e-6


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_shards_the_parameters(two_rank_results: tuple[Path, list[Any]]) -> None:
    _, (rank0, rank1) = two_rank_results
    total = rank0["ddp"]["local_numel"]
    assert rank0["fsdp2"]["local_numel"] + rank1["fsdp2"]["local_numel"] == total
    assert rank0["fsdp2"]["local_numel"] < total
    # hsdp with shard groups of 1 replicates, as ddp does.
    assert rank0["hsdp"]["local_numel"] == total


@pytest.mark.slow
@pytest.mark.distributed
def test_sharded_checkpoint_resumes_at_world_2(two_rank_results: tuple[Path, list[Any]]) -> None:
    out, (rank0, _) = two_rank_results
    resumed, full = rank0["fsdp2-resumed"], rank0["fsdp2"]
    assert sorted(resumed["losses"]) == (
        [("train", s) for s in range(RESUME_AT + 1, STEPS + 1)]
        + [("val", RESUME_AT), ("val", STEPS)]
    )
    assert resumed["losses"] == {key: full["losses"][key] for key in resumed["losses"]}
    torch.testing.assert_close(resumed["params"], full["params"], rtol=0, atol=0)
    checkpoint = out / "fsdp2.ckpt" / f"step_{RESUME_AT:06d}"
    assert (checkpoint / ".metadata").is_file() and (checkpoint / "meta.pt").is_file()
    assert not list(out.glob("*.ckpt/*.partial"))
    assert "written with --parallel fsdp2" in rank0["ddp-resume-error"]


@pytest.mark.slow
@pytest.mark.distributed
def test_sharded_checkpoint_resumes_at_world_1(
    shards: dict[str, str], two_rank_results: tuple[Path, list[Any]], tmp_path: Path
) -> None:
    """One plain process (its own one-rank group) continues the 2-rank fsdp2 run."""
    out, (rank0, _) = two_rank_results
    torch.set_num_threads(1)
    checkpoint = out / "fsdp2.ckpt" / f"step_{RESUME_AT:06d}"
    resumed = train(
        config(shards, tmp_path, run_id="one", parallel="fsdp2", resume=str(checkpoint))
    )
    full = rank0["fsdp2"]
    assert_close_losses(
        resumed["losses"], {k: full["losses"][k] for k in resumed["losses"]}, LOSS_TOLERANCE
    )
    torch.testing.assert_close(
        resumed["params"], full["params"], rtol=0, atol=WORLD_1_PARAM_TOLERANCE
    )


@pytest.mark.parametrize("optimizer", ["shampoo-distadam", "distadam", "muon-distadam"])
def test_fsdp2_with_distadam_is_a_one_line_error(
    optimizer: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["--optimizer", optimizer, "--parallel", "fsdp2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "DistAdam" in err and "parallel='fsdp2'" in err


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"parallel": "zero3"}, "TrainConfig.parallel"),
        (
            {"parallel": "fsdp2", "distributor.fsdp_assignment": "owner"},
            r"distributor\.fsdp_assignment \(--distributor\.fsdp-assignment\)",
        ),
        ({"parallel": "hsdp", "hsdp_shard_size": -1}, "TrainConfig.hsdp_shard_size"),
        ({"parallel": "fsdp2", "hsdp_shard_size": 2}, "TrainConfig.hsdp_shard_size"),
        ({"parallel": "hsdp", "optimizer": "soap-distadam"}, "TrainConfig.optimizer"),
        (
            {"parallel": "fsdp2", "distributor.kind": "single"},
            r"distributor\.kind \(--distributor\.kind\) must be 'auto' under parallel='fsdp2'",
        ),
    ],
)
def test_config_validation_names_the_field(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        TrainConfig(**fields)


def test_sharded_presets_differ_from_their_base_only_in_model_and_parallel() -> None:
    from nanoshampoo.train.presets import load_preset

    base = load_preset("gpt2-124m-shampoo")
    for name, model in (
        ("gpt2-124m-shampoo-fsdp2", "gpt2-124m"),
        ("gpt2-350m-shampoo-fsdp2", "gpt2-350m"),
    ):
        fields = load_preset(name)
        assert {k for k in fields if fields[k] != base.get(k)} <= {"preset", "model", "parallel"}
        assert fields["parallel"] == "fsdp2" and fields["model"] == model
        TrainConfig(**fields)


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_telemetry_matches_ddp(two_rank_results: tuple[Path, list[Any]]) -> None:
    """Telemetry computed where FSDP2's blocks live (full tensors gathered, Shampoo's blocks on
    their round-robin owners) gives the ddp run's records, up to the runs' float32 agreement
    (a condition number moves by ~kappa eps relatively: lambda_min by ~eps lambda_max)."""
    out, _ = two_rank_results

    def telemetry(run: str) -> dict[tuple[int, str], dict[str, Any]]:
        return {
            (r["step"], r["layer"]): r
            for r in read_jsonl(out / f"{run}.jsonl")
            if r["kind"] == "telemetry"
        }

    ddp, fsdp2 = telemetry("ddp"), telemetry("fsdp2")
    assert ddp and sorted(fsdp2) == sorted(ddp)
    eps = float(torch.finfo(torch.float32).eps)
    for point, want in ddp.items():
        got = fsdp2[point]
        assert sorted(got) == sorted(want), point
        for key, value in want.items():
            if isinstance(value, float):
                slack = 4 * value * eps if key.endswith("condition_number") else 0.0
                assert got[key] == pytest.approx(value, rel=1e-4 + slack, abs=1e-9), (point, key)
