"""Step records: the per-step buffer on the training thread, and what the worker receives.

The training thread appends summary rows to a :class:`StepBuffer` while hooks fire. CPU tensors go
through the fused kernel (``_kernel.py``), which writes each row straight into the step's preallocated
float64 host table: at the step boundary there is nothing left to copy. Rows computed with torch ops
(CUDA, half precision, tensor subclasses, compiled code) are 0-d device tensors; :meth:`StepBuffer.seal`
stacks them into one tensor and makes their only copy: on CPU a plain host tensor; on CUDA an
asynchronous copy on a side stream into a pinned host slot, with an event recorded after it, so the
training thread never waits for the device. The result is a :class:`PendingRecord` — sent through the
channel — which the worker turns into a :class:`StepRecord` (waiting on the event on *its* thread, then
merging and deriving with numpy).

A pinned slot is reused only after the worker released it; when every slot is in flight the step is
dropped and counted (the overflow policy of the channel decides about records already queued).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np
import torch

from streamwatch._kernel import NSTATS, FusedKernel, assembler
from streamwatch._schema import COLUMN
from streamwatch._summary import COLUMNS, Raw, Row, derive, finalize, merged

_ROW_BYTES = NSTATS * 8  # one float64 row of the host table

__all__ = ["Layout", "PendingRecord", "Sample", "SeriesKey", "SlotPool", "StepBuffer", "StepRecord"]


class SeriesKey(NamedTuple):
    """Which tensor a summary row describes. Becomes Prometheus labels.

    Attributes:
        phase: ``"train"`` or ``"eval"``.
        layer: the module's qualified name (``"encoder.0.fc"``; ``""`` for the root module).
        kind: ``activation``, ``output_grad``, ``input``, ``input_grad``, ``param``, ``param_grad`` or
            ``update``.
        name: the parameter name (``weight``/``bias``) or the position of a leaf in a tuple/dict output
            (``"0"``, ``"logits"``); ``""`` for a single tensor.
    """

    phase: str
    layer: str
    kind: str
    name: str

    def labels(self) -> dict[str, str]:
        """Prometheus labels: ``name`` is ``param`` for parameter kinds and ``index`` for tensor leaves.

        Example:
            >>> SeriesKey("train", "fc", "param_grad", "weight").labels()
            {'phase': 'train', 'layer': 'fc', 'kind': 'param_grad', 'param': 'weight', 'index': ''}
        """
        is_param = self.kind in _PARAM_KINDS
        return {
            "phase": self.phase,
            "layer": self.layer,
            "kind": self.kind,
            "param": self.name if is_param else "",
            "index": "" if is_param else self.name,
        }


_PARAM_KINDS = frozenset({"param", "param_grad", "update"})


SKIPPED_UPDATE = "_skipped_update"
"""A step scalar for :meth:`PendingRecord.resolve` only (never in a record): nonzero when a
``GradScaler`` found Inf/NaN gradients and a fused optimizer's step, called anyway, changed nothing. The
flag stays on the device (no host sync); the worker drops the step's update rows when it reads it."""


