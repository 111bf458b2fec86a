"""CUDA summaries in Triton kernels: one launch per activation or output gradient, one per pack of
parameters, one finalize per step (the kernels: ``_triton_kernels``).

Where the torch path (``_torchpath``) takes four launches per tensor and a few per pack plus the
boundary's ``cat``/``stack``/``index_select``, this path takes one launch per tensor and one per pack; every
summary's partial sums go into one step-wide device arena (:class:`Arena`), and at the boundary one
finalize reduces them, each summary's in a fixed order, into the step's table (float64, the schema's
device order): deterministic, no float atomics, no host sync. Non-finite counts are exact; a tensor
without NaN or ±inf pays nothing for them (a second pass reads the parts of a tensor that hold one).

**Which tensors.** CUDA tensors of float16, bfloat16, float32 or float64, when Triton imports and
compiles. Inside ``torch.compile`` an arena's bookkeeping cannot run at every call, so traced code calls
the registered op ``streamwatch::partials`` instead (:meth:`Kernels.traced_row`): dynamo sees one op,
AOT autograd hands Inductor the kernel, and the partials are an output of the graph that
:class:`TracedArena` finalizes at the step's end. ``STREAMWATCH_KERNEL=torch`` forces the torch path;
``STREAMWATCH_KERNEL=triton`` makes CPU tensors take these kernels too, which only works under the
Triton interpreter (``TRITON_INTERPRET=1``): the tests' route to check the kernels without a GPU.

**Falling back.** Triton is imported lazily, on the first CUDA model observed. If it is missing, too old
(before 3.0), or fails to compile a kernel (it needs a C compiler the first time), streamwatch warns once
(``RuntimeWarning``), :func:`status` says why, and CUDA tensors take the torch path. Compiled kernels are
cached in a temporary folder of this process (removed at exit), never under the user's home, unless
``TRITON_CACHE_DIR`` or ``TRITON_HOME`` says where.

Example:
    >>> from streamwatch import _triton
    >>> _triton.status().split(":")[0] in ("triton", "torch", "not loaded yet")
    True
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, NamedTuple

import torch

from streamwatch._exit import at_exit
from streamwatch._schema import DEVICE
from streamwatch._torchpath import Packing, Row

__all__ = ["Arena", "Kernels", "forced", "load", "status", "summarize_values"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes the kernels read."""
MIN_VERSION = (3, 0)
NCOL = len(DEVICE)
"""Values per summary in the step's table (the last, ``nonfinite``, only when counted)."""
_FLAT_BLOCK = 1024
_FLAT_PROGRAMS = 1024
"""A contiguous tensor is read by at most about this many programs (each a run of 1024-element blocks)."""
_FLAT_WARPS = 4
"""Warps per program of :func:`~streamwatch._triton_kernels.flat_partials`."""
TILES: dict[str, tuple[int, int, int]] = {
    "one position": (1024, 1, 4),
    "positions contiguous": (8, 128, 4),
    "units contiguous": (64, 16, 4),
    "strided": (32, 32, 4),
}
"""``tile_partials``' block ``(units, positions)`` and warps by layout (:func:`_tile`): 1024 elements,
long along the contiguous dimension, four warps. ``benchmarks/gpu/tiles.py`` times the alternatives on a
GPU; docs/performance.md#the-triton-kernels-on-an-h200 has what it measured and why these."""
_FINAL_BLOCK = 64
_CACHED = 256
"""Device index tensors (segments, permutations) remembered per arena: layouts repeat every step."""
_RTOL, _ATOL = 1e-5, 1e-8  # torch.isclose's defaults, as in _kernel.Activity


def _mode() -> str:
    return os.environ.get("STREAMWATCH_KERNEL", "").lower()


def forced() -> bool:
    """Whether ``STREAMWATCH_KERNEL=triton`` sends every tensor, CPU ones too, to these kernels."""
    return _mode() == "triton"


_lock = threading.Lock()
_loaded: Kernels | None = None
_failure: str | None = None
_cache_dir: str | None = None


