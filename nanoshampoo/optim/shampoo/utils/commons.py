"""Small generic helpers: finding concrete subclasses, batching an iterable, and the error
types that let a script written for the reference Distributed Shampoo catch what it catches
there."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any, TypeVar

from nanoshampoo.validation import check_int

T = TypeVar("T")


class InvalidArgumentError(ValueError, AssertionError):
    """A bad argument to a shape or state tool: a ``ValueError`` that is also an ``AssertionError``.

    The reference library checks these arguments with ``assert``; raising this type keeps our
    message (which names the argument) while ``except AssertionError`` in a ported script still
    catches it.

    Example:
        >>> try:
        ...     raise InvalidArgumentError("compress_list: lengths differ")
        ... except AssertionError as error:
        ...     print(type(error).__name__, isinstance(error, ValueError))
        InvalidArgumentError True
    """


def check_argument(rule: Callable[..., T], label: str, value: Any, **bounds: Any) -> T:
    """``rule(label, value, **bounds)``, a :mod:`nanoshampoo.validation` check, raising
    :class:`InvalidArgumentError` (the same message) instead of its ``ValueError``."""
    try:
        return rule(label, value, **bounds)
    except ValueError as err:
        raise InvalidArgumentError(str(err)) from None


class InvalidStateError(RuntimeError, AssertionError):
    """A call in the wrong lifecycle state: a ``RuntimeError`` that is also an ``AssertionError``.

    Raised, for example, when a quantized list's dequantized cache is read before it exists,
    where the reference library asserts.
    """


def get_all_non_abstract_subclasses(cls: type[T]) -> Iterator[type[T]]:
    """Yield ``cls`` itself when it is concrete, then every concrete subclass, recursively.

    A class is abstract when its ``__abstractmethods__`` is non-empty; abstract classes are
    skipped but their subclasses are still visited. Each class is yielded once, even when it is
    reachable through several parents (diamond inheritance), in depth-first order of definition
    starting from ``cls``.

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
        >>> [c.__name__ for c in get_all_non_abstract_subclasses(Leaf)]
        ['Leaf']
    """
    seen: set[type] = set()
    stack: list[type] = [cls]
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
    try:
        check_int("n", n, at_least=1)
    except ValueError as err:
        # itertools.batched's own words first, so a message match written for it still holds.
        raise ValueError(f"batched: {n=} must be at least one ({err})") from None
    return _batched(iter(iterable), n)


def _batched(iterator: Iterator[T], n: int) -> Iterator[tuple[T, ...]]:
    while batch := tuple(islice(iterator, n)):
        yield batch
