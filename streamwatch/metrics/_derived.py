"""Metrics derived on the worker from whole step records: pure numpy over a record's table, no torch,
nothing on the training thread. Each is a function ``StepRecord -> list[Sample]``, run as a pipeline
``source() | ops.map(fn) | <the latest-values sink>`` and named in ``observe(metrics=...)``.

* ``update_ratio`` — per parameter, ‖Δw‖ / ‖w‖ = √(Σ update²) / √(Σ weight²), from the ``update`` and
  ``param`` rows of the same step (the two kinds share their cadence, so they come aligned by step);
  the classic "updates should be ~1e-3 of the weights" check (ikkuna's Ratio subscriber).
* ``layer_mean`` — per phase and kind, the mean over layers of each layer's mean, L2 norm and RMS
  (ikkuna's MessageMean): one number per kind to watch when there are too many layers to look at.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from streamwatch._record import Sample, StepRecord

__all__ = ["DERIVED", "layer_mean", "update_ratio"]


def update_ratio(record: StepRecord) -> list[Sample]:
    """‖update‖ / ‖weight‖ for every parameter with both rows in ``record``.

    Example:
        >>> import numpy as np
        >>> from streamwatch import SeriesKey, StepRecord
        >>> keys = (SeriesKey("train", "fc", "param", "weight"), SeriesKey("train", "fc", "update", "weight"))
        >>> table = np.zeros((2, 11)); table[:, 2] = [400.0, 0.0004]  # sums of squares
        >>> samples = update_ratio(StepRecord(0, 0.0, 0, keys, table))
        >>> [(s.labels["kind"], s.labels["stat"], round(s.value, 6)) for s in samples]
        [('update', 'update_ratio', 0.001)]
    """
    weights = {(k.layer, k.name): i for i, k in enumerate(record.keys) if k.kind == "param"}
    sumsq = record.column("sumsq")
    out: list[Sample] = []
    for i, key in enumerate(record.keys):
        if key.kind != "update":
            continue
        j = weights.get((key.layer, key.name))
        if j is None:
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = float(np.sqrt(sumsq[i]) / np.sqrt(sumsq[j]))
        if not np.isnan(ratio):  # 0/0 (an empty or all-zero weight): absent, never NaN
            out.append(Sample("streamwatch_tensor", {**key.labels(), "stat": "update_ratio"}, ratio))
    return out


_LAYER_MEAN_STATS = ("mean", "l2", "rms")


def layer_mean(record: StepRecord) -> list[Sample]:
    """The mean over layers of each layer's mean, L2 norm and RMS, per phase and kind.

    Example:
        >>> import numpy as np
        >>> from streamwatch import SeriesKey, StepRecord
        >>> keys = tuple(SeriesKey("train", name, "activation", "") for name in ("a", "b"))
        >>> table = np.zeros((2, 11)); table[:, 0] = 4; table[:, 1] = [4.0, 8.0]  # counts, sums
        >>> [(s.labels["stat"], s.value) for s in layer_mean(StepRecord(0, 0.0, 0, keys, table))][:1]
        [('mean', 1.5)]
    """
    groups: dict[tuple[str, str], list[int]] = {}
    for i, key in enumerate(record.keys):
        groups.setdefault((key.phase, key.kind), []).append(i)
    stats = {name: record.stat(name) for name in _LAYER_MEAN_STATS}
    out: list[Sample] = []
    for (phase, kind), rows in groups.items():
        for name, values in stats.items():
            selected = values[rows]
            selected = selected[~np.isnan(selected)]
            if not selected.size:
                continue
            with np.errstate(invalid="ignore", over="ignore"):  # +inf and -inf layers: NaN, absent
                value = float(selected.mean())
            if not np.isnan(value):
                labels = {"phase": phase, "kind": kind, "stat": name}
                out.append(Sample("streamwatch_layer_mean", labels, value))
    return out


DERIVED: dict[str, Callable[[StepRecord], list[Sample]]] = {
    "update_ratio": update_ratio,
    "layer_mean": layer_mean,
}
"""Worker-side metrics by the name ``observe(metrics=...)`` takes."""
