"""Eigenbasis refresh: the canonical null-space basis on a stack with null spaces of different
widths, one QR iteration against its textbook definition, the re-sorted QR refresh against the
QR algorithm on ``Q^T A Q``, and the first-basis split (each factor gets one eigh or one QR
refresh, never both)."""

from __future__ import annotations

import pytest
import torch

from nanoshampoo.optim.shampoo import PerturbationConfig, QREigendecompositionConfig
from nanoshampoo.optim.shampoo.preconditioner import eigenbasis
from nanoshampoo.optim.shampoo.preconditioner.eigenbasis import (
    canonical_null_space_basis,
    eigh_eigenbasis,
    qr_eigenbasis,
    sorted_qr_eigenbasis,
    warm_started_eigenbasis,
)

torch.set_num_threads(1)


def random_bases(count: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(count, n, n, generator=gen, dtype=torch.float64)).Q


def reference_canonical_columns(basis: torch.Tensor, null: torch.Tensor) -> torch.Tensor:
    """The null columns' canonical basis from the definition: the eigenvectors of
    ``diag(0, 1, ..., n-1)`` compressed onto their span, ascending, in the span's coordinates."""
    columns = basis[:, null]
    compressed = columns.T @ torch.diag(torch.arange(basis.shape[0], dtype=basis.dtype)) @ columns
    return columns @ torch.linalg.eigh(compressed).eigenvectors


def test_canonical_basis_of_a_stack_with_null_spaces_of_different_widths() -> None:
    bases = random_bases(3, 7, seed=0)
    null = torch.tensor(
        [
            [False, True, False, True, True, False, False],  # width 3
            [False, False, False, False, False, False, True],  # width 1
            [False] * 7,
        ]
    )  # none
    canonical, ok = canonical_null_space_basis(bases, null)
    assert bool(ok.all())
    for basis, got, mask in zip(bases, canonical, null):
        # The null columns, in their original positions, are the canonical ones (up to sign).
        if bool(mask.any()):
            expected = reference_canonical_columns(basis, mask)
            torch.testing.assert_close(got[:, mask].abs(), expected.abs(), rtol=0, atol=1e-12)
        torch.testing.assert_close(got[:, ~mask].abs(), basis[:, ~mask].abs(), rtol=0, atol=1e-12)
        eye = torch.eye(7, dtype=torch.float64)
        torch.testing.assert_close(got.T @ got, eye, rtol=0, atol=1e-12)


def spd_stack(count: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(count, n, 2 * n, generator=gen, dtype=torch.float64)
    return g @ g.mT


def test_one_qr_iteration_is_qr_of_a_q_where_not_converged() -> None:
    matrices = spd_stack(3, 6, seed=1)
    exact, _ = eigh_eigenbasis(matrices)
    start = random_bases(3, 6, seed=2)
    start[1] = exact[1]  # already an eigenbasis: ratio ~1e-16, kept as it is
    bases, ok = qr_eigenbasis(matrices, start, max_iterations=1, tolerance=1e-8)
    assert bool(ok.all())
    for i in (0, 2):
        expected = torch.linalg.qr(matrices[i] @ start[i]).Q
        torch.testing.assert_close(bases[i], expected, rtol=0, atol=1e-12)
    assert torch.equal(bases[1], start[1])


def test_sorted_qr_refresh_is_the_qr_algorithm_then_a_sort() -> None:
    """Two steps of ``B = Q_B R -> B <- R Q_B, Q <- Q Q_B`` on ``B = Q^T A Q`` from ascending
    starts, then the columns stably sorted by ascending ``diag(B)``: the result reversed."""
    matrices = spd_stack(3, 6, seed=5)
    start = random_bases(3, 6, seed=6)
    start[2] = torch.eye(6, dtype=torch.float64)  # a first basis: from the identity
    bases, ok = sorted_qr_eigenbasis(matrices, start, max_iterations=2, tolerance=0.0)
    assert bool(ok.all())
    for i in range(3):
        q, b = start[i], start[i].T @ matrices[i] @ start[i]
        for _ in range(2):
            q_b, r_b = torch.linalg.qr(b)
            b, q = r_b @ q_b, q @ q_b
        expected = q[:, torch.argsort(b.diagonal(), stable=True)].flip(-1)
        # Columns up to sign (the two QR factorizations may choose different signs).
        alignment = (bases[i] * expected).sum(dim=0).abs()
        torch.testing.assert_close(
            alignment, torch.ones(6, dtype=torch.float64), rtol=0, atol=1e-10
        )
    # A converged start (tolerance met: no iteration) is still re-sorted.
    diagonal = torch.diag(torch.tensor([1.0, 3.0, 2.0], dtype=torch.float64)).expand(2, 3, 3)
    sorted_bases, _ = sorted_qr_eigenbasis(
        diagonal, torch.eye(3, dtype=torch.float64).expand(2, 3, 3), 5, 0.5
    )
    assert sorted_bases[0].abs().argmax(dim=0).tolist() == [1, 2, 0]


def test_the_first_refresh_runs_eigh_on_new_factors_and_qr_on_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    matrices = spd_stack(4, 5, seed=3)
    previous = random_bases(4, 5, seed=4)
    computed = torch.tensor([True, False, True, False])
    solver = QREigendecompositionConfig(
        rank_deficient_stability_config=PerturbationConfig(), keep_descending_order=True
    )
    calls: list[tuple[str, int]] = []
    for name in ("eigh_eigenbasis", "qr_eigenbasis"):
        original = getattr(eigenbasis, name)
        monkeypatch.setattr(
            eigenbasis,
            name,
            lambda m, *a, name=name, f=original, **k: (
                calls.append((name, m.shape[0])) or f(m, *a, **k)
            ),
        )
    bases, ok = warm_started_eigenbasis(matrices, previous, computed, solver)
    assert sorted(calls) == [("eigh_eigenbasis", 2), ("qr_eigenbasis", 2)]
    assert bool(ok.all())
    stability = solver.rank_deficient_stability_config
    fresh, _ = eigh_eigenbasis(matrices[~computed], True, stability)
    warm, _ = qr_eigenbasis(matrices[computed], previous[computed], 1, solver.tolerance, stability)
    assert torch.equal(bases[~computed], fresh) and torch.equal(bases[computed], warm)
    calls.clear()
    warm_started_eigenbasis(matrices, previous, torch.zeros(4, dtype=torch.bool), solver)
    assert calls == [("eigh_eigenbasis", 4)]
