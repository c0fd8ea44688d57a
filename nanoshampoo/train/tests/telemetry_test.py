"""Telemetry records of real optimizer steps against float64 computations from the definitions
(weights before and after, the gradient, the optimizer's state), the gloo run against one
process, and the divergence line."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from trainer_test import tiny_config

from nanoshampoo.model.gpt import GPT, GPTConfig
from nanoshampoo.testing.distributed import run_on_gloo
from nanoshampoo.train.config import TrainConfig
from nanoshampoo.train.distributed import DistributedContext
from nanoshampoo.train.optimizers import build_optimizer_setup
from nanoshampoo.train.outcomes import TrainingDiverged
from nanoshampoo.train.setups.muon_variants import MuonCwdConfig, NorMuonConfig, SoapMuonConfig
from nanoshampoo.train.setups.shampoo_family import MuonConfig, ShampooConfig, SoapConfig
from nanoshampoo.train.telemetry import DepartureWatch, Telemetry, resolve_every
from nanoshampoo.train.trainer import Trainer

STEPS = 3
EPS32 = float(torch.finfo(torch.float32).eps)
# conftest's tiny GPT, spelled here: the gloo workers import this module in a fresh process,
# where ``conftest`` names the repository's root conftest.
VOCAB = 64
TINY_GPT = dict(vocab_size=VOCAB, num_layers=2, model_dim=32, head_dim=16, max_seq_len=16)
# Every matrix of the tiny GPT one block (none merged into a vector, as the 8192 default would
# do at these sizes), and roots often, so that every statistic moves within STEPS steps.
# The Muon family outside DistributedShampoo: telemetry reads the Newton-Schulz outputs it kept.
MUON_FAMILY = ["muon-cwd", "normuon", "soap-muon"]
SETTINGS = {
    "preconditioner.max_preconditioner_dim": 128,
    "shampoo.precondition_frequency": 1,
    "soap.precondition_frequency": 2,
}


def one_process() -> DistributedContext:
    return DistributedContext(
        rank=0, world_size=1, device=torch.device("cpu"), owns_process_group=False
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (4, 17), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def train_and_record(
    setup_name: str, ctx: DistributedContext, record: str = "last"
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``STEPS`` steps of the tiny GPT (gradients averaged over ranks), telemetry recording
    the ``"last"`` step, ``"every"`` step or ``"none"``; the last step's records, and what a
    reference needs: weights before and after it (float64), its gradients, the optimizers,
    and the Newton-Schulz outputs a Muon-family optimizer handed to telemetry
    (``"orthogonalized"``, by parameter name)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY_GPT))
    cfg = TrainConfig(optimizer=setup_name, **SETTINGS)
    setup = build_optimizer_setup(model, cfg, ctx.world_size)
    telemetry = Telemetry(
        1, model, setup.groups["matrix"], setup.optimizers, setup.self_reducing_params, ctx
    )
    records: list[dict[str, Any]] = []
    names = {id(p): n for n, p in model.named_parameters()}
    seen: dict[str, Any] = {"orthogonalized": {}}
    for opt in setup.optimizers:
        if hasattr(opt, "pop_orthogonalized"):
            pop = opt.pop_orthogonalized

            def spy(pop: Any = pop) -> dict[torch.Tensor, torch.Tensor]:
                kept = pop()
                seen["orthogonalized"].update({names[id(p)]: u.clone() for p, u in kept.items()})
                return kept

            opt.pop_orthogonalized = spy
    for step in range(STEPS):
        x, y = batch(step)
        model(x, y).backward()
        if ctx.world_size > 1:
            for p in setup.all_reduce_params:
                torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.AVG)
        last = step == STEPS - 1
        recorded = record == "every" or (record == "last" and last)
        if last:
            seen["before"] = {n: p.detach().double().clone() for n, p in model.named_parameters()}
            seen["grads"] = {n: p.grad.double().clone() for n, p in model.named_parameters()}
        if recorded:
            telemetry.snapshot()
        for opt in setup.optimizers:
            opt.step()
        if recorded:
            records = telemetry.record(step + 1)
        for opt in setup.optimizers:
            opt.zero_grad(set_to_none=True)
    seen["after"] = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    seen["setup"] = setup
    seen["model"] = model
    return records, seen


def root_mean_square(x: np.ndarray) -> float:
    return math.sqrt(float((x**2).sum()) / x.size)


@pytest.mark.parametrize("setup_name", ["shampoo", "soap", "muon", "adamw", "distadam"])
def test_every_setup_records_the_update_against_float64(setup_name: str) -> None:
    records, seen = train_and_record(setup_name, one_process())
    matrices = [
        n
        for n, p in seen["model"].named_parameters()
        if any(p is m for m in seen["setup"].groups["matrix"])
    ]
    assert [r["layer"] for r in records] == matrices
    for record in records:
        name = record["layer"]
        before, after = seen["before"][name].numpy(), seen["after"][name].numpy()
        update = after - before
        assert record["kind"] == "telemetry" and record["step"] == STEPS
        assert record["grad_rms"] == pytest.approx(root_mean_square(seen["grads"][name].numpy()))
        assert record["weight_rms"] == pytest.approx(root_mean_square(after))
        assert record["update_rms"] == pytest.approx(root_mean_square(update), rel=1e-5)
        assert record["update_ratio"] == pytest.approx(
            root_mean_square(update) / root_mean_square(before), rel=1e-5
        )
        sigma = np.linalg.svd(update.reshape(update.shape[0], -1), compute_uv=False)
        # Power iteration: a lower bound, close after 8 steps.
        assert 0.9 * sigma[0] <= record["update_top_sv"] <= sigma[0] * (1 + 1e-5)


def bias_corrected_factor(state: Any, dim: int, beta2: float) -> np.ndarray:
    return state.factor_matrices[dim].double().numpy() / (1.0 - beta2**STEPS)


def reference_spectrum(eigenvalues: np.ndarray, epsilon: float) -> tuple[float, float, float]:
    values = np.clip(eigenvalues, 0.0, None)
    p = values / values.sum()
    entropy = -sum(float(q * math.log(q)) for q in p if q > 0)
    below = float(np.mean(values < epsilon))
    return (values.max() + epsilon) / (values.min() + epsilon), math.exp(entropy), below


@pytest.mark.parametrize(
    ("setup_name", "table"), [("shampoo", ShampooConfig), ("soap", SoapConfig)]
)
def test_factor_statistics_from_the_optimizer_state_in_float64(
    setup_name: str, table: type
) -> None:
    records, seen = train_and_record(setup_name, one_process())
    cfg = TrainConfig(optimizer=setup_name, **SETTINGS)
    epsilon, beta2 = cfg.table(table).epsilon, cfg.table(table).beta2
    shampoo = seen["setup"].optimizers[-1]
    by_name = dict(seen["model"].named_parameters())
    for record in records:
        state = shampoo.state[by_name[record["layer"]]]["block_0"]["shampoo"]
        for dim in (0, 1):
            factor = bias_corrected_factor(state, dim, beta2)
            expected = reference_spectrum(np.linalg.eigvalsh(factor), epsilon)
            got = tuple(
                record[f"factor{dim}.{k}"]
                for k in ("condition_number", "effective_rank", "share_below_epsilon")
            )
            assert got == pytest.approx(expected, rel=1e-6)
            assert record[f"factor{dim}.failures"] == 0.0
            if setup_name == "soap":
                q = state.factor_matrices_eigenvectors[dim].double().numpy()
                rotated = q.T @ factor @ q
                off = np.linalg.norm(rotated - np.diag(np.diag(rotated))) / np.linalg.norm(rotated)
                assert record[f"factor{dim}.off_diagonal"] == pytest.approx(off, rel=1e-5)
        if setup_name == "shampoo":
            assert record["graft_ratio"] > 0.0


def test_muon_orthogonality_from_the_update_itself() -> None:
    """Muon without weight decay moves ``W`` by ``-lr scale U``: ``U`` from the update."""
    records, seen = train_and_record("muon", one_process())
    lr = TrainConfig(optimizer="muon").table(MuonConfig).lr
    assert TrainConfig(optimizer="muon").table(MuonConfig).weight_decay == 0.0
    for record in records:
        name = record["layer"]
        update = seen["after"][name].numpy() - seen["before"][name].numpy()
        rows, cols = update.shape
        u = -update / (lr * max(1.0, rows / cols) ** 0.5)
        gram = u @ u.T if rows <= cols else u.T @ u
        error = np.linalg.norm(gram - np.eye(gram.shape[0])) / math.sqrt(gram.shape[0])
        sigma = np.linalg.svd(u, compute_uv=False)
        assert record["ns_orthogonality_error"] == pytest.approx(error, rel=1e-3, abs=1e-5)
        assert record["ns_sigma_min"] == pytest.approx(sigma.min(), rel=1e-3)
        assert record["ns_sigma_max"] == pytest.approx(sigma.max(), rel=1e-3)


def svd_statistics(u: np.ndarray) -> tuple[float, float, float]:
    """``(||G - I||_F / sqrt(n), sigma_min, sigma_max)`` of ``u`` in float64, ``G`` its
    smaller Gram matrix."""
    gram = u @ u.T if u.shape[0] <= u.shape[1] else u.T @ u
    error = np.linalg.norm(gram - np.eye(gram.shape[0])) / math.sqrt(gram.shape[0])
    sigma = np.linalg.svd(u, compute_uv=False)
    return float(error), float(sigma.min()), float(sigma.max())


def expected_update(setup_name: str, u: np.ndarray, before: np.ndarray, state: Any) -> np.ndarray:
    """The step a Muon-family setup takes from the Newton-Schulz output ``u`` (float64, from
    the module docstrings' equations): the aspect-ratio scale, NorMuon's row normalization,
    the (cautious) weight decay."""
    rows, cols = u.shape
    scale = max(1.0, rows / cols) ** 0.5
    cfg = TrainConfig(optimizer=setup_name)
    if setup_name == "normuon":
        hp = cfg.table(NorMuonConfig)
        v = state["second_moment"].double().numpy()  # (rows, 1), after this step
        normalized = u / (np.sqrt(v) + 1e-10)  # NorMuon's default eps
        direction = normalized * np.linalg.norm(u) / np.linalg.norm(normalized) * scale
        cautious = hp.cautious_weight_decay
    else:
        hp = cfg.table(MuonCwdConfig if setup_name == "muon-cwd" else SoapMuonConfig)
        direction = scale * u
        cautious = setup_name == "muon-cwd"
    decay = hp.weight_decay * before
    if cautious:
        decay = decay * (direction * before >= 0)
    return -hp.lr * (direction + decay)


@pytest.mark.parametrize("setup_name", MUON_FAMILY)
def test_muon_family_statistics_of_the_newton_schulz_output_in_float64(setup_name: str) -> None:
    """The records hold the statistics of the ``NS(U)`` each matrix stepped with: that output
    reproduces the update (the equations in float64), and its statistics are those of
    ``svd`` / the Gram matrix in float64."""
    records, seen = train_and_record(setup_name, one_process())
    (muon,) = [o for o in seen["setup"].optimizers if hasattr(o, "pop_orthogonalized")]
    by_name = dict(seen["model"].named_parameters())
    assert sorted(seen["orthogonalized"]) == sorted(r["layer"] for r in records)
    for record in records:
        name = record["layer"]
        u = seen["orthogonalized"][name].double().numpy()
        before = seen["before"][name].numpy()
        update = seen["after"][name].numpy() - before
        want = expected_update(setup_name, u, before, muon.state[by_name[name]])
        # The update is a float32 difference of weights ~100x its size: ~1e-5 of it.
        np.testing.assert_allclose(update, want, rtol=0, atol=1e-4 * np.abs(want).max())
        error, low, high = svd_statistics(u)
        assert record["ns_orthogonality_error"] == pytest.approx(error, rel=1e-9)
        # svdvals in float32: LAPACK's error bound is a low power of n ulps of sigma_max (on an
        # AVX2-only AMD EPYC, at 2 threads, sigma_min came out 25 ulps of it away).
        assert record["ns_sigma_min"] == pytest.approx(low, abs=64 * EPS32 * high)
        assert record["ns_sigma_max"] == pytest.approx(high, rel=16 * EPS32)
        # The quintic pushes singular values towards ~[0.7, 1.2] but leaves small ones of U
        # smaller: 5 steps are not an exact orthogonalization.
        assert error > 0.0 and 0.0 <= low <= high < 1.3


@pytest.mark.parametrize("setup_name", MUON_FAMILY)
def test_keeping_the_newton_schulz_output_leaves_training_bit_identical(setup_name: str) -> None:
    _, recorded = train_and_record(setup_name, one_process(), record="every")
    _, plain = train_and_record(setup_name, one_process(), record="none")
    assert len(recorded["orthogonalized"]) > 0 and plain["orthogonalized"] == {}
    for name, after in plain["after"].items():
        assert torch.equal(recorded["after"][name], after), name
    for opt in recorded["setup"].optimizers:
        assert getattr(opt, "_kept_orthogonalized", None) is None  # nothing kept past record()


def test_adam_second_moment_spread_against_float64() -> None:
    records, seen = train_and_record("adamw", one_process())
    (adamw,) = seen["setup"].optimizers
    by_name = dict(seen["model"].named_parameters())
    for record in records:
        roots = np.sort(
            np.sqrt(adamw.state[by_name[record["layer"]]]["exp_avg_sq"].double().numpy()).ravel()
        )
        expected = roots[-1] / roots[(roots.size - 1) // 2]
        assert record["sqrt_v_spread"] == pytest.approx(expected, rel=1e-12)


def _gloo_records(rank: int, world_size: int, setup_name: str) -> list[dict[str, Any]]:
    ctx = DistributedContext(
        rank=rank, world_size=world_size, device=torch.device("cpu"), owns_process_group=False
    )
    records, _ = train_and_record(setup_name, ctx)
    return [{k: v for k, v in r.items() if k not in ("kind", "layer")} for r in records]


@pytest.mark.distributed
@pytest.mark.parametrize("setup_name", ["shampoo", "distadam", "muon", *MUON_FAMILY])
def test_two_ranks_record_what_one_process_records(setup_name: str) -> None:
    """World size 2 (Shampoo's and spectral-descent Muon's DDP distributor: each rank holds
    half of the blocks; DistAdam: each rank one slice of the moments; the Muon family: each
    rank measures every other matrix of its replicated step): rank 0's records equal one
    process's."""
    single, _ = train_and_record(setup_name, one_process())
    ranks = run_on_gloo(_gloo_records, 2, setup_name)
    assert ranks[1] == []
    expected = [{k: v for k, v in r.items() if k not in ("kind", "layer")} for r in single]
    assert len(ranks[0]) == len(expected)
    for got, want in zip(ranks[0], expected):
        assert sorted(got) == sorted(want)
        for key in want:
            # Each rank stacks other blocks side by side, so its float32 products round
            # differently from one process's: the two trajectories agree to ~1e-4 after three
            # steps, and kappa moves by ~kappa eps relatively (lambda_min by ~eps lambda_max).
            slack = want[key] * EPS32 if key.endswith("condition_number") else 0.0
            assert got[key] == pytest.approx(want[key], rel=1e-3 + 4 * slack, abs=1e-9), key


def test_resolve_every_and_departure_watch() -> None:
    assert (resolve_every(-1, 50), resolve_every(0, 50), resolve_every(7, 50)) == (50, 0, 7)
    watch = DepartureWatch()
    # The range is taken over the values at least two records old (lag 2, three of them).
    for step, value in enumerate([1.0, 2.0, 1.5, 1.0, 2.0, 50.0, 2.0, 1e4, 1e5], start=1):
        watch.add(step, "a", "update_ratio", value)  # 50 goes out and comes back: forgotten
        watch.add(step, "b", "grad_rms", 1.0)
    for step, loss in enumerate([5.0, 4.0, 3.9, 3.8, 3.7, 3.6, 3.5, 9.0, math.nan], start=1):
        watch.add_loss(step, loss)
    assert watch.loss_departure == 8  # 9.0 > 5.0 * 1.05, the top of its range
    assert watch.first_departure(stop_step=9) == (
        "first to leave its running range before the loss: a update ratio 1e+04 at step 8 "
        "(range 1-2)"
    )
    assert watch.first_departure(stop_step=7) is None  # the 50 came back
    assert DepartureWatch().first_departure(stop_step=3) is None


def test_off_builds_nothing_and_the_default_follows_validation(
    shards: dict[str, str], tmp_path: Path
) -> None:
    assert Trainer(tiny_config(shards, tmp_path, telemetry_every=0)).telemetry is None
    default = Trainer(tiny_config(shards, tmp_path, val_every=4)).telemetry
    assert default is not None and default.every == 4
    assert Trainer(tiny_config(shards, tmp_path, val_every=0)).telemetry is None
    with pytest.raises(ValueError, match=r"TrainConfig.telemetry_every \(--telemetry-every\)"):
        tiny_config(shards, tmp_path, telemetry_every=-2)


class TelemetryCalled(AssertionError):
    pass


def forbid_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every telemetry function raise: its classes' methods, the statistics, the
    optimizers' hooks for it (a kept Newton-Schulz output, the factors' health, the spectral
    directions) and the log's and TensorBoard's writers of records. ``resolve_every``, which
    decides that telemetry is off, stays."""
    from nanoshampoo.optim.muon import OrthogonalizedMomentum
    from nanoshampoo.optim.shampoo import health
    from nanoshampoo.optim.shampoo.preconditioner.kronecker_factored_preconditioner import (
        KroneckerFactoredPreconditioner,
    )
    from nanoshampoo.optim.shampoo.preconditioner.spectral_descent_preconditioner import (
        SpectralDescentPreconditioner,
    )
    from nanoshampoo.train import run_log, telemetry, telemetry_stats, tensorboard_scalars

    def fail(*args: Any, **kwargs: Any) -> None:
        raise TelemetryCalled("a telemetry function ran with telemetry off")

    ours = (telemetry.__name__, telemetry_stats.__name__)
    for module in (telemetry, telemetry_stats):
        for name, value in vars(module).items():
            own = getattr(value, "__module__", None) in ours
            if own and callable(value) and name != "resolve_every" and not isinstance(value, type):
                monkeypatch.setattr(module, name, fail)
    for cls, names in (
        (telemetry.Telemetry, ("__init__", "snapshot", "record", "due")),
        (telemetry.DepartureWatch, ("add", "add_loss", "first_departure")),
        (OrthogonalizedMomentum, ("keep_orthogonalized", "pop_orthogonalized")),
        (KroneckerFactoredPreconditioner, ("factor_health",)),
        (SpectralDescentPreconditioner, ("last_directions",)),
        (run_log.RunLog, ("telemetry",)),
        (tensorboard_scalars.TensorBoardScalars, ("telemetry",)),
    ):
        for name in names:
            monkeypatch.setattr(cls, name, fail)
    monkeypatch.setattr(health, "block_health", fail)


@pytest.mark.parametrize("setup_name", ["shampoo", "muon", "muon-cwd", "distadam"])
def test_off_calls_no_telemetry_function_on_the_step_path(
    setup_name: str, shards: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--telemetry-every 0``: a run (validation and a checkpoint included) calls nothing of
    telemetry; the same run with telemetry on trips the patches, so they do bite."""
    forbid_telemetry(monkeypatch)
    settings = dict(optimizer=setup_name, num_iterations=4, val_every=2, **SETTINGS)
    Trainer(tiny_config(shards, tmp_path, telemetry_every=0, **settings)).run()
    with pytest.raises(TelemetryCalled):
        Trainer(tiny_config(shards, tmp_path, run_id="on", telemetry_every=2, **settings)).run()