def status() -> str:
    """How CUDA tensors are summarised: ``"triton: <version>"``, ``"torch: <why>"`` or ``"not loaded yet"``.

    Example:
        >>> status() != ""
        True
    """
    if _mode() == "torch":
        return "torch: STREAMWATCH_KERNEL=torch"
    if not (forced() or torch.cuda.is_available()):
        return "torch: no CUDA device"
    if _loaded is not None and _loaded.failed is not None:
        return f"torch: a Triton kernel failed ({_loaded.failed})"
    if _loaded is not None:
        return f"triton: {_loaded.version}"
    if _failure is not None:
        return f"torch: the Triton kernels are unavailable ({_failure})"
    return "not loaded yet"


def load() -> Kernels | None:
    """The Triton kernels, or None (CUDA tensors then take the torch path; :func:`status` says why).

    None without a CUDA device (unless ``STREAMWATCH_KERNEL=triton``). Never raises; a failure is warned
    about once per process and never retried. The kernels are
    compiled here, on a small CUDA tensor, so a missing compiler shows now and not inside a training
    step (under ``STREAMWATCH_KERNEL=triton`` without CUDA nothing is compiled: the interpreter runs them).
    """
    global _loaded, _failure
    if _mode() == "torch" or not (forced() or torch.cuda.is_available()):
        return None
    with _lock:
        if _loaded is not None or _failure is not None:
            return _loaded
        try:
            _own_cache()
            kernels = Kernels(_import())
            if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
                kernels.check(torch.device("cuda", torch.cuda.current_device()))
            _loaded = kernels
        except Exception as exc:  # ImportError, a compiler missing, a version we cannot use, ...
            _failure = f"{type(exc).__name__}: {exc}".strip()[:400]
    if _failure is not None:
        warnings.warn(
            f"streamwatch: {status()}; CUDA summaries use torch ops (more launches per step). Install "
            "Triton 3.0 or newer with a C compiler available (it comes with Linux CUDA torch wheels), or "
            "set STREAMWATCH_KERNEL=torch to choose the torch path without this warning.",
            RuntimeWarning,
            stacklevel=2,
        )
    return _loaded


def _import() -> ModuleType:
    import triton  # (lazy: a CPU-only install never imports it)

    version = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_VERSION:
        raise ImportError(f"Triton {triton.__version__} is older than {'.'.join(map(str, MIN_VERSION))}")
    from streamwatch import _triton_kernels

    return _triton_kernels


def _own_cache() -> None:
    """Point Triton's cache at a temporary folder of this process (removed at exit) unless the user chose
    a place (``TRITON_CACHE_DIR``, ``TRITON_HOME``): compiled kernels are never written under the home
    folder. Set once, before the first compile, for the whole process (a scope around each launch would
    cost every launch two environment writes); a user's own Triton kernels then cache there too, which
    setting ``TRITON_CACHE_DIR`` avoids."""
    global _cache_dir
    if _cache_dir is not None or "TRITON_CACHE_DIR" in os.environ or "TRITON_HOME" in os.environ:
        return
    _cache_dir = tempfile.mkdtemp(prefix="streamwatch-triton-")
    at_exit(functools.partial(shutil.rmtree, _cache_dir, True), cleanup=True)  # (after the last flush)
    os.environ["TRITON_CACHE_DIR"] = _cache_dir


