"""Plain sinks: call a function per output, or collect outputs into a list."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from streamwatch._pipeline import Sink

__all__ = ["Callback", "Collect", "callback", "collect"]


class Callback(Sink):
    """Calls ``fn(item)`` for every output, on the worker thread. See :func:`callback`."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[Any], object]) -> None:
        if not callable(fn):
            raise TypeError(f"Expected `fn` to be callable, got {fn!r}")
        self.fn = fn

    def send(self, item: Any) -> None:
        self.fn(item)

    def __repr__(self) -> str:
        return f"<callback {getattr(self.fn, '__qualname__', repr(self.fn))}>"


def callback(fn: Callable[[Any], object]) -> Callback:
    """A sink that calls ``fn(item)`` for each output (on the worker thread: keep it quick).

    Example:
        >>> import streamwatch as sw
        >>> seen = []
        >>> (sw.source() | sw.sinks.callback(seen.append)).run([1, 2])
        >>> seen
        [1, 2]
    """
    return Callback(fn)


class Collect(Sink):
    """Appends every output to ``items``; ``closed`` and ``error`` tell how the pipeline ended."""

    __slots__ = ("closed", "error", "items")

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.closed = False
        self.error: BaseException | None = None

    def send(self, item: Any) -> None:
        self.items.append(item)

    def close(self) -> None:
        self.closed = True

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.closed = True

    def __repr__(self) -> str:
        return "<collect>"


def collect() -> Collect:
    """A sink that keeps every output in a list (``.items``), for tests and notebooks.

    Example:
        >>> import streamwatch as sw
        >>> out = sw.sinks.collect()
        >>> (sw.source() | out).run("ab")
        >>> out.items, out.closed
        (['a', 'b'], True)
    """
    return Collect()
