"""How a step runs: ``shampoo_pt2_compile_config``, ``shampoo_runtime_config``,
``concurrency_config`` and ``use_pin_memory``. None of them may change the numbers.

The compiled step is checked against the eager one: with ``aot_eager`` (no C++ compiler
needed) always, with inductor where its probe passes. The fallback path is checked by making
the probe fail.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
from flat_shampoo_state import flat_state

from nanoshampoo.optim.shampoo import (
    AdamPreconditionerConfig,
    ConcurrencyConfig,
    DistributedShampoo,
    NonFiniteGradientError,
    ShampooPT2CompileConfig,
    ShampooRuntimeConfig,
    step_compilation,
)

torch.set_num_threads(1)

STEPS = 5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


def _optimizer(model: torch.nn.Module, **kwargs: Any) -> DistributedShampoo:
    return DistributedShampoo(
        model.parameters(),
        lr=0.05,
        betas=(0.9, 0.999),
        epsilon=1e-12,
        momentum=0.5,
        weight_decay=0.01,
        precondition_frequency=2,
        grafting_config=AdamPreconditionerConfig(epsilon=1e-8),
        **kwargs,
    )


def _train(
    model: torch.nn.Module, optimizer: DistributedShampoo, steps: int = STEPS
) -> list[torch.Tensor]:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)).to(
        next(model.parameters()).dtype
    )
    for _ in range(steps):
        model.zero_grad()
        model(x).square().sum().backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _eager() -> list[torch.Tensor]:
    model = _model()
    return _train(model, _optimizer(model))


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor], rtol: float) -> None:
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * float(w.abs().max()))


@pytest.mark.slow
def test_aot_eager_compiled_step_equals_the_eager_step() -> None:
    model = _model()
    optimizer = _optimizer(
        model, shampoo_pt2_compile_config=ShampooPT2CompileConfig(backend="aot_eager")
    )
    assert optimizer.step_compiled
    _assert_same(_train(model, optimizer), _eager(), rtol=1e-6)


@pytest.mark.slow
def test_inductor_compiled_step_equals_the_eager_step_where_it_compiles() -> None:
    config = ShampooPT2CompileConfig()
    reason = step_compilation.probe_compile(config, torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"inductor cannot compile here: {reason}")
    model = _model()
    optimizer = _optimizer(model, shampoo_pt2_compile_config=config)
    assert optimizer.step_compiled
    compiled = _train(model, optimizer)
    # Inductor fuses and reorders float32 arithmetic, and at epsilon 1e-12 the roots of
    # rank-deficient factors amplify rounding (by up to 1e-12 ** -0.25): so the compiled step
    # must be as close to the float64 eager step as the float32 eager step is, not bit-equal.
    model64 = _model().double()
    exact = _train(model64, _optimizer(model64))
    eager = _eager()

    def error(params: list[torch.Tensor]) -> float:
        return max(float((p.double() - e).norm() / e.norm()) for p, e in zip(params, exact))

    assert error(compiled) <= 2.0 * error(eager) + 1e-6


def test_a_failed_probe_falls_back_to_eager_with_the_reason_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(
        step_compilation, "probe_compile", lambda config, device: "InvalidCxxCompiler: no g++"
    )
    model = _model()
    with caplog.at_level(logging.WARNING, logger=step_compilation.__name__):
        optimizer = _optimizer(model, shampoo_pt2_compile_config=ShampooPT2CompileConfig())
    assert not optimizer.step_compiled
    assert (
        "cannot compile on cpu (InvalidCxxCompiler: no g++); the step runs eagerly" in caplog.text
    )
    assert not isinstance(optimizer._runtimes[0].apply_step, type(torch.compile(lambda: None)))
    _assert_same(_train(model, optimizer), _eager(), rtol=0.0)


def test_disabled_compilation_does_not_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(config: ShampooPT2CompileConfig, device: torch.device) -> str:
        raise AssertionError("probed")

    monkeypatch.setattr(step_compilation, "probe_compile", fail)
    model = _model()
    optimizer = _optimizer(model, shampoo_pt2_compile_config=ShampooPT2CompileConfig(disable=True))
    assert not optimizer.step_compiled
    _assert_same(_train(model, optimizer), _eager(), rtol=0.0)


def test_the_probe_reports_a_backend_that_fails() -> None:
    def broken_backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        raise RuntimeError("no compiler on this machine\nsecond line")

    reason = step_compilation.probe_compile(
        ShampooPT2CompileConfig(backend=broken_backend), torch.device("cpu")
    )
    assert reason == "RuntimeError: no compiler on this machine"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"fullgraph": 1}, "fullgraph"),
        ({"dynamic": "yes"}, "dynamic"),
        ({"backend": ""}, "backend"),
        ({"backend": 3}, "backend"),
        ({"mode": "fastest"}, "mode"),
        ({"options": ["x"]}, "options"),
        ({"mode": "default", "options": {}}, "mode and options"),
        ({"disable": None}, "disable"),
    ],
)
def test_invalid_compile_configs_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        ShampooPT2CompileConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"shampoo_pt2_compile_config": "inductor"}, "shampoo_pt2_compile_config"),
        ({"shampoo_runtime_config": {"eager_nan_check": True}}, "shampoo_runtime_config"),
        ({"concurrency_config": None}, "concurrency_config"),
        ({"use_pin_memory": "no"}, "use_pin_memory"),
    ],
)
def test_invalid_runtime_arguments_name_the_argument(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be"):
        _optimizer(_model(), **kwargs)


def test_runtime_config_fields_are_validated() -> None:
    with pytest.raises(ValueError, match="^eager_nan_check must be a bool"):
        ShampooRuntimeConfig(eager_nan_check=1)
    with pytest.raises(ValueError, match="^enable_cuda_stream_for_param_groups must be a bool"):
        ConcurrencyConfig(enable_cuda_stream_for_param_groups="on")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"use_pin_memory": True},
        {"concurrency_config": ConcurrencyConfig(enable_cuda_stream_for_param_groups=False)},
        {"shampoo_runtime_config": ShampooRuntimeConfig(eager_nan_check=True)},
    ],
)
def test_runtime_settings_keep_the_numbers(kwargs: dict[str, Any]) -> None:
    model = _model()
    _assert_same(_train(model, _optimizer(model, **kwargs)), _eager(), rtol=0.0)


def test_eager_nan_check_raises_naming_the_parameter_even_when_the_policy_skips() -> None:
    model = _model()
    optimizer = _optimizer(
        model,
        shampoo_runtime_config=ShampooRuntimeConfig(eager_nan_check=True),
        nonfinite_grad_policy="skip",
    )
    _train(model, optimizer, steps=2)
    before = (
        [p.detach().clone() for p in model.parameters()],
        copy.deepcopy(flat_state(optimizer.state_dict())),
    )
    model[2].bias.grad[1] = float("nan")
    with pytest.raises(
        NonFiniteGradientError,
        match=r"in param_groups\[0\]\['params'\]\[3\] \(shape \(3,\)\) \(eager_nan_check\)",
    ):
        optimizer.step()
    for got, want in zip(model.parameters(), before[0]):
        assert torch.equal(got, want)
    for index, entries in flat_state(optimizer.state_dict()).items():
        for key, value in entries.items():
            assert torch.equal(value, before[1][index][key])
