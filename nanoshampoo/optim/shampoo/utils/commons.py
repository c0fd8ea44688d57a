"""Small generic helpers: finding concrete subclasses and batching an iterable."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice
from typing import TypeVar

T = TypeVar("T")


def get_all_non_abstract_subclasses(cls: type[T]) -> Iterator[type[T]]:
    """Yield every concrete subclass of ``cls``, recursively (children, grandchildren, ...).

    ``cls`` itself is not yielded. A class is abstract when its ``__abstractmethods__`` is
    non-empty; abstract classes are skipped but their subclasses are still visited. Each class is
    yielded once, even when it is reachable through several parents (diamond inheritance), in
    depth-first order of definition.

    Example:
        >>> from abc import ABC, abstractmethod
        >>> class Base(ABC):
        ...     @abstractmethod
        ...     def f(self) -> None: ...
        >>> class Mid(Base): pass            # still abstract
        >>> class Leaf(Mid):
        ...     def f(self) -> None: ...
        >>> [c.__name__ for c in get_all_non_abstract_subclasses(Base)]
        ['Leaf']
    """
    seen: set[type] = set()
    stack = list(reversed(cls.__subclasses__()))
    while stack:
        sub = stack.pop()
        if sub in seen:
            continue
        seen.add(sub)
        if not getattr(sub, "__abstractmethods__", frozenset()):
            yield sub
        stack.extend(reversed(sub.__subclasses__()))


def batched(iterable: Iterable[T], n: int) -> Iterator[tuple[T, ...]]:
    """Yield consecutive tuples of ``n`` items; the last tuple may be shorter.

    Same behaviour as Python 3.12's ``itertools.batched`` (which this project cannot assume on
    Python 3.11). ``n`` must be an int ``>= 1``; anything else raises ``ValueError`` at call time.

    Example:
        >>> list(batched(range(10), 3))
        [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9,)]
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"batched: n must be an int >= 1, got {n!r}")
    return _batched(iter(iterable), n)


def _batched(iterator: Iterator[T], n: int) -> Iterator[tuple[T, ...]]:
    while batch := tuple(islice(iterator, n)):
        yield batch
