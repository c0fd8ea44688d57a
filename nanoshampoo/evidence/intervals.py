"""Set operations on unions of half-open time intervals ``[start, end)``, vectorized in numpy.

An interval set is a float64 array of shape ``(N, 2)`` (columns start, end). :func:`merge`
returns the canonical form: sorted, disjoint, non-empty intervals. All other functions accept
any interval set and return canonical ones, so nested and overlapping events are counted once
(the union), never summed.

Example:
    >>> a = merge([(0, 10), (2, 3), (8, 12)])
    >>> a.tolist()
    [[0.0, 12.0]]
    >>> total(intersection(a, [(5, 20)]))
    7.0
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

IntervalsLike = np.ndarray | Sequence[tuple[float, float]]


def as_intervals(intervals: IntervalsLike) -> np.ndarray:
    """``intervals`` as a float64 ``(N, 2)`` array; raises ``ValueError`` on a bad shape."""
    if len(intervals) == 0:
        return np.empty((0, 2))
    array = np.asarray(intervals, dtype=np.float64)
    if array.ndim != 2 or array.shape[1] != 2:
        raise ValueError(f"intervals: expected shape (N, 2), got {array.shape}")
    if np.any(array[:, 1] < array[:, 0]):
        raise ValueError("intervals: an interval ends before it starts")
    return array


def merge(intervals: IntervalsLike) -> np.ndarray:
    """The union of ``intervals`` as sorted disjoint intervals (empty ones dropped)."""
    array = as_intervals(intervals)
    array = array[array[:, 1] > array[:, 0]]
    if array.shape[0] == 0:
        return np.empty((0, 2))
    array = array[np.argsort(array[:, 0], kind="stable")]
    reach = np.maximum.accumulate(array[:, 1])  # furthest end seen so far
    # A new disjoint piece starts where an interval begins after everything before it ended.
    starts = np.concatenate(([0], np.nonzero(array[1:, 0] > reach[:-1])[0] + 1))
    ends = np.concatenate((starts[1:] - 1, [array.shape[0] - 1]))
    return np.stack((array[starts, 0], reach[ends]), axis=1)


def total(intervals: IntervalsLike) -> float:
    """Length of the union of ``intervals``."""
    merged = merge(intervals)
    return float(np.sum(merged[:, 1] - merged[:, 0]))


def intersection(a: IntervalsLike, b: IntervalsLike) -> np.ndarray:
    """Times covered by both ``a`` and ``b``."""
    return _combine(merge(a), merge(b), keep_b=True)


def difference(a: IntervalsLike, b: IntervalsLike) -> np.ndarray:
    """Times covered by ``a`` but not by ``b``."""
    return _combine(merge(a), merge(b), keep_b=False)


def _covered(merged: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Boolean mask: which ``points`` lie inside the canonical interval set ``merged``."""
    if merged.shape[0] == 0:
        return np.zeros(points.shape, dtype=bool)
    index = np.searchsorted(merged[:, 0], points, side="right") - 1
    inside = index >= 0
    inside[inside] = points[inside] < merged[index[inside], 1]
    return inside


def _combine(a: np.ndarray, b: np.ndarray, keep_b: bool) -> np.ndarray:
    """Cut time at every endpoint of ``a`` and ``b``; keep segments in ``a`` and (not) in ``b``."""
    if a.shape[0] == 0:
        return np.empty((0, 2))
    cuts = np.unique(np.concatenate((a.ravel(), b.ravel())))
    segments = np.stack((cuts[:-1], cuts[1:]), axis=1)
    middles = segments.mean(axis=1)
    keep = _covered(a, middles) & (_covered(b, middles) == keep_b)
    return merge(segments[keep])
