"""Errors and log records a script written against the reference Distributed Shampoo recognises.

Where one of this library's checks is one of the reference's, its message starts with the
reference's sentence (the same facts in the same words) and this library's hint follows; the
error's ``field`` names the config field or group entry. Log records are preformatted:
``record.msg`` holds the text and ``record.args`` is empty, as with the reference's f-strings.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from nanoshampoo.optim.shampoo import (
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    ClassicMomentumConfig,
    DDPDistributedConfig,
    DistributedShampoo,
    EigenConfig,
    EigenvalueCorrectedShampooPreconditionerConfig,
    EighEigendecompositionConfig,
    FullyShardDistributedConfig,
    GeneralizedPrimalAveragingConfig,
    HybridShardDistributedConfig,
    IterateAveragingConfig,
    PerturbationConfig,
    PreconditionerConfig,
    PseudoInverseConfig,
    QREigendecompositionConfig,
    RMSpropPreconditionerConfig,
    RootInvShampooPreconditionerConfig,
    ScheduleFreeConfig,
    ShampooPT2CompileConfig,
    SignDescentPreconditionerConfig,
    SingleDeviceDistributedConfig,
    SpectralDescentPreconditionerConfig,
    UnsupportedConfigError,
    WeightDecayType,
)
from nanoshampoo.optim.shampoo.config_checks import error_field

SHAMPOO = RootInvShampooPreconditionerConfig
SOAP = EigenvalueCorrectedShampooPreconditionerConfig

CONFIG_CASES: list[tuple[Callable[[], Any], str, str]] = [
    (
        lambda: AdaGradPreconditionerConfig(epsilon=0.0),
        "epsilon",
        "Invalid epsilon value: 0.0. Must be > 0.0.",
    ),
    (
        lambda: AdamPreconditionerConfig(epsilon=-1.0),
        "epsilon",
        "Invalid epsilon value: -1.0. Must be > 0.0.",
    ),
    (
        lambda: RMSpropPreconditionerConfig(beta2=1.3),
        "beta2",
        "Invalid grafting beta2 parameter: 1.3. Must be in (0.0, 1.0].",
    ),
    (
        lambda: AdamPreconditionerConfig(beta2=0.0),
        "beta2",
        "Invalid grafting beta2 parameter: 0.0. Must be in (0.0, 1.0].",
    ),
    (
        lambda: SHAMPOO(num_tolerated_failed_amortized_computations=-1),
        "num_tolerated_failed_amortized_computations",
        "Invalid num_tolerated_failed_amortized_computations value: -1. Must be >= 0.",
    ),
    (
        lambda: SOAP(num_tolerated_failed_amortized_computations=-1),
        "num_tolerated_failed_amortized_computations",
        "Invalid num_tolerated_failed_amortized_computations value: -1. Must be >= 0.",
    ),
    (
        lambda: SHAMPOO(use_trace_scaling=True, trace_scaling_exponent=1.5),
        "trace_scaling_exponent",
        "Invalid trace_scaling_exponent value: 1.5. Must be in (0.0, 1.0] when "
        "use_trace_scaling=True.",
    ),
    (
        lambda: SHAMPOO(inverse_exponent_override={-1: {}, 2: 0.5, -3: {}}),
        "inverse_exponent_override",
        "Invalid orders in self.inverse_exponent_override={-1: {}, 2: 0.5, -3: {}}: [-1, -3]. "
        "All orders must be >= 0.",
    ),
    (
        lambda: SHAMPOO(inverse_exponent_override={2: {0: 0.5, 2: 0.5, 3: 0.5}}),
        "inverse_exponent_override",
        "Invalid dimensions in self.inverse_exponent_override[2]={0: 0.5, 2: 0.5, 3: 0.5}: "
        "[2, 3]. All dimensions must be within [0, 1].",
    ),
    (
        lambda: SHAMPOO(inverse_exponent_override={2: {0: -0.5, 1: -1.0}}),
        "inverse_exponent_override",
        "Invalid override value in self.inverse_exponent_override[2]={0: -0.5, 1: -1.0}: "
        "[-0.5, -1.0]. All overrides must be >= 0.",
    ),
    (
        lambda: SHAMPOO(inverse_exponent_override={1: -0.25}),
        "inverse_exponent_override",
        "Invalid override value in self.inverse_exponent_override[1]=-0.25: -0.25. All "
        "overrides must be >= 0.",
    ),
    (
        lambda: SOAP(ignored_basis_change_dims={-1: [0], 2: [1]}),
        "ignored_basis_change_dims",
        "Invalid orders in self.ignored_basis_change_dims={-1: [0], 2: [1]}: [-1]. All orders "
        "must be >= 0.",
    ),
    (
        lambda: SOAP(ignored_basis_change_dims={2: [0, 2]}),
        "ignored_basis_change_dims",
        # The reference's sentence names the entry "[order]", as written.
        "Invalid dimensions in self.ignored_basis_change_dims[order]=[0, 2]: [2]. All "
        "dimensions must be within [0, 1].",
    ),
    (
        lambda: SOAP(ignored_basis_change_dims={3: [1, 1]}),
        "ignored_basis_change_dims",
        "Invalid ignored dimensions in self.ignored_basis_change_dims[order]=[1, 1]. Duplicate "
        "dimensions found in [1, 1]. All dimensions must be unique.",
    ),
    (
        lambda: SOAP(inverse_exponent_override={-2: 0.5}),
        "inverse_exponent_override",
        "Invalid orders in self.inverse_exponent_override={-2: 0.5}: [-2]. All orders must be "
        ">= 0.",
    ),
    (
        lambda: SOAP(inverse_exponent_override={2: 0.0}),
        "inverse_exponent_override",
        "Invalid override value in self.inverse_exponent_override[order]=0.0: 0.0. All "
        "overrides must be > 0.",
    ),
    (
        lambda: SOAP(
            amortized_computation_config=EighEigendecompositionConfig(
                rank_deficient_stability_config=PseudoInverseConfig()
            )
        ),
        "amortized_computation_config",
        "PseudoInverseConfig is an invalid rank_deficient_stability_config for "
        "EigenvalueCorrectedShampooPreconditionerConfig. Please use an instance of "
        "PerturbationConfig instead.",
    ),
    (
        lambda: SOAP(
            amortized_computation_config=QREigendecompositionConfig(
                rank_deficient_stability_config=PseudoInverseConfig(rank_rtol=1e-6)
            )
        ),
        "amortized_computation_config",
        "PseudoInverseConfig is an invalid rank_deficient_stability_config for "
        "EigenvalueCorrectedShampooPreconditionerConfig. Please use an instance of "
        "PerturbationConfig instead.",
    ),
    (
        lambda: ClassicMomentumConfig(momentum=1.0),
        "momentum",
        "Invalid self.momentum=1.0. Must be within (0.0, 1.0).",
    ),
    (
        lambda: ClassicMomentumConfig(momentum=0.5, dampening=-0.1),
        "dampening",
        "Invalid self.dampening=-0.1. Must be within [0.0, 1.0).",
    ),
    (
        lambda: GeneralizedPrimalAveragingConfig(eval_interp_coeff=1.0),
        "eval_interp_coeff",
        "Invalid self.eval_interp_coeff=1.0. Must be within [0.0, 1.0).",
    ),
    (
        lambda: GeneralizedPrimalAveragingConfig(train_interp_coeff=0.0),
        "train_interp_coeff",
        "Invalid self.train_interp_coeff=0.0. Must be within (0.0, 1.0].",
    ),
    (
        lambda: ScheduleFreeConfig(train_interp_coeff=1.5),
        "train_interp_coeff",
        "Invalid self.train_interp_coeff=1.5. Must be within (0.0, 1.0].",
    ),
    (
        lambda: SingleDeviceDistributedConfig(target_parameter_dimensionality=1.5),
        "target_parameter_dimensionality",
        "Invalid self.target_parameter_dimensionality=1.5 value. Must be an integer or math.inf.",
    ),
    (
        lambda: DDPDistributedConfig(target_parameter_dimensionality=0),
        "target_parameter_dimensionality",
        "Invalid self.target_parameter_dimensionality=0 value. Must be >= 1.",
    ),
    (
        lambda: FullyShardDistributedConfig(num_sub_groups=0),
        "num_sub_groups",
        "Invalid self.num_sub_groups=0. Must be >= 1.",
    ),
    (
        lambda: FullyShardDistributedConfig(num_sub_groups=2),
        "num_sub_groups",
        "num_sub_groups > 1 requires param_assignment_strategy != DEFAULT (REPLICATE or "
        "ROUND_ROBIN); only the lossless FSDP/HSDP distributors support param-group splitting. "
        "Got self.num_sub_groups=2, "
        "self.param_assignment_strategy=<FSDPParamAssignmentStrategy.DEFAULT: 1>.",
    ),
    (
        # The reference checks num_sub_groups before anything about the mesh.
        lambda: HybridShardDistributedConfig(num_sub_groups=-1, device_mesh=object()),
        "num_sub_groups",
        "Invalid self.num_sub_groups=-1. Must be >= 1.",
    ),
    (
        lambda: EighEigendecompositionConfig(tolerance=1.1),
        "tolerance",
        "Invalid tolerance value: 1.1. Must be in the interval [0.0, 1.0].",
    ),
    (
        lambda: QREigendecompositionConfig(tolerance=-1.0),
        "tolerance",
        "Invalid tolerance value: -1.0. Must be in the interval [0.0, 1.0].",
    ),
    (
        lambda: EigenConfig(tolerance=0.01),
        "tolerance",
        "Invalid tolerance value: 0.01. Must be 0.0 for EigenConfig.",
    ),
]


@pytest.mark.parametrize("make, field, sentence", CONFIG_CASES)
def test_a_config_error_starts_with_the_reference_sentence(
    make: Callable[[], Any], field: str, sentence: str
) -> None:
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value).startswith(sentence), str(info.value)
    assert error_field(info.value) == field


def test_a_soap_subclass_names_itself_when_it_refuses_a_pseudo_inverse() -> None:
    @dataclass(kw_only=True)
    class MySOAPConfig(SOAP):
        pass

    solver = EighEigendecompositionConfig(rank_deficient_stability_config=PseudoInverseConfig())
    with pytest.raises(ValueError) as info:
        MySOAPConfig(amortized_computation_config=solver)
    assert str(info.value).startswith(
        "PseudoInverseConfig is an invalid rank_deficient_stability_config for MySOAPConfig."
    )
    # A perturbation is what it takes, with or without a floor.
    for stability in (PerturbationConfig(), PerturbationConfig(eigenvalue_floor_rtol=0.0)):
        config = MySOAPConfig(
            amortized_computation_config=EighEigendecompositionConfig(
                rank_deficient_stability_config=stability
            )
        )
        assert config.amortized_computation_config.rank_deficient_stability_config is stability


@pytest.mark.parametrize(
    "make, sentence",
    [
        (lambda: AdamPreconditionerConfig(epsilon=math.inf), "Invalid epsilon value: inf."),
        (lambda: EighEigendecompositionConfig(tolerance=math.nan), "Invalid tolerance value: nan."),
        (
            lambda: SHAMPOO(num_tolerated_failed_amortized_computations=True),
            "Invalid num_tolerated_failed_amortized_computations value: True.",
        ),
        (
            lambda: ClassicMomentumConfig(momentum="0.5"),  # type: ignore[arg-type]
            "Invalid self.momentum='0.5'.",
        ),
    ],
)
def test_what_only_this_library_refuses_reads_the_same_way(
    make: Callable[[], Any], sentence: str
) -> None:
    """An infinite epsilon, a NaN, a bool or a string: the reference lets them through (or fails
    with a TypeError); here they are refused in the reference's form."""
    with pytest.raises(ValueError, match=f"^{sentence.replace('.', '[.]')} Must be "):
        make()


