"""The Prometheus exporter: a ``Collector`` over a series store's latest values, served per process.

Nothing here runs on the training thread or keeps a ``Gauge`` per series: at each scrape the collector
reads a :class:`streamwatch.SeriesStore` through its read protocol (:class:`streamwatch._store.SeriesSource`:
``table()``, ``samples()``, ``edges``, ``version()``) and a statistics callable (``watch.statistics``,
or a replay's), and builds the families then, so the hot path pays nothing for Prometheus and a scrape
costs one pass over the series. It knows nothing of a Watch: ``watch.expose()`` hands it the watch's
store and statistics, ``streamwatch replay`` a store fed from a run file.

**One render path.** Every route — ``watch.expose()``'s endpoint, a caller-supplied registry, a scrape
over the series budget, replay — goes through :meth:`StoreCollector.exposition`: one list of families,
each one of ``streamwatch._families.FAMILIES`` (names, types, help and labels live there and nowhere
else) or a family served with ``watch.serve()``. :meth:`StoreCollector.render` writes it as the text
format (the per-tensor statistics from cached label strings: ~1 µs a sample); :meth:`StoreCollector.collect`
hands the same families to prometheus_client's registry. Floats are written as Go (and prometheus_client)
write them: ``+Inf``, ``-Inf``, ``NaN``, else the shortest round-trip repr (:func:`format_float`).

Naming (docs/prometheus.md has the full table): namespace ``streamwatch_``, base units, counters end in
``_total``, one family per statistic (``streamwatch_tensor_l2``, ``streamwatch_tensor_dead_ratio``: no
``stat`` label); every series carries ``run`` and ``rank`` (Prometheus adds ``job`` and ``instance``),
and ``streamwatch_info`` (value 1) the whole identity, ``host``, ``local_rank`` and ``world_size`` too,
joined where a query needs them. Sums of squares and element counts are exported beside norms
(``streamwatch_tensor_sum_of_squares``, ``streamwatch_tensor_elements``), so a global norm across
layers, shards or ranks is exact in PromQL:
``sqrt(sum by (run) (streamwatch_tensor_sum_of_squares{kind="param_grad"}))``.

**Series budget** (:mod:`streamwatch.sinks._budget`): past ``series_budget`` (default 5 000) series of
the per-layer families per process (``streamwatch_tensor``, the histogram buckets, the detectors'
per-layer families), a scrape serves :data:`CORE_STATS` per layer; if that is still too many, one total
per (phase, kind) with ``layer="__all__"`` and the worst layers in core detail with their detector
series, as many as fit. A warning is logged once and ``streamwatch_series_reduced_total`` counts the
scrapes that had to reduce. Both routes (:meth:`StoreCollector.render`, :meth:`StoreCollector.collect`)
serve the same reduction: it is made in :meth:`StoreCollector.exposition`.

**The server** is :class:`streamwatch.sinks._http.MetricsServer` (two threads whatever the load,
bounded connections and timeouts, one render per version of the values). Every family passes
``promtool check metrics``.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.registry import Collector

from streamwatch._detail import position
from streamwatch._families import (
    DATA_FAMILIES,
    FIRST_NONFINITE_INFO,
    HISTOGRAM_SAMPLE,
    IDENTITY,
    INFO,
    LAYER_MEAN,
    LAYER_MEAN_FAMILIES,
    PER_LAYER_FAMILIES,
    SELF_FAMILIES,
    SERIES_IDENTITY,
    STEP_DURATION,
    TENSOR,
    TENSOR_VALUES,
    Family,
    exposed_sample,
    served_family,
    tensor_family,
)
from streamwatch._record import Sample, SeriesKey
from streamwatch._steptimes import STEP_BUCKETS
from streamwatch._store import SeriesSource, StatisticsSource, WatchStatistics
from streamwatch._validate import check_int, check_seconds
from streamwatch._version import version
from streamwatch.sinks._budget import CORE_STATS, Budget, HistogramKey, Served, histogram_series
from streamwatch.sinks._http import MetricsServer, listen

__all__ = [
    "CORE_STATS",
    "DEFAULT_PORT",
    "DEFAULT_TIMEOUT",
    "Exporter",
    "StoreCollector",
    "format_float",
    "identity",
]

log = logging.getLogger("streamwatch")

DEFAULT_PORT = 16400
"""The default base port: rank ``LOCAL_RANK`` serves on ``DEFAULT_PORT + LOCAL_RANK``. Chosen clear of
every exporter on the Prometheus project's list of default port allocations (which fills 9100-9999, and
grows upward from 10000) and of the services a training node runs (docs/prometheus.md, *The port*)."""

DEFAULT_TIMEOUT = 10.0
"""Seconds a /metrics client has to send its request, and again to read the response, before the
connection is closed (``expose(timeout=...)``)."""

_PER_LAYER_DETECTORS = frozenset(f.name for f in PER_LAYER_FAMILIES) - {TENSOR.name, TENSOR_VALUES.name}


def identity(run: str | None = None) -> dict[str, str]:
    """The process identity every series carries: run (``run``, else ``$STREAMWATCH_RUN``, else the
    script's name), the rank and world size (from ``torch.distributed`` once it is initialised, else
    torchrun's ``RANK``/``WORLD_SIZE``; 0 and 1 without them), the local rank (``LOCAL_RANK``; the rank
    where a multi-process job leaves it unset, as ``mp.spawn`` does), the host.

    Example:
        >>> sorted(identity("demo"))
        ['host', 'local_rank', 'rank', 'run', 'world_size']
    """
    if run is None:
        script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] not in ("", "-", "-c") else ""
        run = os.environ.get("STREAMWATCH_RUN") or script or "python"
    rank, local_rank, world_size = position()
    return {
        "run": run,
        "rank": str(rank),
        # (unset in a multi-process job, as under mp.spawn on one host: the rank, unique on every host)
        "local_rank": str(rank if local_rank is None else local_rank),
        "world_size": str(world_size),
        "host": socket.gethostname(),
    }


def format_float(value: float) -> str:
    """A sample value as Prometheus' text format (Go, and prometheus_client) writes it.

    Example:
        >>> [format_float(v) for v in (3, 0.1, -2.5e-7, 1e22, float("inf"), float("-inf"), float("nan"))]
        ['3.0', '0.1', '-2.5e-07', '1e+22', '+Inf', '-Inf', 'NaN']
        >>> format_float(12345678.0)  # Go switches to an exponent sooner than Python's repr
        '1.2345678e+07'
    """
    value = float(value)
    if value != value:
        return "NaN"
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    text = repr(value)
    dot = text.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) and bound > 0 else repr(float(bound))


@dataclass(slots=True)
class Block:
    """One family of an exposition: its samples as ``(sample name, labels without the identity, value)``.

    A per-tensor statistic's summary column rides as ``rows`` (the statistic, its column and the keys), so
    the text writer can format it from cached label strings; :meth:`samples` expands it.
    """

    family: Family
    entries: list[tuple[str, Mapping[str, str], float]] = field(default_factory=list)
    rows: tuple[str, np.ndarray, list[SeriesKey]] | None = None

    def samples(self) -> Iterator[tuple[str, Mapping[str, str], float]]:
        """Every sample of the family, the summary rows (NaN: absent) first."""
        if self.rows is not None:
            _stat, values, keys = self.rows
            for key, value in zip(keys, values.tolist(), strict=True):
                if value == value:
                    yield self.family.name, key.labels(), value
        yield from self.entries


class StoreCollector(Collector):
    """Builds every family at scrape time from a store's latest values and a statistics callable.

    Args:
        store: what it reads (a :class:`streamwatch.SeriesStore`, or anything with its read protocol).
        statistics: the monitoring's own statistics (``watch.statistics``; a replay's).
        labels: the identity labels on every series.
        series_budget: the most series of the per-layer families to export
            (:mod:`streamwatch.sinks._budget`).
    """

    def __init__(
        self,
        store: SeriesSource,
        statistics: StatisticsSource,
        labels: Mapping[str, str],
        series_budget: int,
    ) -> None:
        self.store = store
        self.statistics = statistics
        self.identity = dict(labels)  # the whole identity: on streamwatch_info
        self.series_labels = {k: v for k, v in labels.items() if k in SERIES_IDENTITY}  # on every series
        self.series_budget = series_budget
        self.reductions = 0
        self._budget = Budget(series_budget)
        self._warned = False
        self._lock = threading.RLock()
        # 'name{labels}' of the series rendered: by (series key, stat) for the summary rows, by
        # (name, label items) for the other samples
        self._prefixes: dict[object, str] = {}
        self._rendered = 0  # lines of the last render (how large the prefix cache may grow)

    def version(self) -> object:
        """A value that changes whenever :meth:`render` would render something else: the store's
        version and the statistics. Cheap: no formatting."""
        return self.store.version(), self.statistics()

    def collect(self) -> Iterator[Metric]:
        """The families for a prometheus_client registry (a caller's registry; ``generate_latest``)."""
        for block in self.exposition():
            family = block.family
            metric = Metric(family.name, family.help, family.type)
            for name, labels, value in block.samples():
                metric.add_sample(name, {**self.series_labels, **labels}, value)
            yield metric

    def render(self, openmetrics: bool = False) -> bytes:
        """The text exposition of every family (what ``generate_latest`` would write for
        :meth:`collect`), every series' name and labels from cached strings; with ``openmetrics``, the
        OpenMetrics 1.0.0 text format instead (what prometheus_client's OpenMetrics ``generate_latest``
        writes): a counter's family named without ``_total`` (its samples keep it), ``"`` escaped in
        HELP, and ``# EOF`` at the end."""
        lines: list[str] = []
        prefixes = self._prefixes
        with self._lock:
            if len(prefixes) > 4 * self._rendered + 1024:  # series came and went: start over
                prefixes.clear()
            for block in self.exposition():
                family = block.family
                help_text = family.help.replace("\\", "\\\\").replace("\n", "\\n")
                name = family.exposed
                if openmetrics:
                    help_text, name = help_text.replace('"', '\\"'), family.name
                lines.append(f"# HELP {name} {help_text}")
                lines.append(f"# TYPE {name} {family.type}")
                if block.rows is not None:
                    self._tensor_lines(family, block.rows, lines)
                for name, labels, value in block.entries:
                    key = (name, tuple(labels.items()))
                    prefix = prefixes.get(key)
                    if prefix is None:
                        prefix = prefixes[key] = self._prefix(name, labels)
                    lines.append(f"{prefix} {format_float(value)}")
            self._rendered = len(lines)
        if openmetrics:
            lines.append("# EOF")
        # (a module name with a lone surrogate cannot be UTF-8: it reads "?" rather than failing the scrape)
        return ("\n".join(lines) + "\n").encode("utf-8", "replace") if lines else b""

    def _tensor_lines(
        self, family: Family, rows: tuple[str, np.ndarray, list[SeriesKey]], lines: list[str]
    ) -> None:
        prefixes = self._prefixes
        stat, values, keys = rows
        for key, value in zip(keys, values.tolist(), strict=True):
            if value != value:  # NaN: unknown, absent
                continue
            prefix = prefixes.get((key, stat))
            if prefix is None:
                prefix = prefixes[(key, stat)] = self._prefix(family.name, key.labels())
            lines.append(f"{prefix} {format_float(value)}")

    def _prefix(self, name: str, labels: Mapping[str, str]) -> str:
        merged = {**self.series_labels, **labels}
        body = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(merged.items()))
        return f"{name}{{{body}}}"

    # -- the one exposition ---------------------------------------------------------------------------

    def exposition(self) -> list[Block]:
        """Every family to serve now, in order: the identity, the run's data (the store) within the series
        budget, the families served with ``watch.serve()``, the monitoring's own statistics.
        Thread-safe (one at a time)."""
        with self._lock:
            table, keys = self.store.table()
            samples = self.store.samples(table_rows=False)
            statistics = self.statistics()
            extras: list[Sample] = []  # streamwatch_tensor values beside the table
            histograms: list[Sample] = []
            detectors: list[Sample] = []  # the detectors' per-layer families
            rest: list[Sample] = []
            origin: str | None = None  # the layer where the run's first NaN/Inf started
            for sample in samples:
                name = sample.name
                if name == TENSOR.name:
                    extras.append(sample)
                elif name == HISTOGRAM_SAMPLE:
                    histograms.append(sample)
                elif name in _PER_LAYER_DETECTORS:
                    detectors.append(sample)
                else:
                    rest.append(sample)
                    if name == FIRST_NONFINITE_INFO.name and sample.labels.get("kind") != "loss":
                        origin = sample.labels.get("layer")
            served = self._budget.serve(
                table,
                keys,
                extras=extras,
                histograms=histogram_series(histograms),
                edges=self.store.edges,
                detectors=detectors,
                origin=origin,
            )
            if served.level != "full":
                self._reduced(served)
            info = {k: v for k, v in self.identity.items() if k not in SERIES_IDENTITY}
            blocks = [Block(INFO, [(INFO.name, {**info, "version": version()}, 1.0)])]
            blocks.extend(
                self._data(
                    _tensor_blocks(served.stats, served.keys, served.extras),
                    self._histograms(served.histograms) if served.histograms else None,
                    [*map(exposed_sample, rest), *served.detectors],
                )
            )
            blocks.extend(self._self_metrics(statistics, served.wanted, served.exported))
            return blocks

    def _data(self, tensor: list[Block], histograms: Block | None, samples: list[Sample]) -> list[Block]:
        grouped: dict[str, list[Sample]] = {}
        for sample in samples:
            grouped.setdefault(sample.name, []).append(sample)
        blocks: list[Block] = []
        for family in DATA_FAMILIES:
            if family is TENSOR:
                blocks.extend(tensor)  # absent before the first record, never a placeholder
            elif family is LAYER_MEAN:
                for mean in LAYER_MEAN_FAMILIES.values():
                    if mean.name in grouped:
                        blocks.append(_block(mean, grouped.pop(mean.name)))
            elif family is TENSOR_VALUES:
                if histograms is not None:
                    blocks.append(histograms)
            elif family.name in grouped:
                blocks.append(_block(family, grouped.pop(family.name)))
        for name in sorted(grouped):  # watch.serve() families
            blocks.append(_block(served_family(name), grouped[name]))
        return blocks

    def _reduced(self, served: Served) -> None:
        """Count a scrape over the budget; warn the first time."""
        self.reductions += 1
        if self._warned:
            return
        self._warned = True
        if served.level == "core":
            level = "core statistics per layer"
        else:
            level = (
                f'one total per phase and kind (layer="__all__") and the {served.layers} worst of '
                f"{served.of_layers} layers in core detail"
            )
        log.warning(
            "streamwatch: %d per-layer series exceed the series budget of %d per process; exporting %s "
            "(%d series). Select fewer modules (observe(select=...)) or raise expose(series_budget=...).",
            served.wanted,
            self.series_budget,
            level,
            served.exported,
        )

    def _histograms(self, series: Mapping[HistogramKey, np.ndarray]) -> Block:
        """Bucket counts (streamwatch.metrics.Buckets order) as cumulative ``le`` buckets, with the
        bounds the records carried (``store.edges``)."""
        bounds = self.store.edges
        block = Block(TENSOR_VALUES)
        name = f"{TENSOR_VALUES.name}_bucket"
        kind = TENSOR_VALUES.labels.index("kind")
        for key, counts in series.items():
            upper = bounds.get(key[kind])
            if upper is None:
                continue
            vector = np.zeros(len(upper) + 1)
            vector[: len(counts)] = counts[: len(vector)]
            cumulative = np.cumsum(vector[1:])  # bucket 0 (non-finite) is not a value; the last bound is +inf
            # negative buckets: no _sum/_count (the Prometheus convention); the +Inf bucket is the count
            labels = dict(zip(TENSOR_VALUES.labels, key, strict=True))
            for bound, count in zip(upper, cumulative.tolist(), strict=True):
                block.entries.append((name, {**labels, "le": _le(bound)}, float(count)))
        return block

    def _self_metrics(self, stats: WatchStatistics, wanted: int, exported: int) -> list[Block]:
        dropped = {
            "drop_oldest": stats.dropped_oldest,
            "drop_newest": stats.dropped_newest,
            "slots_exhausted": stats.slots_exhausted,
        }
        values: dict[str, float | Mapping[str, float] | None] = {
            "streamwatch_steps": stats.steps,
            "streamwatch_step_seconds": stats.step_seconds_total,
            "streamwatch_samples": stats.samples_total,
            "streamwatch_steps_sampled": stats.sampled,
            "streamwatch_records": stats.records_received,
            "streamwatch_records_dropped": dropped,
            "streamwatch_queue_length": stats.queue_len,
            "streamwatch_queue_high_water": stats.queue_high_water,
            "streamwatch_worker_lag_seconds": stats.worker_lag_seconds,
            "streamwatch_hook_errors": stats.hook_errors,
            "streamwatch_sink_errors": stats.pipeline_failures,
            "streamwatch_tensors_skipped": dict(stats.skipped),
            "streamwatch_series": exported,
            "streamwatch_series_wanted": wanted,
            "streamwatch_series_reduced": self.reductions,
            "streamwatch_overhead_last_step_seconds": stats.overhead_seconds,
            "streamwatch_overhead_seconds": stats.overhead_seconds_total,
            "streamwatch_sampling_interval": stats.sampling_interval,
            "streamwatch_overhead_ratio": stats.overhead_ratio,
            "streamwatch_sentinel_trips": stats.sentinel_trips,
            "streamwatch_escalations": stats.escalations,
            "streamwatch_escalated": float(stats.escalated_until is not None),
        }
        blocks: list[Block] = []
        for family in SELF_FAMILIES:
            if family is INFO:
                continue
            if family is STEP_DURATION:
                if stats.step_buckets:  # (a replay has none: absent)
                    blocks.append(_step_histogram(stats.step_buckets, stats.step_seconds_total))
                continue
            value = values[family.name]
            block = Block(family)
            if isinstance(value, Mapping):  # one sample per reason
                (label,) = family.labels
                block.entries = [(family.exposed, {label: k}, float(v)) for k, v in value.items()]
            elif value is None or math.isnan(value):  # unknown (no record yet, no governor): absent
                continue
            else:
                block.entries = [(family.exposed, {}, float(value))]
            blocks.append(block)
        return blocks


