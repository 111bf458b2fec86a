"""The channel by example: argument errors, backpressure, close/drain, permits, overflow policies, statistics,
leaks. Properties: test_channel_properties.py; the async faces: test_channel_async.py.

No test sleeps: a thread that must block is detected through the channel's own waiter count (white-box, see
``blocked_senders``), and real timeouts (0.01 s) appear only where the timeout itself is under test.
"""

from __future__ import annotations

import contextlib
import gc
import math
import re
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import FrozenInstanceError, fields
from typing import Any

import pytest

import streamwatch as sw
from tests.threads import JOIN_S, Spawned, spawn, wait_until


def blocked_senders(tx: sw.Sender[Any]) -> int:
    """Threads blocked in ``send``/``reserve``/``offer(policy="block")`` (white-box: the waiter count)."""
    return int(tx._state.send_waiting)


@pytest.fixture
def make_channel() -> Iterator[Callable[..., tuple[sw.Sender[Any], sw.Receiver[Any]]]]:
    """``channel(...)`` whose two endpoints are closed at teardown (clones are the test's own business)."""
    made: list[tuple[sw.Sender[Any], sw.Receiver[Any]]] = []

    def make(capacity: int, **kwargs: Any) -> tuple[sw.Sender[Any], sw.Receiver[Any]]:
        pair = sw.channel(capacity, **kwargs)
        made.append(pair)
        return pair

    yield make
    for tx, rx in made:
        tx.close()
        rx.close()


def drain(rx: sw.Receiver[Any]) -> list[Any]:
    """Everything left in an ended channel (fails instead of hanging if it never ends)."""
    items = []
    while True:
        try:
            items.append(rx.recv(timeout=JOIN_S))
        except sw.EndOfChannel:
            return items


def full_channel(make: Callable[..., tuple[sw.Sender[Any], sw.Receiver[Any]]]) -> tuple[Any, Any]:
    tx, rx = make(1)
    tx.send_nowait("a")
    return tx, rx


def check_invariant(stats: sw.ChannelStatistics) -> None:
    assert stats.sent == stats.received + stats.len + stats.dropped_oldest


# -- construction --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capacity", "shown"),
    [(0, "0"), (-1, "-1"), (1.5, r"1\.5"), (True, "True"), ("3", "'3'"), (None, "None")],
    ids=["zero", "negative", "float", "bool", "str", "none"],
)
def test_channel_rejects_a_capacity_that_is_not_an_integer_of_at_least_one(capacity: Any, shown: str) -> None:
    with pytest.raises(ValueError, match=f"^Expected `capacity` to be a positive integer, got {shown}$"):
        sw.channel(capacity)


def test_channel_rejects_an_on_drop_that_is_not_callable() -> None:
    with pytest.raises(TypeError, match=r"^Expected `on_drop` to be callable or None, got 'log'$"):
        sw.channel(1, on_drop="log")


def test_channel_returns_an_open_pair_with_empty_statistics() -> None:
    tx, rx = sw.channel(3)
    with tx, rx:
        assert (tx.closed, rx.closed) == (False, False)
        assert repr(tx) == "<Sender open capacity=3>"
        assert repr(rx) == "<Receiver open capacity=3>"
        assert tx.statistics() == sw.ChannelStatistics(
            capacity=3,
            len=0,
            reserved=0,
            sent=0,
            received=0,
            dropped_oldest=0,
            dropped_newest=0,
            high_water=0,
            open_senders=1,
            blocked_send_seconds=0.0,
            closed=False,
        )
    assert repr(tx) == "<Sender closed capacity=3>"
    assert repr(rx) == "<Receiver closed capacity=3>"


# -- the exception tree --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc_type", "builtin"),
    [
        (sw.WouldBlock, BlockingIOError),
        (sw.Full, BlockingIOError),
        (sw.Empty, BlockingIOError),
        (sw.SendTimeout, TimeoutError),
        (sw.RecvTimeout, TimeoutError),
        (sw.ChannelClosed, BrokenPipeError),
        (sw.EndOfChannel, EOFError),
        (sw.Lagged, RuntimeError),
        (sw.PipelineError, RuntimeError),
    ],
    ids=lambda value: value.__name__,
)
def test_every_public_exception_is_a_streamwatch_error_and_its_builtin(
    exc_type: type[Exception], builtin: type[Exception]
) -> None:
    assert issubclass(exc_type, sw.StreamwatchError)
    assert issubclass(exc_type, builtin)


def test_full_and_empty_are_both_would_block_but_end_of_channel_is_not() -> None:
    assert issubclass(sw.Full, sw.WouldBlock)
    assert issubclass(sw.Empty, sw.WouldBlock)
    assert not issubclass(sw.EndOfChannel, sw.WouldBlock)
    assert not issubclass(sw.Empty, EOFError)


# -- non-blocking send and receive ---------------------------------------------------------------------


def test_items_arrive_in_the_order_they_were_sent(make_channel: Any) -> None:
    tx, rx = make_channel(4)
    for item in ["a", "b", "c"]:
        tx.send_nowait(item)
    assert [rx.recv_nowait() for _ in range(3)] == ["a", "b", "c"]


