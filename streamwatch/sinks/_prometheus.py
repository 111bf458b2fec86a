"""The Prometheus exporter: a custom ``Collector`` over a Watch's latest values, served per process.

Nothing here runs on the training thread or keeps a ``Gauge`` per series: at each scrape, the collector
reads ``watch.snapshot()`` (the worker's latest values, under one lock) and ``watch.statistics()`` and
builds the metric families then, so the hot path pays nothing for Prometheus and a scrape costs one pass
over the series.

Naming (docs/prometheus.md has the full table): namespace ``streamwatch_``, base units,
counters end in ``_total``; every series carries the process identity ``run``, ``rank``, ``local_rank``,
``world_size`` and ``host`` (Prometheus adds ``job`` and ``instance`` from the scrape config), and
``streamwatch_info`` holds the same identity with value 1 for dashboard variables. Sums of squares and
counts are exported beside norms (``stat="sumsq"``, ``stat="count"``), so a global norm across layers,
shards or ranks is exact in PromQL: ``sqrt(sum by (run) (streamwatch_tensor{kind="param_grad",
stat="sumsq"}))``.

**Series budget**: past ``series_budget`` (default 5 000) ``streamwatch_tensor`` series per process, the
per-layer statistics are reduced to :data:`CORE_STATS` (norms, sums of squares, counts, mean, extremes,
non-finite counts, dead fraction); if that is still too many, the per-layer series are replaced by one
aggregate per (phase, kind) with ``layer="__all__"`` (sums of the additive columns, min of minima, max of
maxima, statistics derived from those). A warning is logged once and ``streamwatch_series_reduced_total``
counts the scrapes that had to reduce.

**The server** (:class:`_MetricsServer`) has two threads whatever the load. One multiplexes every
connection over non-blocking sockets: a client that connects and sends nothing, half a request or reads
slowly holds a buffer, never a thread, and is closed after ``timeout`` (default 10 s) seconds; at most
64 connections are open (a new one evicts the oldest still sending its request); only ``GET``/``HEAD
/metrics`` are served (other methods 405 with ``Allow``, other paths 404, a bad request line 400,
oversized headers 431). The other answers the waiting requests in batches, at most 4 a second, with one
body per version of the values (rendered at most once however many scrapers ask, and at most 2 % of the
time), so a scrape storm neither starts threads nor takes the training thread's GIL for long.
``close()`` joins both threads and closes every connection. ``host=""`` is refused (it would bind every
interface); unresolvable and foreign hosts and taken ports are errors that name the host or port and
the fix. Every family passes ``promtool check metrics`` (the accuracy's denominator is the gauge
``streamwatch_predictions``: ``_total`` is for counters).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import selectors
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString as _float_to_go

from streamwatch._record import Sample
from streamwatch._summary import COLUMNS, derive

if TYPE_CHECKING:
    from streamwatch._observe import Watch

__all__ = ["CORE_STATS", "DEFAULT_PORT", "DEFAULT_TIMEOUT", "Exporter", "identity"]

log = logging.getLogger("streamwatch")

DEFAULT_PORT = 9400
"""The default base port: rank ``LOCAL_RANK`` serves on ``DEFAULT_PORT + LOCAL_RANK``."""

DEFAULT_TIMEOUT = 10.0
"""Seconds a /metrics client has to send its request, and again to read the response, before the
connection is closed (``expose(timeout=...)``)."""

_JOIN_S = 10.0  # bound on joining the server's threads at close()

CORE_STATS = ("count", "sumsq", "l2", "mean", "min", "max", "nonfinite", "dead_fraction")
"""The statistics kept per layer when the series budget is exceeded."""

_IDENTITY = ("run", "rank", "local_rank", "world_size", "host")

_HELP = {
    "streamwatch_tensor": "Statistics of a tapped tensor (stat: count, sum, sumsq, min, max, l2, ...)",
    "streamwatch_layer_mean": "Mean over layers of a per-layer statistic, per phase and kind",
    "streamwatch_loss": "The step's loss",
    "streamwatch_accuracy": "Accuracy (ratio): train from the step's outputs, eval from the evaluation",
    "streamwatch_learning_rate": "Learning rate of a parameter group",
    "streamwatch_step_seconds": "Wall time of the last step (seconds)",
    "streamwatch_samples_per_second": "Training throughput of the last step (samples per second)",
    "streamwatch_batch_size": "Samples in the last step",
    "streamwatch_step": "Index of the last step processed by the worker",
    "streamwatch_correct": "Correct predictions in the last step",
    "streamwatch_predictions": "Predictions in the last step (the denominator of the train accuracy)",
    "streamwatch_hessian_max_eig": "Largest-magnitude eigenvalue of the loss Hessian",
    "streamwatch_step_phase_seconds": "Host wall time of a part of the last sampled step (seconds)",
}


def identity(run: str | None = None) -> dict[str, str]:
    """The process identity every series carries: run (``run``, else ``$STREAMWATCH_RUN``, else the
    script's name), torchrun's ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` (0/0/1 without them), the host.

    Example:
        >>> sorted(identity("demo"))
        ['host', 'local_rank', 'rank', 'run', 'world_size']
    """
    if run is None:
        script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] not in ("", "-", "-c") else ""
        run = os.environ.get("STREAMWATCH_RUN") or script or "python"
    return {
        "run": run,
        "rank": os.environ.get("RANK", "0"),
        "local_rank": os.environ.get("LOCAL_RANK", "0"),
        "world_size": os.environ.get("WORLD_SIZE", "1"),
        "host": socket.gethostname(),
    }


class _Collector(Collector):
    """Builds every family at scrape time from the Watch's latest values and statistics."""

    def __init__(self, watch: Watch, labels: dict[str, str], series_budget: int) -> None:
        self.watch = watch
        self.identity = labels
        self.series_budget = series_budget
        self.reductions = 0
        self._warned = False
        self._lock = threading.RLock()
        self._prefixes: dict[tuple[Any, str], str] = {}  # (series key, stat) -> 'name{labels}'

    def collect(self) -> Iterator[Any]:
        with self._lock:  # concurrent scrapes: one at a time (the reduction counter)
            yield from self._collect()

    def version(self) -> object:
        """A value that changes whenever :meth:`render` would render something else: the latest values'
        record count and step, the derived and served values, and the watch's statistics (steps, queue,
        overhead, ...). Cheap: no formatting, one short lock."""
        latest = self.watch._latest
        with latest.lock:
            values = (
                id(latest),
                latest.records,
                latest.step,
                len(latest.rows),
                len(latest.extras),
                tuple(s.value for s in latest.derived.values()),
            )
        return values, self.watch.statistics()

    def render(self) -> bytes:
        """The text exposition of every family, the per-tensor statistics formatted here from cached
        label strings (prometheus_client formats ~15 µs per sample on a small VM; this ~1 µs)."""
        with self._lock:
            latest = self.watch._latest
            table, keys = latest.table()
            samples = latest.samples(table_rows=False)
            extra = [s for s in samples if s.name == "streamwatch_tensor"]
            stats = {name: table[:, i] for i, name in enumerate(COLUMNS)} | derive(table)
            count = sum(int(np.count_nonzero(~np.isnan(v))) for v in stats.values()) + len(extra)
            if count > self.series_budget:  # the reduction path (rare): prometheus_client's formatter
                return generate_latest(self)
            lines = (
                []
                if not count
                else [
                    f"# HELP streamwatch_tensor {_HELP['streamwatch_tensor']}",
                    "# TYPE streamwatch_tensor gauge",
                ]
            )
            prefixes = self._prefixes
            if len(prefixes) > 4 * self.series_budget:  # layers came and went: start over
                prefixes.clear()
            for stat, values in stats.items():
                for key, value in zip(keys, values.tolist(), strict=True):
                    if value != value:  # NaN: unknown, absent
                        continue
                    prefix = prefixes.get((key, stat))
                    if prefix is None:
                        prefix = prefixes[(key, stat)] = self._prefix({**key.labels(), "stat": stat})
                    lines.append(f"{prefix} {floatToGoString(value)}")
            for sample in extra:
                lines.append(f"{self._prefix(dict(sample.labels))} {floatToGoString(sample.value)}")
            text = "\n".join(lines) + "\n" if lines else ""
            rest = generate_latest(_Families(list(self._collect(samples=samples, counts=(count, count)))))
            return text.encode() + rest

    def _prefix(self, labels: Mapping[str, str]) -> str:
        merged = {**self.identity, **labels}
        body = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(merged.items()))
        return f"streamwatch_tensor{{{body}}}"

    def _collect(
        self, samples: list[Sample] | None = None, counts: tuple[int, int] | None = None
    ) -> Iterator[Any]:
        """Every family; with ``samples`` (all but the table's statistics) and their ``counts``, all but
        ``streamwatch_tensor``, which :meth:`render` formatted."""
        ident_names, ident_values = list(self.identity), list(self.identity.values())
        info = InfoMetricFamily(
            "streamwatch", "Process identity of a streamwatch exporter", labels=ident_names
        )
        info.add_metric(ident_values, {"version": _version()})
        yield info
        if samples is None:
            samples = self.watch.snapshot()
            tensors = [s for s in samples if s.name == "streamwatch_tensor"]
            wanted = len(tensors)
            tensors = self._budget(tensors)
            exported = len(tensors)
        else:
            tensors, (wanted, exported) = [], counts or (0, 0)
        families: dict[str, list[Sample]] = {"streamwatch_tensor": tensors}
        histograms: list[Sample] = []
        for sample in samples:
            if sample.name == "streamwatch_tensor":
                continue
            if sample.name == "streamwatch_tensor_histogram":
                histograms.append(sample)
            else:
                families.setdefault(sample.name, []).append(sample)
        for name, members in families.items():
            if not members:
                continue
            label_names = sorted({k for s in members for k in s.labels} - set(ident_names))
            family = GaugeMetricFamily(
                name,
                _HELP.get(name, f"{name} (served by a streamwatch pipeline)"),
                labels=[*ident_names, *label_names],
            )
            for s in members:
                family.add_metric([*ident_values, *(s.labels.get(k, "") for k in label_names)], s.value)
            yield family
        if histograms:
            yield self._histograms(histograms, ident_names, ident_values)
        yield from self._self_metrics(ident_names, ident_values, wanted, exported)

    def _budget(self, tensors: list[Sample]) -> list[Sample]:
        if len(tensors) <= self.series_budget:
            return tensors
        self.reductions += 1
        core = [s for s in tensors if s.labels["stat"] in CORE_STATS]
        level = "core statistics per layer"
        if len(core) > self.series_budget:
            core = _aggregate(self.watch)
            level = 'one aggregate per phase and kind (layer="__all__")'
        if not self._warned:
            self._warned = True
            log.warning(
                "streamwatch: %d tensor series exceed the series budget of %d per process; exporting %s "
                "(%d series). Select fewer modules (observe(select=...)) or raise expose(series_budget=...).",
                len(tensors),
                self.series_budget,
                level,
                len(core),
            )
        return core

    def _histograms(
        self, samples: list[Sample], names: list[str], values: list[str]
    ) -> HistogramMetricFamily:
        """Bucket counts (streamwatch.metrics.Buckets order) as cumulative ``le`` buckets."""
        bounds = _histogram_bounds(self.watch)
        series: dict[tuple[tuple[str, str], ...], dict[int, float]] = {}
        for s in samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("bucket", "stat")}
            series.setdefault(tuple(sorted(labels.items())), {})[int(s.labels["bucket"])] = s.value
        label_names = ["phase", "layer", "kind", "param", "index"]
        family = HistogramMetricFamily(
            "streamwatch_tensor_values",
            "Values of a tapped tensor in fixed log-spaced buckets (non-finite values excluded: see "
            'streamwatch_tensor{stat="nonfinite"})',
            labels=[*names, *label_names],
        )
        for key, counts in series.items():
            labels = dict(key)
            upper = bounds.get(labels.get("kind", ""))
            if upper is None:
                continue
            vector = np.array([counts.get(i, 0.0) for i in range(len(upper) + 1)])
            cumulative = np.cumsum(vector[1:])  # bucket 0 (non-finite) is not a value; the last bound is +inf
            buckets = [(_le(b), float(c)) for b, c in zip(upper, cumulative, strict=True)]
            # negative buckets: no _sum/_count (the Prometheus convention); the +Inf bucket is the count
            family.add_metric([*values, *(labels.get(k, "") for k in label_names)], buckets, None)
        return family

    def _self_metrics(self, names: list[str], values: list[str], wanted: int, exported: int) -> Iterator[Any]:
        stats = self.watch.statistics()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        def counter(
            name: str, doc: str, value: float, extra: Mapping[str, float] | None = None, label: str = ""
        ) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=[*names, label] if label else names)
            if extra is None:
                family.add_metric(values, value)
            else:
                for key, v in extra.items():
                    family.add_metric([*values, key], v)
            return family

        yield counter("streamwatch_steps", "Steps seen (watch.step() calls)", stats.steps)
        yield counter("streamwatch_steps_sampled", "Steps whose record was sent to the worker", stats.sampled)
        yield counter(
            "streamwatch_records", "Records the worker turned into step records", stats.records_received
        )
        dropped = {
            "drop_oldest": float(stats.dropped_oldest),
            "drop_newest": float(stats.dropped_newest),
            "slots_exhausted": float(stats.slots_exhausted),
        }
        yield counter("streamwatch_records_dropped", "Records dropped, by reason", 0, dropped, "reason")
        yield gauge("streamwatch_queue_length", "Records waiting for the worker", stats.queue_len)
        yield gauge(
            "streamwatch_queue_high_water", "Most records ever waiting for the worker", stats.queue_high_water
        )
        if not math.isnan(stats.worker_lag_seconds):
            yield gauge(
                "streamwatch_worker_lag_seconds",
                "From the step boundary to the worker having processed its record (latest)",
                stats.worker_lag_seconds,
            )
        yield counter(
            "streamwatch_hook_errors", "Exceptions caught inside hooks and metrics", stats.hook_errors
        )
        yield counter(
            "streamwatch_sink_errors", "Pipelines and sinks stopped by an exception", stats.pipeline_failures
        )
        skipped = {reason: float(n) for reason, n in stats.skipped.items()}
        yield counter(
            "streamwatch_tensors_skipped", "Tensors not summarised, by reason", 0, skipped, "reason"
        )
        yield gauge(
            "streamwatch_series", "streamwatch_tensor series exported (after the series budget)", exported
        )
        yield gauge("streamwatch_series_wanted", "streamwatch_tensor series before the series budget", wanted)
        yield counter(
            "streamwatch_series_reduced", "Scrapes that reduced series to fit the budget", self.reductions
        )
        yield gauge(
            "streamwatch_overhead_last_step_seconds",
            "streamwatch's own time on the training thread in the last step (in-process estimate)",
            stats.overhead_seconds,
        )
        yield counter(
            "streamwatch_overhead_seconds",
            "streamwatch's own time on the training thread, all steps (in-process estimate)",
            stats.overhead_seconds_total,
        )


def _render_app(collector: _Collector) -> Any:
    """A WSGI app serving ``collector.render()`` on any path (GET /metrics is what Prometheus asks)."""

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        if environ.get("PATH_INFO") == "/favicon.ico":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b""]
        body = collector.render()
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST), ("Content-Length", str(len(body)))])
        return [body]

    return app


class _Families:
    """Already-built families, in the shape ``generate_latest`` reads (``collect()``)."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families


def floatToGoString(value: float) -> str:
    """A float as Prometheus' text format writes it (``+Inf``, ``-Inf``, shortest round-trip repr)."""
    text: str = _float_to_go(value)  # type: ignore[no-untyped-call]
    return text


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) and bound > 0 else repr(float(bound))


def _histogram_bounds(watch: Watch) -> dict[str, list[float]]:
    """``kind -> upper bounds`` of the Histogram metrics the watch runs."""
    from streamwatch.metrics._tensor import Histogram

    out: dict[str, list[float]] = {}
    for metric in getattr(watch, "_metrics", ()):
        if isinstance(metric, Histogram):
            for kind in metric.kinds:
                out[kind] = list(metric.buckets.upper_bounds())
    return out


def _aggregate(watch: Watch) -> list[Sample]:
    """One row per (phase, kind): additive columns summed, extremes combined, statistics re-derived."""
    table, keys = watch._latest.table()
    groups: dict[tuple[str, str], list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault((key.phase, key.kind), []).append(i)
    out: list[Sample] = []
    col = {name: i for i, name in enumerate(COLUMNS)}
    for (phase, kind), rows in groups.items():
        part = table[rows]
        row = np.nansum(part, axis=0)
        row[col["min"]] = np.min(part[:, col["min"]])
        row[col["max"]] = np.max(part[:, col["max"]])
        row = row.reshape(1, -1)
        stats = {name: row[:, i] for i, name in enumerate(COLUMNS)} | derive(row)
        labels = {"phase": phase, "layer": "__all__", "kind": kind, "param": "", "index": ""}
        for stat in CORE_STATS:
            value = float(stats[stat][0])
            if not math.isnan(value):
                out.append(Sample("streamwatch_tensor", {**labels, "stat": stat}, value))
    return out


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("streamwatch")
    except Exception:  # not installed (a source checkout on sys.path)
        return "unknown"


class _Conn:
    """One client connection, owned by the server's I/O thread.

    ``state``: ``read`` (until the request's headers are in), ``wait`` (for the render thread's body),
    ``write`` (the response, non-blocking), ``drain`` (written; reading what the client still sends
    until it closes, so unread request bytes do not turn the close into a reset that loses the response).
    """

    __slots__ = ("buffer", "closed", "deadline", "events", "head", "linger", "out", "sock", "state")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.state = "read"
        self.buffer = bytearray()
        self.out = memoryview(b"")
        self.deadline: float | None = deadline
        self.head = False
        self.linger = False
        self.closed = False
        self.events = 0  # what the selector watches for (0: not registered)


class _Cached:
    """A rendered body and the full responses to GET and HEAD, for one version of the values."""

    __slots__ = ("get", "head", "version")

    def __init__(self, version: object, status: str, body: bytes, content_type: str) -> None:
        self.version = version
        header = _response_head(status, content_type, len(body))
        self.head = header
        self.get = header + body


def _response_head(status: str, content_type: str, length: int, extra: str = "") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\n{extra}"
        "Connection: close\r\n\r\n"
    ).encode("latin-1")


def _plain(status: str, text: str, extra: str = "") -> bytes:
    body = text.encode()
    return _response_head(status, "text/plain; charset=utf-8", len(body), extra) + body


_NOT_ALLOWED = _plain("405 Method Not Allowed", "Only GET and HEAD are served.\n", "Allow: GET, HEAD\r\n")
_NOT_FOUND = _plain("404 Not Found", "Not found: streamwatch serves /metrics only.\n")
_BAD_REQUEST = _plain("400 Bad Request", "Bad request.\n")
_TOO_LARGE = _plain("431 Request Header Fields Too Large", "Request headers too large.\n")
_BUSY = _plain("503 Service Unavailable", "Too many connections; retry.\n", "Retry-After: 1\r\n")


class _MetricsServer:
    """``GET /metrics`` over one listening socket, with two threads whatever the load.

    The I/O thread multiplexes every connection with a selector (non-blocking sockets: a connection that
    sends nothing, half a request line or reads its response slowly holds a few bytes of buffer, never a
    thread), closes each one whose request or response is not through within ``timeout`` seconds, keeps
    at most :attr:`max_connections` (a new one evicts the oldest still sending its request), and answers
    anything but ``GET``/``HEAD`` with 405 and paths other than ``/metrics`` with 404 itself.

    The render thread answers the requests for ``/metrics`` in batches: every request waiting when a
    batch starts gets the same body, rendered then (values at least as new as the request) unless
    ``version()`` is unchanged since the cached body was rendered, so a scrape storm costs one render per
    change of the values. Batches are spaced: at least :attr:`min_interval` seconds apart, and renders
    take at most :attr:`render_share` of the time, so scrapers cannot keep the process busy beside the
    training loop (requests wait for the next batch instead; Prometheus' default scrape timeout is 10 s).

    ``close()`` stops both threads, joins them and closes every socket, the selector and the wake pipe.
    """

    backlog = 64
    """Connections the kernel queues before they are accepted."""
    max_connections = 64
    """Connections open at once; past it a new one evicts the oldest still sending its request."""
    max_request_bytes = 8192
    """The largest request head (request line and headers); past it: 431."""
    min_interval = 0.25
    """Seconds between two batches of responses (requests meanwhile wait for the next batch): at most
    ``max_connections / min_interval`` responses a second, whatever the clients do."""
    render_share = 0.02
    """The largest fraction of the time spent rendering: after a render of ``d`` seconds, the next batch
    waits at least ``d * (1 / render_share - 1)`` (up to :attr:`max_interval`)."""
    max_interval = 2.0
    """The longest wait between batches however slow renders are (a caller's registry of 10 k series
    renders in about 0.4 s): well inside Prometheus' default scrape timeout of 10 s."""

    def __init__(
        self,
        sock: socket.socket,
        render: Callable[[], bytes],
        version: Callable[[], object] | None,
        *,
        timeout: float,
        name: str = "streamwatch-metrics",
    ) -> None:
        self._listener = sock
        self._render = render
        self._version = version
        self.timeout = timeout
        self._conns: dict[socket.socket, _Conn] = {}  # in accept order: the first is the oldest
        self._cond = threading.Condition()
        self._pending: list[_Conn] = []  # requests for /metrics, waiting for a body (under _cond)
        self._done: deque[tuple[list[_Conn], _Cached | None]] = deque()  # bodies for the I/O thread
        self._stopping = False
        self._cache: _Cached | None = None
        self._next_batch = 0.0
        self._render_errors = 0
        self.renders = 0
        sock.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._threads = [
            threading.Thread(target=self._serve_io, name=name, daemon=True),
            threading.Thread(target=self._serve_renders, name=f"{name}-render", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # -- the I/O thread ------------------------------------------------------------------------------

    def _serve_io(self) -> None:
        selector = self._selector
        try:
            while not self._stopping:
                deadlines = [c.deadline for c in self._conns.values() if c.deadline is not None]
                wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                for key, mask in selector.select(wait):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._drain_wake()
                    else:
                        conn: _Conn = key.data
                        if mask & selectors.EVENT_WRITE and not conn.closed:
                            self._send(conn)
                        if mask & selectors.EVENT_READ and not conn.closed:
                            self._read(conn)
                self._deliver()
                self._expire()
        except Exception:  # pragma: no cover - a bug here must not pass silently
            log.exception("streamwatch: the /metrics server stopped")
        finally:  # (the wake pair and the selector are closed by close(), after both threads ended)
            for conn in list(self._conns.values()):
                self._close(conn)
            self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # out of file descriptors, ...: try again at the next event
                log.debug("streamwatch: /metrics accept failed: %s", err)
                return
            sock.setblocking(False)
            if len(self._conns) >= self.max_connections:
                oldest = next((c for c in self._conns.values() if c.state in ("read", "drain")), None)
                if oldest is None:  # every slot has a request in progress: refuse this one
                    try:
                        sock.send(_BUSY)
                    except OSError:
                        pass
                    sock.close()
                    continue
                self._close(oldest)
            conn = _Conn(sock, time.monotonic() + self.timeout)
            self._conns[sock] = conn
            self._watch(conn, selectors.EVENT_READ)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not data:
            if conn.state == "wait":  # a half-close after the request (printf ... | nc): still answered
                self._watch(conn, 0)
            else:  # the client closed or gave up
                self._close(conn)
            return
        if conn.state != "read":  # a body, a pipelined request, or bytes after the response: dropped
            conn.linger = True
            if len(data) + len(conn.buffer) > 16 * self.max_request_bytes:
                self._close(conn)  # a client streaming at us: not worth reading
            return
        conn.buffer += data
        end = conn.buffer.find(b"\r\n\r\n")
        if end < 0:
            end = conn.buffer.find(b"\n\n")
        if end < 0:
            if len(conn.buffer) > self.max_request_bytes:
                conn.linger = True
                self._respond(conn, _TOO_LARGE)
            return
        if end > self.max_request_bytes:
            conn.linger = True
            self._respond(conn, _TOO_LARGE)
            return
        tail = len(conn.buffer) - end - (4 if conn.buffer[end : end + 2] == b"\r\n" else 2)
        line = bytes(conn.buffer[: conn.buffer.find(b"\n")]).decode("latin-1").strip()
        conn.buffer = bytearray()  # what follows is dropped; nothing more is parsed
        conn.linger = tail > 0
        parts = line.split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            conn.linger = True
            self._respond(conn, _BAD_REQUEST)
            return
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            conn.linger = True  # a body may follow
            self._respond(conn, _NOT_ALLOWED)
            return
        if "://" in target:  # an absolute URI (as proxies send)
            target = "/" + target.split("://", 1)[1].partition("/")[2]
        if target.split("?", 1)[0] != "/metrics":
            self._respond(conn, _NOT_FOUND)
            return
        conn.head = method == "HEAD"
        conn.state = "wait"
        conn.deadline = None  # the render thread's spacing bounds the wait
        with self._cond:
            self._pending.append(conn)
            self._cond.notify()

    def _respond(self, conn: _Conn, response: bytes) -> None:
        conn.state = "write"
        conn.out = memoryview(response)
        conn.deadline = time.monotonic() + self.timeout
        self._send(conn)
        if not conn.closed and conn.state == "write":
            self._watch(conn, selectors.EVENT_WRITE)

    def _send(self, conn: _Conn) -> None:
        if conn.state != "write":
            return
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        conn.out = conn.out[sent:]
        if conn.out:
            return
        if not conn.linger:
            self._close(conn)
            return
        try:  # lingering close: our side is done; read (and drop) until the client closes
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        conn.state = "drain"
        conn.deadline = time.monotonic() + min(self.timeout, 2.0)
        self._watch(conn, selectors.EVENT_READ)

    def _deliver(self) -> None:
        while self._done:
            conns, cached = self._done.popleft()
            for conn in conns:
                if conn.closed:
                    continue
                if cached is None:
                    self._respond(
                        conn, _plain("500 Internal Server Error", "Rendering failed; see the log.\n")
                    )
                else:
                    self._respond(conn, cached.head if conn.head else cached.get)

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._conns.values() if c.deadline is not None and c.deadline <= now]:
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        conn.out = memoryview(b"")
        self._conns.pop(conn.sock, None)
        self._watch(conn, 0)
        conn.sock.close()

    def _watch(self, conn: _Conn, events: int) -> None:
        """Have the selector watch ``conn`` for ``events`` (0: not at all)."""
        if events == conn.events:
            return
        if not events:
            self._selector.unregister(conn.sock)
        elif not conn.events:
            self._selector.register(conn.sock, events, conn)
        else:
            self._selector.modify(conn.sock, events, conn)
        conn.events = events

    # -- the render thread ---------------------------------------------------------------------------

    def _serve_renders(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                delay = self._next_batch - time.monotonic()
                if delay > 0:  # too soon after the last batch: this one waits (and grows) until then
                    self._cond.wait_for(lambda: self._stopping, timeout=delay)
                    continue
                batch, self._pending = self._pending, []
            start = time.monotonic()
            cached = self._cache
            try:
                version = self._version() if self._version is not None else None
            except Exception:  # a broken version: render every time
                version = None
            if cached is None or version is None or version != cached.version:
                cached = self._render_once(version)
            end = time.monotonic()
            spacing = min(self.max_interval, (end - start) * (1 / self.render_share - 1))
            self._next_batch = end + max(self.min_interval, spacing)
            self._done.append((batch, cached))
            try:
                self._wake_w.send(b"\0")
            except (BlockingIOError, InterruptedError):
                pass  # the pipe is full: the I/O thread is already woken

    def _render_once(self, version: object) -> _Cached | None:
        try:
            body = self._render()
        except Exception:
            self._render_errors += 1
            if self._render_errors == 1:
                log.warning(
                    "streamwatch: rendering /metrics failed (500); further failures at DEBUG", exc_info=True
                )
            else:
                log.debug("streamwatch: rendering /metrics failed", exc_info=True)
            return None
        self.renders += 1
        cached = self._cache = _Cached(version, "200 OK", body, CONTENT_TYPE_LATEST)
        return cached

    def close(self) -> None:
        """Stop both threads, join them and close every socket. Idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        for thread in self._threads:
            thread.join(timeout=_JOIN_S)
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:  # pragma: no cover - a render stuck in a collector of the caller's registry
            log.warning("streamwatch: %s did not stop within %s s", ", ".join(stuck), _JOIN_S)
            return
        self._wake_r.close()
        self._wake_w.close()
        self._selector.close()


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    """A listening socket on ``host:port``, or an error that says what is wrong and what to do."""
    if not isinstance(host, str):
        raise ValueError(f"Expected `host` to be a str (an address of this machine), got {host!r}")
    if host == "":
        raise ValueError(
            "streamwatch: host='' binds every interface; pass '0.0.0.0' explicitly if that is what you "
            "want, or leave the default '127.0.0.1' (this machine only)"
        )
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise socket.gaierror(
            err.errno,
            f"streamwatch: cannot resolve host {host!r} ({err.strerror}); pass an address of this "
            "machine: '127.0.0.1' (the default, this machine only), '0.0.0.0' (every interface) or the "
            "address of one interface",
        ) from err
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        if os.name == "posix":  # rebind over TIME_WAIT after a restart; never over a live listener
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise OSError(
                errno.EADDRINUSE,
                f"streamwatch: port {port} on {host} is already in use (this process's /metrics port is "
                f"the base port + LOCAL_RANK = {port}); pass expose(port=...) another base port, or stop "
                "the process that holds it",
            ) from err
        if err.errno == errno.EADDRNOTAVAIL:
            shown = host if host == address[0] else f"{host} ({address[0]})"
            raise OSError(
                errno.EADDRNOTAVAIL,
                f"streamwatch: host {shown!r} is not an address of this machine, so /metrics cannot "
                "listen there; pass '127.0.0.1' (the default, this machine only), '0.0.0.0' (every "
                "interface) or the address of one of this machine's interfaces",
            ) from err
        if err.errno == errno.EACCES:
            raise OSError(
                errno.EACCES,
                f"streamwatch: not allowed to listen on port {port} of {host} (ports below 1024 need "
                "privileges); pass expose(port=...) a port of 1024 or more, such as the default 9400",
            ) from err
        raise OSError(err.errno, f"streamwatch: cannot listen on {host} port {port}: {err.strerror}") from err
    return sock


class Exporter:
    """A running ``/metrics`` endpoint for one Watch. Create it with :meth:`streamwatch.Watch.expose`.

    The server has two threads whatever the load (see :meth:`streamwatch.Watch.expose`): connections are
    multiplexed, each has ``timeout`` seconds to send its request and read the response, the body is
    rendered off the training thread, once per change of the values however many scrapers ask, and
    :meth:`close` joins both threads and closes every connection.

    Attributes:
        url: ``http://host:port/metrics``.
        registry: the registry the collector is in (yours if you passed one).
        labels: the identity labels on every series.
    """

    def __init__(
        self,
        watch: Watch,
        *,
        port: int = DEFAULT_PORT,
        host: str = "127.0.0.1",
        registry: CollectorRegistry | None = None,
        run: str | None = None,
        series_budget: int = 5000,
        timeout: float = DEFAULT_TIMEOUT,
        serve: bool = True,
    ) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"Expected `port` to be an int in [0, 65535], got {port!r}")
        if isinstance(series_budget, bool) or not isinstance(series_budget, int) or series_budget < 1:
            raise ValueError(f"Expected `series_budget` to be a positive int, got {series_budget!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
            raise ValueError(f"Expected `timeout` to be a positive number of seconds, got {timeout!r}")
        self.labels = identity(run)
        self.port = port + int(self.labels["local_rank"]) if port else 0
        if self.port > 65535:
            raise ValueError(
                f"The base port {port} + LOCAL_RANK {self.labels['local_rank']} is past 65535; pass "
                "expose(port=...) a lower base port"
            )
        self.host = host
        self.timeout = float(timeout)
        self._own_registry = registry is None
        self.registry = registry if registry is not None else CollectorRegistry()
        self.collector = _Collector(watch, self.labels, series_budget)
        self._server: _MetricsServer | None = None
        sock = _listen(host, self.port, _MetricsServer.backlog) if serve else None
        self.registry.register(self.collector)
        if sock is not None:
            self.port = sock.getsockname()[1]
            # our own registry holds only our families: the fast formatter, cached per version of the
            # values; the caller's registry: prometheus_client's formatter over every collector in it,
            # rendered for each batch of requests (its other collectors have no version)
            if self._own_registry:
                render: Callable[[], bytes] = lambda: self.collector.render()  # noqa: E731 - late-bound
                version: Callable[[], object] | None = self.collector.version
            else:
                render, version = (lambda: generate_latest(self.registry)), None
            self._server = _MetricsServer(sock, render, version, timeout=self.timeout)
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving: join the server's threads, close every connection, unregister the collector.
        Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        try:
            self.registry.unregister(self.collector)
        except KeyError:
            pass

    def __repr__(self) -> str:
        return f"<Exporter {self.url}>"
