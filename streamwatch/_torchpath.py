"""The torch path's summaries: what CUDA, half-precision and subclass tensors take, in few launches.

Every sum of the column schema is an entry of one small Gram matrix. With the rows
``R = [1, x, x², sign x]`` of a tensor (flattened), ``R Rᵀ`` holds Σx ``(0,1)``, Σx² ``(1,1)``,
Σx³ ``(1,2)``, Σx⁴ ``(2,2)``, Σ|x| = Σ sign(x)·x ``(1,3)`` and the nonzero count Σ sign(x)² ``(3,3)``. So
one tensor is four dispatched ops on an accelerator (:func:`summarize`; a CPU takes five to eight
faster ones, :data:`FEW_LAUNCHES_ON_CPU`):

1. ``pow(x, [1, 2])`` writes x and x² into rows 1-2 of a reused scratch buffer, in the accumulation dtype
   (float32, float64 for float64 tensors: a float16 x² cannot overflow); row 0 holds ones for good;
2. ``sign`` of row 1 into row 3;
3. one ``mm`` of the rows with their transpose: the 4×4 Gram matrix;
4. ``aminmax`` of row 1: min and max (NaN if any element is NaN; ±inf shows: the non-finite flag is free).

Per-unit activity (dead units, activation rates) adds one ``vector_norm`` of the sign rows over the batch
(two for tensors with positions: the ∞-norm over them first). A group of tensors (parameters, their
gradients and updates: :class:`Packing`) is copied into one chunked buffer by one multi-tensor copy and
summarised by a fixed number of ops whatever its size (:func:`summarize_packed`: a batched Gram matrix per
chunk, one ``segment_reduce`` adding chunks into tensors, the extremes by ``_foreach_max``).

At the step boundary :func:`device_values` turns a step's rows into one flat tensor of one dtype, in the
schema's device order (``_schema.DEVICE``): one ``cat`` of the Gram matrices, one ``stack`` of the
extremes, one ``index_select`` of the entries; no ``stack`` or ``cat`` ever sees two dtypes (CUDA copies
such inputs one by one).

Matrix products run in float32 only where the backend computes float32 products exactly (IEEE): where
TF32 or bfloat16 products are allowed (``torch.set_float32_matmul_precision("high")``), the Gram matrices
are float64. Autocast is switched off around the ops (``mm`` would run in bfloat16 under it).

Example:
    >>> import torch
    >>> row = summarize(torch.tensor([1.0, -2.0, 0.0]))
    >>> [float(v) for v in row.values()][:6]  # sum, sumsq, min, max, nonzero, sumabs
    [-1.0, 5.0, -2.0, 1.0, 2.0, 3.0]
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from streamwatch._schema import DEVICE_NAMES

__all__ = [
    "GROUP_ELEMENTS",
    "Packing",
    "Packings",
    "Row",
    "batches",
    "device_values",
    "gram_dtype",
    "release_scratch",
    "summarize",
    "summarize_packed",
    "summarize_traced",
]

_INF = float("inf")
_RTOL, _ATOL = 1e-5, 1e-8  # torch.isclose's defaults: "at a saturation bound" means isclose to it

_ENTRY = {"sum": 1, "sumsq": 5, "nonzero": 15, "sumabs": 7, "sumcube": 6, "sumfourth": 10}
"""Where each sum is in a flattened 4×4 Gram matrix of ``[1, x, x², sign x]``."""
_PICK = [{**_ENTRY, "min": 16, "max": 17, "nonfinite": 18}[name] for name in DEVICE_NAMES]
"""Each device value's place in a row ``[Gram matrix (16), min, max, nonfinite]``, in the schema's order
(a schema with a sum the Gram matrix does not hold fails here, at import)."""

_GRAM_FROM_SUMS = [0, 1, 2, 3, 1, 2, 4, 5, 2, 4, 6, 7, 3, 5, 7, 8]
"""The Gram matrix of ``[1, x, x², sign x]`` from :func:`summarize_traced`'s nine sums (Σ1, Σx, Σx², Σsign x,
Σx³, Σ|x|, Σx⁴, Σx²·sign x, Σsign² x), row by row."""

_CHUNK = 1024
"""Elements per chunk of a :class:`Packing` (each tensor starts a chunk; its last is padded with zeros)."""
GROUP_ELEMENTS = 1 << 22
"""The most elements one :class:`Packing` holds (its buffers: 5 values per element, in float32 80 MB);
a larger tensor is summarised alone."""
FEW_LAUNCHES_ON_CPU = False
"""Whether CPU tensors take the few-launch ops of the module docstring (``pow``, one ``mm``) too. A CPU
pays no launches but ~10 µs of dispatch per op and its bandwidth, so by default it takes a copy and a
multiply for x and x², a batched product per chunk (both 2-3× faster there) and ``abs_``, ``amax``,
``sum`` for per-unit activity (norms are slow there) — five to eight ops. The
launch counts (``benchmarks/count_ops.py``, ``tests/test_launches.py``) set it: what they count on a CPU
is then what CUDA runs."""
SLICE_ELEMENTS = 1 << 24
"""A larger tensor is summarised in slices along its first dimension of about this many elements, so the
scratch rows stay within 4 of them (256 MB in float32) however large the tensor."""
_VIEWS_KEPT = 512
"""Scratch views remembered per thread (shapes repeat every step; a model fed ever-new shapes must not
grow the cache without bound)."""


@dataclass(frozen=True, slots=True)
class Row:
    """One summarised tensor on its device: its Gram matrix and extremes (see the module docstring).

    Attributes:
        gram: ``(4·k, 4)``: k Gram matrices one above the other, this row's at ``part`` (k > 1: a group's).
        low, high: 0-d, the smallest and largest element, in ``gram``'s dtype.
        nonfinite: 0-d, the exact NaN/±inf count (only when counted), in ``gram``'s dtype.
        unit_counts: 1-D: per unit, the samples in which it was active (per-unit activity), or None.
        samples: the batch size behind ``unit_counts``.
        part: this row's Gram matrix in ``gram``; for an ``arena`` row, its index there.
        arena: the Triton path's step arena (``_triton.Arena``) that holds this row's partial sums, or
            None; ``gram``, ``low`` and ``high`` are then placeholders. A row summarised in compiled code
            holds its own partials in ``gram`` (its arena a ``_triton.TracedArena``).
    """

    gram: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    nonfinite: torch.Tensor | None = None
    unit_counts: torch.Tensor | None = None
    samples: int = 0
    part: int = 0
    arena: Any = None

    def values(self) -> torch.Tensor:
        """The device values in the schema's order (``_schema.DEVICE``; ``nonfinite`` only when counted):
        for tests and references, not the hot path (the step boundary takes all rows at once)."""
        return device_values([self], self.nonfinite is not None)

    @property
    def scalars(self) -> list[torch.Tensor]:
        """:meth:`values` as a list of 0-d tensors."""
        return list(self.values().unbind())


@dataclass(slots=True)
class _Views:
    """Views of a thread's scratch rows for one tensor shape (made once: a view is a dispatched op)."""

    rows: torch.Tensor  # (4, n): [1; x; x²; sign x]
    rows_t: torch.Tensor  # (n, 4)
    powers: torch.Tensor  # (2, *shape): rows 1-2, what pow writes
    value: torch.Tensor  # (*shape): row 1, x in the accumulation dtype
    sign: torch.Tensor  # (*shape): row 3
    flat: torch.Tensor  # (n,): row 1
    exponents: torch.Tensor  # (2, 1, ..., 1): [1, 2]
    square: torch.Tensor  # (n,): row 2
    chunks: tuple[torch.Tensor, torch.Tensor] | None  # the rows as (C, 4, L) and (C, L, 4), if n = C·L


