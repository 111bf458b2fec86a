"""The per-step buffer: a step's summary rows on the training thread, sealed into a PendingRecord.

The training thread appends summary rows to a :class:`StepBuffer` while hooks fire. CPU tensors go
through the fused kernel (``_kernel.py``), which writes each row straight into the step's preallocated
float64 host table: at the step boundary there is nothing left to copy. Rows computed with torch ops
(CUDA, half precision, tensor subclasses, compiled code) are 0-d device tensors; :meth:`StepBuffer.seal`
stacks them into one tensor and makes their only copy: on CPU a plain host tensor; on CUDA an
asynchronous copy on a side stream into a pinned host slot (:class:`SlotPool`), with an event recorded
after it, so the training thread never waits for the device. The result is a
:class:`~streamwatch._record.PendingRecord` — sent through the channel — which the worker turns into a
:class:`~streamwatch._record.StepRecord` (``_record.py``: waiting on the event on *its* thread, then
merging and deriving with numpy).

A pinned slot is reused only after the worker released it; when every slot is in flight the step is
dropped and counted (the overflow policy of the channel decides about records already queued). Everything
here runs once per hook or once per sampled step on the training thread, which is why :meth:`StepBuffer.seal`
builds its record with one C call (``tuple.__new__``) and why the host table comes from a :class:`_Slab`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from streamwatch._cudagraphs import overwritten
from streamwatch._kernel import NSTATS, FusedKernel
from streamwatch._record import NO_DEVICE_DATA, NO_EDGES, PendingRecord
from streamwatch._summary import Row
from streamwatch._torchpath import device_values
from streamwatch._triton import Arena, Kernels

__all__ = ["SlotPool", "StepBuffer"]

_ROW_BYTES = NSTATS * 8  # one float64 row of the host table

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


_CPU = torch.device("cpu")


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
        >>> table.shape == (2, NSTATS), float(table.sum()), arena.tolist()
        (True, 0.0, [0.0, 0.0, 0.0])
        >>> arena_address - table_address == 2 * NSTATS * 8  # the arena right after the table
        True
        >>> slab.take(2, 3)[1] - table_address == (2 * NSTATS + 3) * 8  # the next piece
        True
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
        "arenas",
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
        "traced",
        "unit_counts",
        "unit_more",
        "unit_sizes",
        "units",
    )

    keys: list[Hashable]
    counts: list[int]
    units: list[int]
    samples: list[int]
    device_rows: dict[int, Row]  # row -> its device summary (torch path), in row order
    extras: dict[tuple[Hashable, str], torch.Tensor]  # opt-in metric values by (key, stat); last one wins
    # key -> (first row, its per-unit counts: a device tensor, or an offset into the fused rows' arena)
    unit_counts: dict[Hashable, tuple[int, torch.Tensor | int]]
    # key -> later device rows whose per-unit counts add to the first's, added at seal (not where they
    # are made: in compiled code that sum would make one graph read another's output, CUDA graphs' memory)
    unit_more: dict[Hashable, list[int]]
    unit_sizes: dict[Hashable, int]  # key -> units of its first device row's counts
    traced: list[int]  # rows summarised inside torch.compile'd code (outputs of a graph), in order
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
        self.arenas: dict[torch.device, Arena] = {}  # the Triton path's, by device (kept across steps)
        self.clear()

    def triton_arena(self, kernels: Kernels, device: torch.device) -> Arena:
        """The Triton path's step arena on ``device`` (made once)."""
        found = self.arenas.get(device)
        if found is None:
            found = self.arenas[device] = Arena(kernels, device)
        return found

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

    def add_counts(self, counts: Iterable[tuple[Hashable, int]]) -> None:
        """Add element counts to rows already in the step (one per key: a repeated key's rows are merged
        with their counts added); a count whose key has no row is dropped."""
        where = {key: index for index, key in enumerate(self.keys)}
        for key, count in counts:
            index = where.get(key)
            if index is not None:
                self.counts[index] += count

    def add(self, key: Hashable, count: int, row: Row, replace: bool = False, traced: bool = False) -> None:
        """Append one row summarised with torch ops; with ``replace``, a later row of the same key
        overwrites the earlier one (accumulated gradients: the last, complete one counts) instead of
        merging. ``traced``: the row's tensors are outputs of a compiled graph (:meth:`drop_overwritten`)."""
        index = self._append(key, count, replace)
        if index is not None:
            self.device_rows[index] = row
            if traced:
                self.traced.append(index)
            return
        index = len(self.keys) - 1
        self.device_rows[index] = row
        if traced:
            self.traced.append(index)
        if self.device is None:
            self.device = row.gram.device
        counts = row.unit_counts
        if counts is None:
            return
        # (a later row's counts are added at seal, not here: no op on an earlier pass's output, which CUDA
        # graphs may have overwritten)
        if key not in self.unit_counts:
            self.unit_counts[key] = (index, counts)
            self.unit_sizes[key] = counts.numel()
        elif self.unit_sizes.get(key) == counts.numel():
            self.unit_more.setdefault(key, []).append(index)
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

    def drop_overwritten(self) -> int:
        """Drop the rows compiled code summarised whose memory CUDA graphs have reused since, and the
        opt-in values in such memory; how many rows and values were dropped.

        ``torch.compile(mode="reduce-overhead")`` replays CUDA graphs whose outputs live in one memory
        pool: a new pass of the model (the next micro-batch of a step with gradient accumulation, an
        evaluation pass) overwrites the outputs of the last one and makes reading them raise. A row of
        such a pass is dropped here, before :meth:`seal` reads the step's rows; the rows of the same
        key from the passes still readable (the last one) stay. Reading a data pointer launches nothing.

        Example:
            >>> buffer = StepBuffer()
            >>> buffer.drop_overwritten()  # (nothing summarised in compiled code)
            0
        """
        if not self.traced:
            return 0
        dead = {i for i in self.traced if i in self.device_rows and overwritten(self.device_rows[i].gram)}
        stale = [name for name, value in self.extras.items() if overwritten(value)]
        for name in stale:
            del self.extras[name]
        if dead:
            self._drop(dead)
        self.traced = []
        return len(dead) + len(stale)

    def _drop(self, dead: set[int]) -> None:
        """Remove the device rows ``dead`` from the step (the other rows keep their order)."""
        keep = [i for i in range(len(self.keys)) if i not in dead]
        new = {old: i for i, old in enumerate(keep)}
        if any(i not in self.device_rows and new[i] != i for i in keep):  # host rows move up
            self.host[: len(keep)] = self.host[keep]
        self.keys = [self.keys[i] for i in keep]
        self.counts = [self.counts[i] for i in keep]
        self.units = [self.units[i] for i in keep]
        self.samples = [self.samples[i] for i in keep]
        positions = sorted(self.order[i] for i in keep)
        rank = {position: i for i, position in enumerate(positions)}
        self.order = [rank[self.order[i]] for i in keep]
        self.latest = {key: new[i] for key, i in self.latest.items() if i in new}
        units: dict[Hashable, tuple[int, torch.Tensor | int]] = {}
        more: dict[Hashable, list[int]] = {}
        for key, (first, value) in self.unit_counts.items():
            if isinstance(value, int):  # (a host row's: never from compiled code)
                units[key] = (new[first], value)
                continue
            alive = [i for i in (first, *self.unit_more.get(key, ())) if i in new]
            if alive:  # (the first live row's counts lead; the others add to them at seal)
                units[key] = (new[alive[0]], self.device_rows[alive[0]].unit_counts)  # type: ignore[assignment]
                if len(alive) > 1:
                    more[key] = [new[i] for i in alive[1:]]
        self.device_rows = {new[i]: row for i, row in self.device_rows.items() if i in new}
        self.unit_counts, self.unit_more = units, more
        self.unit_sizes = {key: self.unit_sizes[key] for key in units if key in self.unit_sizes}
        if not self.device_rows:
            self.device = None

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
        steps: Sequence[tuple[int, float, dict[str, float]]] = (),
    ) -> PendingRecord | None:
        """Hand the step over: host rows as they are, device rows stacked with one copy; returns None
        if no pinned slot was free. ``marks``: a sampled step's clock marks (:func:`step_parts`);
        ``steps``: the unrecorded steps since the last record (``PendingRecord.steps``; their device
        losses ride in ``step_scalars``).

        Layout of the device copy: every device row's scalars, then the device step scalars, then each
        device unit-row's per-unit activity counts (small vectors: dead units and active pairs are
        counted on the worker). CPU step scalars are read directly (no device to wait for). Everything
        else is handed over as is — numpy work happens on the worker.
        """
        if step_scalars or self.device_rows or self.device is not None or self.extras:
            device = self._device_part(step_scalars, host_scalars, stream, pool, nonfinite_counted)
            if device is None:
                self.clear()
                return None
            host_units, unit_rows, extra_layout, names, host_scalars, data, event, release = device
        else:  # every row the fused kernel's, every scalar read (the common CPU step): nothing to copy
            host_units, unit_rows, extra_layout, names = list(self.unit_counts.values()), [], [], ()
            data, event, release = NO_DEVICE_DATA, None, None  # (resolve() knows it: nothing to copy)
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
                edges if edges is not None else NO_EDGES,
                event,
                release,
                self.order,
                start_step,
                marks,
                steps,
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
        self.unit_more, self.unit_sizes, self.traced = {}, {}, []
        self.device = None
        for arena in self.arenas.values():  # (the Triton path's: its copy above was enqueued first)
            arena.reset()
        return record

    def _device_part(
        self,
        step_scalars: Mapping[str, torch.Tensor],
        host_scalars: dict[str, float],
        stream: Any,
        pool: SlotPool | None,
        nonfinite_counted: bool,
    ) -> tuple[Any, ...] | None:
        """:meth:`seal` of a step with device rows, device scalars or opt-in metric values: one flat
        tensor of one dtype (:func:`_flat`) and its copy (on CUDA into a pinned slot, with an event).
        Returns the record's fields ``(host_units, unit_rows, extra_layout, scalar_names, host_scalars,
        data, event, release)``; None if no pinned slot was free."""
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
            vectors, unit_rows, host_units = [], [], []
            for key, (first, v) in self.unit_counts.items():
                if isinstance(v, int):
                    host_units.append((first, v))
                    continue
                for later in self.unit_more.get(key, ()):  # (a repeated key: its calls' counts added)
                    v = v + self.device_rows[later].unit_counts  # type: ignore[operator]
                vectors.append(v)
                unit_rows.append(first)
        else:  # every row from the fused kernel: unit counts are arena offsets
            vectors, unit_rows = [], []
            host_units = list(self.unit_counts.values())  # type: ignore[arg-type]
        device = self.device if self.device is not None else (extra[0].device if extra else None)
        if device is None:
            device = next(iter(self.extras.values())).device if self.extras else _CPU
        if self.device_rows or extra:
            flat = _flat(list(self.device_rows.values()), nonfinite_counted, extra, vectors, device)
        elif self.extras:
            flat = torch.empty(0, dtype=torch.float64, device=device)
        else:
            flat = NO_DEVICE_DATA  # every row on the host, every scalar read (CPU step scalars)
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
        if flat is not NO_DEVICE_DATA and flat.device.type == "cuda" and pool is not None:
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

        elif flat is NO_DEVICE_DATA:
            data = flat  # (resolve() recognises it: nothing to copy)
        else:
            data = flat.detach().cpu() if flat.device.type != "cpu" else flat.detach()
        return host_units, unit_rows, extra_layout, tuple(names), host_scalars, data, event, release

    def clear(self) -> None:
        """Forget the current step's rows (the host table is reused)."""
        self.keys, self.order, self.counts, self.units, self.samples = [], [], [], [], []
        self.device_rows, self.extras, self.unit_counts, self.latest = {}, {}, {}, {}
        self.unit_more, self.unit_sizes, self.traced = {}, {}, []
        self.device = None
        if self._arena_used:
            self.arena[: self._arena_used] = 0
            self._arena_used = 0
        for arena in self.arenas.values():
            arena.reset()


