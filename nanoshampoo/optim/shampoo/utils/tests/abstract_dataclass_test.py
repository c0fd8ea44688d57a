from dataclasses import dataclass, fields

import pytest

from nanoshampoo.optim.shampoo.utils.abstract_dataclass import AbstractDataclass


@dataclass(init=False)
class _AbstractBase(AbstractDataclass):
    lr: float = 0.1


@dataclass(init=False)
class _StillAbstract(_AbstractBase):
    momentum: float = 0.9


@dataclass
class _Concrete(_StillAbstract):
    nesterov: bool = False


@dataclass
class _ConcreteWithOwnInit(_AbstractBase):
    def __init__(self, lr: float = 0.5) -> None:
        self.lr = lr * 2


@dataclass(init=False)
class _AbstractAgainBelowConcrete(_Concrete):
    """A subclass declared init=False inherits the concrete __init__ of its parent."""


@pytest.mark.parametrize("cls", [AbstractDataclass, _AbstractBase, _StillAbstract])
def test_abstract_levels_cannot_be_instantiated(cls: type) -> None:
    with pytest.raises(TypeError, match="abstract"):
        cls()


def test_plain_dataclass_subclass_is_concrete_with_inherited_fields() -> None:
    config = _Concrete(lr=0.3, nesterov=True)
    assert (config.lr, config.momentum, config.nesterov) == (0.3, 0.9, True)
    assert [f.name for f in fields(config)] == ["lr", "momentum", "nesterov"]
    assert config == _Concrete(lr=0.3, momentum=0.9, nesterov=True)


def test_subclass_with_its_own_init_uses_it() -> None:
    assert _ConcreteWithOwnInit().lr == 1.0


def test_concrete_init_is_inherited_below_a_concrete_class() -> None:
    assert _AbstractAgainBelowConcrete(lr=0.2).lr == 0.2