def test_send_nowait_on_a_full_channel_raises_full_carrying_the_item(make_channel: Any) -> None:
    tx, rx = full_channel(make_channel)
    item = object()
    with pytest.raises(sw.Full, match=r"^channel is full \(capacity 1\); item handed back$") as info:
        tx.send_nowait(item)
    assert info.value.item is item
    assert isinstance(info.value, sw.WouldBlock)
    assert isinstance(info.value, BlockingIOError)
    assert isinstance(info.value, sw.StreamwatchError)
    assert tx.statistics().sent == 1
    assert rx.recv_nowait() == "a"
    with pytest.raises(sw.Empty):
        rx.recv_nowait()


def test_recv_nowait_on_an_empty_open_channel_raises_empty(make_channel: Any) -> None:
    _, rx = make_channel(1)
    with pytest.raises(sw.Empty, match=r"^channel is empty \(senders still open\)$") as info:
        rx.recv_nowait()
    assert isinstance(info.value, sw.WouldBlock)
    assert not isinstance(info.value, sw.EndOfChannel)


def test_recv_nowait_tells_empty_from_closed_and_drained(make_channel: Any) -> None:
    tx, rx = make_channel(2)
    tx.send_nowait("last")
    tx.close()
    assert rx.recv_nowait() == "last"
    with pytest.raises(sw.EndOfChannel, match=r"^channel closed and drained$") as info:
        rx.recv_nowait()
    assert isinstance(info.value, EOFError)
    assert not isinstance(info.value, sw.WouldBlock)


# -- timeouts ------------------------------------------------------------------------------------------


def test_send_with_a_timeout_on_a_full_channel_raises_send_timeout_carrying_the_item(
    make_channel: Any,
) -> None:
    tx, rx = full_channel(make_channel)
    expected = r"^channel stayed full \(capacity 1\) for 0\.01 s; item handed back$"
    with pytest.raises(sw.SendTimeout, match=expected) as info:
        tx.send("b", timeout=0.01)
    assert info.value.item == "b"
    assert isinstance(info.value, TimeoutError)
    stats = tx.statistics()
    assert (stats.sent, stats.len) == (1, 1)
    assert stats.blocked_send_seconds >= 0.01
    assert rx.recv_nowait() == "a"


def test_send_with_a_zero_timeout_on_a_full_channel_fails_at_once(make_channel: Any) -> None:
    tx, _ = full_channel(make_channel)
    with pytest.raises(sw.SendTimeout) as info:
        tx.send("b", timeout=0)
    assert info.value.item == "b"


def test_send_with_a_timeout_succeeds_at_once_when_there_is_room(make_channel: Any) -> None:
    tx, rx = make_channel(1)
    tx.send("a", timeout=0)
    assert rx.recv_nowait() == "a"
    assert tx.statistics().blocked_send_seconds == 0.0


def test_recv_with_a_timeout_on_an_empty_channel_raises_recv_timeout(make_channel: Any) -> None:
    _, rx = make_channel(1)
    with pytest.raises(sw.RecvTimeout, match=r"^no item arrived within 0\.01 s$") as info:
        rx.recv(timeout=0.01)
    assert isinstance(info.value, TimeoutError)
    with pytest.raises(sw.RecvTimeout, match=r"^no item arrived within 0\.01 s$"):
        rx.recv_many(4, timeout=0.01)


def test_recv_with_a_zero_timeout_returns_a_buffered_item(make_channel: Any) -> None:
    tx, rx = make_channel(2)
    tx.send_nowait("a")
    tx.send_nowait("b")
    assert rx.recv(timeout=0) == "a"
    assert rx.recv_many(8, timeout=0) == ["b"]


BLOCKING_CALLS: dict[str, Callable[[sw.Sender[Any], sw.Receiver[Any], Any], object]] = {
    "recv": lambda tx, rx, timeout: rx.recv(timeout=timeout),
    "recv_many": lambda tx, rx, timeout: rx.recv_many(2, timeout=timeout),
    "send": lambda tx, rx, timeout: tx.send("b", timeout=timeout),
    "reserve": lambda tx, rx, timeout: tx.reserve(timeout=timeout),
    "offer_block": lambda tx, rx, timeout: tx.offer("b", "block", timeout=timeout),
}
BAD_TIMEOUTS = [-1, -0.001, True, math.nan, "1"]


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS, ids=["negative", "tiny-negative", "bool", "nan", "str"])
@pytest.mark.parametrize("call", BLOCKING_CALLS, ids=str)
def test_blocking_calls_reject_an_invalid_timeout_when_they_would_wait(
    make_channel: Any, call: str, timeout: Any
) -> None:
    tx, rx = make_channel(1)
    if call not in ("recv", "recv_many"):
        tx.send_nowait("a")  # full: the send side would wait
    expected = f"^Expected `timeout` to be None or a number of seconds >= 0, got {re.escape(repr(timeout))}$"
    with pytest.raises(ValueError, match=expected):
        BLOCKING_CALLS[call](tx, rx, timeout)
    stats = tx.statistics()
    assert (stats.received, stats.reserved, stats.blocked_send_seconds) == (0, 0, 0.0)
    assert stats.sent == (0 if call.startswith("recv") else 1)


@pytest.mark.parametrize("call", ["send", "reserve", "offer_block"])
def test_send_side_rejects_an_invalid_timeout_even_when_there_is_room(make_channel: Any, call: str) -> None:
    tx, rx = make_channel(1)
    with pytest.raises(
        ValueError, match=r"^Expected `timeout` to be None or a number of seconds >= 0, got -1$"
    ):
        BLOCKING_CALLS[call](tx, rx, -1)