def _without_updates(
    keys: tuple[Any, ...],
    table: np.ndarray,
    order: tuple[int, ...],
    extras: dict[tuple[Any, str], np.ndarray],
) -> tuple[tuple[Any, ...], np.ndarray, tuple[int, ...], dict[tuple[Any, str], np.ndarray]]:
    """The record's rows and extras without its ``update`` ones.

    Example:
        >>> keys = (SeriesKey("train", "fc", "param", "weight"), SeriesKey("train", "fc", "update", "weight"))
        >>> extras = {(keys[1], "h"): np.ones(1)}
        >>> k, t, o, e = _without_updates(keys, np.arange(4.0).reshape(2, 2), (0, 1), extras)
        >>> [key.kind for key in k], t.tolist(), o, e
        (['param'], [[0.0, 1.0]], (0,), {})
    """
    keep = [i for i, key in enumerate(keys) if key.kind != "update"]
    if len(keep) == len(keys):
        return keys, table, order, extras
    kept = table[keep]
    kept.setflags(write=False)
    return (
        tuple(keys[i] for i in keep),
        kept,
        tuple(order[i] for i in keep) if len(order) == len(keys) else order,
        {extra: value for extra, value in extras.items() if extra[0].kind != "update"},
    )


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One sampled step, as the worker's pipelines see it. Immutable, host-only (no autograd graph).

    Attributes:
        step: the step index (``watch.step()`` calls before this one).
        time: wall-clock seconds (``time.time()``) at the step boundary.
        rank: the process rank (0 without torch.distributed).
        keys: one :class:`SeriesKey` per table row, unique.
        table: ``(len(keys), len(COLUMNS))`` float64, the columns of ``streamwatch._schema.COLUMNS``
            (count, sum, sumsq, min, max, zeros, nonfinite, units, dead, ...); read them by name with
            :meth:`column` and :meth:`stat`. Read-only.
        scalars: step-level values: ``loss``, ``lr/<group>``, ``batch_size``, ``step_seconds``,
            ``samples_per_second``, ``correct``, ``total``, ``accuracy`` — whichever were given — and
            those of opt-in metrics (``eval/accuracy``, ``eval/loss``, ``hessian_max_eig``), and the
            host wall time of the step's parts (``part/data_wait``, ``part/forward``, ``part/backward``,
            ``part/optimizer``).
        extras: values of opt-in tensor metrics, by ``(key, stat)``: a float64 vector (length 1 for a
            scalar such as ``spectral_norm`` or ``cosine``; the bucket counts for ``histogram``).
        edges: what it takes to render the extras without the metric objects: the ``histogram``
            buckets' upper bounds (Prometheus ``le``, ascending, the last ``inf``) by tap kind, aligned
            with the counts after the non-finite bucket. The same mapping for every record of a run.
        order: each row's position in the step's execution (forward, then backward, then the optimizer,
            as the hooks fired; a key summarised several times in a step takes its first position), one
            integer per row; smaller ran earlier. Empty: the rows are in execution order (records built
            by hand, run files written before it existed). Read it through :meth:`execution_order`.
        start_step: the first step of the run that sent it (``observe(start_step=)``: 0, or the step a
            resumed run went on from). A record at that step has nothing unrecorded before it.

    Example:
        >>> from streamwatch.testing import table
        >>> r = StepRecord(3, 0.0, 0, (SeriesKey("train", "fc", "activation", ""),),
        ...                table(count=4, sum=2.0, sumsq=6.0, min=-1.0, max=2.0, zeros=1), {"loss": 0.5})
        >>> round(float(r.stat("l2")[0]) ** 2, 9), float(r.column("zeros")[0])
        (6.0, 1.0)
    """

    step: int
    time: float
    rank: int
    keys: tuple[SeriesKey, ...]
    table: np.ndarray
    scalars: Mapping[str, float] = field(default_factory=dict)
    extras: Mapping[tuple[SeriesKey, str], np.ndarray] = field(default_factory=dict)
    edges: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    order: tuple[int, ...] = ()
    start_step: int = 0

    def execution_order(self) -> np.ndarray:
        """Each row's position in the step's execution (:attr:`order`, or the row order without one).

        Example:
            >>> from streamwatch.testing import table
            >>> keys = tuple(SeriesKey("train", layer, "activation", "") for layer in "ab")
            >>> StepRecord(0, 0.0, 0, keys, table(2), order=(5, 2)).execution_order().tolist()
            [5, 2]
        """
        if len(self.order) == len(self.keys):
            return np.asarray(self.order, dtype=np.int64)
        return np.arange(len(self.keys), dtype=np.int64)

    def column(self, name: str) -> np.ndarray:
        """One column of :attr:`table` by name (see ``streamwatch._schema.COLUMNS``)."""
        return self.table[:, COLUMN[name]]

    def stat(self, name: str) -> np.ndarray:
        """A column or a derived statistic (mean, std, var, l2, rms, absmax, zero_fraction, ...: the names
        of ``streamwatch._schema.DERIVED``)."""
        if name in COLUMN:
            return self.column(name)
        return derive(self.table)[name]

    def rows(self, kind: str | None = None, phase: str | None = None) -> list[int]:
        """Indices of the rows of one kind and/or phase."""
        return [
            i
            for i, key in enumerate(self.keys)
            if (kind is None or key.kind == kind) and (phase is None or key.phase == phase)
        ]


class Sample(NamedTuple):
    """One series' latest value: what ``/metrics`` serves for it (identity labels such as rank aside).

    Example:
        >>> Sample("streamwatch_loss", {"phase": "train"}, 0.25)
        Sample(name='streamwatch_loss', labels={'phase': 'train'}, value=0.25)
    """

    name: str
    labels: Mapping[str, str]
    value: float


_NO_EDGES: Mapping[str, tuple[float, ...]] = MappingProxyType({})

_PARTS = ("part/data_wait", "part/forward", "part/backward", "part/optimizer")


def step_parts(marks: Sequence[float], out: dict[str, float]) -> dict[str, float]:
    """A sampled step's parts from its host clock marks (``StepTimes.marks``: the previous step's end,
    forward start and end, optimizer start and end, this step's end; 0 where not seen), in seconds, into
    ``out`` (a record's scalars): data wait (previous end → first training forward), forward, backward
    (forward end → optimizer step, or → the step's end without one), optimizer. Computed on the worker:
    the training thread only hands the marks over.

    Example:
        >>> step_parts((1.0, 1.5, 2.0, 3.0, 3.25, 3.5), {"loss": 2.0})  # doctest: +NORMALIZE_WHITESPACE
        {'loss': 2.0, 'part/data_wait': 0.5, 'part/forward': 0.5, 'part/backward': 1.0,
         'part/optimizer': 0.25}
        >>> step_parts((1.0, 1.5, 2.0, 0.0, 0.0, 3.5), {})  # no optimizer seen: backward ends with the step
        {'part/data_wait': 0.5, 'part/forward': 0.5, 'part/backward': 1.5}
    """
    step_end, forward_start, forward_end, optimizer_start, optimizer_end, now = marks
    if step_end and forward_start:
        out[_PARTS[0]] = forward_start - step_end
    if forward_start and forward_end:
        out[_PARTS[1]] = forward_end - forward_start
    if forward_end:
        out[_PARTS[2]] = (optimizer_start or now) - forward_end
    if optimizer_start and optimizer_end:
        out[_PARTS[3]] = optimizer_end - optimizer_start
    return out


_new_record = tuple.__new__  # (a PendingRecord from a tuple of its fields, in one C call)


class SlotPool:
    """Pinned host slots for CUDA step copies, reused only after the worker released them.

    Thread-safe: ``acquire`` runs on the training thread, ``release`` on the worker.
    """

    def __init__(self, slots: int) -> None:
        self._free: list[torch.Tensor | None] = [None] * slots
        self._lock = threading.Lock()
        self.exhausted = 0  # steps dropped because every slot was still in flight

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        with self._lock:
            if not self._free:
                self.exhausted += 1
                return None
            slot = self._free.pop()
        if slot is None or slot.numel() < numel or slot.dtype != dtype:
            slot = torch.empty(max(numel, 256), dtype=dtype, pin_memory=True)
        return slot

    def release(self, slot: torch.Tensor) -> None:
        with self._lock:
            self._free.append(slot)


class PendingRecord(NamedTuple):
    """A sealed step in flight to the worker: host rows, device rows (copied or being copied), metadata.

    Rows summarised by the fused CPU kernel are already in ``host`` (float64, one line per row, the
    kernel wrote them in place); rows summarised with torch ops (CUDA, half precision, tensor subclasses,
    compiled code) are in ``data``, stacked once at the step boundary. A named tuple: :meth:`StepBuffer.seal`
    makes one with a single C call (``tuple.__new__``), no Python frame on a cold step boundary.
    """

    step: int
    time: float
    rank: int
    keys: list[Hashable]
    counts: list[int]
    units: list[int]
    samples: list[int]
    host: np.ndarray  # (>= rows, NSTATS) float64: the fused kernel's rows; other lines are unused
    host_units: list[tuple[int, int]]  # (first row of a key, offset in ``arena``) of fused unit-rows
    arena: np.ndarray  # active samples per unit of fused unit-rows, ``units[row]`` values from offset
    device_rows: list[int]  # rows whose device scalars are in ``data``, in order
    unit_rows: list[int]  # device rows (first occurrence of a key) whose per-unit counts follow in ``data``
    extra_layout: list[tuple[tuple[Any, str], int]]  # opt-in metric values at the end of ``data``, in order
    scalar_names: tuple[str, ...]  # device step scalars after the device rows (loss, correct)
    host_scalars: dict[str, float]
    data: torch.Tensor  # flat: device rows x 5 (6) stats, step scalars, then per-unit counts per unit-row
    nonfinite_counted: bool  # exact non-finite counts asked for (fused rows always have them; else a flag)
    edges: Mapping[str, tuple[float, ...]] = _NO_EDGES  # StepRecord.edges
    event: Any = None  # torch.cuda.Event on CUDA
    release: Callable[[], None] | None = None  # gives the pinned slot back to its pool
    order: Sequence[int] = ()  # each row's position in the step's execution
    start_step: int = 0  # StepRecord.start_step
    marks: Sequence[float] = ()  # a sampled step's clock marks (step_parts), its parts made here

    def resolve(self) -> StepRecord:
        """Wait for the copy (on the calling thread — the worker's), then merge and derive."""
        if self.event is not None:
            self.event.synchronize()
        data = self.data
        flat = _NO_DEVICE_VALUES if data is _NO_DEVICE_DATA else data.numpy().astype(np.float64, copy=True)
        if self.release is not None:
            self.release()
        n = len(self.keys)
        layout = layout_of(self.keys)
        if _ASSEMBLE is not None and len(self.host) >= n:  # the table in one C call, numpy's result exactly
            table = np.empty((n, len(COLUMNS)))
            nstats = NSTATS if self.nonfinite_counted else NSTATS - 1
            start = _ASSEMBLE(
                table,
                self.host,
                self.counts,
                self.units,
                self.samples,
                self.host_units,
                self.arena,
                self.nonfinite_counted,
                flat,
                self.device_rows,
                self.unit_rows,
                len(self.device_rows) * nstats + len(self.scalar_names),
            )
            keys, table = merged(layout, table, self.nonfinite_counted)
        else:
            keys, table, start = self._finalize(flat, layout)
        table.setflags(write=False)
        order = layout.ordered(self.order, len(keys))
        scalars = dict(self.host_scalars)
        if self.marks:
            step_parts(self.marks, scalars)
        nd = len(self.device_rows) * (NSTATS if self.nonfinite_counted else NSTATS - 1)
        for i, name in enumerate(self.scalar_names):
            scalars[name] = float(flat[nd + i])
        if "correct" in scalars and scalars.get("total"):
            scalars["accuracy"] = scalars["correct"] / scalars["total"]
        extras: dict[tuple[Any, str], np.ndarray] = {}
        for extra, length in self.extra_layout:  # opt-in metric values, after everything else
            value = flat[start : start + length]
            value.setflags(write=False)
            extras[extra] = value
            start += length
        if scalars.pop(SKIPPED_UPDATE, 0.0):  # the step did not happen: its Δ = 0 is no update
            keys, table, order, extras = _without_updates(keys, table, order, extras)
        return StepRecord(
            self.step,
            self.time,
            self.rank,
            keys,  # type: ignore[arg-type]
            table,
            scalars,
            extras,
            self.edges,
            order,
            self.start_step,
        )

    def _finalize(self, flat: np.ndarray, layout: Layout) -> tuple[tuple[Hashable, ...], np.ndarray, int]:
        """The table with numpy (device rows; the reference for the C path): ``(keys, table, where the
        extras start in flat)``."""
        n = len(self.keys)
        nstats = NSTATS if self.nonfinite_counted else NSTATS - 1
        values = self.host[:n]
        if len(values) < n:  # the table only grows for fused rows; device rows need their lines too
            values = np.concatenate([values, np.empty((n - len(values), NSTATS))])
        dead, active = np.full((2, n), np.nan)
        nd = len(self.device_rows)
        if nd:
            rows = np.asarray(self.device_rows, dtype=np.intp)
            values[rows, :nstats] = flat[: nd * nstats].reshape(nd, nstats)
        units = np.asarray(self.units, dtype=np.float64)
        if self.host_units:  # each fused unit-row's counts sit in the arena: one reduceat for all
            # (offsets were handed out in this order, so they increase and the segments are adjacent)
            pairs = np.asarray(self.host_units, dtype=np.intp)
            rows, offsets = pairs[:, 0], pairs[:, 1]
            vectors = self.arena[: offsets[-1] + int(units[rows[-1]])]
            dead[rows] = np.add.reduceat(vectors == 0, offsets, dtype=np.float64)
            active[rows] = np.add.reduceat(vectors, offsets)
        start = nd * nstats + len(self.scalar_names)
        if self.unit_rows:  # each device unit-row's activity counts follow the scalars, in row order
            rows = np.asarray(self.unit_rows, dtype=np.intp)
            lengths = units[rows].astype(np.intp)  # >= 1: a unit-row has units
            vectors = flat[start : start + int(lengths.sum())]
            start += int(lengths.sum())
            offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
            dead[rows] = np.add.reduceat(vectors == 0, offsets, dtype=np.float64)
            active[rows] = np.add.reduceat(vectors, offsets)
        raw = Raw(
            layout,
            np.asarray(self.counts, dtype=np.float64),
            units,
            values,
            dead,
            self.nonfinite_counted,
            np.asarray(self.samples, dtype=np.float64),
            active,
        )
        keys, table = finalize(raw)
        return keys, table, start


class Layout(tuple):  # type: ignore[type-arg]
    """A record's keys, as the worker receives them step after step: a tuple that hashes once.

    Every stage after the channel keys a cache or a dict by the record's keys (the series store's
    latest record per layout, the detectors' and the non-finite tracker's row selections); hashing a
    tuple of a few hundred keys each time costs microseconds per stage. A layout remembers its hash,
    whether its keys are unique, and the last execution order it was resolved with. It equals (and
    hashes like) the plain tuple of its keys.

    Example:
        >>> keys = (SeriesKey("train", "fc", "activation", ""),)
        >>> layout = Layout(keys)
        >>> layout == keys, hash(layout) == hash(keys), layout.unique
        (True, True, True)
    """

    _hash: int
    unique: bool
    """No two keys are equal (nothing to merge)."""
    _order: tuple[Sequence[int], tuple[int, ...]]
    """The last execution order resolved with this layout, and :func:`_merged_order` of it."""

    def __new__(cls, keys: Any) -> Layout:
        self = super().__new__(cls, keys)
        self._hash = tuple.__hash__(self)
        self.unique = len(set(self)) == len(self)
        self._order = ([], ())
        return self

    def __hash__(self) -> int:
        return self._hash

    def ordered(self, order: Sequence[int], merged: int) -> tuple[int, ...]:
        """:func:`_merged_order` of these keys, remembered for the last ``order`` (a step's order repeats
        with its layout; ``order`` is a handed-over list, never changed after)."""
        seen, result = self._order
        if order != seen:
            result = _merged_order(self, order, merged)
            self._order = (order, result)
        return result

    def __reduce__(self) -> tuple[Any, ...]:
        return (tuple, (tuple(self),))  # copies and pickles are plain tuples


_LAYOUTS: list[tuple[list[Hashable], Layout]] = []
"""The keys of the last few distinct steps resolved (a training thread's lists) and their layouts, the
latest first: a run's layouts repeat (a step with weights and updates every 10th sampled step, the other
steps without); several watches at once only make more of them."""

_LAYOUTS_KEPT = 4


def layout_of(keys: list[Hashable]) -> Layout:
    """The :class:`Layout` of a step's keys: a recent step's when they are the same keys (a comparison
    of the same key objects, one by one), else a new one.

    Example:
        >>> keys = [SeriesKey("train", "fc", "activation", "")]
        >>> layout_of(keys) is layout_of(list(keys))
        True
    """
    global _LAYOUTS
    layouts = _LAYOUTS
    for entry in layouts:
        if keys == entry[0]:  # a list of another length differs at once
            return entry[1]
    layout = Layout(keys)
    _LAYOUTS = [(keys, layout), *layouts[: _LAYOUTS_KEPT - 1]]  # one assignment: safe across threads
    return layout


def _merged_order(keys: Sequence[Hashable], order: Sequence[int], merged: int) -> tuple[int, ...]:
    """The execution position of each row after :func:`finalize` merged equal keys (each key keeps its
    first row's place and position; keys are merged in order of first appearance, as ``finalize`` does);
    ``()`` when the rows are in execution order already (the common case, and what a run file holds)."""
    if len(order) != len(keys):  # no explicit order: the rows are in execution order
        return ()
    if merged == len(keys):
        if order == list(range(len(order))):  # the common case, compared at C speed
            return ()
        positions = tuple(order)
    else:
        first: dict[Hashable, int] = {}
        for key, position in zip(keys, order, strict=True):
            first.setdefault(key, position)
        positions = tuple(first.values())
    # rows already in execution order need no explicit order: () (as a run file reads them back)
    return () if all(b > a for a, b in itertools.pairwise(positions)) else positions


_ASSEMBLE = assembler()
"""The compiled assembly of a step's summary table (None: numpy, ``PendingRecord._finalize``)."""

_CPU = torch.device("cpu")

_NO_DEVICE_DATA = torch.empty(0, dtype=torch.float64)
"""A record's ``data`` when nothing came from a device: shared, never written (the worker copies it)."""

_NO_DEVICE_VALUES = np.empty(0, dtype=np.float64)
_NO_DEVICE_VALUES.setflags(write=False)
"""What the worker reads for :data:`_NO_DEVICE_DATA` (nothing to copy)."""


class _Slab:
    """Each step's fresh host table and arena (float64, zeroed), cut from larger blocks, with their
    addresses for the kernel. A block of ``PIECES`` is allocated and cut into views at once, so a step
    takes its ready views and addresses from a list in one call: on a step that evicts the interpreter's
    caches, a fresh numpy array or view and its address cost microseconds each (~30 µs a step,
    allocated per step).

    A piece is never handed out twice; a block lives as long as a record holds a piece of it. Asking for
    other sizes starts a new block (callers round their sizes up and keep the largest: rarely).

    Example:
        >>> slab = _Slab()
        >>> table, table_address, arena, arena_address = slab.take(2, 3)
        >>> table.shape, float(table.sum()), arena.tolist(), arena_address - table_address
        ((2, 6), 0.0, [0.0, 0.0, 0.0], 96)
        >>> slab.take(2, 3)[1] - table_address  # the next piece: (2 * 6 + 3) * 8 bytes on
        120
    """

    PIECES = 64
    __slots__ = ("_pieces", "_sizes")

    def __init__(self) -> None:
        self._sizes = (0, 0)
        self._pieces: list[tuple[np.ndarray, int, np.ndarray, int]] = []

    def take(self, rows: int, units: int) -> tuple[np.ndarray, int, np.ndarray, int]:
        """A fresh zeroed ``(rows, NSTATS)`` table and ``(units,)`` arena, each with the address of its
        first value."""
        pieces = self._pieces
        if not pieces or (rows, units) != self._sizes:
            n, cells = self.PIECES, rows * NSTATS
            block = np.zeros((n, cells + units))
            base, stride = int(block.ctypes.data), block.strides[0]
            self._pieces = pieces = [
                (
                    block[i, :cells].reshape(rows, NSTATS),
                    base + i * stride,
                    block[i, cells:],
                    base + i * stride + cells * 8,
                )
                for i in range(n - 1, -1, -1)
            ]
            self._sizes = (rows, units)
        return pieces.pop()


def _capacity(n: int, least: int) -> int:
    """``n`` rounded up to a power of two, at least ``least`` (table rows, arena values)."""
    return max(least, 1 << (n - 1).bit_length()) if n > 1 else least


class StepBuffer:
    """Rows of the current step, appended by hooks on the training thread (no locks: one thread).

    Two kinds of rows share one row order: *host rows*, which the fused CPU kernel writes straight into
    a preallocated float64 table (:meth:`add_host`), and *device rows* of 0-d tensors from the torch
    path (:meth:`add`), stacked once at :meth:`seal`. Rows with equal keys are kept apart here and
    merged on the worker; per-unit activity counts of a repeated key are added here so dead units and
    activation rates stay exact.
    """

    __slots__ = (
        "_arena_address",
        "_arena_used",
        "_host_address",
        "_rows",
        "_slab",
        "_units",
        "arena",
        "counts",
        "device",
        "device_rows",
        "extras",
        "host",
        "host_units",
        "keys",
        "latest",
        "order",
        "samples",
        "unit_counts",
        "units",
    )

    keys: list[Hashable]
    counts: list[int]
    units: list[int]
    samples: list[int]
    device_rows: dict[int, list[torch.Tensor]]  # row -> its device scalars, in row order
    extras: dict[tuple[Hashable, str], torch.Tensor]  # opt-in metric values by (key, stat); last one wins
    # key -> (first row, its per-unit counts: a device tensor, or an offset into the fused rows' arena)
    unit_counts: dict[Hashable, tuple[int, torch.Tensor | int]]
    latest: dict[Hashable, int]  # row index of replaceable keys
    order: list[int]  # each row's position in the step's execution (explicit: rows may be laid out ahead)
    device: torch.device | None

    def __init__(self, rows: int = 64, units: int = 4096) -> None:
        self._slab = _Slab()  # each step's host table and arena are cut from it
        # Sizes of the next table and arena: the largest a step needed so far, rounded up (a scalar
        # record's empty step does not shrink them, so the next sampled step does not grow them).
        self._rows = _capacity(rows, 16)
        self._units = _capacity(units, 64)
        # the host table, and the arena: per-unit active samples
        self.host, self._host_address, self.arena, self._arena_address = self._slab.take(
            self._rows, self._units
        )
        self._arena_used = 0
        self.clear()

    def _append(self, key: Hashable, count: int, replace: bool) -> int | None:
        """A new row's index, or the index to overwrite (``replace`` and the key was seen)."""
        if replace:
            index = self.latest.get(key)
            if index is not None:
                self.counts[index] = count
                return index
            self.latest[key] = len(self.keys)
        self.order.append(len(self.order))
        self.keys.append(key)
        self.counts.append(count)
        self.units.append(0)
        self.samples.append(0)
        return None

    def add(self, key: Hashable, count: int, row: Row, replace: bool = False) -> None:
        """Append one row summarised with torch ops; with ``replace``, a later row of the same key
        overwrites the earlier one (accumulated gradients: the last, complete one counts) instead of
        merging."""
        index = self._append(key, count, replace)
        if index is not None:
            self.device_rows[index] = row.scalars
            return
        index = len(self.keys) - 1
        self.device_rows[index] = row.scalars
        if self.device is None:
            self.device = row.scalars[0].device
        counts = row.unit_counts
        if counts is None:
            return
        seen = self.unit_counts.get(key)
        if seen is None:
            self.unit_counts[key] = (index, counts)
        elif isinstance(seen[1], torch.Tensor) and seen[1].shape == counts.shape:
            self.unit_counts[key] = (seen[0], seen[1] + counts)
        else:  # the same key with another unit count (a module reused on other shapes): not comparable
            return
        self.units[index] = counts.numel()
        self.samples[index] = row.samples

    def add_host(
        self,
        kernel: FusedKernel,
        key: Hashable,
        x: torch.Tensor,
        *,
        unit_dim: int | None = None,
        bounds: tuple[float, float] | None = None,
        replace: bool = False,
        minus: torch.Tensor | None = None,
    ) -> None:
        """Summarise ``x`` with the fused CPU kernel straight into this step's host table (and its
        per-unit activity into the step's arena): no allocation on this path once shapes repeat.
        With ``minus`` (no units), the row summarises ``x - minus`` without materialising it.

        All or nothing: if the kernel call raises, the step is left as it was before this call (no
        half-written row, no arena range without units) and the error propagates to the hook guard.
        """
        n, arena_used, first_units = len(self.keys), self._arena_used, self.unit_counts.get(key)
        latest, replaced = self.latest.get(key), None
        if replace and latest is not None:
            replaced = (self.counts[latest], self.device_rows.get(latest))
        try:
            self._add_host(kernel, key, x, unit_dim, bounds, replace, minus)
        except BaseException:
            del self.keys[n:], self.counts[n:], self.units[n:], self.samples[n:], self.order[n:]
            if self._arena_used != arena_used:
                self.arena[arena_used : self._arena_used] = 0
                self._arena_used = arena_used
            if first_units is None:
                self.unit_counts.pop(key, None)
            if latest is None:
                self.latest.pop(key, None)
            elif replaced is not None:
                self.counts[latest] = replaced[0]
                if replaced[1] is not None:
                    self.device_rows[latest] = replaced[1]
            raise

    def _add_host(
        self,
        kernel: FusedKernel,
        key: Hashable,
        x: torch.Tensor,
        unit_dim: int | None,
        bounds: tuple[float, float] | None,
        replace: bool,
        minus: torch.Tensor | None,
    ) -> None:
        index = self._append(key, x.numel(), replace)
        if index is not None:
            self.device_rows.pop(index, None)  # a host row now
            out = self._host_address + index * _ROW_BYTES
            if minus is None:
                kernel.run(x, out)
            else:
                kernel.run_diff(x, minus, out)
            return
        index = len(self.keys) - 1
        if index >= len(self.host):
            self.host = np.concatenate([self.host, np.empty_like(self.host)])
            self._host_address = int(self.host.ctypes.data)
        out = self._host_address + index * _ROW_BYTES
        if minus is not None:
            kernel.run_diff(x, minus, out)
            return
        if unit_dim is None:
            kernel.run(x, out)
            return
        layout = kernel.layout(x.shape, unit_dim)
        n_units = layout[2]
        seen = self.unit_counts.get(key)
        if seen is None:
            offset = self._arena_used
            if offset + n_units > len(self.arena):
                self.arena = np.concatenate([self.arena, np.zeros(max(n_units, len(self.arena)))])
                self._arena_address = int(self.arena.ctypes.data)
            self._arena_used += n_units
            self.unit_counts[key] = (index, offset)
        elif isinstance(seen[1], int) and self.units[seen[0]] == n_units:
            offset = seen[1]  # the kernel adds this call's active samples to the first call's
        else:  # the same key with another unit count: not comparable, summarise without units
            kernel.run(x, out)
            return
        kernel.run(x, out, layout, self._arena_address + offset * 8, bounds)
        self.units[index] = n_units
        self.samples[index] = layout[0]

    def add_extra(self, key: Hashable, stat: str, value: torch.Tensor) -> None:
        """An opt-in metric's value for ``key`` (a 0-d or 1-d tensor on any device; read at the worker,
        never here). A later value of the same ``(key, stat)`` in a step replaces the earlier one."""
        self.extras[(key, stat)] = value.detach()

    def __len__(self) -> int:
        return len(self.keys)

    def seal(
        self,
        step: int,
        rank: int,
        step_scalars: Mapping[str, torch.Tensor],
        host_scalars: dict[str, float],
        nonfinite_counted: bool,
        edges: Mapping[str, tuple[float, ...]] | None = None,
        stream: Any = None,
        pool: SlotPool | None = None,
        start_step: int = 0,
        marks: Sequence[float] = (),
    ) -> PendingRecord | None:
        """Hand the step over: host rows as they are, device rows stacked with one copy; returns None
        if no pinned slot was free. ``marks``: a sampled step's clock marks (:func:`step_parts`).

        Layout of the device copy: every device row's scalars, then the device step scalars, then each
        device unit-row's per-unit activity counts (small vectors: dead units and active pairs are
        counted on the worker). CPU step scalars are read directly (no device to wait for). Everything
        else is handed over as is — numpy work happens on the worker.
        """
        if step_scalars or self.device_rows or self.device is not None or self.extras:
            device = self._device_part(step_scalars, host_scalars, stream, pool)
            if device is None:
                self.clear()
                return None
            host_units, unit_rows, extra_layout, names, host_scalars, data, event, release = device
        else:  # every row the fused kernel's, every scalar read (the common CPU step): nothing to copy
            host_units, unit_rows, extra_layout, names = list(self.unit_counts.values()), [], [], ()
            data, event, release = _NO_DEVICE_DATA, None, None  # (resolve() knows it: nothing to copy)
        record: PendingRecord = _new_record(  # (its fields in order; one C call)
            PendingRecord,
            (
                step,
                time.time(),
                rank,
                self.keys,
                self.counts,
                self.units,
                self.samples,
                self.host,
                host_units,
                self.arena,
                list(self.device_rows),
                unit_rows,
                extra_layout,
                names,
                host_scalars,
                data,
                nonfinite_counted,
                edges if edges is not None else _NO_EDGES,
                event,
                release,
                self.order,
                start_step,
                marks,
            ),
        )
        # The next step's table and arena, fresh (the record keeps these), and its rows: clear() written
        # out (the arena is fresh: nothing to zero)
        if len(self.keys) > self._rows:
            self._rows = _capacity(len(self.keys), 16)
        if self._arena_used > self._units:
            self._units = _capacity(self._arena_used, 64)
        self.host, self._host_address, self.arena, self._arena_address = self._slab.take(
            self._rows, self._units
        )
        self._arena_used = 0
        self.keys, self.order, self.counts, self.units, self.samples = [], [], [], [], []
        self.device_rows, self.extras, self.unit_counts, self.latest = {}, {}, {}, {}
        self.device = None
        return record

    def _device_part(
        self,
        step_scalars: Mapping[str, torch.Tensor],
        host_scalars: dict[str, float],
        stream: Any,
        pool: SlotPool | None,
    ) -> tuple[Any, ...] | None:
        """:meth:`seal` of a step with device rows, device scalars or opt-in metric values: one stack
        of them and its copy (on CUDA into a pinned slot, with an event). Returns the record's fields
        ``(host_units, unit_rows, extra_layout, scalar_names, host_scalars, data, event, release)``;
        None if no pinned slot was free."""
        extra: list[torch.Tensor] = []
        names: list[str] = []
        if step_scalars:
            host_scalars = dict(host_scalars)  # (the caller's stays as it was)
            for name, value in step_scalars.items():
                if value.device.type == "cpu":
                    host_scalars[name] = float(value)  # a CPU tensor: reading it waits for nothing
                else:
                    extra.append(value.detach().reshape(()))
                    names.append(name)
        if self.device_rows or self.device is not None:
            parts = [scalar for scalars in self.device_rows.values() for scalar in scalars] + extra
            vectors = [v for _, v in self.unit_counts.values() if isinstance(v, torch.Tensor)]
            host_units = [(first, v) for first, v in self.unit_counts.values() if isinstance(v, int)]
            unit_rows = [first for first, v in self.unit_counts.values() if isinstance(v, torch.Tensor)]
        else:  # every row from the fused kernel: unit counts are arena offsets
            parts, vectors, unit_rows = extra, [], []
            host_units = list(self.unit_counts.values())  # type: ignore[arg-type]
        device = self.device if self.device is not None else (extra[0].device if extra else None)
        if device is None:
            device = next(iter(self.extras.values())).device if self.extras else _CPU
        if parts:
            # One stack for all device rows (it promotes float16/int64 scalars to float32/float64),
            # one cat for the unit vectors.
            try:
                flat = torch.stack(parts)
            except RuntimeError:  # parts on several devices (model parallel): gather them first
                flat = torch.stack([p.to(device, non_blocking=True) for p in parts])
            if vectors:  # convert the small vectors, never the sums (float64 models keep float64)
                flat = torch.cat([flat, *(v if v.dtype == flat.dtype else v.to(flat.dtype) for v in vectors)])
        elif self.extras:
            flat = torch.empty(0, dtype=torch.float64, device=device)
        else:
            flat = _NO_DEVICE_DATA  # every row on the host, every scalar read (CPU step scalars)
        extra_layout: list[tuple[tuple[Any, str], int]] = []
        if self.extras:  # opt-in metric values: float64 (histogram counts stay exact), after the rest
            values = [
                v.reshape(-1).to(device=device, dtype=torch.float64, non_blocking=True)
                for v in self.extras.values()
            ]
            extra_layout = [(name, v.numel()) for name, v in zip(self.extras, values, strict=True)]
            flat = torch.cat([flat.to(device=device, dtype=torch.float64), *values])
        event = None
        release: Callable[[], None] | None = None
        if flat is not _NO_DEVICE_DATA and flat.device.type == "cuda" and pool is not None:
            slot = pool.acquire(flat.numel(), flat.dtype)
            if slot is None:
                return None
            host = slot[: flat.numel()]
            main = torch.cuda.current_stream(flat.device)
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                host.copy_(flat, non_blocking=True)
                flat.record_stream(stream)
                event = torch.cuda.Event()
                event.record(stream)
            data = host

            def release() -> None:
                pool.release(slot)

        elif flat is _NO_DEVICE_DATA:
            data = flat  # (resolve() recognises it: nothing to copy)
        else:
            data = flat.detach().cpu() if flat.device.type != "cpu" else flat.detach()
        return host_units, unit_rows, extra_layout, tuple(names), host_scalars, data, event, release

    def clear(self) -> None:
        """Forget the current step's rows (the host table is reused)."""
        self.keys, self.order, self.counts, self.units, self.samples = [], [], [], [], []
        self.device_rows, self.extras, self.unit_counts, self.latest = {}, {}, {}, {}
        self.device = None
        if self._arena_used:
            self.arena[: self._arena_used] = 0
            self._arena_used = 0
