"""Combining streams: ``zip`` aligns several streams by a key (e.g. the step number), not by arrival."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from functools import partial
from typing import Any

from streamwatch._pipeline import Emit, Node, Stream
from streamwatch.ops._checks import check_callable, describe, positive_int

__all__ = ["Zip", "ZipNode", "zip"]


class ZipNode(Node):
    # Invariant: no key is pending on every side at once (that would have been emitted), and each
    # side's dict is in arrival order, so its first entry is its oldest.
    __slots__ = ("key", "max_pending", "pending", "replaced", "unmatched")

    def __init__(self, emit: Emit, sides: int, key: Callable[[Any], Hashable], max_pending: int) -> None:
        super().__init__(emit)
        self.key = key
        self.max_pending = max_pending
        self.pending: tuple[dict[Hashable, Any], ...] = tuple({} for _ in range(sides))
        self.unmatched = 0
        self.replaced = 0

    def push(self, item: Any) -> None:
        raise TypeError("a ZipNode has one input per side: use push_side(side, item)")

    def push_side(self, side: int, item: Any) -> None:
        k = self.key(item)
        pending = self.pending
        mine = pending[side]
        if k in mine:  # then another side lacks `k`: no match possible
            del mine[k]  # re-inserted below as the newest entry
            mine[k] = item
            self.replaced += 1
            return
        for other in pending:
            if other is not mine and k not in other:
                mine[k] = item
                if len(mine) > self.max_pending:
                    del mine[next(iter(mine))]
                    self.unmatched += 1
                return
        matched = tuple([item if other is mine else other.pop(k) for other in pending])
        self._drop_older(k)
        self.emit(matched)

    def _drop_older(self, k: Any) -> None:
        """Drop each side's oldest entries while their keys are < ``k``: they can never match now."""
        for other in self.pending:
            while other:
                oldest = next(iter(other))
                try:
                    if not oldest < k:
                        break
                except TypeError:  # keys that do not order are only dropped by max_pending or close
                    break
                del other[oldest]
                self.unmatched += 1

    def close(self) -> None:
        for other in self.pending:
            self.unmatched += len(other)
            other.clear()

    def counters(self) -> dict[str, int]:
        return {"unmatched": self.unmatched, "replaced": self.replaced}


class Zip(Stream):
    """Several streams aligned by key. See :func:`zip`."""

    __slots__ = ("key", "max_pending", "streams")

    def __init__(self, streams: tuple[Stream, ...], key: Callable[[Any], Hashable], max_pending: int) -> None:
        self.streams = streams
        self.key = key
        self.max_pending = max_pending

    def _wire(self, emit: Emit, roots: list[Emit], nodes: list[Node]) -> None:
        node = ZipNode(emit, len(self.streams), self.key, self.max_pending)
        nodes.append(node)
        for side, stream in enumerate(self.streams):
            stream._wire(partial(node.push_side, side), roots, nodes)

    def __repr__(self) -> str:
        return f"<zip {len(self.streams)} streams key={describe(self.key)} max_pending={self.max_pending}>"


def zip(*streams: Stream, key: Callable[[Any], Hashable], max_pending: int = 64) -> Stream:
    """Align two or more streams by ``key(item)`` and emit one tuple per key they all produced.

    A tuple ``(item_0, item_1, ...)``, in the order of ``streams``, is emitted as soon as every stream
    has produced an item with the same key, so branches running at different cadences line up on, say,
    the training step. Until then items wait, per stream, in arrival order. What never matches is
    dropped and counted as ``"zip.unmatched"`` in :meth:`streamwatch.Pipeline.counters`:

    * after key ``k`` is emitted, each stream's oldest waiting items with keys ``< k`` (keys are expected
      to increase, like step numbers; keys that do not order with ``<`` are never dropped this way);
    * a stream's oldest waiting item when more than ``max_pending`` wait (one stream ran far ahead);
    * everything still waiting at close.

    A second item with the key of a waiting item replaces it, counted as ``"zip.replaced"``.

    Args:
        *streams: at least two streams, e.g. branches of one :func:`streamwatch.source`.
        key: maps an item to its alignment key (hashable).
        max_pending: most items waiting per stream (>= 1).

    Example:
        >>> import streamwatch as sw
        >>> from streamwatch import ops
        >>> steps = sw.source()
        >>> every_2 = steps | ops.subsample(2)
        >>> every_3 = steps | ops.subsample(3)
        >>> out = sw.sinks.collect()
        >>> p = ops.zip(every_2, every_3, key=lambda step: step) | out
        >>> p.run(range(13))
        >>> out.items
        [(0, 0), (6, 6), (12, 12)]
        >>> p.counters()
        {'zip.unmatched': 6, 'zip.replaced': 0}
    """
    if len(streams) < 2:
        raise TypeError(f"Expected at least 2 streams to zip, got {len(streams)}")
    for i, stream in enumerate(streams):
        if not isinstance(stream, Stream):
            raise TypeError(
                f"Expected `streams[{i}]` to be a Stream (e.g. streamwatch.source()), got {stream!r}"
            )
    check_callable("key", key)
    return Zip(streams, key, positive_int("max_pending", max_pending))