class _Scratch(threading.local):
    """Per-thread reusable buffers (hooks run on the training thread, and on CUDA also on autograd's
    device threads). Kernels on one stream run in order, so a buffer may be rewritten as soon as the
    ops reading it are enqueued."""

    def __init__(self) -> None:
        self.rows: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.views: dict[tuple[torch.device, torch.dtype, torch.Size], _Views] = {}
        self.chunks: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.other: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.picks: dict[tuple[torch.device, bool], torch.Tensor] = {}


_SCRATCH = _Scratch()


def release_scratch() -> None:
    """Free this thread's scratch buffers (``Watch.close`` calls it)."""
    _SCRATCH.__init__()  # type: ignore[misc]


def _exact_matmul(device: torch.device) -> bool:
    """Whether float32 matrix products on ``device`` are IEEE float32 (no TF32, no bfloat16 inside)."""
    backend = {"cuda": torch.backends.cuda, "cpu": torch.backends.mkldnn}.get(device.type)
    if backend is None:
        return True
    return getattr(backend.matmul, "fp32_precision", "none") in ("none", "ieee")


def gram_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``x``'s sums are computed in: float32, or float64 for float64 tensors and where float32
    products are not exact (:func:`_exact_matmul`)."""
    return torch.float64 if x.dtype == torch.float64 or not _exact_matmul(x.device) else torch.float32


def _views(x: torch.Tensor, dtype: torch.dtype) -> _Views:
    key = (x.device, dtype, x.shape)
    compiling = torch.compiler.is_compiling()  # (traced code makes its views: dynamo reads a kept view
    found = None if compiling else _SCRATCH.views.get(key)  # as a graph input, a non-leaf's .grad)
    if found is not None:
        return found
    n = x.numel()
    buffer = _SCRATCH.rows.get(key[:2])
    if buffer is None or buffer.shape[1] < n:
        buffer = torch.empty(4, max(n, 1024), dtype=dtype, device=x.device)
        buffer[0] = 1.0
        _SCRATCH.rows[key[:2]] = buffer
        _SCRATCH.views = {k: v for k, v in _SCRATCH.views.items() if k[:2] != key[:2]}  # (of the old one)
    if len(_SCRATCH.views) >= _VIEWS_KEPT:
        _SCRATCH.views.clear()
    rows = buffer[:, :n]
    exponents = torch.arange(1, 3, dtype=dtype, device=x.device).view(2, *([1] * x.dim()))  # [1, 2]
    chunks = None
    if n % _CHUNK == 0:
        chunked = rows.view(4, n // _CHUNK, _CHUNK).transpose(0, 1)
        chunks = (chunked, chunked.transpose(1, 2))
    found = _Views(
        rows,
        rows.t(),
        rows[1:3].view(2, *x.shape),
        rows[1].view(x.shape),
        rows[3].view(x.shape),
        rows[1],
        exponents,
        rows[2],
        chunks,
    )
    if not compiling:
        _SCRATCH.views[key] = found
    return found


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Autocast off while summarising (it would run ``mm`` in bfloat16); nothing to do when it is off."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _inside(x: torch.Tensor, bounds: tuple[float, float]) -> torch.Tensor:
    """1 where ``x`` is not at (isclose to) either saturation bound, else 0 — in ``x``'s dtype."""
    mask: torch.Tensor | None = None
    for bound in bounds:
        if bound in (_INF, -_INF):
            continue
        far = (x - bound).abs_() > (_ATOL + _RTOL * abs(bound))
        mask = far if mask is None else mask & far
    if mask is None:
        return torch.ones_like(x)
    return mask.to(x.dtype)


