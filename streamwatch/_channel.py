"""A bounded multi-producer, single-consumer channel with sync and async faces.

``channel(capacity)`` returns a ``(Sender, Receiver)`` pair sharing one buffer. The contract is
tokio's ``mpsc`` in Python names; the layout follows anyio's memory object streams.

Backpressure:
    At most ``capacity`` items are buffered (or reserved by permits). ``send`` blocks while the
    channel is full, ``send_nowait`` raises :class:`~streamwatch.Full` carrying the item, and
    ``await send_async`` suspends only its own task. Producers that must never stall (taps on the
    training thread) use :meth:`Sender.offer` with an overflow policy instead: ``"drop_oldest"``
    (default), ``"drop_newest"``, ``"block"`` or ``"error"``. Every dropped item is counted per
    reason in :meth:`Sender.statistics` and handed to the channel's ``on_drop`` callback, so a
    drop is never silent.

Disconnection:
    The channel is closed for receiving when every :class:`Sender` clone is closed and no
    :class:`Permit` is outstanding, or when the receiver calls :meth:`Receiver.close`. A send on a
    closed channel raises :class:`~streamwatch.ChannelClosed` with the item handed back and ``by``
    naming who closed it. A leaked endpoint is closed by the garbage collector with a
    ``ResourceWarning``.

Clean shutdown:
    Closing never discards buffered items: after the last sender closes (or the receiver closes),
    ``recv`` keeps returning buffered items and only then raises :class:`~streamwatch.EndOfChannel`;
    iteration simply ends. ``recv_nowait`` tells the two cases apart: :class:`~streamwatch.Empty`
    (nothing yet) vs :class:`~streamwatch.EndOfChannel` (nothing ever again).

Sync/async boundary:
    Every method is thread-safe. Blocking methods (``send``, ``reserve``, ``recv``,
    ``recv_many``) block the calling *thread*; ``*_async`` methods suspend the calling *task*
    (asyncio or trio, through anyio) and are woken thread-safely when a thread on the other side
    makes progress, so a worker thread and an event loop can share one channel. ``*_nowait`` and
    ``offer`` with a non-blocking policy never block.

Example:
    >>> import streamwatch as sw
    >>> tx, rx = sw.channel(2)
    >>> tx.send_nowait("a"); tx.send_nowait("b")
    >>> try:
    ...     tx.send_nowait("c")
    ... except sw.Full as full:
    ...     full.item
    'c'
    >>> tx.close()
    >>> list(rx)
    ['a', 'b']
    >>> rx.close()
"""

from __future__ import annotations

import math
import queue
import threading
import time
import warnings
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Literal, TypeVar, cast

import anyio.lowlevel

from streamwatch._exceptions import ChannelClosed, Empty, EndOfChannel, Full, Lagged, RecvTimeout, SendTimeout
from streamwatch._validate import check_int, check_seconds
from streamwatch._wakers import Waker, async_waker, wake_all

__all__ = [
    "OVERFLOW_POLICIES",
    "ChannelStatistics",
    "OverflowPolicy",
    "Permit",
    "Receiver",
    "Sender",
    "channel",
    "lagging_pair",
]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
T_contra = TypeVar("T_contra", contravariant=True)

OverflowPolicy = Literal["drop_oldest", "drop_newest", "block", "error"]
OVERFLOW_POLICIES: tuple[str, ...] = ("drop_oldest", "drop_newest", "block", "error")
_POLICY_SET = frozenset(OVERFLOW_POLICIES)
_LEAK = (
    "unclosed {!r}: close it (or use it as a context manager) when done; closed now by the garbage collector"
)


