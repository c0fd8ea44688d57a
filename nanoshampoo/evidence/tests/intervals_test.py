"""Interval unions: compared with a brute-force coverage count on a fine grid."""

from __future__ import annotations

import numpy as np
import pytest

from nanoshampoo.evidence.intervals import difference, intersection, merge, total


def _covered(intervals: list[tuple[float, float]], grid: np.ndarray) -> np.ndarray:
    mask = np.zeros(grid.shape, dtype=bool)
    for start, end in intervals:
        mask |= (grid >= start) & (grid < end)
    return mask


def test_merge_unites_nested_and_overlapping() -> None:
    assert merge([(5, 6), (0, 10), (2, 3), (9, 12), (20, 21), (21, 22)]).tolist() == [
        [0, 12],
        [20, 22],
    ]
    assert merge([]).shape == (0, 2)
    assert merge([(3, 3)]).shape == (0, 2)


def test_operations_match_brute_force() -> None:
    rng = np.random.default_rng(0)
    starts_a, starts_b = rng.integers(0, 90, 15), rng.integers(0, 90, 15)
    a = [(float(s), float(s + rng.integers(1, 10))) for s in starts_a]
    b = [(float(s), float(s + rng.integers(1, 10))) for s in starts_b]
    grid = np.arange(0, 100, 0.5) + 0.25  # integer endpoints: half-step cells are uniform
    in_a, in_b = _covered(a, grid), _covered(b, grid)
    assert total(a) == pytest.approx(0.5 * in_a.sum())
    assert total(intersection(a, b)) == pytest.approx(0.5 * (in_a & in_b).sum())
    assert total(difference(a, b)) == pytest.approx(0.5 * (in_a & ~in_b).sum())


def test_bad_intervals_raise() -> None:
    with pytest.raises(ValueError, match="ends before"):
        merge([(2, 1)])
