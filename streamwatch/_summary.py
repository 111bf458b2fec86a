"""Summaries: a tensor becomes a few device scalars; the host turns them into every statistic.

Pure functions only — no hooks, no threads. Two halves:

* :func:`summarize` runs on the training thread, where the tensor lives. It never calls ``.item()``,
  ``.cpu()`` or ``float()``: it returns 0-d device tensors, stacked once per step at the step boundary.
  Kernels per tensor (measured on a 2-core CPU for a 1024×1024 float32 tensor): ``sum`` ~42 µs, a
  BLAS ``dot`` for the sum of squares ~68 µs (``vector_norm`` is ~175 µs), ``aminmax`` ~118 µs, a sign
  mask written into a reused scratch buffer and counted with ``dot`` (``count_nonzero`` is 5-10x
  slower), per-unit activity from the same mask. The non-finite *flag* is free (``aminmax`` propagates
  NaN, ±inf shows in min/max); an exact non-finite *count* costs two more passes and is opt-in.
  Counts accumulate in float32 (float64 for float64 tensors): exact below 2**24 elements.
* :func:`finalize` runs on the worker, vectorised over all rows of a step with numpy: it merges rows of
  the same key (a module called twice, gradient accumulation), squares norms into sums of squares
  and derives mean, std, RMS, abs-max, zero and dead fractions.

Example:
    >>> import numpy as np, torch
    >>> from streamwatch._summary import COLUMNS, summarize, finalize, Raw
    >>> x = torch.tensor([[0.0, 2.0], [0.0, -1.0]])
    >>> row = summarize(x, unit_dim=1)
    >>> raw = Raw(keys=("a",), counts=np.array([4.0]), units=np.array([2.0]),
    ...           values=torch.stack(row.scalars).reshape(1, -1).numpy(), dead=np.array([1.0]),
    ...           nonfinite_counted=False, samples=np.array([2.0]), active=np.array([2.0]))
    >>> keys, table = finalize(raw)
    >>> dict(zip(COLUMNS, table[0].tolist()))["zeros"], dict(zip(COLUMNS, table[0].tolist()))["dead"]
    (2.0, 1.0)
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "COLUMNS",
    "DERIVED",
    "Raw",
    "Row",
    "derive",
    "finalize",
    "saturation_bounds",
    "summarize",
    "totals",
    "unit_dim_for",
]

DEVICE_STATS = ("sum", "sumsq", "min", "max", "nonzero", "nonfinite")
"""The device scalars per tensor, in this order (``nonfinite`` only when counted)."""

COLUMNS = ("count", "sum", "sumsq", "min", "max", "zeros", "nonfinite", "units", "dead", "samples", "active")
"""Columns of a finalized table: everything else derives from these, and all of them add up (or take
min/max) across rows, steps, shards and ranks — which is why sums of squares, not norms, are kept.
``units``/``dead``/``samples``/``active`` describe per-unit activity (monitorch): ``active`` counts the
(sample, unit) pairs in which the unit was active anywhere in its positions."""

DERIVED = ("mean", "std", "var", "l2", "rms", "absmax", "zero_fraction", "dead_fraction", "activation_rate")
"""Statistics :func:`derive` computes from the columns."""

_RTOL, _ATOL = 1e-5, 1e-8  # torch.isclose's defaults: "at a saturation bound" means isclose to it
_INF = float("inf")
_BOUNDS: dict[type[torch.nn.Module], tuple[float, float]] = {
    torch.nn.Sigmoid: (0.0, 1.0),
    torch.nn.Hardsigmoid: (0.0, 1.0),
    torch.nn.Tanh: (-1.0, 1.0),
    torch.nn.Softsign: (-1.0, 1.0),
    torch.nn.ReLU6: (0.0, 6.0),
    torch.nn.LogSigmoid: (-_INF, 0.0),
    torch.nn.SELU: (-1.7580993408473766, _INF),  # -scale * alpha
    torch.nn.Tanhshrink: (-_INF, _INF),  # never saturates
}


def saturation_bounds(module: torch.nn.Module) -> tuple[float, float] | None:
    """Where ``module``'s output saturates (zero gradient): an output at a bound is *inactive*.

    monitorch's definition of activity. None means the default bound, exact zero (ReLU and everything
    that is not a saturating activation); streamwatch then counts exact zeros, where monitorch counts
    ``|y| <= 1e-8`` — identical for ReLU-family outputs, which are exactly zero when inactive.

    Example:
        >>> import torch
        >>> saturation_bounds(torch.nn.Sigmoid()), saturation_bounds(torch.nn.ReLU())
        ((0.0, 1.0), None)
    """
    bounds = _BOUNDS.get(type(module))
    if bounds is not None:
        return bounds
    if isinstance(module, torch.nn.Hardtanh):  # also ReLU6's base: read its own limits
        return (float(module.min_val), float(module.max_val))
    if isinstance(module, torch.nn.ELU | torch.nn.CELU):
        return (-float(module.alpha), _INF)
    if isinstance(module, torch.nn.Threshold):
        return (float(module.value), _INF)
    return None


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


@dataclass(frozen=True, slots=True)
class Row:
    """The device scalars of one summarized tensor (see :data:`DEVICE_STATS`), plus per-unit activity."""

    scalars: list[torch.Tensor]
    unit_counts: torch.Tensor | None = None  # 1-D float32: per unit, the samples in which it was active
    samples: int = 0  # the batch size behind unit_counts


class _Scratch(threading.local):
    """Per-thread reusable buffers, two per (device, dtype) (hooks run on the training thread, and on
    CUDA also on autograd's device threads). Kernels on one stream run in order, so a buffer may be
    rewritten as soon as the reductions reading it are enqueued."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}


_SCRATCH = _Scratch()


def _scratch(x: torch.Tensor, slot: int = 0) -> torch.Tensor:
    """A scratch tensor shaped like ``x`` (contiguous), reused across calls on this thread."""
    key = (x.device, x.dtype, slot)
    buffer = _SCRATCH.buffers.get(key)
    n = x.numel()
    if buffer is None or buffer.numel() < n:
        buffer = torch.empty(n, dtype=x.dtype, device=x.device)
        _SCRATCH.buffers[key] = buffer
    return buffer[:n].view(x.shape)


def release_scratch() -> None:
    """Free this thread's scratch buffers (``Watch.close`` calls it)."""
    _SCRATCH.buffers.clear()


def unit_dim_for(x: torch.Tensor, channel_last: bool) -> int | None:
    """The dimension that indexes units (neurons/channels) of a batched tensor, or None (no units).

    monitorch's convention: ``[batch, features, *spatial]`` by default, ``[batch, ..., features]``
    with ``channel_last``. A tensor with fewer than two dimensions has no batch to be dead across.
    """
    if x.dim() < 2:
        return None
    return x.dim() - 1 if channel_last else 1


def summarize(
    x: torch.Tensor,
    *,
    unit_dim: int | None = None,
    count_nonfinite: bool = False,
    bounds: tuple[float, float] | None = None,
) -> Row:
    """Device scalars of a real floating tensor: sum, sum of squares, min, max, nonzero and non-finite counts.

    No host synchronisation: every result stays on ``x``'s device. ``x`` must be a dense, non-empty,
    real floating tensor (callers convert or skip the rest and count them). Accumulation is float32
    (float64 for float64 inputs) so half-precision sums of squares cannot overflow.

    Args:
        x: the tensor; it is only read.
        unit_dim: if given, also return per-unit activity along this dimension (dead units, activation
            rate); dimension 0 is the batch.
        bounds: the module's saturation bounds (:func:`saturation_bounds`): activity is "not at a
            bound" instead of "nonzero".
        count_nonfinite: also count NaN/Inf elements exactly (one more pass); otherwise there are five
            scalars and :func:`finalize` reports a 0/1 presence flag derived for free from min/max/sum.

    Example:
        >>> import torch
        >>> row = summarize(torch.tensor([1.0, -2.0, 0.0]))
        >>> [round(float(s), 4) for s in row.scalars[:5]]
        [-1.0, 5.0, -2.0, 1.0, 2.0]
    """
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    # BLAS dot is 2.5-3x faster than vector_norm for a sum of squares (and more accurate); half
    # precision goes through vector_norm, which accumulates in float32 and cannot overflow.
    blas = x.dtype in (torch.float32, torch.float64) and x.is_contiguous()
    total = x.sum(dtype=acc)
    if blas:
        flat = x.view(-1)
        sumsq = torch.dot(flat, flat)
    else:
        sumsq = torch.linalg.vector_norm(x, dtype=acc).square()
    low, high = torch.aminmax(x)
    # The sign mask (±1 where nonzero, 0 where zero; sign(NaN) is 0) is written into a reused scratch
    # buffer: a fresh full-size temporary per tensor costs page faults that dwarf the pass itself.
    active = _scratch(x)
    torch.sign(x, out=active)
    if blas and unit_dim is None:
        mask = active.view(-1)
        nonzero = torch.dot(mask, mask)  # sign² is the nonzero indicator: no abs pass needed
    else:
        active.abs_()
        nonzero = active.sum(dtype=acc)
    scalars = [total, sumsq, low, high, nonzero]
    if count_nonfinite:  # x - x is 0 where finite and NaN at NaN/±inf: count those, in the scratch too
        scalars.append(torch.sub(x, x, out=_scratch(x, 1)).nan_to_num_(nan=1.0).sum(dtype=acc))
    if unit_dim is None:
        return Row(scalars)
    if bounds is not None:
        active = _inside(x, bounds)
    if x.dim() > 2:  # a (sample, unit) pair is active if the unit is active anywhere in its positions
        positions = [d for d in range(1, x.dim()) if d != unit_dim]
        active = active.amax(dim=positions)
    return Row(scalars, active.sum(0, dtype=torch.float32), x.shape[0])


@dataclass(frozen=True, slots=True)
class Raw:
    """One step's rows as copied off the device, before merging (built by the step boundary).

    Attributes:
        keys: one hashable key per row; equal keys are merged by :func:`finalize`.
        counts: elements per row.
        units: units per row (0 where no unit activity was taken).
        values: ``(rows, 5)`` device scalars on the host (``(rows, 6)`` with the non-finite count).
        dead: dead units per row (NaN where not taken), already merged across repeats of a key.
        nonfinite_counted: whether the ``nonfinite`` column holds exact counts.
        samples: batch size per row (0 where no unit activity was taken); repeats of a key add up.
        active: active (sample, unit) pairs per row (NaN where not taken), merged like ``dead``.
    """

    keys: tuple[Hashable, ...]
    counts: np.ndarray
    units: np.ndarray
    values: np.ndarray
    dead: np.ndarray
    nonfinite_counted: bool
    samples: np.ndarray | None = None
    active: np.ndarray | None = None


def finalize(raw: Raw) -> tuple[tuple[Hashable, ...], np.ndarray]:
    """Merge rows with equal keys and produce the ``(unique keys, table)`` in :data:`COLUMNS` order.

    Vectorised with numpy over all rows; runs on the worker thread. Merging: counts, sums, sums of
    squares, zeros and non-finite counts add; min/max take min/max; units and dead units come from the
    first row of a key (the step boundary already merged per-unit activity across repeats).
    """
    return merged(raw.keys, unmerged(raw), raw.nonfinite_counted)


def merged(
    keys: tuple[Hashable, ...], table: np.ndarray, counted: bool
) -> tuple[tuple[Hashable, ...], np.ndarray]:
    """``(keys, table)`` with rows of equal keys merged (see :func:`finalize`); as they are if all differ
    (known once per layout for a ``_record.Layout``)."""
    unique = getattr(keys, "unique", None)
    if unique if unique is not None else len(set(keys)) == len(keys):
        return keys, table
    return _merge(keys, table, counted=counted)


def unmerged(raw: Raw) -> np.ndarray:
    """The table of :func:`finalize` before rows with equal keys are merged (one row per raw row)."""
    values = np.asarray(raw.values, dtype=np.float64)
    n = len(raw.keys)
    table = np.empty((n, len(COLUMNS)), dtype=np.float64)
    table[:, 0] = raw.counts
    table[:, 1:5] = values[:, :4]  # sum, sumsq, min, max
    table[:, 5] = raw.counts - values[:, 4]
    # One check for the common case, every sum and bound finite: no NaN, no flag (isfinite never warns)
    finite = bool(np.isfinite(values[:, :4]).all())
    if raw.nonfinite_counted:
        table[:, 6] = values[:, 5]
    elif finite:
        table[:, 6] = 0.0
    else:  # presence flag, free: NaN propagates through min/max/sum, ±inf shows in min/max
        table[:, 6] = ~(np.isfinite(values[:, 0]) & np.isfinite(values[:, 2]) & np.isfinite(values[:, 3]))
    taken = raw.units > 0  # no unit activity taken: unknown, not 0
    table[:, 7] = np.where(taken, raw.units, np.nan)
    table[:, 8] = raw.dead
    table[:, 9] = np.where(taken, raw.samples, np.nan) if raw.samples is not None else np.nan
    table[:, 10] = raw.active if raw.active is not None else np.nan
    if not finite:
        # sign(NaN) is 0 on CPU, so the nonzero mask counts NaN elements as zeros (and an all-NaN unit as
        # dead): with a NaN present (aminmax propagates it) zeros and dead units are unknown, not wrong.
        has_nan = np.isnan(values[:, 2]) | np.isnan(values[:, 3])
        table[has_nan, 5] = np.nan
        table[has_nan, 8] = np.nan
        table[has_nan, 10] = np.nan
    return table


def _merge(
    keys: tuple[Hashable, ...], table: np.ndarray, counted: bool
) -> tuple[tuple[Hashable, ...], np.ndarray]:
    first: dict[Hashable, int] = {}
    for key in keys:
        first.setdefault(key, len(first))
    index = np.fromiter((first[k] for k in keys), dtype=np.intp, count=len(keys))
    out = np.zeros((len(first), table.shape[1]), dtype=np.float64)
    for col in (0, 1, 2, 5, 9):
        np.add.at(out[:, col], index, table[:, col])
    if counted:
        np.add.at(out[:, 6], index, table[:, 6])
    else:  # presence flags: any, not a sum
        np.maximum.at(out[:, 6], index, table[:, 6])
    out[:, 3] = np.inf
    out[:, 4] = -np.inf
    np.fmin.at(out[:, 3], index, table[:, 3])
    np.fmax.at(out[:, 4], index, table[:, 4])
    nan_min = np.zeros(len(first), dtype=bool)  # fmin skips NaN: put NaN back where any part had one
    np.logical_or.at(nan_min, index, np.isnan(table[:, 3]))
    out[nan_min, 3] = np.nan
    out[nan_min, 4] = np.nan
    order = np.unique(index, return_index=True)[1]
    for col in (7, 8, 10):  # per-unit activity was merged per key on the training thread
        out[:, col] = table[order, col]
    out[nan_min, 8] = np.nan  # a NaN in any call: dead units unknown, as for one call (see unmerged)
    out[nan_min, 10] = np.nan
    return tuple(first), out


_ADDED = tuple(COLUMNS.index(c) for c in ("count", "sum", "sumsq", "zeros", "nonfinite", "units", "dead"))
_MIN, _MAX = COLUMNS.index("min"), COLUMNS.index("max")
_UNITS, _SAMPLES, _ACTIVE = COLUMNS.index("units"), COLUMNS.index("samples"), COLUMNS.index("active")


def totals(table: np.ndarray, groups: Sequence[np.ndarray | list[int]]) -> np.ndarray:
    """One row per group of a finalized table's rows: their total, as one tensor made of all of them.

    ``count``, ``sum``, ``sumsq``, ``zeros``, ``nonfinite``, ``units`` and ``dead`` are added,
    ``min``/``max`` combined, ``active`` added and ``samples`` set so that ``activation_rate`` is the
    fraction of active (sample, unit) pairs over all the rows. Unknown (NaN) values are left out of a
    total, as PromQL's ``sum`` leaves out absent series; a total with no known value is unknown. The
    totals of a rank without per-layer detail (``observe(detail=...)``) and of a scrape over the series
    budget are these.

    Example:
        >>> t = np.full((3, len(COLUMNS)), np.nan)
        >>> t[:, 0], t[:, 2], t[:, 3] = 4.0, [1.0, 4.0, np.nan], [-1.0, -3.0, 0.0]
        >>> out = totals(t, [[0, 1], [2]])
        >>> out[:, 0].tolist(), out[:, 2].tolist(), out[:, 3].tolist()
        ([8.0, 4.0], [5.0, nan], [-3.0, 0.0])
    """
    out = np.full((len(groups), len(COLUMNS)), np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        for row, rows in enumerate(groups):
            part = table[rows]
            known = ~np.isnan(part)
            for column in _ADDED:
                if known[:, column].any():
                    out[row, column] = np.nansum(part[:, column])
            for column, combine in ((_MIN, np.nanmin), (_MAX, np.nanmax)):
                if known[:, column].any():
                    out[row, column] = combine(part[:, column])
            pairs = part[:, _SAMPLES] * part[:, _UNITS]  # (sample, unit) pairs of each row
            if (~np.isnan(pairs)).any() and out[row, _UNITS] > 0:
                out[row, _SAMPLES] = np.nansum(pairs) / out[row, _UNITS]
                if known[:, _ACTIVE].any():
                    out[row, _ACTIVE] = np.nansum(part[:, _ACTIVE])
    return out


def derive(table: np.ndarray) -> dict[str, np.ndarray]:
    """Every derived statistic, vectorised over the rows of a finalized table.

    ``var`` is the population variance ``sumsq/count - mean²`` (clipped at 0 against rounding); ``l2``
    is ``√sumsq``; ``rms`` is ``√(sumsq/count)``; ``absmax`` is ``max(|min|, |max|)``; fractions are
    per element (zeros) and per unit (dead); ``activation_rate`` is the fraction of (sample, unit) pairs
    in which the unit was active (monitorch). Ratios over a zero count are NaN (never an error).

    Example:
        >>> import numpy as np
        >>> t = np.array([[4, 2.0, 6.0, -1.0, 2.0, 1, 0, 2, 1, 2, 3]])
        >>> d = {k: round(float(v[0]), 4) for k, v in derive(t).items()}
        >>> d["mean"], d["std"], d["l2"], d["rms"], d["absmax"], d["zero_fraction"], d["dead_fraction"]
        (0.5, 1.118, 2.4495, 1.2247, 2.0, 0.25, 0.5)
        >>> d["activation_rate"]
        0.75
    """
    count, total, sumsq = table[:, 0], table[:, 1], table[:, 2]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = total / count
        var = np.maximum(sumsq / count - mean * mean, 0.0)
        return {
            "mean": mean,
            "std": np.sqrt(var),
            "var": var,
            "l2": np.sqrt(sumsq),
            "rms": np.sqrt(sumsq / count),
            "absmax": np.fmax(np.abs(table[:, 3]), np.abs(table[:, 4])),
            "zero_fraction": table[:, 5] / count,
            "dead_fraction": table[:, 8] / table[:, 7],
            "activation_rate": table[:, 10] / (table[:, 9] * table[:, 7]),
        }
