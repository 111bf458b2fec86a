"""Step records: the per-step buffer on the training thread, and what the worker receives.

The training thread appends summary rows to a :class:`StepBuffer` while hooks fire. At the step boundary
:meth:`StepBuffer.seal` stacks every device scalar of the step into one tensor and makes the only copy of
the step: on CPU a plain host tensor; on CUDA an asynchronous copy on a side stream into a pinned host
slot, with an event recorded after it, so the training thread never waits for the device. The result is a
:class:`PendingRecord` — sent through the channel — which the worker turns into a :class:`StepRecord`
(waiting on the event on *its* thread, then merging and deriving with numpy).

A pinned slot is reused only after the worker released it; when every slot is in flight the step is
dropped and counted (the overflow policy of the channel decides about records already queued).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from streamwatch._summary import COLUMNS, DEVICE_STATS, Raw, Row, derive, finalize

_NSTATS_COUNTED = len(DEVICE_STATS)  # with the exact non-finite count; one fewer without

__all__ = ["PendingRecord", "SeriesKey", "SlotPool", "StepBuffer", "StepRecord"]


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


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One sampled step, as the worker's pipelines see it. Immutable, host-only (no autograd graph).

    Attributes:
        step: the step index (``watch.step()`` calls before this one).
        time: wall-clock seconds (``time.time()``) at the step boundary.
        rank: the process rank (0 without torch.distributed).
        keys: one :class:`SeriesKey` per table row, unique.
        table: ``(len(keys), len(COLUMNS))`` float64: count, sum, sumsq, min, max, zeros, nonfinite,
            units, dead. Read-only.
        scalars: step-level values: ``loss``, ``lr/<group>``, ``batch_size``, ``step_seconds``,
            ``samples_per_second``, ``correct``, ``total``, ``accuracy`` — whichever were given.

    Example:
        >>> import numpy as np
        >>> r = StepRecord(3, 0.0, 0, (SeriesKey("train", "fc", "activation", ""),),
        ...                np.array([[4, 2.0, 6.0, -1.0, 2.0, 1, 0, 2, 1, 2, 3]]), {"loss": 0.5})
        >>> round(float(r.stat("l2")[0]) ** 2, 9), float(r.column("zeros")[0])
        (6.0, 1.0)
    """

    step: int
    time: float
    rank: int
    keys: tuple[SeriesKey, ...]
    table: np.ndarray
    scalars: Mapping[str, float] = field(default_factory=dict)

    def column(self, name: str) -> np.ndarray:
        """One column of :attr:`table` by name (see ``streamwatch._summary.COLUMNS``)."""
        return self.table[:, COLUMNS.index(name)]

    def stat(self, name: str) -> np.ndarray:
        """A column or a derived statistic (mean, std, var, l2, rms, absmax, zero_fraction, dead_fraction)."""
        if name in COLUMNS:
            return self.column(name)
        return derive(self.table)[name]

    def rows(self, kind: str | None = None, phase: str | None = None) -> list[int]:
        """Indices of the rows of one kind and/or phase."""
        return [
            i
            for i, key in enumerate(self.keys)
            if (kind is None or key.kind == kind) and (phase is None or key.phase == phase)
        ]


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


@dataclass(slots=True)
class PendingRecord:
    """A sealed step in flight to the worker: host (or pinned, being copied) scalars plus metadata."""

    step: int
    time: float
    rank: int
    keys: list[Hashable]
    counts: list[int]
    units: list[int]
    samples: list[int]
    unit_rows: list[int]  # rows (first occurrence of a key) whose per-unit activity counts were copied
    scalar_names: tuple[str, ...]  # device step scalars after the dead counts (loss, correct)
    host_scalars: dict[str, float]
    data: torch.Tensor  # flat: rows x 5 (6) device stats, step scalars, then per-unit counts per unit-row
    nonfinite_counted: bool
    event: Any = None  # torch.cuda.Event on CUDA
    release: Callable[[], None] | None = None  # gives the pinned slot back to its pool

    def resolve(self) -> StepRecord:
        """Wait for the copy (on the calling thread — the worker's), then merge and derive."""
        if self.event is not None:
            self.event.synchronize()
        n = len(self.keys)
        nstats = _NSTATS_COUNTED if self.nonfinite_counted else _NSTATS_COUNTED - 1
        flat = self.data.numpy().astype(np.float64, copy=True)
        if self.release is not None:
            self.release()
        values = flat[: n * nstats].reshape(n, nstats)
        units = np.asarray(self.units, dtype=np.float64)
        dead = np.full(n, np.nan)
        active = np.full(n, np.nan)
        if self.unit_rows:  # each unit-row's per-unit activity counts follow the scalars, in row order
            rows = np.asarray(self.unit_rows)
            lengths = units[rows].astype(np.intp)  # >= 1: a unit-row has units
            start = n * nstats + len(self.scalar_names)
            vectors = flat[start : start + int(lengths.sum())]
            offsets = np.concatenate(([0], np.cumsum(lengths)[:-1]))
            dead[rows] = np.add.reduceat((vectors == 0).astype(np.float64), offsets)
            active[rows] = np.add.reduceat(vectors, offsets)
        raw = Raw(
            tuple(self.keys),
            np.asarray(self.counts, dtype=np.float64),
            units,
            values,
            dead,
            self.nonfinite_counted,
            np.asarray(self.samples, dtype=np.float64),
            active,
        )
        keys, table = finalize(raw)
        table.setflags(write=False)
        scalars = dict(self.host_scalars)
        for i, name in enumerate(self.scalar_names):
            scalars[name] = float(flat[n * nstats + i])
        if "correct" in scalars and scalars.get("total"):
            scalars["accuracy"] = scalars["correct"] / scalars["total"]
        return StepRecord(self.step, self.time, self.rank, keys, table, scalars)  # type: ignore[arg-type]