def test_recv_with_an_infinite_timeout_returns_a_buffered_item(make_channel: Any) -> None:
    tx, rx = make_channel(1)
    tx.send_nowait("a")
    assert rx.recv(timeout=math.inf) == "a"


def test_send_with_an_infinite_timeout_waits_like_no_timeout(make_channel: Any) -> None:
    tx, rx = full_channel(make_channel)
    worker = spawn(tx.send, "b", math.inf)
    wait_until(lambda: blocked_senders(tx) or not worker.is_alive(), "the sender blocks")
    assert rx.recv() == "a"
    worker.finish()
    assert rx.recv_nowait() == "b"


# -- blocking send and receive across threads ----------------------------------------------------------


def test_blocked_send_resumes_when_the_consumer_receives(make_channel: Any) -> None:
    tx, rx = full_channel(make_channel)
    worker = spawn(tx.send, "b")
    wait_until(lambda: blocked_senders(tx) == 1, "the sender blocks")
    assert rx.recv() == "a"
    assert worker.finish() is None
    assert rx.recv_nowait() == "b"
    stats = tx.statistics()
    assert (stats.sent, stats.received, stats.high_water) == (2, 2, 1)
    assert stats.blocked_send_seconds > 0
    assert blocked_senders(tx) == 0


def test_several_blocked_senders_all_get_through_one_slot(make_channel: Any) -> None:
    tx, rx = full_channel(make_channel)
    clones = [tx.clone() for _ in range(3)]
    workers = [spawn(clone.send, n) for n, clone in enumerate(clones)]
    wait_until(lambda: blocked_senders(tx) == 3, "three senders block")
    received = [rx.recv(timeout=JOIN_S) for _ in range(4)]
    for worker, clone in zip(workers, clones, strict=True):
        worker.finish()
        clone.close()
    assert received[0] == "a"
    assert sorted(received[1:]) == [0, 1, 2]


def test_blocked_send_raises_channel_closed_by_receiver_when_the_receiver_closes(make_channel: Any) -> None:
    tx, rx = full_channel(make_channel)
    worker = spawn(tx.send, "b")
    wait_until(lambda: blocked_senders(tx) == 1, "the sender blocks")
    rx.close()
    expected = r"^send on a channel whose receiver is closed: the consumer went away$"
    with pytest.raises(sw.ChannelClosed, match=expected) as info:
        worker.finish()
    assert (info.value.item, info.value.by) == ("b", "receiver")
    assert isinstance(info.value, BrokenPipeError)
    assert drain(rx) == ["a"]  # closing never discards what was buffered


def test_blocked_send_raises_channel_closed_when_its_own_sender_is_closed(make_channel: Any) -> None:
    tx, rx = full_channel(make_channel)
    worker = spawn(tx.send, "b")
    wait_until(lambda: blocked_senders(tx) == 1, "the sender blocks")
    tx.close()
    worker.join(1.0)
    woken = not worker.is_alive()
    if not woken:
        rx.recv()  # free the slot so the stuck thread can finish before teardown
    with pytest.raises(sw.ChannelClosed) as info:
        worker.finish()
    assert (info.value.item, info.value.by) == ("b", "sender")
    assert woken, "the blocked send was only released by a later receive"


SEND_CALLS: dict[str, Callable[[sw.Sender[Any]], object]] = {
    "send": lambda tx: tx.send("x"),
    "send_timeout": lambda tx: tx.send("x", timeout=0),
    "send_nowait": lambda tx: tx.send_nowait("x"),
    "offer_drop_oldest": lambda tx: tx.offer("x"),
    "offer_drop_newest": lambda tx: tx.offer("x", "drop_newest"),
    "offer_block": lambda tx: tx.offer("x", "block"),
    "offer_error": lambda tx: tx.offer("x", "error"),
    "reserve": lambda tx: tx.reserve(),
    "reserve_nowait": lambda tx: tx.reserve_nowait(),
}


@pytest.mark.parametrize("call", SEND_CALLS, ids=str)
def test_send_on_a_closed_sender_raises_channel_closed_by_sender(make_channel: Any, call: str) -> None:
    tx, rx = make_channel(1)
    other = tx.clone()  # the channel itself stays open: only this sender is closed
    tx.close()
    expected = r"^send on a closed Sender: you closed it; send through an open clone$"
    with pytest.raises(sw.ChannelClosed, match=expected) as info:
        SEND_CALLS[call](tx)
    assert info.value.by == "sender"
    assert info.value.item == (None if call.startswith("reserve") else "x")
    other.close()
    assert drain(rx) == []


@pytest.mark.parametrize("call", SEND_CALLS, ids=str)
def test_send_after_the_receiver_closed_raises_channel_closed_by_receiver(
    make_channel: Any, call: str
) -> None:
    tx, rx = make_channel(1)
    rx.close()
    expected = r"^send on a channel whose receiver is closed: the consumer went away$"
    with pytest.raises(sw.ChannelClosed, match=expected) as info:
        SEND_CALLS[call](tx)
    assert info.value.by == "receiver"
    assert info.value.item == (None if call.startswith("reserve") else "x")
    assert tx.statistics().sent == 0


