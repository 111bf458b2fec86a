"""``streamwatch.observe(model)``: wires taps → summaries → step records → channel → worker → sinks.

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

import collections
import contextlib
import math
import numbers
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from types import MappingProxyType, TracebackType
from typing import Any, NamedTuple

import torch
from prometheus_client import CollectorRegistry
from torch import nn

from streamwatch import _kernel
from streamwatch._accuracy import AMBIGUOUS, Score, TrainAccuracy
from streamwatch._buffer import SlotPool
from streamwatch._channel import OverflowPolicy, channel
from streamwatch._clock import Clock
from streamwatch._detail import Detail, position, resolver, this_rank_keeps_detail
from streamwatch._detectors import DEFAULT_DETECTORS, Detector
from streamwatch._detectors import pipelines as detector_pipelines
from streamwatch._exceptions import Full, PipelineError, SendTimeout
from streamwatch._families import check_served
from streamwatch._governor import Governor
from streamwatch._nonfinite import (
    DEFAULT_ESCALATE,
    FirstNonFinite,
    NonFiniteTracker,
    Reaction,
    Sentinel,
    direction_of,
    log,
)
from streamwatch._options import DEFAULT_OVERHEAD, STATS, Options, check_start_step, parse_options
from streamwatch._pipeline import Pipeline, Sink, source
from streamwatch._record import SKIPPED_UPDATE, PendingRecord, Sample
from streamwatch._store import SeriesStore, WatchStatistics
from streamwatch._summary import release_scratch
from streamwatch._taps import (
    DEFAULT_TAPS,
    KINDS,
    TapSet,
    TapState,
    check_hookable,
    describe_modules,
    named_params,
)
from streamwatch._worker import Worker, seconds_or_forever
from streamwatch.metrics._base import Binding, Metric
from streamwatch.metrics._derived import DEFAULT_METRICS
from streamwatch.sinks._prometheus import DEFAULT_PORT, Exporter

__all__ = ["DEFAULT_METRICS", "DEFAULT_OVERHEAD", "STATS", "Sample", "Watch", "WatchStatistics", "observe"]

_FORWARD_KINDS = ("input", "activation", "output_grad", "input_grad")
GRAD_NORM_TRIAL = 8
"""Steps over which an automatic gradient-norm sentinel (``overhead=`` with the default ``sentinel``) is
timed before it is kept or turned off."""
SCALAR_SECONDS = 1.0
"""Between sampled steps, a scalar record (loss, learning rates, step time, throughput, accuracy; no layer
rows) is sent when this many seconds have passed since the last record, so those values are never
staler than this on ``/metrics``."""
_governor_clock: Clock = time.perf_counter
"""The clock a Watch's overhead governor times steps with (``observe(overhead=...)``): a seam for tests,
which monkeypatch it with a :class:`streamwatch.testing.FakeClock` before ``observe()``."""
_Tensor = torch.Tensor  # (read on every quiet step: one global lookup, not two)
_F32 = torch.float32
_LR_NAMES = tuple(f"lr/{i}" for i in range(64))  # (param groups' scalar names, made once)
_CYCLE_MAX = 4096  # cadences whose lcm is longer: each sampled step's flags are looked up by pattern


class _Observed:
    """The models and modules the open Watches observe: one Watch per model and per module. A module
    two observed models share would have both models' passes merged into each watch's rows (its hooks
    cannot tell whose forward called it), so the second ``observe()`` naming it is refused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._modules: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()

    def claim(self, model: nn.Module, modules: list[tuple[str, nn.Module]]) -> None:
        """Take ``model`` and its selected ``modules`` for one Watch, or raise naming the clash."""
        with self._lock:
            if model in self._models:
                raise RuntimeError(
                    f"{type(model).__name__} is already observed by another Watch; close that one first "
                    "(one Watch per model — use watch.pipe() to add pipelines to it)"
                )
            for name, module in modules:
                owner = self._modules.get(module)
                if owner is not None:
                    raise RuntimeError(
                        f"Layer {name or '(the model itself)'!r} ({type(module).__name__}) of "
                        f"{type(model).__name__} is already observed by another Watch, as {owner}: a module "
                        "two observed models share would have both models' passes in each watch's rows. "
                        "Close that Watch first, or leave the shared module out of this one with select="
                    )
            self._models.add(model)
            for name, module in modules:
                self._modules[module] = f"layer {name!r} of a {type(model).__name__}" if name else "its model"

    def release(self, model: nn.Module | None, modules: list[tuple[str, nn.Module]]) -> None:
        """Give back what :meth:`claim` took (idempotent)."""
        with self._lock:
            if model is not None:
                self._models.discard(model)
            for _, module in modules:
                self._modules.pop(module, None)


_OBSERVED = _Observed()


def _on_cpu(model: nn.Module) -> bool:
    """Whether the model's tensors live on the CPU (or it has none): then the fused kernel is built."""
    for param in model.parameters():
        return param.device.type == "cpu"
    for buffer in model.buffers():
        return buffer.device.type == "cpu"
    return True


def _rank() -> int:
    return position()[0]


