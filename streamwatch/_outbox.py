"""The outbox: each step's record sealed from the step buffer and offered to the channel.

:class:`Outbox` makes a record's step-level values (step time, throughput, loss, train accuracy,
learning rates), hands the step buffer's rows over with them (``StepBuffer.seal``: on CUDA one copy into a
pinned slot on a side stream, with an event) and offers the :class:`streamwatch._record.PendingRecord`
to the worker with the overflow policy the user chose. It counts what it sent; the worker counts what it
received.

Steps that send no record of their own (unsampled steps between records) are not lost: each one's
step-level values go into the outbox's :class:`StepLog` at the step's end (a tuple appended, a few
hundred nanoseconds; a device loss is kept as a 0-d view, never read there) and ride with the next record
(``StepRecord.steps``), so a sink that keeps every step (the run file) has every one. The log holds at most
:data:`STEP_LOG_CAPACITY` steps: a full log makes the next step's end send a record.

Example:
    >>> import torch, streamwatch as sw
    >>> model = torch.nn.Linear(2, 1)
    >>> with sw.observe(model, every=1) as watch:
    ...     watch.step(loss=0.5)
    >>> watch.statistics().sampled
    1
"""

from __future__ import annotations

import collections
import operator
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from streamwatch._buffer import SlotPool
from streamwatch._channel import OverflowPolicy, Sender
from streamwatch._cudagraphs import overwritten
from streamwatch._logbook import Value
from streamwatch._param_taps import ParamTaps
from streamwatch._record import SKIPPED_UPDATE, STEP_VALUE, PendingRecord
from streamwatch._step_args import StepArgs, read_loss
from streamwatch._tapstate import TapState

__all__ = [
    "LR_OF",
    "STEP_LOG_CAPACITY",
    "Groups",
    "LoggedStep",
    "Outbox",
    "StepLog",
    "learning_rates",
    "release_dropped",
]

_LR_NAMES = tuple(f"lr/{i}" for i in range(64))  # (param groups' scalar names, made once)
LR_OF = operator.methodcaller("get", "lr")
"""A param group's learning rate (None without one)."""

_NUMBERS = frozenset({float, int, type(None)})


def learning_rates(groups: Iterable[dict[str, Any]]) -> list[Value | None]:
    """The param groups' learning rates as they are now. Numbers are read as they are; a tensor (the
    compiled-optimizer recipe's ``lr=torch.tensor(0.01)``, which torch's schedulers update in place with
    ``fill_``) is read now: its value on the CPU, a copy on a device (no sync; read with the record's
    copy). Kept as the tensor, an unsampled step's rate read at the next record was that record's.

    Example:
        >>> import torch
        >>> lr = torch.tensor(0.5)
        >>> rates = learning_rates([{"lr": 0.1}, {"lr": lr}])
        >>> _ = lr.fill_(0.25); rates
        [0.1, 0.5]
    """
    rates = list(map(LR_OF, groups))
    if _NUMBERS.issuperset(map(type, rates)):  # (the common case: no Python frame per group)
        return rates
    return [_rate_now(rate) for rate in rates]


def _rate_now(rate: Any) -> Any:
    if isinstance(rate, torch.Tensor):
        rate = rate.detach()
        return rate.item() if rate.is_cpu else rate.clone()
    return rate


STEP_LOG_CAPACITY = 4096
"""Steps the log holds between records at most (a full log sends one at the next step's end): at a
thousand steps a second and a record at least once a second (``SCALAR_SECONDS``), never full."""

LoggedStep = tuple[
    int, float, float, "Value | None", "int | None", "list[Value | None] | None", "dict[str, Value] | None"
]
"""One unrecorded step: ``(step, perf_counter at its end, seconds, loss, batch size, the param groups'
learning rates, the values given to watch.log)``."""


