"""The worker thread: fan-out, failure isolation, drain on close, statistics."""

from __future__ import annotations

import math
import threading

import pytest

import streamwatch as sw
from streamwatch import ops


class Boom(Exception):
    pass


def explode_at(bad: int):
    def fn(x: int) -> int:
        if x == bad:
            raise Boom(f"bad item {x}")
        return x

    fn.__qualname__ = f"explode_at_{bad}"
    return fn


def test_every_pipeline_receives_every_item_in_order() -> None:
    tx, rx = sw.channel(8)
    outs = [sw.sinks.collect() for _ in range(3)]
    worker = sw.Worker(rx, [sw.source() | out for out in outs]).start()
    with tx:
        for i in range(1000):
            tx.send(i)
    worker.close()
    for out in outs:
        assert out.items == list(range(1000))
        assert out.closed
    stats = worker.statistics()
    assert stats.items == 1000
    assert stats.pipelines == 3
    assert stats.failed == 0
    assert 1 <= stats.batches <= 1000
    assert not stats.running


def test_items_from_many_producer_threads_all_arrive() -> None:
    tx, rx = sw.channel(4)
    out = sw.sinks.collect()
    worker = sw.Worker(rx, [sw.source() | out]).start()

    def produce(sender: sw.Sender[tuple[int, int]], who: int) -> None:
        with sender:
            for i in range(300):
                sender.send((who, i))

    threads = [threading.Thread(target=produce, args=(tx.clone(), who)) for who in range(3)]
    tx.close()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    worker.close()
    assert sorted(out.items) == [(w, i) for w in range(3) for i in range(300)]
    for who in range(3):
        assert [i for w, i in out.items if w == who] == list(range(300))


def test_a_failing_pipeline_is_stopped_and_the_others_keep_running() -> None:
    tx, rx = sw.channel(16)
    good, bad = sw.sinks.collect(), sw.sinks.collect()
    failing = sw.source() | ops.map(explode_at(3)) | bad
    worker = sw.Worker(rx, [failing, sw.source() | good]).start()
    with tx:
        for i in range(10):
            tx.send(i)
    with pytest.raises(sw.PipelineError, match=r"^1 pipeline failed on the worker thread") as info:
        worker.close()
    assert good.items == list(range(10))
    assert bad.items == [0, 1, 2]
    assert isinstance(bad.error, Boom)
    assert isinstance(info.value.__cause__, Boom)
    assert info.value.pipeline == repr(failing)
    assert "Boom: bad item 3" in str(info.value)
    assert worker.statistics().failed == 1


def test_check_reports_each_failure_once() -> None:
    tx, rx = sw.channel(16)
    out = sw.sinks.collect()
    worker = sw.Worker(rx, [sw.source() | ops.map(explode_at(0)) | out]).start()
    tx.send(0)
    tx.send(1)
    tx.close()
    worker._thread.join()  # type: ignore[union-attr]  # wait for the drain without closing
    with pytest.raises(sw.PipelineError) as info:
        worker.check()
    assert [type(exc) for _, exc in info.value.errors] == [Boom]
    worker.check()  # reported already: silent now
    worker.close()  # and not raised again at close
    assert out.items == []


def test_close_drains_everything_sent_and_flushes_windows() -> None:
    tx, rx = sw.channel(2)
    out = sw.sinks.collect()
    worker = sw.Worker(rx, [sw.source() | ops.window(4) | ops.sum() | out]).start()
    for i in range(10):
        tx.send(i)  # blocks while the worker is behind: lossless
    worker.close()
    assert out.items == [0 + 1 + 2 + 3, 4 + 5 + 6 + 7, 8 + 9]
    with pytest.raises(sw.ChannelClosed, match=r"receiver is closed") as info:
        tx.send(10)
    assert info.value.item == 10
    tx.close()


def test_close_without_start_drains_on_the_calling_thread() -> None:
    tx, rx = sw.channel(8)
    out = sw.sinks.collect()
    worker = sw.Worker(rx, [sw.source() | out])
    for i in range(5):
        tx.send(i)
    worker.close()
    assert out.items == [0, 1, 2, 3, 4]
    assert out.closed
    worker.close()  # idempotent
    tx.close()


