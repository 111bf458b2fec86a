"""Replay a recorded run on ``/metrics``, so Prometheus and Grafana dashboards work after the fact.

A :class:`Replay` feeds the run's step records, one at a time at ``speed`` steps per second, into a
:class:`streamwatch.SeriesStore` — the store a live :class:`streamwatch.Watch` keeps, running the same
worker-side metrics (``update_ratio``, ``layer_mean``), with the histogram edges the run file carries —
and serves it through the live exporter's collector and server (:class:`StoreCollector`,
:class:`streamwatch.sinks._http.MetricsServer`). So the families, names, labels and values are those the
live exporter served at that record (``streamwatch_tensor``, ``streamwatch_tensor_values``,
``streamwatch_layer_mean``, ``streamwatch_loss``, ...), with the identity labels ``run`` (``run=``,
else the run file's directory name), ``rank`` (the records'), ``local_rank``, ``world_size`` and
``host``. The monitoring's own counters (records dropped, queue length, ...) report the replay: records
replayed so far, nothing dropped. What a live watch computes on its worker from the records is computed
again: the default detectors (``streamwatch.detectors.DEFAULT_DETECTORS``: their series and counters, from
the first record of each pass) and the first non-finite value (``streamwatch_first_nonfinite_info``). A
detector that raises is dropped and the rest go on.

Looping never spins a core: a pass through the records, with the pause before the next one, lasts at
least :data:`MIN_PASS_SECONDS`; with ``speed=0`` there is no timeline to repeat, so the last record is
served (the stepping thread asleep) until :meth:`Replay.close`; a run with no records serves only its
identity (``streamwatch_info``) and the replay's counters, the thread asleep likewise.
"""

from __future__ import annotations

import dataclasses
import errno
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING

from streamwatch._detectors import DEFAULT_DETECTORS, pipelines
from streamwatch._nonfinite import NonFiniteTracker
from streamwatch._pipeline import Pipeline, source
from streamwatch._store import SeriesStore, WatchStatistics
from streamwatch._validate import check_int, check_real
from streamwatch.metrics._derived import DEFAULT_METRICS
from streamwatch.sinks._http import MetricsServer, listen
from streamwatch.sinks._prometheus import DEFAULT_PORT, DEFAULT_TIMEOUT, StoreCollector, identity

if TYPE_CHECKING:
    from streamwatch._record import StepRecord
    from streamwatch.sinks import RunData

__all__ = ["MIN_PASS_SECONDS", "Replay"]

MIN_PASS_SECONDS = 1.0
"""With ``loop=True``, the shortest a pass through the records (and the pause after it) may take."""

_MAX_WAIT = 3600.0  # Event.wait overflows for huge timeouts: wait in pieces this long at most