class StepBuffer:
    """Rows of the current step, appended by hooks on the training thread (no locks: one thread).

    Rows with equal keys are kept apart here and merged on the worker; per-unit activity counts of a
    repeated key are added here (one small kernel) so dead units and activation rates stay exact.
    """

    __slots__ = ("counts", "device", "keys", "latest", "samples", "scalars", "unit_counts", "units")

    def __init__(self) -> None:
        self.keys: list[Hashable] = []
        self.counts: list[int] = []
        self.units: list[int] = []
        self.scalars: list[torch.Tensor] = []
        self.samples: list[int] = []
        self.unit_counts: dict[Hashable, tuple[int, torch.Tensor]] = {}
        self.latest: dict[Hashable, int] = {}  # row index of replaceable keys
        self.device: torch.device | None = None

    def add(self, key: Hashable, count: int, row: Row, replace: bool = False) -> None:
        """Append one summarized tensor's row; with ``replace``, a later row of the same key overwrites
        the earlier one (accumulated gradients: the last, complete one counts) instead of merging."""
        if replace:
            index = self.latest.get(key)
            if index is not None:
                start = index * len(row.scalars)
                self.scalars[start : start + len(row.scalars)] = row.scalars
                self.counts[index] = count
                return
            self.latest[key] = len(self.keys)
        self.keys.append(key)
        self.counts.append(count)
        self.scalars.extend(row.scalars)
        if self.device is None:
            self.device = row.scalars[0].device
        counts = row.unit_counts
        if counts is None:
            self.units.append(0)
            self.samples.append(0)
            return
        seen = self.unit_counts.get(key)
        if seen is None:
            self.unit_counts[key] = (len(self.keys) - 1, counts)
        elif seen[1].shape == counts.shape:
            self.unit_counts[key] = (seen[0], seen[1] + counts)
        else:  # the same key with another unit count (a module reused on other shapes): not comparable
            self.units.append(0)
            self.samples.append(0)
            return
        self.units.append(counts.numel())
        self.samples.append(row.samples)

    def __len__(self) -> int:
        return len(self.keys)

    def seal(
        self,
        *,
        step: int,
        rank: int,
        step_scalars: Mapping[str, torch.Tensor],
        host_scalars: dict[str, float],
        nonfinite_counted: bool,
        stream: Any = None,
        pool: SlotPool | None = None,
    ) -> PendingRecord | None:
        """Stack the step into one tensor and make its only copy; returns None if no slot was free.

        Layout of the copy: every row's device scalars, then the step scalars, then each unit-row's
        per-unit activity counts (small vectors: dead units and active pairs are counted on the worker).
        Everything else stays a plain Python list handed over as is — numpy work happens on the worker.
        """
        extra = [t.detach().reshape(()) for t in step_scalars.values()]
        parts = self.scalars + extra
        vectors = [counts for _, counts in self.unit_counts.values()]
        device = (
            self.device if self.device is not None else (extra[0].device if extra else torch.device("cpu"))
        )
        if parts:
            # One stack for the whole step (it promotes float16/int64 scalars to float32/float64), one
            # cat for the unit vectors.
            try:
                flat = torch.stack(parts)
            except RuntimeError:  # parts on several devices (model parallel): gather them first
                flat = torch.stack([p.to(device, non_blocking=True) for p in parts])
            if vectors:  # convert the small vectors, never the sums (float64 models keep float64)
                flat = torch.cat([flat, *(v if v.dtype == flat.dtype else v.to(flat.dtype) for v in vectors)])
        else:
            flat = torch.empty(0, dtype=torch.float64)
        event = None
        release: Callable[[], None] | None = None
        if flat.device.type == "cuda" and pool is not None:
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

        else:
            data = flat.detach().cpu() if flat.device.type != "cpu" else flat.detach()
        record = PendingRecord(
            step=step,
            time=time.time(),
            rank=rank,
            keys=self.keys,
            counts=self.counts,
            units=self.units,
            samples=self.samples,
            unit_rows=[first for first, _ in self.unit_counts.values()],
            scalar_names=tuple(step_scalars),
            host_scalars=host_scalars,
            data=data,
            nonfinite_counted=nonfinite_counted,
            event=event,
            release=release,
        )
        self.clear()
        return record

    def clear(self) -> None:
        self.keys = []
        self.counts = []
        self.units = []
        self.scalars = []
        self.samples = []
        self.unit_counts = {}
        self.latest = {}
        self.device = None