class StepLog:
    """The steps since the last record, kept on the training thread (no lock: one thread).

    Example:
        >>> log = StepLog(capacity=2)
        >>> log.add(5, 10.0, 0.25, 0.5, 32, [0.1], None)
        >>> len(log), log.full
        (1, False)
        >>> log.take()[0][:4], len(log)
        ((5, 10.0, 0.25, 0.5), 0)
    """

    __slots__ = ("capacity", "entries")

    def __init__(self, capacity: int = STEP_LOG_CAPACITY) -> None:
        self.capacity = capacity
        self.entries: list[LoggedStep] = []

    def add(
        self,
        step: int,
        at: float,
        seconds: float,
        loss: Value | None,
        batch_size: int | None,
        lrs: list[Value | None] | None,
        values: dict[str, Value] | None,
    ) -> None:
        """Keep one step's values (a device loss as a 0-d view, device values and rates as copies: nothing
        is read here)."""
        self.entries.append((step, at, seconds, loss, batch_size, lrs, values))

    @property
    def full(self) -> bool:
        """Whether the next step's end must send a record (the log has no room for it)."""
        return len(self.entries) >= self.capacity

    def take(self) -> list[LoggedStep]:
        """Every step kept, oldest first; the log is empty after (the same list: a quiet step holds its
        bound ``append``)."""
        entries = self.entries[:]
        self.entries.clear()
        return entries

    def __len__(self) -> int:
        return len(self.entries)


def release_dropped(item: Any, reason: str) -> None:
    """A dropped record gives its pinned slot back (the drop itself is counted by the channel)."""
    if isinstance(item, PendingRecord) and item.release is not None:
        item.release()


