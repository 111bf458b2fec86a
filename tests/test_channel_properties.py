"""Channel properties under Hypothesis: no loss, per-producer order, exact drop accounting, close semantics.

Producers run on real threads; the consumer runs on the test's thread following a generated plan of receive
calls. Every blocking call carries a generous timeout so a lost wake-up fails the example instead of hanging
the session. Examples: test_channel.py.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streamwatch as sw

JOIN_S = 10.0  # a hang fails the example instead of the session timeout


class Endpoints(list[sw.Sender[Any] | sw.Receiver[Any]]):
    """Endpoints to close at teardown (a short repr: Hypothesis prints it in every falsifying example)."""

    def __repr__(self) -> str:
        return f"<{len(self)} endpoints closed at teardown>"


# One consumer step: ("recv",), ("recv_many", limit) or ("yield",) (hand the GIL to the producers).
consumer_steps = st.one_of(
    st.just(("recv",)),
    st.tuples(st.just("recv_many"), st.integers(1, 32)),
    st.just(("yield",)),
)
consumer_plans = st.lists(consumer_steps, min_size=1, max_size=8).filter(
    lambda plan: any(step[0] != "yield" for step in plan)  # a plan that never receives would spin forever
)


def consume(rx: sw.Receiver[Any], plan: list[tuple[Any, ...]]) -> list[Any]:
    """Receive until the channel ends, cycling through ``plan``."""
    received: list[Any] = []
    for step in itertools.cycle(plan):
        if step[0] == "yield":
            time.sleep(0)
        elif step[0] == "recv":
            try:
                received.append(rx.recv(timeout=JOIN_S))
            except sw.EndOfChannel:
                return received
        else:
            batch = rx.recv_many(step[1], timeout=JOIN_S)
            if not batch:
                return received
            assert len(batch) <= step[1]
            received.extend(batch)
    raise AssertionError("unreachable")


class Producers:
    """One thread per sender clone; the original sender is closed once the clones exist. If the consumer
    fails, leaving the block closes the receiver so that no producer stays blocked."""

    def __init__(
        self, tx: sw.Sender[Any], rx: sw.Receiver[Any], bodies: list[Callable[[sw.Sender[Any]], None]]
    ) -> None:
        self.rx = rx
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self._run, args=(body, tx.clone()), daemon=True) for body in bodies
        ]
        tx.close()

    def _run(self, body: Callable[[sw.Sender[Any]], None], sender: sw.Sender[Any]) -> None:
        with sender:
            try:
                body(sender)
            except BaseException as exc:
                self.errors.append(exc)

    def __enter__(self) -> Producers:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        if exc_type is not None:
            self.rx.close()
        for thread in self.threads:
            thread.join(JOIN_S)
        assert not any(thread.is_alive() for thread in self.threads), "a producer is still blocked"
        if self.errors and exc_type is None:
            raise self.errors[0]


@pytest.fixture
def endpoints() -> Iterator[Endpoints]:
    """Endpoints closed at teardown, however an example ended: closing a receiver wakes any producer still
    blocked, and holding every endpoint here keeps a failing example from also leaking ResourceWarnings."""
    opened = Endpoints()
    yield opened
    for endpoint in opened:
        endpoint.close()


def assert_in_producer_order(received: list[tuple[int, int]], n_producers: int) -> None:
    for producer in range(n_producers):
        indices = [index for p, index in received if p == producer]
        assert indices == sorted(indices), f"producer {producer}'s items arrived out of order"
        assert len(set(indices)) == len(indices), f"producer {producer} has an item received twice"


# -- lossless: blocking send and offer(policy="block") ------------------------------------------------


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    capacity=st.integers(1, 16),
    n_items=st.integers(0, 200),
    modes=st.lists(st.sampled_from(["send", "offer_block", "send_timeout"]), min_size=1, max_size=4),
    plan=consumer_plans,
)
def test_blocking_sends_deliver_every_item_exactly_once_in_producer_order(
    endpoints: Endpoints,
    capacity: int,
    n_items: int,
    modes: list[str],
    plan: list[Any],
) -> None:
    tx, rx = sw.channel(capacity)
    endpoints.append(rx)

    def producer(p: int, mode: str) -> Callable[[sw.Sender[Any]], None]:
        def body(sender: sw.Sender[Any]) -> None:
            for i in range(n_items):
                if mode == "send":
                    sender.send((p, i))
                elif mode == "send_timeout":
                    sender.send((p, i), timeout=JOIN_S)
                else:
                    assert sender.offer((p, i), "block") is True

        return body

    with Producers(tx, rx, [producer(p, mode) for p, mode in enumerate(modes)]):
        received = consume(rx, plan)
    n_producers = len(modes)
    assert Counter(received) == Counter((p, i) for p in range(n_producers) for i in range(n_items))
    assert_in_producer_order(received, n_producers)
    stats = rx.statistics()
    total = n_producers * n_items
    assert (stats.sent, stats.received, stats.dropped, stats.len) == (total, total, 0, 0)
    assert stats.high_water <= capacity
    assert (stats.open_senders, stats.reserved, stats.closed) == (0, 0, True)


# -- lossy: drop_oldest / drop_newest ------------------------------------------------------------------


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    capacity=st.integers(1, 16),
    n_items=st.integers(0, 200),
    policies=st.lists(st.sampled_from(["drop_oldest", "drop_newest"]), min_size=1, max_size=4),
    plan=consumer_plans,
)
def test_drop_policies_account_for_every_offered_item(
    endpoints: Endpoints,
    capacity: int,
    n_items: int,
    policies: list[str],
    plan: list[Any],
) -> None:
    dropped: list[tuple[Any, str]] = []  # list.append is atomic: on_drop runs on the producers' threads
    tx, rx = sw.channel(capacity, on_drop=lambda item, reason: dropped.append((item, reason)))
    endpoints.append(rx)
    refused: list[Any] = []  # items whose offer returned False

    def producer(p: int, policy: str) -> Callable[[sw.Sender[Any]], None]:
        def body(sender: sw.Sender[Any]) -> None:
            for i in range(n_items):
                if not sender.offer((p, i), policy):  # type: ignore[arg-type]
                    refused.append((p, i))

        return body

    with Producers(tx, rx, [producer(p, policy) for p, policy in enumerate(policies)]):
        received = consume(rx, plan)
    n_producers = len(policies)
    offered = [(p, i) for p in range(n_producers) for i in range(n_items)]
    stats = rx.statistics()
    assert stats.received + stats.dropped_oldest + stats.dropped_newest == len(offered)
    assert stats.received == len(received)
    assert stats.sent == stats.received + stats.dropped_oldest  # the invariant, with len == 0
    assert Counter(received) + Counter(item for item, _ in dropped) == Counter(offered)
    assert stats.dropped_oldest == sum(reason == "drop_oldest" for _, reason in dropped)
    assert stats.dropped_newest == sum(reason == "drop_newest" for _, reason in dropped)
    # offer returns False exactly for the items it discarded itself
    assert Counter(refused) == Counter(item for item, reason in dropped if reason == "drop_newest")
    assert_in_producer_order(received, n_producers)
    assert stats.high_water <= capacity


# -- close and drain: a sequential model ---------------------------------------------------------------

# Operations on one channel, run on one thread and checked step by step against a plain model.
operations = st.lists(
    st.one_of(
        st.tuples(st.just("send_nowait"), st.integers(0, 3)),
        st.tuples(st.just("send_timeout"), st.integers(0, 3)),
        st.tuples(st.just("offer"), st.integers(0, 3), st.sampled_from(sw.OVERFLOW_POLICIES)),
        st.tuples(st.just("reserve"), st.integers(0, 3)),
        st.just(("permit_send",)),
        st.just(("permit_close",)),
        st.just(("recv_nowait",)),
        st.tuples(st.just("recv_many"), st.integers(1, 4)),
        st.tuples(st.just("clone"), st.integers(0, 3)),
        st.tuples(st.just("close_sender"), st.integers(0, 3)),
        st.just(("close_receiver",)),
    ),
    max_size=60,
)


def attempt(sender: sw.Sender[Any], name: str, item: int, policy: str) -> object:
    """One send of kind ``name``; never waits (a blocking send gets a zero timeout on one thread)."""
    if name == "send_nowait":
        return sender.send_nowait(item)
    if name == "send_timeout":
        return sender.send(item, timeout=0)
    return sender.offer(item, policy, timeout=0)  # type: ignore[arg-type]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(capacity=st.integers(1, 4), ops=operations)
def test_close_and_drain_deliver_or_hand_back_every_item(
    endpoints: Endpoints, capacity: int, ops: list[tuple[Any, ...]]
) -> None:
    dropped: list[tuple[Any, str]] = []
    tx, rx = sw.channel(capacity, on_drop=lambda item, reason: dropped.append((item, reason)))
    endpoints.extend([tx, rx])
    senders = [tx]
    permits: list[sw.Permit[Any]] = []
    # the model
    buffer: list[int] = []
    reserved = 0
    receiver_closed = False
    delivered: list[int] = []  # sends that returned normally and buffered their item
    handed_back: list[int] = []  # items an exception carried back
    received: list[int] = []
    counter = itertools.count()

    def closing() -> bool:
        return receiver_closed or all(sender.closed for sender in senders)

    for op in ops:
        name = op[0]
        if name in ("send_nowait", "send_timeout", "offer", "reserve", "clone", "close_sender"):
            sender = senders[op[1] % len(senders)]
        if name in ("send_nowait", "send_timeout", "offer"):
            item = next(counter)
            policy = op[2] if name == "offer" else ""
            if sender.closed or receiver_closed:
                with pytest.raises(sw.ChannelClosed) as closed:
                    attempt(sender, name, item, policy)
                assert closed.value.item == item
                assert closed.value.by == ("sender" if sender.closed else "receiver")
                handed_back.append(item)
            elif len(buffer) + reserved < capacity:
                assert attempt(sender, name, item, policy) in (None, True)
                buffer.append(item)
                delivered.append(item)
            elif name != "offer" or policy in ("error", "block"):
                error = sw.Full if name == "send_nowait" or policy == "error" else sw.SendTimeout
                with pytest.raises(error) as refused:
                    attempt(sender, name, item, policy)
                assert refused.value.item == item
                handed_back.append(item)
            elif policy == "drop_oldest" and buffer:
                assert attempt(sender, name, item, policy) is True
                assert dropped[-1] == (buffer.pop(0), "drop_oldest")
                buffer.append(item)
                delivered.append(item)
            else:  # drop_newest, or drop_oldest with every free slot reserved
                assert attempt(sender, name, item, policy) is False
                assert dropped[-1] == (item, "drop_newest")
        elif name == "reserve":
            if sender.closed or receiver_closed:
                with pytest.raises(sw.ChannelClosed) as closed:
                    sender.reserve_nowait()
                assert closed.value.item is None
            elif len(buffer) + reserved < capacity:
                permits.append(sender.reserve_nowait())
                reserved += 1
            else:
                with pytest.raises(sw.Full):
                    sender.reserve_nowait()
        elif name in ("permit_send", "permit_close") and permits:
            permit = permits.pop(0)
            reserved -= 1
            if name == "permit_send":
                item = next(counter)
                permit.send(item)  # cannot fail, even once the channel is closed
                buffer.append(item)
                delivered.append(item)
            else:
                permit.close()
        elif name == "recv_nowait":
            if buffer:
                received.append(rx.recv_nowait())
                assert received[-1] == buffer.pop(0)
            else:
                with pytest.raises(sw.EndOfChannel if closing() and not reserved else sw.Empty):
                    rx.recv_nowait()
        elif name == "recv_many":
            if buffer or (closing() and not reserved):
                batch = rx.recv_many(op[1])  # [] exactly when the channel has ended
                assert batch == buffer[: op[1]]
                del buffer[: op[1]]
                received.extend(batch)
            else:
                with pytest.raises(sw.RecvTimeout):
                    rx.recv_many(op[1], timeout=0)
        elif name == "clone":
            if sender.closed:
                with pytest.raises(sw.ChannelClosed):
                    sender.clone()
            else:
                senders.append(sender.clone())
                endpoints.append(senders[-1])
        elif name == "close_sender":
            sender.close()
        elif name == "close_receiver":
            rx.close()
            receiver_closed = True
        stats = rx.statistics()
        assert (stats.len, stats.reserved, stats.closed) == (len(buffer), reserved, closing())
        assert stats.open_senders == sum(not sender.closed for sender in senders)
        assert stats.sent == stats.received + stats.len + stats.dropped_oldest

    # Shut down: every sender closes, every outstanding permit is used, then the receiver drains.
    for sender in senders:
        sender.close()
    for permit in permits:
        item = next(counter)
        permit.send(item)
        buffer.append(item)
        delivered.append(item)
    tail = consume(rx, [("recv",)])  # bounded: a channel that never ends fails instead of hanging
    assert tail == buffer
    received.extend(tail)
    rx.close()
    with pytest.raises(sw.EndOfChannel):
        rx.recv_nowait()
    made = next(counter)
    evicted = [item for item, reason in dropped if reason == "drop_oldest"]
    refused = [item for item, reason in dropped if reason == "drop_newest"]
    assert sorted(received + evicted) == sorted(delivered)  # a successful send is received or evicted
    assert sorted(delivered + handed_back + refused) == list(range(made))  # every item has one fate
    assert received == sorted(received)  # one thread: strict FIFO, no duplicates
    assert len(set(received)) == len(received)
    stats = rx.statistics()
    assert (stats.sent, stats.received, stats.len) == (len(delivered), len(received), 0)
    assert (stats.dropped_oldest, stats.dropped_newest) == (len(evicted), len(refused))


# -- close and drain: threads ---------------------------------------------------------------------------


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    capacity=st.integers(1, 8),
    plans=st.lists(
        st.tuples(st.integers(0, 100), st.integers(0, 3)),  # (items to send, sends tried after closing)
        min_size=1,
        max_size=4,
    ),
    close_receiver_after=st.one_of(st.none(), st.integers(0, 150)),
)
def test_sends_racing_a_receiver_close_are_received_or_handed_back(
    endpoints: Endpoints,
    capacity: int,
    plans: list[tuple[int, int]],
    close_receiver_after: int | None,
) -> None:
    tx, rx = sw.channel(capacity)
    endpoints.append(rx)
    outcomes: list[list[tuple[str, Any]]] = [[] for _ in plans]  # ("sent", item) or (closed by, item)

    def producer(p: int, n_items: int, after_close: int) -> Callable[[sw.Sender[Any]], None]:
        def body(sender: sw.Sender[Any]) -> None:
            for i in range(n_items):
                try:
                    sender.send((p, i), timeout=JOIN_S)
                except sw.ChannelClosed as exc:
                    outcomes[p].append((exc.by, exc.item))
                else:
                    outcomes[p].append(("sent", (p, i)))
            sender.close()
            for i in range(n_items, n_items + after_close):
                with pytest.raises(sw.ChannelClosed) as info:
                    sender.send((p, i))
                assert (info.value.by, info.value.item) == ("sender", (p, i))

        return body

    received: list[Any] = []
    with Producers(tx, rx, [producer(p, n, after) for p, (n, after) in enumerate(plans)]):
        while True:
            if close_receiver_after is not None and len(received) == close_receiver_after:
                rx.close()
            try:
                received.append(rx.recv(timeout=JOIN_S))
            except sw.EndOfChannel:
                break
    sent = [item for outcome in outcomes for kind, item in outcome if kind == "sent"]
    handed_back = [item for outcome in outcomes for kind, item in outcome if kind != "sent"]
    assert {kind for outcome in outcomes for kind, _ in outcome} <= {"sent", "receiver"}
    assert Counter(received) == Counter(sent)  # every send that returned normally arrived exactly once
    assert sorted(sent + handed_back) == sorted((p, i) for p, (n, _) in enumerate(plans) for i in range(n))
    if close_receiver_after is None:
        assert handed_back == []
    assert_in_producer_order(received, len(plans))
    stats = rx.statistics()
    assert (stats.sent, stats.received, stats.len, stats.dropped) == (len(sent), len(received), 0, 0)
