"""Eigenvalue-corrected Shampoo (SOAP) against a slow float64 reference, QR eigenbases, configs."""

from __future__ import annotations

import io
import logging
import re
from typing import Any

import numpy as np
import pytest
import torch

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    CoupledNewtonConfig,
    DistributedShampoo,
    EigenvalueCorrectedShampooPreconditionerConfig,
    EighEigendecompositionConfig,
    QREigendecompositionConfig,
    RootInvShampooPreconditionerConfig,
)
from nanoshampoo.optim.shampoo.config_checks import error_field
from nanoshampoo.optim.shampoo.preconditioner.eigenbasis import (
    eigh_eigenbasis,
    off_diagonal_ratio,
    qr_eigenbasis,
)
from nanoshampoo.optim.shampoo.state_dict_trees import flatten_tree

torch.set_num_threads(1)

MAX_DIM = 8
# Blocks with max_preconditioner_dim 8: (6, 5) 2-D; (3,) 1-D; (3, 4, 5) 3-D;
# (10, 3) -> (8, 3), (2, 3).
# Every factor is full rank from step 3 on: a rank-deficient factor has no unique eigenbasis (its
# null space may be spanned any way), and a later gradient reaching into that null space would
# make the reference ambiguous whenever the basis is not recomputed every step.
SHAPES = [(6, 5), (3,), (3, 4, 5), (10, 3)]
STEPS = 10
F64 = dict(
    factor_matrix_dtype=torch.float64,
    factor_matrix_eigenvectors_dtype=torch.float64,
    corrected_eigenvalues_dtype=torch.float64,
)


