"""The worker thread: receive items from a channel and fan each one out to every pipeline.

The worker runs beside the training loop and competes with it for the GIL, so it works in batches:
one ``recv_many`` call takes up to ``batch`` items at once, and each item (a whole record, never a
per-scalar Python object) is pushed through every pipeline.

Failure isolation:
    A pipeline that raises is stopped (its sink is told through ``Sink.fail``) and counted; the other
    pipelines keep running. The exception is kept and re-raised to the owner as a
    :class:`~streamwatch.PipelineError` (original as ``__cause__``) at the next :meth:`Worker.check`
    or at :meth:`Worker.close` — never only printed. Every call into a pipeline or its sink (``push``,
    ``fail``, ``close``) is guarded, ``BaseException`` included: a sink whose ``fail`` or ``close``
    raises again has that second error added as a note to the first, and the thread goes on — it
    never dies of a sink.

Clean shutdown:
    :meth:`Worker.close` closes the receiver (producers get ``ChannelClosed`` from then on), lets the
    thread drain every item already sent, flushes every pipeline (windows emit what they hold), closes
    the sinks and joins the thread.

Example:
    >>> import streamwatch as sw
    >>> from streamwatch import ops
    >>> tx, rx = sw.channel(64)
    >>> out = sw.sinks.collect()
    >>> with sw.Worker(rx, [sw.source() | ops.window(2) | ops.sum() | out]) as worker:
    ...     for i in range(5):
    ...         tx.send(i)
    >>> tx.close()
    >>> out.items
    [1, 5, 4]
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from streamwatch._channel import Receiver, Sender
from streamwatch._exceptions import PipelineError
from streamwatch._pipeline import Pipeline, describe
from streamwatch._validate import check_int, check_seconds

__all__ = ["Worker", "WorkerStatistics", "give_up"]


def seconds_or_forever(value: object, name: str) -> float | None:
    """A timeout argument checked: a number of seconds > 0, ``math.inf`` (returned as ``None``: wait
    forever) — anything else is a ValueError naming ``name``.

    Example:
        >>> import math
        >>> seconds_or_forever(2, "timeout"), seconds_or_forever(math.inf, "timeout")
        (2.0, None)
        >>> seconds_or_forever(0, "close_timeout")
        Traceback (most recent call last):
        ...
        ValueError: Expected `close_timeout` to be a number of seconds > 0 (math.inf waits forever), got 0
    """
    seconds = check_seconds(value, name, zero=False)
    return None if seconds == math.inf else seconds


@dataclass(frozen=True, slots=True)
class WorkerStatistics:
    """A snapshot of one worker.

    Attributes:
        items: items received from the channel and fanned out.
        batches: ``recv_many`` batches processed (``items / batches`` is the mean batch size).
        pipelines: pipelines attached (running or stopped).
        failed: pipelines stopped by an exception.
        failed_items: items dropped because ``prepare`` raised on them.
        busy_seconds: time spent pushing items through pipelines (the worker's share of the GIL).
        running: the thread is alive.
        in_flight: items taken from the channel that have not been through every pipeline yet.
        current: the pipeline the thread is inside now (its repr; ``""`` between calls) — after a
            :meth:`Worker.close` timeout, the one that did not return.
    """

    items: int
    batches: int
    pipelines: int
    failed: int
    failed_items: int
    busy_seconds: float
    running: bool
    in_flight: int = 0
    current: str = ""


class Worker:
    """Consumes a :class:`~streamwatch.Receiver` on a daemon thread and feeds every pipeline.

    Args:
        receiver: the channel end to drain; the worker owns it and closes it in :meth:`close`.
        pipelines: initial pipelines; more can be added with :meth:`add` at any time before close.
        name: the thread's name.
        batch: the most items taken per ``recv_many`` round.
        prepare: applied to each item on the worker thread before the fan-out (e.g. waiting for a
            device copy and decoding it). An item whose ``prepare`` raises is dropped, counted in
            ``statistics().failed_items`` and its error reported like a pipeline's.
    """

    def __init__(
        self,
        receiver: Receiver[Any],
        pipelines: Iterable[Pipeline] = (),
        *,
        name: str = "streamwatch-worker",
        batch: int = 256,
        prepare: Callable[[Any], Any] | None = None,
    ) -> None:
        if not isinstance(receiver, Receiver):
            raise TypeError(f"Expected `receiver` to be a streamwatch Receiver, got {receiver!r}")
        check_int(batch, "batch")
        self._receiver = receiver
        self._batch = batch
        self._prepare = prepare
        self._failed_items = 0
        self._name = name
        self._pipelines: tuple[Pipeline, ...] = ()  # copy-on-write: the thread reads a snapshot per batch
        self._lock = threading.Lock()
        self._errors: list[tuple[str, BaseException]] = []  # not yet reported to the owner
        self.has_errors = False
        """Whether failures await :meth:`check` (an attribute: a lock-free read, for hot paths)."""
        self._failed = 0
        self._items = 0
        self._batches = 0
        self._busy = 0.0
        self._thread: threading.Thread | None = None
        self._closed = False
        self._in_flight = 0  # items of the current batch not yet through every pipeline
        self._current: Pipeline | None = None  # the pipeline being called now
        for pipeline in pipelines:
            self.add(pipeline)

    def add(self, pipeline: Pipeline) -> Pipeline:
        """Attach ``pipeline``; it receives every item that arrives from now on. Thread-safe.

        Raises:
            TypeError: not a :class:`~streamwatch.Pipeline` (build one with ``stream | sink``).
            RuntimeError: the worker is closed, or the pipeline is already closed.
        """
        if not isinstance(pipeline, Pipeline):
            raise TypeError(f"Expected `pipeline` to be a Pipeline (`stream | sink`), got {pipeline!r}")
        with self._lock:
            if self._closed:
                raise RuntimeError(f"cannot add {pipeline!r}: the worker is closed")
            if pipeline.closed or pipeline in self._pipelines:
                raise RuntimeError(f"cannot add {pipeline!r}: it is closed or already attached")
            self._pipelines = (*self._pipelines, pipeline)
        return pipeline

    def start(self) -> Worker:
        """Start the thread (once). Returns ``self``."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("the worker was already started; a worker runs once")
            if self._closed:
                raise RuntimeError("cannot start a closed worker")
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        receiver = self._receiver
        limit = self._batch
        perf_counter = time.perf_counter
        try:
            prepare = self._prepare
            while batch := receiver.recv_many(limit):
                start = perf_counter()
                pipelines = self._pipelines
                left = len(batch)
                for item in batch:
                    self._in_flight = left
                    left -= 1
                    if prepare is not None:
                        try:
                            item = prepare(item)
                        except BaseException as exc:
                            self._failed_items += 1
                            self._record(f"<prepare {getattr(prepare, '__qualname__', prepare)!s}>", exc)
                            continue
                    for pipeline in pipelines:
                        if pipeline.closed:
                            continue
                        self._current = pipeline
                        try:
                            pipeline.push(item)
                        except BaseException as exc:  # a sink's SystemExit too: it stops that pipeline only
                            self._fail(pipeline, exc)
                    self._current = None
                self._in_flight = 0
                self._items += len(batch)
                self._batches += 1
                self._busy += perf_counter() - start
        except BaseException as exc:  # a bug in the worker itself: keep it for the owner
            self._record("<worker>", exc)
        finally:
            self._in_flight = 0
            for pipeline in self._pipelines:
                self._current = pipeline
                try:
                    pipeline.close()
                except BaseException as exc:
                    self._fail(pipeline, exc)
            self._current = None

    def _fail(self, pipeline: Pipeline, exc: BaseException) -> None:
        """Stop ``pipeline`` after ``exc``, count and keep the error. Never raises: a second error from the
        sink's ``fail`` becomes a note on ``exc``."""
        self._failed += 1
        try:
            pipeline.fail(exc)
        except BaseException as again:
            _note(exc, f"then {describe(pipeline.sink)}.fail() raised {type(again).__name__}: {again}")
        self._record(describe(pipeline), exc)

    def _record(self, name: str, exc: BaseException) -> None:
        with self._lock:
            self._errors.append((name, exc))
            self.has_errors = True

    @property
    def stopped(self) -> bool:
        """Whether the thread was started and has ended (closed, or a bug in the worker itself): nothing
        sent from now on will be handled. A failed pipeline does not stop it."""
        thread = self._thread
        return thread is not None and not thread.is_alive()

    def check(self) -> None:
        """Raise failures not yet reported, as one :class:`~streamwatch.PipelineError`. Thread-safe.

        Each failure is reported once; a clean worker returns ``None``.
        """
        with self._lock:
            errors, self._errors = self._errors, []
            self.has_errors = False
        if errors:
            raise PipelineError(errors) from errors[0][1]

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting items, drain what was sent, flush and close every pipeline, join the thread.

        A worker that was never started drains on the calling thread. Idempotent.

        Args:
            timeout: the most seconds to wait for the thread (``None`` or ``math.inf``: forever).

        Raises:
            PipelineError: failures not yet reported by :meth:`check`.
            TimeoutError: the thread did not finish within ``timeout`` seconds (it keeps draining;
                ``statistics().current`` names the pipeline it is inside, ``in_flight`` the items
                it holds).
            ValueError: ``timeout`` is not a number of seconds > 0.
        """
        timeout = None if timeout is None else seconds_or_forever(timeout, "timeout")
        with self._lock:
            first = not self._closed
            self._closed = True
            thread = self._thread
        self._receiver.close()
        if first and thread is None:
            self._run()
        elif thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(
                    f"the worker did not drain within {timeout} s ({self._receiver.statistics().len} items "
                    "left); a pipeline may be slow — call close() again to keep waiting"
                )
        self.check()

    def statistics(self) -> WorkerStatistics:
        """A snapshot of the worker's counters. Thread-safe."""
        thread = self._thread
        return WorkerStatistics(
            items=self._items,
            batches=self._batches,
            pipelines=len(self._pipelines),
            failed=self._failed,
            failed_items=self._failed_items,
            busy_seconds=self._busy,
            running=thread is not None and thread.is_alive(),
            in_flight=self._in_flight,
            current=describe(current) if (current := self._current) is not None else "",
        )

    @property
    def pipelines(self) -> tuple[Pipeline, ...]:
        """Attached pipelines, in the order they were added."""
        return self._pipelines

    def __enter__(self) -> Worker:
        if self._thread is None:
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # the body already failed: don't let a pipeline error replace the original
            self.close()
        except PipelineError as err:
            if exc is not None and hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(f"streamwatch: {err}")

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._thread is not None else "new")
        return f"<Worker {state} pipelines={len(self._pipelines)}>"


