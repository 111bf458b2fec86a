"""Step records: what the worker receives from the training thread, and what it makes of it.

The training thread's half lives in ``_buffer.py``: its :class:`~streamwatch._buffer.StepBuffer` collects a
step's summary rows while hooks fire and seals them into a :class:`PendingRecord` — host rows the fused
kernel wrote in place, device rows stacked and copied once (on CUDA into a pinned slot, with an event). This
module holds that hand-over value and the worker's side: :meth:`PendingRecord.resolve` waits for the copy
(on the worker's thread), assembles the step's table (one C call, or numpy's reference) and merges rows of
equal keys into a :class:`StepRecord`, the immutable value every pipeline and sink sees. Also here, because
both halves and the sinks share them: :class:`SeriesKey`, :class:`Sample`, :class:`Layout` and
:func:`step_parts`.

A table's columns are declared once, in ``_schema.py``; records read them by name (:meth:`StepRecord.column`,
:meth:`StepRecord.stat`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np
import torch

from streamwatch._kernel import NSTATS, assembler
from streamwatch._schema import COLUMN
from streamwatch._summary import COLUMNS, Raw, derive, finalize, merged

__all__ = [
    "NO_DEVICE_DATA",
    "NO_EDGES",
    "SKIPPED_UPDATE",
    "STEP_VALUE",
    "Layout",
    "PendingRecord",
    "Sample",
    "SeriesKey",
    "StepRecord",
    "StepScalars",
    "layout_of",
    "step_parts",
]


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


class StepScalars(NamedTuple):
    """One step's step-level values, for a step that sent no record of its own (``StepRecord.steps``).

    Attributes:
        step: the step index.
        time: wall-clock seconds (``time.time()``) at its end.
        scalars: its values, named as a record's (``loss``, ``lr/0``, ``step_seconds``, ``batch_size``,
            ``samples_per_second``, ``log/<name>`` for ``watch.log``).
    """

    step: int
    time: float
    scalars: Mapping[str, float]


STEP_VALUE = "_step/"
"""The prefix of the step scalars a record's device copy carries for its unrecorded steps' device values
(the loss of ``StepScalars`` number ``i`` is ``f"{STEP_VALUE}{i}/loss"``): :meth:`PendingRecord.resolve`
moves them where they belong; never in a record."""


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
        steps: the steps since the previous record that sent none of their own (unsampled steps), each
            with its step-level values (:class:`StepScalars`: loss, learning rates, step time,
            throughput, values given to ``watch.log``), oldest first: with the records, every step of
            the run is there once (:meth:`every_step`).

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
    steps: tuple[StepScalars, ...] = ()

    def every_step(self) -> Iterator[StepRecord]:
        """The steps this record carries, one record each, oldest first: those of :attr:`steps` (no rows)
        and then this record itself (without its ``steps``). What a sink that keeps every step writes
        (the run file).

        Example:
            >>> from streamwatch.testing import table
            >>> past = (StepScalars(8, 1.5, {"loss": 0.7}),)
            >>> r = StepRecord(9, 2.0, 0, (), table(0), {"loss": 0.5}, steps=past)
            >>> [(s.step, s.scalars["loss"], len(s.steps)) for s in r.every_step()]
            [(8, 0.7, 0), (9, 0.5, 0)]
        """
        if not self.steps:
            yield self
            return
        empty = self.table[:0]
        for past in self.steps:
            yield StepRecord(
                past.step,
                past.time,
                self.rank,
                (),
                empty,
                past.scalars,
                edges=self.edges,
                start_step=self.start_step,
            )
        yield dataclasses.replace(self, steps=())

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


NO_EDGES: Mapping[str, tuple[float, ...]] = MappingProxyType({})
"""A record's ``edges`` when it has none (shared, read-only)."""

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


class PendingRecord(NamedTuple):
    """A sealed step in flight to the worker: host rows, device rows (copied or being copied), metadata.

    Rows summarised by the fused CPU kernel are already in ``host`` (float64, one line per row, the
    kernel wrote them in place); rows summarised with torch ops (CUDA, half precision, tensor subclasses,
    compiled code) are in ``data``, stacked once at the step boundary. A named tuple:
    :meth:`~streamwatch._buffer.StepBuffer.seal` makes one with a single C call (``tuple.__new__``), no
    Python frame on a cold step boundary.
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
    edges: Mapping[str, tuple[float, ...]] = NO_EDGES  # StepRecord.edges
    event: Any = None  # torch.cuda.Event on CUDA
    release: Callable[[], None] | None = None  # gives the pinned slot back to its pool
    order: Sequence[int] = ()  # each row's position in the step's execution
    start_step: int = 0  # StepRecord.start_step
    marks: Sequence[float] = ()  # a sampled step's clock marks (step_parts), its parts made here
    steps: Sequence[tuple[int, float, dict[str, float]]] = ()  # the steps since the last record (STEP_VALUE)

    def resolve(self) -> StepRecord:
        """Wait for the copy (on the calling thread — the worker's), then merge and derive."""
        if self.event is not None:
            self.event.synchronize()
        data = self.data
        flat = _NO_DEVICE_VALUES if data is NO_DEVICE_DATA else data.numpy().astype(np.float64, copy=True)
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
        steps: tuple[StepScalars, ...] = ()
        if self.steps:
            values = [dict(host) for _, _, host in self.steps]
            for name in [name for name in scalars if name.startswith(STEP_VALUE)]:
                index, _, value_name = name[len(STEP_VALUE) :].partition("/")
                values[int(index)][value_name] = scalars.pop(name)
            steps = tuple(
                StepScalars(step, wall, v) for (step, wall, _), v in zip(self.steps, values, strict=True)
            )
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
            steps,
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

NO_DEVICE_DATA = torch.empty(0, dtype=torch.float64)
"""A record's ``data`` when nothing came from a device: shared, never written (the worker copies it)."""

_NO_DEVICE_VALUES = np.empty(0, dtype=np.float64)
_NO_DEVICE_VALUES.setflags(write=False)
"""What the worker reads for :data:`NO_DEVICE_DATA` (nothing to copy)."""
