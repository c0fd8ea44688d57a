"""Errors shared by the optimizers (DistributedShampoo and DistAdam).

Kept apart from either optimizer so that importing one does not import the other.
"""

from __future__ import annotations


class NonFiniteGradientError(RuntimeError):
    """A gradient given to an optimizer's ``step`` holds NaN or Inf.

    Raised before any parameter or optimizer state is modified, so the caller may skip the batch
    and continue (e.g. after lowering a loss scale).
    """
