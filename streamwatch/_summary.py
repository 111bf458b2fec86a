"""Summaries: a tensor becomes a few device scalars; the host turns them into every statistic.

Pure functions only — no hooks, no threads. Two halves:

* :func:`summarize` runs on the training thread, where the tensor lives. It never calls ``.item()``,
  ``.cpu()`` or ``float()``: it returns 0-d device tensors, stacked once per step at the step boundary.
  Kernels per tensor (measured on a 2-core CPU for 128×1024 float32, see README): ``sum`` ~17 µs,
  ``vector_norm`` ~23 µs, ``aminmax`` ~25 µs, a nonzero mask ``sign().abs_()`` + its ``sum`` ~55 µs
  (``count_nonzero`` is 311 µs), per-unit activity ``amax`` over the mask ~30 µs. The non-finite
  *flag* is free (``aminmax`` propagates NaN, ±inf shows in min/max); an exact non-finite *count*
  costs one more pass (``isfinite().sum()``, ~260 µs) and is opt-in.
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
    ...           nonfinite_counted=False)
    >>> keys, table = finalize(raw)
    >>> dict(zip(COLUMNS, table[0].tolist()))["zeros"], dict(zip(COLUMNS, table[0].tolist()))["dead"]
    (2.0, 1.0)
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["COLUMNS", "DERIVED", "Raw", "Row", "derive", "finalize", "summarize", "unit_dim_for"]

DEVICE_STATS = ("sum", "l2", "min", "max", "nonzero", "nonfinite")
"""The device scalars per tensor, in this order (``nonfinite`` only when counted)."""

COLUMNS = ("count", "sum", "sumsq", "min", "max", "zeros", "nonfinite", "units", "dead")
"""Columns of a finalized table: everything else derives from these, and all of them add up (or take
min/max) across rows, steps, shards and ranks — which is why sums of squares, not norms, are kept."""

DERIVED = ("mean", "std", "var", "l2", "rms", "absmax", "zero_fraction", "dead_fraction")
"""Statistics :func:`derive` computes from the columns."""


@dataclass(frozen=True, slots=True)
class Row:
    """The device scalars of one summarized tensor (see :data:`DEVICE_STATS`), plus per-unit activity."""

    scalars: list[torch.Tensor]
    unit_active: torch.Tensor | None  # 1-D: 1 where a unit had any nonzero element, else 0


def unit_dim_for(x: torch.Tensor, channel_last: bool) -> int | None:
    """The dimension that indexes units (neurons/channels) of a batched tensor, or None (no units).

    monitorch's convention: ``[batch, features, *spatial]`` by default, ``[batch, ..., features]``
    with ``channel_last``. A tensor with fewer than two dimensions has no batch to be dead across.
    """
    if x.dim() < 2:
        return None
    return x.dim() - 1 if channel_last else 1


def summarize(x: torch.Tensor, *, unit_dim: int | None = None, count_nonfinite: bool = False) -> Row:
    """Device scalars of a real floating tensor: sum, L2 norm, min, max, nonzero count, non-finite count.

    No host synchronisation: every result stays on ``x``'s device. ``x`` must be a dense, non-empty,
    real floating tensor (callers convert or skip the rest and count them). Accumulation is float32
    (float64 for float64 inputs) so half-precision sums of squares cannot overflow.

    Args:
        x: the tensor; it is only read.
        unit_dim: if given, also return per-unit activity along this dimension (dead-unit rate).
        count_nonfinite: also count NaN/Inf elements exactly (one more pass); otherwise there are five
            scalars and :func:`finalize` reports a 0/1 presence flag derived for free from min/max/sum.

    Example:
        >>> import torch
        >>> row = summarize(torch.tensor([1.0, -2.0, 0.0]))
        >>> [round(float(s), 4) for s in row.scalars[:5]]
        [-1.0, 2.2361, -2.0, 1.0, 2.0]
    """
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    total = x.sum(dtype=acc)
    l2 = torch.linalg.vector_norm(x, dtype=acc)
    low, high = torch.aminmax(x)
    active = x.sign().abs_()  # 1 where nonzero, 0 where zero (NaN where NaN): one mask, two uses
    scalars = [total, l2, low, high, active.sum(dtype=acc)]
    if count_nonfinite:
        scalars.append(x.numel() - torch.isfinite(x).sum())
    unit_active = None
    if unit_dim is not None:
        dims = [d for d in range(x.dim()) if d != unit_dim]
        unit_active = active.amax(dim=dims)
    return Row(scalars, unit_active)


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
    """

    keys: tuple[Hashable, ...]
    counts: np.ndarray
    units: np.ndarray
    values: np.ndarray
    dead: np.ndarray
    nonfinite_counted: bool


