"""Summaries: a tensor becomes a few device scalars; the host turns them into every statistic.

Pure functions only — no hooks, no threads. Two halves:

* :func:`summarize` runs on the training thread, where the tensor lives (``_torchpath.py``: the torch
  path, which CUDA, half-precision and subclass tensors take; CPU float32/float64 tensors take the fused C
  kernel, ``_kernel.py``). It never calls ``.item()``, ``.cpu()`` or ``float()``: every sum of the schema
  is an entry of one 4×4 Gram matrix of ``[1, x, x², sign x]``, so a tensor is four dispatched ops
  (``pow``, ``sign``, ``mm``, ``aminmax``), per-unit activity one or two more, and the step boundary
  turns all rows into one flat tensor of one dtype with a fixed number of ops. The non-finite *flag* is
  free (``aminmax`` propagates NaN, ±inf shows in min/max); an exact non-finite *count* costs three more
  ops and is opt-in. Sums accumulate in float32 (float64 for float64 tensors, and where float32 matrix
  products are not exact): counts are exact below 2**24 elements.
* :func:`finalize` runs on the worker, vectorised over all rows of a step with numpy: it merges rows of
  the same key (a module called twice, gradient accumulation) and :func:`derive` computes mean, std,
  RMS, abs-max, zero and dead fractions from the columns.

Which values the device computes, the table's columns and how each merges are declared once, in
``_schema.py``; everything here indexes them by name.

Example:
    >>> import numpy as np, torch
    >>> from streamwatch._summary import COLUMNS, summarize, finalize, Raw
    >>> x = torch.tensor([[0.0, 2.0], [0.0, -1.0]])
    >>> row = summarize(x, unit_dim=1)
    >>> raw = Raw(keys=("a",), counts=np.array([4.0]), units=np.array([2.0]),
    ...           values=row.values().reshape(1, -1).numpy(), dead=np.array([1.0]),
    ...           nonfinite_counted=False, samples=np.array([2.0]), active=np.array([2.0]))
    >>> keys, table = finalize(raw)
    >>> dict(zip(COLUMNS, table[0].tolist()))["zeros"], dict(zip(COLUMNS, table[0].tolist()))["dead"]
    (2.0, 1.0)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import ArrayLike

from streamwatch import _schema
from streamwatch._schema import COLUMN, DEVICE_INDEX
from streamwatch._torchpath import Row, release_scratch, summarize

__all__ = [
    "COLUMNS",
    "DERIVED",
    "DEVICE_STATS",
    "Raw",
    "Row",
    "derive",
    "finalize",
    "release_scratch",
    "saturation_bounds",
    "summarize",
    "table",
    "totals",
    "unit_dim_for",
]

DEVICE_STATS = _schema.DEVICE_NAMES
"""The device scalars per tensor, in this order (``nonfinite``, the last, only when counted on the torch
path): ``_schema.DEVICE``."""

COLUMNS = _schema.COLUMN_NAMES
"""Columns of a finalized table (``_schema.COLUMNS``): everything else derives from these, and all of
them add up (or take min/max) across rows, steps, shards and ranks — which is why sums of squares, not
norms, are kept. ``units``/``dead``/``samples``/``active`` describe per-unit activity (monitorch):
``active`` counts the (sample, unit) pairs in which the unit was active anywhere in its positions."""

DERIVED = tuple(name for name, _ in _schema.DERIVED)
"""Statistics :func:`derive` computes from the columns (``_schema.DERIVED``)."""

_COPIED = [COLUMN[c.name] for c in _schema.COLUMNS if c.device]
_COPIED_FROM = [DEVICE_INDEX[c.name] for c in _schema.COLUMNS if c.device]
"""Columns that copy the device value of their name, and those values' positions."""
_BOUNDS_KNOWN = [DEVICE_INDEX[name] for name in ("sum", "sumsq", "min", "max")]
"""Device values that are all finite when the tensor is (the common case, checked in one call)."""
_NAN_UNKNOWN = np.array([COLUMN[c.name] for c in _schema.COLUMNS if c.nan_unknown], dtype=np.intp)
_REPEAT = {kind: [COLUMN[c.name] for c in _schema.COLUMNS if c.repeat == kind] for kind in ("add", "first")}
_MERGE = {
    kind: [COLUMN[c.name] for c in _schema.COLUMNS if c.merge == kind] for kind in ("add", "min", "max")
}
_NONFINITE, _MIN, _MAX = COLUMN["nonfinite"], COLUMN["min"], COLUMN["max"]


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


