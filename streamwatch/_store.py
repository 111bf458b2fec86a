"""The series store: the latest value of every series, the one thing everything after the channel reads.

A :class:`SeriesStore` is a :class:`streamwatch.Sink` of :class:`streamwatch.StepRecord`\\ s. For each record
it keeps the latest summary row of every series, the opt-in metrics' values, the step-level scalars and
the histogram bucket edges the record carries, and it runs the worker-side metrics chosen in
``observe(metrics=...)`` (``update_ratio``, ``layer_mean``) on the record itself.

Only the latest values are ever read, so the worker does the least it can per record: it keeps the
record as the latest of its layout (its tuple of keys) and counts it. The rows and the metrics are
brought up to date when the store is read (``samples()``, ``table()``, :meth:`SeriesStore.apply`: a
scrape, the console view, ``watch.snapshot()``, ``watch.flush()``, ``close()``), from the latest record
of each layout, in the order they arrived: what a reader sees is exactly what running everything on
every record would have left, at the cost of one pass per read instead of one per record. A live
:class:`streamwatch.Watch` feeds it from its worker; ``streamwatch replay`` feeds a new one from a run
file's records; so both serve the same series.

Readers use :class:`SeriesSource`, a small read protocol (``watch.snapshot()``, the Prometheus exporter,
replay and the console view all do):

* ``samples()`` — every latest value as :class:`streamwatch.Sample`\\ s (``watch.snapshot()``);
* ``table()`` — the latest summary row of every series as one table (``COLUMNS``) and its keys;
* ``edges`` — histogram bucket upper bounds by tap kind (Prometheus ``le``);
* ``step`` — the step of the last record (None before the first);
* ``version()`` — a cheap value that changes whenever ``samples()`` would;

and, beside it, a statistics callable returning :class:`WatchStatistics` (how the monitoring that feeds
the store is doing: ``watch.statistics``, or a replay's own).

Example:
    >>> from streamwatch import SeriesKey, StepRecord
    >>> from streamwatch.testing import table
    >>> store = SeriesStore()
    >>> keys = (SeriesKey("train", "fc", "activation", ""),)
    >>> row = table(count=4, sum=2.0, sumsq=6.0, min=-1, max=2, zeros=1, fill=0.0)
    >>> store.send(StepRecord(4, 0.0, 0, keys, row, {"loss": 0.5}))
    >>> store.step, sorted({s.name for s in store.samples()})
    (4, ['streamwatch_layer_mean', 'streamwatch_loss', 'streamwatch_step', 'streamwatch_tensor'])
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from streamwatch._families import HISTOGRAM_SAMPLE, STEP, TENSOR, scalar_sample
from streamwatch._nonfinite import FirstNonFinite
from streamwatch._pipeline import Sink
from streamwatch._record import Sample, SeriesKey, StepRecord
from streamwatch._summary import COLUMNS, derive
from streamwatch.metrics._derived import DEFAULT_METRICS, DERIVED

__all__ = ["SeriesSource", "SeriesStore", "Served", "StatisticsSource", "WatchStatistics"]

_PENDING_LAYOUTS = 8
"""Layouts whose latest record the store holds unapplied at most; one more applies them all (a run whose
layout changes every record then pays per record, as before, and holds no more than this)."""


@dataclass(frozen=True, slots=True)
class WatchStatistics:
    """How the monitoring itself is doing.

    Attributes:
        steps: ``watch.step()`` calls.
        sampled: steps whose record with layer rows was sent to the worker: the sampled steps, and an
            unsampled step that carried rows anyway (an evaluation pass within it, a per-step metric).
        scalar_records: scalar records sent between sampled steps (loss, learning rates, step time,
            throughput; no layer rows): one per ``streamwatch.SCALAR_SECONDS`` at most, plus one for each
            step whose loss passed ``LossSpike``'s spike line (docs/detectors.md).
        records_received: records the worker turned into step records (``sampled`` plus
            ``scalar_records``, and the evaluation record ``close()`` sends, if any).
        dropped_oldest: queued records evicted because the worker fell behind (``overflow="drop_oldest"``).
        dropped_newest: records discarded at send (``overflow="drop_newest"``).
        slots_exhausted: CUDA steps dropped because every pinned slot was still in flight.
        queue_len: records waiting for the worker now; ``queue_high_water`` the most ever waiting.
        worker_lag_seconds: from the step boundary to the worker having processed the record (latest).
        skipped: tensors not summarised, by reason (``non_tensor``, ``complex``, ``sparse``, ``empty``, ...).
        hook_errors: exceptions caught inside hooks or inside ``watch.step()`` (never raised into
            training; re-raised at close).
        pipeline_failures: pipelines stopped by an exception (and worker-side metrics the series store
            stopped).
        kernel: how CPU tensors are summarised: ``"fused: <library>"`` (one pass, exact non-finite
            counts) or ``"torch: <why the fused kernel is not used>"``.
        overhead_seconds: streamwatch's own time on the training thread in the last step (its hooks and
            ``watch.step()``; torch's dispatch of the hooks is not included): an in-process estimate.
        overhead_seconds_total: the same, summed over every step.
        failed_steps: steps whose ``watch.step()`` failed, so they have no record: an argument it refused
            (the error was raised to the caller) or an error inside streamwatch (warned about, raised
            again at close). Their rows are dropped, never merged into the next step.
        stuck_pipelines: the pipeline(s) still running a call that did not return when ``close()`` gave
            up waiting (``close_timeout``); empty unless it gave up.
        unflushed_records: records that had not reached every sink when ``close()`` gave up.
        sampling_interval: one step in ``sampling_interval`` is sampled: ``every`` with a fixed interval,
            the governor's current interval with ``observe(overhead=...)`` (docs/governor.md).
        overhead_ratio: with ``observe(overhead=...)``, what monitoring costs now as a fraction of the
            run's time, measured by the governor (the cost of a sampled step over the interval); None
            before it has measured it, and with a fixed interval.
        overhead_budget: the ``overhead=`` budget; None with a fixed interval.
        dark_steps: steps the governor ran dark to measure what streamwatch costs beyond its own
            measured time (docs/governor.md): no streamwatch hook ran in them, so an evaluation pass
            in one is not summarised. 0 with a fixed interval.
        first_nonfinite: where the run's first NaN/Inf started: the first tensor, in execution order,
            of the first record with a non-finite value (a :class:`streamwatch.FirstNonFinite`), or None
            (docs/nonfinite.md). Computed on the worker: ``watch.flush()`` makes it current.
        nonfinite_episodes: runs of consecutive records with a non-finite value (each gets one reaction).
        sentinel_trips: steps whose per-step sentinel found a non-finite loss (or gradient norm),
            sampled or not.
        escalations: times a sentinel trip escalated sampling to every step (``observe(escalate=...)``).
        escalated_until: while escalated, the first step after the escalation; else None.
        step_seconds_total: every step's wall time, summed (``watch.step()`` to ``watch.step()``; the first
            from ``observe()``).
        step_buckets: the steps per bucket of ``streamwatch._steptimes.STEP_BUCKETS`` (not cumulative;
            empty in a replay): the ``streamwatch_step_duration_seconds`` histogram.
        samples_total: the samples of every step that gave ``batch_size``; None before the first.
        log_refused: ``watch.log()`` values refused: new names past the 64 kept.
        sentinel: what the per-step sentinel checks: ``("loss",)``, ``("loss", "grad_norm")`` or ``()``
            (under ``overhead=`` with the default, ``grad_norm`` once its trial found it affordable).

    Example:
        >>> WatchStatistics.replayed(3).records_received
        3
    """

    steps: int
    sampled: int
    records_received: int
    dropped_oldest: int
    dropped_newest: int
    slots_exhausted: int
    queue_len: int
    queue_high_water: int
    worker_lag_seconds: float
    skipped: Mapping[str, int]
    hook_errors: int
    pipeline_failures: int
    kernel: str = ""
    overhead_seconds: float = 0.0
    overhead_seconds_total: float = 0.0
    failed_steps: int = 0
    stuck_pipelines: tuple[str, ...] = ()
    unflushed_records: int = 0
    sampling_interval: int = 1
    overhead_ratio: float | None = None
    overhead_budget: float | None = None
    dark_steps: int = 0
    first_nonfinite: FirstNonFinite | None = None
    nonfinite_episodes: int = 0
    sentinel_trips: int = 0
    escalations: int = 0
    escalated_until: int | None = None
    sentinel: tuple[str, ...] = ()
    scalar_records: int = 0
    step_seconds_total: float = 0.0
    step_buckets: tuple[int, ...] = ()
    samples_total: int | None = None
    log_refused: int = 0

    @classmethod
    def replayed(cls, records: int, first_nonfinite: FirstNonFinite | None = None) -> WatchStatistics:
        """The statistics of a replay that served ``records`` records: nothing dropped, queued or lost."""
        return cls(
            first_nonfinite=first_nonfinite,
            steps=records,
            sampled=records,
            records_received=records,
            dropped_oldest=0,
            dropped_newest=0,
            slots_exhausted=0,
            queue_len=0,
            queue_high_water=0,
            worker_lag_seconds=math.nan,
            skipped={},
            hook_errors=0,
            pipeline_failures=0,
            kernel="replay",
        )


StatisticsSource = Callable[[], WatchStatistics]
"""What readers call for the monitoring's own statistics (``watch.statistics``)."""