def reference_blocks(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The spec's blocking for SHAPES (no dims merge for these shapes)."""
    blocks = [tensor]
    for dim in range(tensor.dim()):
        blocks = [piece for b in blocks for piece in torch.split(b, MAX_DIM, dim)]
    return blocks


def contract(x: np.ndarray, matrix: np.ndarray, dim: int) -> np.ndarray:
    """``x`` with dim ``dim`` multiplied by ``matrix`` (``matrix @ x_(dim)``)."""
    return np.moveaxis(np.tensordot(matrix, x, axes=([1], [dim])), 0, dim)


class ReferenceSOAP:
    """One block, float64 numpy, the module docstring's equations in order."""

    def __init__(self, shape: tuple[int, ...], h: dict[str, Any]) -> None:
        self.h = h
        order = len(shape)
        ignored = h["ignored"].get(order, [])
        self.rotated = [d not in ignored for d in range(order)]
        self.factors = [np.zeros((n, n)) for n in shape]
        self.bases = [np.eye(n) for n in shape]
        self.d = np.zeros(shape)
        self.v = np.zeros(shape)
        self.m = np.zeros(shape)

    def rotate(self, x: np.ndarray, inverse: bool = False) -> np.ndarray:
        for dim, q in enumerate(self.bases):
            if self.rotated[dim]:
                x = contract(x, q if inverse else q.T, dim)
        return x

    def basis(self, factor: np.ndarray, previous: np.ndarray, first: bool) -> np.ndarray:
        """The new ascending basis of a bias-corrected factor by ``h["solver"]``: ``"eigh"``;
        ``("qr", iterations, tolerance)``, the QR algorithm on ``B = Q^T (F + eps I) Q`` from the
        previous basis (the identity at first), ``B = QR -> B <- RQ, Q <- Q Q_B``, then the columns
        sorted by ``diag(B)``; ``("descending", iterations, tolerance)``: ``eigh`` at first, later
        ``Q <- qr(F Q)`` on the descending order, unsorted."""
        solver = self.h["solver"]
        if solver == "eigh" or (solver[0] == "descending" and first):
            return np.linalg.eigh(factor)[1]
        kind, iterations, tolerance = solver
        if kind == "descending":
            q = previous[:, ::-1]
            for _ in range(iterations):
                b = q.T @ factor @ q
                if np.linalg.norm(b - np.diag(np.diag(b))) <= tolerance * np.linalg.norm(b):
                    break
                q = np.linalg.qr(factor @ q)[0]
            return q[:, ::-1]
        q = previous
        b = q.T @ (factor + self.h["epsilon"] * np.eye(len(factor))) @ q
        for _ in range(iterations):
            if np.linalg.norm(b - np.diag(np.diag(b))) <= tolerance * np.linalg.norm(b):
                break
            q_b, r_b = np.linalg.qr(b)
            b, q = r_b @ q_b, q @ q_b
        return q[:, np.argsort(np.diag(b), kind="stable")] if self.h["sort"] else q

    def step(self, t: int, g: np.ndarray, w: np.ndarray) -> np.ndarray:
        h = self.h
        b1, b2 = h["betas"]
        f, s = h["precondition_frequency"], h["precondition_frequency"]
        weight = 1.0 - b2
        for dim in range(g.ndim):
            if self.rotated[dim]:
                unfolded = np.moveaxis(g, dim, 0).reshape(g.shape[dim], -1)
                self.factors[dim] = b2 * self.factors[dim] + weight * unfolded @ unfolded.T
        if (t % f == 0 and t > s) or t == s:
            for dim in range(g.ndim):
                if self.rotated[dim]:
                    # Ascending eigenvalue order, the reference library's: D accumulated in an
                    # earlier basis (the identity at first) pairs with columns by position.
                    # (The implementation's bases are descending, with D reversed once, at
                    # the first basis: the same pairing.)
                    self.bases[dim] = self.basis(
                        self.factors[dim] / (1.0 - b2**t), self.bases[dim], t == s
                    )
        self.d = b2 * self.d + weight * self.rotate(g) ** 2  # in the basis used below
        bc2 = 1.0 - b2**t
        self.m = b1 * self.m + (1 - b1) * g
        gbar = self.m / (1.0 - b1**t)
        graft = h["grafting_config"]
        if graft is not None:
            self.v = graft.beta2 * self.v + (1 - graft.beta2) * g * g
            p_g = gbar / (np.sqrt(self.v / (1.0 - graft.beta2**t)) + graft.epsilon)
        if t >= s or graft is None:
            # Without grafting SOAP steps from step 1, in the identity basis until t == s.
            p = self.rotate(
                self.rotate(gbar) / (np.sqrt(self.d / bc2) + h["epsilon"]), inverse=True
            )
            if graft is not None:
                p = p * np.linalg.norm(p_g) / (np.linalg.norm(p) + 1e-16)
        else:
            p = p_g
        return w - h["lr"] * p


DEFAULTS: dict[str, Any] = dict(
    lr=0.05,
    betas=(0.9, 0.95),
    epsilon=1e-6,
    precondition_frequency=1,
    grafting_config=None,
    ignored={},
    solver="eigh",
    sort=True,
)
CASES = {
    "frequency1": {},
    "frequency3": dict(precondition_frequency=3),
    "frequency1_adam_grafting": dict(
        grafting_config=AdamPreconditionerConfig(beta2=0.99, epsilon=1e-8)
    ),
    "frequency3_adam_grafting": dict(
        precondition_frequency=3, grafting_config=AdamPreconditionerConfig(beta2=0.99, epsilon=1e-8)
    ),
    "ignored_dims": dict(ignored={2: [1], 1: [0], 3: [0, 2]}),
}


def _params_and_grads(
    seed: int, steps: int
) -> tuple[list[torch.nn.Parameter], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in SHAPES
    ]
    grads = [
        [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES] for _ in range(steps)
    ]
    return params, grads


def _optimizer(
    params: list[torch.nn.Parameter], h: dict[str, Any], **config: Any
) -> DistributedShampoo:
    kwargs = {k: v for k, v in h.items() if k not in ("ignored", "solver", "sort")}
    preconditioner = EigenvalueCorrectedShampooPreconditionerConfig(
        ignored_basis_change_dims=h["ignored"], **F64, **config
    )
    return DistributedShampoo(
        params, max_preconditioner_dim=MAX_DIM, preconditioner_config=preconditioner, **kwargs
    )


def _run(
    opt: DistributedShampoo, params: list[torch.nn.Parameter], grads: list[list[torch.Tensor]]
) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


def _reference(
    params: list[torch.nn.Parameter], grads: list[list[torch.Tensor]], h: dict[str, Any]
) -> list[torch.Tensor]:
    weights = [p.detach().clone() for p in params]
    blocks = [[ReferenceSOAP(tuple(b.shape), h) for b in reference_blocks(w)] for w in weights]
    for t, step_grads in enumerate(grads, start=1):
        for index, g in enumerate(step_grads):
            for block, wb, gb in zip(
                blocks[index], reference_blocks(weights[index]), reference_blocks(g)
            ):
                wb.copy_(torch.from_numpy(block.step(t, gb.numpy(), wb.numpy().copy())))
    return weights


def _assert_close_relative(
    params: list[torch.nn.Parameter], expected: list[torch.Tensor], tolerance: float
) -> None:
    for p, e in zip(params, expected):
        relative = (torch.linalg.vector_norm(p.detach() - e) / torch.linalg.vector_norm(e)).item()
        assert relative < tolerance, (tuple(p.shape), relative)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_float64_reference(case: str) -> None:
    h = {**DEFAULTS, **CASES[case]}
    params, grads = _params_and_grads(0, STEPS)
    expected = _reference(params, grads, h)
    opt = _optimizer(params, h)
    _run(opt, params, grads)
    _assert_close_relative(params, expected, 1e-9)


# 30 steps, a basis at steps 10, 20 and 30: D carried through three refreshes (issue 19).
REFRESHES = {**DEFAULTS, "precondition_frequency": 10}
SOLVERS: dict[str, tuple[Any, Any]] = {
    "eigh": ("eigh", EighEigendecompositionConfig()),
    "qr": (("qr", 1, 0.0), QREigendecompositionConfig()),
    "qr_3_iterations_tolerance_1e-3": (
        ("qr", 3, 1e-3),
        QREigendecompositionConfig(max_iterations=3, tolerance=1e-3),
    ),
    "qr_keep_descending_order": (
        ("descending", 1, 0.0),
        QREigendecompositionConfig(keep_descending_order=True),
    ),
}


@pytest.mark.parametrize("name", sorted(SOLVERS))
def test_past_several_refreshes_matches_float64_reference(name: str) -> None:
    solver, config = SOLVERS[name]
    h = {**REFRESHES, "solver": solver}
    params, grads = _params_and_grads(4, 30)
    expected = _reference(params, grads, h)
    _run(_optimizer(params, h, amortized_computation_config=config), params, grads)
    _assert_close_relative(params, expected, 1e-10)


def test_qr_refresh_pairs_d_with_the_re_sorted_columns() -> None:
    """Without the re-sort (D kept by position on the unsorted QR columns) the steps differ:
    the test above sees the pairing, not only the span of the bases."""
    h = {**REFRESHES, "solver": ("qr", 1, 0.0)}
    params, grads = _params_and_grads(4, 30)
    unsorted = _reference(params, grads, {**h, "sort": False})
    _run(
        _optimizer(params, h, amortized_computation_config=QREigendecompositionConfig()),
        params,
        grads,
    )
    worst = max(
        (torch.linalg.vector_norm(p.detach() - e) / torch.linalg.vector_norm(e)).item()
        for p, e in zip(params, unsorted)
    )
    assert worst > 1e-3


def test_qr_iterated_to_tolerance_matches_the_eigh_reference() -> None:
    h = {**DEFAULTS, "precondition_frequency": 3}
    params, grads = _params_and_grads(1, STEPS)
    expected = _reference(params, grads, h)
    qr = QREigendecompositionConfig(max_iterations=5000, tolerance=1e-13)
    opt = _optimizer(params, h, amortized_computation_config=qr)
    _run(opt, params, grads)
    _assert_close_relative(params, expected, 1e-9)


def test_qr_eigenbasis_converges_to_the_eigh_subspaces() -> None:
    gen = torch.Generator().manual_seed(2)
    rotation = torch.linalg.qr(torch.randn(3, 6, 6, generator=gen, dtype=torch.float64)).Q
    spectrum = 2.0 ** torch.arange(6, dtype=torch.float64)  # ratios 1/2: fast, sure convergence
    matrices = rotation @ torch.diag_embed(spectrum.expand(3, 6)) @ rotation.mT
    exact, ok = eigh_eigenbasis(matrices)
    assert ok.all()
    # Start from a perturbed eigenbasis, as after the factors moved since the last computation.
    start = torch.linalg.qr(
        exact + 0.05 * torch.randn(3, 6, 6, generator=gen, dtype=torch.float64)
    ).Q
    one, _ = qr_eigenbasis(matrices, start, max_iterations=1, tolerance=0.0)
    many, ok = qr_eigenbasis(matrices, start, max_iterations=300, tolerance=1e-14)
    assert ok.all()
    assert off_diagonal_ratio(matrices, one).max() < off_diagonal_ratio(matrices, start).min()
    assert off_diagonal_ratio(matrices, many).max() < 1e-13
    # Column j spans the same line as the j-th eigenvector (descending): |<q_j, e_j>| = 1.
    alignment = (many * exact).sum(dim=-2).abs()
    torch.testing.assert_close(alignment, torch.ones_like(alignment), rtol=0, atol=1e-10)


def test_qr_skips_bases_within_tolerance() -> None:
    matrices = torch.diag(torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)).expand(2, 3, 3)
    start = torch.eye(3, dtype=torch.float64).expand(2, 3, 3)
    bases, ok = qr_eigenbasis(matrices, start, max_iterations=5, tolerance=0.0)
    assert torch.equal(bases, start) and ok.all()