def summarize(
    x: torch.Tensor,
    *,
    unit_dim: int | None = None,
    count_nonfinite: bool = False,
    bounds: tuple[float, float] | None = None,
) -> Row:
    """The :class:`Row` of a dense, non-empty, real floating tensor, in four ops (module docstring).

    No host synchronisation: every result stays on ``x``'s device, and ``x`` is only read.

    Args:
        x: the tensor (any layout: strided views are read as they are).
        unit_dim: if given, also per-unit activity along this dimension (dimension 0 is the batch).
        count_nonfinite: also count NaN/Inf elements exactly (three more ops); otherwise
            ``_summary.finalize`` reports a 0/1 presence flag derived for free from min/max/sum.
        bounds: the module's saturation bounds (``_summary.saturation_bounds``): activity is "not at a
            bound" instead of "nonzero".
    """
    if torch.compiler.is_compiling():
        return summarize_traced(x, unit_dim, count_nonfinite, bounds)
    if x.numel() > SLICE_ELEMENTS and x.dim() and x.shape[0] > 1:
        return _sliced(x, unit_dim, count_nonfinite, bounds)
    dtype = gram_dtype(x)
    views = _views(x, dtype)
    few = FEW_LAUNCHES_ON_CPU or x.device.type != "cpu"
    with _no_autocast(x.device):
        if few:  # x and x² in one op
            torch.pow(x, views.exponents, out=views.powers)
        else:  # a CPU: a copy and a multiply, where pow takes a transcendental per element
            views.value.copy_(x)
            torch.mul(views.flat, views.flat, out=views.square)
        torch.sign(views.value, out=views.sign)
        if few or views.chunks is None:
            gram = torch.mm(views.rows, views.rows_t)
        else:  # a CPU: a Gram matrix per chunk, added (a 4×n product runs at a fraction of the bandwidth)
            gram = torch.bmm(*views.chunks).sum(0)
        low, high = torch.aminmax(views.flat)
        nonfinite = None
        if count_nonfinite:  # x - x is 0 where finite and NaN at NaN/±inf: count those
            nonfinite = torch.sub(views.flat, views.flat).nan_to_num_(nan=1.0).sum()
        if unit_dim is None:
            return Row(gram, low, high, nonfinite)
        active = views.sign if bounds is None else _inside(x, bounds)
        positions = [d for d in range(1, x.dim()) if d != unit_dim]
        if few:  # |sign| reduced by norms: one op over the samples (one more over the positions first)
            if positions:  # a (sample, unit) pair is active if the unit is active anywhere in its positions
                active = torch.linalg.vector_norm(active, _INF, dim=positions, dtype=dtype)
            counts = torch.linalg.vector_norm(active, 1, dim=0, dtype=dtype)
        else:  # a CPU: |sign| in place (the Gram matrix is taken), then max and sum (norms are slow there)
            if bounds is None:
                active.abs_()
            if positions:
                active = active.amax(dim=positions)
            counts = active.sum(0, dtype=dtype)
    return Row(gram, low, high, nonfinite, counts, x.shape[0])