def test_a_pipeline_added_while_running_sees_later_items() -> None:
    tx, rx = sw.channel(8)
    first, late = sw.sinks.collect(), sw.sinks.collect()
    worker = sw.Worker(rx, [sw.source() | first]).start()
    tx.send("a")
    # Wait until "a" went through the first pipeline: recv side is empty and the worker counted it.
    while worker.statistics().items < 1:
        threading.Event().wait(0.001)
    worker.add(sw.source() | late)
    tx.send("b")
    tx.close()
    worker.close()
    assert first.items == ["a", "b"]
    assert late.items == ["b"]


def test_a_pipeline_failing_while_flushing_is_reported_at_close() -> None:
    tx, rx = sw.channel(8)
    out = sw.sinks.collect()
    worker = sw.Worker(rx, [sw.source() | ops.window(10) | ops.map(lambda w: 1 / 0) | out]).start()
    tx.send(1)
    tx.close()
    with pytest.raises(sw.PipelineError) as info:
        worker.close()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert isinstance(out.error, ZeroDivisionError)


def test_close_times_out_while_a_pipeline_is_stuck_and_can_be_retried() -> None:
    release = threading.Event()
    tx, rx = sw.channel(8)
    out = sw.sinks.collect()
    worker = sw.Worker(rx, [sw.source() | ops.map(lambda x: release.wait() and x) | out]).start()
    tx.send(7)
    tx.close()
    with pytest.raises(TimeoutError, match=r"^the worker did not drain within 0.05 s"):
        worker.close(timeout=0.05)
    release.set()
    worker.close()
    assert out.items == [7]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda w: w.add("nope"),
            TypeError,
            r"^Expected `pipeline` to be a Pipeline \(`stream \| sink`\), got 'nope'$",
        ),
        (lambda w: w.start().start(), RuntimeError, r"^the worker was already started; a worker runs once$"),
    ],
    ids=["add-non-pipeline", "start-twice"],
)
def test_misuse_is_a_clear_error(call, error, message) -> None:
    tx, rx = sw.channel(1)
    worker = sw.Worker(rx)
    with pytest.raises(error, match=message):
        call(worker)
    tx.close()
    worker.close()


def test_adding_to_a_closed_worker_is_an_error() -> None:
    tx, rx = sw.channel(1)
    worker = sw.Worker(rx)
    tx.close()
    worker.close()
    message = r"^cannot add <pipeline <source> \| <collect>>: the worker is closed$"
    with pytest.raises(RuntimeError, match=message):
        worker.add(sw.source() | sw.sinks.collect())


@pytest.mark.parametrize("batch", [0, -1, True, 1.5], ids=str)
def test_batch_must_be_a_positive_integer(batch) -> None:
    tx, rx = sw.channel(1)
    with pytest.raises(ValueError, match=rf"^Expected `batch` to be a positive integer, got {batch!r}$"):
        sw.Worker(rx, batch=batch)
    tx.close()
    rx.close()


def test_context_manager_keeps_the_body_error_and_notes_the_pipeline_error() -> None:
    tx, rx = sw.channel(4)

    def body() -> None:
        with sw.Worker(rx, [sw.source() | ops.map(explode_at(1)) | sw.sinks.collect()]):
            tx.send(1)
            tx.close()
            raise KeyError("body")

    with pytest.raises(KeyError) as info:
        body()
    assert any("Boom: bad item 1" in note for note in getattr(info.value, "__notes__", []))


def test_repr_shows_state() -> None:
    tx, rx = sw.channel(1)
    worker = sw.Worker(rx, [sw.source() | sw.sinks.collect()])
    assert repr(worker) == "<Worker new pipelines=1>"
    worker.start()
    assert repr(worker) == "<Worker running pipelines=1>"
    tx.close()
    worker.close()
    assert repr(worker) == "<Worker closed pipelines=1>"


