"""Item-by-item operators: ``map``, ``filter``, ``scan``, ``subsample``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streamwatch._pipeline import Emit, Node, Operator
from streamwatch.ops._checks import check_callable, describe, positive_int

__all__ = ["Filter", "Map", "Scan", "Subsample", "filter", "map", "scan", "subsample"]


# -- map ---------------------------------------------------------------------------------------------


class MapNode(Node):
    __slots__ = ("fn",)

    def __init__(self, emit: Emit, fn: Callable[[Any], Any]) -> None:
        super().__init__(emit)
        self.fn = fn

    def push(self, item: Any) -> None:
        self.emit(self.fn(item))


@dataclass(frozen=True, slots=True, repr=False)
class Map(Operator):
    """Apply ``fn`` to every item. See :func:`map`."""

    fn: Callable[[Any], Any]

    def open(self, emit: Emit) -> MapNode:
        return MapNode(emit, self.fn)

    def __repr__(self) -> str:
        return f"<map {describe(self.fn)}>"


def map(fn: Callable[[Any], Any]) -> Map:
    """Emit ``fn(item)`` for every item.

    Args:
        fn: called once per item, on the worker thread.

    Example:
        >>> import streamwatch as sw
        >>> from streamwatch import ops
        >>> out = sw.sinks.collect()
        >>> (sw.source() | ops.map(abs) | out).run([-1, 2, -3])
        >>> out.items
        [1, 2, 3]
    """
    check_callable("fn", fn)
    return Map(fn)


# -- filter ------------------------------------------------------------------------------------------


class FilterNode(Node):
    __slots__ = ("pred",)

    def __init__(self, emit: Emit, pred: Callable[[Any], object]) -> None:
        super().__init__(emit)
        self.pred = pred

    def push(self, item: Any) -> None:
        if self.pred(item):
            self.emit(item)


@dataclass(frozen=True, slots=True, repr=False)
class Filter(Operator):
    """Keep the items ``pred`` accepts. See :func:`filter`."""

    pred: Callable[[Any], object]

    def open(self, emit: Emit) -> FilterNode:
        return FilterNode(emit, self.pred)

    def __repr__(self) -> str:
        return f"<filter {describe(self.pred)}>"


def filter(pred: Callable[[Any], object]) -> Filter:
    """Emit the items for which ``pred(item)`` is truthy; drop the others.

    Example:
        >>> import streamwatch as sw
        >>> from streamwatch import ops
        >>> out = sw.sinks.collect()
        >>> (sw.source() | ops.filter(lambda x: x > 1) | out).run([3, 1, 2])
        >>> out.items
        [3, 2]
    """
    check_callable("pred", pred)
    return Filter(pred)


# -- scan --------------------------------------------------------------------------------------------


class ScanNode(Node):
    __slots__ = ("fn", "state")

    def __init__(self, emit: Emit, fn: Callable[[Any, Any], Any], init: Any) -> None:
        super().__init__(emit)
        self.fn = fn
        self.state = init

    def push(self, item: Any) -> None:
        self.state = state = self.fn(self.state, item)
        self.emit(state)


@dataclass(frozen=True, slots=True, repr=False)
class Scan(Operator):
    """A running fold. See :func:`scan`."""

    fn: Callable[[Any, Any], Any]
    init: Any

    def open(self, emit: Emit) -> ScanNode:
        return ScanNode(emit, self.fn, self.init)

    def __repr__(self) -> str:
        return f"<scan {describe(self.fn)} init={self.init!r}>"


def scan(fn: Callable[[Any, Any], Any], init: Any) -> Scan:
    """Fold items into a state, ``state = fn(state, item)``, and emit every new state.

    ``init`` is the starting state and is not emitted itself: the output is
    ``itertools.accumulate(items, fn, initial=init)`` without its first element. Every pipeline built
    from this operator starts from the same ``init`` object, so ``fn`` should return a new state rather
    than mutate it.

    Args:
        fn: ``fn(state, item) -> new state``.
        init: the state before the first item.

    Example:
        >>> import operator
        >>> import streamwatch as sw
        >>> from streamwatch import ops
        >>> out = sw.sinks.collect()
        >>> (sw.source() | ops.scan(operator.add, 0) | out).run([1, 2, 3])
        >>> out.items
        [1, 3, 6]
    """
    check_callable("fn", fn)
    return Scan(fn, init)


# -- subsample ---------------------------------------------------------------------------------------


class SubsampleNode(Node):
    __slots__ = ("left", "n")

    def __init__(self, emit: Emit, n: int) -> None:
        super().__init__(emit)
        self.n = n
        self.left = 0  # items still to drop before the next one is emitted

    def push(self, item: Any) -> None:
        if self.left:
            self.left -= 1
        else:
            self.left = self.n - 1
            self.emit(item)


@dataclass(frozen=True, slots=True, repr=False)
class Subsample(Operator):
    """Every ``n``-th item. See :func:`subsample`."""

    n: int

    def open(self, emit: Emit) -> SubsampleNode:
        return SubsampleNode(emit, self.n)

    def __repr__(self) -> str:
        return f"<subsample n={self.n}>"


def subsample(n: int) -> Subsample:
    """Emit every ``n``-th item, starting with the first: items ``0, n, 2n, ...``.

    ::

        input : 1 2 3 4 5 6 7 |
        subsample(3)
        output: 1     4     7 |

    Args:
        n: keep one item in ``n`` (``1`` keeps them all).

    Example:
        >>> import streamwatch as sw
        >>> from streamwatch import ops
        >>> out = sw.sinks.collect()
        >>> (sw.source() | ops.subsample(3) | out).run([1, 2, 3, 4, 5, 6, 7])
        >>> out.items
        [1, 4, 7]
    """
    return Subsample(positive_int("n", n))
