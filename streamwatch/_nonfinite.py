"""The first bad value: where a NaN/Inf started, a per-step sentinel, and the reactions to it.

Three parts, each on its own side of the channel:

* :func:`find_first` (pure, any thread) — the first non-finite tensor of one :class:`StepRecord`, in the
  step's execution order (:meth:`StepRecord.execution_order`: forward, the loss, backward, the
  optimizer), as a frozen :class:`FirstNonFinite`.
* :class:`NonFiniteTracker` (a sink on the worker thread) — runs :func:`find_first` on every record,
  keeps the run's first value, publishes it into the series store
  (``streamwatch_first_nonfinite_info{...} 1`` and ``streamwatch_first_nonfinite_step``) and reacts
  once per *episode* (consecutive records with a non-finite value): ``"warn"`` logs, ``"raise"`` hands
  the value to the training thread, a callable is called with it.
* :class:`Sentinel` (the training thread, every step, sampled or not) — a finite check of the loss (and,
  opt-in, of the global gradient norm). On the CPU it reads the value at once (a few µs). On CUDA it
  never waits for the device: the flag ``~isfinite(loss)`` is copied without blocking into a pinned ring
  slot with an event, and read once the event has completed, a few steps later.

Example:
    >>> from streamwatch import SeriesKey, StepRecord
    >>> from streamwatch.testing import table
    >>> keys = (SeriesKey("train", "fc", "param_grad", "weight"), SeriesKey("train", "fc", "activation", ""))
    >>> rows = table(nonfinite=[1, 1], fill=0.0)  # both rows hold a non-finite value
    >>> record = StepRecord(7, 0.0, 0, keys, rows, order=(3, 1))  # ... but the activation ran first
    >>> first = find_first(record)
    >>> first.step, first.layer, first.kind, first.direction
    (7, 'fc', 'activation', 'forward')
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import torch

from streamwatch._cudagraphs import GraphMemory, overwritten
from streamwatch._exceptions import NonFiniteError
from streamwatch._families import FIRST_NONFINITE_INFO, FIRST_NONFINITE_STEP
from streamwatch._pipeline import Sink
from streamwatch._record import Sample, SeriesKey, StepRecord
from streamwatch._validate import check_int

__all__ = [
    "DEFAULT_ESCALATE",
    "DIRECTIONS",
    "SENTINEL_CHECKS",
    "FirstNonFinite",
    "NonFiniteTracker",
    "Reaction",
    "Sentinel",
    "check_escalate",
    "check_on_nonfinite",
    "check_sentinel",
    "direction_of",
    "find_first",
]

log = logging.getLogger("streamwatch")

Direction = Literal["forward", "backward", "optimizer"]
DIRECTIONS: tuple[Direction, ...] = ("forward", "backward", "optimizer")
_DIRECTION: dict[str, Direction] = {
    "input": "forward",
    "activation": "forward",
    "loss": "forward",
    "output_grad": "backward",
    "input_grad": "backward",
    "param_grad": "backward",
    "grad_norm": "backward",
    "update": "optimizer",
    "param": "optimizer",
}
_PARAM_KINDS = frozenset({"param", "param_grad", "update"})

DEFAULT_ESCALATE = 100
"""Steps sampled in full (every step, every tapped kind) after the sentinel trips: docs/nonfinite.md."""

SENTINEL_CHECKS = ("loss", "grad_norm")
"""What the per-step sentinel can check: ``loss`` (default, a few µs) and ``grad_norm`` (opt-in: one
``torch._foreach_norm`` pass over every gradient, ~0.4 ms per 13 MB of gradients on CPU)."""

Reaction = str | Callable[["FirstNonFinite"], object]


def direction_of(kind: str) -> Direction:
    """Where in the step a tensor of ``kind`` is produced.

    Example:
        >>> direction_of("activation"), direction_of("param_grad"), direction_of("update")
        ('forward', 'backward', 'optimizer')
    """
    return _DIRECTION.get(kind, "forward")


@dataclass(frozen=True, slots=True)
class FirstNonFinite:
    """The first tensor of a step that held a NaN or an Inf, in the step's execution order.

    Attributes:
        step: the step (``watch.step()`` calls before it).
        phase: ``"train"`` or ``"eval"``.
        layer: the module's qualified name (``""`` for the loss, ``"__all__"`` on a rank without
            per-layer detail).
        kind: ``activation``, ``output_grad``, ``param_grad``, ``update``, ``param``, ``input``,
            ``input_grad``, or ``loss`` (the loss was the first non-finite value: every tapped tensor of
            the forward pass was finite).
        param: the parameter (``weight``/``bias``) for parameter kinds, else ``""``.
        index: the leaf of a tuple/dict output (``"0"``, ``"logits"``), else ``""``.
        direction: ``"forward"``, ``"backward"`` or ``"optimizer"``.
        rank: the process rank.
        count: the non-finite values in that tensor (exact with ``stats=("nonfinite",)``; otherwise 1,
            a presence flag).
        certain: whether the records rule out an earlier origin: the step before was recorded in full
            (every tapped kind) with finite values (or this is the first step), and this step's record
            holds every tapped kind that runs before the value.
            When False, the step before may have started it unseen — typically an update on a step that
            did not sample updates (the default cadence samples them on one sampled step in 10) — and
            the escalation that follows a sentinel trip records every kind until a recurrence gives a
            certain value, which then replaces this one (docs/nonfinite.md).

    Example:
        >>> value = FirstNonFinite(12, "train", "fc", "param_grad", "weight", "", "backward", 0, 3.0, True)
        >>> value.describe()
        "step 12, rank 0: param_grad of layer 'fc' (param 'weight', backward, train): 3 non-finite values"
    """

    step: int
    phase: str
    layer: str
    kind: str
    param: str
    index: str
    direction: str
    rank: int
    count: float = 1.0
    certain: bool = False

    def labels(self) -> dict[str, str]:
        """The labels of ``streamwatch_first_nonfinite_info`` (the rank is the process identity's)."""
        return {
            "phase": self.phase,
            "layer": self.layer,
            "kind": self.kind,
            "param": self.param,
            "index": self.index,
            "direction": self.direction,
            "certain": "true" if self.certain else "false",
        }

    def describe(self) -> str:
        """One line for logs, reports and errors."""
        where = f"param {self.param!r}, " if self.param else (f"index {self.index!r}, " if self.index else "")
        what = "the loss" if self.kind == "loss" else f"{self.kind} of layer {self.layer!r}"
        values = f"{self.count:g} non-finite value{'s' if self.count != 1 else ''}"
        sure = "" if self.certain else "; the step before was not recorded in full, so it may have started it"
        head = f"step {self.step}, rank {self.rank}: {what}"
        return f"{head} ({where}{self.direction}, {self.phase}): {values}{sure}"

    def error(self, note: str = "") -> NonFiniteError:
        """The :class:`streamwatch.NonFiniteError` that ``on_nonfinite="raise"`` raises for this value."""
        message = f"non-finite value first at {self.describe()}"
        return NonFiniteError(
            message + (f"; {note}" if note else ""),
            step=self.step,
            phase=self.phase,
            layer=self.layer,
            kind=self.kind,
            param=self.param,
            index=self.index,
            direction=self.direction,
            rank=self.rank,
        )


@functools.lru_cache(maxsize=16)
def _train_kinds(keys: tuple[SeriesKey, ...]) -> frozenset[str]:
    """The training kinds of a record layout (cached: layouts repeat)."""
    return frozenset(key.kind for key in keys if key.phase == "train")


def find_first(record: StepRecord) -> FirstNonFinite | None:
    """The first non-finite tensor of ``record`` in its execution order, or None if all are finite.

    The loss (``scalars["loss"]``) counts as computed after every training forward row and before the
    first backward row: a NaN that first appears in the loss function is reported as ``kind="loss"``.
    """
    nonfinite = record.column("nonfinite") if len(record.keys) else np.empty(0)
    clean = nonfinite <= 0  # not > 0 and not NaN (unknown counts as suspect); comparisons never warn
    loss = record.scalars.get("loss")
    loss_bad = loss is not None and not math.isfinite(loss)
    if not loss_bad and clean.all():  # the common case, in one pass
        return None
    bad = np.flatnonzero(~clean)
    positions = record.execution_order()
    first: int | None = int(bad[np.argmin(positions[bad])]) if len(bad) else None
    if loss_bad:
        later = [
            int(positions[i])
            for i, key in enumerate(record.keys)
            if key.phase == "train" and direction_of(key.kind) != "forward"
        ]
        loss_position = min(later) - 0.5 if later else math.inf
        if first is None or loss_position < positions[first]:
            return FirstNonFinite(record.step, "train", "", "loss", "", "", "forward", record.rank, 1.0)
    assert first is not None
    key = record.keys[first]
    is_param = key.kind in _PARAM_KINDS
    count = float(nonfinite[first]) if nonfinite[first] > 0 else 1.0
    return FirstNonFinite(
        record.step,
        key.phase,
        key.layer,
        key.kind,
        key.name if is_param else "",
        "" if is_param else key.name,
        direction_of(key.kind),
        record.rank,
        count,
    )


def first_of_run(records: Iterable[StepRecord]) -> FirstNonFinite | None:
    """The first non-finite tensor of the first record that has one (what a run file holds).

    Example:
        >>> first_of_run([]) is None
        True
    """
    for record in records:
        found = find_first(record)
        if found is not None:
            return found
    return None


class Publishes(Protocol):
    """Where the tracker publishes where the first NaN started (a :class:`streamwatch.SeriesStore`)."""

    def put(self, samples: Iterable[Sample], replace: bool = False) -> None:
        """Latest values, replacing those with the same names (and, with ``replace``, every label set)."""
        ...


class NonFiniteTracker(Sink):
    """The worker side: the run's first non-finite value, published into ``store``, and the reaction.

    Put it before the store in the worker's pipelines (its values are then in when the store counts
    the record: ``watch.flush()`` waits for that). Not thread-safe for writers (one worker thread);
    :attr:`first`, :attr:`episodes` and :meth:`take_verdict` may be read from any thread.

    Args:
        store: where ``streamwatch_first_nonfinite_info`` and ``_step`` are published (None: nowhere).
        reaction: ``"warn"`` (log once per episode), ``"raise"`` (keep the episode's value for
            :meth:`take_verdict`), a callable (called with it here, on the worker thread; if it raises
            it is stopped, counted in :attr:`failures` and reported like a failing sink), or None
            (no reaction: a replay).

    Example:
        >>> from streamwatch import SeriesKey, SeriesStore, StepRecord
        >>> from streamwatch.testing import table
        >>> store, seen = SeriesStore(metrics=()), []
        >>> tracker = NonFiniteTracker(store, seen.append)
        >>> key = SeriesKey("train", "fc", "activation", "")
        >>> for step, flag in enumerate([0, 1, 1, 0, 1]):
        ...     row = table(count=4, nonfinite=flag, fill=0.0)
        ...     tracker.send(StepRecord(step, 0.0, 0, (key,), row))
        >>> [v.step for v in seen], tracker.first.step, tracker.episodes
        ([1, 4], 1, 2)
        >>> sorted((s.name, s.value) for s in store.samples() if "first" in s.name)
        [('streamwatch_first_nonfinite_info', 1.0), ('streamwatch_first_nonfinite_step', 1.0)]
    """

    def __init__(self, store: Publishes | None, reaction: Reaction | None = "warn") -> None:
        self.store = store
        self.reaction: Reaction | None = reaction
        self.first: FirstNonFinite | None = None
        self.episode: FirstNonFinite | None = None  # the latest episode's first value
        # by rank (a run file may hold several ranks' records, interleaved): the last step recorded in full
        # with finite values, and whether the rank's last record had a non-finite value
        self._last_full_finite: dict[int, int] = {}
        self.episodes = 0
        self.failures: list[tuple[str, BaseException]] = []
        self._in_episode: dict[int, bool] = {}
        self._session: dict[int, tuple[int, int]] = {}  # by rank: (start_step, step) of its last record
        # by rank: the training kinds of its session so far (a record with all of them is full)
        self._rank_kinds: dict[int, set[str]] = {}
        self._lock = threading.Lock()
        self._verdicts: collections.deque[FirstNonFinite] = collections.deque(maxlen=16)

    def send(self, item: Any) -> None:
        """Look at one record (the worker thread)."""
        record: StepRecord = item
        kinds = _train_kinds(record.keys)
        rank = record.rank
        session = (record.start_step, record.step)
        last = self._session.get(rank)
        if last is not None and (session[0] != last[0] or session[1] <= last[1]):
            # a new session of this rank (a resumed run appended to the same file): what the last one
            # recorded says nothing about what came before this one's records, nor which kinds it taps
            self._last_full_finite.pop(rank, None)
            self._in_episode[rank] = False
            self._rank_kinds[rank] = set()
        self._session[rank] = session
        seen = self._rank_kinds.setdefault(rank, set())
        seen |= kinds
        full = bool(kinds) and kinds >= seen
        found = find_first(record)
        if found is None:
            self._in_episode[rank] = False
            if full:
                self._last_full_finite[rank] = record.step
            return
        # Certain: nothing unrecorded can have come first — the step before was recorded in full with
        # finite values (or this is the first step), and this record holds every kind that runs up to
        # the value's direction (a step may end early: a loop that skips the backward of a NaN loss).
        order = DIRECTIONS.index(direction_of(found.kind))
        needed = {kind for kind in seen if DIRECTIONS.index(direction_of(kind)) <= order}
        previous = self._last_full_finite.get(rank)
        certain = kinds >= needed and (record.step == record.start_step or previous == record.step - 1)
        found = dataclasses.replace(found, certain=certain)
        with self._lock:
            if self.first is None or (certain and not self.first.certain):
                self.first = found  # the first value; an uncertain one gives way to the first certain one
                if self.store is not None:
                    self.store.put(
                        [
                            Sample(FIRST_NONFINITE_INFO.name, found.labels(), 1.0),
                            Sample(FIRST_NONFINITE_STEP.name, {}, float(found.step)),
                        ],
                        replace=True,
                    )
            if self._in_episode.get(rank):
                return
            self._in_episode[rank] = True
            self.episodes += 1
            self.episode = found
        self._react(found)

    def _react(self, found: FirstNonFinite) -> None:
        reaction = self.reaction
        if reaction == "warn":
            log.warning(
                "streamwatch: non-finite value first at %s (once per episode of non-finite steps; "
                "observe(on_nonfinite=...) picks another reaction)",
                found.describe(),
            )
        elif reaction == "raise":
            with self._lock:
                self._verdicts.append(found)
        elif callable(reaction):
            try:
                reaction(found)
            except Exception as exc:  # stops only the callback: counted, warned, raised at close()
                self.reaction = None
                self.failures.append((f"on_nonfinite callback {reaction!r}", exc))

    @property
    def pending(self) -> bool:
        """Whether a ``"raise"`` verdict waits for the training thread (a cheap read, no lock)."""
        return bool(self._verdicts)

    def take_verdict(self) -> FirstNonFinite | None:
        """The oldest episode's value not yet raised (``"raise"``), or None."""
        with self._lock:
            return self._verdicts.popleft() if self._verdicts else None

    def __repr__(self) -> str:
        return f"<NonFiniteTracker first={self.first} episodes={self.episodes}>"


# -- the training thread's sentinel ---------------------------------------------------------------------


class Sentinel:
    """A finite check of the loss (and optionally the global gradient norm) on every step.

    :meth:`check` returns the steps whose check failed, as soon as that is known: at once on the CPU (or
    for a Python number), later on CUDA. There a step leaves a *probe* (the loss itself, a view: no
    kernel; with ``grad_norm``, the gradients' largest magnitude too), non-finite exactly when the step
    failed. Probes are checked in batches of ``batch`` steps (or the steps of ``batch_seconds``, whichever
    is first): one ``stack`` of their values, copied without blocking into a pinned ring slot (float64)
    and read once its event has completed (``event.query()``: the training thread never waits) — two
    launches per batch, not per step. When every slot is still in flight (the host more than ``slots``
    batches ahead of the device), the batch is folded into a carry on the device (the largest
    magnitude: finite exactly when every value is) and the whole range is reported at the step of its
    first member. :meth:`drain` (at ``close()``) checks what is left, waiting for the device.

    The values read also give LossSpike's line a device loss: a finite loss past :attr:`alarm`'s line
    (a probe of the loss alone, not carried) is kept in :meth:`take_crossed`, and the boundary sends
    the step log at once, as it does for a CPU loss past the line (docs/detectors.md, *A spike is sent
    at once*).

    Example:
        >>> sentinel = Sentinel(grad_norm=False)
        >>> sentinel.check(0, 0.5, ()), sentinel.check(1, float("nan"), ())
        ([], [1])
        >>> sentinel.check(2, torch.tensor(1.0), ()), sentinel.trips
        ([], 1)
    """

    def __init__(self, grad_norm: bool, slots: int = 8, batch: int = 16, batch_seconds: float = 0.05) -> None:
        self.grad_norm = grad_norm
        self.slots = slots
        self.batch = batch
        self.batch_seconds = batch_seconds
        self.trips = 0
        # (slots, batch + 1) float64 (any probe's value exactly, a float64 gradient's 1e300 too): a batch's
        # values, after a carry's
        self._pinned: torch.Tensor | None = None
        self._events: list[Any] = []
        self._free: list[int] = []
        self._pending: collections.deque[tuple[int, list[int]]] = collections.deque()  # (slot, steps)
        self._probes: list[tuple[int, torch.Tensor]] = []  # (step, probe) not yet checked
        self._since = 0.0  # when the first of ``_probes`` came
        self._carry: torch.Tensor | None = None  # (1,) on the device: the carried steps' largest |value|
        self._carry_first = 0
        self._found: list[int] = []  # failed steps a quiet step's poll read, for the next check
        self._crossed: list[int] = []  # steps whose device loss passed the alarm's line (take_crossed)
        self._no_line: set[int] = set()  # steps whose probe is not the loss alone (or a carry): no line
        self.memory: GraphMemory | None = None
        """The Watch's account of values CUDA graphs overwrote: a kept probe is copied once one was
        (``_cudagraphs``); None: kept as a view."""
        self.alarm: Any = None
        """The detectors' alarm (``_guard.Alarm``), whose ``line`` a device loss is compared with when its
        batch is read; None: no comparison."""
        self.grads_tripped = False
        """Whether the last :meth:`check` tripped on its gradients (CPU), its loss being finite or not
        checked: then what went bad is the gradient, not the loss."""
        self.idle = not grad_norm
        """Whether a step with a finite CPU loss (or none) has nothing for :meth:`check` to do: no
        gradient-norm check, no device probe waiting or in flight (an attribute, kept by :meth:`check`,
        :meth:`drain` and :meth:`set_grad_norm`: read on every step boundary)."""

    @property
    def takes_quiet_probes(self) -> bool:
        """Whether a quiet step may hand this sentinel a device loss (:meth:`probe`) without the full
        boundary: no gradient-norm check, and no failed step read by :meth:`quiet_poll` still to report
        (copies in flight are fine: the quiet step polls them)."""
        return not self.grad_norm and not self._found and not self._crossed

    def quiet_poll(self) -> bool:
        """A quiet step's look at the batches in flight (``event.query()``: never waits): their slots are
        freed as :meth:`check` would; False when one of them holds a failed step — kept for the next
        :meth:`check`, which the full boundary then runs at once. Without it, each batch's copy made the
        step after it (or a few, until the copy completed) a full boundary."""
        if self._pending:
            self._found.extend(self._poll())
        return not self._found and not self._crossed

    def take_crossed(self) -> list[int]:
        """The steps read since the last call whose device loss passed the alarm's line (training thread).

        Example:
            >>> sentinel = Sentinel(grad_norm=False)
            >>> sentinel.take_crossed()
            []
        """
        crossed, self._crossed = self._crossed, []
        if crossed:
            self._settle()
        return crossed

    def probe(self, step: int, loss: torch.Tensor) -> None:
        """A quiet step's device loss (a 0-d view: no kernel, no sync), checked with its batch."""
        self._push(step, loss)
        self.idle = False

    def set_grad_norm(self, on: bool) -> None:
        """Check the gradients from the next step on, or stop."""
        self.grad_norm = on
        self._settle()

    def _settle(self) -> None:
        self.idle = (
            not self.grad_norm
            and not self._pending
            and not self._probes
            and self._carry is None
            and not self._found
            and not self._crossed
        )

    def check(self, step: int, loss: torch.Tensor | float | None, grads: Iterable[torch.Tensor]) -> list[int]:
        """Check ``step``'s loss (and gradients, if ``grad_norm``); the steps now known to have failed."""
        probes: list[torch.Tensor] = []
        tripped, self._found = self._found, []  # (read by a quiet step's poll)
        if isinstance(loss, torch.Tensor):
            if loss.is_cpu:
                if not math.isfinite(loss.item()):  # a CPU scalar: reading it waits for nothing
                    tripped.append(step)
            else:
                probe = loss.detach().reshape(())
                probes.append(probe if self.memory is None else self.memory.keep(probe))
        elif loss is not None and not math.isfinite(loss):
            tripped.append(step)
        self.grads_tripped = False
        if self.grad_norm:
            probes.extend(self._check_grads(step, grads, tripped))
        if self._pending:  # earlier batches whose copy completed (frees their slots first)
            tripped.extend(self._poll())
        if probes:
            if self.grad_norm:
                self._no_line.add(step)  # (the loss's and the gradients' largest magnitude: no line)
            self._push(step, probes[0] if len(probes) == 1 else _largest(probes))
        self._settle()
        return self._count(tripped)

    def drain(self) -> list[int]:
        """Check every probe left and wait for the copies in flight (``close()``: the training is over,
        waiting is allowed); the steps found to have failed."""
        if self._probes:
            self._queue()
        tripped, self._found = self._found, []
        while self._pending or self._carry is not None:
            for slot, _ in self._pending:
                self._wait(self._events[slot])
            tripped.extend(self._poll())
            if self._carry is not None:
                self._queue()
        self._settle()
        return self._count(tripped)

    def _count(self, tripped: list[int]) -> list[int]:
        if tripped:
            tripped = sorted(set(tripped))
            self.trips += len(tripped)
        return tripped

    def _check_grads(
        self, step: int, grads: Iterable[torch.Tensor], tripped: list[int]
    ) -> list[torch.Tensor]:
        """The gradients' largest magnitude per device and dtype: checked at once on the CPU (a trip goes
        to ``tripped``), returned as probes on a device."""
        by_group: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in grads:
            if grad.layout is not torch.strided:  # sparse (an Embedding(sparse=True)): its stored values
                grad = grad._values() if grad.layout is torch.sparse_coo else grad.values()
            if grad.numel():  # (an empty gradient holds nothing to check: its max-norm is an error)
                by_group.setdefault((grad.device, grad.dtype), []).append(grad.detach())
        probes: list[torch.Tensor] = []
        for (device, _), tensors in by_group.items():
            with torch.no_grad():  # the largest |g|, in the gradients' own dtype: finite exactly when
                # every element is, and it cannot overflow (a float16 2-norm does at 65504)
                total = torch.stack(torch._foreach_norm(tensors, math.inf)).amax()
            if device.type != "cpu":
                probes.append(total)
            elif not math.isfinite(total.item()) and step not in tripped:
                tripped.append(step)  # (the loss was finite, or not checked: the gradients tripped)
                self.grads_tripped = True
        return probes

    def _push(self, step: int, probe: torch.Tensor) -> None:
        """Add ``step``'s probe; check the batch when it is full or old enough."""
        now = time.perf_counter()
        if self._pinned is None:  # at the first probe (a warm-up step), not at the first batch's end
            self._pinned, self._events = self._allocate()
            self._free = list(range(self.slots))
        if not self._probes:
            self._since = now
        self._probes.append((step, probe))
        if len(self._probes) >= self.batch or now - self._since >= self.batch_seconds:
            self._queue()

    def _queue(self) -> None:
        """The waiting probes' values in one ``stack`` (after the carry), copied without blocking into a
        free pinned slot with an event; no free slot: folded into the carry."""
        if self._pinned is None:
            self._pinned, self._events = self._allocate()
            self._free = list(range(self.slots))
        batch, self._probes = self._probes, []
        if batch and self.memory is not None:  # (probes a later pass of CUDA graphs overwrote: unread)
            kept = [(step, probe) for step, probe in batch if not overwritten(probe)]
            if len(kept) < len(batch):
                self.memory.found(len(batch) - len(kept), "losses the sentinel kept")
                batch = kept
        steps = [step for step, _ in batch]
        parts: list[torch.Tensor] = []
        if batch:
            device = batch[0][1].device
            probes = [p if p.device == device else p.to(device, non_blocking=True) for _, p in batch]
            if any(p.dtype != probes[0].dtype for p in probes):  # (a loss whose dtype changed mid-batch)
                probes = [p.float() for p in probes]
            parts.append(torch.stack(probes))
        if self._carry is not None:
            parts.insert(0, self._carry if not parts else self._carry.to(parts[0].device, non_blocking=True))
            steps.insert(0, self._carry_first)
            self._no_line.add(self._carry_first)  # (a carry's largest magnitude: no line)
        if not parts:
            return
        values = parts[0] if len(parts) == 1 else torch.cat(parts)  # (cat promotes the dtypes)
        if not self._free:
            if self._carry is None:
                self._carry_first = steps[0]
            self._no_line.difference_update(steps)
            self._carry = values.abs().amax().reshape(1)  # (amax keeps a NaN)
            return
        self._carry = None
        slot = self._free.pop()
        self._pinned[slot, : len(steps)].copy_(values, non_blocking=True)
        self._record(self._events[slot], values.device)  # after the copy, on its stream
        self._pending.append((slot, steps))

    def _allocate(self) -> tuple[torch.Tensor, list[Any]]:
        """The ring: ``slots`` pinned rows of values and an event per slot (the device seam tests replace)."""
        return torch.zeros((self.slots, self.batch + 1), dtype=torch.float64, pin_memory=True), [
            torch.cuda.Event() for _ in range(self.slots)
        ]

    def _record(self, event: Any, device: torch.device) -> None:
        event.record(torch.cuda.current_stream(device))

    def _wait(self, event: Any) -> None:
        event.synchronize()

    def _poll(self) -> list[int]:
        """Read the slots whose copy completed (in order); the steps whose value is non-finite. Finite
        losses past the alarm's line go to :meth:`take_crossed`."""
        found: list[int] = []
        pinned = self._pinned
        line = math.inf if self.alarm is None else self.alarm.line
        while self._pending and pinned is not None:
            slot, steps = self._pending[0]
            if not self._events[slot].query():
                break
            self._pending.popleft()
            values = pinned[slot, : len(steps)].tolist()
            for step, value in zip(steps, values, strict=True):
                if not math.isfinite(value):
                    found.append(step)
                elif value > line and step not in self._no_line:
                    self._crossed.append(step)
            if self._no_line:
                self._no_line.difference_update(steps)
            self._free.append(slot)
        return found


def _largest(probes: list[torch.Tensor]) -> torch.Tensor:
    """One probe for several (a loss and gradients; gradients on several devices or in several dtypes):
    their largest magnitude, non-finite exactly when one of them is (``amax`` propagates NaN)."""
    device = probes[0].device
    on_one = [p if p.device == device else p.to(device, non_blocking=True) for p in probes]
    return torch.stack(on_one).abs().amax()


# -- argument checks --------------------------------------------------------------------------------------


def check_on_nonfinite(value: object) -> Reaction:
    """``observe(on_nonfinite=...)``: ``"warn"``, ``"raise"`` or a callable.

    Example:
        >>> check_on_nonfinite("raise")
        'raise'
    """
    if value in ("warn", "raise") or callable(value):
        return value
    raise ValueError(
        f'Expected `on_nonfinite` to be "warn", "raise" or a callable taking a '
        f"streamwatch.FirstNonFinite, got {value!r}"
    )


def check_escalate(value: object) -> int:
    """``observe(escalate=...)``: steps sampled in full after the sentinel trips, an integer >= 0
    (0: never escalate).

    Example:
        >>> check_escalate(50)
        50
    """
    why = "steps sampled in full after the sentinel trips; 0 turns escalation off"
    return check_int(value, "escalate", minimum=0, note=why)


def check_sentinel(value: object) -> frozenset[str]:
    """``observe(sentinel=...)``: a collection of :data:`SENTINEL_CHECKS` (empty: no sentinel).

    Example:
        >>> sorted(check_sentinel(("loss", "grad_norm")))
        ['grad_norm', 'loss']
    """
    message = (
        f"Expected `sentinel` to be a collection of {SENTINEL_CHECKS} (() turns the per-step check off), "
        f"got {value!r}"
    )
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ValueError(message)
    try:
        chosen = frozenset(value)
    except TypeError:
        raise ValueError(message) from None
    if chosen - set(SENTINEL_CHECKS):
        raise ValueError(message)
    return chosen
