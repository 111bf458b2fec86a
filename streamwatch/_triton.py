"""CUDA summaries in Triton kernels: one launch per activation or output gradient, one per pack of
parameters, one finalize per step (the kernels: ``_triton_kernels``).

Where the torch path (``_torchpath``) takes four launches per tensor and a few per pack plus the
boundary's ``cat``/``stack``/``index_select``, this path takes one launch per tensor and one per pack; every
summary's partial sums go into one step-wide device arena (:class:`Arena`), and at the boundary one
finalize reduces them, each summary's in a fixed order, into the step's table (float64, the schema's
device order): deterministic, no float atomics, no host sync. Non-finite counts are exact; a tensor
without NaN or ±inf pays nothing for them (a second pass reads the parts of a tensor that hold one).

**Which tensors.** CUDA tensors of float16, bfloat16, float32 or float64 outside ``torch.compile`` (traced
code keeps the torch path's plain ops, which Inductor fuses into its own kernels), when Triton imports and
compiles. ``STREAMWATCH_KERNEL=torch`` forces the torch path; ``STREAMWATCH_KERNEL=triton`` makes CPU
tensors take these kernels too, which only works under the Triton interpreter (``TRITON_INTERPRET=1``):
the tests' route to check the kernels without a GPU.

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

import atexit
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Sequence
from types import ModuleType

import torch

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
    atexit.register(shutil.rmtree, _cache_dir, True)
    os.environ["TRITON_CACHE_DIR"] = _cache_dir


class Kernels:
    """The loaded kernels (one per process): launches them for an :class:`Arena`."""

    def __init__(self, module: ModuleType) -> None:
        import triton

        self.module = module
        self.version = triton.__version__
        self.failed: str | None = None  # why a launch failed; then nothing takes these kernels again

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether ``x`` takes these kernels (CUDA, or any device under ``STREAMWATCH_KERNEL=triton``),
        which no tensor does once a launch failed."""
        return self.failed is None and x.dtype in DTYPES and (x.device.type == "cuda" or forced())

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
        self._index: dict[tuple[int, ...], torch.Tensor] = {}

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
        layout = _layout(x, unit_dim)
        if layout is None:  # positions no single stride reaches: one copy first
            x = x.contiguous()
            layout = _layout(x, unit_dim)
            assert layout is not None
        wide = x.dtype == torch.float64
        k = self.kernels.module
        if unit_dim is None and x.is_contiguous():
            n = x.numel()
            per = _FLAT_BLOCK * -(-n // (_FLAT_BLOCK * _FLAT_PROGRAMS))
            programs = -(-n // per)
            first, row, _ = self._take([programs])
            k.flat_partials[(programs,)](
                x,
                x,
                x,
                n,
                per,
                self.partials,
                first,
                WIDE=wide,
                PACKED=False,
                DIFF=False,
                BLOCK=_FLAT_BLOCK,
                num_warps=_FLAT_WARPS,
            )
            return Row(self.partials, self.partials, self.partials, arena=self, part=row)
        samples, units, positions, sb, su, sp = layout
        bu, bp, warps, fold = _tile(su, sp, units, positions)
        tiles = -(-units // bu)
        # positions split over programs until there are about _FLAT_PROGRAMS (a batch of 8 sequences
        # of 1024 tokens would be 48 programs otherwise: a GPU mostly idle)
        splits = max(1, min(-(-positions // bp), _FLAT_PROGRAMS // (samples * tiles)))
        per_split = bp * -(-positions // (bp * splits))
        splits = -(-positions // per_split)
        first, row, offset = self._take(
            [samples * tiles * splits], units * (1 + samples) if unit_dim is not None else 0
        )
        lo, hi = bounds if bounds is not None else (0.0, 0.0)
        has_lo, has_hi = (
            bounds is not None and abs(lo) != float("inf"),
            bounds is not None and abs(hi) != float("inf"),
        )
        counts = self.units[offset : offset + units] if unit_dim is not None else None
        flags = self.units[offset + units :] if unit_dim is not None else self.units  # (sample, unit)
        k.tile_partials[(samples, tiles, splits)](
            x,
            units,
            positions,
            sb,
            su,
            sp,
            per_split,
            self.partials,
            first,
            counts if counts is not None else self.units,
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
        return Row(
            self.partials,
            self.partials,
            self.partials,
            unit_counts=counts,
            samples=samples,
            arena=self,
            part=row,
        )

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
        ncol = NCOL if counted else NCOL - 1
        parts = [r.part for r in rows] if rows is not None else list(range(len(self.segments)))
        segments = [self.segments[p] for p in parts]
        out = torch.empty(len(parts), ncol, dtype=torch.float64, device=self.device)
        if not parts:
            return out
        starts = self._device_index(tuple(s for s, _ in segments))
        lengths = self._device_index(tuple(c for _, c in segments))
        self.kernels.module.finalize[(len(parts),)](
            self.partials, starts, lengths, out, NCOL=ncol, BLOCK=_FINAL_BLOCK
        )
        return out

    def _device_index(self, values: tuple[int, ...]) -> torch.Tensor:
        found = self._index.get(values)
        if found is None:
            if len(self._index) >= _CACHED:
                self._index.clear()
            host = torch.tensor(values, dtype=torch.int64)
            found = self._index[values] = host.to(self.device, non_blocking=True)
        return found

    def reset(self) -> None:
        """Forget this step's rows (the buffers stay; the next step's kernels overwrite them in order)."""
        with self._lock:
            if self._units_used:
                self.units[: self._units_used].zero_()
            self.segments, self._used, self._units_used = [], 0, 0


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
