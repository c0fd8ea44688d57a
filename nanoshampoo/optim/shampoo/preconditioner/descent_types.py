"""Configs of the stateless descent preconditioners: spectral descent (Muon) and sign descent
(signSGD, Lion). Each validates its fields in ``__post_init__`` (``ValueError`` naming the field).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanoshampoo.optim.shampoo.preconditioner.matrix_functions_types import (
    NewtonSchulzOrthogonalizationConfig,
    OrthogonalizationConfig,
)
from nanoshampoo.optim.shampoo.preconditioner.preconditioner_types import (
    PreconditionerConfig,
)

# ---------------------------------------------------------------------------------------------
# Spectral descent (Muon)
# ---------------------------------------------------------------------------------------------


@dataclass
class SpectralDescentPreconditionerConfig(PreconditionerConfig):
    """Spectral descent (Muon): the search direction of a 2-D block is ``orth(Gbar) ~ U V^T``.

    For blocks of >= 2 dims: a ``(d0, d1, ..., dk)`` block is orthogonalized as the
    ``(d0, d1 * ... * dk)`` matrix (as the reference library's merge to 2 dims does). A vector
    block (choose ``max_preconditioner_dim``, or put vectors in another param group) makes the
    optimizer raise ``ValueError`` naming ``preconditioner_config``. Stateless.

    Args:
        orthogonalization_config: ``NewtonSchulzOrthogonalizationConfig`` (default) or
            ``SVDOrthogonalizationConfig``.
    """

    orthogonalization_config: OrthogonalizationConfig = field(
        default_factory=NewtonSchulzOrthogonalizationConfig
    )

    def __post_init__(self) -> None:
        if not isinstance(self.orthogonalization_config, OrthogonalizationConfig):
            raise ValueError(
                "orthogonalization_config must be a NewtonSchulzOrthogonalizationConfig or "
                f"SVDOrthogonalizationConfig, got {self.orthogonalization_config!r}"
            )


DefaultSpectralDescentPreconditionerConfig = SpectralDescentPreconditionerConfig()


# ---------------------------------------------------------------------------------------------
# Sign descent (signSGD, Lion)
# ---------------------------------------------------------------------------------------------


def unit_scale(grad: torch.Tensor) -> float:
    """The default ``scale_fn`` of sign descent: every block's step is ``sign(Gbar)``.

    A module-level function, not a lambda, so that configs pickle (checkpoints, spawned ranks).
    """
    return 1.0


@dataclass(kw_only=True)
class SignDescentPreconditionerConfig(PreconditionerConfig):
    """Sign descent: the search direction of a block is ``sign(Gbar) * scale_fn(Gbar)``.

    ``Gbar`` is the block's filtered gradient (``betas[0]``, ``beta3``), so ``betas=(b2, ...)``
    with ``beta3=b1`` and ``use_bias_correction=False`` is Lion. Stateless: ``betas[1]`` and
    ``epsilon`` have no effect, and ``precondition_frequency`` is taken as 1 (as a group with
    ``start_preconditioning_step=-1`` then starts at step 1).

    Args:
        scale_fn: ``block -> float or tensor`` (broadcast against the block), called once per
            block and step; e.g. ``lambda g: g.abs().sum()`` is steepest descent under the
            L-infinity norm. Prefer a named function: lambdas do not pickle.
    """

    scale_fn: Callable[[torch.Tensor], float | torch.Tensor] = unit_scale

    def __post_init__(self) -> None:
        if not callable(self.scale_fn):
            raise ValueError(
                f"scale_fn must be callable (block -> float or tensor), got {self.scale_fn!r}"
            )


DefaultSignDescentPreconditionerConfig = SignDescentPreconditionerConfig()
