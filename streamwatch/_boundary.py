"""The step boundary: what ``watch.step()`` does at the end of each training step.

:class:`StepBoundary` is the one object on the Watch's side that writes the taps' state
(:class:`streamwatch._taps.TapState`): which kinds the next step samples, the hooks armed for it, the step's
clock marks, the quiet-step window. At each step's end it takes one of three paths:

* **quiet** (:meth:`StepBoundary._quiet_step`): an unsampled step between unsampled ones with nothing
  due: the arguments' cheap checks, the governor told where the step ended, a few microseconds. The
  common step under the governor or ``every=N`` (docs/governor.md, *Quiet steps*).
* **dark** (:meth:`StepBoundary._dark_step`): the governor's measurement of its floor: two steps with
  streamwatch entirely out of the way; their boundaries run at the second's end.
* **full** (:meth:`StepBoundary._full_step`): every check, the record (a sampled step's, or a scalar
  record at least once a second), the sentinel (:mod:`streamwatch._guard`), the governor's tick and the
  next step's sampling (:mod:`streamwatch._cadence`).

A record is sealed from the step buffer (``StepBuffer.seal``) and offered to the channel with the
overflow policy the user chose. Nothing here raises into the training step except what the user asked
for: a refused argument, ``on_nonfinite="raise"``, ``overflow="error"``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from streamwatch import _kernel
from streamwatch._accuracy import TrainAccuracy
from streamwatch._cadence import Cadence, Preparing
from streamwatch._channel import Sender
from streamwatch._exceptions import Full, SendTimeout
from streamwatch._failures import Failures
from streamwatch._governor import Governor
from streamwatch._guard import Alarm, NonFiniteGuard
from streamwatch._logbook import LogBook, Value
from streamwatch._nonfinite import NonFiniteTracker
from streamwatch._outbox import Outbox, learning_rates
from streamwatch._record import PendingRecord
from streamwatch._step_args import NO_ARGS, StepArgs, check_step, dark_ready, read_loss
from streamwatch._steptimes import StepTimes
from streamwatch._store import SeriesStore
from streamwatch._summary import release_scratch
from streamwatch._taps import TapSet
from streamwatch._tapstate import TapState
from streamwatch._worker import Worker
from streamwatch.metrics._base import Metric

__all__ = ["SCALAR_SECONDS", "StepBoundary", "paused"]

SCALAR_SECONDS = 1.0
"""Between sampled steps, a scalar record (loss, learning rates, step time, throughput, accuracy; no layer
rows) is sent when this many seconds have passed since the last record, so those values are never
staler than this on ``/metrics``."""

_Tensor = torch.Tensor  # (read on every quiet step: one global lookup, not two)
_F32 = torch.float32
_Stashed = tuple[float, float, tuple[object, object, object, object], "dict[str, Value] | None"]
"""A dark pair's step end waiting for its boundary: ``now``, the governor's reading, the arguments
(loss, outputs, targets, batch size) and its ``watch.log()`` values."""
_LR_NAMES = tuple(f"lr/{i}" for i in range(64))  # (param groups' scalar names, made once)


@contextlib.contextmanager
def paused(state: TapState) -> Iterator[None]:
    """streamwatch's own taps do nothing inside (a metric runs the model itself: a probe batch, the
    Hessian's passes)."""
    was, state.paused = state.paused, True
    try:
        yield
    finally:
        state.paused = was


