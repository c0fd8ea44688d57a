"""Lock-step iteration over a dict of iterators, with a clear error on mismatched lengths."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Generic, TypeVar

V = TypeVar("V")


class DictZipIterator(Generic[V]):
    """Iterate several iterables together, yielding ``{key: next value of that key's iterable}``.

    Every step yields a dict with the same keys (in the input's order). Iteration stops when all
    iterables are exhausted at the same step; an empty input dict yields nothing. When only some
    are exhausted the lengths differ, which is a bug in the caller, so ``ValueError`` is raised
    naming the exhausted keys and the still-active keys.

    Args:
        data: ``{name: iterable}``; each iterable is consumed once (``iter()`` is called on it).

    Example:
        >>> it = DictZipIterator({"grad": [1, 2], "param": [10, 20]})
        >>> list(it)
        [{'grad': 1, 'param': 10}, {'grad': 2, 'param': 20}]
        >>> list(DictZipIterator({"a": [1], "b": [1, 2]}))
        Traceback (most recent call last):
        ...
        ValueError: DictZipIterator: Iterators have different lengths. Exhausted: ['a']. ...
    """

    def __init__(self, data: Mapping[str, Iterable[V]]) -> None:
        self._iterators: dict[str, Iterator[V]] = {
            key: iter(values) for key, values in data.items()
        }

    def __iter__(self) -> DictZipIterator[V]:
        return self

    def __next__(self) -> dict[str, V]:
        if not self._iterators:
            raise StopIteration
        step: dict[str, V] = {}
        exhausted: list[str] = []
        for key, iterator in self._iterators.items():
            try:
                step[key] = next(iterator)
            except StopIteration:
                exhausted.append(key)
        if not exhausted:
            return step
        if len(exhausted) == len(self._iterators):
            raise StopIteration
        raise ValueError(
            "DictZipIterator: Iterators have different lengths. "
            f"Exhausted: {exhausted}. Still active: {list(step)}"
        )
