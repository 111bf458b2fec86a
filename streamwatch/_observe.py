"""``streamwatch.observe(model)``: wires taps → summaries → step records → channel → worker → sinks.

A :class:`Watch` holds its parts, each an object with one job: the options (checked once,
:mod:`streamwatch._options`), the hooks (:class:`streamwatch._taps.TapSet`), the step boundary that ends
each training step (:class:`streamwatch._boundary.StepBoundary`: sampling, records, the sentinel), the
channel and the worker thread with its pipelines, the series store everything after the channel reads.
This module wires them and holds the users' side: serving, reading, closing.

Example:
    >>> import torch, streamwatch as sw
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with sw.observe(model, opt) as watch:
    ...     for _ in range(3):
    ...         x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    ...         logits = model(x)
    ...         loss = torch.nn.functional.cross_entropy(logits, y)
    ...         opt.zero_grad(); loss.backward(); opt.step()
    ...         watch.step(loss=loss, outputs=logits, targets=y, batch_size=16)
    >>> sorted({s.labels["kind"] for s in watch.snapshot() if s.name == "streamwatch_tensor"})
    ['activation', 'output_grad', 'param', 'param_grad', 'update']
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping
from types import MappingProxyType, TracebackType

import torch
from prometheus_client import CollectorRegistry
from torch import nn

from streamwatch._accuracy import AMBIGUOUS
from streamwatch._allowance import EvalAllowance
from streamwatch._attach import OBSERVED, OptimizerArg, checked, device_type
from streamwatch._boundary import SCALAR_SECONDS, StepBoundary, paused
from streamwatch._cadence import Cadence
from streamwatch._channel import OverflowPolicy, Receiver, channel
from streamwatch._clip_tap import log_clipping
from streamwatch._clock import Clock
from streamwatch._closing import Closing
from streamwatch._detail import Detail, position, resolver, this_rank_keeps_detail
from streamwatch._detectors import DEFAULT_DETECTORS, Detector
from streamwatch._detectors import pipelines as detector_pipelines
from streamwatch._failures import Failures
from streamwatch._families import check_served
from streamwatch._governor import Governor
from streamwatch._guard import Alarm, NonFiniteGuard
from streamwatch._nonfinite import DEFAULT_ESCALATE, NonFiniteTracker, Reaction
from streamwatch._options import DEFAULT_OVERHEAD, STATS, Options, check_start_step, parse_options
from streamwatch._outbox import Outbox, release_dropped
from streamwatch._pipeline import Pipeline, Sink, source
from streamwatch._record import PendingRecord, Sample
from streamwatch._select import named_params
from streamwatch._store import SeriesStore, Served, WatchStatistics
from streamwatch._taps import DEFAULT_TAPS, KINDS, TapSet
from streamwatch._tapstate import TapState, kernel_status, load_summaries
from streamwatch._validate import check_seconds
from streamwatch._worker import Worker, seconds_or_forever
from streamwatch._zero import fragments
from streamwatch.metrics._base import Binding, Metric
from streamwatch.metrics._derived import DEFAULT_METRICS
from streamwatch.sinks._prometheus import DEFAULT_PORT, Exporter

__all__ = [
    "DEFAULT_METRICS",
    "DEFAULT_OVERHEAD",
    "SCALAR_SECONDS",
    "STATS",
    "Sample",
    "Watch",
    "WatchStatistics",
    "observe",
]

_governor_clock: Clock = time.perf_counter
"""The clock a Watch's overhead governor times steps with (``observe(overhead=...)``): a seam for tests,
which monkeypatch it with a :class:`streamwatch.testing.FakeClock` before ``observe()``."""


class Watch:
    """A running observation of one model. Create it with :func:`observe`."""

    def __init__(self, model: nn.Module, optimizer: OptimizerArg, options: Options) -> None:
        # Every argument is checked before anything is attached: a refused observe() touches nothing.
        optimizers, modules = checked(model, optimizer, options)
        detailed = this_rank_keeps_detail(options.detail)  # per-layer series on this rank? (docs/scale.md)
        site = OBSERVED.claim(model, modules, self)
        self._claimed = modules  # (given back by close(), or by _undo())
        self._every = options.every
        self._detectors = options.detectors
        self._exporters: list[Exporter] = []
        self._model_ref = weakref.ref(model)
        metrics = list(options.metrics)
        try:
            params = named_params(model, modules, all_params=options.every_parameter)
            zero = fragments(optimizer, params)  # (DeepSpeed ZeRO: what its optimizer steps of them)
            self._state = state = TapState(
                taps=options.taps,
                channel_last=options.channel_last,
                dead_units="dead" in options.stats and detailed,  # per-layer only: not worth it for totals
                count_nonfinite="nonfinite" in options.stats,
            )
            load_summaries(state, device_type(model))
            # everything after the channel reads the store; it runs the worker-side metrics itself
            self._store = SeriesStore(metrics=options.derived)
            # NaN/Inf: where it started (worker); the per-step sentinel and escalation (the boundary's guard)
            self._tracker = NonFiniteTracker(self._store, options.reaction)
            edges: dict[str, tuple[float, ...]] = {}
            for metric in metrics:
                edges.update(metric.edges())
            self._tx, rx = channel(options.capacity, on_drop=release_dropped)
            self._rx = rx  # the worker's once it starts; closed here only if observe() fails before
            alarm = Alarm(state)  # the detectors' (worker) → the guard's escalation (training thread)
            self._worker = _worker(rx, self._store, self._tracker, options, detailed, alarm)
            self._failures = Failures(state, self._store, self._tracker, self._worker)
            self._taps = TapSet(model, modules, params, optimizers, state, zero)
            binding = Binding(model, tuple(params), optimizers, lambda: paused(state))
            bound: tuple[Metric, ...] = ()
            for metric in metrics:
                metric.bind(binding)
                bound += (metric,)
            # last before the worker: the first step begins when observe() returns
            self._governor = (
                None if options.budget is None else Governor(options.budget, clock=_governor_clock)
            )
            if options.budget is not None:  # evaluation passes' share of it (_allowance)
                self._taps.eval_allowance = EvalAllowance(options.budget, clock=_governor_clock)
            periods = [(kind, options.cadence[kind]) for kind in KINDS if kind in options.taps]
            rank = position()[0]
            self._outbox = Outbox(
                state=state,
                taps=self._taps.parameters,
                optimizers=optimizers,
                sender=self._tx,
                overflow=options.overflow,
                capacity=options.capacity,
                edges=MappingProxyType(edges),  # carried by every record: rendering needs no metric
                rank=rank,
            )
            self._boundary = StepBoundary(
                state=state,
                taps=self._taps,
                outbox=self._outbox,
                sender=self._tx,
                store=self._store,
                tracker=self._tracker,
                worker=self._worker,
                failures=self._failures,
                cadence=Cadence(options.every, periods),
                governor=self._governor,
                guard=NonFiniteGuard(
                    options.sentinel,
                    options.auto_grad_norm,
                    options.budget,
                    escalate=options.escalate,
                    reaction=options.reaction,
                    rank=rank,
                    alarm=alarm,
                ),
                metrics=bound,
                start_step=options.start_step,
                clock=_governor_clock,
            )
            self._taps.clip = log_clipping(model, self._boundary.logbook.add, state.fail)  # pre-clip norms
            self._closing = Closing(
                boundary=self._boundary,
                sender=self._tx,
                worker=self._worker,
                failures=self._failures,
                store=self._store,
                exporters=self._exporters,
                model=self._model_ref,
                claimed=self._claimed,
                site=site,
                timeout=options.close_timeout,
            )
            self._worker.start()  # last: a failure before it leaves no thread and no sink touched
            # collected without close(): its hooks pause now, and it is closed at the next observe() or
            # at exit (_attach.Attachments.drop): every completed step still reaches the sinks
            self._dropped = weakref.finalize(self, OBSERVED.drop, self._closing, state)
            self._dropped.atexit = False
        except BaseException:
            self._undo(model, metrics)
            raise

    def _undo(self, model: nn.Module, metrics: list[Metric]) -> None:
        """observe() failed part-way: take back everything it did — every hook, every metric binding
        (also of a metric whose ``bind`` raised half-way), the channel — and free the model. The worker
        thread is started last, so it never runs here; the user's sinks were never touched."""
        taps: TapSet | None = getattr(self, "_taps", None)
        if taps is not None:
            taps.remove()
        for metric in metrics:  # none was bound before observe(): parse_options refuses those
            try:
                metric.unbind()
            except Exception:  # (a bind that raised half-way may leave nothing to unbind)
                pass
        for end in (getattr(self, "_tx", None), getattr(self, "_rx", None)):
            if end is not None:
                end.close()
        OBSERVED.release(model, self._claimed)
        self._claimed = []

    # -- the training loop's side ---------------------------------------------------------------------

    def step(
        self,
        loss: torch.Tensor | float | None = None,
        outputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        batch_size: int | None = None,
    ) -> None:
        """Mark the end of a training step. Never blocks on the device and (with the default overflow
        policy) never blocks on the worker.

        Args:
            loss: the step's loss: a one-element real tensor (it stays on its device) or a real number.
            outputs: model outputs, for train accuracy (with ``targets``; see below).
            targets: the labels ``outputs`` are scored against.
            batch_size: samples in the step (a positive integer), for throughput.

        Train accuracy reads class indices (``[N]`` with ``[N, C]`` logits; ``[N, ...]`` with the classes
        last or second), one-hot or probability targets, binary logits (positive above 0) and bool
        multi-label targets, and predicted labels; ``correct`` counts right predictions, ``total`` those
        scored, ``accuracy`` their ratio. A class-index layout that fits both ways (``[N, 4, 4]`` with
        ``[N, 4]``) is scored as the run's earlier steps put the classes, else skipped and counted
        (``statistics().skipped["ambiguous_accuracy"]``). Every layout, and what is refused:
        docs/observe.md, *Train accuracy*.

        Raises:
            TypeError, ValueError: an argument is not what it should be (the message names it). The step
                then ends without a record: what was summarised for it is dropped, never merged into the
                next step, and counted in ``statistics().failed_steps``. On a quiet step (unsampled
                between unsampled ones) only what needs no shapes is checked; ``outputs``' and
                ``targets``' layouts are refused at the next full boundary, at most a second later
                (docs/governor.md, *Quiet steps*).
            NonFiniteError: with ``observe(on_nonfinite="raise")``, a NaN/Inf appeared: raised once per
                episode, after the step has ended normally (its record sent, the step counted); from
                this step for its own non-finite loss, later for a NaN the loss does not show
                (docs/nonfinite.md gives the bounds).

        The first step of a dark pair (the governor's measurement of its floor, docs/governor.md) only
        reads the clock and its loss: its errors are raised by the next ``watch.step()`` (both steps'
        refusals: the first raised, the second in a note), or by :meth:`close` if that comes first.
        """
        self._boundary.end(loss, outputs, targets, batch_size)

    def log(self, values: Mapping[str, object] | None = None, /, **named: object) -> None:
        """Record your own values with the step under way (W&B's ``log``, Lightning's ``self.log``), before
        its ``watch.step()``: they ride with its record into the run file (``log/<name>``), ``report``,
        ``plot`` and ``/metrics`` (``streamwatch_logged_<name>``; ``eval_loss`` is
        ``streamwatch_loss{phase="eval"}``). Never blocks, never syncs (a device tensor is read with the
        record's copy). docs/observe.md#your-own-values-per-step.

        Raises:
            TypeError, ValueError: a name that is no metric name or a value that is not a real number
                (past 64 names, new ones are refused, counted in ``statistics().log_refused``, warned once).

        Example:
            >>> import torch, streamwatch as sw
            >>> records = sw.sinks.collect()
            >>> with sw.observe(torch.nn.Linear(2, 1), every=2, sinks=[records]) as watch:
            ...     for step in range(3):
            ...         watch.log(val_loss=1.0 / (step + 1))
            ...         watch.step(loss=0.5)
            >>> [(s.step, round(s.scalars["log/val_loss"], 2)) for r in records.items for s in r.every_step()]
            [(0, 1.0), (1, 0.5), (2, 0.33)]
        """
        self._boundary.logbook.add({**(values or {}), **named})

    # -- users' side ------------------------------------------------------------------------------------

    def expose(
        self,
        port: int = DEFAULT_PORT,
        *,
        host: str = "127.0.0.1",
        registry: CollectorRegistry | None = None,
        run: str | None = None,
        series_budget: int = 5000,
        timeout: float = 10.0,
    ) -> Exporter:
        """Serve this watch's latest values on ``http://host:(port + LOCAL_RANK)/metrics`` for Prometheus.

        One endpoint per process; under torchrun each local rank takes the next port. The families are
        built at scrape time, off the training thread, by a server of two threads whatever the load
        (bounded connections and timeouts, one render per change of the values; docs/prometheus.md).
        Only ``GET``/``HEAD /metrics`` are served. ``close()`` joins both threads.

        Args:
            port: the base port (``0``: any free port, see :attr:`Exporter.url`).
            host: the interface to bind: loopback by default; ``"0.0.0.0"`` to let other machines
                scrape, explicitly (``""`` is refused rather than binding every interface).
            registry: a ``prometheus_client.CollectorRegistry`` to register in (default: a new one).
            run: the ``run`` label (default ``$STREAMWATCH_RUN``, else the script's name).
            series_budget: the most series of the per-layer families to export (``streamwatch_tensor_*``,
                the histogram buckets, the detectors' per-layer families); past it, core statistics per
                layer, else per-(phase, kind) totals (``layer="__all__"``) and the worst layers in core
                detail (docs/prometheus.md#series-budget).
            timeout: seconds a client has to send its request, and again to read the response, before
                its connection is closed.

        Raises:
            OSError: the port is taken, the host cannot be resolved or is not an address of this
                machine (the message names it and the fix).
            ValueError: a bad argument, or ``host=""``.
            RuntimeError: the watch is closed (its close() would no longer stop the server).

        Example:
            >>> import torch, urllib.request, streamwatch as sw
            >>> model = torch.nn.Linear(2, 1)
            >>> with sw.observe(model) as watch:
            ...     exporter = watch.expose(port=0)
            ...     _ = model(torch.ones(1, 2)); watch.step()
            ...     _ = watch.flush()
            ...     body = urllib.request.urlopen(exporter.url, timeout=10).read().decode()
            >>> 'streamwatch_info{host=' in body and 'streamwatch_tensor_l2{' in body and 'run="' in body
            True
        """
        if self._boundary.closed:
            raise RuntimeError(
                "this Watch is closed: expose() it before close() (its final values stay readable "
                "through snapshot()), or create a new one with streamwatch.observe()"
            )
        exporter = Exporter(
            self._store,
            self.statistics,
            port=port,
            host=host,
            registry=registry,
            run=run,
            series_budget=series_budget,
            timeout=timeout,
        )
        self._exporters.append(exporter)
        return exporter

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the worker has handled every record sent so far (for tests and scripts that read
        :meth:`snapshot` right after a step); True if it did within ``timeout`` seconds (>= 0; ``math.inf``
        waits as long as it takes).

        A failed pipeline stops only itself, so flush still waits for the others; it returns False at once
        only when the worker thread has stopped (the watch is closed)."""
        return self._boundary.wait_for_worker(check_seconds(timeout, "timeout"))

    def pipe(self, pipeline: Pipeline) -> Pipeline:
        """Attach a user pipeline (``source | ops... | sink``); it receives every :class:`StepRecord`.

        Example:
            >>> import torch, streamwatch as sw
            >>> from streamwatch import ops
            >>> model = torch.nn.Linear(3, 1)
            >>> losses = sw.sinks.collect()
            >>> with sw.observe(model, every=1) as watch:
            ...     _ = watch.pipe(sw.source() | ops.map(lambda r: r.scalars["loss"]) | losses)
            ...     for _ in range(2):
            ...         loss = model(torch.randn(4, 3)).pow(2).mean()
            ...         loss.backward()
            ...         watch.step(loss=loss)
            >>> len(losses.items)
            2
        """
        return self._worker.add(pipeline)

    def serve(self, name: str, labels: Mapping[str, str] | None = None) -> Sink:
        """A sink that publishes what a pipeline computes as the series ``streamwatch_<name>{labels}``, served
        with every other latest value by :meth:`snapshot` (and ``/metrics``).

        The pipeline's items are numbers (one series), or mappings ``{label value: number}`` (one series
        per value, under the label ``series``).

        Raises:
            ValueError: ``name`` is a built-in family's (``info``, ``tensor``, ``queue_length``,
                ``steps``, ... — anything streamwatch serves itself), ends in ``_total``, ``_count``,
                ``_sum`` or ``_bucket``, or is not a metric name; a label is reserved (``le``,
                ``quantile``, the identity ``run``/``rank``/``local_rank``/``world_size``/``host``, any
                ``__`` label) or not a label name. The message names the clash.
            TypeError: a label key or value is not a string.

        Example:
            >>> import torch, streamwatch as sw
            >>> from streamwatch import ops
            >>> model = torch.nn.Linear(2, 1)
            >>> with sw.observe(model, every=1) as watch:
            ...     try:
            ...         watch.serve("queue_length")
            ...     except ValueError as err:
            ...         print(str(err).split(':')[0])
            ...     _ = watch.pipe(sw.source() | ops.map(lambda r: r.step * 10.0) | watch.serve("tenfold"))
            ...     watch.step(); watch.step()
            Expected `name` not to be a built-in family's, got 'queue_length'
            >>> [s.value for s in watch.snapshot() if s.name == "streamwatch_tenfold"]
            [10.0]
        """
        full, checked = check_served(name, labels)
        return Served(self._store, full, checked)

    @property
    def detectors(self) -> tuple[Detector, ...]:
        """The detectors ``observe(detectors=...)`` runs on the worker (docs/detectors.md)."""
        return self._detectors

    @property
    def store(self) -> SeriesStore:
        """The :class:`streamwatch.SeriesStore` the worker feeds: the latest value of every series, read
        through its protocol (``samples()``, ``table()``, ``edges``, ``step``, ``version()``) by
        :meth:`snapshot`, :meth:`expose` and the console view."""
        return self._store

    def snapshot(self) -> list[Sample]:
        """The latest value of every series (the data ``/metrics`` serves): ``watch.store.samples()``.
        Thread-safe.

        Tensor statistics are ``streamwatch_tensor`` samples labelled ``phase``, ``layer``, ``kind``,
        ``param`` (parameter kinds), ``index`` (leaf of a tuple/dict output) and ``stat`` (``/metrics``
        serves each statistic as a family: ``streamwatch_tensor_l2``, ...). Unknown ones are absent.
        """
        return self._store.samples()

    def pass_begins(self, module: nn.Module) -> None:
        """For integrations and custom trainers: a batch begins on ``module`` (the observed model) whose
        step function may never call it (Lightning's ``validation_step`` calling ``self.net(x)``). The
        watch learns whether a pass is training or evaluation from the observed model's calls (its mode
        and grad mode then); this tells it as if the model were called now, so an evaluation batch is
        summarised whatever the step samples. End the batch with :meth:`pass_ends`. Never raises
        (a failure is counted, as a hook's).

        Example:
            >>> import torch, streamwatch as sw
            >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2))
            >>> watch = sw.observe(model, every=100)
            >>> _ = model(torch.ones(1, 3)); watch.step()
            >>> _ = model.eval()
            >>> with torch.no_grad():
            ...     watch.pass_begins(model)
            ...     _ = model[0](torch.ones(4, 3))  # a submodule called directly: still summarised
            ...     watch.pass_ends()
            >>> watch.close()
            >>> sorted({s.labels["phase"] for s in watch.snapshot() if s.name == "streamwatch_tensor"})
            ['eval', 'train']
        """
        self._boundary.pass_begins(module)

    def pass_ends(self) -> None:
        """The batch :meth:`pass_begins` announced ended: an evaluation batch's hooks come out, a compiled
        model's rows leave the graph (docs/observe.md#torchcompile). Never raises: counted."""
        self._boundary.pass_ends()

    @property
    def start_step(self) -> int:
        """The index the first step's record carries (``observe(start_step=)``, default 0).

        Set it before the first :meth:`step`, when the step to resume from is known only after
        ``observe()`` (a trainer that restores its global step later); afterwards it is a
        ``RuntimeError``, as the records sent already carry the old numbering.

        Example:
            >>> import torch, streamwatch as sw
            >>> model = torch.nn.Linear(3, 2)
            >>> with sw.observe(model, every=1) as watch:
            ...     watch.start_step = 500  # the checkpoint's global step
            ...     model(torch.randn(4, 3)).sum().backward()
            ...     watch.step(loss=1.0)
            ...     watch.flush()
            ...     watch.store.step, watch.statistics().steps
            True
            (500, 1)
        """
        return self._boundary.start_step

    @start_step.setter
    def start_step(self, step: int) -> None:
        step = check_start_step(step)
        boundary = self._boundary
        if boundary.closed:
            raise RuntimeError("this Watch is closed; pass start_step= to streamwatch.observe()")
        done = boundary.step - boundary.start_step + boundary.stashed
        if done:
            raise RuntimeError(
                f"start_step can be set only before the first watch.step(); this Watch has ended "
                f"{done} step(s), numbered from {boundary.start_step}. Pass observe(start_step=) or set it "
                "before the first step"
            )
        boundary.restart_at(step)

    def statistics(self) -> WatchStatistics:
        """Steps seen and sampled, records sent and dropped by reason, worker lag, skips, errors."""
        channel_stats = self._tx.statistics()
        worker_stats = self._worker.statistics()
        governor = self._governor.statistics() if self._governor is not None else None
        boundary, guard = self._boundary, self._boundary.guard
        return WatchStatistics(
            # this Watch's calls; a dark pair's first call counts (its boundary still to run)
            steps=boundary.step - boundary.start_step + boundary.stashed,
            sampled=self._outbox.sampled,
            scalar_records=self._outbox.scalar_records,
            records_received=self._store.records,
            dropped_oldest=channel_stats.dropped_oldest,
            dropped_newest=channel_stats.dropped_newest,
            slots_exhausted=self._outbox.pool.exhausted if self._outbox.pool is not None else 0,
            queue_len=channel_stats.len,
            queue_high_water=channel_stats.high_water,
            worker_lag_seconds=self._store.lag,
            skipped=_skipped(self._state.skipped, boundary.scoring.ambiguous),
            hook_errors=self._state.hook_errors,
            pipeline_failures=worker_stats.failed + len(self._store.failures) + len(self._tracker.failures),
            kernel=kernel_status(self._state),
            overhead_seconds=boundary.overhead,
            overhead_seconds_total=boundary.overhead_total,
            failed_steps=boundary.failed_steps,
            log_refused=boundary.logbook.refused,
            stuck_pipelines=self._closing.stuck,
            unflushed_records=self._closing.unflushed,
            sampling_interval=self._every if governor is None else governor.interval,
            overhead_ratio=None if governor is None else governor.overhead_ratio,
            overhead_budget=None if governor is None else governor.budget,
            dark_steps=0 if governor is None else governor.dark_steps,
            first_nonfinite=self._tracker.first,
            nonfinite_episodes=self._tracker.episodes,
            sentinel_trips=guard.trips,
            sentinel=guard.checks(),
            escalations=guard.escalations,
            escalated_until=guard.escalated_until,
            **boundary.times.statistics(),
        )

    def close(self, timeout: float | None = None) -> None:
        """Flush every completed step to every sink, remove every hook, release the model. Idempotent.

        Waiting for the sinks is bounded: if they have not taken every record within ``timeout``
        seconds (a sink whose call never returns), close() gives up — it warns (``RuntimeWarning``)
        naming the pipeline that did not return and how many records were not flushed to every sink,
        records both in :meth:`statistics` (``stuck_pipelines``, ``unflushed_records``) and returns.
        The worker thread is left behind: a daemon thread (it does not keep the process alive) that
        finishes flushing and closing the sinks by itself if the stuck call ever returns.

        Args:
            timeout: the most seconds to wait for the sinks; ``None`` (default) uses ``close_timeout``
                from :func:`observe` (30 s unless set); ``math.inf`` waits forever.

        Raises:
            PipelineError: pipelines or hooks failed during the run (each was also warned about).
            ValueError: ``timeout`` is not a number of seconds > 0 (nothing is closed then).
            TypeError, ValueError, NonFiniteError, Full: the last ``watch.step()`` was the first step
                of a dark pair (docs/governor.md), whose errors the next call raises: close() raises
                them, after closing (with a failed pipeline's error in a note).

        Example:
            >>> import torch, streamwatch as sw
            >>> model = torch.nn.Linear(2, 1)
            >>> watch = sw.observe(model, close_timeout=60.0)
            >>> _ = model(torch.ones(1, 2)); watch.step()
            >>> watch.close(timeout=10.0)
            >>> watch.statistics().stuck_pipelines, watch.statistics().unflushed_records
            ((), 0)
        """
        wait = self._closing.timeout if timeout is None else seconds_or_forever(timeout, "timeout")
        self._dropped.detach()
        self._closing.close(wait)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._boundary.closed

    def __enter__(self) -> Watch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:  # the training loop failed: keep its exception, attach ours as a note
            self.close()
        except Exception as err:  # (failed pipelines, or what a dark pair's last step raised)
            if hasattr(exc, "add_note"):
                exc.add_note(f"streamwatch: {err}")

    def __repr__(self) -> str:
        state = "closed" if self._boundary.closed else f"step={self._boundary.step}"
        sampling = f"every={self._every}" if self._governor is None else f"overhead={self._governor.budget:g}"
        return f"<Watch {state} {sampling} taps={sorted(self._state.taps)}>"


