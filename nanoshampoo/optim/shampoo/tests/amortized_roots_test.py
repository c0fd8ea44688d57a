"""``amortize_roots``: the root computations spread over the ``precondition_frequency`` steps.

Specification (step 4 of the ``distributed_shampoo`` module docstring): all roots at the first
preconditioned step ``s``; at each later step ``t`` the roots of share ``t % f`` only, each
from the factors of step ``t``; every factor in exactly one share.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DistributedShampoo,
    EigenvalueCorrectedShampooPreconditionerConfig,
)
from nanoshampoo.optim.shampoo.preconditioner.kronecker_factored_preconditioner import (
    KroneckerFactoredPreconditioner,
)
from nanoshampoo.optim.shampoo.preconditioner.matrix_roots import eigh_inverse_root

torch.set_num_threads(1)

SHAPES = [(12, 12), (12, 12), (12, 20), (20,), (5, 6, 7)]
FREQUENCY = 3


def _optimizer(
    amortize: bool, **kwargs: Any
) -> tuple[DistributedShampoo, list[torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(s, dtype=torch.float64, generator=gen)) for s in SHAPES
    ]
    opt = DistributedShampoo(
        params,
        lr=0.01,
        betas=(0.0, 0.99),
        epsilon=1e-10,
        precondition_frequency=FREQUENCY,
        max_preconditioner_dim=16,
        grafting_config=AdamPreconditionerConfig(),
        amortize_roots=amortize,
        **kwargs,
    )
    return opt, params


def _step(opt: DistributedShampoo, params: list[torch.nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    for p in params:
        p.grad = torch.randn(p.shape, dtype=p.dtype, generator=gen)
    opt.step()


def _record_solved_rows(monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[Any, int]]]:
    """Per call of ``_solve`` in a step, the (pool key, row) pairs solved; one list per step."""
    solved: list[list[tuple[Any, int]]] = []
    original = KroneckerFactoredPreconditioner.amortized_computation
    solve_of: dict[type, Any] = {}

    def amortized(
        self: Any, step: int, share: int = 0, num_shares: int = 1, period: Any = None
    ) -> None:
        solved.append([])
        cls = type(self)
        solve_of.setdefault(cls, cls._solve)

        def recording(
            inner: Any, key: Any, matrices: torch.Tensor, rows: torch.Tensor | None
        ) -> Any:
            count = matrices.shape[0]
            solved[-1].extend((key, r) for r in (range(count) if rows is None else rows.tolist()))
            return solve_of[cls](inner, key, matrices, rows)

        monkeypatch.setattr(cls, "_solve", recording)
        try:
            original(self, step, share, num_shares, period)
        finally:
            monkeypatch.setattr(cls, "_solve", solve_of[cls])
        solved[-1].append(("step", step))

    monkeypatch.setattr(KroneckerFactoredPreconditioner, "amortized_computation", amortized)
    return solved


@pytest.mark.parametrize("soap", [False, True])
def test_the_schedule_solves_every_factor_once_per_period_and_spreads_the_work(
    monkeypatch: pytest.MonkeyPatch, soap: bool
) -> None:
    kwargs = (
        {"preconditioner_config": EigenvalueCorrectedShampooPreconditionerConfig()} if soap else {}
    )
    opt, params = _optimizer(True, **kwargs)
    solved = _record_solved_rows(monkeypatch)
    num_factors = sum(
        len(p.labels) for p in opt._runtimes[0].preconditioner._factors.pools.values()
    )
    for seed in range(1, 3 * FREQUENCY + 1):
        _step(opt, params, seed)
    steps = [calls[-1][1] for calls in solved]
    rows = [sorted(calls[:-1], key=str) for calls in solved]
    # Nothing before the first preconditioned step, then a root computation at every step.
    assert steps == list(range(FREQUENCY, 3 * FREQUENCY + 1))
    assert len(rows[0]) == num_factors  # step s: every root
    later = rows[1:]
    for start in range(0, len(later) - FREQUENCY + 1):
        period = [row for step_rows in later[start : start + FREQUENCY] for row in step_rows]
        assert sorted(period, key=str) == sorted(set(period), key=str)  # each once
        assert len(period) == num_factors  # and all of them
    assert max(len(r) for r in later) < num_factors
    # A fixed share per residue t % f.
    assert later[0] == later[FREQUENCY] and later[1] == later[1 + FREQUENCY]


def test_each_solved_root_comes_from_the_factors_of_its_step_and_the_others_are_kept() -> None:
    opt, params = _optimizer(True)
    pre = opt._runtimes[0].preconditioner
    shares = pre._factors.share_rows(FREQUENCY)
    for seed in range(1, FREQUENCY + 1):
        _step(opt, params, seed)
    for seed in range(FREQUENCY + 1, 3 * FREQUENCY + 1):
        before = {key: roots.clone() for key, roots in pre._results.items()}
        _step(opt, params, seed)
        share = shares[seed % FREQUENCY]
        correction = 1.0 - 0.99**seed
        for key, pool in pre._factors.pools.items():
            rows = share.get(key, torch.zeros(0, dtype=torch.int64))
            untouched = [r for r in range(len(pool.labels)) if r not in rows.tolist()]
            assert torch.equal(pre._results[key][untouched], before[key][untouched])
            if rows.numel() == 0:
                continue
            # The same function on the same float32 factors of this step: the same bits, made
            # symmetric (X + X^T) / 2 as the preconditioner keeps its roots.
            expected, ok = eigh_inverse_root(
                pre._factors.matrices(pool, rows, divisor=correction),
                pre._exponents[key][rows],
                1e-10,
            )
            assert bool(ok.all())
            expected = (expected + expected.mT).mul_(0.5)
            assert torch.equal(pre._results[key][rows], expected.to(torch.float64))


def test_frequency_one_is_the_unamortized_step_bit_for_bit() -> None:
    runs = []
    for amortize in (False, True):
        opt, params = _optimizer(amortize, start_preconditioning_step=3)
        opt.param_groups[0]["precondition_frequency"] = 1
        for seed in range(1, 7):
            _step(opt, params, seed)
        runs.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_amortized_and_all_at_once_schedules_agree_before_they_diverge() -> None:
    """Up to and including step s both solve every root at s, so the parameters are equal;
    the next step solves only a share, so they differ (a different schedule)."""
    runs = []
    for amortize in (False, True):
        opt, params = _optimizer(amortize)
        for seed in range(1, FREQUENCY + 1):
            _step(opt, params, seed)
        at_start = [p.detach().clone() for p in params]
        for seed in range(FREQUENCY + 1, 2 * FREQUENCY + 1):
            _step(opt, params, seed)
        runs.append((at_start, [p.detach().clone() for p in params]))
    (plain_start, plain_end), (amortized_start, amortized_end) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain_start, amortized_start))
    assert not all(torch.equal(a, b) for a, b in zip(plain_end, amortized_end))


@pytest.mark.parametrize("value", [1, "yes", None])
def test_amortize_roots_must_be_a_bool(value: Any) -> None:
    with pytest.raises(ValueError, match=r"^amortize_roots must be a bool"):
        _optimizer(value)  # type: ignore[arg-type]


def test_soap_refolds_only_the_buckets_whose_bases_moved_and_loses_nothing() -> None:
    """Re-folding every bucket after an amortized SOAP step changes no corrected eigenvalue:
    the skipped buckets kept their bases, so their D was already folded in them."""
    opt, params = _optimizer(
        True, preconditioner_config=EigenvalueCorrectedShampooPreconditionerConfig()
    )
    pre = opt._runtimes[0].preconditioner
    for seed in range(1, 3 * FREQUENCY + 1):
        _step(opt, params, seed)
        folded = [d.clone() for d in pre._corrected]
        for index in range(len(pre._corrected)):
            pre._fold_step_into_corrected_eigenvalues(index)
        assert all(torch.equal(a, b) for a, b in zip(folded, pre._corrected))
    skipped = [
        set(range(len(pre._corrected))) - buckets for buckets in pre._share_buckets(FREQUENCY)
    ]
    assert any(skipped)  # the test covers skipped buckets