def _weight() -> torch.Tensor:
    return torch.nn.Parameter(torch.ones(4, 3))


PSEUDO_INVERSE = SHAMPOO(
    amortized_computation_config=EigenConfig(rank_deficient_stability_config=PseudoInverseConfig())
)

GROUP_CASES: list[tuple[dict[str, Any], str, str]] = [
    ({"lr": -0.1}, "lr", "Invalid param_group[LR]=-0.1. Must be >= 0.0."),
    (
        {"betas": (-0.1, 1.0)},
        "betas[0]",
        "Invalid param_group[BETAS][0]=-0.1. Must be in [0.0, 1.0).",
    ),
    (
        {"betas": (0.9, 1.1)},
        "betas[1]",
        "Invalid param_group[BETAS][1]=1.1. Must be in [0.0, 1.0].",
    ),
    ({"beta3": 1.0}, "beta3", "Invalid param_group[BETA3]=1.0. Must be in [0.0, 1.0)."),
    (
        {"epsilon": 0.1, "preconditioner_config": PSEUDO_INVERSE},
        "epsilon",
        "Invalid param_group[EPSILON]=0.1. Must be == 0.0 when PseudoInverseConfig is used.",
    ),
    ({"epsilon": 0.0}, "epsilon", "Invalid param_group[EPSILON]=0.0. Must be > 0.0."),
    (
        {"weight_decay": -0.1},
        "weight_decay",
        "Invalid param_group[WEIGHT_DECAY]=-0.1. Must be >= 0.0.",
    ),
    (
        {"weight_decay_type": WeightDecayType.INDEPENDENT, "lr": 0.0},
        "peak_lr",
        "Invalid param_group[PEAK_LR]=0.0. Must be > 0.0 when using WeightDecayType.CORRECTED or "
        "WeightDecayType.INDEPENDENT.",
    ),
    (
        {"max_preconditioner_dim": 2.5},
        "max_preconditioner_dim",
        "Invalid param_group[MAX_PRECONDITIONER_DIM]=2.5. Must be an integer or math.inf.",
    ),
    (
        {"max_preconditioner_dim": 0},
        "max_preconditioner_dim",
        "Invalid param_group[MAX_PRECONDITIONER_DIM]=0. Must be >= 1.",
    ),
    (
        {"precondition_frequency": 0},
        "precondition_frequency",
        "Invalid param_group[PRECONDITION_FREQUENCY]=0. Must be >= 1.",
    ),
    (
        {"start_preconditioning_step": -3},
        "start_preconditioning_step",
        "Invalid param_group[START_PRECONDITIONING_STEP]=-3. Must be >= -1.",
    ),
    (
        {"start_preconditioning_step": 4, "precondition_frequency": 5},
        "start_preconditioning_step",
        "Invalid param_group[START_PRECONDITIONING_STEP]=4. Must be >= "
        "param_group[PRECONDITION_FREQUENCY]=5.",
    ),
]