def test_blocked_recv_resumes_when_a_thread_sends(make_channel: Any) -> None:
    tx, rx = make_channel(1)
    worker = spawn(rx.recv)
    tx.send("x")
    assert worker.finish() == "x"


def test_blocked_recv_ends_when_the_last_sender_closes(make_channel: Any) -> None:
    tx, rx = make_channel(1)
    worker = spawn(rx.recv)
    tx.close()
    with pytest.raises(sw.EndOfChannel):
        worker.finish()


class _HookedTokens(deque[Any]):
    """The slot-token deque, calling ``hook`` once when a *blocked* producer finds no token."""

    def __init__(self, tokens: deque[Any], state: Any, hook: Callable[[], None]) -> None:
        super().__init__(tokens)
        self.state, self.hook, self.fired = state, hook, False

    def pop(self) -> Any:
        try:
            return super().pop()
        except IndexError:
            if self.state.send_waiting and not self.fired:  # inside _wait_for_token, before its wait
                self.fired = True
                self.hook()
            raise


def test_blocked_send_is_woken_when_a_slot_frees_just_before_it_waits(make_channel: Any) -> None:
    tx, rx = full_channel(make_channel)
    # One ordinary blocked-send round: the consumer's wake-up leaves wake_pending set behind it.
    worker = spawn(tx.send, "b")
    wait_until(lambda: blocked_senders(tx) == 1, "the first sender blocks")
    assert rx.recv() == "a"
    worker.finish()

    consumers: list[Spawned] = []

    def consumer_frees_the_slot() -> None:  # on another thread, as the real consumer would
        consumers.append(spawn(rx.recv))
        consumers[0].join(0.2)  # a correct channel makes it wait for the producer's lock: stop waiting

    state = tx._state
    state.tokens = _HookedTokens(state.tokens, state, consumer_frees_the_slot)
    sender = spawn(tx.send, "c")
    sender.join(2.0)
    stuck = sender.is_alive()
    if stuck:
        rx.close()  # wakes every blocked sender: it raises ChannelClosed
    with pytest.raises(sw.ChannelClosed) if stuck else contextlib.nullcontext():
        sender.finish()
    assert consumers[0].finish() == "b"
    assert not stuck, "send('c') stayed blocked although its slot was free"
    assert rx.recv_nowait() == "c"


# -- clones and close ------------------------------------------------------------------------------------


def test_channel_stays_open_until_every_clone_closes(make_channel: Any) -> None:
    tx, rx = make_channel(4)
    clone = tx.clone()
    assert tx.statistics().open_senders == 2
    tx.close()
    stats = rx.statistics()
    assert (stats.open_senders, stats.closed) == (1, False)
    with pytest.raises(sw.Empty):  # not EndOfChannel: the clone can still send
        rx.recv_nowait()
    clone.send_nowait("from the clone")
    clone.close()
    assert rx.statistics().closed
    assert list(rx) == ["from the clone"]


def test_receiver_drains_buffered_items_after_the_last_sender_closes_then_ends(make_channel: Any) -> None:
    tx, rx = make_channel(4)
    for n in range(3):
        tx.send_nowait(n)
    tx.close()
    assert rx.statistics().len == 3
    assert list(rx) == [0, 1, 2]
    assert list(rx) == []


def test_clone_of_a_closed_sender_raises_channel_closed(make_channel: Any) -> None:
    tx, _ = make_channel(1)
    tx.close()
    with pytest.raises(sw.ChannelClosed, match=r"^cannot clone a closed Sender: clone an open one$") as info:
        tx.clone()
    assert (info.value.by, info.value.item) == ("sender", None)


def test_sender_close_is_idempotent(make_channel: Any) -> None:
    tx, rx = make_channel(1)
    clone = tx.clone()
    tx.close()
    tx.close()
    assert tx.closed
    assert rx.statistics().open_senders == 1  # counted once
    clone.close()
    assert rx.statistics().open_senders == 0


def test_endpoints_close_on_leaving_their_with_blocks() -> None:
    tx, rx = sw.channel(1)
    with tx as entered_tx, rx as entered_rx:
        assert (entered_tx, entered_rx) == (tx, rx)
    assert (tx.closed, rx.closed) == (True, True)


def test_receiver_close_rejects_new_sends_but_buffered_items_still_drain(make_channel: Any) -> None:
    tx, rx = make_channel(4)
    tx.send_nowait(1)
    tx.send_nowait(2)
    rx.close()
    rx.close()  # idempotent
    assert rx.closed
    assert not tx.closed
    assert tx.statistics().closed
    with pytest.raises(sw.ChannelClosed):
        tx.send_nowait(3)
    assert rx.recv() == 1
    assert rx.recv_nowait() == 2
    with pytest.raises(sw.EndOfChannel):
        rx.recv()


def test_end_of_channel_is_sticky_for_every_receive(make_channel: Any) -> None:
    tx, rx = make_channel(2)
    tx.send_nowait("only")
    tx.close()
    assert rx.recv_many(8) == ["only"]
    for _ in range(3):
        with pytest.raises(sw.EndOfChannel):
            rx.recv()
        with pytest.raises(sw.EndOfChannel):
            rx.recv_nowait()
        with pytest.raises(sw.EndOfChannel):
            rx.recv(timeout=0)
        assert rx.recv_many(8) == []
        assert list(rx) == []
    stats = rx.statistics()
    assert (stats.len, stats.sent, stats.received) == (0, 1, 1)


