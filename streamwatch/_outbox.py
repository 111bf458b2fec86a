"""The outbox: each step's record sealed from the step buffer and offered to the channel.

:class:`Outbox` makes a record's step-level values (step time, throughput, loss, train accuracy,
learning rates), hands the step buffer's rows over with them (``StepBuffer.seal``: on CUDA one copy into a
pinned slot on a side stream, with an event) and offers the :class:`streamwatch._record.PendingRecord`
to the worker with the overflow policy the user chose. It counts what it sent; the worker counts what it
received.

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
import time
from collections.abc import Mapping
from typing import Any

import torch

from streamwatch._buffer import SlotPool
from streamwatch._channel import OverflowPolicy, Sender
from streamwatch._param_taps import ParamTaps
from streamwatch._record import SKIPPED_UPDATE, PendingRecord
from streamwatch._step_args import StepArgs
from streamwatch._tapstate import TapState

__all__ = ["Outbox", "release_dropped"]

_LR_NAMES = tuple(f"lr/{i}" for i in range(64))  # (param groups' scalar names, made once)


def release_dropped(item: Any, reason: str) -> None:
    """A dropped record gives its pinned slot back (the drop itself is counted by the channel)."""
    if isinstance(item, PendingRecord) and item.release is not None:
        item.release()


class Outbox:
    """Sends one Watch's records (training thread only).

    Args:
        state, taps: the Watch's tap state (its step buffer and clock marks) and parameter taps (a
            fused optimizer's skipped step).
        optimizer: the observed optimizer (its learning rates), or None.
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
        optimizer: torch.optim.Optimizer | None,
        sender: Sender[PendingRecord],
        overflow: OverflowPolicy,
        capacity: int,
        edges: Mapping[str, tuple[float, ...]],
        rank: int,
    ) -> None:
        self.state = state
        self._taps = taps
        self._optimizer = optimizer
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

    def release_optimizer(self) -> None:
        """At close: the optimizer is no longer read (the Watch frees it)."""
        self._optimizer = None

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
    ) -> None:
        """Seal this step's record and offer it to the worker: ``full`` for a sampled step (or one with
        rows: an evaluation pass, a metric), else a scalar record between sampled steps. ``seconds``
        None: not a step's end (evaluation rows handed over at close), so no step time and no parts.
        ``timeout``: how long ``overflow="block"`` may wait for room (None: as long as it takes).
        ``step``, ``start_step``: the record's step index and its run's first.

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
        optimizer = self._optimizer  # each param group's learning rate (a tensor lr stays on its device)
        for i, group in enumerate(() if optimizer is None else optimizer.param_groups):
            lr = group.get("lr")
            name = _LR_NAMES[i] if i < len(_LR_NAMES) else f"lr/{i}"
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
        buffer = state.buffer
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
