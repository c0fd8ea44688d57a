"""The ``custom`` setup: any ``torch.optim.Optimizer`` class, loaded by import path.

``[custom]`` (:class:`CustomConfig`) names the class of the block matrices,
``matrix_optimizer = "package.module:Class"`` (or ``"path/to/file.py:Class"``, a file outside
any package, relative to the working directory), and the keyword arguments it is built with,
``matrix_kwargs``. ``rest_optimizer`` optionally does the same for the embedding, head and 1-D
parameters; empty, they get the recipe's AdamW at the ``[adam]`` hyper-parameters. A custom
rest optimizer gets three param groups (embed, head, scalar) at the ``[adam]`` lrs, and
``rest_kwargs``.

The trainer averages a custom optimizer's gradients across ranks before its step (DDP), saves
and restores its ``state_dict`` with the checkpoints, and applies the lr schedule to every
param group's ``lr`` (a class must keep one per group, as every ``torch.optim`` class does).
See ``docs/adding-an-optimizer.md``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanoshampoo.train.setups.adam import build_rest_adamw, rest_param_groups
from nanoshampoo.train.setups.checks import check_types, field_label
from nanoshampoo.train.setups.registry import (
    BuildContext,
    OptimizerPart,
    SetupInputs,
    register_setup,
    register_table,
)


def load_optimizer_class(spec: str, label: str) -> type[torch.optim.Optimizer]:
    """The class that ``"package.module:Class"`` or ``"file.py:Class"`` names.

    ``ValueError`` naming ``label`` when the module cannot be imported, lacks the name, or the
    name is not a ``torch.optim.Optimizer`` subclass.
    """
    module_name, sep, class_name = spec.rpartition(":")
    if not sep or not module_name or not class_name.isidentifier():
        raise ValueError(f"{label} must be 'package.module:Class' or 'file.py:Class', got {spec!r}")
    try:
        module = _import(module_name)
    except Exception as exc:  # the user's module: any import-time failure is a bad input
        raise ValueError(
            f"{label} {spec!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}"
        ) from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(
            f"{label} {spec!r}: {module_name!r} has no torch.optim.Optimizer "
            f"subclass {class_name!r}"
        )
    return cls


def _import(module_name: str) -> Any:
    if not module_name.endswith(".py"):
        return importlib.import_module(module_name)
    path = Path(module_name).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no file {path}")
    name = f"nanoshampoo_custom_{path.stem}_{abs(hash(str(path))):x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: pickling and dataclasses look the module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


@register_table("custom")
@dataclass
class CustomConfig:
    """A user's optimizer classes (see the module docstring); empty strings: not set."""

    matrix_optimizer: str = ""
    matrix_kwargs: dict[str, Any] = field(default_factory=dict)
    rest_optimizer: str = ""
    rest_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_types("custom", self)
        for name in ("matrix_optimizer", "rest_optimizer"):
            if getattr(self, name):
                load_optimizer_class(getattr(self, name), field_label("custom", name))
        if self.rest_kwargs and not self.rest_optimizer:
            raise ValueError(
                f"{field_label('custom', 'rest_kwargs')} needs "
                f"{field_label('custom', 'rest_optimizer')}; the default rest "
                "optimizer takes the [adam] table"
            )


def check_custom_config(cfg: SetupInputs) -> None:
    if not cfg.table(CustomConfig).matrix_optimizer:
        raise ValueError(
            f"{field_label('custom', 'matrix_optimizer')} is required by "
            "optimizer='custom' ('package.module:Class')"
        )


def _construct(spec: str, label: str, params: Any, kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    cls = load_optimizer_class(spec, label)
    try:
        optimizer = cls(params, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{label} {spec!r} refused its arguments {kwargs}: {exc}") from None
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"{label} {spec!r}: its step() requires a closure (it re-evaluates the "
            "loss, as LBFGS does); the trainer steps once per batch, without one"
        )
    missing = [i for i, group in enumerate(optimizer.param_groups) if "lr" not in group]
    if missing:
        raise ValueError(
            f"{label} {spec!r}: param groups {missing} have no 'lr', which the "
            "trainer's schedule sets every step"
        )
    return optimizer


@register_setup(
    "custom",
    tables=("adam", "custom"),
    matrix="custom",
    rest="adamw or custom",
    check=check_custom_config,
)
def build_custom(ctx: BuildContext) -> list[OptimizerPart]:
    """The user's block-matrix optimizer, and the user's rest optimizer or the recipe's AdamW."""
    hp = ctx.cfg.table(CustomConfig)
    matrix = _construct(
        hp.matrix_optimizer,
        field_label("custom", "matrix_optimizer"),
        ctx.groups["matrix"],
        hp.matrix_kwargs,
    )
    if not hp.rest_optimizer:
        return [build_rest_adamw(ctx), OptimizerPart(matrix)]
    rest = _construct(
        hp.rest_optimizer,
        field_label("custom", "rest_optimizer"),
        rest_param_groups(ctx),
        hp.rest_kwargs,
    )
    return [OptimizerPart(rest), OptimizerPart(matrix)]