# -- permits ------------------------------------------------------------------------------------------


def test_reserve_nowait_holds_a_slot(make_channel: Any) -> None:
    tx, _ = make_channel(1)
    permit = tx.reserve_nowait()
    assert repr(permit) == "<Permit held>"
    with pytest.raises(sw.Full, match=r"^channel is full \(capacity 1\); no slot to reserve$") as info:
        tx.reserve_nowait()
    assert info.value.item is None
    with pytest.raises(sw.Full):
        tx.send_nowait("x")
    stats = tx.statistics()
    assert (stats.reserved, stats.len, stats.sent) == (1, 0, 0)
    permit.close()


def test_permit_send_buffers_the_item(make_channel: Any) -> None:
    tx, rx = make_channel(1)
    with tx.reserve() as permit:
        permit.send("x")
    assert repr(permit) == "<Permit used>"
    stats = tx.statistics()
    assert (stats.reserved, stats.len, stats.sent) == (0, 1, 1)
    assert rx.recv_nowait() == "x"


def test_permit_send_cannot_fail_after_the_receiver_closed(make_channel: Any) -> None:
    tx, rx = make_channel(1)
    permit = tx.reserve_nowait()
    rx.close()
    with pytest.raises(sw.Empty):  # the reserved item is still to come: not the end yet
        rx.recv_nowait()
    permit.send("promised")
    assert rx.recv_nowait() == "promised"
    with pytest.raises(sw.EndOfChannel):
        rx.recv_nowait()


def _release_with_block(tx: sw.Sender[Any]) -> None:
    with tx.reserve_nowait():
        pass


def _release_with_close(tx: sw.Sender[Any]) -> None:
    tx.reserve_nowait().close()


def _release_by_collection(tx: sw.Sender[Any]) -> None:
    permit = tx.reserve_nowait()
    assert tx.statistics().reserved == 1
    del permit
    gc.collect()


@pytest.mark.parametrize(
    "release",
    [_release_with_block, _release_with_close, _release_by_collection],
    ids=["context-exit", "close", "garbage-collected"],
)
def test_unused_permit_releases_its_slot(
    make_channel: Any, release: Callable[[sw.Sender[Any]], None]
) -> None:
    tx, rx = make_channel(1)
    release(tx)
    assert tx.statistics().reserved == 0
    tx.send_nowait("fits again")
    assert rx.recv_nowait() == "fits again"


def test_releasing_a_permit_wakes_a_blocked_sender(make_channel: Any) -> None:
    tx, rx = make_channel(1)
    permit = tx.reserve_nowait()
    worker = spawn(tx.send, "waiting")
    wait_until(lambda: blocked_senders(tx) == 1, "the sender blocks")
    permit.close()
    worker.finish()
    assert rx.recv_nowait() == "waiting"


@pytest.mark.parametrize("first", ["send", "close"])
def test_using_a_permit_twice_raises_runtime_error(make_channel: Any, first: str) -> None:
    tx, _ = make_channel(2)
    permit = tx.reserve_nowait()
    if first == "send":
        permit.send(1)
    else:
        permit.close()
    with pytest.raises(RuntimeError, match=r"^this Permit was already used or released; reserve a new one$"):
        permit.send(2)
    permit.close()  # a no-op now: the slot is not released twice
    stats = tx.statistics()
    assert (stats.reserved, stats.sent) == (0, 1 if first == "send" else 0)
    tx.send_nowait("a")
    if first == "close":
        tx.send_nowait("b")
    with pytest.raises(sw.Full):  # exactly `capacity` slots exist: none was released twice
        tx.send_nowait("over")


def test_outstanding_permit_keeps_the_channel_from_ending(make_channel: Any) -> None:
    tx, rx = make_channel(2)
    tx.send_nowait("before")
    permit = tx.reserve_nowait()
    tx.close()
    stats = rx.statistics()
    assert (stats.open_senders, stats.reserved, stats.closed) == (0, 1, True)
    assert rx.recv_nowait() == "before"
    with pytest.raises(sw.Empty):
        rx.recv_nowait()
    worker = spawn(drain, rx)
    permit.send("late")
    assert worker.finish() == ["late"]


def test_releasing_the_last_permit_unused_ends_the_channel(make_channel: Any) -> None:
    tx, rx = make_channel(1)
    permit = tx.reserve_nowait()
    tx.close()
    worker = spawn(rx.recv)
    permit.close()
    with pytest.raises(sw.EndOfChannel):
        worker.finish()


def test_blocked_reserve_resumes_when_a_slot_frees(make_channel: Any) -> None:
    tx, rx = full_channel(make_channel)
    worker = spawn(tx.reserve)
    wait_until(lambda: blocked_senders(tx) == 1, "reserve blocks")
    assert rx.recv() == "a"
    permit = worker.finish()
    assert tx.statistics().reserved == 1
    permit.send("b")
    assert rx.recv_nowait() == "b"


