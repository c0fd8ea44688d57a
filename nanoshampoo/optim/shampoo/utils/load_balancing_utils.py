"""Cost models that say how expensive a block is, for spreading blocks over ranks."""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass, field

import torch
from numpy.polynomial import polynomial

from nanoshampoo.optim.shampoo.utils.abstract_dataclass import AbstractDataclass
from nanoshampoo.validation import check_float, check_int


@dataclass(init=False)
class CostModel(AbstractDataclass):
    """Abstract: ``cost(tensor) -> float``, the load one block puts on the rank that owns it.

    Concrete models are plain ``@dataclass`` subclasses implementing :meth:`cost`. Costs must
    depend only on the tensor's shape and dtype (never its values), so that every rank computes
    the same assignment; meta tensors are therefore valid inputs.

    Example:
        >>> @dataclass
        ... class NumelCostModel(CostModel):
        ...     def cost(self, tensor: torch.Tensor) -> float:
        ...         return float(tensor.numel())
        >>> NumelCostModel().cost(torch.empty(3, 4, device="meta"))
        12.0
    """

    @abstractmethod
    def cost(self, tensor: torch.Tensor) -> float:
        """The non-negative cost of owning ``tensor``."""


@dataclass
class PolynomialComputationalCostModel(CostModel):
    """Compute cost: ``sum over dims d of max(min_cost, polyval(d, coefficients))``.

    ``coefficients`` are in increasing degree (numpy's ``polynomial.polyval`` convention), so the
    default ``(0, 0, 0, 1)`` is ``sum(d**3)``: the cost of a root-inverse or eigendecomposition
    of each ``d x d`` Shampoo factor matrix. The floor applies per dim, as in the reference
    library: each factor matrix costs at least ``min_cost`` (a kernel launch). A 0-D tensor has
    no dims (no factor matrices) and costs 0.

    Fields:
        coefficients: non-empty tuple of finite floats.
        min_cost: finite, ``>= 0``; the floor of the cost of every dim.

    Example:
        >>> model = PolynomialComputationalCostModel(coefficients=(1.0, 0.1, 0.01), min_cost=10.0)
        >>> model.cost(torch.empty(100, 200, device="meta"))
        532.0
    """

    coefficients: tuple[float, ...] = (0.0, 0.0, 0.0, 1.0)
    min_cost: float = 0.0

    def __post_init__(self) -> None:
        self.coefficients = tuple(float(c) for c in self.coefficients)
        if not self.coefficients or not all(math.isfinite(c) for c in self.coefficients):
            raise ValueError(
                "PolynomialComputationalCostModel.coefficients must be a non-empty tuple of finite "
                f"floats, got {self.coefficients!r}"
            )
        check_float("PolynomialComputationalCostModel.min_cost", self.min_cost, at_least=0.0)

    def cost(self, tensor: torch.Tensor) -> float:
        return sum(
            (max(self.min_cost, float(polynomial.polyval(dim, self.coefficients)))
             for dim in tensor.shape),
            0.0,
        )  # fmt: skip


@dataclass
class AlignedMemoryCostModel(CostModel):
    """Memory cost: the tensor's bytes rounded up to a multiple of ``alignment_bytes``.

    The result is an int number of bytes (also usable as a buffer size).

    Fields:
        alignment_bytes: int ``>= 1`` (default 64, a cache line).

    Example:
        >>> AlignedMemoryCostModel(alignment_bytes=64).cost(torch.empty(10, dtype=torch.float32))
        64
    """

    alignment_bytes: int = 64

    def __post_init__(self) -> None:
        check_int("AlignedMemoryCostModel.alignment_bytes", self.alignment_bytes, at_least=1)

    def cost(self, tensor: torch.Tensor) -> int:
        size = tensor.numel() * tensor.element_size()
        return -(-size // self.alignment_bytes) * self.alignment_bytes


# The memory model that buffer sizes are aligned by, and the default load measure.
DefaultCostModel = AlignedMemoryCostModel()


@dataclass(kw_only=True)
class LoadBalancingConfig:
    """How ``shampoo_utils.distribute_buffer_sizes`` weighs blocks when spreading them over ranks.

    Keyword-only, as in the reference library (which defines it in ``shampoo_types``).

    Fields:
        cost_model: a :class:`CostModel` instance; default ``DefaultCostModel`` (balance aligned
            bytes). ``PolynomialComputationalCostModel()`` balances the cubic cost of the roots.

    Example:
        >>> LoadBalancingConfig(cost_model=PolynomialComputationalCostModel()).cost_model.min_cost
        0.0
    """

    cost_model: CostModel = field(default_factory=lambda: DefaultCostModel)

    def __post_init__(self) -> None:
        if not isinstance(self.cost_model, CostModel):
            raise ValueError(
                "LoadBalancingConfig.cost_model must be a CostModel instance, "
                f"got {type(self.cost_model).__name__}"
            )
