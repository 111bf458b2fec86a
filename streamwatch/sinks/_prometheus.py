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

**The server** is :class:`streamwatch.sinks._http.MetricsServer` (two threads whatever the load,
bounded connections and timeouts, one render per version of the values). Every family passes
``promtool check metrics`` (the accuracy's denominator is the gauge
``streamwatch_predictions``: ``_total`` is for counters).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
import threading
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
from streamwatch.sinks._http import MetricsServer, listen

if TYPE_CHECKING:
    from streamwatch._observe import Watch

__all__ = ["CORE_STATS", "DEFAULT_PORT", "DEFAULT_TIMEOUT", "Exporter", "identity"]

log = logging.getLogger("streamwatch")

DEFAULT_PORT = 9400
"""The default base port: rank ``LOCAL_RANK`` serves on ``DEFAULT_PORT + LOCAL_RANK``."""

DEFAULT_TIMEOUT = 10.0
"""Seconds a /metrics client has to send its request, and again to read the response, before the
connection is closed (``expose(timeout=...)``)."""

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
        self._server: MetricsServer | None = None
        sock = listen(host, self.port, MetricsServer.backlog) if serve else None
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
            self._server = MetricsServer(sock, render, version, timeout=self.timeout)
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
