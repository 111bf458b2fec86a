"""Async subscribers: own bounded buffer, Lagged(n) when slow, never blocking the worker."""

from __future__ import annotations

import threading

import anyio
import pytest

import streamwatch as sw
from streamwatch import ops

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_a_subscriber_reads_a_worker_fed_pipeline_across_threads() -> None:
    tx, rx = sw.channel(16)
    sub = sw.sinks.subscribe(capacity=1000)
    worker = sw.Worker(rx, [sw.source() | ops.map(lambda x: x * 2) | sub]).start()

    def produce() -> None:
        with tx:
            for i in range(500):
                tx.send(i)

    thread = threading.Thread(target=produce)
    thread.start()
    got = [x async for x in sub]  # ends when the worker closes the pipeline
    thread.join()
    worker.close()
    assert got == [2 * i for i in range(500)]
    assert sub.missed == 0


async def test_a_slow_subscriber_lags_and_is_told_how_many_it_missed() -> None:
    sub = sw.sinks.subscribe(capacity=3)
    pipeline = sw.source() | sub
    for i in range(10):
        pipeline.push(i)  # the producer (worker) never waits for the subscriber
    pipeline.close()
    with pytest.raises(sw.Lagged, match=r"^subscriber lagged: 7 item\(s\) were overwritten") as info:
        await sub.recv()
    assert info.value.missed == 7
    assert [x async for x in sub] == [7, 8, 9]  # still usable: the oldest retained items follow
    assert sub.missed == 7


async def test_lag_is_reported_at_the_gap_not_before_or_after() -> None:
    sub = sw.sinks.subscribe(capacity=2)
    pipeline = sw.source() | sub
    pipeline.push("a")
    assert await sub.recv() == "a"
    for x in "bcde":
        pipeline.push(x)
    with pytest.raises(sw.Lagged) as info:
        await sub.recv()
    assert info.value.missed == 2
    assert await sub.recv() == "d"
    pipeline.close()
    assert [x async for x in sub] == ["e"]


async def test_the_worker_is_never_blocked_by_a_subscriber_that_does_not_read() -> None:
    tx, rx = sw.channel(8)
    sub = sw.sinks.subscribe(capacity=1)
    other = sw.sinks.collect()
    worker = sw.Worker(rx, [sw.source() | sub, sw.source() | other]).start()
    with tx:
        for i in range(200):
            tx.send(i)
    worker.close()
    assert other.items == list(range(200))
    assert sub.missed == 199
    with pytest.raises(sw.Lagged):
        await sub.recv()
    assert await sub.recv() == 199


async def test_a_failed_pipeline_ends_its_subscription_with_the_error() -> None:
    sub = sw.sinks.subscribe(capacity=8)
    pipeline = sw.source() | ops.map(lambda x: 10 // x) | sub
    pipeline.push(5)
    with pytest.raises(ZeroDivisionError):
        pipeline.push(0)
    pipeline.fail(ZeroDivisionError("integer division or modulo by zero"))
    assert await sub.recv() == 2  # buffered outputs still arrive
    with pytest.raises(sw.PipelineError) as info:
        await sub.recv()
    assert isinstance(info.value.__cause__, ZeroDivisionError)


async def test_unsubscribing_discards_and_counts_later_outputs_without_failing_the_pipeline() -> None:
    sub = sw.sinks.subscribe(capacity=4)
    pipeline = sw.source() | sub
    pipeline.push(1)
    sub.unsubscribe()
    pipeline.push(2)
    pipeline.push(3)
    pipeline.close()
    assert pipeline.error is None
    assert sub.unsubscribed_drops == 2
    assert [x async for x in sub] == [1]


async def test_a_waiting_subscriber_is_woken_by_the_worker_thread() -> None:
    tx, rx = sw.channel(4)
    sub = sw.sinks.subscribe(capacity=4)
    worker = sw.Worker(rx, [sw.source() | sub]).start()
    got = []
    async with anyio.create_task_group() as tg:

        async def read() -> None:
            got.append(await sub.recv())

        tg.start_soon(read)
        await anyio.sleep(0)  # let the reader suspend first
        await anyio.to_thread.run_sync(tx.send, "ping")
    tx.close()
    worker.close()
    assert got == ["ping"]


def test_capacity_must_be_a_positive_integer() -> None:
    with pytest.raises(ValueError, match=r"^Expected `capacity` to be a positive integer, got 0$"):
        sw.sinks.subscribe(capacity=0)


def test_repr() -> None:
    assert repr(sw.sinks.subscribe(capacity=5)) == "<subscription capacity=5>"