def _worker(
    rx: Receiver[PendingRecord],
    store: SeriesStore,
    tracker: NonFiniteTracker,
    options: Options,
    detailed: bool,
    alarm: Callable[[], object] | None = None,
) -> Worker:
    """The worker thread's pipelines, in order: the tracker and the detectors publish into the store
    before it counts the record (``watch.flush()`` waits for that count: their values are in when it
    returns), then the store, then the user's sinks. Without per-layer detail, each record is reduced to
    per-(phase, kind) totals before any of them sees it."""
    return Worker(
        rx,
        [
            source() | tracker,
            *detector_pipelines(store, options.detectors, alarm),
            source() | store,
            *(source() | sink for sink in options.sinks),
        ],
        name="streamwatch-worker",
        prepare=resolver(detailed),
    )


def _skipped(tensors: Mapping[str, int], ambiguous: int) -> dict[str, int]:
    """``statistics().skipped``: tensors not summarised by reason, and the steps whose train accuracy
    was skipped (an ambiguous layout, :data:`streamwatch._accuracy.AMBIGUOUS`)."""
    return {**tensors, AMBIGUOUS: ambiguous} if ambiguous else dict(tensors)


def observe(
    model: nn.Module,
    optimizer: OptimizerArg = None,
    *,
    every: int | None = None,
    overhead: float | None = None,
    select: object = None,
    taps: Collection[str] = DEFAULT_TAPS,
    cadence: Mapping[str, int] | None = None,
    stats: Collection[str] = ("dead",),
    channel_last: bool | None = None,
    overflow: OverflowPolicy = "drop_oldest",
    capacity: int = 64,
    sinks: Iterable[Sink] = (),
    metrics: Iterable[str | Metric] = DEFAULT_METRICS,
    close_timeout: float = 30.0,
    detail: Detail = "all",
    detectors: Iterable[Detector] = DEFAULT_DETECTORS,
    on_nonfinite: Reaction = "warn",
    escalate: int = DEFAULT_ESCALATE,
    sentinel: Collection[str] | None = None,
    start_step: int = 0,
) -> Watch:
    """Observe ``model``: summarise every selected layer's tensors on the device, one record per step.

    Args:
        model: the module to observe; attach before any ``torch.compile``.
        optimizer: enables the ``param`` (after each step), ``update`` and learning-rate taps; a list
            observes several (Muon for the matrices and AdamW for the rest, a GAN's two halves): each
            parameter is read around the step of the optimizer that steps it, and the learning rates
            are numbered across them in order (docs/observe.md#several-optimizers).
        every: sample one step in ``every`` (``every=1``: every step); a fixed interval, which turns the
            overhead governor off. Unsampled steps run without the per-layer hooks and send a scalar
            record once a second (``SCALAR_SECONDS``), or at once for a loss past ``LossSpike``'s line.
        overhead: the default, ``0.02`` (:data:`DEFAULT_OVERHEAD`): a budget, the fraction of the run's
            time monitoring may cost, in (0, 1). The overhead governor (docs/governor.md) times every step,
            measures what a sampled step costs and samples one step in ``N``, the smallest ``N`` that keeps
            the measured cost within the budget, but at least once every 1000 steps and every 60 s. The
            first step is sampled. Passing both ``every`` and ``overhead`` is a ``ValueError``, and so is
            an opt-in metric that must prepare the step before the ones it samples (``GradientCosine``)
            without ``every=``.
        select: which modules — None (every leaf module), a glob, a module class, a tuple of classes
            or a :class:`streamwatch.Select`. It must match at least one module (else ``ValueError``,
            listing module names); TorchScript modules cannot be observed (``TypeError``).
        taps: which kinds to capture (see ``streamwatch._taps.KINDS``); ``input`` and ``input_grad``
            are opt-in.
        cadence: per kind, sample it on one sampled step in ``cadence[kind]`` (default: weights and
            updates 10×, the rest 1×), whether ``every`` or ``overhead`` picks the sampled steps.
        stats: optional statistics: ``"dead"`` (dead-unit rate, default) and ``"nonfinite"`` (exact
            NaN/Inf counts; otherwise a free 0/1 flag).
        channel_last: where units are for dead-unit rates: True, False, or None to pick per module
            (channels first for convolutions/norms/pools, features last otherwise).
        overflow: what to do when the worker is ``capacity`` records behind: ``"drop_oldest"``
            (default, never stalls training), ``"drop_newest"``, ``"block"`` (lossless) or ``"error"``.
        capacity: records in flight between the training thread and the worker.
        sinks: extra sinks that receive every :class:`streamwatch.StepRecord` (one sink alone is fine).
        metrics: worker-side metrics by name (default ``("update_ratio", "layer_mean")``: numpy over each
            record, nothing on the training thread) and opt-in metric objects from
            :mod:`streamwatch.metrics` (``GradientCosine``, ``SpectralNorm``, ``ConditionNumber``,
            ``Histogram``, ``PNorm``, ``ActivationSimilarity``, ``HessianMaxEig``, ``TestAccuracy``), each
            with its own ``every`` (one sampled step in the metric's ``every``). Keep the defaults when
            adding one: ``metrics=[*streamwatch.DEFAULT_METRICS, streamwatch.metrics.SpectralNorm()]``.
        close_timeout: the most seconds ``close()`` waits for the sinks to take the last records
            (``math.inf``: forever). A sink that does not return in time is left behind on the daemon
            worker thread; close() warns, naming it and the records not flushed, and returns (see
            :meth:`Watch.close`).
        detail: which ranks export per-layer series (docs/scale.md): ``"all"`` (default), ``"rank0"``,
            ``"local_rank0"`` (one rank per node), ``"none"``, or a callable
            ``(rank, local_rank, world_size) -> bool`` called once here. Any other rank reduces each
            record on its worker to one ``layer="__all__"`` row per phase and kind (counts, sums and sums
            of squares added over the layers, so global norms stay exact in PromQL; no dead units), before
            any sink: snapshot, ``/metrics``, run file and pipelines alike. Loss, step times and
            streamwatch's own metrics are served by every rank.
        detectors: built-in detector pipelines run on the worker (docs/detectors.md): default
            :data:`streamwatch.detectors.DEFAULT_DETECTORS` (``LossSpike``, ``GradientSpike``,
            ``UpdateRatioBand``); a list to choose and configure them; ``()`` for none.
        on_nonfinite: what happens when a NaN/Inf appears (docs/nonfinite.md): ``"warn"`` (default: logs
            the first tensor of each episode of non-finite steps, once), ``"raise"``
            (:class:`streamwatch.NonFiniteError` from a later ``watch.step()``: the same step for a
            non-finite loss), or a callable, called on the worker thread with a
            :class:`streamwatch.FirstNonFinite` once per episode (if it raises, it is stopped, counted
            and reported like a failing sink). ``watch.statistics().first_nonfinite`` holds the run's
            first whatever the reaction.
        escalate: when the per-step sentinel trips, or a spike or drift detector fires (docs/detectors.md),
            sample every step and every tapped kind for this many steps (default 100), so that the origin
            is recorded if the fault recurs; ``0``: never.
        sentinel: the per-step finite check, on every step, sampled or not: ``("loss",)`` (a few µs on the
            CPU, no host sync on CUDA); ``("loss", "grad_norm")`` also checks the global gradient norm
            (one pass over the gradients); ``()`` turns it off. Default (None): the loss, and with
            ``overhead=`` the gradient norm too if, timed over the first 8 steps with gradients, it costs
            at most a quarter of the budget (``statistics().sentinel`` says which).
        start_step: the index the first step's record carries (default 0; records count up from it).
            Resuming from a checkpoint, pass the steps already done (the trainer's global step): the
            resumed run's records, run file and dashboards go on where the last one stopped, and
            ``every=N`` samples the same steps it would have. :attr:`Watch.start_step` sets it later,
            before the first step (the Lightning callback does, once the trainer has restored its step).

    Raises:
        RuntimeError: the model is already observed (the message says where that Watch was made; close it,
            or ``streamwatch.unobserve`` the model).
        TypeError, ValueError: an argument is not what it should be; the message names it. Every
            argument is checked before anything is attached, and an observe() that fails part-way (a
            metric's ``bind`` raising, a hook torch refuses) takes back every hook and binding it made
            and starts no thread: the model can be observed again.
    """
    options = parse_options(
        every=every,
        overhead=overhead,
        select=select,
        taps=taps,
        cadence=cadence,
        stats=stats,
        channel_last=channel_last,
        overflow=overflow,
        capacity=capacity,
        sinks=sinks,
        metrics=metrics,
        close_timeout=close_timeout,
        detail=detail,
        detectors=detectors,
        on_nonfinite=on_nonfinite,
        escalate=escalate,
        sentinel=sentinel,
        start_step=start_step,
    )
    return Watch(model, optimizer, options)