def _flat(
    rows: list[Row],
    counted: bool,
    scalars: list[torch.Tensor],
    vectors: list[torch.Tensor],
    device: torch.device,
) -> torch.Tensor:
    """The device part of a step in one flat tensor of one dtype: the rows' device values
    (``_torchpath.device_values``), then the device step scalars, then the unit-rows' per-unit counts.
    Every piece is converted to that dtype before the one ``cat``: CUDA's ``cat`` copies inputs of
    mixed dtypes one by one. Pieces on other devices (model parallel) are moved to ``device`` first."""
    pieces = [device_values(rows, counted)] if rows else []
    dtype = pieces[0].dtype if pieces else torch.float32
    if scalars:
        dtype = torch.float64 if any(s.dtype == torch.float64 for s in scalars) else dtype
        if pieces and pieces[0].dtype != dtype:
            pieces[0] = pieces[0].to(dtype)
        same = [s if s.dtype == dtype else s.to(dtype) for s in scalars]
        pieces.append(same[0].reshape(1) if len(same) == 1 else torch.stack(same))
    if len(vectors) > 1 and all(v.dtype == torch.int32 for v in vectors):  # the Triton path's counts
        vectors = [torch.cat(vectors)]  # (one conversion below, not one per vector)
    pieces += [v if v.dtype == dtype else v.to(dtype) for v in vectors]
    if len(pieces) == 1:
        return pieces[0]
    try:
        return torch.cat(pieces)
    except RuntimeError:  # pieces on several devices (model parallel): gather them first
        return torch.cat([p.to(device, non_blocking=True) for p in pieces])