@dataclass(frozen=True, slots=True)
class ChannelStatistics:
    """A consistent snapshot of one channel, taken under its lock.

    Invariant: ``sent == received + len + dropped_oldest`` (items that entered the buffer), and
    every item a producer offered is in ``sent`` or ``dropped_newest``.

    Attributes:
        capacity: the bound given to :func:`channel`.
        len: items buffered now (not counting reserved slots).
        reserved: slots held by outstanding permits.
        sent: items that entered the buffer.
        received: items handed to the receiver.
        dropped_oldest: buffered items evicted by the ``drop_oldest`` policy.
        dropped_newest: offered items discarded by ``drop_newest`` (or ``drop_oldest`` when every slot
            is reserved and nothing can be evicted).
        high_water: the largest ``len`` seen.
        open_senders: sender clones not yet closed.
        blocked_send_seconds: total time producers spent blocked in ``send``/``reserve``/``offer``.
        closed: no further item can be sent.
    """

    capacity: int
    len: int
    reserved: int
    sent: int
    received: int
    dropped_oldest: int
    dropped_newest: int
    high_water: int
    open_senders: int
    blocked_send_seconds: float
    closed: bool

    @property
    def dropped(self) -> int:
        """Items dropped for any reason."""
        return self.dropped_oldest + self.dropped_newest


_TOKEN = None
_END: Any = object()  # sticky end-of-channel sentinel: once in the buffer, it is put back when read


class _State(Generic[T]):
    """The state both endpoints share.

    Concurrency design (locks are expensive next to CPython's C queues, and the receiver is the worker
    thread competing with training for the GIL):

    * ``buffer`` is a C ``queue.SimpleQueue``: ``put`` wakes a thread blocked in ``get`` without any
      Python-level lock, and ``get`` blocks in C.
    * ``tokens`` holds one token per free slot; ``deque.pop``/``append`` are atomic, so it is a counting
      semaphore. A producer pops a token before putting an item; the receiver appends one after taking
      an item. ``len(buffer) <= capacity`` holds exactly.
    * ``lock`` serialises *producers* and state changes (close, permits, evictions, async waiter
      lists); the receiver's fast path never takes it. Closing puts the sticky ``_END`` sentinel under
      the lock, so no send can land behind it: everything sent before the end is received.
    * Lost wake-ups are ruled out by register-then-check: a blocked producer counts itself in
      ``send_waiting`` (or appends its waker) *before* it tries for a token, and the receiver returns
      the token *before* it reads those fields.
    """

    __slots__ = (
        "async_recv",
        "async_send",
        "blocked_send_seconds",
        "buffer",
        "capacity",
        "dropped_newest",
        "dropped_oldest",
        "end_put",
        "high_water",
        "lock",
        "missed",
        "not_full",
        "on_drop",
        "open_senders",
        "received",
        "receiver_closed",
        "reserved",
        "send_waiting",
        "sent",
        "tokens",
        "wake_pending",
    )

    def __init__(self, capacity: int, on_drop: Callable[[T, str], object] | None) -> None:
        self.capacity = capacity
        self.buffer: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.tokens: deque[None] = deque([_TOKEN] * capacity)
        # RLock: a leaked endpoint's __del__ may run (via the GC) on a thread already inside a method.
        self.lock = threading.RLock()
        self.not_full = threading.Condition(self.lock)
        self.send_waiting = 0
        self.wake_pending = False  # a notify is in flight to blocked producers that have not run yet
        self.async_recv: list[Waker] = []
        self.async_send: list[Waker] = []
        self.reserved = 0
        self.open_senders = 0
        self.receiver_closed = False
        self.end_put = False
        self.sent = 0
        self.received = 0  # written by the (single) consumer only
        self.dropped_oldest = 0
        self.dropped_newest = 0
        self.missed = 0  # evictions not yet reported to a lag-aware receiver (subscriptions)
        self.high_water = 0
        self.blocked_send_seconds = 0.0
        self.on_drop = on_drop

    # -- producer side, ``lock`` held --------------------------------------------------------------

    def closing(self) -> bool:
        """No new send is accepted (buffered and reserved items still arrive)."""
        return self.receiver_closed or self.open_senders == 0

    def put(self, item: T) -> None:
        """Buffer ``item`` whose slot token the caller already holds."""
        buffer = self.buffer
        buffer.put(item)
        self.sent += 1
        n = buffer.qsize()
        if n > self.high_water:
            self.high_water = n
        if self.async_recv:
            wake_all(self.async_recv)

    def maybe_end(self) -> None:
        """Put the end sentinel once nothing more can arrive: closing and no permit outstanding."""
        if not self.end_put and self.closing() and self.reserved == 0:
            self.end_put = True
            self.buffer.put(_END)
            wake_all(self.async_recv)

    def wake_senders(self) -> None:
        if self.send_waiting:
            self.not_full.notify_all()
        if self.async_send:
            wake_all(self.async_send)

    # -- consumer side, no lock ---------------------------------------------------------------------

    def returned(self, n: int) -> None:
        """The consumer took ``n`` items: give their tokens back, then wake blocked producers."""
        if n == 1:
            self.tokens.append(_TOKEN)
        else:
            self.tokens.extend([_TOKEN] * n)
        self.received += n
        if (self.send_waiting and not self.wake_pending) or self.async_send:
            self.room_freed()

    def room_freed(self) -> None:
        """Slow path of :meth:`returned`: producers are blocked; wake them once per round."""
        with self.lock:
            self.wake_pending = True
            self.wake_senders()

    def statistics(self) -> ChannelStatistics:
        with self.lock:  # producers are locked out, so `sent` and the drop counts stand still
            received = self.received  # the consumer counts without the lock: read it once
            return ChannelStatistics(
                capacity=self.capacity,
                # Derived, not read from the buffer, so the invariant holds even while the consumer is
                # mid-receive (an item it has taken but not yet counted still shows as buffered).
                len=self.sent - received - self.dropped_oldest,
                reserved=self.reserved,
                sent=self.sent,
                received=received,
                dropped_oldest=self.dropped_oldest,
                dropped_newest=self.dropped_newest,
                high_water=self.high_water,
                open_senders=self.open_senders,
                blocked_send_seconds=self.blocked_send_seconds,
                closed=self.closing(),
            )