def finalize(raw: Raw) -> tuple[tuple[Hashable, ...], np.ndarray]:
    """Merge rows with equal keys and produce the ``(unique keys, table)`` in :data:`COLUMNS` order.

    Vectorised with numpy over all rows; runs on the worker thread. Merging: counts, sums, sums of
    squares, zeros and non-finite counts add; min/max take min/max; units and dead units come from the
    first row of a key (the step boundary already merged per-unit activity across repeats).
    """
    values = np.asarray(raw.values, dtype=np.float64)
    n = len(raw.keys)
    table = np.empty((n, len(COLUMNS)), dtype=np.float64)
    table[:, 0] = raw.counts
    table[:, 1] = values[:, 0]
    table[:, 2] = np.square(values[:, 1])
    table[:, 3] = values[:, 2]
    table[:, 4] = values[:, 3]
    table[:, 5] = raw.counts - values[:, 4]
    if raw.nonfinite_counted:
        table[:, 6] = values[:, 5]
    else:  # presence flag, free: NaN propagates through min/max/sum, ±inf shows in min/max
        with np.errstate(invalid="ignore"):
            finite = np.isfinite(values[:, 0]) & np.isfinite(values[:, 2]) & np.isfinite(values[:, 3])
        table[:, 6] = (~finite).astype(np.float64)
    table[:, 7] = np.where(raw.units > 0, raw.units, np.nan)  # no unit activity taken: unknown, not 0
    table[:, 8] = raw.dead
    # sign(NaN) is 0 on CPU, so the nonzero mask counts NaN elements as zeros (and an all-NaN unit as
    # dead): with a NaN present (aminmax propagates it) zeros and dead units are unknown, not wrong.
    has_nan = np.isnan(values[:, 2]) | np.isnan(values[:, 3])
    table[has_nan, 5] = np.nan
    table[has_nan, 8] = np.nan
    if len(set(raw.keys)) == n:
        return raw.keys, table
    return _merge(raw.keys, table, counted=raw.nonfinite_counted)


def _merge(
    keys: tuple[Hashable, ...], table: np.ndarray, counted: bool
) -> tuple[tuple[Hashable, ...], np.ndarray]:
    first: dict[Hashable, int] = {}
    for key in keys:
        first.setdefault(key, len(first))
    index = np.fromiter((first[k] for k in keys), dtype=np.intp, count=len(keys))
    out = np.zeros((len(first), table.shape[1]), dtype=np.float64)
    for col in (0, 1, 2, 5):
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
    out[:, 7] = table[order, 7]
    out[:, 8] = table[order, 8]
    return tuple(first), out


def derive(table: np.ndarray) -> dict[str, np.ndarray]:
    """Every derived statistic, vectorised over the rows of a finalized table.

    ``var`` is the population variance ``sumsq/count - mean²`` (clipped at 0 against rounding); ``l2``
    is ``√sumsq``; ``rms`` is ``√(sumsq/count)``; ``absmax`` is ``max(|min|, |max|)``; fractions are
    per element (zeros) and per unit (dead). Ratios over a zero count are NaN (never an error).

    Example:
        >>> import numpy as np
        >>> t = np.array([[4, 2.0, 6.0, -1.0, 2.0, 1, 0, 2, 1]])
        >>> d = {k: round(float(v[0]), 4) for k, v in derive(t).items()}
        >>> d["mean"], d["std"], d["l2"], d["rms"], d["absmax"], d["zero_fraction"], d["dead_fraction"]
        (0.5, 1.118, 2.4495, 1.2247, 2.0, 0.25, 0.5)
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
        }