def test_reserve_with_a_timeout_raises_send_timeout(make_channel: Any) -> None:
    tx, _ = full_channel(make_channel)
    with pytest.raises(sw.SendTimeout, match=r"^channel stayed full \(capacity 1\) for 0\.01 s") as info:
        tx.reserve(timeout=0.01)
    assert info.value.item is None
    assert tx.statistics().reserved == 0


def test_blocked_reserve_raises_channel_closed_when_the_receiver_closes(make_channel: Any) -> None:
    tx, rx = full_channel(make_channel)
    worker = spawn(tx.reserve)
    wait_until(lambda: blocked_senders(tx) == 1, "reserve blocks")
    rx.close()
    with pytest.raises(sw.ChannelClosed) as info:
        worker.finish()
    assert (info.value.by, info.value.item) == ("receiver", None)
    assert tx.statistics().reserved == 0


# -- recv_many ---------------------------------------------------------------------------------------


def test_recv_many_returns_up_to_limit_items_in_order(make_channel: Any) -> None:
    tx, rx = make_channel(8)
    for n in range(5):
        tx.send_nowait(n)
    assert rx.recv_many(3) == [0, 1, 2]
    assert rx.recv_many(3) == [3, 4]
    assert rx.statistics().received == 5


def test_recv_many_blocks_until_one_item_arrives_then_returns_without_waiting_for_more(
    make_channel: Any,
) -> None:
    tx, rx = make_channel(8)
    worker = spawn(rx.recv_many, 64)
    tx.send("x")
    assert worker.finish() == ["x"]


def test_recv_many_returns_an_empty_list_only_when_closed_and_drained(make_channel: Any) -> None:
    tx, rx = make_channel(8)
    tx.send_nowait(0)
    assert rx.recv_many(4) == [0]
    with pytest.raises(sw.RecvTimeout):  # open and empty: it waits (here: times out), never returns []
        rx.recv_many(4, timeout=0)
    tx.send_nowait(1)
    tx.close()
    assert rx.recv_many(4) == [1]
    assert rx.recv_many(4) == []
    assert rx.recv_many(4) == []


def test_recv_many_frees_the_slots_it_takes(make_channel: Any) -> None:
    tx, rx = make_channel(2)
    tx.send_nowait(0)
    tx.send_nowait(1)
    worker = spawn(tx.send, 2)
    wait_until(lambda: blocked_senders(tx) == 1, "the sender blocks")
    assert rx.recv_many(2) == [0, 1]
    worker.finish()
    tx.send_nowait(3)
    assert rx.recv_many(8) == [2, 3]


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "2"], ids=["zero", "negative", "float", "bool", "str"])
def test_recv_many_rejects_an_invalid_limit(make_channel: Any, limit: Any) -> None:
    tx, rx = make_channel(1)
    tx.send_nowait("kept")
    expected = f"^Expected `limit` to be a positive integer, got {re.escape(repr(limit))}$"
    with pytest.raises(ValueError, match=expected):
        rx.recv_many(limit)
    assert rx.recv_nowait() == "kept"


# -- offer and overflow policies ------------------------------------------------------------------------