@runtime_checkable
class SeriesSource(Protocol):
    """The read side of a :class:`SeriesStore`: what ``snapshot()``, the exporter, replay and the console
    view read. Every method is thread-safe and returns values the caller owns.

    A test double implements these five members; nothing reads a store's internals.
    """

    @property
    def step(self) -> int | None:
        """The step of the last record received (None before the first)."""
        ...

    @property
    def edges(self) -> Mapping[str, tuple[float, ...]]:
        """Histogram bucket upper bounds (Prometheus ``le``, ascending, ending at +inf) by tap kind."""
        ...

    def samples(self, table_rows: bool = True) -> list[Sample]:
        """Every latest value; without ``table_rows``, all but the per-tensor statistics of
        :meth:`table` (readers that format those themselves)."""
        ...

    def table(self) -> tuple[np.ndarray, list[SeriesKey]]:
        """The latest summary row of every series (``COLUMNS``), and the series' keys."""
        ...

    def version(self) -> object:
        """A value that changes whenever :meth:`samples` would return something else."""
        ...


class SeriesStore(Sink):
    """The latest value of every series, fed with :class:`streamwatch.StepRecord`\\ s (a Sink); see the
    module documentation for what it keeps and the :class:`SeriesSource` protocol it is read through.

    Args:
        metrics: the worker-side metrics it runs on each record, by name (``streamwatch.DEFAULT_METRICS``
            by default; ``()`` for none). A metric that raises is stopped (the others and the store go
            on) and listed in :attr:`failures`.

    Raises:
        ValueError: an unknown metric name.

    Example:
        >>> from streamwatch import SeriesKey, StepRecord
        >>> from streamwatch.testing import table
        >>> keys = (SeriesKey("train", "fc", "param", "weight"), SeriesKey("train", "fc", "update", "weight"))
        >>> store = SeriesStore(metrics=["update_ratio"])
        >>> store.send(StepRecord(0, 0.0, 0, keys, table(sumsq=[400.0, 0.0004])))
        >>> [round(s.value, 6) for s in store.samples() if s.labels.get("stat") == "update_ratio"]
        [0.001]
    """

    def __init__(self, metrics: Iterable[str] = DEFAULT_METRICS) -> None:
        names = list(dict.fromkeys(metrics))
        unknown = [name for name in names if name not in DERIVED]
        if unknown:
            raise ValueError(f"Unknown metric {unknown[0]!r}: the names are {sorted(DERIVED)}")
        self.metrics: tuple[str, ...] = tuple(names)
        self._run: list[tuple[str, Callable[[StepRecord], list[Sample]]]] = [(n, DERIVED[n]) for n in names]
        self.failures: list[tuple[str, BaseException]] = []
        self._lock = threading.Lock()
        # the latest record of each layout not yet applied, oldest first (see apply())
        self._pending: dict[tuple[SeriesKey, ...], StepRecord] = {}
        self._rows: dict[SeriesKey, np.ndarray] = {}
        self._extras: dict[tuple[SeriesKey, str], np.ndarray] = {}
        self._put: dict[tuple[str, tuple[tuple[str, str], ...]], Sample] = {}  # derived and served values
        # when each put value and each record scalar was last written (one count for both): where a
        # value put and a record's scalar are the same series, the later one is served (see samples())
        self._writes = 0
        self._put_at: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}
        self._scalar_at: dict[str, int] = {}
        # the latest state of each deferred publisher, not yet turned into samples (see later())
        self._later: dict[object, tuple[Callable[[Any], Iterable[Sample]], Any]] = {}
        self._stopped: set[object] = set()  # publishers whose samples raised (in failures)
        self._scalars: dict[str, float] = {}
        self._edges: Mapping[str, tuple[float, ...]] = {}
        self._step: int | None = None
        self._changes = 0
        self.records = 0
        """Records received."""
        self.lag = math.nan
        """Seconds from the last record's step boundary to its arrival here."""

    # -- the write side (the worker's thread; replay's) ----------------------------------------------

    def send(self, item: Any) -> None:
        """Take one record's values as the latest; its rows and metrics are applied when next read."""
        record: StepRecord = item
        with self._lock:
            pending = self._pending
            pending.pop(record.keys, None)  # re-inserted last: the newest layout applies last
            pending[record.keys] = record
            if len(pending) > _PENDING_LAYOUTS:  # the layout changes with every record: keep up
                self._apply()
            if record.extras:
                self._extras.update(record.extras)
            self._scalars.update(record.scalars)
            self._writes += 1
            self._scalar_at.update(dict.fromkeys(record.scalars, self._writes))
            if record.edges:
                self._edges = record.edges
            self._step = record.step
            self.records += 1  # counted once everything of the record is in: flush() waits for this
            self.lag = time.time() - record.time

    def apply(self) -> None:
        """Bring the rows and the worker-side metrics up to date with the records received (the readers
        call it; ``watch.flush()`` and ``close()`` too, so a failing metric is reported by then).
        Thread-safe; cheap when nothing arrived since the last call.

        Example:
            >>> from streamwatch import SeriesKey, StepRecord
            >>> from streamwatch.testing import table
            >>> store = SeriesStore(metrics=["layer_mean"])
            >>> keys = (SeriesKey("train", "fc", "activation", ""),)
            >>> store.send(StepRecord(0, 0.0, 0, keys, table(1, fill=1.0)))
            >>> store.apply()  # (what samples() does first)
            >>> [s.value for s in store.samples() if s.name == "streamwatch_layer_mean"][:1]
            [1.0]
        """
        with self._lock:
            self._apply()

    def _apply(self) -> None:  # holds the lock
        pending = self._pending
        if pending:
            rows = self._rows
            for record in pending.values():
                for key, row in zip(record.keys, record.table, strict=True):
                    rows[key] = row
                for name, metric in list(self._run):
                    try:
                        samples = metric(record)
                    except Exception as exc:  # stops only this metric: the values and the others go on
                        self._run = [entry for entry in self._run if entry[0] != name]
                        self.failures.append((f"SeriesStore metric {name!r}", exc))
                        continue
                    self._store(samples)  # a function of records already counted: the version stays
            pending.clear()
        if self._later:
            self._publish_later()

    def _publish_later(self) -> None:  # holds the lock
        later = self._later
        for key, (publish, state) in later.items():
            try:
                samples = list(publish(state))
            except Exception as exc:  # stops only this publisher: the values and the others go on
                self._stopped.add(key)
                self.failures.append((f"SeriesStore publishing {key!r}", exc))
                continue
            self._store(samples)
        later.clear()

    def put(self, samples: Iterable[Sample], replace: bool = False) -> None:
        """Latest values of derived or user-served series, replacing those with the same name and labels;
        with ``replace``, every earlier series of the names in ``samples`` goes first (an info series
        whose labels changed). A value put for the series a record's step-level value also gives (a
        trainer's logged learning rate and the optimizer's, ``streamwatch_learning_rate{group="0"}``) is
        served until a later record brings that value again, and the other way round: one series, the
        latest value."""
        samples = list(samples)
        with self._lock:
            if replace:
                names = {sample.name for sample in samples}
                self._put = {key: s for key, s in self._put.items() if key[0] not in names}
                self._put_at = {key: at for key, at in self._put_at.items() if key[0] not in names}
            self._store(samples)
            self._writes += 1
            for sample in samples:
                self._put_at[(sample.name, tuple(sorted(sample.labels.items())))] = self._writes
            self._changes += 1

    def later(self, key: object, publish: Callable[[Any], Iterable[Sample]], state: Any) -> bool:
        """Publish ``publish(state)``'s samples (as :meth:`put` would) when the store is next read, in
        place of any state ``key`` left unread: a pipeline whose samples are a function of its latest
        state (the detectors') hands over that state per record and the samples are made once per read.

        ``state`` must not change after it is handed over (the read may happen on another thread). A
        ``publish`` that raises is stopped — listed in :attr:`failures`, its key refused from then on
        (False) — and everything else goes on.

        Example:
            >>> from streamwatch import Sample
            >>> store = SeriesStore(metrics=())
            >>> total = lambda n: [Sample("streamwatch_seen", {}, float(n))]
            >>> store.later("seen", total, 1), store.later("seen", total, 2)
            (True, True)
            >>> [s.value for s in store.samples() if s.name == "streamwatch_seen"]
            [2.0]
        """
        with self._lock:
            if key in self._stopped:
                return False
            self._later[key] = (publish, state)
            self._changes += 1
        return True

    def _store(self, samples: Iterable[Sample]) -> None:  # holds the lock
        put = self._put
        for sample in samples:
            put[(sample.name, tuple(sorted(sample.labels.items())))] = sample

    # -- the read side: SeriesSource -------------------------------------------------------------------

    @property
    def step(self) -> int | None:
        """The step of the last record received (None before the first)."""
        return self._step

    @property
    def edges(self) -> Mapping[str, tuple[float, ...]]:
        """Histogram bucket upper bounds by tap kind, from the last record that carried them."""
        return self._edges

    def version(self) -> object:
        """Changes whenever :meth:`samples` would return something else (records and put values)."""
        with self._lock:
            return self.records, self._changes

    def table(self) -> tuple[np.ndarray, list[SeriesKey]]:
        """The latest row of every series as one table (``COLUMNS``), and the series' keys."""
        with self._lock:
            self._apply()
            keys = list(self._rows)
            table = np.array([self._rows[k] for k in keys]) if keys else np.empty((0, len(COLUMNS)))
        return table, keys

    def samples(self, table_rows: bool = True) -> list[Sample]:
        """Every latest value as a Sample; without ``table_rows``, all but the per-tensor statistics of
        the summary table. Values that are unknown (NaN) are absent."""
        with self._lock:
            self._apply()
            keys = list(self._rows) if table_rows else []
            table = np.array([self._rows[k] for k in keys]) if keys else np.empty((0, len(COLUMNS)))
            scalars = dict(self._scalars)
            extras = dict(self._extras)
            put = dict(self._put)
            put_at, scalar_at = dict(self._put_at), dict(self._scalar_at)
            step = self._step
        out: list[Sample] = []
        stats = {name: table[:, i] for i, name in enumerate(COLUMNS)} | derive(table)
        for i, key in enumerate(keys):
            labels = key.labels()
            for stat, values in stats.items():
                value = float(values[i])
                if not math.isnan(value):  # absent, never a NaN placeholder
                    out.append(Sample(TENSOR.name, {**labels, "stat": stat}, value))
        for (key, stat), vector in extras.items():
            labels = {**key.labels(), "stat": stat}
            if stat == "histogram":  # bucket counts, in streamwatch.metrics.Buckets order
                for bucket, count in enumerate(vector):
                    out.append(Sample(HISTOGRAM_SAMPLE, {**labels, "bucket": str(bucket)}, float(count)))
            elif not math.isnan(value := float(vector[0])):
                out.append(Sample(TENSOR.name, labels, value))
        later: list[Sample] = []  # the record scalars, each unless a later put value is its series
        for name, value in scalars.items():
            sample = scalar_sample(name, value)
            if sample is None:  # (a watch.log() name that cannot be served: refused when logged)
                continue
            series = (sample.name, tuple(sorted(sample.labels.items())))
            if series in put_at:
                if put_at[series] > scalar_at.get(name, 0):
                    continue
                del put[series]
            later.append(sample)
        out.extend(put.values())
        out.extend(later)
        if step is not None:
            out.append(Sample(STEP.name, {}, float(step)))
        return out

    def __repr__(self) -> str:
        self.apply()
        return f"<SeriesStore step={self._step} series={len(self._rows)} metrics={list(self.metrics)}>"


class Served(Sink):
    """The sink :meth:`Watch.serve` returns: its items become the store's latest values."""

    def __init__(self, store: SeriesStore, name: str, labels: dict[str, str]) -> None:
        self.store, self.name, self.labels = store, name, labels

    def send(self, item: Any) -> None:
        if isinstance(item, Mapping):
            samples = [
                Sample(self.name, {**self.labels, "series": str(k)}, float(v)) for k, v in item.items()
            ]
        else:
            samples = [Sample(self.name, self.labels, float(item))]
        self.store.put(samples)