def summarize_traced(
    x: torch.Tensor,
    unit_dim: int | None = None,
    count_nonfinite: bool = False,
    bounds: tuple[float, float] | None = None,
) -> Row:
    """:func:`summarize` in code ``torch.compile`` traces: the same values from plain ops, in float64
    (no scratch, no ``out=`` into views, no backend flags: Dynamo traces none of them; Inductor fuses
    what is left). Its Gram matrix is the row's own (4×4), its first entry the element count; its entries
    are reductions of the one input (no ``(4, n)`` rows in memory, no matrix product), which Inductor
    fuses into one kernel on the CPU (``torch._inductor.utils.run_and_get_code``; not looked at on a GPU)."""
    v = x.reshape(-1).to(torch.float64)
    sign = torch.sign(v)
    square = v * v
    sums = torch.stack(
        [
            v.new_full((), v.numel()),  # Σ1
            v.sum(),
            square.sum(),
            sign.sum(),
            (square * v).sum(),
            v.abs().sum(),
            (square * square).sum(),
            (square * sign).sum(),
            (sign * sign).sum(),
        ]
    )
    gram = sums[_GRAM_FROM_SUMS].view(4, 4)
    low, high = torch.aminmax(v)
    nonfinite = (v - v).nan_to_num(nan=1.0).sum() if count_nonfinite else None
    if unit_dim is None:
        return Row(gram, low, high, nonfinite)
    active = sign.view(x.shape) if bounds is None else _inside(x, bounds).to(torch.float64)
    if x.dim() > 2:
        positions = [d for d in range(1, x.dim()) if d != unit_dim]
        active = torch.linalg.vector_norm(active, _INF, dim=positions)
    return Row(gram, low, high, nonfinite, torch.linalg.vector_norm(active, 1, dim=0), x.shape[0])