def _check_timeout(timeout: float | None) -> float | None:
    """Validate ``timeout`` and normalise it: ``None`` or ``inf`` wait forever (``None``)."""
    if timeout is None:
        return None
    seconds = check_seconds(timeout, "timeout", optional=True)  # (None, above: no timeout)
    return None if math.isinf(seconds) else seconds


def _deadline(timeout: float | None) -> float | None:
    """The monotonic deadline of an already-normalised timeout."""
    return None if timeout is None else time.monotonic() + timeout


def channel(
    capacity: int, *, on_drop: Callable[[Any, str], object] | None = None
) -> tuple[Sender[Any], Receiver[Any]]:
    """Create a bounded channel; returns ``(sender, receiver)``.

    Args:
        capacity: the most items buffered at once (an ``int >= 1``; there is no unbounded mode).
        on_drop: called as ``on_drop(item, reason)`` for every item an overflow policy drops
            (``reason`` is ``"drop_oldest"`` or ``"drop_newest"``), on the producer's thread, outside
            the lock — e.g. to return a pinned buffer slot to its pool.

    Example:
        >>> import streamwatch as sw
        >>> tx, rx = sw.channel(8)
        >>> with tx:
        ...     tx.send(1)
        >>> rx.recv()
        1
        >>> rx.close()
    """
    capacity = _check_capacity(capacity)
    if on_drop is not None and not callable(on_drop):
        raise TypeError(f"Expected `on_drop` to be callable or None, got {on_drop!r}")
    state: _State[Any] = _State(capacity, on_drop)
    return Sender(state), Receiver(state)


_C = TypeVar("_C", bound="_Closing")


def _check_capacity(capacity: object) -> int:
    return check_int(capacity, "capacity")


def lagging_pair(capacity: int) -> tuple[Sender[Any], Receiver[Any]]:
    """A sender and a receiver over one buffer of ``capacity`` whose receiver reports what a full buffer
    overwrote (:class:`~streamwatch.Lagged`) and neither warns when left open (they live and die with
    their owner): a subscription's buffer, sent to with ``offer(item, "drop_oldest")``.

    Example:
        >>> tx, rx = lagging_pair(1)
        >>> tx.offer("a", "drop_oldest"), tx.offer("b", "drop_oldest")
        (True, True)
        >>> try:
        ...     rx.recv_nowait()
        ... except Lagged as lag:
        ...     print(lag.missed, rx.recv_nowait())
        1 b
    """
    state: _State[Any] = _State(_check_capacity(capacity), None)
    return Sender(state, warn_on_leak=False), Receiver(state, report_lag=True, warn_on_leak=False)