def unit_dim_for(x: torch.Tensor, channel_last: bool) -> int | None:
    """The dimension that indexes units (neurons/channels) of a batched tensor, or None (no units).

    monitorch's convention: ``[batch, features, *spatial]`` by default, ``[batch, ..., features]``
    with ``channel_last``. A tensor with fewer than two dimensions has no batch to be dead across.
    """
    if x.dim() < 2:
        return None
    return x.dim() - 1 if channel_last else 1


@dataclass(frozen=True, slots=True)
class Raw:
    """One step's rows as copied off the device, before merging (built by the step boundary).

    Attributes:
        keys: one hashable key per row; equal keys are merged by :func:`finalize`.
        counts: elements per row.
        units: units per row (0 where no unit activity was taken).
        values: ``(rows, len(DEVICE_STATS) - 1)`` device scalars on the host (``(rows, len(DEVICE_STATS))``
            with the non-finite count, the last).
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
    table[:, COLUMN["count"]] = raw.counts
    table[:, _COPIED] = values[:, _COPIED_FROM]  # sum, sumsq, min, max, ...: as the device gave them
    table[:, COLUMN["zeros"]] = raw.counts - values[:, DEVICE_INDEX["nonzero"]]
    # One check for the common case, every sum and bound finite: no NaN, no flag (isfinite never warns)
    finite = bool(np.isfinite(values[:, _BOUNDS_KNOWN]).all())
    total, low, high = (values[:, DEVICE_INDEX[name]] for name in ("sum", "min", "max"))
    if raw.nonfinite_counted:
        table[:, _NONFINITE] = values[:, DEVICE_INDEX["nonfinite"]]
    elif finite:
        table[:, _NONFINITE] = 0.0
    else:  # presence flag, free: NaN propagates through min/max/sum, ±inf shows in min/max
        table[:, _NONFINITE] = ~(np.isfinite(total) & np.isfinite(low) & np.isfinite(high))
    taken = raw.units > 0  # no unit activity taken: unknown, not 0
    table[:, COLUMN["units"]] = np.where(taken, raw.units, np.nan)
    table[:, COLUMN["dead"]] = raw.dead
    samples = np.where(taken, raw.samples, np.nan) if raw.samples is not None else np.nan
    table[:, COLUMN["samples"]] = samples
    table[:, COLUMN["active"]] = raw.active if raw.active is not None else np.nan
    if not finite:
        # sign(NaN) is 0 on CPU, so the nonzero mask counts NaN elements as zeros (and an all-NaN unit as
        # dead): with a NaN present (aminmax propagates it) zeros and dead units are unknown, not wrong.
        has_nan = np.isnan(low) | np.isnan(high)
        table[np.ix_(has_nan, _NAN_UNKNOWN)] = np.nan
    return table


def _merge(
    keys: tuple[Hashable, ...], table: np.ndarray, counted: bool
) -> tuple[tuple[Hashable, ...], np.ndarray]:
    """Rows of equal keys merged as each column's ``repeat`` says (``_schema.COLUMNS``)."""
    first: dict[Hashable, int] = {}
    for key in keys:
        first.setdefault(key, len(first))
    index = np.fromiter((first[k] for k in keys), dtype=np.intp, count=len(keys))
    out = np.zeros((len(first), table.shape[1]), dtype=np.float64)
    with np.errstate(invalid="ignore"):  # +inf from one call and -inf from another: NaN, silently
        for col in _REPEAT["add"]:
            if col == _NONFINITE and not counted:  # presence flags: any, not a sum
                np.maximum.at(out[:, col], index, table[:, col])
            else:
                np.add.at(out[:, col], index, table[:, col])
    out[:, _MIN] = np.inf
    out[:, _MAX] = -np.inf
    np.fmin.at(out[:, _MIN], index, table[:, _MIN])
    np.fmax.at(out[:, _MAX], index, table[:, _MAX])
    nan_min = np.zeros(len(first), dtype=bool)  # fmin skips NaN: put NaN back where any part had one
    np.logical_or.at(nan_min, index, np.isnan(table[:, _MIN]))
    out[nan_min, _MIN] = np.nan
    out[nan_min, _MAX] = np.nan
    order = np.unique(index, return_index=True)[1]
    for col in _REPEAT["first"]:  # per-unit activity was merged per key on the training thread
        out[:, col] = table[order, col]
        if col in _NAN_UNKNOWN:  # a NaN in any call: unknown, as for one call (see unmerged)
            out[nan_min, col] = np.nan
    return tuple(first), out