def _tensor_blocks(
    stats: Mapping[str, np.ndarray], keys: list[SeriesKey], extras: Sequence[Sample]
) -> list[Block]:
    """One block per per-tensor statistic (:func:`streamwatch._families.tensor_family`): the summary
    table's columns and derived statistics that have a value, then the opt-in values beside them."""
    blocks: dict[str, Block] = {}
    for stat, values in stats.items():
        if len(values) and np.any(~np.isnan(values)):
            blocks[stat] = Block(tensor_family(stat), rows=(stat, values, keys))
    for sample in extras:
        labels = dict(sample.labels)
        stat = labels.pop("stat")
        block = blocks.get(stat)
        if block is None:
            block = blocks[stat] = Block(tensor_family(stat))
        block.entries.append((block.family.name, labels, sample.value))
    return list(blocks.values())


def _step_histogram(buckets: Sequence[int], seconds: float) -> Block:
    """``streamwatch_step_duration_seconds``: cumulative ``le`` buckets, ``_sum`` and ``_count`` (the
    +Inf bucket, so the two agree whatever step the training thread is at)."""
    name = STEP_DURATION.name
    block = Block(STEP_DURATION)
    total = 0
    for bound, count in zip(STEP_BUCKETS, buckets, strict=True):
        total += count
        block.entries.append((f"{name}_bucket", {"le": _le(bound)}, float(total)))
    block.entries.append((f"{name}_sum", {}, float(seconds)))
    block.entries.append((f"{name}_count", {}, float(total)))
    return block