class Replay:
    """Serve a recorded run's series on ``http://host:port/metrics``, stepping through its records.

    Args:
        run: a run file read back with :func:`streamwatch.sinks.read_run`.
        port: the port to serve on (0 picks a free one; see :attr:`url`).
        host: the interface to bind.
        speed: records per second; ``0`` jumps straight to the last record.
        loop: start over from the first record after the last one (forever, until :meth:`close`), one
            record interval after it and no sooner than :data:`MIN_PASS_SECONDS` after the pass began.
            With ``speed=0`` or no records there is nothing to repeat: the last state is served until
            :meth:`close` (and :meth:`wait_until_done` waits until then, as for any loop).
        run_name: the ``run`` label (default: the name of the run file's directory).
        series_budget: as for :meth:`streamwatch.Watch.expose`.
        metrics: the worker-side metrics the store runs on the records (default
            ``streamwatch.DEFAULT_METRICS``, as ``observe()``).
        rank: the rank whose records are served, under its ``rank`` label (default: the first
            record's). One endpoint serves one rank, as the live exporter does: a run file holding
            several ranks' records serves the one chosen (:attr:`ranks` lists them all).

    Raises:
        ValueError: a bad argument, or a ``rank`` the run file has no record of.

    Example::

        from streamwatch.sinks import read_run
        with Replay(read_run("runs/a/run.jsonl"), speed=20) as replay:  # started
            print(replay.url)
            replay.wait_until_done(timeout=60)
    """

    def __init__(
        self,
        run: RunData,
        *,
        port: int = DEFAULT_PORT,
        host: str = "127.0.0.1",
        speed: float = 10.0,
        loop: bool = False,
        run_name: str | None = None,
        series_budget: int = 5000,
        metrics: Sequence[str] = DEFAULT_METRICS,
        rank: int | None = None,
    ) -> None:
        check_int(port, "port", minimum=0, maximum=65535)
        check_real(speed, "speed", at_least=0, finite=True, note="records per second")
        check_int(series_budget, "series_budget")
        self.ranks: tuple[int, ...] = tuple(sorted({r.rank for r in run.records}))
        """Every rank the run file has records of."""
        if rank is not None and rank not in self.ranks:
            raise ValueError(
                f"{run.path} has no record of rank {rank!r}; its ranks: "
                f"{', '.join(map(str, self.ranks)) or 'none'}"
            )
        chosen = rank if rank is not None else (run.records[0].rank if run.records else None)
        if len(self.ranks) > 1:  # (one endpoint, one rank: the series of several would overwrite each other)
            run = dataclasses.replace(run, records=[r for r in run.records if r.rank == chosen])
        self.run = run
        self.port = port
        self.host = host
        self.speed = float(speed)
        self.loop = bool(loop)
        labels = identity(run_name if run_name is not None else (run.path.resolve().parent.name or "run"))
        if chosen is not None:
            labels["rank"] = str(chosen)
        self.labels = labels
        self._metrics = tuple(metrics)
        self._store = SeriesStore(self._metrics)
        self._tracker = NonFiniteTracker(self._store, None)
        self._pipelines = self._fresh_pipelines()
        self.detector_failures: list[tuple[str, BaseException]] = []
        """Detectors dropped because they raised (``(pipeline, exception)``), over every pass."""
        self._served = 0  # records served, over every pass
        self._collector = StoreCollector(self._store, self.statistics, labels, series_budget)
        self._server: MetricsServer | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self.url = f"http://{host}:{port}/metrics"

    @property
    def current_step(self) -> int | None:
        """The step of the record served now (None before the first)."""
        return self._store.step

    @property
    def store(self) -> SeriesStore:
        """The series store served now (a fresh one each pass of a loop)."""
        return self._store

    def statistics(self) -> WatchStatistics:
        """The replay's own statistics, served as the monitoring's: records replayed so far (over every
        pass of a loop), nothing dropped or queued."""
        return WatchStatistics.replayed(self._served, self._tracker.first)

    def _fresh_pipelines(self) -> list[Pipeline]:
        """The tracker and the default detectors, publishing into the current store (a pass's own)."""
        return [source() | self._tracker, *pipelines(self._store, DEFAULT_DETECTORS)]

    def start(self) -> Replay:
        """Start serving (an HTTP server thread) and stepping (a thread advancing through the records).

        Raises:
            OSError: the port is in use (the message names it and the fix).
            RuntimeError: already started or closed.
        """
        with self._lock:
            if self._closed or self._server is not None:
                raise RuntimeError("Replay.start(): already started or closed; create another Replay")
            self._serve()
            stepper = threading.Thread(target=self._step_through, name="streamwatch-replay", daemon=True)
            self._threads.append(stepper)
            stepper.start()
        return self

    def _serve(self) -> None:
        try:
            sock = listen(self.host, self.port, MetricsServer.backlog)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise OSError(
                    errno.EADDRINUSE,
                    f"streamwatch replay: port {self.port} on {self.host} is already in use; pass "
                    "Replay(port=...) another port (port=0 picks a free one), or stop the process that "
                    "holds it",
                ) from err
            raise
        self.port = sock.getsockname()[1]
        self.url = f"http://{self.host}:{self.port}/metrics"
        self._server = MetricsServer(
            sock,
            self._collector.render,
            self._collector.version,
            timeout=DEFAULT_TIMEOUT,
            name="streamwatch-replay-metrics",
            render_openmetrics=lambda: self._collector.render(openmetrics=True),
        )

    def _wait_until(self, deadline: float) -> bool:
        """Sleep until ``time.monotonic()`` reaches ``deadline`` (which may be inf); True if stopped."""
        while (left := deadline - time.monotonic()) > 0:
            if self._stop.wait(min(left, _MAX_WAIT)):
                return True
        return self._stop.is_set()

    def _step_through(self) -> None:
        records = self.run.records
        try:
            while not self._stop.is_set():
                start = time.monotonic()
                if self.speed == 0:
                    for record in records:
                        self._send(record)
                else:
                    for i, record in enumerate(records):
                        if self._wait_until(start + i / self.speed):
                            return
                        self._send(record)
                if not self.loop:
                    return
                if self.speed == 0 or not records:  # nothing to repeat: serve this state until close()
                    self._stop.wait()
                    return
                pause = start + max(len(records) / self.speed, MIN_PASS_SECONDS)
                if self._wait_until(pause):
                    return
                # start over: the first record's values, not the last pass's
                self._store = self._collector.store = SeriesStore(self._metrics)
                self._tracker = NonFiniteTracker(self._store, None)
                self._pipelines = self._fresh_pipelines()
        finally:
            self._done.set()

    def _send(self, record: StepRecord) -> None:
        for pipeline in list(self._pipelines):  # before the store counts the record, as live
            try:
                pipeline.push(record)
            except Exception as exc:  # this detector stops; the rest go on
                self._pipelines.remove(pipeline)
                self.detector_failures.append((repr(pipeline), exc))
        self._store.send(record)
        self._served += 1

    def wait_until_done(self, timeout: float | None = None) -> bool:
        """Wait until the last record is served (never, with ``loop=True``, until :meth:`close`).

        Returns:
            Whether it was done within ``timeout`` seconds.
        """
        return self._done.wait(timeout)

    def close(self) -> None:
        """Stop stepping and serving, join the threads. Idempotent."""
        with self._lock:
            self._closed = True
            self._stop.set()
            server, self._server = self._server, None
            threads, self._threads = self._threads, []
        if server is not None:
            server.close()
        for thread in threads:
            thread.join(timeout=5)

    def __enter__(self) -> Replay:
        if self._server is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Replay {str(self.run.path)!r} at {self.url}, step {self.current_step}>"