@pytest.mark.parametrize("entries, field, sentence", GROUP_CASES)
def test_a_group_error_starts_with_the_reference_sentence(
    entries: dict[str, Any], field: str, sentence: str
) -> None:
    with pytest.raises(ValueError) as info:
        DistributedShampoo([_weight()], **entries)
    assert str(info.value).startswith(sentence), str(info.value)
    assert error_field(info.value) == field


def test_a_bad_entry_set_between_steps_is_refused_in_the_same_words() -> None:
    weight = _weight()
    optimizer = DistributedShampoo([weight], lr=0.1)
    optimizer.param_groups[0]["betas"] = (0.9, -0.5)
    weight.grad = torch.ones_like(weight)
    with pytest.raises(ValueError, match=r"^Invalid param_group\[BETAS\]\[1\]=-0\.5\. Must be"):
        optimizer.step()


def test_a_stateless_preconditioner_checks_the_start_against_frequency_one() -> None:
    """Sign descent steps every step: the reference writes frequency 1 into the group before it
    compares the start step with it, so a start of 3 with a frequency entry of 10 is accepted."""
    optimizer = DistributedShampoo(
        [_weight()],
        preconditioner_config=SignDescentPreconditionerConfig(),
        precondition_frequency=10,
        start_preconditioning_step=3,
    )
    group = optimizer.param_groups[0]
    assert (group["precondition_frequency"], group["start_preconditioning_step"]) == (1, 3)


