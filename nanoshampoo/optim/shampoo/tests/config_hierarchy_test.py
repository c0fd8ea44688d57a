"""The config classes relate as in the well-known Distributed Shampoo library, and their new
fields are validated (``ValueError`` naming the field)."""

from __future__ import annotations

import math

import pytest
import torch

from nanoshampoo.optim.shampoo import (
    AdaGradPreconditionerConfig,
    AdamPreconditionerConfig,
    AmortizedComputationConfig,
    BaseShampooPreconditionerConfig,
    ClassicShampooPreconditionerConfig,
    CoupledNewtonConfig,
    DistributedShampoo,
    EigenConfig,
    EigendecompositionConfig,
    EigenvalueCorrectedShampooPreconditionerConfig,
    EighEigendecompositionConfig,
    MatrixFunctionConfig,
    NewtonSchulzOrthogonalizationConfig,
    OrthogonalizationConfig,
    QREigendecompositionConfig,
    RMSpropPreconditionerConfig,
    RootInvConfig,
    RootInvShampooPreconditionerConfig,
    ShampooPreconditionerConfig,
    SVDOrthogonalizationConfig,
    WarmStartedEigenConfig,
    WeightDecayType,
)
from nanoshampoo.optim.shampoo.config_checks import error_field


@pytest.mark.parametrize(
    "instance, base, expected",
    [
        (AdamPreconditionerConfig(), RMSpropPreconditionerConfig, True),
        (AdamPreconditionerConfig(), AdaGradPreconditionerConfig, True),
        (RMSpropPreconditionerConfig(), AdaGradPreconditionerConfig, True),
        (AdaGradPreconditionerConfig(), RMSpropPreconditionerConfig, False),
        (RMSpropPreconditionerConfig(), AdamPreconditionerConfig, False),
        (EigenConfig(), EighEigendecompositionConfig, True),
        (EigenConfig(), EigendecompositionConfig, True),
        (EigenConfig(), RootInvConfig, True),
        (EighEigendecompositionConfig(), RootInvConfig, False),
        (QREigendecompositionConfig(), MatrixFunctionConfig, True),
        (CoupledNewtonConfig(), MatrixFunctionConfig, True),
        (WarmStartedEigenConfig(), MatrixFunctionConfig, True),
        (NewtonSchulzOrthogonalizationConfig(), MatrixFunctionConfig, True),
        (SVDOrthogonalizationConfig(), OrthogonalizationConfig, True),
        (RootInvShampooPreconditionerConfig(), ClassicShampooPreconditionerConfig, True),
        (RootInvShampooPreconditionerConfig(), BaseShampooPreconditionerConfig, True),
        (EigenvalueCorrectedShampooPreconditionerConfig(), BaseShampooPreconditionerConfig, True),
        (
            EigenvalueCorrectedShampooPreconditionerConfig(),
            ClassicShampooPreconditionerConfig,
            False,
        ),
    ],
)
def test_isinstance_follows_the_reference_hierarchy(
    instance: object, base: type, expected: bool
) -> None:
    assert isinstance(instance, base) is expected


def test_the_old_names_are_the_new_classes() -> None:
    assert AmortizedComputationConfig is MatrixFunctionConfig
    assert ShampooPreconditionerConfig is ClassicShampooPreconditionerConfig


@pytest.mark.parametrize(
    "base",
    [
        MatrixFunctionConfig,
        BaseShampooPreconditionerConfig,
        ClassicShampooPreconditionerConfig,
        RootInvConfig,
        EigendecompositionConfig,
        OrthogonalizationConfig,
    ],
)
def test_base_classes_cannot_be_built(base: type) -> None:
    with pytest.raises(TypeError):
        base()


def test_subclasses_keep_their_own_defaults_and_inherit_the_rest() -> None:
    adam, rmsprop, adagrad = (
        AdamPreconditionerConfig(),
        RMSpropPreconditionerConfig(),
        AdaGradPreconditionerConfig(),
    )
    assert (adam.beta2, rmsprop.beta2) == (0.999, 0.99)
    assert adam.epsilon == rmsprop.epsilon == adagrad.epsilon == 1e-10
    eigen = EigenConfig()
    assert (eigen.tolerance, eigen.eigendecomposition_offload_device) == (0.0, "")
    assert eigen.retry_double_precision is True


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: AdamPreconditionerConfig(beta2=0.0), "beta2"),
        (lambda: RMSpropPreconditionerConfig(epsilon=0.0), "epsilon"),
        (lambda: EigenConfig(tolerance=0.1), "tolerance"),
        (lambda: EighEigendecompositionConfig(tolerance=1.5), "tolerance"),
        (lambda: EighEigendecompositionConfig(tolerance=math.nan), "tolerance"),
        (
            lambda: EighEigendecompositionConfig(
                eigendecomposition_offload_device="no-such-device"
            ),
            "eigendecomposition_offload_device",
        ),
        (
            lambda: EigenConfig(eigendecomposition_offload_device=0),
            "eigendecomposition_offload_device",
        ),
    ],
)
def test_invalid_fields_raise_value_error_naming_the_field(make, field: str) -> None:
    with pytest.raises(ValueError) as info:
        make()
    assert error_field(info.value) == field and field in str(info.value)


def test_configs_are_keyword_only_like_the_reference() -> None:
    with pytest.raises(TypeError):
        AdamPreconditionerConfig(0.99)  # type: ignore[misc]


def test_weight_decay_type_values_are_their_names() -> None:
    assert [(t.name, t.value) for t in WeightDecayType] == [
        ("L2", "L2"),
        ("DECOUPLED", "DECOUPLED"),
        ("CORRECTED", "CORRECTED"),
        ("INDEPENDENT", "INDEPENDENT"),
    ]
    assert WeightDecayType("CORRECTED") is WeightDecayType.CORRECTED


def _root_step(config: EigenConfig) -> torch.Tensor:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(6, 5))
    opt = DistributedShampoo(
        [param],
        lr=0.1,
        betas=(0.0, 1.0),
        epsilon=1e-12,
        precondition_frequency=1,
        preconditioner_config=RootInvShampooPreconditionerConfig(
            amortized_computation_config=config
        ),
    )
    for _ in range(2):
        param.grad = torch.randn(6, 5)
        opt.step()
    return param.detach().clone()


def test_offloading_the_eigendecomposition_to_the_cpu_gives_the_same_step() -> None:
    assert torch.equal(
        _root_step(EigenConfig(eigendecomposition_offload_device="cpu")), _root_step(EigenConfig())
    )


def _soap_step(solver: EighEigendecompositionConfig) -> torch.Tensor:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(6, 5))
    opt = DistributedShampoo(
        [param],
        lr=0.1,
        betas=(0.9, 0.99),
        epsilon=1e-12,
        precondition_frequency=1,
        preconditioner_config=EigenvalueCorrectedShampooPreconditionerConfig(
            amortized_computation_config=solver
        ),
    )
    for _ in range(3):
        param.grad = torch.randn(6, 5)
        opt.step()
    return param.detach().clone()


def test_an_eigen_config_configures_the_eigenbasis_as_eigh_does() -> None:
    assert torch.equal(_soap_step(EigenConfig()), _soap_step(EighEigendecompositionConfig()))