class _Closing:
    """``with x:`` closes ``x`` on exit."""

    __slots__ = ()

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _Endpoint(_Closing):
    """What both ends share: closing, statistics, the context manager and the leak warning."""

    __slots__ = ("__weakref__", "_closed", "_state", "_warn_on_leak")

    def __init__(self, state: _State[Any], warn_on_leak: bool) -> None:
        self._state = state
        self._closed = False
        self._warn_on_leak = warn_on_leak  # False for endpoints owned by another streamwatch object

    @property
    def closed(self) -> bool:
        """Whether this endpoint was closed (not whether the channel has ended)."""
        return self._closed

    def statistics(self) -> ChannelStatistics:
        """A snapshot of the channel's counters. Thread-safe."""
        return self._state.statistics()

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        if self._warn_on_leak:
            warnings.warn(_LEAK.format(self), ResourceWarning, stacklevel=1)
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {state} capacity={self._state.capacity}>"


class Sender(_Endpoint, Generic[T_contra]):
    """The sending endpoint. Thread-safe; ``clone()`` one per producer and close each.

    Use it as a context manager so it is closed on exit.
    """

    __slots__ = ()

    def __init__(self, state: _State[Any], *, warn_on_leak: bool = True) -> None:
        super().__init__(state, warn_on_leak)
        with state.lock:
            state.open_senders += 1

    # -- sending ------------------------------------------------------------------------------------

    def send_nowait(self, item: T_contra) -> None:
        """Buffer ``item`` now or raise; never blocks. Thread-safe.

        Raises:
            Full: the channel is at capacity (``.item`` is the item).
            ChannelClosed: this sender or the receiver is closed (``.item`` is the item).
        """
        state = self._state
        lock = state.lock
        lock.acquire()  # explicit acquire/release: measurably cheaper than `with` on the hot path
        try:
            if not self._try_token(item):
                raise Full(f"channel is full (capacity {state.capacity}); item handed back", item)
            state.put(item)
        finally:
            lock.release()

    def send(self, item: T_contra, timeout: float | None = None) -> None:
        """Buffer ``item``, blocking the calling thread while the channel is full. Thread-safe.

        Raises:
            SendTimeout: still full after ``timeout`` seconds (``.item`` is the item).
            ChannelClosed: the channel is or becomes closed while waiting (``.item`` is the item).
        """
        if timeout is not None:
            timeout = _check_timeout(timeout)
        state = self._state
        lock = state.lock
        lock.acquire()
        try:
            if not self._try_token(item):
                self._wait_for_token(item, timeout)
            state.put(item)
        finally:
            lock.release()

    async def send_async(self, item: T_contra) -> None:
        """Buffer ``item``, suspending the calling task (asyncio or trio) while the channel is full.

        Cancellation before the item is buffered leaves the channel untouched; once buffered, the
        send has happened and is not undone.

        Raises:
            ChannelClosed: the channel is or becomes closed while waiting (``.item`` is the item).
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        state = self._state
        start = 0.0
        while True:
            with state.lock:
                if self._closed or state.receiver_closed:
                    raise self._closed_error(item)
                wake, wait = async_waker()
                state.async_send.append(wake)  # register, then check: no lost wake-up
                try:
                    state.tokens.pop()
                except IndexError:
                    pass
                else:
                    state.async_send.remove(wake)
                    state.put(item)
                    break
            start = start or time.perf_counter()
            try:
                await wait()
            finally:
                with state.lock:
                    if wake in state.async_send:
                        state.async_send.remove(wake)
        if start:
            with state.lock:
                state.blocked_send_seconds += time.perf_counter() - start
        await anyio.lowlevel.cancel_shielded_checkpoint()

    def offer(
        self, item: T_contra, policy: OverflowPolicy = "drop_oldest", timeout: float | None = None
    ) -> bool:
        """Send under an overflow policy: the producer boundary that taps use. Thread-safe.

        Policies when the channel is full:
            * ``"drop_oldest"`` — evict the oldest buffered item (counted, passed to ``on_drop``) and
              buffer this one. Never blocks: training is never stalled.
            * ``"drop_newest"`` — discard this item (counted, passed to ``on_drop``). Never blocks.
            * ``"block"`` — wait for room like :meth:`send` (lossless; ``timeout`` raises
              :class:`~streamwatch.SendTimeout`).
            * ``"error"`` — raise :class:`~streamwatch.Full` like :meth:`send_nowait`.

        Returns:
            ``True`` if ``item`` was buffered, ``False`` if it was dropped.

        Raises:
            ChannelClosed: the channel is closed (``.item`` is the item).
            ValueError: unknown ``policy``.

        Example:
            >>> import streamwatch as sw
            >>> tx, rx = sw.channel(1)
            >>> tx.offer("old"), tx.offer("new"), tx.offer("newer", "drop_newest")
            (True, True, False)
            >>> rx.recv_nowait(), tx.statistics().dropped
            ('new', 2)
            >>> tx.close(); rx.close()
        """
        if policy not in _POLICY_SET:
            raise ValueError(f"Expected `policy` to be one of {OVERFLOW_POLICIES}, got {policy!r}")
        if timeout is not None:
            timeout = _check_timeout(timeout)
        state = self._state
        dropped: Any
        with state.lock:
            if self._try_token(item):  # a free slot
                state.put(item)
                return True
            if policy == "drop_oldest":
                try:
                    dropped = state.buffer.get_nowait()  # its token now carries the new item
                except queue.Empty:  # every slot is reserved or in the consumer's hands
                    dropped = _END
                if dropped is not _END:
                    state.dropped_oldest += 1
                    state.missed += 1
                    state.put(item)
                    reason = "drop_oldest"
                else:
                    dropped, reason = item, "drop_newest"
                    state.dropped_newest += 1
            elif policy == "drop_newest":
                dropped, reason = item, "drop_newest"
                state.dropped_newest += 1
            elif policy == "block":
                self._wait_for_token(item, timeout)
                state.put(item)
                return True
            else:  # "error"
                raise Full(f"channel is full (capacity {state.capacity}); item handed back", item)
        if state.on_drop is not None:
            state.on_drop(dropped, reason)
        return reason == "drop_oldest"

    def reserve(self, timeout: float | None = None) -> Permit[T_contra]:
        """Reserve one slot, blocking the calling thread while the channel is full. Thread-safe.

        The permit's ``send`` then cannot block or fail.

        Raises:
            SendTimeout: no room after ``timeout`` seconds.
            ChannelClosed: the channel is or becomes closed.
        """
        timeout = _check_timeout(timeout)
        state = self._state
        with state.lock:
            if not self._try_token(None):
                self._wait_for_token(None, timeout)
            state.reserved += 1
        return Permit(state)

    def reserve_nowait(self) -> Permit[T_contra]:
        """Reserve one slot now or raise :class:`~streamwatch.Full`; never blocks. Thread-safe.

        Example:
            >>> import streamwatch as sw
            >>> tx, rx = sw.channel(1)
            >>> with tx.reserve_nowait() as permit:
            ...     permit.send("x")
            >>> rx.recv_nowait()
            'x'
            >>> tx.close(); rx.close()
        """
        state = self._state
        with state.lock:
            if not self._try_token(None):
                raise Full(f"channel is full (capacity {state.capacity}); no slot to reserve")
            state.reserved += 1
        return Permit(state)

    def _try_token(self, item: Any) -> bool:
        """(Lock held.) Raise if closed; take a free slot's token if there is one."""
        state = self._state
        if self._closed or state.receiver_closed:
            raise self._closed_error(item)
        try:
            state.tokens.pop()
        except IndexError:
            return False
        return True

    def _wait_for_token(self, item: Any, timeout: float | None) -> None:
        """Block (lock held) until a slot token is ours; raise if closed or timed out."""
        state = self._state
        deadline = _deadline(timeout)
        start = time.perf_counter()
        state.send_waiting += 1  # register, then check: no lost wake-up
        try:
            while True:
                if self._closed or state.receiver_closed:
                    raise self._closed_error(item)
                # Before the attempt, not after: a slot freed between a failed pop and the wait below
                # must see wake_pending False and notify, or this producer would sleep through it.
                state.wake_pending = False
                try:
                    state.tokens.pop()
                    return
                except IndexError:
                    pass
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise SendTimeout(
                        f"channel stayed full (capacity {state.capacity}) for {timeout} s; item handed back",
                        item,
                    )
                state.not_full.wait(remaining)
        finally:
            state.send_waiting -= 1
            state.blocked_send_seconds += time.perf_counter() - start

    def _closed_error(self, item: Any) -> ChannelClosed:
        if self._closed:
            message = "send on a closed Sender: you closed it; send through an open clone"
            return ChannelClosed(message, item, "sender")
        message = "send on a channel whose receiver is closed: the consumer went away"
        return ChannelClosed(message, item, "receiver")

    # -- lifecycle ----------------------------------------------------------------------------------

    def clone(self) -> Sender[T_contra]:
        """A new sender on the same channel (the channel stays open until every clone is closed).

        Raises:
            ChannelClosed: this sender is closed.
        """
        with self._state.lock:  # check and register atomically: a racing close() cannot slip between
            if self._closed:
                raise ChannelClosed("cannot clone a closed Sender: clone an open one", None, "sender")
            return Sender(self._state, warn_on_leak=self._warn_on_leak)

    def close(self) -> None:
        """Close this sender. When the last clone closes, the receiver drains and then ends. Idempotent."""
        state = self._state
        with state.lock:
            if self._closed:
                return
            self._closed = True
            state.open_senders -= 1
            state.wake_senders()  # a send blocked on this very sender must raise ChannelClosed now
            state.maybe_end()


