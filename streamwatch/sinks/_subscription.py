"""Async subscribers: ``async for item in subscription`` over any pipeline's output.

Each subscription has its own bounded buffer. The worker never waits for a subscriber: when the
buffer is full the oldest item is overwritten, and the subscriber is told how many it missed with
:class:`~streamwatch.Lagged` (tokio ``broadcast``'s ``Lagged(n)``) before it gets the next item.
The subscription stays usable after ``Lagged``: catch it and keep reading.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from streamwatch._channel import ChannelStatistics, Receiver, Sender, lagging_pair
from streamwatch._exceptions import ChannelClosed, EndOfChannel, PipelineError
from streamwatch._pipeline import Sink

__all__ = ["Subscription", "subscribe"]


class Subscription(Sink):
    """A sink whose outputs are read with ``async for`` (asyncio or trio). See :func:`subscribe`."""

    __slots__ = ("_error", "_rx", "_tx", "unsubscribed_drops")

    def __init__(self, capacity: int) -> None:
        # Both ends live and die with this subscription: no ResourceWarning of their own.
        pair: tuple[Sender[Any], Receiver[Any]] = lagging_pair(capacity)
        self._tx, self._rx = pair
        self._error: BaseException | None = None
        self.unsubscribed_drops = 0  # outputs discarded after the subscriber called unsubscribe()

    # -- the worker's side (Sink) -------------------------------------------------------------------

    def send(self, item: Any) -> None:
        """Buffer ``item``; never blocks — a full buffer overwrites its oldest item (counted)."""
        try:
            self._tx.offer(item, "drop_oldest")
        except ChannelClosed:  # the subscriber left: its choice, counted, never the worker's failure
            self.unsubscribed_drops += 1

    def close(self) -> None:
        """The pipeline ended: the subscriber drains what is buffered, then iteration stops."""
        self._tx.close()

    def fail(self, error: BaseException) -> None:
        """The pipeline failed: the subscriber drains, then gets :class:`~streamwatch.PipelineError`."""
        self._error = error
        self._tx.close()

    # -- the subscriber's side ----------------------------------------------------------------------

    async def recv(self) -> Any:
        """The next output, waiting for it without blocking the event loop.

        Raises:
            Lagged: items were overwritten since the last receive (``.missed`` says how many).
            EndOfChannel: the pipeline ended and everything was read.
            PipelineError: the pipeline failed (after everything buffered was read).
        """
        try:
            return await self._rx.recv_async()
        except EndOfChannel:
            if self._error is not None:
                raise PipelineError([("<subscription>", self._error)]) from self._error
            raise

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.recv()
        except EndOfChannel:
            raise StopAsyncIteration from None

    def unsubscribe(self) -> None:
        """Stop receiving: later outputs are discarded and counted in ``unsubscribed_drops``."""
        self._rx.close()

    @property
    def missed(self) -> int:
        """Total outputs overwritten because this subscriber was too slow."""
        return self._rx.statistics().dropped_oldest

    def statistics(self) -> ChannelStatistics:
        """The subscription buffer's counters (``dropped_oldest`` = items missed)."""
        return self._rx.statistics()

    def __repr__(self) -> str:
        return f"<subscription capacity={self._rx.statistics().capacity}>"


def subscribe(capacity: int = 64) -> Subscription:
    """A sink read with ``async for``, holding at most ``capacity`` unread outputs.

    Example:
        >>> import anyio, streamwatch as sw
        >>> from streamwatch import ops
        >>> sub = sw.sinks.subscribe(capacity=8)
        >>> (sw.source() | ops.map(lambda x: x * x) | sub).run(range(4))
        >>> async def main():
        ...     return [x async for x in sub]
        >>> anyio.run(main)
        [0, 1, 4, 9]
    """
    return Subscription(capacity)
