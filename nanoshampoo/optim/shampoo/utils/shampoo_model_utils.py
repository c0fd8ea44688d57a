"""Model layers shaped for structure-aware optimizers such as Shampoo."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nanoshampoo.validation import check_int


class CombinedLinear(nn.Module):
    """``nn.Linear`` with weight and bias stored in ONE parameter, ``combined_weight``.

    ``combined_weight`` has shape ``(out_features, in_features + 1)`` with the bias as the last
    column (``(out_features, in_features)`` when ``bias=False``), so Shampoo builds one pair of
    factor matrices over ``[W | b]`` and preconditions the bias together with the weight.

    Initialization draws the same values as ``nn.Linear`` under the same RNG state: weight
    kaiming-uniform with ``a=sqrt(5)``, i.e. ``U(-1/sqrt(in), 1/sqrt(in))``, then bias
    ``U(-1/sqrt(in), 1/sqrt(in))``. The forward pass is
    ``F.linear(x, combined_weight[:, :-1], combined_weight[:, -1])``.

    Args:
        in_features: int ``>= 0``, size of the last input dim.
        out_features: int ``>= 0``.
        bias: whether the layer has a bias column.
        device, dtype: of the parameter.

    Attributes (as in the reference library):
        bias: the ``bias`` flag, a bool (the bias values are ``combined_weight[:, -1]``).
        in_features_with_bias: ``in_features + 1`` with a bias, else ``in_features``.

    Shapes: input ``(*, in_features)`` -> output ``(*, out_features)``.

    Example:
        >>> layer = CombinedLinear(256, 128)
        >>> layer(torch.randn(32, 256)).shape, layer.combined_weight.shape
        (torch.Size([32, 128]), torch.Size([128, 257]))
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            check_int(f"CombinedLinear.{name}", value, at_least=0)
        self.in_features = in_features
        self.out_features = out_features
        self.bias = bias
        self.in_features_with_bias = in_features + int(bias)
        self.combined_weight = nn.Parameter(
            torch.empty(out_features, self.in_features_with_bias, device=device, dtype=dtype)
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw the parameter exactly as ``nn.Linear.reset_parameters`` would (same RNG use)."""
        weight = torch.empty(
            self.out_features, self.in_features,
            device=self.combined_weight.device, dtype=self.combined_weight.dtype,
        )  # fmt: skip
        if weight.numel() > 0:  # kaiming init of an empty tensor only warns, like nn.Linear
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        with torch.no_grad():
            self.combined_weight[:, : self.in_features].copy_(weight)
            if self.bias:
                bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
                nn.init.uniform_(self.combined_weight[:, -1], -bound, bound)

    @property
    def weight(self) -> torch.Tensor:
        """View of the weight columns, ``(out_features, in_features)``."""
        return self.combined_weight[:, : self.in_features]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> CombinedLinear:
        """A ``CombinedLinear`` computing exactly what ``linear`` computes (parameters copied)."""
        layer = cls(
            linear.in_features, linear.out_features, bias=linear.bias is not None,
            device=linear.weight.device, dtype=linear.weight.dtype,
        )  # fmt: skip
        with torch.no_grad():
            layer.combined_weight[:, : linear.in_features].copy_(linear.weight)
            if linear.bias is not None:
                layer.combined_weight[:, -1].copy_(linear.bias)
        return layer

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        bias = self.combined_weight[:, -1] if self.bias else None
        return F.linear(input, self.weight, bias)

    def extra_repr(self) -> str:
        # The reference library's exact text (self-documenting f-string names).
        return (
            f"self.in_features={self.in_features}, self.out_features={self.out_features}, "
            f"self.in_features_with_bias={self.in_features_with_bias}"
        )
