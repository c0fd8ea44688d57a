import itertools
from abc import ABC, abstractmethod

import pytest

from nanoshampoo.optim.shampoo.utils.commons import (
    InvalidArgumentError,
    InvalidStateError,
    batched,
    get_all_non_abstract_subclasses,
)


class _Root(ABC):
    @abstractmethod
    def run(self) -> None: ...


class _Leaf1(_Root):
    def run(self) -> None: ...


class _AbstractMid(_Root):
    @abstractmethod
    def extra(self) -> None: ...


class _GrandChild(_AbstractMid):
    def run(self) -> None: ...

    def extra(self) -> None: ...


class _Other(_Root):
    def run(self) -> None: ...


class _Diamond(_Leaf1, _Other):
    """Reachable through two parents: must be reported once."""


class _GreatGrandChild(_GrandChild):
    pass


def test_get_all_non_abstract_subclasses_recurses_and_deduplicates() -> None:
    found = list(get_all_non_abstract_subclasses(_Root))
    assert len(found) == len(set(found))
    assert set(found) == {_Leaf1, _GrandChild, _Other, _Diamond, _GreatGrandChild}


def test_get_all_non_abstract_subclasses_includes_cls_when_concrete() -> None:
    # As the reference library: a concrete class is among its own non-abstract subclasses.
    assert list(get_all_non_abstract_subclasses(_Leaf1)) == [_Leaf1, _Diamond]
    assert list(get_all_non_abstract_subclasses(_GreatGrandChild)) == [_GreatGrandChild]
    assert list(get_all_non_abstract_subclasses(_AbstractMid)) == [_GrandChild, _GreatGrandChild]
    assert _Root not in set(get_all_non_abstract_subclasses(_Root))


@pytest.mark.parametrize(
    ("data", "n", "expected"),
    [
        (range(10), 3, [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9,)]),
        (range(6), 3, [(0, 1, 2), (3, 4, 5)]),
        ([], 2, []),
        ("ab", 5, [("a", "b")]),
        (range(3), 1, [(0,), (1,), (2,)]),
    ],
)
def test_batched_examples(data: object, n: int, expected: list[tuple]) -> None:
    assert list(batched(data, n)) == expected


@pytest.mark.parametrize("length", [0, 1, 7, 12])
@pytest.mark.parametrize("n", [1, 2, 5])
def test_batched_matches_reference(length: int, n: int) -> None:
    items = list(range(length))
    reference = [tuple(items[i : i + n]) for i in range(0, length, n)]
    assert list(batched(iter(items), n)) == reference
    assert list(itertools.chain.from_iterable(batched(items, n))) == items


@pytest.mark.parametrize("n", [0, -1, 2.0, True])
def test_batched_rejects_bad_n_at_call_time(n: object) -> None:
    with pytest.raises(ValueError, match=rf"n={n!r} must be at least one \(n must be an int >= 1"):
        batched(range(3), n)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("error_type", "also"), [(InvalidArgumentError, ValueError), (InvalidStateError, RuntimeError)]
)
def test_compat_errors_are_caught_as_assertion_errors(
    error_type: type[Exception], also: type[Exception]
) -> None:
    for caught in (AssertionError, also):
        with pytest.raises(caught, match="the message"):
            raise error_type("the message")