def test_state_dict_round_trip_and_bit_exact_resume() -> None:
    h = {**DEFAULTS, "precondition_frequency": 2, "grafting_config": AdamPreconditionerConfig()}
    qr = QREigendecompositionConfig(max_iterations=2, tolerance=1e-3)
    params, grads = _params_and_grads(3, 8)
    opt = _optimizer(params, h, amortized_computation_config=qr)
    _run(opt, params, grads[:5])
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    snapshot = [p.detach().clone() for p in params]
    _run(opt, params, grads[5:])

    state = {
        i: {k: v.clone() for k, v in flatten_tree(e).items()}
        for i, e in opt.state_dict()["state"].items()
    }
    assert {
        "block_0.shampoo.factor_matrices.0",
        "block_0.shampoo.factor_matrices_eigenvectors.1",
        "block_0.shampoo.corrected_eigenvalues",
        "step",
    } <= set(state[0])
    # Every basis was computed when the step implies it, so the flags are left out (the
    # reference's layout); a load infers them.
    assert not any("eigenvectors_computed" in key for key in state[0])

    resumed = [torch.nn.Parameter(s.clone()) for s in snapshot]
    opt2 = _optimizer(resumed, h, amortized_computation_config=qr)
    buffer.seek(0)
    opt2.load_state_dict(torch.load(buffer, weights_only=True))
    _run(opt2, resumed, grads[5:])
    for a, b in zip(params, resumed):
        assert torch.equal(a.detach(), b.detach())
    for index, entries in opt2.state_dict()["state"].items():
        flat = flatten_tree(entries)
        assert flat.keys() == state[index].keys()
        for key, value in flat.items():
            assert torch.equal(value, state[index][key]), key


