"""Configs this optimizer does not implement raise ``UnsupportedConfigError``: a ``ValueError``
(this project's rule) that is also the ``NotImplementedError`` the well-known library raises,
with a message naming the field and, for its FSDP1 configs, the replacement."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from nanoshampoo.optim.shampoo import (
    DistributedShampoo,
    FSDPDistributedConfig,
    HSDPDistributedConfig,
    PreconditionerConfig,
    RootInvShampooPreconditionerConfig,
    UnsupportedConfigError,
)


@dataclass
class _UnknownPreconditionerConfig(PreconditionerConfig):
    """A user-defined config no builder knows."""


def _build(**kwargs: object) -> DistributedShampoo:
    return DistributedShampoo([torch.nn.Parameter(torch.zeros(3, 2))], **kwargs)


def test_the_error_is_both_value_error_and_not_implemented_error() -> None:
    assert issubclass(UnsupportedConfigError, ValueError)
    assert issubclass(UnsupportedConfigError, NotImplementedError)


@pytest.mark.parametrize(
    "config, replacement",
    [
        (FSDPDistributedConfig(param_to_metadata={}), "FullyShardDistributedConfig"),
        (
            HSDPDistributedConfig(param_to_metadata={}, device_mesh=None),
            "HybridShardDistributedConfig",
        ),
    ],
)
@pytest.mark.parametrize("caught", [ValueError, NotImplementedError])
def test_fsdp1_configs_are_refused_naming_their_replacement(
    config: object, replacement: str, caught: type[Exception]
) -> None:
    with pytest.raises(
        caught, match=rf"^distributed_config: {type(config).__name__} .*use {replacement}$"
    ):
        _build(distributed_config=config)


@pytest.mark.parametrize("caught", [ValueError, NotImplementedError])
def test_an_unknown_preconditioner_config_is_refused(caught: type[Exception]) -> None:
    with pytest.raises(caught, match=r"^preconditioner_config=.*\(\) not supported!$"):
        _build(preconditioner_config=_UnknownPreconditionerConfig())


@pytest.mark.parametrize("caught", [ValueError, NotImplementedError])
def test_a_shampoo_config_as_grafting_is_refused(caught: type[Exception]) -> None:
    with pytest.raises(
        caught, match="^grafting_config must be None or an SGD/AdaGrad/RMSprop/Adam"
    ):
        _build(grafting_config=RootInvShampooPreconditionerConfig())


def test_a_non_config_grafting_value_is_a_plain_value_error() -> None:
    with pytest.raises(ValueError, match="^grafting_config") as info:
        _build(grafting_config="adam")
    assert not isinstance(info.value, NotImplementedError)


def test_a_refused_group_is_not_kept() -> None:
    opt = _build()
    with pytest.raises(UnsupportedConfigError):
        opt.add_param_group(
            {
                "params": [torch.nn.Parameter(torch.zeros(2))],
                "distributed_config": FSDPDistributedConfig(),
            }
        )
    assert len(opt.param_groups) == 1
