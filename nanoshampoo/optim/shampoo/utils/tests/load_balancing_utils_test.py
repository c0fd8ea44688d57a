import math

import pytest
import torch

from nanoshampoo.optim.shampoo.utils.commons import get_all_non_abstract_subclasses
from nanoshampoo.optim.shampoo.utils.load_balancing_utils import (
    AlignedMemoryCostModel,
    CostModel,
    DefaultCostModel,
    LoadBalancingConfig,
    PolynomialComputationalCostModel,
)


def test_cost_model_is_abstract_and_concrete_models_are_found() -> None:
    with pytest.raises(TypeError, match="abstract"):
        CostModel()
    found = set(get_all_non_abstract_subclasses(CostModel))
    assert {PolynomialComputationalCostModel, AlignedMemoryCostModel} <= found


@pytest.mark.parametrize("shape", [(100, 200), (7,), (), (3, 0, 5), (1, 1)], ids=str)
@pytest.mark.parametrize(
    ("coefficients", "min_cost"),
    [((1.0, 0.1, 0.01), 10.0), ((0.0, 0.0, 0.0, 1.0), 0.0), ((2.0,), 0.0), ((0.0, 1.0), 5.0)],
)
def test_polynomial_cost_matches_hand_computation(
    shape: tuple[int, ...], coefficients: tuple[float, ...], min_cost: float
) -> None:
    model = PolynomialComputationalCostModel(coefficients=coefficients, min_cost=min_cost)
    # The floor applies to each dim's cost, not to the total (0-D: no dims, cost 0).
    by_hand = sum(max(min_cost, sum(c * d**k for k, c in enumerate(coefficients))) for d in shape)
    assert model.cost(torch.empty(shape, device="meta")) == pytest.approx(by_hand)


def test_polynomial_cost_floors_each_dim() -> None:
    model = PolynomialComputationalCostModel(coefficients=(0.0, 1.0), min_cost=5.0)
    assert model.cost(torch.empty(2, 3, 7)) == 5.0 + 5.0 + 7.0
    assert model.cost(torch.empty(())) == 0.0


def test_polynomial_cost_article_example_and_default_is_cubic() -> None:
    model = PolynomialComputationalCostModel(coefficients=(1.0, 0.1, 0.01), min_cost=10.0)
    assert model.cost(torch.empty(100, 200)) == pytest.approx(111.0 + 421.0)
    assert PolynomialComputationalCostModel().cost(torch.empty(4, 3)) == 64 + 27


@pytest.mark.parametrize(("dim", "expected"), [(3, 1.0 + 2.0 * 3 + 0.5 * 9), (1, 3.5), (0, 1.0)])
def test_polynomial_coefficients_are_in_increasing_degree(dim: int, expected: float) -> None:
    # (1, 2, 0.5) is 1 + 2 d + 0.5 d^2; read in decreasing degree it would be d^2 + 2 d + 0.5.
    model = PolynomialComputationalCostModel(coefficients=(1.0, 2.0, 0.5))
    assert model.cost(torch.empty(dim, device="meta")) == expected


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"coefficients": ()}, "coefficients"),
        ({"coefficients": (1.0, math.nan)}, "coefficients"),
        ({"min_cost": -1.0}, "min_cost"),
        ({"min_cost": math.inf}, "min_cost"),
    ],
)
def test_polynomial_cost_model_rejects_bad_fields(bad: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"PolynomialComputationalCostModel.{field} must be"):
        PolynomialComputationalCostModel(**bad)


@pytest.mark.parametrize(
    ("numel", "dtype", "alignment", "expected"),
    [
        (10, torch.float32, 64, 64),
        (16, torch.float32, 64, 64),
        (17, torch.float32, 64, 128),
        (0, torch.float32, 64, 0),
        (3, torch.bfloat16, 4, 8),
        (100 * 100, torch.float32, 64, 40000),
        (5, torch.uint8, 1, 5),
    ],
)
def test_aligned_memory_cost(numel: int, dtype: torch.dtype, alignment: int, expected: int) -> None:
    model = AlignedMemoryCostModel(alignment_bytes=alignment)
    assert model.cost(torch.empty(numel, dtype=dtype, device="meta")) == expected
    assert model.cost(torch.empty(numel, dtype=dtype, device="meta")) % alignment == 0


@pytest.mark.parametrize("alignment", [0, -64, 1.5, True])
def test_aligned_memory_cost_model_rejects_bad_alignment(alignment: object) -> None:
    with pytest.raises(
        ValueError, match=r"AlignedMemoryCostModel.alignment_bytes must be an int >= 1"
    ):
        AlignedMemoryCostModel(alignment_bytes=alignment)  # type: ignore[arg-type]


def test_default_cost_model_and_load_balancing_config() -> None:
    assert DefaultCostModel == AlignedMemoryCostModel(alignment_bytes=64)
    assert LoadBalancingConfig().cost_model is DefaultCostModel
    with pytest.raises(TypeError, match="positional"):
        LoadBalancingConfig(DefaultCostModel)  # type: ignore[misc]  # keyword-only
    with pytest.raises(ValueError, match=r"LoadBalancingConfig.cost_model must be a CostModel"):
        LoadBalancingConfig(cost_model="memory")  # type: ignore[arg-type]