def test_failed_eigendecomposition_keeps_the_basis_and_counts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    w = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.float64))
    opt = DistributedShampoo(
        [w],
        lr=0.1,
        betas=(0.0, 0.9),
        epsilon=1e-8,
        max_preconditioner_dim=MAX_DIM,
        preconditioner_config=EigenvalueCorrectedShampooPreconditionerConfig(
            num_tolerated_failed_amortized_computations=1, **F64
        ),
    )
    w.grad = torch.randn(4, 3, dtype=torch.float64)
    opt.step()
    block = opt.state[w]["block_0"]["shampoo"]
    basis = block.factor_matrices_eigenvectors[0].clone()
    block.factor_matrices[0][0] = float("nan")  # entry (0, 0) of the packed upper triangle
    with caplog.at_level(logging.WARNING):
        w.grad = torch.randn(4, 3, dtype=torch.float64)
        opt.step()
    assert "keeping the previous basis" in caplog.text
    assert torch.equal(block.factor_matrices_eigenvectors[0], basis)
    assert block.failure_counts[0].item() == 1 and block.failure_counts[1].item() == 0
    w.grad = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="2 consecutive times"):
        opt.step()


@pytest.mark.parametrize(
    ("factory", "field"),
    [
        # A root solver that is not an eigendecomposition (EigenConfig is one, as in the reference).
        (
            lambda: EigenvalueCorrectedShampooPreconditionerConfig(
                amortized_computation_config=CoupledNewtonConfig()
            ),
            "amortized_computation_config",
        ),
        (
            lambda: EigenvalueCorrectedShampooPreconditionerConfig(factor_matrix_dtype=torch.int32),
            "factor_matrix_dtype",
        ),
        (
            lambda: EigenvalueCorrectedShampooPreconditionerConfig(
                corrected_eigenvalues_dtype="float"
            ),
            "corrected_eigenvalues_dtype",
        ),
        (
            lambda: EigenvalueCorrectedShampooPreconditionerConfig(
                ignored_basis_change_dims={2: [2]}
            ),
            "ignored_basis_change_dims",
        ),
        (
            lambda: EigenvalueCorrectedShampooPreconditionerConfig(
                ignored_basis_change_dims={2: [0, 0]}
            ),
            "ignored_basis_change_dims",
        ),
        (
            lambda: EigenvalueCorrectedShampooPreconditionerConfig(
                ignored_basis_change_dims={-1: [0]}
            ),
            "ignored_basis_change_dims",
        ),
        (
            lambda: EigenvalueCorrectedShampooPreconditionerConfig(
                inverse_exponent_override={2: 0.0}
            ),
            "inverse_exponent_override",
        ),
        (
            lambda: EigenvalueCorrectedShampooPreconditionerConfig(
                num_tolerated_failed_amortized_computations=-1
            ),
            "num_tolerated_failed_amortized_computations",
        ),
        (lambda: QREigendecompositionConfig(max_iterations=0), "max_iterations"),
        (lambda: QREigendecompositionConfig(tolerance=1.5), "tolerance"),
        (lambda: QREigendecompositionConfig(keep_descending_order=1), "keep_descending_order"),
        (lambda: EighEigendecompositionConfig(retry_double_precision=1), "retry_double_precision"),
        # Root-inverse Shampoo needs eigenvalues too: a QR eigenbasis solver is rejected there.
        (
            lambda: RootInvShampooPreconditionerConfig(
                amortized_computation_config=QREigendecompositionConfig()
            ),
            "amortized_computation_config",
        ),
    ],
)
def test_invalid_configs_name_the_field(factory: Any, field: str) -> None:
    with pytest.raises(ValueError) as info:
        factory()
    assert re.match(field, error_field(info.value)), str(info.value)