def test_unsupported_configs_name_themselves_as_the_reference_does() -> None:
    @dataclass
    class Unknown(PreconditionerConfig):
        pass

    @dataclass
    class UnknownAveraging(IterateAveragingConfig):
        pass

    with pytest.raises(
        NotImplementedError, match=r"^preconditioner_config=.*\.Unknown\(\) not supported!$"
    ):
        DistributedShampoo([_weight()], preconditioner_config=Unknown())
    with pytest.raises(
        UnsupportedConfigError,
        match=r"^group\[ITERATE_AVERAGING_CONFIG\]=.*\.UnknownAveraging\(\) is not supported! "
        r"Supported configs: ClassicMomentumConfig, GeneralizedPrimalAveragingConfig, "
        r"ScheduleFreeConfig\.",
    ):
        DistributedShampoo([_weight()], iterate_averaging_config=UnknownAveraging())


def test_each_group_is_announced_at_info_until_the_first_bad_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO), pytest.raises(ValueError, match="LR"):
        DistributedShampoo(
            [
                {"params": []},
                {"params": [_weight()], "lr": -1.0},
                {"params": [_weight()]},
            ]
        )
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert [r.msg for r in infos] == [
        "Checking param_group 0 hyperparameters...",
        "Checking param_group 1 hyperparameters...",
    ]
    assert all(r.args == () for r in infos)