def totals(table: np.ndarray, groups: Sequence[np.ndarray | list[int]]) -> np.ndarray:
    """One row per group of a finalized table's rows: their total, as one tensor made of all of them,
    each column combined as its ``merge`` says (``_schema.COLUMNS``): added, the extremes combined,
    ``samples`` such that ``samples × units`` adds up. Unknown (NaN) values are left out, as PromQL's
    ``sum`` leaves out absent series; a column with no known value is unknown. The totals of a rank
    without per-layer detail (``observe(detail=...)``) and of a scrape over the series budget are these.

    Example:
        >>> part = table(count=[4, 2], sumsq=[9.0, np.nan], min=[-1.0, -3.0], units=[2, 4], samples=[8, 2])
        >>> row = dict(zip(COLUMNS, totals(part, [[0, 1]])[0].tolist()))
        >>> row["count"], row["sumsq"], row["min"], row["units"], row["samples"], row["zeros"]
        (6.0, 9.0, -3.0, 6.0, 4.0, nan)
    """
    out = np.full((len(groups), table.shape[1]), np.nan)
    units, samples = COLUMN["units"], COLUMN["samples"]
    with np.errstate(invalid="ignore", divide="ignore"):
        for row, rows in enumerate(groups):
            part = table[rows]
            known = ~np.isnan(part)
            for kind, combine in (("add", np.nansum), ("min", np.nanmin), ("max", np.nanmax)):
                for column in _MERGE[kind]:
                    if known[:, column].any():
                        out[row, column] = combine(part[:, column])
            pairs = part[:, samples] * part[:, units]  # (sample, unit) pairs of each row
            if (~np.isnan(pairs)).any() and out[row, units] > 0:
                out[row, samples] = np.nansum(pairs) / out[row, units]
    return out


def table(rows: int | None = None, *, fill: float = np.nan, **columns: ArrayLike) -> np.ndarray:
    """A summary table built by column name: each keyword a column of :data:`COLUMNS` (a number for every
    row, or one per row), every other column ``fill`` (default NaN: unknown). ``rows`` defaults to the
    length of the longest column given (1 if all are numbers). For tests, docs and records built by hand
    (``streamwatch.testing.table``); a misspelt column is an error, never a silent extra.

    Example:
        >>> t = table(count=4, sumsq=[9.0, 16.0], fill=0.0)
        >>> t.shape == (2, len(COLUMNS)), t[:, COLUMNS.index("sumsq")].tolist(), float(t[1, 0])
        (True, [9.0, 16.0], 4.0)
        >>> table(sumsquares=1.0)
        Traceback (most recent call last):
        ...
        ValueError: Expected column names from streamwatch._summary.COLUMNS, got ['sumsquares']
    """
    unknown = sorted(set(columns) - set(COLUMN))
    if unknown:
        raise ValueError(f"Expected column names from streamwatch._summary.COLUMNS, got {unknown}")
    given = {name: np.asarray(value, dtype=np.float64) for name, value in columns.items()}
    if rows is None:
        rows = max((len(v) for v in given.values() if v.ndim), default=1)
    out = np.full((rows, len(COLUMNS)), fill, dtype=np.float64)
    for name, value in given.items():
        out[:, COLUMN[name]] = value
    return out


