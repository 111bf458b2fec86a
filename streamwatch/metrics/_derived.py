"""Metrics derived on the worker from whole step records: pure numpy over a record's table, no torch,
nothing on the training thread. Each is a function ``StepRecord -> list[Sample]``, named in
``observe(metrics=...)`` and run on every record by the series store (``streamwatch.SeriesStore``), so a
replayed run file gets them too.

* ``update_ratio`` — per parameter, ‖Δw‖ / ‖w‖ = √(Σ update²) / √(Σ weight²), from the ``update`` and
  ``param`` rows of the same step (the two kinds share their cadence, so they come aligned by step);
  the classic "updates should be ~1e-3 of the weights" check (ikkuna's Ratio subscriber).
* ``layer_mean`` — per phase and kind, the mean over layers of each layer's mean, L2 norm and RMS
  (a layer's weight and bias taken together; ikkuna's MessageMean): one number per kind to watch when
  there are too many layers to look at.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from streamwatch._families import ALL_LAYERS, LAYER_MEAN, TENSOR, stepped_weight_sumsq
from streamwatch._record import Sample, SeriesKey, StepRecord
from streamwatch._schema import COLUMN

__all__ = ["DEFAULT_METRICS", "DERIVED", "layer_mean", "update_ratio"]


@functools.lru_cache(maxsize=16)
def _ratio_rows(
    keys: tuple[SeriesKey, ...],
) -> tuple[np.ndarray, np.ndarray, list[dict[str, str]], tuple[int, ...]]:
    """(update rows, their weight rows, the update rows' labels, the positions among them of
    ``__all__`` totals) of a record layout (cached)."""
    weights = {(k.layer, k.name): i for i, k in enumerate(keys) if k.kind == "param"}
    pairs = [
        (i, weights[(k.layer, k.name)])
        for i, k in enumerate(keys)
        if k.kind == "update" and (k.layer, k.name) in weights
    ]
    updates = np.array([i for i, _ in pairs], dtype=np.intp)
    params = np.array([j for _, j in pairs], dtype=np.intp)
    totals = tuple(n for n, (i, _) in enumerate(pairs) if keys[i].layer == ALL_LAYERS)
    return updates, params, [{**keys[i].labels(), "stat": "update_ratio"} for i, _ in pairs], totals


def update_ratio(record: StepRecord) -> list[Sample]:
    """‖update‖ / ‖weight‖ for every parameter with both rows in ``record``.

    Example:
        >>> from streamwatch import SeriesKey, StepRecord
        >>> from streamwatch.testing import table
        >>> keys = (SeriesKey("train", "fc", "param", "weight"), SeriesKey("train", "fc", "update", "weight"))
        >>> samples = update_ratio(StepRecord(0, 0.0, 0, keys, table(sumsq=[400.0, 0.0004])))
        >>> [(s.labels["kind"], s.labels["stat"], round(s.value, 6)) for s in samples]
        [('update', 'update_ratio', 0.001)]
    """
    updates, params, labels, totals = _ratio_rows(record.keys)
    if not updates.size:
        return []
    sumsq = record.column("sumsq")
    weights = sumsq[params]  # (a copy: fancy indexing)
    for n in totals:  # a reduced record's total: over the weights that were stepped
        stepped = stepped_weight_sumsq(record, record.keys[int(updates[n])])
        if stepped is not None:
            weights[n] = stepped
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.sqrt(sumsq[updates] / weights)
    # 0/0 (an empty or all-zero weight): absent, never NaN
    return [Sample(TENSOR.name, lab, float(r)) for lab, r in zip(labels, ratios, strict=True) if r == r]


_LAYER_MEAN_STATS = ("mean", "l2", "rms")
_LAYER_COLUMNS = np.array([COLUMN["count"], COLUMN["sum"], COLUMN["sumsq"]], dtype=np.intp)
"""The columns a layer's mean, L2 norm and RMS come from."""