def test_prepare_runs_on_the_worker_before_the_fan_out_and_its_failures_are_counted() -> None:
    tx, rx = sw.channel(8)
    out = sw.sinks.collect()

    def decode(item: int) -> int:
        if item < 0:
            raise ValueError(f"cannot decode {item}")
        return item * 100

    worker = sw.Worker(rx, [sw.source() | out], prepare=decode).start()
    for item in (1, -1, 2):
        tx.send(item)
    tx.close()
    with pytest.raises(sw.PipelineError, match=r"ValueError: cannot decode -1") as info:
        worker.close()
    assert out.items == [100, 200]  # the bad item is dropped, the pipeline keeps running
    assert isinstance(info.value.__cause__, ValueError)
    stats = worker.statistics()
    assert (stats.failed_items, stats.failed) == (1, 0)


class Unruly(sw.Sink):
    """Fails in every way a sink can: ``send``, ``fail``, ``close`` and even ``repr`` raise."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def send(self, item: object) -> None:
        raise self.error

    def fail(self, error: BaseException) -> None:
        raise Boom("fail() raised too")

    def close(self) -> None:
        raise Boom("close() raised too")

    def __repr__(self) -> str:
        raise Boom("repr() raised")


@pytest.mark.parametrize("error", [Boom("send"), SystemExit(2), KeyboardInterrupt()], ids=repr)
def test_a_sink_failing_in_every_way_stops_only_its_pipeline(error: BaseException) -> None:
    tx, rx = sw.channel(2)
    good = sw.sinks.collect()
    worker = sw.Worker(rx, [sw.source() | Unruly(error), sw.source() | good]).start()
    for i in range(20):
        tx.send(i)  # blocks while the worker is behind: a dead worker would hang here
    tx.close()
    with pytest.raises(sw.PipelineError, match=r"^1 pipeline failed") as info:
        worker.close(timeout=10)
    assert good.items == list(range(20))
    assert good.closed
    ((name, exc),) = info.value.errors
    assert name == "<pipeline <source> | <Unruly (repr raised Boom)>>"
    assert exc is error
    if hasattr(exc, "add_note"):  # the second error is kept with the first
        assert exc.__notes__ == ["then <Unruly (repr raised Boom)>.fail() raised Boom: fail() raised too"]
    stats = worker.statistics()
    assert (stats.failed, stats.items, stats.running) == (1, 20, False)


def test_a_flush_error_is_kept_when_the_sink_fail_raises_too() -> None:
    tx, rx = sw.channel(2)
    worker = sw.Worker(rx, [sw.source() | ops.window(4) | ops.map(lambda w: 1 / 0) | Unruly(Boom())])
    tx.send(1)
    tx.close()
    with pytest.raises(sw.PipelineError) as info:
        worker.close()
    assert isinstance(info.value.__cause__, ZeroDivisionError)  # the flush's error, not fail()'s
    assert worker.statistics().failed == 1


def test_a_timed_out_close_names_the_pipeline_it_is_stuck_in() -> None:
    release = threading.Event()
    tx, rx = sw.channel(8)
    stuck = sw.source() | sw.sinks.callback(lambda x: release.wait())
    worker = sw.Worker(rx, [stuck, sw.source() | sw.sinks.collect()]).start()
    for i in range(3):
        tx.send(i)
    tx.close()
    with pytest.raises(TimeoutError):
        worker.close(timeout=0.05)
    stats = worker.statistics()
    assert stats.current == repr(stuck)
    assert stats.in_flight + rx.statistics().len == 3  # nothing went through every pipeline
    release.set()
    worker.close()
    assert worker.statistics().current == ""
    assert worker.statistics().in_flight == 0


@pytest.mark.parametrize("timeout", [0, -1, True, math.nan], ids=repr)
def test_a_bad_close_timeout_is_refused(timeout: object) -> None:
    tx, rx = sw.channel(1)
    worker = sw.Worker(rx).start()
    tx.close()
    message = r"^Expected `timeout` to be a number of seconds > 0 \(math.inf waits forever\)"
    with pytest.raises(ValueError, match=message):
        worker.close(timeout=timeout)  # type: ignore[arg-type]
    worker.close(timeout=math.inf)
