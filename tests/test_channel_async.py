"""The channel's async faces under asyncio and trio (through anyio), and their wake-ups across threads.

A task that must be suspended is detected through the channel's own waiter lists (white-box, see
``suspended_senders`` / ``suspended_receivers``), never by sleeping. Sync behaviour: test_channel.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import streamwatch as sw
from tests.threads import JOIN_S, spawn, wait_until

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def suspended_senders(tx: sw.Sender[Any]) -> int:
    """Tasks suspended in ``send_async`` (white-box: the channel's async waiter list)."""
    return len(tx._state.async_send)


def suspended_receivers(rx: sw.Receiver[Any]) -> int:
    """Tasks suspended in ``recv_async`` (white-box)."""
    return len(rx._state.async_recv)


async def until(predicate: Callable[[], object]) -> None:
    """Let other tasks run until ``predicate()`` holds (fails after JOIN_S)."""
    with anyio.fail_after(JOIN_S):
        while not predicate():
            await anyio.lowlevel.checkpoint()


async def test_send_async_and_recv_async_round_trip() -> None:
    tx, rx = sw.channel(4)
    with tx, rx:
        for item in ["a", "b", "c"]:
            await tx.send_async(item)
        assert [await rx.recv_async() for _ in range(3)] == ["a", "b", "c"]
        stats = rx.statistics()
        assert (stats.sent, stats.received, stats.len, stats.blocked_send_seconds) == (3, 3, 0, 0.0)


async def test_async_for_ends_when_the_last_sender_closes() -> None:
    tx, rx = sw.channel(2)

    async def produce() -> None:
        with tx:
            for n in range(20):
                await tx.send_async(n)

    received = []
    with rx:
        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            async for item in rx:
                received.append(item)
    assert received == list(range(20))


async def test_async_for_ends_when_the_receiver_closes_after_draining() -> None:
    tx, rx = sw.channel(4)
    with tx, rx:
        await tx.send_async(1)
        await tx.send_async(2)
        seen = []
        async for item in rx:
            seen.append(item)
            rx.close()
        assert seen == [1, 2]


async def test_async_tasks_pass_many_items_through_one_slot() -> None:
    tx, rx = sw.channel(1)
    received: list[int] = []

    async def consume() -> None:
        async for item in rx:
            received.append(item)

    with rx:
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            with tx:
                for n in range(200):
                    await tx.send_async(n)
    assert received == list(range(200))
    assert rx.statistics().high_water == 1


async def test_send_async_suspends_while_full_and_resumes_when_a_thread_receives() -> None:
    tx, rx = sw.channel(1)
    await tx.send_async("a")

    def consume() -> list[Any]:
        wait_until(lambda: suspended_senders(tx) == 1, "send_async suspends")
        return list(rx)

    with rx:
        consumer = spawn(consume)
        with tx, anyio.fail_after(JOIN_S):  # a lost cross-thread wake-up fails instead of hanging
            await tx.send_async("b")  # suspends until the thread takes "a"
            for n in range(100):
                await tx.send_async(n)
        assert await consumer.finish_async() == ["a", "b", *range(100)]
        stats = rx.statistics()
        assert stats.blocked_send_seconds > 0
        assert (stats.sent, stats.received) == (102, 102)
        assert suspended_senders(tx) == 0


async def test_recv_async_is_woken_by_a_send_from_another_thread() -> None:
    tx, rx = sw.channel(1)

    def produce() -> None:
        wait_until(lambda: suspended_receivers(rx) == 1, "recv_async suspends")
        with tx:
            tx.send("from a thread")

    with rx:
        producer = spawn(produce)
        with anyio.fail_after(JOIN_S):
            assert await rx.recv_async() == "from a thread"
        await producer.finish_async()
        with pytest.raises(sw.EndOfChannel):
            await rx.recv_async()
        assert suspended_receivers(rx) == 0


async def test_recv_async_is_woken_by_the_end_when_a_thread_closes_the_last_sender() -> None:
    tx, rx = sw.channel(1)

    def close() -> None:
        wait_until(lambda: suspended_receivers(rx) == 1, "recv_async suspends")
        tx.close()

    with rx:
        closer = spawn(close)
        with pytest.raises(sw.EndOfChannel), anyio.fail_after(JOIN_S):
            await rx.recv_async()
        await closer.finish_async()


async def test_cancelling_a_suspended_send_async_leaves_the_channel_unchanged() -> None:
    tx, rx = sw.channel(1)
    with tx, rx:
        await tx.send_async("a")
        before = tx.statistics()
        finished = False

        async def send_b(scope: anyio.CancelScope) -> None:
            nonlocal finished
            with scope:
                await tx.send_async("b")
                finished = True

        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()
            tg.start_soon(send_b, scope)
            await until(lambda: suspended_senders(tx) == 1)
            scope.cancel()
        assert not finished
        assert scope.cancelled_caught
        assert tx.statistics() == before  # not sent, nothing counted, no slot taken
        assert suspended_senders(tx) == 0  # no waiter leaked
        assert await rx.recv_async() == "a"
        await tx.send_async("c")  # the channel still works both ways
        assert rx.recv_nowait() == "c"
        with pytest.raises(sw.Empty):
            rx.recv_nowait()


async def test_send_async_under_move_on_after_times_out_without_sending() -> None:
    tx, rx = sw.channel(1)
    with tx, rx:
        await tx.send_async("a")
        with anyio.move_on_after(0.01) as scope:
            await tx.send_async("b")
        assert scope.cancelled_caught
        assert (tx.statistics().sent, suspended_senders(tx)) == (1, 0)
        assert rx.recv_nowait() == "a"
        with pytest.raises(sw.Empty):
            rx.recv_nowait()


async def test_send_async_in_an_already_cancelled_scope_sends_nothing_even_with_room() -> None:
    tx, rx = sw.channel(1)
    with tx, rx:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await tx.send_async("x")
        assert scope.cancelled_caught
        assert tx.statistics().sent == 0
        with pytest.raises(sw.Empty):
            rx.recv_nowait()


async def test_cancelling_a_suspended_recv_async_loses_no_item() -> None:
    tx, rx = sw.channel(1)
    with tx, rx:
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()

            async def receive() -> None:
                with scope:
                    await rx.recv_async()

            tg.start_soon(receive)
            await until(lambda: suspended_receivers(rx) == 1)
            scope.cancel()
        assert scope.cancelled_caught
        assert suspended_receivers(rx) == 0
        tx.send_nowait("kept")
        assert await rx.recv_async() == "kept"


async def test_suspended_send_async_raises_channel_closed_when_the_receiver_closes() -> None:
    tx, rx = sw.channel(1)
    with tx:
        await tx.send_async("a")

        def close_receiver() -> None:
            wait_until(lambda: suspended_senders(tx) == 1, "send_async suspends")
            rx.close()

        closer = spawn(close_receiver)
        with pytest.raises(sw.ChannelClosed) as info, anyio.fail_after(JOIN_S):
            await tx.send_async("b")
        await closer.finish_async()
        assert (info.value.item, info.value.by) == ("b", "receiver")
        assert suspended_senders(tx) == 0
        assert await rx.recv_async() == "a"  # buffered items still drain
        with pytest.raises(sw.EndOfChannel):
            await rx.recv_async()


async def test_send_async_on_a_closed_sender_raises_channel_closed_by_sender() -> None:
    tx, rx = sw.channel(1)
    with rx:
        tx.close()
        with pytest.raises(sw.ChannelClosed, match=r"^send on a closed Sender") as info:
            await tx.send_async("x")
        assert (info.value.item, info.value.by) == ("x", "sender")


async def test_recv_async_raises_end_of_channel_after_close_and_drain() -> None:
    tx, rx = sw.channel(2)
    with rx:
        await tx.send_async("last")
        tx.close()
        assert await rx.recv_async() == "last"
        for _ in range(2):  # the end is sticky
            with pytest.raises(sw.EndOfChannel, match=r"^channel closed and drained$"):
                await rx.recv_async()


async def test_a_thread_producer_and_an_async_consumer_share_a_channel() -> None:
    tx, rx = sw.channel(3)

    def produce() -> None:
        with tx:
            for n in range(500):
                tx.send(n)

    with rx:
        producer = spawn(produce)
        with anyio.fail_after(JOIN_S):
            received = [item async for item in rx]
        await producer.finish_async()
    assert received == list(range(500))