class Kernels:
    """The loaded kernels (one per process): launches them for an :class:`Arena`."""

    def __init__(self, module: ModuleType) -> None:
        import triton

        self.module = module
        self.version = triton.__version__
        self.failed: str | None = None  # why a launch failed; then nothing takes these kernels again
        self.op = _register(module)  # streamwatch::partials, for compiled code (None: torch before 2.6)
        self.traced = TracedArena(self)

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether ``x`` takes these kernels (CUDA, or any device under ``STREAMWATCH_KERNEL=triton``),
        which no tensor does once a launch failed."""
        return self.failed is None and x.dtype in DTYPES and (x.device.type == "cuda" or forced())

    def traced_row(
        self, x: torch.Tensor, unit_dim: int | None = None, bounds: tuple[float, float] | None = None
    ) -> Row:
        """:meth:`Arena.summarize` for code ``torch.compile`` traces (where an arena's Python bookkeeping
        cannot run at every call): the registered op ``streamwatch::partials``, which Inductor turns into
        a launch of the same kernel from its own code, with no graph break. The row's partials are an
        output of the graph; :attr:`traced` finalizes the step's rows in one launch."""
        partials, counts, _ = self.op(x, unit_dim, None if bounds is None else [bounds[0], bounds[1]])
        if unit_dim is None:
            return Row(partials, partials, partials, arena=self.traced)
        return Row(partials, partials, partials, unit_counts=counts, samples=x.shape[0], arena=self.traced)

    def give_up(self, exc: BaseException) -> None:
        """A launch failed (a specialisation compiled at its first use that would not compile, say):
        every tensor takes the torch path from now on, after one ``RuntimeWarning``; :func:`status`
        says why. The caller summarises the tensor at hand with the torch path."""
        if self.failed is not None:
            return
        self.failed = f"{type(exc).__name__}: {exc}".strip()[:400]
        warnings.warn(
            f"streamwatch: a Triton kernel failed ({self.failed}); CUDA summaries use torch ops from now "
            "on. Set STREAMWATCH_KERNEL=torch to choose them from the start.",
            RuntimeWarning,
            stacklevel=3,
        )

    def check(self, device: torch.device) -> None:
        """Compile and run every kernel once on ``device`` (the finalize in both its variants; other
        dtypes and layouts compile at their first use), checking values against torch's."""
        arena = Arena(self, device)
        x = torch.tensor([[1.0, -2.0], [0.0, 4.0]], device=device)
        row = arena.summarize(x, unit_dim=1)
        pack = Packing([torch.Size([3])], device, torch.float32)
        pack.fill([torch.tensor([1.0, 2.0, 3.0], device=device)])
        packed = arena.summarize_packed(pack)
        arena.table(True, [row, *packed])  # (both finalize variants compiled now, not inside a step)
        table = arena.table(False, [row, *packed]).cpu()
        if float(table[0, 0]) != 3.0 or float(table[1, 0]) != 6.0:
            raise RuntimeError(f"the Triton kernels' self-check failed: {table.tolist()}")


