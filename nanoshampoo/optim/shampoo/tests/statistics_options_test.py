"""``drop_weighting_factor_on_gsquare`` and trace scaling, each against a float64 loop of its
equation.

- Dropped weighting factor: ``F <- b2 F + G G^T`` (Shampoo), ``D <- b2 D + R(G)^2`` (SOAP),
  ``V <- b2 V + G^2`` (RMSprop/Adam grafting), and no ``beta2`` bias correction.
- Trace scaling: the root of ``A max(tr A, eps)^(-a)``, ``A = F / bc2``.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from flat_shampoo_state import flat_state

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    DistributedShampoo,
    EigendecomposedShampooPreconditionerConfig,
    EigenvalueCorrectedShampooPreconditionerConfig,
    RMSpropPreconditionerConfig,
    RootInvShampooPreconditionerConfig,
    SGDPreconditionerConfig,
)
from nanoshampoo.optim.shampoo.config_checks import error_field
from nanoshampoo.optim.shampoo.utils.shampoo_utils import unpack_upper_triangular
from nanoshampoo.testing.shampoo_reference import run_reference

torch.set_num_threads(1)

OPTIONS = dict(
    lr=0.05, betas=(0.9, 0.95), epsilon=1e-12, max_preconditioner_dim=8, precondition_frequency=2
)


def _data(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    steps: int,
    seed: int = 0,
    scale: float = 1.0,
    rank_one: bool = False,
) -> tuple[torch.nn.Parameter, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    param = torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype))
    grads = []
    for _ in range(steps):
        g = scale * torch.randn(shape, generator=gen, dtype=dtype)
        if rank_one and len(shape) == 2:
            g = torch.outer(g[:, 0], g[0])
            g[0] = 0.0
        grads.append(g)
    return param, grads


def _run(param: torch.nn.Parameter, grads: list[torch.Tensor], **kwargs: Any) -> np.ndarray:
    opt = DistributedShampoo([param], **{**OPTIONS, **kwargs})
    for g in grads:
        param.grad = g.clone()
        opt.step()
        assert torch.isfinite(param).all()
    return param.detach().numpy().copy()


CLASSIC = {
    "root_inv": lambda **kw: RootInvShampooPreconditionerConfig(
        factor_matrix_dtype=torch.float64, **kw
    ),
    "eigendecomposed": lambda **kw: EigendecomposedShampooPreconditionerConfig(
        factor_matrix_dtype=torch.float64,
        factor_matrix_eigenvectors_dtype=torch.float64,
        factor_matrix_eigenvalues_dtype=torch.float64,
        **kw,
    ),
}


@pytest.mark.parametrize("kind", sorted(CLASSIC))
@pytest.mark.parametrize("shape", [(6, 5), (3, 4, 5)])
@pytest.mark.parametrize(
    "options",
    [
        dict(drop_weighting_factor_on_gsquare=True),
        dict(use_trace_scaling=True),
        dict(use_trace_scaling=True, trace_scaling_exponent=1.0),
        dict(
            use_trace_scaling=True,
            drop_weighting_factor_on_gsquare=True,
            trace_scaling_exponent=0.25,
        ),
    ],
    ids=["drop", "trace_0.5", "trace_1", "both"],
)
def test_classic_shampoo_matches_float64_loop(
    kind: str, shape: tuple[int, ...], options: dict[str, Any]
) -> None:
    param, grads = _data(shape, torch.float64, 7)
    initial = param.detach().numpy().copy()
    final = _run(param, grads, preconditioner_config=CLASSIC[kind](**options))
    trace = options.get("trace_scaling_exponent", 0.5) if options.get("use_trace_scaling") else None
    expected = run_reference(
        initial,
        [g.numpy() for g in grads],
        lr=0.05,
        betas=(0.9, 0.95),
        epsilon=1e-12,
        frequency=2,
        start=2,
        drop_weighting_factor=options.get("drop_weighting_factor_on_gsquare", False),
        trace_scaling_exponent=trace,
    )
    assert np.linalg.norm(final - expected) / np.linalg.norm(expected) < 1e-9
    # The option changes the steps (so this test can tell it from plain Shampoo).
    plain = run_reference(
        initial,
        [g.numpy() for g in grads],
        lr=0.05,
        betas=(0.9, 0.95),
        epsilon=1e-12,
        frequency=2,
        start=2,
    )
    assert np.linalg.norm(final - plain) / np.linalg.norm(plain) > 1e-6


def test_trace_scaling_statistics_are_unscaled_in_the_state() -> None:
    """Scaling applies to what the root sees, not to the stored factors."""
    param, grads = _data((6, 5), torch.float64, 3)
    opt = DistributedShampoo(
        [param], **OPTIONS, preconditioner_config=CLASSIC["root_inv"](use_trace_scaling=True)
    )
    for g in grads:
        param.grad = g.clone()
        opt.step()
    expected = sum(0.95 ** (3 - t) * 0.05 * (g @ g.T) for t, g in enumerate(grads, start=1))
    state = flat_state(opt.state_dict())[0]
    # Factors are stored as packed upper triangles (use_symmetric_packing, on by default).
    stored = unpack_upper_triangular(state["block_0.shampoo.factor_matrices.0"], expected.shape[-1])
    assert torch.allclose(stored, expected, rtol=1e-12)


@pytest.mark.parametrize("rank_one", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.0])
def test_trace_scaling_float32_rank_deficient_or_zero_never_fails(
    rank_one: bool, scale: float
) -> None:
    """Rank-1 gradients, and all-zero ones (trace 0: clamped at epsilon), at epsilon 1e-12."""
    for config in (RootInvShampooPreconditionerConfig, EigendecomposedShampooPreconditionerConfig):
        param, grads = _data((6, 5), torch.float32, 10, scale=scale, rank_one=rank_one)
        _run(
            param,
            grads,
            precondition_frequency=1,
            preconditioner_config=config(
                use_trace_scaling=True, num_tolerated_failed_amortized_computations=0
            ),
        )


def test_soap_dropped_weighting_factor_in_the_identity_basis() -> None:
    """Before its first eigenbasis SOAP is ``Gbar / (sqrt(D) + eps)``,
    ``D = sum b2^(t-s) g_s^2``."""
    param, grads = _data((6, 5), torch.float64, 6)
    w = param.detach().numpy().copy()
    config = EigenvalueCorrectedShampooPreconditionerConfig(
        drop_weighting_factor_on_gsquare=True,
        factor_matrix_dtype=torch.float64,
        factor_matrix_eigenvectors_dtype=torch.float64,
        corrected_eigenvalues_dtype=torch.float64,
    )
    final = _run(
        param, grads, preconditioner_config=config, precondition_frequency=100, epsilon=1e-8
    )
    m, d = np.zeros_like(w), np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = g.numpy()
        d = 0.95 * d + g * g
        m = 0.9 * m + 0.1 * g
        w = w - 0.05 * (m / (1 - 0.9**t)) / (np.sqrt(d) + 1e-8)
    assert np.linalg.norm(final - w) / np.linalg.norm(w) < 1e-12


@pytest.mark.parametrize("config_type", [RMSpropPreconditionerConfig, AdamPreconditionerConfig])
def test_grafting_dropped_weighting_factor(config_type: type) -> None:
    """``V <- b2 V + G^2`` and ``P = Gbar / (sqrt(V) + eps)`` for both: Adam loses its
    correction."""
    param, grads = _data((6, 5), torch.float64, 6)
    w = param.detach().numpy().copy()
    grafting = config_type(beta2=0.9, epsilon=1e-8, drop_weighting_factor_on_gsquare=True)
    final = _run(
        param,
        grads,
        preconditioner_config=CLASSIC["root_inv"](),
        grafting_config=grafting,
        precondition_frequency=100,
    )
    m, v = np.zeros_like(w), np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = g.numpy()
        v = 0.9 * v + g * g
        m = 0.9 * m + 0.1 * g
        w = w - 0.05 * (m / (1 - 0.9**t)) / (np.sqrt(v) + 1e-8)
    assert np.linalg.norm(final - w) / np.linalg.norm(w) < 1e-12


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (
            lambda: RootInvShampooPreconditionerConfig(
                use_trace_scaling=True, trace_scaling_exponent=0.0
            ),
            "trace_scaling_exponent",
        ),
        (
            lambda: RootInvShampooPreconditionerConfig(
                use_trace_scaling=True, trace_scaling_exponent=1.5
            ),
            "trace_scaling_exponent",
        ),
        (
            lambda: EigenvalueCorrectedShampooPreconditionerConfig(trace_scaling_exponent="0.5"),
            "trace_scaling_exponent",
        ),
        (lambda: RootInvShampooPreconditionerConfig(use_trace_scaling=1), "use_trace_scaling"),
        (
            lambda: RootInvShampooPreconditionerConfig(drop_weighting_factor_on_gsquare=None),
            "drop_weighting_factor_on_gsquare",
        ),
        (
            lambda: AdamPreconditionerConfig(drop_weighting_factor_on_gsquare=0),
            "drop_weighting_factor_on_gsquare",
        ),
    ],
)
def test_invalid_values_name_the_field(make: Any, field: str) -> None:
    with pytest.raises(ValueError) as info:
        make()
    assert re.match(field, error_field(info.value)), str(info.value)


def test_exponent_outside_its_range_is_fine_while_trace_scaling_is_off() -> None:
    """As in the well-known library: the exponent is only checked when it is used."""
    assert (
        RootInvShampooPreconditionerConfig(trace_scaling_exponent=2.0).trace_scaling_exponent == 2.0
    )
    assert not hasattr(SGDPreconditionerConfig(), "drop_weighting_factor_on_gsquare")