class DropLog:
    """An ``on_drop`` callback that records ``(item, reason)`` pairs."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, str]] = []

    def __call__(self, item: Any, reason: str) -> None:
        self.calls.append((item, reason))


@pytest.mark.parametrize("policy", sw.OVERFLOW_POLICIES)
def test_offer_buffers_the_item_when_there_is_room_under_every_policy(make_channel: Any, policy: str) -> None:
    log = DropLog()
    tx, rx = make_channel(1, on_drop=log)
    assert tx.offer("x", policy) is True
    assert rx.recv_nowait() == "x"
    assert log.calls == []
    assert tx.statistics().dropped == 0


def test_offer_drop_oldest_evicts_the_oldest_items_when_full(make_channel: Any) -> None:
    log = DropLog()
    tx, rx = make_channel(2, on_drop=log)
    assert [tx.offer(n, "drop_oldest") for n in range(4)] == [True] * 4
    assert log.calls == [(0, "drop_oldest"), (1, "drop_oldest")]
    stats = tx.statistics()
    assert (stats.dropped_oldest, stats.dropped_newest, stats.dropped) == (2, 0, 2)
    assert (stats.sent, stats.len, stats.high_water) == (4, 2, 2)
    check_invariant(stats)
    assert [rx.recv_nowait(), rx.recv_nowait()] == [2, 3]


def test_offer_defaults_to_drop_oldest(make_channel: Any) -> None:
    log = DropLog()
    tx, rx = make_channel(1, on_drop=log)
    assert (tx.offer("old"), tx.offer("new")) == (True, True)
    assert log.calls == [("old", "drop_oldest")]
    assert rx.recv_nowait() == "new"


def test_offer_drop_newest_discards_the_new_item_when_full(make_channel: Any) -> None:
    log = DropLog()
    tx, rx = make_channel(2, on_drop=log)
    assert [tx.offer(n, "drop_newest") for n in range(4)] == [True, True, False, False]
    assert log.calls == [(2, "drop_newest"), (3, "drop_newest")]
    stats = tx.statistics()
    assert (stats.dropped_oldest, stats.dropped_newest, stats.dropped) == (0, 2, 2)
    assert (stats.sent, stats.len) == (2, 2)
    check_invariant(stats)
    assert rx.recv_many(8) == [0, 1]


def test_offer_drop_oldest_drops_the_new_item_when_every_slot_is_reserved(make_channel: Any) -> None:
    log = DropLog()
    tx, rx = make_channel(1, on_drop=log)
    permit = tx.reserve_nowait()
    assert tx.offer("x", "drop_oldest") is False  # nothing buffered to evict
    assert log.calls == [("x", "drop_newest")]
    stats = tx.statistics()
    assert (stats.dropped_oldest, stats.dropped_newest, stats.sent) == (0, 1, 0)
    permit.send("reserved")
    assert rx.recv_nowait() == "reserved"


def test_offer_error_raises_full_when_full(make_channel: Any) -> None:
    log = DropLog()
    tx, rx = make_channel(1, on_drop=log)
    tx.offer("a", "error")
    with pytest.raises(sw.Full, match=r"^channel is full \(capacity 1\); item handed back$") as info:
        tx.offer("b", "error")
    assert info.value.item == "b"
    assert log.calls == []
    assert tx.statistics().dropped == 0
    assert rx.recv_nowait() == "a"


def test_offer_block_waits_for_room(make_channel: Any) -> None:
    log = DropLog()
    tx, rx = make_channel(1, on_drop=log)
    tx.send_nowait("a")
    worker = spawn(tx.offer, "b", "block")
    wait_until(lambda: blocked_senders(tx) == 1, "offer blocks")
    assert rx.recv() == "a"
    assert worker.finish() is True
    assert rx.recv_nowait() == "b"
    assert log.calls == []
    stats = tx.statistics()
    assert stats.dropped == 0
    assert stats.blocked_send_seconds > 0


def test_offer_block_with_a_timeout_raises_send_timeout(make_channel: Any) -> None:
    log = DropLog()
    tx, _ = make_channel(1, on_drop=log)
    tx.send_nowait("a")
    with pytest.raises(sw.SendTimeout, match=r"^channel stayed full \(capacity 1\) for 0\.01 s") as info:
        tx.offer("b", "block", timeout=0.01)
    assert info.value.item == "b"
    assert log.calls == []
    assert (tx.statistics().dropped, tx.statistics().sent) == (0, 1)


@pytest.mark.parametrize("full", [False, True], ids=["room", "full"])
def test_offer_rejects_an_unknown_policy_whether_or_not_the_channel_is_full(
    make_channel: Any, full: bool
) -> None:
    tx, _ = make_channel(1)
    if full:
        tx.send_nowait("a")
    expected = (
        r"^Expected `policy` to be one of \('drop_oldest', 'drop_newest', 'block', 'error'\), got 'drop_all'$"
    )
    with pytest.raises(ValueError, match=expected):
        tx.offer("x", "drop_all")  # type: ignore[arg-type]
    assert tx.statistics().sent == int(full)


def test_on_drop_runs_on_the_producer_thread_outside_the_lock(make_channel: Any) -> None:
    seen: list[tuple[Any, str, threading.Thread, Any]] = []

    def on_drop(item: Any, reason: str) -> None:
        # Another thread must be able to take the channel's lock while on_drop runs.
        other = spawn(tx.statistics)
        seen.append((item, reason, threading.current_thread(), other.finish(timeout=2.0)))

    tx, rx = make_channel(1, on_drop=on_drop)
    tx.offer("a")
    tx.offer("b")  # evicts "a"
    tx.offer("c", "drop_newest")
    assert [(item, reason) for item, reason, _, _ in seen] == [("a", "drop_oldest"), ("c", "drop_newest")]
    assert all(thread is threading.current_thread() for _, _, thread, _ in seen)
    assert [stats.dropped for _, _, _, stats in seen] == [1, 2]
    assert rx.recv_nowait() == "b"


def test_drop_oldest_keeps_the_newest_capacity_items(make_channel: Any) -> None:
    log = DropLog()
    tx, rx = make_channel(3, on_drop=log)
    for n in range(10):
        tx.offer(n)
    assert log.calls == [(n, "drop_oldest") for n in range(7)]
    tx.close()
    assert list(rx) == [7, 8, 9]
    stats = rx.statistics()
    assert (stats.sent, stats.received, stats.dropped_oldest, stats.len) == (10, 3, 7, 0)
    check_invariant(stats)


# -- statistics -----------------------------------------------------------------------------------------


def test_statistics_is_a_frozen_snapshot(make_channel: Any) -> None:
    tx, _ = make_channel(2)
    before = tx.statistics()
    with pytest.raises(FrozenInstanceError):
        before.sent = 5  # type: ignore[misc]
    assert not hasattr(before, "__dict__")
    tx.send_nowait("x")
    assert before.sent == 0  # a snapshot, not a live view
    assert tx.statistics().sent == 1
    assert [field.name for field in fields(sw.ChannelStatistics)] == [
        "capacity",
        "len",
        "reserved",
        "sent",
        "received",
        "dropped_oldest",
        "dropped_newest",
        "high_water",
        "open_senders",
        "blocked_send_seconds",
        "closed",
    ]


def test_statistics_count_a_known_sequence_exactly(make_channel: Any) -> None:
    tx, rx = make_channel(3)
    clone = tx.clone()
    for n in range(3):
        tx.send_nowait(n)
    assert rx.recv_nowait() == 0
    tx.offer(3)  # room: buffered
    tx.offer(4)  # full: evicts 1
    tx.offer(5, "drop_newest")  # full: discarded
    permit_holder = rx.recv_nowait()  # 2 leaves; a slot frees for the permit
    permit = tx.reserve_nowait()
    stats = rx.statistics()
    assert permit_holder == 2
    assert stats == sw.ChannelStatistics(
        capacity=3,
        len=2,
        reserved=1,
        sent=5,
        received=2,
        dropped_oldest=1,
        dropped_newest=1,
        high_water=3,
        open_senders=2,
        blocked_send_seconds=0.0,
        closed=False,
    )
    assert stats == tx.statistics()  # both endpoints see the same channel
    assert stats.dropped == 2
    check_invariant(stats)
    permit.close()
    clone.close()


def test_statistics_invariant_holds_through_a_whole_run(make_channel: Any) -> None:
    tx, rx = make_channel(4)
    for n in range(50):
        policy = ("drop_oldest", "drop_newest", "error")[n % 3]
        try:
            tx.offer(n, policy)
        except sw.Full:
            pass
        if n % 4 == 0:
            rx.recv_many(3)
        stats = rx.statistics()
        check_invariant(stats)
        assert 0 <= stats.len <= stats.high_water <= stats.capacity
    tx.close()
    drain(rx)
    final = rx.statistics()
    check_invariant(final)
    assert (final.len, final.closed, final.open_senders) == (0, True, 0)


def test_blocked_send_seconds_grows_only_when_a_send_blocks(make_channel: Any) -> None:
    tx, rx = full_channel(make_channel)
    with pytest.raises(sw.Full):
        tx.send_nowait("b")
    tx.offer("c", "drop_newest")
    assert tx.statistics().blocked_send_seconds == 0.0
    worker = spawn(tx.send, "d")
    wait_until(lambda: blocked_senders(tx) == 1, "the sender blocks")
    rx.recv()
    worker.finish()
    assert tx.statistics().blocked_send_seconds > 0


def test_statistics_snapshot_is_consistent_while_the_consumer_receives(make_channel: Any) -> None:
    # The receive path takes no lock, so `len` is derived from the counters producers update under the
    # lock: the invariant holds in every snapshot, even one taken mid-receive.
    tx, rx = make_channel(8)
    total = 20_000

    def produce() -> None:
        with tx:
            for i in range(total):
                tx.send(i)

    producer = spawn(produce)
    consumer = spawn(lambda: sum(1 for _ in rx))
    snapshots = 0
    while consumer.is_alive() and snapshots < 5_000:
        stats = rx.statistics()
        check_invariant(stats)
        assert 0 <= stats.len <= stats.capacity
        snapshots += 1
    assert producer.finish() is None
    assert consumer.finish() == total
    assert snapshots > 0


# -- leaked endpoints --------------------------------------------------------------------------------


def test_leaked_sender_warns_and_is_closed_by_the_garbage_collector() -> None:
    tx, rx = sw.channel(2)
    tx.send_nowait("buffered")
    with pytest.warns(ResourceWarning, match=r"^unclosed <Sender open capacity=2>: close it"):  # noqa: PT031
        del tx
        gc.collect()
    with rx:
        assert rx.statistics().open_senders == 0
        assert list(rx) == ["buffered"]  # the channel ended: iteration terminates


def test_leaked_receiver_warns_and_is_closed_by_the_garbage_collector() -> None:
    tx, rx = sw.channel(2)
    with pytest.warns(ResourceWarning, match=r"^unclosed <Receiver open capacity=2>: close it"):  # noqa: PT031
        del rx
        gc.collect()
    with tx:
        with pytest.raises(sw.ChannelClosed) as info:
            tx.send_nowait("x")
        assert info.value.by == "receiver"


def test_leaked_sender_ends_a_receiver_iterating_on_another_thread() -> None:
    tx, rx = sw.channel(2)
    worker = spawn(list, rx)
    tx.send("x")
    with pytest.warns(ResourceWarning, match=r"^unclosed <Sender"):  # noqa: PT031
        del tx
        gc.collect()
    assert worker.finish() == ["x"]
    rx.close()


def test_closed_endpoints_and_unused_permits_collect_without_warnings() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tx, rx = sw.channel(2)
        permit = tx.reserve_nowait()
        tx.close()
        rx.close()
        del tx, rx, permit
        gc.collect()
    assert caught == []


# -- iteration ------------------------------------------------------------------------------------------


def test_iteration_ends_when_all_senders_close() -> None:
    tx, rx = sw.channel(2)

    def produce(sender: sw.Sender[int], start: int) -> None:
        with sender:
            for n in range(start, start + 50):
                sender.send(n)

    workers = [spawn(produce, tx.clone(), start) for start in (0, 100)]
    tx.close()
    with rx:
        received = list(rx)
    for worker in workers:
        worker.finish()
    assert sorted(received) == [*range(50), *range(100, 150)]
    assert [n for n in received if n < 100] == list(range(50))  # each producer's order is kept


def test_iteration_ends_when_the_receiver_closes_after_draining(make_channel: Any) -> None:
    tx, rx = make_channel(4)
    tx.send_nowait(1)
    tx.send_nowait(2)
    seen = []
    for item in rx:
        seen.append(item)
        rx.close()  # stop new sends; what is buffered still arrives
    assert seen == [1, 2]
    assert iter(rx) is rx
