"""Base class for configuration dataclasses that must not be instantiated directly.

Every Shampoo config family (preconditioner configs, distributed configs, cost models) derives
from :class:`AbstractDataclass`. The abstract ``__init__`` keeps the family's base classes
uninstantiable while still letting them declare dataclass fields that subclasses inherit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(init=False)
class AbstractDataclass(ABC):
    """An abstract dataclass: only subclasses that get a concrete ``__init__`` can be built.

    Rules (they hold through any number of inheritance levels):

    - A subclass declared ``@dataclass(init=False)`` without its own ``__init__`` stays abstract;
      instantiating it raises ``TypeError``.
    - A subclass declared with plain ``@dataclass`` gets a generated ``__init__`` (or keeps the one
      it defines) and becomes concrete. ``dataclasses`` re-computes the abstract methods after
      generating ``__init__`` (``abc.update_abstractmethods``), which is what makes this work.

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass(init=False)
        ... class StepConfig(AbstractDataclass):
        ...     lr: float = 0.1
        >>> @dataclass
        ... class SGDConfig(StepConfig):
        ...     momentum: float = 0.9
        >>> SGDConfig(lr=0.5)
        SGDConfig(lr=0.5, momentum=0.9)
        >>> StepConfig()
        Traceback (most recent call last):
        ...
        TypeError: Can't instantiate abstract class StepConfig ...
    """

    @abstractmethod
    def __init__(self) -> None:
        """Abstract: concrete subclasses get theirs from ``@dataclass`` or define one."""