class StepBoundary:
    """Ends each training step for one Watch (the training thread's side of it).

    Args:
        state, taps: the Watch's tap state and hooks.
        outbox: what sends the records; ``sender`` the channel's sending end it sends into (the
            boundary reads its statistics).
        store, tracker, worker: the worker side, whose progress :meth:`wait_for_worker` waits on.
        failures: what failed, warned about at the step's end.
        cadence, governor, guard: what is sampled, the overhead governor (None with ``every=``), the
            sentinel and its escalation.
        metrics: the opt-in metric objects, bound.
        start_step: the index of the first step's record.
        clock: the governor's clock (``time.perf_counter``, or a test's fake).

    Attributes:
        step: the index the next record carries; ``start_step`` the first step's.
        failed_steps: steps refused (no record).
        overhead, overhead_total: streamwatch's own seconds on the training thread, last step and all.
        scoring: train accuracy's layouts (and the steps whose accuracy it skipped).
        closed: :meth:`finish` ran.
    """

    def __init__(
        self,
        *,
        state: TapState,
        taps: TapSet,
        outbox: Outbox,
        sender: Sender[PendingRecord],
        store: SeriesStore,
        tracker: NonFiniteTracker,
        worker: Worker,
        failures: Failures,
        cadence: Cadence,
        governor: Governor | None,
        guard: NonFiniteGuard,
        metrics: tuple[Metric, ...],
        start_step: int,
        clock: Callable[[], float],
    ) -> None:
        self.state = state
        self._memory = state.memory
        self._taps = taps
        self._outbox = outbox
        self._tx = sender
        self._store = store
        self._tracker = tracker
        self._worker = worker
        self._failures = failures
        self._cadence = cadence
        self._governor = governor
        self.guard = guard
        if guard.sentinel is not None:  # (the losses its batches keep: copied once CUDA graphs overwrote one)
            guard.sentinel.memory = state.memory
        self._alarm = guard.alarm or Alarm(state)  # (its line: LossSpike's; inf without one)
        self._metrics = metrics
        self._step_metrics: tuple[Any, ...] = ()
        self.step = self.start_step = start_step
        self.failed_steps = 0
        self.overhead = 0.0  # streamwatch's own time on the training thread, last step
        self.overhead_total = 0.0
        self.times = StepTimes()  # every step's wall time and samples (the step counters, the histogram)
        self.closed = False
        self.scoring = TrainAccuracy()  # train accuracy's layouts, and where the classes are
        self._read_f32 = _kernel.scalar_reader()  # a float32 CPU loss's value in one C call
        self._forced = False  # the running step is sampled only because of an escalation
        self._sampling_now = True  # the step running now is sampled (set with the flags)
        self._dark = 0  # steps left in a dark pair (docs/governor.md): their ends only read the clock
        self._stashed: list[_Stashed] = []
        self._reading: float | None = None  # a dark step's reading, for its deferred tick
        self._ticked = 0.0  # perf_counter when the governor took its reading at the last boundary
        self._tail = 0.0  # own seconds after it (the last boundary's rest): the next step's
        self._last = time.perf_counter()
        self._quiet_until = 0.0  # a quiet step must begin before (see _quiet_step)
        self._gov_clock = clock
        self._gov_real = clock is time.perf_counter  # (else a test's fake clock: no own time)
        self._file = governor.filed.append if governor is not None else None  # (a quiet step's one call)
        self.logbook = LogBook()  # watch.log()'s values for the step under way
        self._set_sampling(start_step)

    @property
    def stashed(self) -> int:
        """Steps of a dark pair whose boundary has not run yet (0 or 1)."""
        return len(self._stashed)

    # -- the step's end ---------------------------------------------------------------------------------

    def end(self, loss: object, outputs: object, targets: object, batch_size: object) -> None:
        """``watch.step()``: end the training step (see :meth:`streamwatch.Watch.step`)."""
        now = time.perf_counter()
        if (
            self.state.quiet
            and now < self._quiet_until
            and self._quiet_step(now, loss, outputs, targets, batch_size)
        ):
            return
        if self._dark:
            self._dark_step(now, loss, outputs, targets, batch_size)
            return
        if self.closed:
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
        state = self.state
        timed = state.timed  # this step's parts were timed
        try:
            try:
                checked = check_step(loss, outputs, targets, batch_size, self.scoring, self._read_f32)
            except (TypeError, ValueError):
                self._end_step(now, failed=True)
                raise
            self._boundary(now, checked)
            guard = self.guard
            if guard.raises and (guard.tripped or self._tracker.pending):
                guard.raise_nonfinite(self._tracker, self._outbox.sent_steps, self._flush_for_verdict)
        finally:
            end = time.perf_counter()
            self.overhead = state.busy + (end - (now if started is None else started))
            self.overhead_total += self.overhead
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
        the step's end (it measures it at its next tick).

        A hot spot (docs/architecture.md): the common step under a governor or ``every=N``, a few
        microseconds where the full boundary takes tens on a small model whose step evicts the
        interpreter's caches (docs/performance.md); ``tests/test_quiet.py`` holds it to the full
        boundary's results."""
        value: float | torch.Tensor | None = None
        probe = None  # (a device loss: its 0-d view for the sentinel, given once nothing can refuse)
        if isinstance(loss, _Tensor) and not loss.is_cpu:
            sentinel = self.guard.sentinel
            if loss.ndim or not loss.is_floating_point() or type(loss) is not _Tensor:
                return False  # (the full boundary checks and says what is wrong)
            if sentinel is not None and not (sentinel.takes_quiet_probes and sentinel.quiet_poll()):
                return False  # (a failed step read from a batch's flags: the full boundary reports it)
            value = loss.detach()  # (a view: no kernel, no sync; read with the next record's copy)
            if self._memory.copy:  # (CUDA graphs overwrote a kept loss once: a copy from now on)
                value = value.clone()
            probe = value if sentinel is not None and self.guard.checks_loss else None
        elif isinstance(loss, _Tensor):
            read = self._read_f32  # (inline, not _loss_value: a Python call costs µs on a cold step)
            try:
                if read is not None and type(loss) is _Tensor and loss.dtype is _F32 and not loss.ndim:
                    # (a lazily negated view's memory holds -value: item() reads it)
                    value = read(loss.data_ptr()) if not loss.is_neg() else loss.item()
                else:
                    value = loss.item()  # (a CPU scalar: nothing to wait for; fails unless one element)
            except RuntimeError:  # (no storage, or not one element: the full boundary says what is wrong)
                return False
            if type(value) is not float or not math.isfinite(value) or value > self._alarm.line:
                return False  # (past LossSpike's line: the full boundary sends it at once)
        elif loss is not None:
            if not (type(loss) is float and math.isfinite(loss)) or loss > self._alarm.line:
                return False
            value = loss
        outbox = self._outbox
        log = outbox.steps
        if len(log.entries) >= log.capacity:
            return False  # (its end sends a record, which ships the logged steps)
        if not (
            (batch_size is None or (type(batch_size) is int and batch_size > 0))
            and (
                (outputs is None and targets is None)
                or (isinstance(outputs, _Tensor) and isinstance(targets, _Tensor))
            )
        ):
            return False
        if self.guard.raises and self._tracker.pending:
            return False
        governor = self._governor
        if governor is not None:
            reading = self._gov_clock()
            if not reading < governor.deadline:  # (NaN included: tick() rejects it)
                return False
            # own time in the step: the last boundary's rest, this one's so far (no hook ran in it)
            self._file((reading, self._tail + (reading - now) if self._gov_real else 0.0))  # type: ignore[misc]
        if probe is not None:
            self.guard.sentinel.probe(self.step, probe)  # type: ignore[union-attr]
        book = self.logbook
        logged = book.pending
        if logged is not None:
            book.pending = None
        groups = outbox.groups  # (their learning rates as they are now: tensors read at once)
        lrs = None if groups is None else learning_rates(groups)
        log.entries.append((self.step, now, now - self._last, value, batch_size, lrs, logged))
        self.state.quiet -= 1
        self.step += 1
        self.times.add(now - self._last, batch_size)  # (at once: a scrape sees every step as it ends)
        self._last = now
        end = time.perf_counter()
        self.overhead = end - now
        self.overhead_total += end - now
        if governor is not None:
            self._tail = end - reading if self._gov_real else 0.0
        return True

    def _dark_step(
        self, now: float, loss: object, outputs: object, targets: object, batch_size: object
    ) -> None:
        """One end of a dark pair (the governor's measurement of what its own time misses,
        docs/governor.md): the first only reads the clock and its loss's value and keeps the other
        arguments (copies of outputs and targets where its boundary will send the scalar record, which
        scores them); the second reads the clock, sees the root module's calls again and runs both
        boundaries as they would have run, ticking the governor with their readings. An error of the
        first is raised after both ran. A first end at or past the governor's deadline ends the pair
        there: its boundary runs at once, and the time ceiling samples the next step."""
        reading = float(self._gov_clock())
        if type(loss) is _Tensor and not self._stashed:  # the first end: its loss is read at once (one
            # C call; it may be a buffer the loop overwrites before the boundary runs at the next call)
            if not loss.is_cpu:  # (a 0-d device loss, dark_ready: a copy, no sync)
                loss = loss.detach().clone()
            else:
                value = read_loss(loss, self._read_f32)
                if value is None and loss.dtype is _F32 and loss.numel() == 1:
                    value = loss.item()  # (no compiled reader, or a negated view)
                loss = loss if value is None else value
        if (
            not self._stashed
            and now - self._outbox.last_record >= SCALAR_SECONDS
            and isinstance(outputs, _Tensor)
            and isinstance(targets, _Tensor)
        ):  # its boundary (at the next call) sends the scalar record, with train accuracy: score copies,
            # as they are now (a loop may overwrite its output and label buffers in place)
            outputs, targets = outputs.detach().clone(), targets.detach().clone()
        # (its watch.log() values too: the next step's would replace them in the book before it runs)
        self._stashed.append((now, reading, (loss, outputs, targets, batch_size), self.logbook.take()))
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
            self.state.fail(exc)
        for now, reading, args, logged in stashed:
            self._reading, self.logbook.pending = reading, logged
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
        it: no sampling, metrics, escalation, hooks or rows in, and a guard with nothing to do but look
        at a CPU loss. Then its end may be quiet (:meth:`_quiet_step`) or it may run dark."""
        state = self.state
        taps = self._taps
        return not (
            self._sampling_now
            or self._metrics
            or state.step_metrics
            or not self.guard.quiet_ready
            or taps.pending
            or taps.static
            or state.compiled
            or len(state.buffer)
            or state.buffer.extras
        )

    def _quiet_window(self) -> int:
        """How many of the coming step ends may be quiet, decided at a full boundary."""
        if not self._unencumbered():
            return 0
        if self._governor is not None:
            return self._governor.quiet
        every = self._cadence.every
        return every - 1 - self.step % every

    def _end_step(self, now: float, failed: bool, loss: object = None) -> None:
        """The step is over; with ``failed`` it has no record: its rows are dropped and counted.
        ``loss``: the step's checked loss (a dark pair runs only after a loss its first step can read at
        once: none, a number, or a plain float32 CPU scalar)."""
        state = self.state
        if failed:
            state.buffer.clear()
            self.failed_steps += 1
            self._taps.parameters.found_inf = None  # (with the rows it was for)
        self._last = now
        self.step += 1
        # The governor times the step that ended, the hand-off included; it picks the next step's sampling.
        governor = self._governor
        sampled: bool | None = None
        if governor is not None:
            # Own time in the step that ended, from the governor's reading at the last boundary to its
            # reading now: the rest of that boundary, the hooks', this boundary's so far. Read with
            # perf_counter: it is the floor's measure only when the governor's clock is perf_counter too.
            self._ticked = time.perf_counter()
            own = self._tail + state.busy + (self._ticked - now) if self._gov_real else 0.0
            sampled = governor.tick(own, forced=self._forced, at=self._reading)
        self._set_sampling(self.step, sampled)
        state.quiet = 0 if self._sampling_now else self._quiet_window()
        self._quiet_until = self._outbox.last_record + SCALAR_SECONDS
        if governor is not None and governor.dark:
            if not failed and dark_ready(loss) and self._unencumbered() and self._taps.go_dark():
                self._dark = 2  # this step and the next: no hook, nothing at the boundary between
                state.quiet = 0
            else:
                governor.decline_dark()

    def _boundary(self, now: float, checked: StepArgs) -> None:
        seconds = now - self._last
        self.times.add(seconds, checked.batch_size)
        state = self.state
        logged = self.logbook.take()
        failed = True
        try:
            state.settle_counts()  # (rows compiled code made since the last backward pass; probed counts)
            device: dict[str, torch.Tensor] = {}
            if self._step_metrics:
                self._run_step_metrics(device)
            buffer = state.buffer
            if self._sampling_now or len(buffer) or buffer.extras or device:
                taps = self._taps
                parameters = taps.parameters
                if parameters.has_optimizer:  # what its hooks did not read (a GradScaler skipped its step;
                    parameters.summarize_rest()  # parameters it does not step)
                elif state.on.get("param"):
                    parameters.summarize_params()
                self._outbox.send(
                    self.step, self.start_step, seconds, checked, device, True, now, logged=logged
                )
            elif (
                now - self._outbox.last_record >= SCALAR_SECONDS
                or self._outbox.steps.full
                or self._alarm.crossed(checked.loss)
                or self.guard.crossed()
            ):  # Between sampled steps, the cheap values (loss, lr, step time, throughput) still go out
                # at least once a second, and at once for a loss past LossSpike's line (a CPU loss now, a
                # device loss once the sentinel read its batch): a scalar record, no layer rows (it ships
                # the logged steps too).
                self._outbox.send(
                    self.step, self.start_step, seconds, checked, device, False, now, logged=logged
                )
            else:  # an unsampled step: its values wait in the log for the next record
                self._outbox.log(self.step, now, seconds, checked, logged, self._read_f32)
            failed = False
            if self.guard.needs(checked.loss):
                self._check_finite(checked, seconds)
        except (Full, SendTimeout):
            raise  # overflow="error" / a blocking send that timed out: the policy the user chose
        except Exception as exc:  # streamwatch's own failure: training goes on; warned, raised at close
            state.fail(exc)
        finally:
            self._end_step(now, failed, checked.loss)
        if self._failures.new():  # anything new to warn about (the common step has nothing)
            self._failures.warn()

    def _check_finite(self, checked: StepArgs, seconds: float) -> None:
        """The guard's per-step check; a failure is counted like a hook's, never raised."""
        taps = self._taps
        try:
            self.guard.check(
                self.step,
                checked.loss,
                lambda: [p.grad for _, _, p in taps.parameters.params if p.grad is not None],
                seconds,
            )
        except Exception as exc:
            self.state.fail(exc)

    # -- what the next step samples ------------------------------------------------------------------

    def _set_sampling(self, step: int, governed: bool | None = None) -> None:
        """Set the flags the hooks read for ``step``: whether it is sampled (one step in ``every``, or
        ``governed``: the governor's answer, None outside governor mode) and, if so, which kinds
        (:class:`streamwatch._cadence.Cadence`); an escalated step samples every tapped kind."""
        state = self.state
        governor = self._governor
        if governor is not None and governed is None:
            governed = governor.sampling
        sampled, k = self._cadence.decide(step, governed)
        if self._metrics:
            self._set_metrics(step, k if sampled else None)
        # an escalated step is sampled in full whatever the governor said: its time measures nothing
        self._forced = escalated = self.guard.escalated(step)
        cadence = self._cadence
        if escalated:  # a sentinel trip: every step, every tapped kind
            sampled = True
            state.on, state.forward = cadence.all_on, cadence.forward_all
        elif not sampled:  # most steps with every > 1 or a governor: reuse the all-off flags
            if not self._sampling_now and not state.step_metrics and not self._taps.pending:
                return  # as the step before: nothing to change (the unsampled step's fast path)
            state.on, state.forward = cadence.all_off, False
        else:
            state.on, state.forward = cadence.flags(k)
        self._sampling_now = sampled
        state.timed = sampled or bool(state.step_metrics)
        try:
            self._taps.arm()  # only the hooks this step needs are installed
        except Exception as exc:  # never into the user's step: counted, warned, raised at close
            state.fail(exc)

    def restart_at(self, step: int) -> None:
        """Number the records from ``step`` (``Watch.start_step``, before the first step); a fixed
        interval samples by the step's index (the governor: by time)."""
        self.step = self.start_step = step
        if self._governor is None:
            self._set_sampling(step)

    def _set_metrics(self, step: int, k: int | None) -> None:
        """The opt-in metrics ``step`` runs (:meth:`streamwatch._cadence.Cadence.metrics_for`), into the
        taps' state: the tensor metrics by the kind they read, and the step-level ones."""
        state = self.state
        state.kind_metrics, state.step_metrics = self._cadence.metrics_for(
            self._metrics, step, k, self._governor is not None
        )
        self._step_metrics = state.step_metrics

    def _run_step_metrics(self, device: dict[str, torch.Tensor]) -> None:
        """Parameter metrics when no optimizer hook ran them (several: after all), then step-level ones."""
        state = self.state
        buffer = state.buffer
        parameters = self._taps.parameters
        if parameters.several:
            parameters.metrics_after()
        elif not parameters.has_optimizer:
            for metric in self._step_metrics:
                state.call(metric.before_optimizer_step, buffer)
            for metric in self._step_metrics:
                state.call(metric.after_optimizer_step, buffer)
        for metric in self._step_metrics:
            if not isinstance(metric, Preparing):
                state.call(metric.on_step, buffer, device)

    def pass_begins(self, module: torch.nn.Module) -> None:
        """``Watch.pass_begins``: never raises (a failure is counted, as a hook's)."""
        try:
            self._taps.pass_begins(module)
        except Exception as exc:
            self.state.fail(exc)

    def pass_ends(self) -> None:
        """``Watch.pass_ends``: never raises (counted)."""
        try:
            self._taps.pass_ends()
            self.state.drain()  # (rows compiled code made in the pass: out of the graph, between passes)
        except Exception as exc:
            self.state.fail(exc)

    # -- errors, the worker's progress, the end -------------------------------------------------------

    def wait_for_worker(self, timeout: float) -> bool:
        """Wait until the worker handled every record sent so far; True if it did within ``timeout``
        seconds, False at once if the worker thread has stopped."""
        deadline = time.monotonic() + timeout
        while True:
            channel = self._tx.statistics()
            if (  # (sent: sampled and scalar records; a record dropped as newest was never sent)
                self._store.records + channel.dropped_oldest
                >= self._outbox.sampled + self._outbox.scalar_records
                and not self._worker.statistics().in_flight  # the last one is through every pipeline too
            ):
                self._store.apply()  # the metrics' values too (and their failures, reported next step)
                return True
            if time.monotonic() > deadline or self._worker.stopped:
                return False
            time.sleep(0.001)

    def _flush_for_verdict(self) -> None:
        self.wait_for_worker(30.0)

    def finish(self) -> Exception | None:
        """``close()``'s training-thread part: a dark pair in flight ends (its first step's boundary
        runs now; what it raises is returned, for close() to raise once closed), the guard reads its last
        device probes, every hook comes out and every metric is unbound."""
        deferred: Exception | None = None
        if self._dark:
            try:
                self._finish_dark()
            except Exception as raised:
                deferred = raised
        self.closed = True
        state = self.state
        state.quiet = 0
        try:
            self.guard.drain()
        except Exception as exc:
            state.fail(exc)
        self._taps.remove()
        for metric in self._metrics:
            metric.unbind()
        self._metrics, self._step_metrics = (), ()
        state.kind_metrics, state.step_metrics = {}, ()
        return deferred

    def send_last(self, wait: float | None) -> bool:
        """At close: evaluation passes run after the last ``watch.step()`` (a final validation) go out as
        a record of their own (step: the next step's number, as evaluation rows between steps are; no step
        time, no loss), carrying the steps still in the outbox's log; without them, the logged steps go
        out, the last as a record of its own. Rows of a training step that never reached ``watch.step()``
        are not a completed step: they are dropped, never sent (docs/observe.md). Under
        ``overflow="block"`` it waits at most ``wait`` seconds for room; False if the record was not
        sent then (close() counts it as unflushed). The step buffer is cleared either way."""
        buffer = self.state.buffer
        sent = True
        self.logbook.drop_unfinished()
        evaluation = len(buffer) and all(getattr(key, "phase", None) == "eval" for key in buffer.keys)
        if not evaluation:
            buffer.clear()  # (an unfinished training step's rows: not in the last record)
        try:
            if evaluation:
                self._outbox.send(self.step, self.start_step, None, NO_ARGS, {}, full=True, timeout=wait)
            else:
                self._outbox.ship_rest(self.start_step, wait)
        except SendTimeout:
            sent = False
        except Exception as exc:  # a full channel under overflow="error" too: counted, raised by close()
            self.state.fail(exc)
        release_scratch()
        buffer.clear()  # an unfinished step is not a completed step
        self._outbox.release_optimizer()
        return sent