@functools.lru_cache(maxsize=16)
def _layer_groups(
    keys: tuple[SeriesKey, ...],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[dict[str, str]]]:
    """A record layout's rows grouped by (phase, kind), and within a group by layer: the rows in that
    order, each layer's first position among them, each group's first position among the layers (both
    for ``np.add.reduceat``), and the samples' labels, stat-major (cached: layouts repeat). A layer's
    parameters (its weight and bias) are one layer: their rows are added up. ``layer="__all__"`` totals
    (ranks without per-layer detail, ``observe(detail=...)``) are not layers and are left out."""
    groups: dict[tuple[str, str], dict[str, list[int]]] = {}
    for i, k in enumerate(keys):
        if k.layer != ALL_LAYERS:
            groups.setdefault((k.phase, k.kind), {}).setdefault(k.layer, []).append(i)
    layers = [members for by_layer in groups.values() for members in by_layer.values()]
    rows = np.array([i for members in layers for i in members], dtype=np.intp)
    layer_starts = np.cumsum([0] + [len(members) for members in layers])[:-1].astype(np.intp)
    group_starts = np.cumsum([0] + [len(by_layer) for by_layer in groups.values()])[:-1].astype(np.intp)
    labels = [{"phase": p, "kind": k, "stat": stat} for stat in _LAYER_MEAN_STATS for p, k in groups]
    return rows, layer_starts, group_starts, labels


def layer_mean(record: StepRecord) -> list[Sample]:
    """The mean over layers of each layer's mean, L2 norm and RMS, per phase and kind. A layer's
    parameters count as one layer (its weight and bias together: the L2 norm of both, their mean);
    layers whose value is unknown (NaN) are left out; ``layer="__all__"`` totals are not layers: a
    record of those alone has no layer mean.

    Example:
        >>> from streamwatch import SeriesKey, StepRecord
        >>> from streamwatch.testing import table
        >>> keys = tuple(SeriesKey("train", name, "activation", "") for name in ("a", "b"))
        >>> rows = table(count=4, sum=[4.0, 8.0], sumsq=0.0)
        >>> [(s.labels["stat"], s.value) for s in layer_mean(StepRecord(0, 0.0, 0, keys, rows))][:1]
        [('mean', 1.5)]
        >>> keys = (SeriesKey("train", "fc", "param", "weight"), SeriesKey("train", "fc", "param", "bias"))
        >>> rows = table(count=[3, 1], sum=0.0, sumsq=[9.0, 16.0])
        >>> [(s.labels["stat"], s.value) for s in layer_mean(StepRecord(0, 0.0, 0, keys, rows))][1]
        ('l2', 5.0)
    """
    rows, layer_starts, group_starts, labels = _layer_groups(record.keys)
    if not labels:
        return []
    # each layer's count, sum and sum of squares over its rows (grouped: a layer's rows are adjacent; a
    # NaN in any of them makes the layer's unknown)
    count, total, sumsq = np.add.reduceat(record.table[np.ix_(rows, _LAYER_COLUMNS)], layer_starts).T
    values = np.empty((len(layer_starts), len(_LAYER_MEAN_STATS)))  # columns in _LAYER_MEAN_STATS order
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        np.divide(total, count, out=values[:, 0])
        np.sqrt(sumsq, out=values[:, 1])
        np.sqrt(np.divide(sumsq, count, out=values[:, 2]), out=values[:, 2])
        unknown = np.isnan(values)
        values[unknown] = 0.0
        # one segmented sum per group (reduceat adds only within a segment: an inf stays in its group)
        means = np.add.reduceat(values, group_starts) / np.add.reduceat(~unknown, group_starts)
    # no known layer (0/0), or +inf and -inf in one group: absent
    return [
        Sample(LAYER_MEAN.name, label, m)
        for label, m in zip(labels, means.T.ravel().tolist(), strict=True)
        if m == m
    ]


DERIVED: dict[str, Callable[[StepRecord], list[Sample]]] = {
    "update_ratio": update_ratio,
    "layer_mean": layer_mean,
}
"""Worker-side metrics by the name ``observe(metrics=...)`` takes."""

DEFAULT_METRICS = ("update_ratio", "layer_mean")
"""Worker-side metrics on by default (numpy over each record's table: no training-thread cost); the
series store (``streamwatch.SeriesStore``) runs them on every record, live and replayed."""