def _sliced(
    x: torch.Tensor, unit_dim: int | None, count_nonfinite: bool, bounds: tuple[float, float] | None
) -> Row:
    """:func:`summarize` of a large tensor, slice by slice along dimension 0 (samples, for per-unit
    activity), the slices' Gram matrices and counts added, their extremes combined."""
    per = max(1, SLICE_ELEMENTS // (x.numel() // x.shape[0]))
    parts = [
        summarize(part, unit_dim=unit_dim, count_nonfinite=count_nonfinite, bounds=bounds)
        for part in x.split(per)
    ]
    with _no_autocast(x.device):
        gram = torch.stack([p.gram for p in parts]).sum(0)
        low = torch.stack([p.low for p in parts]).amin()
        high = torch.stack([p.high for p in parts]).amax()
        nonfinite = torch.stack([p.nonfinite for p in parts]).sum() if count_nonfinite else None  # type: ignore[misc]
        if unit_dim is None:
            return Row(gram, low, high, nonfinite)
        counts = torch.stack([p.unit_counts for p in parts]).sum(0)  # type: ignore[misc]
    return Row(gram, low, high, nonfinite, counts, x.shape[0])


class Packing:
    """Tensors of one layout (shapes, in order) packed into one chunked buffer of one device and dtype:
    each tensor starts a chunk of :data:`_CHUNK` elements, the rest of its last chunk stays zero (zeros
    add nothing to any sum). ``fill`` copies a list of such tensors in with one multi-tensor op;
    :attr:`views` are the tensors as they sit in it (contiguous, shaped like them).

    Example:
        >>> pack = Packing([torch.Size([2, 3]), torch.Size([3])], torch.device("cpu"), torch.float32)
        >>> pack.fill([torch.ones(2, 3), torch.arange(3.0)])
        >>> pack.buffer.shape, pack.views[1].tolist(), float(pack.buffer.sum())
        (torch.Size([2, 1024]), [0.0, 1.0, 2.0], 9.0)
    """

    def __init__(self, shapes: Sequence[torch.Size], device: torch.device, dtype: torch.dtype) -> None:
        starts, chunks = [], 0
        for shape in shapes:
            starts.append(chunks * _CHUNK)
            chunks += -(-shape.numel() // _CHUNK)
        self.shapes = tuple(shapes)
        self.device, self.dtype = device, dtype
        self.buffer = torch.zeros(chunks, _CHUNK, dtype=dtype, device=device)
        flat = self.buffer.view(-1)
        self.views = [
            flat[s : s + shape.numel()].view(shape) for s, shape in zip(starts, shapes, strict=True)
        ]
        # how many chunks each tensor has: the segments its chunks' sums are added over
        self.lengths = _on(device, [-(-shape.numel() // _CHUNK) for shape in shapes])
        self.rows: tuple[torch.Tensor, ...] = ()  # views of the thread's chunk scratch (summarize_packed)
        self._chunking: tuple[list[int], torch.Tensor] | None = None

    def chunking(self) -> tuple[list[int], torch.Tensor]:
        """``(chunks per tensor, valid elements per chunk on the device)``: what a kernel reading the
        buffer chunk by chunk needs to skip the padding (made once)."""
        if self._chunking is None:
            lengths, valid = [], []
            for shape in self.shapes:
                n = shape.numel()
                lengths.append(-(-n // _CHUNK))
                valid += [_CHUNK] * (n // _CHUNK) + ([n % _CHUNK] if n % _CHUNK else [])
            self._chunking = lengths, _on(self.device, valid)
        return self._chunking

    def fill(self, tensors: list[torch.Tensor]) -> None:
        """Copy ``tensors`` (of this packing's shapes, any dtype) in: one multi-tensor copy."""
        torch._foreach_copy_(self.views, tensors)


def batches(sizes: Sequence[int], most: int = GROUP_ELEMENTS) -> list[range]:
    """Consecutive runs of tensors (by their ``sizes``) of at most ``most`` elements each; a larger
    tensor makes a run of its own.

    Example:
        >>> batches([3, 3, 3, 9, 1], most=6)
        [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    """
    runs: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > most:
            runs.append(range(start, i))
            start, total = i, 0
        total += size
    if sizes:
        runs.append(range(start, len(sizes)))
    return runs


KEPT_ELEMENTS = 1 << 25
"""The most elements the packings of one :class:`Packings` keep (128 MB in float32): a larger model's
packings beyond it are made for each use (one allocation and a view per tensor: ops, no kernels)."""


class Packings:
    """Packings by layout, kept while they hold at most :data:`KEPT_ELEMENTS` in all (layouts repeat
    every step: a packing's views are made once).

    Example:
        >>> packs = Packings()
        >>> a, b = torch.ones(3), torch.ones(2, 2)
        >>> pack, flipped = packs.get([a, b])
        >>> packs.get([a, b]) == (pack, False), packs.get([b, a]) == (pack, True)
        (True, True)
    """

    def __init__(self, kept: int = KEPT_ELEMENTS) -> None:
        self._kept = kept
        self._packs: dict[tuple[Any, ...], Packing] = {}
        self._elements = 0

    def get(self, tensors: Sequence[torch.Tensor], either_order: bool = True) -> tuple[Packing, bool]:
        """``(packing, flipped)``: the packing of ``tensors``' layout on their device in their
        :func:`gram_dtype` (float64 if any is), or with ``either_order`` that of the reversed layout
        (``flipped``: gradients come in backward order, weights in forward order; one packing serves
        both)."""
        device = tensors[0].device
        dtype = max((gram_dtype(t) for t in tensors), key=lambda d: d.itemsize)
        shapes = tuple(t.shape for t in tensors)
        found = self._packs.get((device, dtype, shapes))
        if found is not None:
            return found, False
        if either_order:
            found = self._packs.get((device, dtype, shapes[::-1]))
            if found is not None:
                return found, True
        pack = Packing(shapes, device, dtype)
        if self._elements + pack.buffer.numel() <= self._kept:
            self._packs[(device, dtype, shapes)] = pack
            self._elements += pack.buffer.numel()
        return pack, False


def summarize_packed(pack: Packing, reverse: bool = False) -> list[Row]:
    """The :class:`Row` of every tensor in ``pack``, in a fixed number of ops whatever their number:
    ``pow`` and ``sign`` into a chunked scratch of rows, one batched product for each chunk's Gram
    matrix, one ``segment_reduce`` adding chunks into tensors (in order: deterministic); the extremes by
    two ``_foreach_max`` calls (on the tensors and their negations) and two ``_foreach_neg``. With
    ``reverse``, the rows of the tensors in reverse order (one ``flip`` more).

    Example:
        >>> pack = Packing([torch.Size([3]), torch.Size([2])], torch.device("cpu"), torch.float32)
        >>> pack.fill([torch.tensor([1.0, -2.0, 0.0]), torch.tensor([4.0, 4.0])])
        >>> [[float(v) for v in row.values()][:5] for row in summarize_packed(pack)]
        [[-1.0, 5.0, -2.0, 1.0, 2.0], [8.0, 32.0, 4.0, 4.0, 2.0]]
    """
    chunks = pack.buffer.shape[0]
    key = (pack.device, pack.dtype)
    scratch = _SCRATCH.chunks.get(key)
    if scratch is None or scratch.shape[0] < chunks:
        scratch = torch.empty(chunks, 4, _CHUNK, dtype=pack.dtype, device=pack.device)
        scratch[:, 0] = 1.0
        _SCRATCH.chunks[key] = scratch
    if not pack.rows or pack.rows[0] is not scratch:  # views made once (a view is a dispatched op)
        rows = scratch[:chunks]
        pack.rows = (scratch, rows, rows.transpose(1, 2), rows[:, 1:3], rows[:, 3], pack.buffer.unsqueeze(1))
    _, rows, rows_t, powers, sign, values = pack.rows
    with _no_autocast(pack.device):
        torch.pow(values, _exponents(pack.device, pack.dtype), out=powers)
        torch.sign(pack.buffer, out=sign)
        grams = torch.bmm(rows, rows_t).view(chunks, 16)
        # each tensor's chunks added up, in order (a product with a 0/1 matrix would make 0·inf = NaN)
        gram = torch.segment_reduce(grams, "sum", lengths=pack.lengths, axis=0, unsafe=True)
        highs = torch._foreach_max(pack.views)
        lows = torch._foreach_neg(torch._foreach_max(torch._foreach_neg(pack.views)))
        if reverse:  # (one flip: the step boundary then takes the whole pack in one piece)
            gram, lows, highs = gram.flip(0), lows[::-1], highs[::-1]
    gram = gram.view(-1, 4)
    return [Row(gram, low, high, part=i) for i, (low, high) in enumerate(zip(lows, highs, strict=True))]


def _exponents(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    key = (device, dtype)
    found = _SCRATCH.other.get(key)
    if found is None:
        found = _SCRATCH.other[key] = torch.arange(1, 3, dtype=dtype, device=device).view(2, 1)  # [1, 2]
    return found


def device_values(rows: Iterable[Row], counted: bool) -> torch.Tensor:
    """A step's rows as one flat tensor of one dtype (float64 if any row is), each row's device values
    in the schema's order (``_schema.DEVICE``; ``nonfinite`` last, only when ``counted``): one ``cat`` of
    the Gram matrices (a group's whole, when its rows are all there in order), one ``stack`` of the
    extremes, one ``cat`` and one ``index_select`` — whatever the number of rows.

    Example:
        >>> rows = [summarize(torch.tensor([1.0, -2.0])), summarize(torch.tensor([3.0], dtype=torch.float64))]
        >>> values = device_values(rows, False)
        >>> values.dtype, values.view(2, -1)[:, :4].tolist()
        (torch.float64, [[-1.0, 5.0, -2.0, 1.0], [3.0, 9.0, 3.0, 3.0]])
    """
    rows = list(rows)
    if any(row.arena is not None for row in rows):
        return _with_arenas(rows, counted)
    runs: list[list[Any]] = []  # [gram, first part, last part]
    extremes: list[torch.Tensor] = []
    nonfinite: list[torch.Tensor] = []
    for row in rows:
        run = runs[-1] if runs else None
        if run is not None and run[0] is row.gram and run[2] + 1 == row.part:
            run[2] += 1
        else:
            runs.append([row.gram, row.part, row.part])
        extremes += (row.low, row.high)
        if counted:
            nonfinite.append(row.nonfinite if row.nonfinite is not None else row.low.new_zeros(()))
    grams = [g if (a, 4 * b + 4) == (0, g.shape[0]) else g[4 * a : 4 * b + 4] for g, a, b in runs]
    device = grams[0].device
    if any(g.device != device for g in grams):  # several devices (model parallel): gather them first
        grams = [g.to(device) for g in grams]
        extremes = [v.to(device) for v in extremes]
        nonfinite = [v.to(device) for v in nonfinite]
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grams) else grams[0].dtype
    if any(g.dtype != dtype for g in grams):  # (float32 and float64 tensors in one step: rare)
        grams = [g.to(dtype) for g in grams]
        extremes = [v.to(dtype) for v in extremes]
        nonfinite = [v.to(dtype) for v in nonfinite]
    gram = grams[0] if len(grams) == 1 else torch.cat(grams)
    n = gram.shape[0] // 4
    parts = [gram.view(n, 16), torch.stack(extremes).view(n, 2)]
    if counted:
        parts.append(torch.stack(nonfinite).view(n, 1))
    table = torch.cat(parts, 1)
    return table.index_select(1, _pick(table.device, counted)).view(-1)


def _with_arenas(rows: list[Row], counted: bool) -> torch.Tensor:
    """:func:`device_values` of a step with rows the Triton path summarised: each arena's rows finalized
    in one launch (float64; the rows from compiled code after one ``cat`` of their partials); rows of the
    torch path beside them joined by one ``cat`` and put back in order by one ``index_select``."""
    groups: dict[int, list[int]] = {}  # id(arena) or 0 (torch rows) -> positions in rows
    for i, row in enumerate(rows):
        groups.setdefault(0 if row.arena is None else id(row.arena), []).append(i)
    tables = []
    for key, positions in groups.items():
        members = [rows[i] for i in positions]
        if key == 0:
            tables.append(device_values(members, counted).view(len(members), -1).to(torch.float64))
        else:
            arena = members[0].arena  # (an Arena, or the TracedArena of rows from compiled code)
            try:
                tables.append(arena.table(counted, members))
            except Exception as exc:  # (this step's record is lost, counted; the torch path from now on)
                arena.kernels.give_up(exc)
                raise
    if len(tables) == 1:
        return tables[0].view(-1)
    device = tables[0].device
    table = torch.cat([t.to(device) for t in tables])
    order = [i for positions in groups.values() for i in positions]
    back = sorted(range(len(order)), key=order.__getitem__)  # where each row of rows sits in table
    return table.index_select(0, _on(device, back)).view(-1)


def _pick(device: torch.device, counted: bool) -> torch.Tensor:
    """The entries :func:`device_values` takes from each row, as an index on ``device`` (made once)."""
    found = _SCRATCH.picks.get((device, counted))
    if found is None:
        pick = _PICK if counted else _PICK[:-1]
        found = _SCRATCH.picks[(device, counted)] = _on(device, pick)
    return found


def _on(device: torch.device, values: list[int]) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, copied without waiting: a blocking host-to-device copy
    is a host sync (``torch.tensor(..., device=)`` makes one), which the training thread never makes."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)