def derive(table: np.ndarray) -> dict[str, np.ndarray]:
    """Every derived statistic, vectorised over the rows of a finalized table.

    ``var`` is the population variance ``sumsq/count - mean²`` (clipped at 0 against rounding); ``l2``
    is ``√sumsq``; ``rms`` is ``√(sumsq/count)``; ``absmax`` is ``max(|min|, |max|)``; fractions are
    per element (zeros) and per unit (dead); ``activation_rate`` is the fraction of (sample, unit) pairs
    in which the unit was active (monitorch). Ratios over a zero count are NaN (never an error).

    Example:
        >>> t = table(count=4, sum=2.0, sumsq=6.0, min=-1.0, max=2.0, zeros=1, nonfinite=0, units=2, dead=1,
        ...           samples=2, active=3)
        >>> d = {k: round(float(v[0]), 4) for k, v in derive(t).items()}
        >>> d["mean"], d["std"], d["l2"], d["rms"], d["absmax"], d["zero_fraction"], d["dead_fraction"]
        (0.5, 1.118, 2.4495, 1.2247, 2.0, 0.25, 0.5)
        >>> d["activation_rate"]
        0.75
    """
    column = {name: table[:, i] for name, i in COLUMN.items()}
    count, total, sumsq = column["count"], column["sum"], column["sumsq"]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = total / count
        var = np.maximum(sumsq / count - mean * mean, 0.0)
        return {
            "mean": mean,
            "std": np.sqrt(var),
            "var": var,
            "l2": np.sqrt(sumsq),
            "rms": np.sqrt(sumsq / count),
            "absmax": np.fmax(np.abs(column["min"]), np.abs(column["max"])),
            "zero_fraction": column["zeros"] / count,
            "dead_fraction": column["dead"] / column["units"],
            "activation_rate": column["active"] / (column["samples"] * column["units"]),
            "mean_abs": column["sumabs"] / count,
            **_shape(column, mean),
        }


_SUM_RTOL = 1e-6
"""How far a sum is taken to be off, relative to the sum of its terms' magnitudes. Float32 accumulation
(the kernel's lanes flushed into float64 every 1 024 elements; BLAS dots on the torch path) measured
≤ 1e-7 in effect on the skewness and kurtosis of shifted normal tensors of 10⁴–10⁶ elements
(``|mean|/std`` up to 20); this leaves a margin of ten."""
_SHAPE_RTOL = 0.01
"""Skewness and kurtosis are reported only where that rounding moves them by at most 1 %."""


def _shape(column: dict[str, np.ndarray], mean: np.ndarray) -> dict[str, np.ndarray]:
    """Skewness and kurtosis from the raw power sums: central moments m2, m3, m4 expanded in Σx^k/n.

    The expansion cancels when |mean| ≫ std, so each is NaN (unknown) where its first-order rounding
    bound — each sum off by :data:`_SUM_RTOL` of its terms' magnitudes, |mean| bounded by mean_abs,
    Σ|x|³ by √(Σx²·Σx⁴) — exceeds :data:`_SHAPE_RTOL` of it (of 1 + |skewness| for skewness, which may be
    0): in practice reported while |mean| ≲ 7·std. Non-finite sums, a zero count or a zero variance
    (constant values, a single element): NaN as well.
    """
    with np.errstate(all="ignore"):  # (huge sums overflow in the bounds: then not reported)
        count = column["count"]
        s2, s3, s4 = column["sumsq"] / count, column["sumcube"] / count, column["sumfourth"] / count
        m = column["sumabs"] / count  # >= |mean|
        mean2 = mean * mean
        m2 = s2 - mean2
        m3 = s3 - 3.0 * mean * s2 + 2.0 * mean * mean2
        m4 = s4 - 4.0 * mean * s3 + 6.0 * mean2 * s2 - 3.0 * mean2 * mean2
        cube = np.sqrt(s2 * s4)  # >= Σ|x|³/n
        e2 = _SUM_RTOL * (s2 + m * m)
        e3 = _SUM_RTOL * (cube + 3.0 * m * s2 + 2.0 * m**3)
        e4 = _SUM_RTOL * (s4 + 4.0 * m * cube + 6.0 * m * m * s2 + 3.0 * m**4)
        spread = np.where(m2 > 0, m2, np.nan)
        skewness = m3 / spread**1.5
        kurtosis = m4 / (spread * spread)
        skewness_error = e3 / spread**1.5 + 1.5 * np.abs(skewness) * e2 / spread
        kurtosis_error = e4 / (spread * spread) + 2.0 * np.abs(kurtosis) * e2 / spread
        skewness[~(skewness_error <= _SHAPE_RTOL * (1.0 + np.abs(skewness)))] = np.nan  # (NaN compares False)
        kurtosis[~(kurtosis_error <= _SHAPE_RTOL * kurtosis)] = np.nan
        return {"skewness": skewness, "kurtosis": kurtosis, "excess_kurtosis": kurtosis - 3.0}
