"""The setup registry: hyper-parameter tables and optimizer setups, each registered by name.

A *table* is a small dataclass of one component's hyper-parameters (``MuonConfig`` under
``muon``), validated in its ``__post_init__``. Presets reach it as a ``[muon]`` table, flags as
``--muon.lr``, ``TrainConfig`` holds one instance per registered table, read by its class
(``cfg.table(MuonConfig)``, typed ``MuonConfig``).

A *setup* (``TrainConfig.optimizer``) is one builder: given the model's parameter groups
(``embed``, ``head``, ``scalar``, ``matrix``: see ``nanoshampoo.train.optimizers``), what it
reads of the config (:class:`SetupInputs`: its tables and the parallel mode) and the world size, it
returns the optimizers as :class:`OptimizerPart`s. ``register_setup`` is
the only way in and takes the builder itself, so a setup without a builder cannot exist; the
trainer then checks that every trainable parameter is owned by exactly one optimizer.

Example:
    >>> @register_setup("sgd-demo", tables=(), rest="none", matrix="SGD")  # doctest: +SKIP
    ... def build_sgd(ctx: BuildContext) -> list[OptimizerPart]:
    ...     params = [p for group in ctx.groups.values() for p in group]
    ...     return [OptimizerPart(torch.optim.SGD(params, lr=0.1))]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
from torch import nn

Table = TypeVar("Table")


class SetupInputs(Protocol):
    """What a setup reads of a run's config (``TrainConfig`` is one): its tables, by class, and
    the parallel mode. The setups see only this, so they never import the config."""

    @property
    def parallel(self) -> str: ...

    def table(self, cls: type[Table]) -> Table: ...


@dataclass(frozen=True)
class OptimizerPart:
    """One optimizer of a setup. ``reduces_own_gradients``: it averages its parameters'
    gradients across ranks itself (DistAdam's reduce-scatter hooks), so the trainer must not."""

    optimizer: torch.optim.Optimizer
    reduces_own_gradients: bool = False


@dataclass(frozen=True)
class BuildContext:
    """What a builder gets: the parameter groups (``GROUP_NAMES``), the config's tables and
    parallel mode, the world size, and whether the parameters are FSDP-sharded DTensors
    (``cfg.parallel`` fsdp2 / hsdp)."""

    groups: Mapping[str, list[nn.Parameter]]
    cfg: SetupInputs
    world_size: int

    @property
    def sharded(self) -> bool:
        return self.cfg.parallel != "ddp"


Builder = Callable[[BuildContext], list[OptimizerPart]]
# A cross-table check of a config that selects the setup; raises ValueError naming the field.
ConfigCheck = Callable[[SetupInputs], None]


@dataclass(frozen=True)
class SetupSpec:
    """A registered setup: its builder, the tables it reads, and what it runs where.

    ``matrix`` / ``rest`` name the optimizers of the block matrices and of the embedding, head
    and 1-D parameters (for messages and ``--help``); ``check`` validates across tables.
    """

    name: str
    build: Builder
    tables: tuple[str, ...]
    matrix: str
    rest: str
    check: ConfigCheck | None = None

    @property
    def uses_distadam(self) -> bool:
        return "distadam" in (self.matrix, self.rest)


_TABLES: dict[str, type] = {}
_SETUPS: dict[str, SetupSpec] = {}


def register_table(name: str) -> Callable[[type], type]:
    """Class decorator: the dataclass is the hyper-parameter table ``name`` (``[name]``)."""

    def register(cls: type) -> type:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"table {name!r}: {cls.__name__} is not a dataclass")
        if name in _TABLES and _TABLES[name] is not cls:
            raise ValueError(f"table {name!r} is already registered ({_TABLES[name].__name__})")
        _TABLES[name] = cls
        return cls

    return register


def register_setup(
    name: str, *, tables: tuple[str, ...], matrix: str, rest: str, check: ConfigCheck | None = None
) -> Callable[[Builder], Builder]:
    """Function decorator: the builder is the setup ``name`` (registering is building)."""

    def register(build: Builder) -> Builder:
        unknown = [t for t in tables if t not in _TABLES]
        if unknown:
            raise ValueError(f"setup {name!r} reads unregistered tables {unknown}")
        if name in _SETUPS and _SETUPS[name].build is not build:
            raise ValueError(f"setup {name!r} is already registered")
        _SETUPS[name] = SetupSpec(name, build, tuple(tables), matrix, rest, check)
        return build

    return register


def setup_names() -> tuple[str, ...]:
    return tuple(_SETUPS)


def get_setup(name: str) -> SetupSpec:
    if name not in _SETUPS:
        raise ValueError(f"TrainConfig.optimizer must be one of {list(_SETUPS)}, got {name!r}")
    return _SETUPS[name]


def table_classes() -> dict[str, type]:
    """Table name -> its dataclass, in registration order."""
    return dict(_TABLES)


def table_name(cls: type) -> str:
    """The name ``cls`` is registered under (``MuonConfig`` -> ``"muon"``)."""
    for name, registered in _TABLES.items():
        if registered is cls:
            return name
    raise KeyError(f"{cls.__name__} is not a registered hyper-parameter table")