class Arena:
    """One device's partial sums for one step: summaries add rows, :meth:`table` finalizes them all.

    Rows this arena makes are :class:`~streamwatch._torchpath.Row` objects with ``arena`` set and
    ``part`` their index here; ``_torchpath.device_values`` asks :meth:`table` for their values.
    Summaries may come from several threads (autograd's device threads), so taking rows is locked;
    kernels run in the order of the stream they are launched on, so a reset arena is rewritten only
    after the finalize that read it.

    Example (CPU tensors need ``STREAMWATCH_KERNEL=triton`` and ``TRITON_INTERPRET=1``)::

        arena = Arena(load(), torch.device("cpu"))
        rows = [arena.summarize(torch.ones(3)), arena.summarize(torch.zeros(2, 4), unit_dim=1)]
        arena.table(False, rows)  # (2, 8): sum, sumsq, min, max, nonzero, sumabs, sumcube, sumfourth
    """

    def __init__(self, kernels: Kernels, device: torch.device) -> None:
        self.kernels = kernels
        self.device = device
        self.partials = torch.empty(4096, NCOL + 1, dtype=torch.float64, device=device)
        self.units = torch.zeros(4096, dtype=torch.int32, device=device)
        self.segments: list[tuple[int, int]] = []  # each row's partials: (first, count)
        self._used = 0  # partials rows taken this step
        self._units_used = 0
        self._lock = threading.Lock()
        self._index: dict[tuple[int, ...], torch.Tensor] = {}  # segment starts and lengths on the device

    def _take(self, parts: Sequence[int], units: int = 0) -> tuple[int, int, int]:
        """Room for summaries of ``parts`` partials each (and ``units`` counts): (first partials row,
        first summary row, units offset). A full arena grows, keeping what this step wrote."""
        need = sum(parts)
        with self._lock:
            first, row, offset = self._used, len(self.segments), self._units_used
            if first + need > self.partials.shape[0]:
                grown = torch.empty(2 * (first + need), NCOL + 1, dtype=torch.float64, device=self.device)
                grown[:first] = self.partials[:first]
                self.partials = grown
            if offset + units > self.units.shape[0]:  # (earlier rows keep views of the old buffer)
                self.units = torch.zeros(2 * (offset + units), dtype=torch.int32, device=self.device)
                offset = 0
            start = first
            for count in parts:
                self.segments.append((start, count))
                start += count
            self._used = start
            self._units_used = offset + units
            return first, row, offset

    def summarize(
        self, x: torch.Tensor, *, unit_dim: int | None = None, bounds: tuple[float, float] | None = None
    ) -> Row:
        """The :class:`Row` of a dense, non-empty tensor (any strides), in one launch; with ``unit_dim``,
        also per-unit activity (active: nonzero, or away from the saturation ``bounds``)."""
        reading = _reading(x, unit_dim)
        units = reading.units if unit_dim is not None else 0
        first, row, offset = self._take([reading.programs], units * (1 + reading.samples))
        counts = self.units[offset : offset + units] if unit_dim is not None else None
        flags = self.units[offset + units :] if unit_dim is not None else self.units  # (sample, unit)
        _launch(self.kernels.module, _as_is, reading, self.partials, first, counts, flags, bounds)
        p = self.partials
        return Row(p, p, p, unit_counts=counts, samples=reading.samples, arena=self, part=row)

    def summarize_packed(
        self, pack: Packing, reverse: bool = False, minus: Packing | None = None
    ) -> list[Row]:
        """The :class:`Row` of every tensor in ``pack`` in one launch (one program per chunk; each
        tensor's partials are its chunks). With ``reverse``, the rows in reverse order; with ``minus`` (a
        pack of the same layout), the rows of ``pack − minus``, read from both, never stored."""
        lengths, valid = pack.chunking()
        first, row, _ = self._take(lengths)
        chunks = pack.buffer.shape[0]
        self.kernels.module.flat_partials[(chunks,)](
            pack.buffer,
            minus.buffer if minus is not None else pack.buffer,
            valid,
            pack.buffer.numel(),
            pack.buffer.shape[1],
            self.partials,
            first,
            WIDE=pack.dtype == torch.float64,
            PACKED=True,
            DIFF=minus is not None,
            BLOCK=_FLAT_BLOCK,
            num_warps=_FLAT_WARPS,
        )
        p = self.partials
        rows = [Row(p, p, p, arena=self, part=row + i) for i in range(len(lengths))]
        return rows[::-1] if reverse else rows

    def table(self, counted: bool, rows: Sequence[Row] | None = None) -> torch.Tensor:
        """``(len(rows), NCOL)`` (``NCOL - 1`` unless ``counted``) float64: the device values of
        ``rows`` (this arena's; default all its rows in order), in one finalize launch."""
        parts = [r.part for r in rows] if rows is not None else list(range(len(self.segments)))
        segments = [self.segments[p] for p in parts]
        return _finalize(self.kernels.module, self.partials, segments, counted, self._index)

    def reset(self) -> None:
        """Forget this step's rows (the buffers stay; the next step's kernels overwrite them in order)."""
        with self._lock:
            if self._units_used:
                self.units[: self._units_used].zero_()
            self.segments, self._used, self._units_used = [], 0, 0


