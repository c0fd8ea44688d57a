"""The setup registry: registering is building, and every parameter is owned exactly once."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from nanoshampoo.model.gpt import GPT
from nanoshampoo.train.config import TrainConfig, UserError
from nanoshampoo.train.optimizers import build_optimizer_setup
from nanoshampoo.train.setups import BuildContext, OptimizerPart, registry, setup_names


@pytest.fixture(autouse=True)
def _scratch_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Setups registered by a test vanish after it."""
    monkeypatch.setattr(registry, "_SETUPS", dict(registry._SETUPS))


def test_the_builtin_setups_are_registered() -> None:
    assert set(setup_names()) == {
        "adamw",
        "distadam",
        "shampoo",
        "soap",
        "muon",
        "custom",
        "normuon",
        "muon-cwd",
        "soap-muon",
        "schedule-free",
        "lion",
        "kl-shampoo",
        "shampoo-distadam",
        "soap-distadam",
        "muon-distadam",
    }


def test_a_setup_exists_only_with_its_builder(tiny_gpt: Callable[..., GPT]) -> None:
    register = registry.register_setup("half-done", tables=("adam",), matrix="sgd", rest="adamw")
    assert "half-done" not in setup_names()  # nothing registered until a builder is given
    with pytest.raises(ValueError, match="TrainConfig.optimizer must be one of"):
        TrainConfig(optimizer="half-done")

    @register
    def build(ctx: BuildContext) -> list[OptimizerPart]:
        params = [p for group in ctx.groups.values() for p in group]
        return [OptimizerPart(torch.optim.SGD(params, lr=0.1))]

    setup = build_optimizer_setup(tiny_gpt(), TrainConfig(optimizer="half-done"), world_size=1)
    assert [type(o).__name__ for o in setup.optimizers] == ["SGD"]


def test_a_setup_must_read_registered_tables() -> None:
    with pytest.raises(ValueError, match=r"unregistered tables \['sophia'\]"):
        registry.register_setup("sophia", tables=("sophia",), matrix="sophia", rest="adamw")(
            lambda ctx: []
        )


def test_a_parameter_that_no_optimizer_owns_is_a_one_line_error(
    tiny_gpt: Callable[..., GPT],
) -> None:
    @registry.register_setup("no-matrix", tables=("adam",), matrix="none", rest="adamw")
    def build(ctx: BuildContext) -> list[OptimizerPart]:
        rest = [p for name in ("embed", "head", "scalar") for p in ctx.groups[name]]
        return [OptimizerPart(torch.optim.AdamW(rest, lr=0.1))]

    model = tiny_gpt()
    with pytest.raises(UserError) as info:
        build_optimizer_setup(model, TrainConfig(optimizer="no-matrix"), world_size=1)
    message = str(info.value)
    assert "\n" not in message and "setup 'no-matrix'" in message
    matrices = [n for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim >= 2]
    assert f"owned by no optimizer: {', '.join(matrices)}" in message


def test_a_parameter_owned_twice_is_a_one_line_error(tiny_gpt: Callable[..., GPT]) -> None:
    @registry.register_setup("twice", tables=("adam",), matrix="sgd", rest="sgd")
    def build(ctx: BuildContext) -> list[OptimizerPart]:
        every = [p for group in ctx.groups.values() for p in group]
        return [
            OptimizerPart(torch.optim.SGD(every, lr=0.1)),
            OptimizerPart(torch.optim.SGD(ctx.groups["embed"], lr=0.1)),
        ]

    with pytest.raises(UserError, match=r"owned more than once: embed\.weight \(0:SGD, 1:SGD\)$"):
        build_optimizer_setup(tiny_gpt(), TrainConfig(optimizer="twice"), world_size=1)


def test_the_builtin_setups_own_every_parameter_once(tiny_gpt: Callable[..., GPT]) -> None:
    model = tiny_gpt()
    for name in setup_names():
        if name == "custom":
            continue
        cfg = TrainConfig(optimizer=name, **{"preconditioner.max_preconditioner_dim": 128})
        setup = build_optimizer_setup(model, cfg, world_size=1)
        owned = [id(p) for o in setup.optimizers for g in o.param_groups for p in g["params"]]
        assert sorted(owned) == sorted(id(p) for p in model.parameters()), name
        self_reducing = {id(p) for p in setup.self_reducing_params}
        assert bool(self_reducing) == ("distadam" in (cfg.setup.matrix, cfg.setup.rest)), name
        assert {id(p) for p in setup.all_reduce_params} == set(owned) - self_reducing, name


@pytest.mark.parametrize("name, expected", [("float32", None), ("bfloat16", torch.bfloat16)])
def test_shampoo_precondition_dtype_reaches_the_optimizer(
    tiny_gpt: Callable[..., GPT], name: str, expected: torch.dtype | None
) -> None:
    from nanoshampoo.optim.shampoo import DistributedShampoo

    cfg = TrainConfig(optimizer="shampoo", **{"shampoo.precondition_dtype": name})
    setup = build_optimizer_setup(tiny_gpt(), cfg, world_size=1)
    (shampoo,) = [o for o in setup.optimizers if isinstance(o, DistributedShampoo)]
    assert [g["preconditioner_config"].precondition_dtype for g in shampoo.param_groups] == [
        expected
    ] * len(shampoo.param_groups)