@pytest.mark.parametrize(
    "config", [SignDescentPreconditionerConfig(), SpectralDescentPreconditionerConfig()]
)
def test_a_stateless_preconditioner_warns_what_has_no_effect(
    config: PreconditionerConfig, caplog: pytest.LogCaptureFixture
) -> None:
    name = type(config).__name__
    distributed = SingleDeviceDistributedConfig(target_parameter_dimensionality=1)
    with caplog.at_level(logging.WARNING):
        DistributedShampoo(
            [_weight()],
            betas=(0.9, 0.999),
            epsilon=1e-8,
            precondition_frequency=100,
            preconditioner_config=config,
            distributed_config=distributed,
        )
    expected = [
        f"param_group[BETAS][1]=0.999 does not have any effect when {name} is used.",
        f"param_group[EPSILON]=1e-08 does not have any effect when {name} is used.",
        f"param_group[PRECONDITION_FREQUENCY]=100 does not have any effect when {name} is used. "
        "Setting precondition_frequency to 1...",
    ]
    if isinstance(config, SpectralDescentPreconditionerConfig):
        expected.append(
            "param_group[DISTRIBUTED_CONFIG].target_parameter_dimensionality=1 is not equal to 2. "
            "Setting target_parameter_dimensionality to 2..."
        )
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.msg for r in warnings] == expected
    assert all(r.args == () for r in warnings)
    # The caller's config object is left as it was (the reference writes 2 into it).
    assert distributed.target_parameter_dimensionality == 1


@pytest.mark.slow
def test_a_compiled_step_warns_once_per_new_gradient_selection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The compiled step specializes on which blocks have a gradient: a selection it has not run
    with compiles again, and the reference's warning says so; a selection seen before reuses its
    code and is not warned about."""
    layer = torch.nn.Linear(5, 10)
    optimizer = DistributedShampoo(
        layer.parameters(),
        lr=0.01,
        precondition_frequency=1,
        start_preconditioning_step=1,
        shampoo_pt2_compile_config=ShampooPT2CompileConfig(backend="eager"),
    )
    assert optimizer.step_compiled

    def step(with_bias_grad: bool) -> None:
        optimizer.zero_grad()
        layer.weight.grad = torch.ones_like(layer.weight)
        if with_bias_grad:
            layer.bias.grad = torch.ones_like(layer.bias)
        optimizer.step()

    with caplog.at_level(logging.WARNING):
        for with_bias_grad in (True, True, False, True, False):
            step(with_bias_grad)
    warnings = [r for r in caplog.records if r.msg.startswith("PT2 will recompile")]
    assert len(warnings) == 1
    assert warnings[0].msg.startswith(
        "PT2 will recompile because the gradient selection of model parameters have changed "
        "from the previous step. Possible reasons include some gradients are None. If this is "
        "not intended, please check the data and/or model."
    )
    assert warnings[0].msg.endswith("- Current step: 2\n- Changed gradient selector indices: [1]")


@pytest.mark.slow
def test_a_compiled_step_warns_when_a_group_loses_every_gradient(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A group whose gradients all turn None still steps (its step counts, as the reference's
    does), and its compiled step meets a selection it has not run with, no block selected: it
    compiles again, and the reference's warning says so, naming both blocks. The same idle
    selection again reuses that code and is not warned about."""
    from torch._dynamo.utils import counters

    layer = torch.nn.Linear(5, 10, bias=False)  # max_preconditioner_dim 5: two (5, 5) blocks
    optimizer = DistributedShampoo(
        layer.parameters(),
        lr=0.01,
        max_preconditioner_dim=5,
        precondition_frequency=1,
        start_preconditioning_step=1,
        grafting_config=None,
        shampoo_pt2_compile_config=ShampooPT2CompileConfig(backend="eager"),
    )
    assert optimizer.step_compiled
    compiled_frames = []
    with caplog.at_level(logging.WARNING):
        for has_grad in (True, False, True, False):
            layer.weight.grad = torch.ones_like(layer.weight) if has_grad else None
            frames = counters["frames"]["total"]
            optimizer.step()
            compiled_frames.append(counters["frames"]["total"] - frames)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.msg.startswith("PT2 will recompile") for r in warnings] == [True]
    ending = "- Current step: 1\n- Changed gradient selector indices: [0, 1]"
    assert warnings[0].msg.endswith(ending)
    assert compiled_frames[1] > 0  # the warning is true: the idle step compiled
    assert int(optimizer.state[layer.weight]["step"]) == 4