class Watch:
    """A running observation of one model. Create it with :func:`observe`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, options: Options) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Expected `model` to be a torch.nn.Module, got {type(model).__name__}")
        optimizer = _unwrap_optimizer(optimizer)
        # Every argument is checked before anything is attached: a refused observe() touches nothing.
        taps = options.taps
        if options.taps_asked and "update" in taps and optimizer is None:
            warnings.warn(
                "streamwatch: taps include 'update', which is read around optimizer.step() (its hooks): "
                "without an optimizer no update is recorded; pass it, observe(model, optimizer, ...)",
                UserWarning,
                stacklevel=3,  # the user's observe() call
            )
        for metric in options.metrics:
            if metric.requires_optimizer and optimizer is None:
                raise ValueError(
                    f"{metric!r} measures what optimizer.step() does: pass the optimizer, "
                    "streamwatch.observe(model, optimizer, metrics=[...])"
                )
        budget, every, capacity = options.budget, options.every, options.capacity
        start_step, chosen_detectors, reaction = options.start_step, options.detectors, options.reaction
        checks, auto_grad_norm = options.sentinel, options.auto_grad_norm
        derived, objects = options.derived, list(options.metrics)
        self._escalate = options.escalate
        self._close_timeout = options.close_timeout
        detailed = this_rank_keeps_detail(options.detail)  # per-layer series on this rank? (docs/scale.md)
        self._stuck: tuple[str, ...] = ()  # what close() gave up on, and the records it left
        self._unflushed = 0
        self._eval_unsent = 0  # close()'s evaluation record, if the channel had no room in time
        modules = options.select.modules(model)
        if not modules:
            raise ValueError(
                f"`select` matched no module of {type(model).__name__} (select={options.select!r}); its "
                f"modules are {describe_modules(model)}. Observing no layer is never what is wanted: match "
                "these qualified names (globs), or pass select=None for every leaf module"
            )
        check_hookable(model, modules)
        _check_optimizer_steps(model, optimizer)
        _OBSERVED.claim(model, modules)
        self._claimed = modules  # (given back by close(), or by _undo())
        try:
            params = named_params(model, modules, all_params=options.every_parameter)
            self._every = every
            merged = options.cadence
            taps_on = taps
            # Cadences of the tapped kinds, in sampled steps; kinds not tapped stay False in the flags.
            self._periods = [(kind, merged[kind]) for kind in KINDS if kind in taps_on]
            self._governor: Governor | None = None
            self._sample_count = 0  # governor mode: sampled steps so far (the cadences count these)
            self._forced = False  # the running step is sampled only because of an escalation
            self._all_off = dict.fromkeys(KINDS, False)
            # a sampled step's flags (never mutated: shared), by which kinds its cadences turn on
            self._patterns: dict[tuple[bool, ...], tuple[dict[str, bool], bool]] = {}
            period = math.lcm(*(cadence for _, cadence in self._periods)) if self._periods else 1
            # (a sampled step looks its flags up by phase: building the pattern cost ~9 µs a cold step)
            self._cycle = [self._flags_for(k) for k in range(period)] if period <= _CYCLE_MAX else []
            self._step_metrics: tuple[Any, ...] = ()
            self._exporters: list[Exporter] = []
            self._overhead = 0.0  # streamwatch's own seconds on the training thread, last step
            self._overhead_total = 0.0
            self._dark = 0  # steps left in a dark pair (docs/governor.md): their ends only read the clock
            self._stashed: list[tuple[float, float, tuple[object, object, object, object]]] = []
            self._reading: float | None = None  # a dark step's reading, for its deferred tick
            self._ticked = 0.0  # perf_counter when the governor took its reading at the last boundary
            self._tail = 0.0  # own seconds after it (the last boundary's rest): the next step's
            self._overflow: OverflowPolicy = options.overflow
            self._optimizer = optimizer
            self._state = TapState(
                taps=taps,
                channel_last=options.channel_last,
                dead_units="dead" in options.stats and detailed,  # per-layer only: not worth it for totals
                count_nonfinite="nonfinite" in options.stats,
                kernel=_kernel.load() if _on_cpu(model) else None,
            )
            self._kernel_status = _kernel.status() if _on_cpu(model) else "torch: the model is not on the CPU"
            self._model_ref = weakref.ref(model)
            self._rank = _rank()
            self._step = start_step  # the index the next record carries (docs/observe.md, *Resuming*)
            self._start_step = start_step
            self._sampled = 0
            self._scalar_records = 0  # scalar records sent between sampled steps (SCALAR_SECONDS)
            self._sampling_now = True  # the step running now is sampled (set with the flags)
            self._last_record = time.perf_counter()
            self._quiet_until = 0.0  # a quiet step must begin before (see _quiet_step)
            self._finite_at = _kernel.finite_checks()  # a CPU loss's finiteness in one C call, by dtype
            self._read_f32 = _kernel.scalar_reader()  # a float32 CPU loss's value in one C call
            self._scoring = TrainAccuracy()  # train accuracy's layouts, and where the classes are
            self._failed_steps = 0
            self._last = time.perf_counter()
            self._errors: list[tuple[str, BaseException]] = []
            self._reported_hook_errors = 0
            self._closed = False
            self._stream: Any = None
            self._pool: SlotPool | None = None
            # everything after the channel reads the store; it runs the worker-side metrics itself
            self._store = SeriesStore(metrics=derived)
            self._reported_store_failures = 0
            # NaN/Inf: where it started (worker), the per-step sentinel and escalation (this thread)
            self._reaction = reaction
            self._raises = reaction == "raise"
            self._detectors = chosen_detectors
            self._tracker = NonFiniteTracker(self._store, reaction)
            self._reported_tracker_failures = 0
            self._sentinel = Sentinel(grad_norm="grad_norm" in checks or auto_grad_norm) if checks else None
            self._sentinel_loss = "loss" in checks
            # (grad-norm check seconds, step seconds) of the first steps, while an automatic grad-norm
            # check is on trial against the governor's budget; None when no trial runs
            self._grad_norm_trial: list[tuple[float, float]] | None = [] if auto_grad_norm else None
            self._budget = budget
            self._escalated_until: int | None = None
            self._escalations = 0
            self._tripped: list[int] = []  # sentinel trips learnt at this step's boundary
            self._trip_kind = "loss"  # what the last trip saw go bad: "loss" or "grad_norm"
            self._last_trip = -2
            self._sent_steps: collections.deque[int] = collections.deque(maxlen=capacity + 2)
            edges: dict[str, tuple[float, ...]] = {}
            for metric in objects:
                edges.update(metric.edges())
            self._edges = MappingProxyType(edges)  # carried by every record: rendering needs no metric
            self._tx, rx = channel(capacity, on_drop=_release_dropped)
            self._rx = rx  # the worker's once it starts; closed here only if observe() fails before
            self._worker = Worker(
                rx,
                [
                    # The tracker and the detectors publish into the store before it counts the record
                    # (watch.flush() waits for that count): their values are in when it returns.
                    source() | self._tracker,
                    *detector_pipelines(self._store, chosen_detectors),
                    source() | self._store,
                    *(source() | sink for sink in options.sinks),
                ],
                name="streamwatch-worker",
                prepare=resolver(detailed),  # without detail: per-(phase, kind) totals, before any sink
            )
            self._taps = TapSet(model, modules, params, optimizer, self._state)
            self._all_on = dict.fromkeys(KINDS, False) | {kind: True for kind, _ in self._periods}
            self._metrics: tuple[Metric, ...] = ()
            binding = Binding(model, tuple(params), optimizer, self._paused)
            for metric in objects:
                metric.bind(binding)
                self._metrics += (metric,)
            if budget is not None:  # last before the worker: the first step begins when observe() returns
                self._governor = Governor(budget, clock=_governor_clock)
                self._file = self._governor.filed.append  # (a quiet step's one call into it)
            self._gov_clock = _governor_clock
            self._gov_real = _governor_clock is time.perf_counter  # (else a test's fake clock: no own time)
            self._set_sampling(start_step)
            self._worker.start()  # last: a failure before it leaves no thread and no sink touched
        except BaseException:
            self._undo(model, objects)
            raise

    def _undo(self, model: nn.Module, metrics: list[Metric]) -> None:
        """observe() failed part-way: take back everything it did — every hook, every metric binding
        (also of a metric whose ``bind`` raised half-way), the channel — and free the model. The worker
        thread is started last, so it never runs here; the user's sinks were never touched."""
        self._closed = True
        taps: TapSet | None = getattr(self, "_taps", None)
        if taps is not None:
            taps.remove()
        for metric in metrics:  # none was bound before observe(): _split_metrics refuses those
            with contextlib.suppress(Exception):
                metric.unbind()
        for end in (getattr(self, "_tx", None), getattr(self, "_rx", None)):
            if end is not None:
                end.close()
        _OBSERVED.release(model, self._claimed)
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

        Train accuracy reads these layouts (``N`` the batch, ``C`` the classes; any tensor on one device):

        * class indices: integer ``targets [N]`` with logits ``[N, C]``; ``[N, ..., C]`` with
          ``[N, ...]`` (classes last, e.g. tokens) or ``[N, C, ...]`` with ``[N, ...]`` (classes first, as
          ``cross_entropy`` takes images) — predicted class: the argmax. A layout that fits both ways
          (``[N, 4, 4]`` with ``[N, 4]``: a sequence as long as there are classes) is scored the way the
          run's earlier steps put the classes; before any step settled it, the step's accuracy is
          skipped, counted in ``statistics().skipped["ambiguous_accuracy"]`` and warned about once
          (reshape to ``[M, C]`` and ``[M]`` to score every step).
        * one-hot or class probabilities: floating ``targets [N, C]`` like ``outputs`` — the argmax of each.
        * binary scores: ``outputs`` with one logit per label — the same shape as ``targets``, or ``[N, 1]``
          with ``[N]`` — predicted positive where the logit is > 0 (for probabilities pass ``p - 0.5``);
          a label is positive where it is > 0.5 (0/1, -1/+1, soft labels). Several labels per sample
          (multi-label ``[N, C]``, masks ``[N, H, W]``) are scored element-wise when ``targets`` is bool;
          integer or floating ones of that shape are refused or read as one-hot (above): a shape alone
          cannot tell one-hot from multi-label.
        * predicted labels: integer/bool ``outputs`` of the same shape as ``targets`` — compared as they are.

        ``correct`` counts right predictions; ``total`` the predictions scored (``N``, or every element
        of ``[N, ...]``); ``accuracy`` is their ratio. Anything else is refused.

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
        now = time.perf_counter()
        if (
            self._state.quiet
            and now < self._quiet_until
            and self._quiet_step(now, loss, outputs, targets, batch_size)
        ):
            return
        if self._dark:
            self._dark_step(now, loss, outputs, targets, batch_size)
            return
        if self._closed:
            raise RuntimeError("this Watch is closed; create a new one with streamwatch.observe()")
        self._full_step(now, loss, outputs, targets, batch_size)

    def _full_step(
        self,
        now: float,
        loss: object,
        outputs: object,
        targets: object,
        batch_size: object,
        started: float | None = None,
    ) -> None:
        """The full step boundary: every check, the record (if any), the governor's tick, the arming.
        ``started``: when this call began, if later than the boundary ``now`` (a dark pair's first step,
        whose boundary runs at the second's): the own time counted starts there."""
        timed = self._state.timed  # this step's parts were timed
        try:
            try:
                checked = _check_step(loss, outputs, targets, batch_size, self._scoring, self._read_f32)
            except (TypeError, ValueError):
                self._end_step(now, failed=True)
                raise
            self._step_boundary(now, checked)
            if self._raises and (self._tripped or self._tracker.pending):
                self._raise_nonfinite()
        finally:
            state = self._state
            end = time.perf_counter()
            self._overhead = state.busy + (end - (now if started is None else started))
            self._overhead_total += self._overhead
            state.busy = 0.0
            self._tail = end - self._ticked  # (after the governor's reading: the next step's own time)
            if timed or state.timed:  # (untimed steps leave the boundaries at 0: their hooks are out)
                times = state.times  # the next step's data wait starts after our work (on its clock)
                times.step_end = times.clock()
                times.forward_start = times.forward_end = times.optimizer_start = times.optimizer_end = 0.0

    def _quiet_step(
        self, now: float, loss: object, outputs: object, targets: object, batch_size: object
    ) -> bool:
        """End a quiet step, if this one is (else False, and nothing is touched): the step that ends was
        not sampled, nothing was recorded in it, the next one will not be sampled either, and nothing is
        due (a scalar record, the governor's time ceiling, a verdict to raise). Its arguments get the
        checks that need no layout (types; the loss's size and finiteness, which the sentinel needs);
        outputs' and targets' layouts are checked on the steps that send a record. The governor files
        the step's end (it measures it at its next tick). The common step under a governor or
        ``every=N``: a few microseconds, where the full boundary takes tens on a small model whose step
        evicts the interpreter's caches (docs/performance.md)."""
        if isinstance(loss, _Tensor):
            if not loss.is_cpu:
                return False  # (a device loss: the sentinel queues its flag; the full boundary does it)
            finite = self._finite_at.get(loss.dtype) if type(loss) is _Tensor else None
            if finite is not None and not loss.ndim:  # a plain 0-d float: one C call reads it
                try:
                    if not finite(loss.data_ptr()):
                        return False
                except RuntimeError:  # (no storage: the full boundary says what is wrong)
                    return False
            else:
                try:
                    value = loss.item()  # (a CPU scalar: nothing to wait for; fails unless one element)
                except RuntimeError:
                    return False
                if type(value) is not float or not math.isfinite(value):
                    return False
        elif loss is not None and not (type(loss) is float and math.isfinite(loss)):
            return False
        if not (
            (batch_size is None or (type(batch_size) is int and batch_size > 0))
            and (
                (outputs is None and targets is None)
                or (isinstance(outputs, _Tensor) and isinstance(targets, _Tensor))
            )
        ):
            return False
        if self._raises and self._tracker.pending:
            return False
        governor = self._governor
        if governor is not None:
            reading = self._gov_clock()
            if not reading < governor.deadline:  # (NaN included: tick() rejects it)
                return False
            # own time in the step: the last boundary's rest, this one's so far (no hook ran in it)
            self._file((reading, self._tail + (reading - now) if self._gov_real else 0.0))
        self._state.quiet -= 1
        self._step += 1
        self._last = now
        end = time.perf_counter()
        self._overhead = end - now
        self._overhead_total += end - now
        if governor is not None:
            self._tail = end - reading if self._gov_real else 0.0
        return True

    def _dark_step(
        self, now: float, loss: object, outputs: object, targets: object, batch_size: object
    ) -> None:
        """One end of a dark pair (the governor's measurement of what its own time misses,
        docs/governor.md): the first only reads the clock and its loss's value and keeps the other
        arguments (copies of outputs and targets where its boundary will send the scalar record, which
        scores them); the second reads the clock,
        sees the root module's calls again and runs both boundaries as they would have run, ticking
        the governor with their readings. An error of the first is raised after both ran. A first end
        at or past the governor's deadline ends the pair there: its boundary runs at once, and the
        time ceiling samples the next step."""
        reading = float(self._gov_clock())
        if type(loss) is _Tensor and not self._stashed:  # the first end: its loss is read at once (one
            # C call; it may be a buffer the loop overwrites before the boundary runs at the next call)
            value = self._loss_value(loss)
            if value is None and loss.dtype is _F32 and loss.is_cpu and loss.numel() == 1:
                value = loss.item()  # (no compiled reader, or a negated view)
            loss = loss if value is None else value
        if (
            not self._stashed
            and now - self._last_record >= SCALAR_SECONDS
            and isinstance(outputs, _Tensor)
            and isinstance(targets, _Tensor)
        ):  # its boundary (at the next call) sends the scalar record, with train accuracy: score copies,
            # as they are now (a loop may overwrite its output and label buffers in place)
            outputs, targets = outputs.detach().clone(), targets.detach().clone()
        self._stashed.append((now, reading, (loss, outputs, targets, batch_size)))
        self._dark -= 1
        governor = self._governor
        if not self._dark or (governor is not None and reading >= governor.deadline):
            self._finish_dark()  # (at the deadline after the first: the time ceiling samples the next)

    def _finish_dark(self) -> None:
        self._dark = 0
        stashed, self._stashed = self._stashed, []
        error: BaseException | None = None
        try:
            self._taps.go_light()
        except Exception as exc:  # never into the user's step: counted, and the pair still ends
            self._state.fail(exc)
        for now, reading, args in stashed:
            self._reading = reading
            try:
                self._full_step(now, *args, started=time.perf_counter())
            except Exception as exc:
                if error is None:
                    error = exc
                else:  # both ends refused: the first is raised, the second told in a note
                    error.add_note(f"streamwatch: the next step was refused too: {type(exc).__name__}: {exc}")
            finally:
                self._reading = None
        if error is not None:
            raise error

    def _unencumbered(self) -> bool:
        """Whether the step beginning now has nothing for the full boundary to do at its end, nor in
        it: no sampling, metrics, escalation, hooks or rows in, and a sentinel with nothing to do but
        look at a CPU loss. Then its end may be quiet (:meth:`_quiet_step`) or it may run dark."""
        state = self._state
        taps = self._taps
        sentinel = self._sentinel
        return not (
            self._sampling_now
            or self._metrics
            or state.step_metrics
            or self._escalated_until is not None
            or taps.pending
            or taps.static
            or state.compiled
            or len(state.buffer)
            or state.buffer.extras
            or (sentinel is not None and not (sentinel.idle and self._grad_norm_trial is None))
        )

    def _quiet_window(self) -> int:
        """How many of the coming step ends may be quiet (:meth:`_quiet_step`), decided at a full
        boundary (see :meth:`_unencumbered`)."""
        if not self._unencumbered():
            return 0
        if self._governor is not None:
            return self._governor.quiet
        return self._every - 1 - self._step % self._every

    def _end_step(self, now: float, failed: bool, loss: object = None) -> None:
        """The step is over; with ``failed`` it has no record: its rows are dropped and counted.
        ``loss``: the step's checked loss (a dark pair runs only after a loss its first step can read
        at once: none, a number, or a plain float32 CPU scalar)."""
        if failed:
            self._state.buffer.clear()
            self._failed_steps += 1
            self._taps.found_inf = None  # (with the rows it was for)
        self._last = now
        self._step += 1
        # The governor times the step that ended, the hand-off included; it picks the next step's sampling.
        if self._governor is not None:
            # Own time in the step that ended, from the governor's reading at the last boundary to its
            # reading now: the rest of that boundary, the hooks', this boundary's so far. Read with
            # perf_counter: it is the floor's measure only when the governor's clock is perf_counter
            # too (tests may fake it).
            self._ticked = time.perf_counter()
            own = self._tail + self._state.busy + (self._ticked - now) if self._gov_real else 0.0
            sampled: bool | None = self._governor.tick(own, forced=self._forced, at=self._reading)
        else:
            sampled = None
        self._set_sampling(self._step, sampled)
        self._state.quiet = 0 if self._sampling_now else self._quiet_window()
        self._quiet_until = self._last_record + SCALAR_SECONDS
        governor = self._governor
        if governor is not None and governor.dark:
            if not failed and _dark_ready(loss) and self._unencumbered() and self._taps.go_dark():
                self._dark = 2  # this step and the next: no hook, nothing at the boundary between
                self._state.quiet = 0
            else:
                governor.decline_dark()

    def _step_boundary(self, now: float, checked: _StepArgs) -> None:
        seconds = now - self._last
        state = self._state
        failed = True
        try:
            device: dict[str, torch.Tensor] = {}
            if self._step_metrics:
                self._run_step_metrics(device)
            buffer = state.buffer
            if self._sampling_now or len(buffer) or buffer.extras or device:
                taps = self._taps
                if taps.has_optimizer:  # what its hooks did not read (a GradScaler skipped its step;
                    taps.summarize_rest()  # parameters it does not step)
                elif state.on.get("param"):
                    taps.summarize_params()
                self._send(seconds, checked, device, True, now)
            elif now - self._last_record >= SCALAR_SECONDS:
                # Between sampled steps, the cheap values (loss, lr, step time, throughput) still go out
                # at least once a second: a scalar record, no layer rows.
                self._send(seconds, checked, device, False, now)
            failed = False
            sentinel = self._sentinel
            value = checked.loss
            if sentinel is not None and not (
                type(value) is float  # (read by _check_step: a finite CPU loss is all there is to check)
                and math.isfinite(value)
                and self._sentinel_loss
                and not self._tripped
                and self._grad_norm_trial is None
                and sentinel.idle
            ):
                self._run_sentinel(checked, seconds)
        except (Full, SendTimeout):
            raise  # overflow="error" / a blocking send that timed out: the policy the user chose
        except Exception as exc:  # streamwatch's own failure: training goes on; warned, raised at close
            state.fail(exc)
        finally:
            self._end_step(now, failed, checked.loss)
        if (  # anything new to warn about (the common step has nothing: no call)
            self._worker.has_errors
            or len(state.errors) != self._reported_hook_errors
            or len(self._store.failures) != self._reported_store_failures
            or len(self._tracker.failures) != self._reported_tracker_failures
        ):
            self._surface_errors()

    def _send(
        self,
        seconds: float | None,
        checked: _StepArgs,
        device: dict[str, torch.Tensor],
        full: bool,
        now: float | None = None,
        timeout: float | None = None,
    ) -> None:
        """Seal this step's record and offer it to the worker: ``full`` for a sampled step (or one with
        rows: an evaluation pass, a metric), else a scalar record between sampled steps. ``seconds``
        None: not a step's end (evaluation rows handed over at close), so no step time and no parts.
        ``timeout``: how long
        ``overflow="block"`` may wait for room (None: as long as it takes)."""
        host: dict[str, float] = {}
        marks: tuple[float, ...] = ()  # a sampled step's clock marks: the worker makes its parts
        if seconds is not None:
            host["step_seconds"] = seconds
            if full:  # (the boundaries the hooks saw, and the step's end, on their clock)
                t = self._state.times
                marks = (
                    t.step_end,
                    t.forward_start,
                    t.forward_end,
                    t.optimizer_start,
                    t.optimizer_end,
                    t.clock(),
                )
        if checked.batch_size is not None and seconds is not None:
            host["batch_size"] = float(checked.batch_size)
            if seconds > 0:
                host["samples_per_second"] = checked.batch_size / seconds
        loss = checked.loss
        if type(loss) is float:  # (a number, or a plain CPU loss _check_step read)
            host["loss"] = loss
        elif isinstance(loss, torch.Tensor):
            if loss.is_cpu:  # read at once, nothing to wait for (as float32, like a device loss)
                scalar = loss.detach()
                host["loss"] = float(scalar if scalar.dtype == torch.float32 else scalar.to(torch.float32))
            else:
                device["loss"] = loss.detach().reshape(()).to(torch.float32)
        elif loss is not None:
            host["loss"] = loss
        if checked.accuracy is not None:
            scorer, outputs, targets, total = checked.accuracy
            correct = scorer(outputs, targets)
            if type(correct) is float:  # counted on the host already (a CPU batch of class scores)
                host["correct"] = correct
            else:
                device["correct"] = correct  # type: ignore[assignment]
            host["total"] = float(total)
        optimizer = self._optimizer
        groups = () if optimizer is None else optimizer.param_groups
        lr = groups[0].get("lr") if len(groups) == 1 else None
        if type(lr) is float:  # (the common case: one group, a float)
            host["lr/0"] = lr
        elif groups:
            names = _LR_NAMES
            for i, group in enumerate(groups):
                lr = group.get("lr")
                name = names[i] if i < len(names) else f"lr/{i}"
                if type(lr) is float:
                    host[name] = lr
                elif isinstance(lr, torch.Tensor):
                    device[name] = lr.detach().reshape(()).to(torch.float32)
                elif lr is not None:
                    host[name] = float(lr)
        found_inf = self._taps.found_inf
        if found_inf is not None:  # a fused step a GradScaler skipped: the worker drops its update rows
            self._taps.found_inf = None
            device[SKIPPED_UPDATE] = found_inf
        buffer = self._state.buffer
        if buffer.device is not None and buffer.device.type == "cuda" and self._stream is None:
            self._stream = torch.cuda.Stream(buffer.device)
            self._pool = SlotPool(self._tx.statistics().capacity + 2)
        pending = buffer.seal(  # (positional: keywords cost more on a cold boundary)
            self._step,
            self._rank,
            device,
            host,
            self._state.count_nonfinite,
            self._edges,
            self._stream,
            self._pool,
            self._start_step,
            marks,
        )
        if pending is None:
            return  # counted by the slot pool
        try:
            sent = self._tx.offer(pending, self._overflow, timeout)
        except BaseException:
            _release_dropped(pending, "error")  # the pinned slot goes back; the step is counted as failed
            raise
        if sent:  # (``now``: the step's boundary, which a dark pair's first step runs late)
            self._last_record = time.perf_counter() if now is None else now
            if not full:
                self._scalar_records += 1
            elif seconds is not None:  # (not the evaluation record of close())
                self._sampled += 1
            self._sent_steps.append(self._step)  # its loss is there for the worker's non-finite verdict

    def _loss_value(self, loss: object) -> float | None:
        """A plain 0-d float32 CPU loss's value, read once for the record and the sentinel in one C call
        (two ``item()`` dispatches through torch cost tens of microseconds on a step that evicted the
        interpreter's caches); None for any other loss (torch reads it where needed)."""
        read = self._read_f32
        if (
            read is None
            or type(loss) is not _Tensor
            or loss.dtype is not _F32
            or not loss.is_cpu
            or loss.ndim
            or loss.is_neg()  # (a lazily negated view, z.conj().imag: the memory holds -value)
        ):
            return None
        return read(loss.data_ptr())

    def _run_sentinel(self, checked: _StepArgs, seconds: float) -> None:
        """The per-step finite check (every step, sampled or not); a trip may escalate the sampling.
        Never raises into the step: a failure is counted like a hook's."""
        sentinel = self._sentinel
        assert sentinel is not None
        if self._tripped:
            self._tripped = []
        trial = self._grad_norm_trial
        start = time.perf_counter() if trial is not None else 0.0
        try:
            grads = (
                [p.grad for _, _, p in self._taps.params if p.grad is not None] if sentinel.grad_norm else ()
            )
            loss = checked.loss if self._sentinel_loss else None  # (a plain CPU loss: its value, read)
            tripped = sentinel.check(self._step, loss, grads)
        except Exception as exc:
            self._state.fail(exc)
            return
        if trial is not None and grads:
            self._judge_grad_norm(trial, time.perf_counter() - start, seconds)
        if not tripped:
            return
        self._tripped = tripped
        # what tripped: the gradients where the sentinel saw them go bad with a finite loss (or none
        # checked); else the loss (a device flag covers both: the loss, if it is checked)
        self._trip_kind = "grad_norm" if sentinel.grads_tripped or not self._sentinel_loss else "loss"
        if self._escalate and self._escalated_until is None:
            # From the next step on, every step is sampled in full (every tapped kind): when the fault
            # recurs, its record holds the origin. One escalation at a time: bounded cost.
            self._escalated_until = self._step + 1 + self._escalate
            self._escalations += 1
            if self._reaction == "warn":
                log.warning(
                    "streamwatch: non-finite %s at step %d (sentinel); sampling every step, every tapped "
                    "kind, for the next %d steps so that the origin is recorded if it happens again",
                    "gradients" if self._trip_kind == "grad_norm" else "loss",
                    tripped[0],
                    self._escalate,
                )

    def _drain_sentinel(self) -> None:
        """``close()``: the sentinel's device probes not yet read (the last batch, copies in flight) are
        checked now, waiting for the device. A failed step is counted and logged: too late to escalate,
        and never raised out of ``close()``."""
        sentinel = self._sentinel
        if sentinel is None:
            return
        try:
            tripped = sentinel.drain()
        except Exception as exc:
            self._state.fail(exc)
            return
        if tripped:
            log.warning(
                "streamwatch: non-finite %s at step %d (sentinel, read at close(): the last steps' device "
                "checks are read there)%s",
                "gradients or loss" if sentinel.grad_norm else "loss",
                tripped[0],
                f", and at {len(tripped) - 1} later step(s)" if len(tripped) > 1 else "",
            )

    def _sentinel_checks(self) -> tuple[str, ...]:
        sentinel = self._sentinel
        if sentinel is None:
            return ()
        checks = ("loss",) if self._sentinel_loss else ()
        return (*checks, "grad_norm") if sentinel.grad_norm and self._grad_norm_trial is None else checks

    def _judge_grad_norm(self, trial: list[tuple[float, float]], cost: float, seconds: float) -> None:
        """Under a governor with the default sentinel: keep the gradient-norm check if, over the first
        :data:`GRAD_NORM_TRIAL` steps that had gradients, its median cost is at most a quarter of what the
        budget allows per step (``budget * step seconds``); else turn it off for the run."""
        if seconds > 0:
            trial.append((cost, seconds))
        if len(trial) < GRAD_NORM_TRIAL:
            return
        costs = sorted(c for c, _ in trial)
        steps = sorted(s for _, s in trial)
        affordable = costs[len(costs) // 2] <= 0.25 * (self._budget or 0.0) * steps[len(steps) // 2]
        assert self._sentinel is not None
        self._sentinel.set_grad_norm(affordable)
        self._grad_norm_trial = None

    def _raise_nonfinite(self) -> None:
        """``on_nonfinite="raise"``: raise :class:`NonFiniteError` for a new episode. A sentinel trip on a
        step whose record was sent waits for the worker's verdict on it (the origin); a trip on a step
        without a record raises with what the sentinel saw; a verdict the worker found on its own (a
        non-finite tensor while the loss stayed finite) is raised as soon as it is there."""
        tripped, self._tripped = self._tripped, []
        new = [t for t in tripped if t != self._last_trip + 1]  # consecutive trips: one episode
        if tripped:
            self._last_trip = tripped[-1]
        if new and new[0] in self._sent_steps:
            self.flush(timeout=min(self._close_timeout or 30.0, 30.0))
        verdict = self._tracker.take_verdict()
        if verdict is not None:
            raise verdict.error()
        episode = self._tracker.episode
        if new and new[0] in self._sent_steps and episode is not None and episode.step < new[0]:
            # the record continues an episode whose verdict was taken already (the caller went on)
            raise episode.error(
                f"step {new[0]}'s loss is non-finite too: the episode that began there goes on"
            )
        if new:
            kind = self._trip_kind
            seen = FirstNonFinite(new[0], "train", "", kind, "", "", direction_of(kind), self._rank)
            raise seen.error(
                "the step was not sampled, so only the sentinel saw it and the origin is unknown: sample "
                'more steps (every=) or use on_nonfinite="warn", whose escalation records the origin if it '
                "recurs"
            )

    def _set_sampling(self, step: int, governed: bool | None = None) -> None:
        """Set the flags the hooks read for ``step``: whether it is sampled (one step in ``every``, or
        ``governed``: the governor's answer, None outside governor mode) and, if so, which kinds — kind
        ``kind`` on the ``k``-th sampled step (from 0) with ``k % cadence[kind] == 0``."""
        state = self._state
        if self._governor is None:
            sampled, k = step % self._every == 0, step // self._every
        else:
            sampled = self._governor.sampling if governed is None else governed
            k = self._sample_count
            self._sample_count += sampled
        if self._metrics:
            self._set_metrics(step, k if sampled else None)
        escalated = self._escalated_until
        if escalated is not None and step >= escalated:
            self._escalated_until = escalated = None  # the escalation is over
        # an escalated step is sampled in full whatever the governor said: its time measures nothing
        self._forced = escalated is not None
        if escalated is not None:  # a sentinel trip: every step, every tapped kind
            sampled = True
            state.on = self._all_on
            state.forward = any(self._all_on[kind] for kind in _FORWARD_KINDS)
        elif not sampled:  # most steps with every > 1 or a governor: reuse the all-off flags
            if not self._sampling_now and not state.step_metrics and not self._taps.pending:
                return  # as the step before: nothing to change (the unsampled step's fast path)
            state.on, state.forward = self._all_off, False
        else:
            cycle = self._cycle  # the flags of each phase of the cadences (k mod their lcm), if short
            flags = cycle[k % len(cycle)] if cycle else self._flags_for(k)
            state.on, state.forward = flags
        self._sampling_now = sampled
        state.timed = sampled or bool(state.step_metrics)
        try:
            self._taps.arm()  # only the hooks this step needs are installed
        except Exception as exc:  # never into the user's step: counted, warned, raised at close
            state.fail(exc)

    def _flags_for(self, k: int) -> tuple[dict[str, bool], bool]:
        """The kinds the ``k``-th sampled step samples (kind on where ``k % cadence == 0``) and whether
        any is forward-side; one shared dict per pattern (a few per run, one per cadence phase)."""
        pattern = tuple(k % cadence == 0 for _, cadence in self._periods)
        flags = self._patterns.get(pattern)
        if flags is None:
            kinds = [kind for kind, _ in self._periods]
            on = dict.fromkeys(KINDS, False) | dict(zip(kinds, pattern, strict=True))
            flags = self._patterns[pattern] = (on, any(on[kind] for kind in _FORWARD_KINDS))
        return flags

    def _set_metrics(self, step: int, k: int | None) -> None:
        """Which opt-in metrics run on ``step`` (``k``: its index among the sampled steps, None if it is
        not sampled): those it samples (``k`` a multiple of the metric's ``every``), and the preparation
        of those that sample the next step (fixed interval only: observe() refuses them under a governor,
        which decides whether a step is sampled only when it begins)."""
        state = self._state
        sampled = [] if k is None else [m for m in self._metrics if k % m.every == 0]
        preparing = [
            _Preparing(m)
            for m in self._metrics
            if m.needs_prepare and self._governor is None and (step + 1) % (self._every * m.every) == 0
        ]
        kinds: dict[str, list[Any]] = {}
        for metric in sampled:
            for kind in metric.kinds:
                kinds.setdefault(kind, []).append(metric.on_tensor)
        state.kind_metrics = kinds
        state.step_metrics = (*sampled, *preparing)
        self._step_metrics = state.step_metrics

    def _run_step_metrics(self, device: dict[str, torch.Tensor]) -> None:
        """In ``step()``: parameter metrics when no optimizer hook ran them, then the step-level ones."""
        state = self._state
        buffer = state.buffer
        if not self._taps.has_optimizer:
            for metric in self._step_metrics:
                state.call(metric.before_optimizer_step, buffer)
            for metric in self._step_metrics:
                state.call(metric.after_optimizer_step, buffer)
        for metric in self._step_metrics:
            if not isinstance(metric, _Preparing):
                state.call(metric.on_step, buffer, device)

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        """streamwatch's own taps do nothing inside (a metric runs the model itself)."""
        state = self._state
        was, state.paused = state.paused, True
        try:
            yield
        finally:
            state.paused = was

    def _surface_errors(self) -> None:
        """Warn (once each) about new hook and pipeline errors; they are raised again at close()."""
        failures = self._store.failures
        callback_failures = self._tracker.failures
        new: list[tuple[str, BaseException]] = []
        try:
            self._worker.check()
        except PipelineError as err:
            new.extend(err.errors)
        new.extend(failures[self._reported_store_failures :])
        self._reported_store_failures = len(failures)
        new.extend(callback_failures[self._reported_tracker_failures :])
        self._reported_tracker_failures = len(callback_failures)
        hook_errors = self._state.errors
        for exc in hook_errors[self._reported_hook_errors :]:
            new.append(("<tap>", exc))
        self._reported_hook_errors = len(hook_errors)
        if new:
            self._errors.extend(new)
            warnings.warn(
                f"streamwatch: {PipelineError(new)} — training continues; these are raised again at close()",
                RuntimeWarning,
                stacklevel=4,  # the user's watch.step() call
            )

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

        One endpoint per process; under torchrun each local rank takes the next port. The collector
        builds the metric families at scrape time (no per-series objects, nothing on the training
        thread). The server has two threads whatever the load: one multiplexes every connection (at
        most 64; a silent or half-sent connection holds no thread and is closed after ``timeout``), one
        answers in batches, at most 4 a second, rendering once per change of the values however many
        scrapers ask and at most 2 % of the time (requests wait for the next batch). Only
        ``GET``/``HEAD /metrics`` are served (other methods: 405, other paths: 404). ``close()`` joins
        both threads and closes every connection.

        Args:
            port: the base port (``0``: any free port, see :attr:`Exporter.url`).
            host: the interface to bind: loopback by default; ``"0.0.0.0"`` to let other machines
                scrape, explicitly (``""`` is refused rather than binding every interface).
            registry: a ``prometheus_client.CollectorRegistry`` to register in (default: a new one).
            run: the ``run`` label (default ``$STREAMWATCH_RUN``, else the script's name).
            series_budget: the most ``streamwatch_tensor`` series to export (docs/prometheus.md).
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
            >>> 'streamwatch_info{host=' in body and 'stat="l2"' in body and 'run="' in body
            True
        """
        if self._closed:
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
        deadline = time.monotonic() + _seconds(timeout, "timeout")
        while True:
            stats = self.statistics()
            if (  # (sent: sampled and scalar records; a record dropped as newest was never sent)
                stats.records_received + stats.dropped_oldest >= stats.sampled + stats.scalar_records
                and not self._worker.statistics().in_flight  # the last one is through every pipeline too
            ):
                self._store.apply()  # the metrics' values too (and their failures, reported next step)
                return True
            if time.monotonic() > deadline or self._worker.stopped:
                return False
            time.sleep(0.001)

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
        return _Served(self._store, full, checked)

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

        Tensor statistics are one family, ``streamwatch_tensor``, labelled ``phase``, ``layer``, ``kind``,
        ``param`` (parameter kinds), ``index`` (leaf of a tuple/dict output) and ``stat``. Series whose
        value is unknown (e.g. dead units of a weight) are absent, never NaN.
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
        try:
            self._taps.pass_begins(module)
        except Exception as exc:
            self._state.fail(exc)

    def pass_ends(self) -> None:
        """The batch :meth:`pass_begins` announced ended (an evaluation batch's hooks come out). Never
        raises: counted."""
        try:
            self._taps.pass_ends()
        except Exception as exc:
            self._state.fail(exc)

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
        return self._start_step

    @start_step.setter
    def start_step(self, step: int) -> None:
        step = check_start_step(step)
        if self._closed:
            raise RuntimeError("this Watch is closed; pass start_step= to streamwatch.observe()")
        if self._step != self._start_step or self._stashed:
            raise RuntimeError(
                f"start_step can be set only before the first watch.step(); this Watch has ended "
                f"{self._step - self._start_step + len(self._stashed)} step(s), numbered from "
                f"{self._start_step}. Pass observe(start_step=) or set it before the first step"
            )
        self._step = self._start_step = step
        if self._governor is None:  # a fixed interval samples by the step's index (the governor: by time)
            self._set_sampling(step)

    def statistics(self) -> WatchStatistics:
        """Steps seen and sampled, records sent and dropped by reason, worker lag, skips, errors."""
        channel_stats = self._tx.statistics()
        worker_stats = self._worker.statistics()
        governor = self._governor.statistics() if self._governor is not None else None
        return WatchStatistics(
            # this Watch's calls; a dark pair's first call counts (its boundary still to run)
            steps=self._step - self._start_step + len(self._stashed),
            sampled=self._sampled,
            scalar_records=self._scalar_records,
            records_received=self._store.records,
            dropped_oldest=channel_stats.dropped_oldest,
            dropped_newest=channel_stats.dropped_newest,
            slots_exhausted=self._pool.exhausted if self._pool is not None else 0,
            queue_len=channel_stats.len,
            queue_high_water=channel_stats.high_water,
            worker_lag_seconds=self._store.lag,
            skipped=_skipped(self._state.skipped, self._scoring.ambiguous),
            hook_errors=self._state.hook_errors,
            pipeline_failures=worker_stats.failed + len(self._store.failures) + len(self._tracker.failures),
            kernel=self._kernel_status,
            overhead_seconds=self._overhead,
            overhead_seconds_total=self._overhead_total,
            failed_steps=self._failed_steps,
            stuck_pipelines=self._stuck,
            unflushed_records=self._unflushed,
            sampling_interval=self._every if governor is None else governor.interval,
            overhead_ratio=None if governor is None else governor.overhead_ratio,
            overhead_budget=None if governor is None else governor.budget,
            dark_steps=0 if governor is None else governor.dark_steps,
            first_nonfinite=self._tracker.first,
            nonfinite_episodes=self._tracker.episodes,
            sentinel_trips=0 if self._sentinel is None else self._sentinel.trips,
            sentinel=self._sentinel_checks(),
            escalations=self._escalations,
            escalated_until=self._escalated_until,
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
        wait = self._close_timeout if timeout is None else seconds_or_forever(timeout, "timeout")
        if self._closed:
            return
        deferred: Exception | None = None
        if self._dark:  # a dark pair in flight: its first step's boundary runs now (hook back in);
            try:  # what it raises (its arguments refused, a non-finite loss under on_nonfinite="raise",
                self._finish_dark()  # a full channel under overflow="error") is raised once closed:
            except Exception as raised:  # close() is the call after that step
                deferred = raised
        self._closed = True
        self._state.quiet = 0
        self._drain_sentinel()
        self._taps.remove()
        for exporter in self._exporters:  # the final values stay readable through snapshot()
            exporter.close()
        for metric in self._metrics:
            metric.unbind()
        self._metrics, self._step_metrics = (), ()
        self._state.kind_metrics, self._state.step_metrics = {}, ()
        deadline = None if wait is None else time.monotonic() + wait
        self._send_evaluation(wait)
        release_scratch()
        self._state.buffer.clear()  # an unfinished step is not a completed step
        _OBSERVED.release(self._model_ref(), self._claimed)
        self._claimed = []
        self._optimizer = None
        self._tx.close()
        finished = True
        try:  # (what is left of the wait: the evaluation record's send may have used some)
            self._worker.close(None if deadline is None else max(deadline - time.monotonic(), 1e-3))
        except PipelineError as err:
            self._errors.extend(err.errors)
        except TimeoutError:
            finished = False  # the worker may still be in the store: leave it be
            self._give_up(wait or math.inf)  # a TimeoutError means wait was a number
        if finished:
            self._store.apply()  # the final values, and a metric failing on them, before reporting
        for exc in self._state.errors[self._reported_hook_errors :]:
            self._errors.append(("<tap>", exc))
        self._errors.extend(self._store.failures[self._reported_store_failures :])
        self._reported_store_failures = len(self._store.failures)
        self._errors.extend(self._tracker.failures[self._reported_tracker_failures :])
        self._reported_tracker_failures = len(self._tracker.failures)
        if self._errors:
            errors, self._errors = self._errors, []
            failed = PipelineError(errors)
            if deferred is None:
                raise failed from errors[0][1]
            deferred.add_note(f"streamwatch: {failed}")
        if deferred is not None:
            raise deferred

    def _send_evaluation(self, wait: float | None) -> None:
        """At close: evaluation passes run after the last ``watch.step()`` (a final validation) are
        handed over as a record of their own (step: the next step's number, as evaluation rows between
        steps are; no step time, no loss). Rows of a training step that never reached ``watch.step()``
        are not a completed step: with them in the buffer, nothing is sent (docs/observe.md). Under
        ``overflow="block"`` it waits at most ``wait`` seconds for room (close()'s timeout: the worker
        is stuck if the channel stays full that long); not sent then, it is counted as unflushed."""
        buffer = self._state.buffer
        if not len(buffer) or any(getattr(key, "phase", None) != "eval" for key in buffer.keys):
            return
        try:
            self._send(None, _StepArgs(None, None, None), {}, full=True, timeout=wait)
        except SendTimeout:
            self._eval_unsent = 1  # (close() gives up on the worker next, and says so)
        except Exception as exc:  # a full channel under overflow="error" too: counted, raised below
            self._state.fail(exc)

    def _give_up(self, waited: float) -> None:
        """close() waited ``waited`` seconds for the worker in vain: count and warn, leave it behind."""
        worker = self._worker.statistics()
        self._stuck = (worker.current,) if worker.current else ()
        self._unflushed = worker.in_flight + self._tx.statistics().len + self._eval_unsent
        try:
            self._worker.check()  # failures before it got stuck are reported as usual
        except PipelineError as err:
            self._errors.extend(err.errors)
        stuck = f"{worker.current} did not return" if worker.current else "the worker thread did not finish"
        warnings.warn(
            f"streamwatch: close() gave up after {waited:g} s: {stuck}; {self._unflushed} records were not "
            "flushed to every sink. The worker thread is left running (a daemon thread: it does not keep "
            "the process alive) and finishes by itself if that call returns. Wait longer with "
            "observe(..., close_timeout=...) or close(timeout=...) (math.inf waits forever).",
            RuntimeWarning,
            stacklevel=3,  # the user's close() call
        )

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed

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
        state = "closed" if self._closed else f"step={self._step}"
        sampling = f"every={self._every}" if self._governor is None else f"overhead={self._governor.budget:g}"
        return f"<Watch {state} {sampling} taps={sorted(self._state.taps)}>"


class _Preparing:
    """A metric on the step before one it samples: its ``prepare`` calls, under the optimizer hooks'
    names (so the Watch and the taps call every step metric alike)."""

    __slots__ = ("metric",)

    def __init__(self, metric: Metric) -> None:
        self.metric = metric

    def before_optimizer_step(self, buffer: Any) -> None:
        self.metric.prepare(buffer)

    def after_optimizer_step(self, buffer: Any) -> None:
        self.metric.prepare_after(buffer)


class _Served(Sink):
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


def _unwrap_optimizer(optimizer: object) -> torch.optim.Optimizer | None:
    """The torch optimizer to hook: ``optimizer`` itself, or the one a framework's wrapper steps
    (Accelerate's ``AcceleratedOptimizer.optimizer``, Lightning's ``LightningOptimizer._optimizer``):
    those subclass or imitate ``torch.optim.Optimizer`` without its hook tables, and step the inner one
    only when a step really happens (not on an accumulation micro-step, not when a scaler skips it).

    Example:
        >>> import torch
        >>> inner = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        >>> class Wrapper(torch.optim.Optimizer):
        ...     def __init__(self, optimizer):  # does not call Optimizer.__init__, as Accelerate's does not
        ...         self.optimizer = optimizer
        >>> _unwrap_optimizer(Wrapper(inner)) is inner, _unwrap_optimizer(inner) is inner
        (True, True)
    """
    seen = optimizer
    for _ in range(8):  # wrappers of wrappers, bounded
        if optimizer is None or (
            isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "_optimizer_step_pre_hooks")
        ):
            return optimizer
        inner = next(
            (
                value
                for value in (getattr(optimizer, name, None) for name in ("optimizer", "_optimizer"))
                if isinstance(value, torch.optim.Optimizer)
            ),
            None,
        )
        if inner is None:
            break
        optimizer = inner
    if isinstance(seen, torch.optim.Optimizer):
        raise TypeError(
            f"Expected `optimizer` to be a torch.optim.Optimizer initialised by its __init__ (it has no "
            f"step hooks), or a wrapper whose `optimizer` attribute is one; got a {type(seen).__qualname__} "
            "without them: pass the torch optimizer it wraps"
        )
    raise TypeError(f"Expected `optimizer` to be a torch.optim.Optimizer or None, got {seen!r}")


def _check_optimizer_steps(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Warn when ``optimizer`` steps none of ``model``'s parameters (another model's optimizer): its
    ``update`` and ``param`` taps, read around its step, would then watch nothing of the model."""
    if optimizer is None:
        return
    own = {id(p) for p in model.parameters()}
    stepped = [p for group in optimizer.param_groups for p in group.get("params", ())]
    if own and stepped and not any(id(p) in own for p in stepped):
        warnings.warn(
            f"streamwatch: `optimizer` ({type(optimizer).__name__}, {len(stepped)} parameters) steps none of "
            f"`model`'s {len(own)} parameters ({type(model).__name__}): is it another model's? The update "
            "and weight rows are read around its step, so they would watch nothing of this model; pass the "
            "optimizer that steps it, observe(model, optimizer)",
            UserWarning,
            stacklevel=4,  # the user's observe() call
        )


def _skipped(tensors: Mapping[str, int], ambiguous: int) -> dict[str, int]:
    """``statistics().skipped``: tensors not summarised by reason, and the steps whose train accuracy
    was skipped (an ambiguous layout, :data:`streamwatch._accuracy.AMBIGUOUS`)."""
    return {**tensors, AMBIGUOUS: ambiguous} if ambiguous else dict(tensors)


def _release_dropped(item: Any, reason: str) -> None:
    """A dropped record gives its pinned slot back (the drop itself is counted by the channel)."""
    if isinstance(item, PendingRecord) and item.release is not None:
        item.release()


def _seconds(value: object, name: str) -> float:
    """A duration argument: a real number >= 0 (``math.inf`` allowed, NaN refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) >= 0:
        raise ValueError(f"Expected `{name}` to be a number of seconds >= 0, got {value!r}")
    return float(value)


class _StepArgs(NamedTuple):
    """``watch.step()``'s arguments, checked: nothing in them can fail later."""

    loss: torch.Tensor | float | None
    # (the scorer of their layout, outputs, targets, predictions scored): scorer(outputs, targets) counts
    # the correct ones (a device scalar, or a host float) for a step that sends a record
    accuracy: tuple[Score, torch.Tensor, torch.Tensor, int] | None
    batch_size: int | None


_new_args = tuple.__new__


def _dark_ready(loss: object) -> bool:
    """Whether a dark pair may follow a step with this (checked) loss: its first step reads the loss
    when it is called, and can only where the loss is none, a number or a plain 0-d float32 CPU tensor
    (one C call); any other loss (float64, shape ``[1]``, on a device) would be read one call late, when
    a loop that overwrites a loss buffer in place has changed it."""
    if loss is None or type(loss) is float:
        return True
    return type(loss) is _Tensor and loss.dtype is _F32 and loss.is_cpu and not loss.ndim


def _check_step(
    loss: object,
    outputs: object,
    targets: object,
    batch_size: object,
    scoring: TrainAccuracy,
    read: Callable[[int], float] | None = None,
) -> _StepArgs:
    """Check every argument of ``watch.step()`` before the step is touched (shapes and types only:
    nothing is read from the device). A plain 0-d float32 CPU loss is read at once with ``read`` (the
    compiled reader, one C call): the record and the sentinel need its value, and a loop may overwrite a
    loss buffer in place. ``scoring`` decides train accuracy's layout (None in the result when it skips
    the step's accuracy: an ambiguous layout, counted there)."""
    checked_loss: torch.Tensor | float | None = None
    if type(loss) is _Tensor and loss.dtype is _F32 and not loss.ndim:  # the common loss
        # (a lazily negated view, z.conj().imag, holds -value in its memory: read by torch later)
        checked_loss = loss if read is None or not loss.is_cpu or loss.is_neg() else read(loss.data_ptr())
    elif isinstance(loss, torch.Tensor):
        if loss.numel() != 1 or loss.is_complex():
            what = "a complex tensor" if loss.is_complex() else f"a tensor of shape {list(loss.shape)}"
            raise ValueError(
                f"Expected `loss` to be a scalar (a one-element real tensor or a number), got {what}; "
                "pass the reduced loss (e.g. loss.mean())"
            )
        checked_loss = loss
    elif loss is not None:
        checked_loss = _number_loss(loss)
    if (
        batch_size is not None
        and not (type(batch_size) is int and batch_size >= 1)  # (the common case, accepted first)
        and (isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1)
    ):
        raise ValueError(
            f"Expected `batch_size` to be a positive integer (the samples in the step), got {batch_size!r}"
        )
    accuracy = None if outputs is None and targets is None else _accuracy(outputs, targets, scoring)
    # (one C call: a NamedTuple's own __new__ is a Python frame, and this runs on cold step boundaries)
    return _new_args(_StepArgs, (checked_loss, accuracy, None if batch_size is None else int(batch_size)))


def _number_loss(loss: object) -> float:
    """A loss that is not a tensor: a real number ``float()`` reads exactly — a Python or numpy scalar,
    or a 0-d numpy array of a real dtype.

    Example:
        >>> import numpy as np
        >>> _number_loss(0.5), _number_loss(np.float32(0.25)), _number_loss(np.array(2.0))
        (0.5, 0.25, 2.0)
        >>> _number_loss(np.array([1.0]))
        Traceback (most recent call last):
        ...
        TypeError: Expected `loss` to be a scalar (a one-element real tensor or a number), got array([1.])
    """
    if getattr(loss, "shape", None) == () and getattr(getattr(loss, "dtype", None), "kind", "") in "biuf":
        # a 0-d numpy array (or an array-like of the same kind): a number in a box, as float() reads it
        dtype_kind = loss.dtype.kind  # type: ignore[attr-defined]
        if dtype_kind != "b":
            loss = loss[()]  # type: ignore[index]
    if isinstance(loss, bool) or not isinstance(loss, numbers.Real):
        raise TypeError(
            f"Expected `loss` to be a scalar (a one-element real tensor or a number), got {loss!r}"
        )
    try:
        return float(loss)
    except OverflowError:
        raise ValueError(
            "Expected `loss` to be a number a float can hold, got one too large for it "
            f"({type(loss).__name__}); pass the loss as a float or a tensor"
        ) from None


def _accuracy(
    outputs: object, targets: object, scoring: TrainAccuracy
) -> tuple[Score, torch.Tensor, torch.Tensor, int] | None:
    """``(scorer, outputs, targets, n)``: ``scorer(outputs, targets)`` counts the correct predictions (a
    device scalar, or a host float; called for a step that sends a record), ``n`` the predictions
    scored, for the layouts documented in :meth:`Watch.step`; anything else is refused, naming the
    shapes. None: ``scoring`` skipped this step's accuracy (an ambiguous layout nothing settled yet).

    Example:
        >>> scorer, o, t, n = _accuracy(
        ...     torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]), TrainAccuracy()
        ... )
        >>> scorer(o, t), n
        (1.0, 2)
    """
    if outputs is None or targets is None:
        raise ValueError(
            "Expected `outputs` and `targets` together (both for train accuracy, or neither), got "
            f"{'targets' if outputs is None else 'outputs'} alone"
        )
    for name, value in (("outputs", outputs), ("targets", targets)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"Expected `{name}` to be a torch.Tensor (for train accuracy), got {value!r}")
    assert isinstance(outputs, torch.Tensor)
    assert isinstance(targets, torch.Tensor)
    decided = scoring.layout(outputs, targets)
    if decided is None:
        return None
    scorer, n = decided
    return scorer, outputs, targets, n


def observe(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
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
        optimizer: enables the ``param`` (after each step), ``update`` and learning-rate taps.
        every: sample one step in ``every`` (``every=1``: every step); a fixed interval, which turns the
            overhead governor off. Unsampled steps run without the per-layer hooks and send a scalar
            record at most once a second (``SCALAR_SECONDS``).
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
        escalate: when the per-step sentinel trips, sample every step and every tapped kind for this
            many steps (default 100), so that the origin is recorded if the fault recurs; ``0``: never.
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
        RuntimeError: the model is already observed.
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