class Groups:
    """Several optimizers' param groups, in order, as they are each time they are iterated (a loop may add a
    group, or swap a list, between two steps): learning rate ``i`` of a record is the ``i``-th of them.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> a, b = torch.optim.SGD([model.weight], lr=0.1), torch.optim.SGD([model.bias], lr=0.5)
        >>> [group["lr"] for group in Groups((a, b))]
        [0.1, 0.5]
    """

    __slots__ = ("_optimizers",)

    def __init__(self, optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
        self._optimizers = optimizers

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for optimizer in self._optimizers:
            yield from optimizer.param_groups


class Outbox:
    """Sends one Watch's records (training thread only).

    Args:
        state, taps: the Watch's tap state (its step buffer and clock marks) and parameter taps (a
            fused optimizer's skipped step).
        optimizers: the observed optimizers (their learning rates, numbered across them in order).
        sender: the channel's sending end; ``overflow`` its policy at the step boundary.
        capacity: the channel's capacity (the pinned slots of CUDA copies, and the sent steps kept).
        edges: the histogram bucket bounds every record carries.
        rank: the records' rank.

    Attributes:
        sampled, scalar_records: records sent with rows and without.
        last_record: ``perf_counter`` at the boundary of the last record sent.
        sent_steps: the steps of the last records sent (a non-finite verdict waits for its record).
        pool: the pinned slots of CUDA step copies (None until a CUDA step).
    """

    def __init__(
        self,
        *,
        state: TapState,
        taps: ParamTaps,
        optimizers: tuple[torch.optim.Optimizer, ...],
        sender: Sender[PendingRecord],
        overflow: OverflowPolicy,
        capacity: int,
        edges: Mapping[str, tuple[float, ...]],
        rank: int,
    ) -> None:
        self.state = state
        self._taps = taps
        # the param groups, as they are now: one optimizer's own list, several chained (None: no optimizer)
        self.groups: Iterable[dict[str, Any]] | None = None
        if optimizers:
            self.groups = optimizers[0].param_groups if len(optimizers) == 1 else Groups(optimizers)
        self._tx = sender
        self._overflow = overflow
        self._edges = edges
        self._rank = rank
        self.sampled = 0
        self.scalar_records = 0
        self.last_record = time.perf_counter()
        self.sent_steps: collections.deque[int] = collections.deque(maxlen=capacity + 2)
        self.pool: SlotPool | None = None
        self._stream: Any = None
        self.steps = StepLog()  # the unrecorded steps, shipped with the next record

    def learning_rates(self) -> list[Value | None]:
        """The param groups' learning rates now (none without an optimizer)."""
        groups = self.groups
        return [] if groups is None else learning_rates(groups)

    def log(
        self,
        step: int,
        now: float,
        seconds: float,
        checked: StepArgs,
        logged: dict[str, Value] | None,
        read: Callable[[int], float] | None,
    ) -> None:
        """Keep an unsampled step's values in :attr:`steps` for the next record (the full boundary's;
        the quiet step appends its own): a CPU loss read now (a loop may overwrite its buffer; ``read``,
        a float32 scalar's reader), a device loss as a 0-d view read with the next record's copy."""
        loss = checked.loss
        if isinstance(loss, torch.Tensor):
            if loss.is_cpu:
                value = read_loss(loss, read)  # (one C call for a plain 0-d float32)
                loss = loss.item() if value is None else value
            else:
                loss = self.state.memory.keep(loss.detach().reshape(()))
        self.steps.add(step, now, seconds, loss, checked.batch_size, self.learning_rates(), logged)

    def release_optimizer(self) -> None:
        """At close: the optimizers are no longer read (the Watch frees them)."""
        self.groups = None

    def send(
        self,
        step: int,
        start_step: int,
        seconds: float | None,
        checked: StepArgs,
        device: dict[str, torch.Tensor],
        full: bool,
        now: float | None = None,
        timeout: float | None = None,
        logged: dict[str, Value] | None = None,
        lrs: list[Value | None] | None = None,
    ) -> None:
        """Seal this step's record and offer it to the worker: ``full`` for a sampled step (or one with
        rows: an evaluation pass, a metric), else a scalar record between sampled steps. ``seconds``
        None: not a step's end (evaluation rows handed over at close), so no step time and no parts.
        ``timeout``: how long ``overflow="block"`` may wait for room (None: as long as it takes).
        ``step``, ``start_step``: the record's step index and its run's first. ``logged``: the values
        given to ``watch.log`` in the step; ``lrs``: its learning rates (None: the optimizer's now). The
        step log's steps ride with the record.

        Raises:
            Full, SendTimeout: the overflow policy the user chose (``"error"``; ``"block"`` with a
                timeout) refused the record; its pinned slot goes back first.
        """
        host: dict[str, float] = {}
        marks: tuple[float, ...] = ()  # a sampled step's clock marks: the worker makes its parts
        state = self.state
        if seconds is not None:
            host["step_seconds"] = seconds
            if full:  # (the boundaries the hooks saw, and the step's end, on their clock)
                t = state.times
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
        if type(loss) is float:  # (a number, or a plain CPU loss check_step read)
            host["loss"] = loss
        elif isinstance(loss, torch.Tensor):
            if loss.is_cpu:  # read at once, nothing to wait for (as float32, like a device loss)
                scalar = loss.detach()
                host["loss"] = float(scalar if scalar.dtype == torch.float32 else scalar.to(torch.float32))
            elif overwritten(loss):  # (a pass of CUDA graphs after the step's own made it)
                state.memory.found(1, "losses")
            else:
                device["loss"] = loss.detach().reshape(()).to(torch.float32)
        if checked.accuracy is not None:
            scorer, outputs, targets, total = checked.accuracy
            correct = scorer(outputs, targets)
            if type(correct) is float:  # counted on the host already (a CPU batch of class scores)
                host["correct"] = correct
            else:
                device["correct"] = correct  # type: ignore[assignment]
            host["total"] = float(total)
        for i, lr in enumerate(self.learning_rates() if lrs is None else lrs):
            name = _LR_NAMES[i] if i < len(_LR_NAMES) else f"lr/{i}"
            if type(lr) is float:  # (a tensor lr stays on its device)
                host[name] = lr
            elif lr is not None and not _put_value(name, lr, host, device):
                state.memory.found(1, "learning rates")
        if logged:
            state.memory.found(_put_values(logged, "log/", host, device), "logged values")
        steps = self._ship_steps(device) if self.steps.entries else ()
        found_inf = self._taps.found_inf
        if found_inf is not None:  # a fused step a GradScaler skipped: the worker drops its update rows
            self._taps.found_inf = None
            device[SKIPPED_UPDATE] = found_inf
        state.settle_counts()
        buffer = state.buffer
        if buffer.traced:  # (rows from compiled code: a later pass of CUDA graphs may have overwritten some)
            state.memory.found(buffer.drop_overwritten(), "rows and values of compiled code")
        if buffer.device is not None and buffer.device.type == "cuda" and self._stream is None:
            self._stream = torch.cuda.Stream(buffer.device)
            self.pool = SlotPool(self._tx.statistics().capacity + 2)
        pending = buffer.seal(
            step=step,
            rank=self._rank,
            step_scalars=device,
            host_scalars=host,
            nonfinite_counted=state.count_nonfinite,
            edges=self._edges,
            stream=self._stream,
            pool=self.pool,
            start_step=start_step,
            marks=marks,
            steps=steps,
        )
        if pending is None:
            return  # counted by the slot pool
        try:
            sent = self._tx.offer(pending, self._overflow, timeout)
        except BaseException:
            release_dropped(pending, "error")  # the pinned slot goes back; the step is counted as failed
            raise
        if sent:  # (``now``: the step's boundary, which a dark pair's first step runs late)
            self.last_record = time.perf_counter() if now is None else now
            if not full:
                self.scalar_records += 1
            elif seconds is not None:  # (not the evaluation record of close())
                self.sampled += 1
            self.sent_steps.append(step)  # its loss is there for the worker's non-finite verdict

    def _ship_steps(self, device: dict[str, torch.Tensor]) -> list[tuple[int, float, dict[str, float]]]:
        """The logged steps as a record's ``steps``: each one's host values, its device values into
        ``device`` (``STEP_VALUE``-named: one copy with the record's)."""
        wall, perf = time.time(), time.perf_counter()
        shipped = []
        lost = 0  # device values a later pass of CUDA graphs overwrote
        for i, (step, at, seconds, loss, batch_size, lrs, values) in enumerate(self.steps.take()):
            host: dict[str, float] = {"step_seconds": seconds}
            if batch_size is not None:
                host["batch_size"] = float(batch_size)
                if seconds > 0:
                    host["samples_per_second"] = batch_size / seconds
            prefix = f"{STEP_VALUE}{i}/"
            if loss is not None and not _put_value("loss", loss, host, device, prefix):
                lost += 1
            if lrs is not None:
                for group, lr in enumerate(lrs):
                    if lr is not None and not _put_value(
                        _LR_NAMES[group] if group < len(_LR_NAMES) else f"lr/{group}",
                        lr,
                        host,
                        device,
                        prefix,
                    ):
                        lost += 1
            if values:
                lost += _put_values(values, "log/", host, device, prefix)
            shipped.append((step, wall - (perf - at), host))
        if lost:
            self.state.memory.found(lost, "values of unsampled steps")
        return shipped

    def ship_rest(self, start_step: int, timeout: float | None) -> None:
        """At close: the steps still in the log go out, the last as a record of its own (so the run
        file's last step is the last step trained) carrying the others."""
        entries = self.steps.entries
        if not entries:
            return
        step, at, seconds, loss, batch_size, lrs, values = entries.pop()  # (send ships those before it)
        checked = StepArgs(loss, None, batch_size)
        self.send(step, start_step, seconds, checked, {}, False, at, timeout, values, lrs)


def _put_value(
    name: str, value: object, host: dict[str, float], device: dict[str, torch.Tensor], prefix: str = ""
) -> bool:
    """One value into the record: a number or a CPU tensor on the host, a device tensor for the copy;
    False if it was not (a device tensor a later pass of CUDA graphs overwrote: ``_cudagraphs``)."""
    if isinstance(value, torch.Tensor):
        if value.is_cpu:
            host[name] = float(value.detach().reshape(()).to(torch.float32))
        elif overwritten(value):
            return False
        else:
            device[f"{prefix}{name}"] = value.detach().reshape(()).to(torch.float32)
    else:
        host[name] = float(value)  # type: ignore[arg-type]
    return True


def _put_values(
    values: Mapping[str, object],
    into: str,
    host: dict[str, float],
    device: dict[str, torch.Tensor],
    prefix: str = "",
) -> int:
    """:func:`_put_value` of each of ``values``, named ``into`` + its name; how many were not put."""
    return sum(not _put_value(f"{into}{name}", value, host, device, prefix) for name, value in values.items())
