"""A bool is not a number: the checks of a target, a confidence and a timeout refuse True."""

from __future__ import annotations

import pytest

from nanoshampoo.errors import UserError
from nanoshampoo.evidence.stats import check_confidence, check_target
from nanoshampoo.train.preflight import check_dist_timeout


@pytest.mark.parametrize(
    "check, good",
    [
        (lambda v: check_target("--target", v), 3.28),
        (lambda v: check_confidence("--confidence", v), 0.95),
        (check_dist_timeout, 600.0),
    ],
)
def test_true_is_refused_where_a_number_is_taken(check, good: float) -> None:  # type: ignore[no-untyped-def]
    check(good)
    with pytest.raises(UserError):
        check(True)