def _note(exc: BaseException, note: str) -> None:
    """Add ``note`` to ``exc`` (shown with its traceback; Python >= 3.11)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)


def give_up(
    worker: Worker, sender: Sender[Any], waited: float, evaluation_sent: bool
) -> tuple[tuple[str, ...], int, list[tuple[str, BaseException]]]:
    """close() waited ``waited`` seconds for the worker in vain: warn, leave it behind. Returns the
    pipelines stuck, the records not flushed to every sink, and the failures the worker had before."""
    stats = worker.statistics()
    stuck = (stats.current,) if stats.current else ()
    unflushed = stats.in_flight + sender.statistics().len + (not evaluation_sent)
    errors: list[tuple[str, BaseException]] = []
    try:
        worker.check()  # failures before it got stuck are reported as usual
    except PipelineError as err:
        errors.extend(err.errors)
    what = f"{stats.current} did not return" if stats.current else "the worker thread did not finish"
    warnings.warn(
        f"streamwatch: close() gave up after {waited:g} s: {what}; {unflushed} records were not "
        "flushed to every sink. The worker thread is left running (a daemon thread: it does not keep "
        "the process alive) and finishes by itself if that call returns. Wait longer with "
        "observe(..., close_timeout=...) or close(timeout=...) (math.inf waits forever).",
        RuntimeWarning,
        stacklevel=4,  # the user's close() call
    )
    return stuck, unflushed, errors