def _openmetrics(registry: CollectorRegistry) -> bytes:
    """prometheus_client's OpenMetrics writer over every collector of ``registry``."""
    body: bytes = generate_openmetrics(registry)  # type: ignore[no-untyped-call]
    return body


def _block(family: Family, samples: Sequence[Sample]) -> Block:
    """A gauge family's samples, every one with the union of their labels (``""`` where one lacks it)."""
    names = sorted({k for s in samples for k in s.labels} - set(IDENTITY))
    return Block(
        family, [(family.exposed, {k: s.labels.get(k, "") for k in names}, s.value) for s in samples]
    )


class Exporter:
    """A running ``/metrics`` endpoint over a series store. :meth:`streamwatch.Watch.expose` makes one
    for a watch (its store and statistics).

    The server has two threads whatever the load (see :meth:`streamwatch.Watch.expose`): connections are
    multiplexed, each has ``timeout`` seconds to send its request and read the response, the body is
    rendered off the training thread, once per change of the values however many scrapers ask, and
    :meth:`close` joins both threads and closes every connection.

    Args:
        store: the latest values to serve (``watch.store``; any :class:`streamwatch._store.SeriesSource`).
        statistics: the monitoring's own statistics (``watch.statistics``).
        port, host, registry, run, series_budget, timeout: as for :meth:`streamwatch.Watch.expose`.
        serve: listen on ``host:port`` (False: only register the collector, e.g. in a caller's registry).

    Attributes:
        url: ``http://host:port/metrics``.
        registry: the registry the collector is in (yours if you passed one).
        collector: the :class:`StoreCollector` (``collector.render()`` is what the endpoint serves).
        labels: the identity labels on every series.

    Example:
        >>> import urllib.request
        >>> from streamwatch import SeriesStore, WatchStatistics
        >>> exporter = Exporter(SeriesStore(), lambda: WatchStatistics.replayed(0), port=0, run="doc")
        >>> body = urllib.request.urlopen(exporter.url, timeout=10).read().decode()
        >>> exporter.close()
        >>> 'streamwatch_info{host=' in body and "streamwatch_steps_total" in body
        True
    """

    def __init__(
        self,
        store: SeriesSource,
        statistics: StatisticsSource,
        *,
        port: int = DEFAULT_PORT,
        host: str = "127.0.0.1",
        registry: CollectorRegistry | None = None,
        run: str | None = None,
        series_budget: int = 5000,
        timeout: float = DEFAULT_TIMEOUT,
        serve: bool = True,
    ) -> None:
        check_int(port, "port", minimum=0, maximum=65535)
        check_int(series_budget, "series_budget")
        timeout = check_seconds(timeout, "timeout", zero=False, forever=False)
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
        self.collector = StoreCollector(store, statistics, self.labels, series_budget)
        self._server: MetricsServer | None = None
        sock = listen(host, self.port, MetricsServer.backlog) if serve else None
        try:
            self.registry.register(self.collector)
        except BaseException:  # (a caller's registry refusing our series: the port is not kept)
            if sock is not None:
                sock.close()
            raise
        if sock is not None:
            self.port = sock.getsockname()[1]
            # our own registry holds only our families: the collector's text writer, cached per version of
            # the values; the caller's registry: prometheus_client's writer over every collector in it,
            # rendered for each batch of requests (its other collectors have no version)
            if self._own_registry:
                render: Callable[[], bytes] = lambda: self.collector.render()  # noqa: E731 - late-bound
                render_om: Callable[[], bytes] = lambda: self.collector.render(openmetrics=True)  # noqa: E731
                version: Callable[[], object] | None = self.collector.version
            else:
                render, version = (lambda: generate_latest(self.registry)), None
                render_om = lambda: _openmetrics(self.registry)  # noqa: E731
            self._server = MetricsServer(
                sock, render, version, timeout=self.timeout, render_openmetrics=render_om
            )
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