class TracedArena:
    """The rows summarised inside ``torch.compile``'d code: each holds its own partials (an output of the
    graph, from the registered op ``streamwatch::partials``), and :meth:`table` joins them with one
    ``cat`` and finalizes them in one launch. One per :class:`Kernels`; ``_torchpath.device_values``
    asks it for its rows' values as it asks an :class:`Arena`.

    Example (CPU tensors need ``STREAMWATCH_KERNEL=triton`` and ``TRITON_INTERPRET=1``)::

        kernels = load()
        rows = [kernels.traced_row(torch.ones(3)), kernels.traced_row(torch.zeros(2, 4), unit_dim=1)]
        kernels.traced.table(False, rows)  # (2, 8), as Arena.table gives
    """

    def __init__(self, kernels: Kernels) -> None:
        self.kernels = kernels
        self._index: dict[tuple[int, ...], torch.Tensor] = {}  # segment starts and lengths on the device

    def table(self, counted: bool, rows: Sequence[Row]) -> torch.Tensor:
        """``(len(rows), NCOL)`` (``NCOL - 1`` unless ``counted``) float64: the device values of ``rows``
        (this arena's), in one ``cat`` and one finalize launch."""
        parts = [r.gram for r in rows]
        device = parts[0].device
        if any(p.device != device for p in parts):  # (several devices: model parallel)
            parts = [p.to(device) for p in parts]
        segments, start = [], 0
        for p in parts:
            segments.append((start, p.shape[0]))
            start += p.shape[0]
        partials = parts[0] if len(parts) == 1 else torch.cat(parts)
        return _finalize(self.kernels.module, partials, segments, counted, self._index)


class _Reading(NamedTuple):
    """How one tensor is read: ``x`` (copied contiguous where no single stride walks its positions), the
    grid of programs (each writes one partials row), positions per program (``per``), and for the tile
    kernel the ``[B, U, P]`` layout (:func:`_layout`) and block (:func:`_tile`); ``layout`` None: the flat
    kernel."""

    x: torch.Tensor
    grid: tuple[int, ...]
    per: int
    layout: tuple[int, int, int, int, int, int] | None = None
    tile: tuple[int, int, int, int] | None = None

    @property
    def programs(self) -> int:
        return math.prod(self.grid)

    @property
    def samples(self) -> int:
        return self.layout[0] if self.layout is not None else 0

    @property
    def units(self) -> int:
        return self.layout[1] if self.layout is not None else 0


