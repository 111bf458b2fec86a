"""Channel benchmarks, each measured in the same run as its baseline so that the ratios mean something.

Run (not part of the test suite: ``testpaths = ["tests"]``)::

    python -m pytest benchmarks/bench_channel.py --benchmark-only -p no:cacheprovider \
        -o python_files='bench_*.py'

1. ``test_handoff_*``: 200 000 single items from a producer thread to a consumer thread through capacity
   1024 — streamwatch ``send``/``recv`` (a ``while`` loop, and ``for x in rx``) against ``queue.Queue(1024)``.
   ``extra_info["items_per_s"]``.
2. ``test_batched_*``: records that are numpy arrays of 1000 float32 summaries, ``send`` + ``recv_many(64)``
   across threads, against ``queue.Queue`` ``put``/``get``. ``extra_info["summaries_per_s"]``.
3. ``test_producer_cost_*``: the training thread's cost of one ``send_nowait`` / ``offer`` in ns per call, on
   one thread, against ``queue.Queue.put_nowait`` and ``collections.deque.append``. The buffer never fills:
   the channel is large enough for every timed call (``send_nowait``) or full on purpose (``offer`` with
   ``drop_oldest`` evicting, the steady state when the consumer has stalled).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import streamwatch as sw

N_ITEMS = 200_000
CAPACITY = 1024
N_RECORDS = 50_000
SUMMARIES = 1000  # float32 summaries per record
BATCH = 64
ROUNDS = 5
_DONE = object()


def run_threads(produce: Callable[[], None], consume: Callable[[], int]) -> int:
    """Run ``consume`` on a thread while ``produce`` runs here; return what the consumer counted."""
    counted: list[int] = []
    consumer = threading.Thread(target=lambda: counted.append(consume()))
    consumer.start()
    produce()
    consumer.join()
    return counted[0]


def report(benchmark: Any, n: int, key: str) -> None:
    mean = benchmark.stats.stats.mean
    benchmark.extra_info[key] = round(n / mean)
    benchmark.extra_info["mean_s"] = mean


# -- 1. single-item hand-off across two threads ------------------------------------------------------------


def streamwatch_handoff(iterate: bool) -> int:
    tx, rx = sw.channel(CAPACITY)

    def produce() -> None:
        send = tx.send
        for n in range(N_ITEMS):
            send(n)
        tx.close()

    def consume_recv() -> int:
        recv = rx.recv
        count = 0
        while True:
            try:
                recv()
            except sw.EndOfChannel:
                return count
            count += 1

    def consume_iter() -> int:
        count = 0
        for _ in rx:
            count += 1
        return count

    with rx:
        return run_threads(produce, consume_iter if iterate else consume_recv)


def queue_handoff() -> int:
    q: queue.Queue[Any] = queue.Queue(CAPACITY)

    def produce() -> None:
        put = q.put
        for n in range(N_ITEMS):
            put(n)
        put(_DONE)

    def consume() -> int:
        get = q.get
        count = 0
        while get() is not _DONE:
            count += 1
        return count

    return run_threads(produce, consume)


@pytest.mark.benchmark(group="handoff: 200k items, 2 threads, capacity 1024")
def test_handoff_streamwatch_recv(benchmark: Any) -> None:
    assert benchmark.pedantic(streamwatch_handoff, args=(False,), rounds=ROUNDS, iterations=1) == N_ITEMS
    report(benchmark, N_ITEMS, "items_per_s")


@pytest.mark.benchmark(group="handoff: 200k items, 2 threads, capacity 1024")
def test_handoff_streamwatch_iter(benchmark: Any) -> None:
    assert benchmark.pedantic(streamwatch_handoff, args=(True,), rounds=ROUNDS, iterations=1) == N_ITEMS
    report(benchmark, N_ITEMS, "items_per_s")


@pytest.mark.benchmark(group="handoff: 200k items, 2 threads, capacity 1024")
def test_handoff_queue_queue(benchmark: Any) -> None:
    assert benchmark.pedantic(queue_handoff, rounds=ROUNDS, iterations=1) == N_ITEMS
    report(benchmark, N_ITEMS, "items_per_s")


# -- 2. batched records of numpy summaries -------------------------------------------------------------------

# A small pool reused round-robin, like the pinned slots a real producer cycles through.
RECORDS = [np.full(SUMMARIES, n, dtype=np.float32) for n in range(2 * CAPACITY)]


def streamwatch_batched() -> int:
    tx, rx = sw.channel(CAPACITY)

    def produce() -> None:
        send, pool, size = tx.send, RECORDS, len(RECORDS)
        for n in range(N_RECORDS):
            send(pool[n % size])
        tx.close()

    def consume() -> int:
        summaries = 0
        recv_many = rx.recv_many
        while batch := recv_many(BATCH):
            for record in batch:
                summaries += record.shape[0]
        return summaries

    with rx:
        return run_threads(produce, consume)


def queue_batched() -> int:
    q: queue.Queue[Any] = queue.Queue(CAPACITY)

    def produce() -> None:
        put, pool, size = q.put, RECORDS, len(RECORDS)
        for n in range(N_RECORDS):
            put(pool[n % size])
        put(_DONE)

    def consume() -> int:
        summaries = 0
        get = q.get
        while (record := get()) is not _DONE:
            summaries += record.shape[0]
        return summaries

    return run_threads(produce, consume)


@pytest.mark.benchmark(group="batched: 50k records x 1000 float32 summaries, 2 threads")
def test_batched_streamwatch_recv_many(benchmark: Any) -> None:
    total = N_RECORDS * SUMMARIES
    assert benchmark.pedantic(streamwatch_batched, rounds=ROUNDS, iterations=1) == total
    report(benchmark, total, "summaries_per_s")
    benchmark.extra_info["records_per_s"] = round(N_RECORDS / benchmark.stats.stats.mean)


@pytest.mark.benchmark(group="batched: 50k records x 1000 float32 summaries, 2 threads")
def test_batched_queue_queue(benchmark: Any) -> None:
    total = N_RECORDS * SUMMARIES
    assert benchmark.pedantic(queue_batched, rounds=ROUNDS, iterations=1) == total
    report(benchmark, total, "summaries_per_s")
    benchmark.extra_info["records_per_s"] = round(N_RECORDS / benchmark.stats.stats.mean)


# -- 3. the producer's per-call cost on the training thread ------------------------------------------------

CALLS_ROUNDS, CALLS_PER_ROUND = 200, 1000
# Every call pedantic makes: one warm-up round, the timed rounds, and one last call for the result.
ALL_CALLS = (1 + CALLS_ROUNDS) * CALLS_PER_ROUND + 1
ITEM = RECORDS[0]


def per_call(benchmark: Any, fn: Callable[..., object], *args: Any) -> None:
    """Time ``fn(*args)`` CALLS_PER_ROUND times a round; pytest-benchmark reports the time per call."""
    benchmark.pedantic(fn, args=args, rounds=CALLS_ROUNDS, iterations=CALLS_PER_ROUND, warmup_rounds=1)
    benchmark.extra_info["ns_per_call"] = round(benchmark.stats.stats.median * 1e9, 1)


@pytest.mark.benchmark(group="producer cost: one call, one thread")
def test_producer_cost_send_nowait(benchmark: Any) -> None:
    tx, rx = sw.channel(ALL_CALLS)
    with tx, rx:
        per_call(benchmark, tx.send_nowait, ITEM)
        assert rx.statistics().sent == ALL_CALLS


@pytest.mark.benchmark(group="producer cost: one call, one thread")
def test_producer_cost_offer_with_room(benchmark: Any) -> None:
    tx, rx = sw.channel(ALL_CALLS)
    with tx, rx:
        per_call(benchmark, tx.offer, ITEM)
        assert rx.statistics().dropped == 0


@pytest.mark.benchmark(group="producer cost: one call, one thread")
def test_producer_cost_offer_drop_oldest_when_full(benchmark: Any) -> None:
    tx, rx = sw.channel(CAPACITY)
    with tx, rx:
        for _ in range(CAPACITY):
            tx.send_nowait(ITEM)
        per_call(benchmark, tx.offer, ITEM)  # every call evicts the oldest: the stalled-consumer path
        stats = rx.statistics()
        assert (stats.len, stats.dropped_oldest) == (CAPACITY, ALL_CALLS)


@pytest.mark.benchmark(group="producer cost: one call, one thread")
def test_producer_cost_offer_drop_newest_when_full(benchmark: Any) -> None:
    tx, rx = sw.channel(CAPACITY)
    with tx, rx:
        for _ in range(CAPACITY):
            tx.send_nowait(ITEM)
        per_call(benchmark, tx.offer, ITEM, "drop_newest")
        assert rx.statistics().dropped_newest == ALL_CALLS


@pytest.mark.benchmark(group="producer cost: one call, one thread")
def test_producer_cost_queue_put_nowait(benchmark: Any) -> None:
    q: queue.Queue[Any] = queue.Queue(ALL_CALLS)
    per_call(benchmark, q.put_nowait, ITEM)
    assert q.qsize() == ALL_CALLS


@pytest.mark.benchmark(group="producer cost: one call, one thread")
def test_producer_cost_deque_append_maxlen(benchmark: Any) -> None:
    ring: deque[Any] = deque(maxlen=CAPACITY)  # the unbounded-loss baseline: what drop_oldest does, bare
    per_call(benchmark, ring.append, ITEM)
    assert len(ring) == CAPACITY
