import math

import pytest
import torch
from torch import nn

from nanoshampoo.optim.shampoo.utils.shampoo_model_utils import CombinedLinear


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("in_features", "out_features"), [(7, 5), (1, 1), (16, 3)])
def test_same_outputs_and_gradients_as_nn_linear(
    in_features: int, out_features: int, bias: bool
) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias, dtype=torch.float64)
    combined = CombinedLinear.from_linear(linear)
    x = torch.randn(4, 3, in_features, dtype=torch.float64)
    out_linear, out_combined = linear(x), combined(x)
    assert out_combined.shape == (4, 3, out_features)
    torch.testing.assert_close(out_combined, out_linear, rtol=0, atol=1e-12)
    out_linear.square().sum().backward()
    out_combined.square().sum().backward()
    expected_grad = linear.weight.grad
    if bias:
        expected_grad = torch.cat([expected_grad, linear.bias.grad[:, None]], dim=1)
    torch.testing.assert_close(combined.combined_weight.grad, expected_grad, rtol=0, atol=1e-10)


@pytest.mark.parametrize("bias", [True, False])
def test_parameter_layout_and_views(bias: bool) -> None:
    layer = CombinedLinear(6, 4, bias=bias)
    assert [name for name, _ in layer.named_parameters()] == ["combined_weight"]
    assert layer.combined_weight.shape == (4, 6 + int(bias))
    assert layer.weight.shape == (4, 6)
    assert layer.weight.data_ptr() == layer.combined_weight.data_ptr()
    assert layer.bias is bias  # a flag, as in the reference library
    assert layer.in_features_with_bias == 6 + int(bias)


@pytest.mark.parametrize("bias", [True, False])
def test_init_draws_the_same_values_as_nn_linear(bias: bool) -> None:
    torch.manual_seed(123)
    linear = nn.Linear(10, 3, bias=bias)
    torch.manual_seed(123)
    layer = CombinedLinear(10, 3, bias=bias)
    assert torch.equal(layer.weight, linear.weight)
    if bias:
        assert torch.equal(layer.combined_weight[:, -1], linear.bias)
    bound = 1 / math.sqrt(10)
    assert layer.combined_weight.abs().max() <= bound


def test_zero_sized_layers_work() -> None:
    layer = CombinedLinear(0, 3)
    assert torch.equal(layer(torch.randn(2, 0)), torch.zeros(2, 3))
    assert CombinedLinear(4, 0)(torch.randn(2, 4)).shape == (2, 0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"in_features": -1}, "in_features"), ({"out_features": 2.0}, "out_features")],
)
def test_rejects_bad_sizes(kwargs: dict, field: str) -> None:
    arguments = {"in_features": 2, "out_features": 2, **kwargs}
    with pytest.raises(ValueError, match=rf"CombinedLinear.{field} must be an int >= 0"):
        CombinedLinear(**arguments)


@pytest.mark.parametrize(("bias", "with_bias"), [(True, 4), (False, 3)])
def test_repr_and_dtype(bias: bool, with_bias: int) -> None:
    layer = CombinedLinear(3, 2, bias=bias, dtype=torch.bfloat16)
    assert layer.combined_weight.dtype == torch.bfloat16
    assert layer.extra_repr() == (
        f"self.in_features=3, self.out_features=2, self.in_features_with_bias={with_bias}"
    )
    assert layer.extra_repr() in repr(layer)
