"""Pipelines: ``source | operator | ... | sink``.

Three kinds of object take part, and only one of them holds state:

* **Operator** — a frozen, printable *description* of a step (``<window size=64>``). It can be reused
  in many pipelines and composed with ``|`` into a chain before it meets a stream.
* **Stream** — an immutable description of where values come from: a :class:`Source`, a stream piped
  through an operator, or several streams zipped together (:func:`streamwatch.ops.zip`).
* **Pipeline** — ``stream | sink``. Building one *opens* every operator into a :class:`Node`, the
  runtime object holding window buffers, counters, etc. A pipeline is push-based: the worker calls
  :meth:`Pipeline.push` once per item, each node calls the next one directly (no per-item generators,
  no queues between stages), and :meth:`Pipeline.close` flushes what windows still hold, then closes
  the sink.

Example:
    >>> import streamwatch as sw
    >>> from streamwatch import ops
    >>> out = sw.sinks.collect()
    >>> p = sw.source() | ops.map(lambda x: x * 10) | ops.window(2) | ops.sum() | out
    >>> p.run([1, 2, 3, 4, 5])
    >>> out.items
    [30, 70, 50]
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator
from typing import Any, overload

__all__ = ["Chain", "Emit", "Node", "Operator", "Pipeline", "Sink", "Source", "Stream", "source"]

Emit = Callable[[Any], None]
"""Where a node sends its output: the next node's ``push`` or the sink's ``send``."""


def describe(obj: object) -> str:
    """``repr(obj)``, or a stand-in naming its type if that ``repr`` raises: error reports never fail.

    Example:
        >>> class Odd:
        ...     def __repr__(self) -> str:
        ...         raise ValueError("no")
        >>> describe([1]), describe(Odd())
        ('[1]', '<Odd (repr raised ValueError)>')
    """
    try:
        return repr(obj)
    except Exception as exc:
        return f"<{type(obj).__name__} (repr raised {type(exc).__name__})>"


class Node:
    """The runtime half of an operator: receives items with :meth:`push`, emits with ``self.emit``.

    Nodes run on one thread (the worker's) and need no locks. ``close`` flushes buffered state
    downstream and is called exactly once, after the last ``push``, upstream nodes first.
    """

    __slots__ = ("emit",)

    def __init__(self, emit: Emit) -> None:
        self.emit = emit

    def push(self, item: Any) -> None:
        self.emit(item)

    def close(self) -> None:
        """Flush buffered state downstream. Default: nothing is buffered."""

    def counters(self) -> dict[str, int]:
        """Events this node counted (e.g. ``{"unmatched": 3}``); empty by default."""
        return {}


class Operator(abc.ABC):
    """A frozen description of one pipeline step. Subclasses are frozen dataclasses.

    ``a | b`` composes two operators into a :class:`Chain`; ``stream | op`` extends a stream.
    """

    @abc.abstractmethod
    def open(self, emit: Emit) -> Node:
        """Create the runtime node that feeds its output into ``emit``."""

    def __or__(self, other: Operator) -> Chain:
        if not isinstance(other, Operator):
            return NotImplemented
        return Chain((*_flatten(self), *_flatten(other)))


def _flatten(op: Operator) -> tuple[Operator, ...]:
    return op.ops if isinstance(op, Chain) else (op,)


class Chain(Operator):
    """Operators composed with ``|`` before they are attached to a stream.

    Example:
        >>> from streamwatch import ops
        >>> ops.map(abs) | ops.window(3) | ops.mean()
        <map abs> | <window size=3> | <mean>
    """

    __slots__ = ("ops",)

    def __init__(self, ops: tuple[Operator, ...]) -> None:
        self.ops = ops

    def open(self, emit: Emit) -> Node:
        # Only used when a chain is opened directly (a custom operator's ``open`` returning one); streams
        # unroll chains so every node is visible.
        nodes: list[Node] = []
        for op in reversed(self.ops):
            node = op.open(emit)
            nodes.append(node)
            emit = node.push
        return _ChainNode(nodes[::-1])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Chain) and other.ops == self.ops

    def __hash__(self) -> int:
        return hash(self.ops)

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.ops))


class _ChainNode(Node):
    """The nodes of an opened :class:`Chain`, first to last: pushes go to the first; ``close`` flushes
    them in order (each one's flush reaches the ones after it before they flush); counters of all.

    Example:
        >>> from streamwatch import ops
        >>> out = []
        >>> node = (ops.map(abs) | ops.window(3)).open(out.append)
        >>> for x in range(-4, 1):
        ...     node.push(x)
        >>> node.close()
        >>> out
        [[4, 3, 2], [1, 0]]
    """

    __slots__ = ("nodes",)

    def __init__(self, nodes: list[Node]) -> None:
        super().__init__(nodes[0].push)
        self.nodes = nodes

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def counters(self) -> dict[str, int]:
        merged: dict[str, int] = {}
        for node in self.nodes:
            for name, count in node.counters().items():
                merged[name] = merged.get(name, 0) + count
        return merged


def _unchained(nodes: Iterable[Node]) -> Iterator[Node]:
    """``nodes`` with every opened chain (a custom operator's) replaced by its own nodes, in order."""
    for node in nodes:
        if isinstance(node, _ChainNode):
            yield from _unchained(node.nodes)
        else:
            yield node


class Sink(abc.ABC):
    """The end of a pipeline. ``send`` receives every output; ``close`` is called once at the end.

    Subclass it, or wrap a function with :func:`streamwatch.sinks.callback`.
    """

    @abc.abstractmethod
    def send(self, item: Any) -> None:
        """Receive one output value (called on the worker thread)."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """The pipeline ended normally; release resources. Called once."""

    def fail(self, error: BaseException) -> None:
        """The pipeline failed with ``error`` and will receive nothing more. Default: :meth:`close`."""
        self.close()


class Stream(abc.ABC):
    """An immutable description of a flow of values. Extend it with ``|``."""

    @overload
    def __or__(self, other: Operator) -> Stream: ...

    @overload
    def __or__(self, other: Sink) -> Pipeline: ...

    def __or__(self, other: Operator | Sink) -> Stream | Pipeline:
        if isinstance(other, Operator):
            stream: Stream = self
            for op in _flatten(other):
                stream = _Piped(stream, op)
            return stream
        if isinstance(other, Sink):
            return Pipeline(self, other)
        return NotImplemented

    @abc.abstractmethod
    def _wire(self, emit: Emit, roots: list[Emit], nodes: list[Node]) -> None:
        """Open this stream's nodes feeding ``emit``; append entry points to ``roots``.

        ``nodes`` receives every node in pre-order from the sink upwards, so reversing it gives an order
        in which each node comes after everything upstream of it (the flush order).
        """


class Source(Stream):
    """The root of a stream: every item the worker receives enters the pipeline here.

    ``select`` (optional) maps each item to the value that enters; issue-specific sources (series of
    a step record, for instance) are sources with a ``select``.

    Example:
        >>> import streamwatch as sw
        >>> sw.source()
        <source>
        >>> sw.source(len, name="sizes")
        <source sizes>
    """

    __slots__ = ("name", "select")

    def __init__(self, select: Callable[[Any], Any] | None = None, *, name: str | None = None) -> None:
        if select is not None and not callable(select):
            raise TypeError(f"Expected `select` to be callable or None, got {select!r}")
        self.select = select
        self.name = name

    def _wire(self, emit: Emit, roots: list[Emit], nodes: list[Node]) -> None:
        select = self.select
        if select is None:
            roots.append(emit)
        else:
            roots.append(lambda item: emit(select(item)))

    def __repr__(self) -> str:
        return f"<source {self.name}>" if self.name else "<source>"


def source(select: Callable[[Any], Any] | None = None, *, name: str | None = None) -> Source:
    """A stream of every item the worker receives (optionally mapped through ``select``).

    Example:
        >>> import streamwatch as sw
        >>> out = sw.sinks.collect()
        >>> (sw.source() | out).run(["a", "b"])
        >>> out.items
        ['a', 'b']
    """
    return Source(select, name=name)


class _Piped(Stream):
    __slots__ = ("op", "upstream")

    def __init__(self, upstream: Stream, op: Operator) -> None:
        self.upstream = upstream
        self.op = op

    def _wire(self, emit: Emit, roots: list[Emit], nodes: list[Node]) -> None:
        node = self.op.open(emit)
        nodes.append(node)
        self.upstream._wire(node.push, roots, nodes)

    def __repr__(self) -> str:
        return f"{self.upstream!r} | {self.op!r}"


class Pipeline:
    """A stream connected to a sink, opened and ready to receive items.

    A pipeline holds state (window buffers, counters) and is used by one thread at a time, normally the
    worker's. Outside a worker, drive it by hand with :meth:`push` / :meth:`close` or :meth:`run`.

    Example:
        >>> import streamwatch as sw
        >>> from streamwatch import ops
        >>> out = sw.sinks.collect()
        >>> p = sw.source() | ops.filter(lambda x: x % 2) | out
        >>> p
        <pipeline <source> | <filter <lambda>> | <collect>>
        >>> p.run(range(6))
        >>> out.items
        [1, 3, 5]
    """

    __slots__ = ("_nodes", "_roots", "closed", "error", "sink", "stream")

    def __init__(self, stream: Stream, sink: Sink) -> None:
        if not isinstance(stream, Stream):
            raise TypeError(f"Expected `stream` to be a Stream (e.g. streamwatch.source()), got {stream!r}")
        if not isinstance(sink, Sink):
            raise TypeError(
                f"Expected `sink` to be a Sink (e.g. streamwatch.sinks.callback(fn)), got {sink!r}"
            )
        self.stream = stream
        self.sink = sink
        roots: list[Emit] = []
        nodes: list[Node] = []
        stream._wire(sink.send, roots, nodes)
        self._roots = tuple(roots)
        self._nodes = tuple(reversed(nodes))
        self.closed = False
        self.error: BaseException | None = None

    def push(self, item: Any) -> None:
        """Feed one item through every branch. Raises whatever an operator or the sink raises."""
        for root in self._roots:
            root(item)

    def close(self) -> None:
        """Flush every node (upstream first), then close the sink. Idempotent.

        Raises what a node or the sink raises. When a node raises, the sink is told through ``fail``
        and the node's error is raised — a second error from ``fail`` is added to it as a note.
        """
        if self.closed:
            return
        self.closed = True
        try:
            for node in self._nodes:
                node.close()
        except BaseException as exc:
            self.error = exc
            try:
                self.sink.fail(exc)
            except BaseException as again:
                if hasattr(exc, "add_note"):  # Python >= 3.11
                    exc.add_note(f"then {describe(self.sink)}.fail() raised {type(again).__name__}: {again}")
            raise
        try:
            self.sink.close()
        except BaseException as exc:
            self.error = exc
            raise

    def fail(self, error: BaseException) -> None:
        """Stop this pipeline after ``error``: nothing is flushed, the sink is told. Idempotent.

        The pipeline is stopped even when the sink's ``fail`` raises (that error propagates).
        """
        if self.closed:
            return
        self.closed = True
        self.error = error
        self.sink.fail(error)

    def run(self, items: Iterable[Any]) -> None:
        """Push every item, then close. Handy in tests and notebooks."""
        for item in items:
            self.push(item)
        self.close()

    def counters(self) -> dict[str, int]:
        """Counts reported by the nodes, keyed ``"<op>.<name>"`` (e.g. ``"zip.unmatched"``)."""
        out: dict[str, int] = {}
        for node in _unchained(self._nodes):
            for name, value in node.counters().items():
                key = f"{type(node).__name__.removesuffix('Node').lower()}.{name}"
                out[key] = out.get(key, 0) + value
        return out

    def __repr__(self) -> str:
        return f"<pipeline {self.stream!r} | {describe(self.sink)}>"