class Permit(_Closing, Generic[T_contra]):
    """One reserved slot. ``send(item)`` cannot block or fail; an unused permit frees its slot on
    ``close()``, on leaving its ``with`` block, or when garbage-collected."""

    __slots__ = ("_state", "_used")

    def __init__(self, state: _State[Any]) -> None:
        self._state = state
        self._used = False

    def send(self, item: T_contra) -> None:
        """Buffer ``item`` in the reserved slot, even if the channel closed meanwhile. Never blocks.

        Raises:
            RuntimeError: the permit was already used or released (a bug in the caller).
        """
        state = self._state
        with state.lock:
            if self._used:
                raise RuntimeError("this Permit was already used or released; reserve a new one")
            self._used = True
            state.reserved -= 1
            state.put(item)
            state.maybe_end()

    def close(self) -> None:
        """Release the slot if it was not used. Idempotent."""
        state = self._state
        with state.lock:
            if self._used:
                return
            self._used = True
            state.reserved -= 1
            state.tokens.append(_TOKEN)
            state.wake_senders()
            state.maybe_end()

    def __del__(self) -> None:
        if not getattr(self, "_used", True):
            self.close()

    def __repr__(self) -> str:
        return f"<Permit {'used' if self._used else 'held'}>"


class Receiver(_Endpoint, Generic[T_co]):
    """The receiving endpoint: one per channel, used by one consumer at a time.

    Iterate it (sync or async) until the channel ends.
    """

    __slots__ = ("_report_lag",)

    def __init__(self, state: _State[Any], *, report_lag: bool = False, warn_on_leak: bool = True) -> None:
        super().__init__(state, warn_on_leak)
        # Subscriptions raise Lagged(n) before the first item after an eviction (tokio broadcast).
        self._report_lag = report_lag

    def recv_nowait(self) -> T_co:
        """Take the oldest buffered item; never blocks.

        Raises:
            Empty: nothing buffered yet, but senders are still open.
            EndOfChannel: closed and drained — nothing will ever arrive.
        """
        if self._report_lag:
            self._raise_if_lagged()
        try:
            item = self._state.buffer.get_nowait()
        except queue.Empty:
            raise Empty("channel is empty (senders still open)") from None
        return self._accept(item)

    def recv(self, timeout: float | None = None) -> T_co:
        """Take the oldest item, blocking the calling thread until one arrives.

        Raises:
            RecvTimeout: nothing arrived within ``timeout`` seconds.
            EndOfChannel: closed and drained.
        """
        if self._report_lag:
            self._raise_if_lagged()
        if timeout is not None:
            timeout = _check_timeout(timeout)
        state = self._state
        try:
            item = state.buffer.get(True, timeout)
        except queue.Empty:
            raise RecvTimeout(f"no item arrived within {timeout} s") from None
        if item is _END:
            return self._accept(item)
        # inlined state.returned(1): this is the consumer's per-item hot path
        state.tokens.append(_TOKEN)
        state.received += 1
        if (state.send_waiting and not state.wake_pending) or state.async_send:
            state.room_freed()
        return item  # type: ignore[no-any-return]  # (no cast(): a call per item)

    def recv_many(self, limit: int, timeout: float | None = None) -> list[T_co]:
        """Take up to ``limit`` items at once, blocking until at least one arrives.

        Returns an empty list only when the channel is closed and drained, so
        ``while batch := rx.recv_many(256): ...`` drains everything.

        Raises:
            RecvTimeout: nothing arrived within ``timeout`` seconds.
        """
        check_int(limit, "limit")
        if self._report_lag:
            self._raise_if_lagged()
            limit = 1  # a batch must never straddle a gap
        if timeout is not None:
            timeout = _check_timeout(timeout)
        buffer = self._state.buffer
        try:
            first = buffer.get(True, timeout)
        except queue.Empty:
            raise RecvTimeout(f"no item arrived within {timeout} s") from None
        if first is _END:
            buffer.put(_END)
            return []
        items = [first]
        get = buffer.get_nowait
        try:
            while len(items) < limit:
                item = get()
                if item is _END:
                    buffer.put(_END)
                    break
                items.append(item)
        except queue.Empty:
            pass
        self._state.returned(len(items))
        return items

    async def recv_async(self) -> T_co:
        """Take the oldest item, suspending the calling task (asyncio or trio) until one arrives.

        Raises:
            EndOfChannel: closed and drained.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        state = self._state
        while True:
            try:
                if self._report_lag:  # exact: evictions happen under the lock
                    with state.lock:
                        self._raise_if_lagged()
                        item = state.buffer.get_nowait()
                else:
                    item = state.buffer.get_nowait()
                break
            except queue.Empty:
                pass
            with state.lock:
                wake, wait = async_waker()
                state.async_recv.append(wake)  # register, then check: producers put under the lock
                if state.buffer.qsize():
                    state.async_recv.remove(wake)
                    continue
            try:
                await wait()
            finally:
                with state.lock:
                    if wake in state.async_recv:
                        state.async_recv.remove(wake)
        result = self._accept(item)
        await anyio.lowlevel.cancel_shielded_checkpoint()
        return result

    def _accept(self, item: Any) -> T_co:
        """Account for one item taken from the buffer; turn the end sentinel into EndOfChannel."""
        state = self._state
        if item is _END:
            state.buffer.put(_END)  # sticky: every later receive sees the end too
            raise EndOfChannel("channel closed and drained")
        state.returned(1)
        return cast(T_co, item)

    def _raise_if_lagged(self) -> None:
        state = self._state
        if state.missed:
            with state.lock:
                missed, state.missed = state.missed, 0
            if missed:
                raise Lagged(missed)

    # -- iteration ------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[T_co]:
        return self

    def __next__(self) -> T_co:
        try:
            return self.recv()
        except EndOfChannel:
            raise StopIteration from None

    def __aiter__(self) -> AsyncIterator[T_co]:
        return self

    async def __anext__(self) -> T_co:
        try:
            return await self.recv_async()
        except EndOfChannel:
            raise StopAsyncIteration from None

    # -- lifecycle ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop new sends (they raise :class:`~streamwatch.ChannelClosed` with ``by="receiver"``); items
        already buffered or reserved still drain through ``recv``. Idempotent. Thread-safe."""
        state = self._state
        with state.lock:
            if self._closed:
                return
            self._closed = True
            state.receiver_closed = True
            state.wake_senders()
            state.maybe_end()
