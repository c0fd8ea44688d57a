"""How a step's filtered gradient is made from its gradients, as the preconditioner is told.

``GroupRuntime._filtered_grads`` keeps ``M_t = M_(t-1) + (1 - beta1) (G_t - M_(t-1))`` and gives
the preconditioner ``M_t`` (or ``M_t / (1 - beta1^t)`` with bias correction). A preconditioner
that rotates its input (SOAP) can then update the rotated input linearly
(:class:`~nanoshampoo.optim.shampoo.preconditioner.preconditioner.FilteredInput`).

Example:
    >>> from types import SimpleNamespace
    >>> h = SimpleNamespace(  # the fields it reads of a Hyperparameters
    ...     beta1=0.9, beta3=0.9, momentum_dtype=None, use_bias_correction=True)
    >>> round(filtered_input(h, 2).divisor, 6)
    0.19
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanoshampoo.optim.shampoo.preconditioner.preconditioner import FilteredInput

if TYPE_CHECKING:
    from nanoshampoo.optim.shampoo.group_validation import Hyperparameters


def filtered_input(hyperparameters: Hyperparameters, t: int) -> FilteredInput | None:
    """The :class:`FilteredInput` of step ``t`` under ``hyperparameters`` (a group's
    ``Hyperparameters``): None where the input is not one running average kept in the
    computation dtype (``beta3 != beta1``: a different average; ``momentum_dtype`` set: ``M``
    is rounded into narrower storage every step)."""
    h = hyperparameters
    if h.beta1 == 0.0:
        return FilteredInput(beta=0.0)
    if h.beta3 != h.beta1 or h.momentum_dtype is not None:
        return None
    return FilteredInput(beta=h.beta1, divisor=bias_correction_divisor(h, t))


def bias_correction_divisor(hyperparameters: Hyperparameters, t: int) -> float:
    """What the filtered gradient of step ``t`` is divided by: ``1 - beta3 beta1^(t-1)`` with
    bias correction (``1 - beta1^t`` when ``beta3 == beta1``), else 1."""
    h = hyperparameters
    return 1.0 - h.beta3 * h.beta1 ** (t - 1) if h.use_bias_correction else 1.0