def test_a_forced_divergence_names_the_first_layer_that_ran_away(
    shards: dict[str, str], tmp_path: Path
) -> None:
    cfg = tiny_config(
        shards,
        tmp_path,
        num_iterations=60,
        val_every=0,
        telemetry_every=1,
        optimizer="adamw",
        **{"adamw.lr": 30.0},
    )
    with pytest.raises(TrainingDiverged) as raised:
        Trainer(cfg).run()
    match = re.search(
        r"first to leave its running range before the loss: (\S+) (.+) (\S+) at step (\d+) "
        r"\(range (\S+)-(\S+)\)$",
        raised.value.reason,
    )
    assert match is not None, raised.value.reason
    layer, label, value, step = match.group(1), match.group(2), match.group(3), int(match.group(4))
    assert layer.startswith("blocks.") and step <= raised.value.step
    records = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    key = label.replace(" ", "_")
    series = [r[key] for r in records if r["kind"] == "telemetry" and r["layer"] == layer]
    steps = [r["step"] for r in records if r["kind"] == "telemetry" and r["layer"] == layer]
    at = steps.index(step)
    earlier = [float(v) for v in series[: at - 2]]  # the running range: records 2+ older
    low, high = min(earlier), max(earlier)
    named = float(series[at])
    assert (f"{named:.3g}", f"{low:.3g}", f"{high:.3g}") == (value, *match.group(5, 6))
    assert not (low / 10 <= named <= high * 10)
    text = (tmp_path / "run.txt").read_text().splitlines()[-1]
    assert text.endswith(match.group(0))