def _reading(x: torch.Tensor, unit_dim: int | None) -> _Reading:
    """How the kernels read ``x`` (with ``unit_dim``: per unit too)."""
    if unit_dim is None and x.is_contiguous():
        n = x.numel()
        per = _FLAT_BLOCK * -(-n // (_FLAT_BLOCK * _FLAT_PROGRAMS))
        return _Reading(x, (-(-n // per),), per)
    layout = _layout(x, unit_dim)
    if layout is None:  # positions no single stride reaches: one copy first
        x = x.contiguous()
        layout = _layout(x, unit_dim)
        assert layout is not None
    samples, units, positions, _, su, sp = layout
    tile = _tile(su, sp, units, positions)
    tiles = -(-units // tile[0])
    # positions split over programs until there are about _FLAT_PROGRAMS (a batch of 8 sequences
    # of 1024 tokens would be 48 programs otherwise: a GPU mostly idle)
    splits = max(1, min(-(-positions // tile[1]), _FLAT_PROGRAMS // (samples * tiles)))
    per_split = tile[1] * -(-positions // (tile[1] * splits))
    return _Reading(x, (samples, tiles, -(-positions // per_split)), per_split, layout, tile)


def _as_is(kernel: Any) -> Any:
    """A kernel launched directly (eager code; ``torch.library.wrap_triton`` in a registered op)."""
    return kernel


def _launch(
    k: ModuleType,
    wrap: Callable[[Any], Any],
    reading: _Reading,
    partials: torch.Tensor,
    first: int,
    counts: torch.Tensor | None,
    flags: torch.Tensor,
    bounds: tuple[float, float] | None,
) -> None:
    """Launch the kernel that reads ``reading`` into ``partials`` from row ``first``; ``counts``: its
    per-unit activity counts (None: not taken), ``flags`` its (sample, unit) flags, both zeroed."""
    x = reading.x
    wide = x.dtype == torch.float64
    if reading.layout is None:
        wrap(k.flat_partials)[reading.grid](
            x,
            x,
            x,
            x.numel(),
            reading.per,
            partials,
            first,
            WIDE=wide,
            PACKED=False,
            DIFF=False,
            BLOCK=_FLAT_BLOCK,
            num_warps=_FLAT_WARPS,
        )
        return
    assert reading.tile is not None
    _, units, positions, sb, su, sp = reading.layout
    bu, bp, warps, fold = reading.tile
    lo, hi = bounds if bounds is not None else (0.0, 0.0)
    has_lo = bounds is not None and abs(lo) != float("inf")
    has_hi = bounds is not None and abs(hi) != float("inf")
    wrap(k.tile_partials)[reading.grid](
        x,
        units,
        positions,
        sb,
        su,
        sp,
        reading.per,
        partials,
        first,
        counts if counts is not None else flags,
        flags,
        lo if has_lo else 0.0,
        hi if has_hi else 0.0,
        _ATOL + _RTOL * abs(lo) if has_lo else 0.0,
        _ATOL + _RTOL * abs(hi) if has_hi else 0.0,
        WIDE=wide,
        UNITS=counts is not None,
        BOUNDED=bounds is not None,
        HAS_LO=has_lo,
        HAS_HI=has_hi,
        BU=bu,
        BP=bp,
        FOLD=fold,
        EVEN_U=units % bu == 0,
        num_warps=warps,
    )


def _finalize(
    k: ModuleType,
    partials: torch.Tensor,
    segments: Sequence[tuple[int, int]],
    counted: bool,
    index: dict[tuple[int, ...], torch.Tensor],
) -> torch.Tensor:
    """``(len(segments), NCOL)`` (``NCOL - 1`` unless ``counted``) float64: each segment ``(first row,
    rows)`` of ``partials`` reduced in order, in one launch; ``index`` caches the segments' device
    copies (layouts repeat every step)."""
    ncol = NCOL if counted else NCOL - 1
    out = torch.empty(len(segments), ncol, dtype=torch.float64, device=partials.device)
    if not segments:
        return out
    starts = _device_index(index, partials.device, tuple(s for s, _ in segments))
    lengths = _device_index(index, partials.device, tuple(c for _, c in segments))
    k.finalize[(len(segments),)](partials, starts, lengths, out, NCOL=ncol, BLOCK=_FINAL_BLOCK)
    return out


def _device_index(
    index: dict[tuple[int, ...], torch.Tensor], device: torch.device, values: tuple[int, ...]
) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, remembered in ``index`` (copied without waiting)."""
    found = index.get(values)
    if found is None:
        if len(index) >= _CACHED:
            index.clear()
        host = torch.tensor(values, dtype=torch.int64)
        found = index[values] = host.to(device, non_blocking=True)
    return found


def _partials(
    x: torch.Tensor, unit_dim: int | None, bounds: list[float] | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The registered op ``streamwatch::partials``: ``x``'s partials (one row per program) and, with
    ``unit_dim``, its per-unit activity counts and (sample, unit) flags (else one unread element each),
    in one launch (and two zero fills with ``unit_dim``). Traced into a compiled graph as the kernel
    itself (``wrap_triton``): Inductor launches it from its own code."""
    reading = _reading(x, unit_dim)
    partials, counts, flags = _outputs(reading, unit_dim)
    pair = (bounds[0], bounds[1]) if bounds is not None else None
    taken = counts if unit_dim is not None else None
    _launch(_op_module(), torch.library.wrap_triton, reading, partials, 0, taken, flags, pair)
    return partials, counts, flags


def _partials_fake(
    x: torch.Tensor, unit_dim: int | None, bounds: list[float] | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``streamwatch::partials``' outputs, not computed (what dynamo traces with)."""
    return _outputs(_reading(x, unit_dim), unit_dim)


def _outputs(reading: _Reading, unit_dim: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``streamwatch::partials``' outputs, allocated: partials, counts and flags."""
    device = reading.x.device
    partials = torch.empty(reading.programs, NCOL + 1, dtype=torch.float64, device=device)
    if unit_dim is None:  # (pointers the kernel is given and never reads)
        return (
            partials,
            torch.empty(1, dtype=torch.int32, device=device),
            torch.empty(1, dtype=torch.int32, device=device),
        )
    counts = torch.zeros(reading.units, dtype=torch.int32, device=device)
    return partials, counts, torch.zeros(reading.samples * reading.units, dtype=torch.int32, device=device)


_op: Any = None
"""``streamwatch::partials`` once registered (:func:`_register`); None before, False if it failed."""
_op_modules: list[ModuleType] = []


def _op_module() -> ModuleType:
    """The kernels the registered op launches (the latest :class:`Kernels`' module)."""
    return _op_modules[-1]


def _register(module: ModuleType) -> Any:
    """Register ``streamwatch::partials`` (once per process) to launch ``module``'s kernels; None where
    this torch has no ``torch.library.triton_op`` (before 2.6) or refuses it (warned once): compiled
    code then traces the torch path, and eager code still takes the kernels."""
    global _op
    _op_modules[:] = [module]
    if _op is None and hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton"):
        try:
            op: Any = torch.library.triton_op("streamwatch::partials", _partials, mutates_args=())
            op.register_fake(_partials_fake)
            _op = op
        except Exception as exc:  # (an API that changed under us: only compiled code loses the kernels)
            warnings.warn(
                f"streamwatch: could not register the Triton kernels for compiled code ({exc!r}); "
                "activations inside torch.compile are summarised with torch ops",
                RuntimeWarning,
                stacklevel=2,
            )
            _op = False
    return _op or None


def _layout(x: torch.Tensor, unit_dim: int | None) -> tuple[int, int, int, int, int, int] | None:
    """``x`` as ``[B, U, P]`` by strides: ``(B, U, P, sb, su, sp)`` — samples, units, positions (the
    dimensions that are neither, merged: None if no single stride walks them). Without ``unit_dim``
    any three merged dimensions do."""
    shape, strides = list(x.shape), list(x.stride())
    if unit_dim is not None:
        rest = _merge([(shape[d], strides[d]) for d in range(1, x.dim()) if d != unit_dim])
        if len(rest) > 1:
            return None
        p, sp = rest[0] if rest else (1, 0)
        return shape[0], shape[unit_dim], p, strides[0], strides[unit_dim], sp
    dims = _merge(list(zip(shape, strides, strict=True)))
    if len(dims) > 3:
        return None
    dims = [(1, 0)] * (3 - len(dims)) + dims
    (b, sb), (u, su), (p, sp) = dims
    return b, u, p, sb, su, sp


def _merge(dims: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent (size, stride) dimensions merged where one stride walks both; size-1 ones dropped."""
    out: list[tuple[int, int]] = []
    for size, stride in dims:
        if size == 1:
            continue
        if out and out[-1][1] == stride * size:
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return out


def _tile(su: int, sp: int, units: int, positions: int) -> tuple[int, int, int, int]:
    """Block shape ``(BU, BP)``, warps and ``FOLD`` for a ``[B, U, P]`` layout (:data:`TILES`): which
    dimension each thread adds its own elements along (1: units, 2: positions, 0: neither), the
    contiguous one."""
    if positions == 1:
        return (*TILES["one position"], 0)
    if sp == 1:
        bu, bp, warps = TILES["positions contiguous"]
        return bu, bp, warps, 2 if bp % 8 == 0 else 0  # (8: the most elements a thread loads at once)
    if su == 1:
        bu, bp, warps = TILES["units contiguous"]
        return bu, bp, warps, 1 if bu % 8 == 0 else 0
    return (*TILES["strided"], 0)


def summarize_values(x: torch.Tensor, unit_dim: int | None = None) -> torch.Tensor:
    """One tensor's device values (with the exact non-finite count) through the kernels: for tests and
    the command line, not the hot path. Raises RuntimeError when the kernels are unavailable."""
    kernels = load()
    if kernels is None:
        raise RuntimeError(status())
    arena = Arena(kernels, x.device)
    return arena.table(True, [arena.summarize(x, unit_dim=unit_dim)])[0]
