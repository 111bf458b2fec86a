"""The series budget: what a scrape serves of the per-layer families when they hold more series than
``expose(series_budget=...)`` allows (default 5 000 per process).

**What counts.** Every series of :data:`streamwatch._families.PER_LAYER_FAMILIES`: ``streamwatch_tensor``
(the summary table's statistics and the opt-in values served beside them), each ``le`` bucket of
``streamwatch_tensor_values``, and the detectors' per-layer families (``streamwatch_grad_norm_ratio``,
``streamwatch_grad_norm_spikes_total``, ``streamwatch_layer_update_ratio``,
``streamwatch_update_ratio_out_of_band``), their ``layer="__all__"`` series included.
``streamwatch_series_wanted`` is that count before the budget, ``streamwatch_series`` after it.

**Levels.** Within the budget everything is served. Past it, the first level that fits:

1. ``core``: :data:`CORE_STATS` of every layer, every detector series, and the histograms summed per
   phase and kind (``layer="__all__"``);
2. ``worst``: one total per phase and kind (``layer="__all__"``: :func:`streamwatch._summary.totals`,
   what a rank without per-layer detail serves), the detectors' ``__all__`` series, the histograms
   summed per phase and kind, and as many layers as fit, the worst first (:meth:`Signals.rank`), each with its
   :data:`CORE_STATS` and its detector series. The totals are served even past a budget smaller than
   they are.

**Cost.** No sample is built for a series that is not served: the reduction is numpy over the summary
table (one row per tensor), and what depends only on its layout (each row's layer and (phase, kind)
group, the keys of the totals) is a :class:`Layout`, made once per layout and reused while the keys
stay the same.

Example:
    >>> from streamwatch import SeriesKey
    >>> from streamwatch.testing import table
    >>> keys = [SeriesKey("train", name, "param_grad", "weight") for name in ("a", "b", "c")]
    >>> rows = table(count=4.0, sumsq=[1.0, 900.0, 4.0], fill=0.0)
    >>> served = Budget(14).serve(rows, keys, extras=[], histograms={}, edges={}, detectors=[])
    >>> served.level, [k.layer for k in served.keys], served.exported
    ('worst', ['__all__', 'b'], 14)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from streamwatch._families import (
    ALL_LAYERS,
    GRAD_NORM_RATIO,
    GRAD_NORM_SPIKES,
    TENSOR_VALUES,
    UPDATE_RATIO_OUT_OF_BAND,
)
from streamwatch._record import Sample, SeriesKey
from streamwatch._summary import COLUMNS, derive, totals

__all__ = [
    "CORE_STATS",
    "DEAD_FRACTION_HIGH",
    "Budget",
    "HistogramKey",
    "Layout",
    "Served",
    "Signals",
    "histogram_series",
]

CORE_STATS = ("count", "sumsq", "l2", "mean", "min", "max", "nonfinite", "dead_fraction")
"""The statistics kept per layer when the series budget is exceeded."""

HistogramKey = tuple[str, ...]
"""A histogram's label values, in ``TENSOR_VALUES.labels`` order (phase, layer, kind, param, index)."""

Level = Literal["full", "core", "worst"]

_NONFINITE, _SUMSQ = COLUMNS.index("nonfinite"), COLUMNS.index("sumsq")
_SIGNALS = (UPDATE_RATIO_OUT_OF_BAND.name, GRAD_NORM_SPIKES.name, GRAD_NORM_RATIO.name)
_KIND = TENSOR_VALUES.labels.index("kind")


@dataclass(frozen=True, slots=True, eq=False)
class Layout:
    """What the reduction needs of a summary table's keys, made once per layout.

    Attributes:
        keys: the table's keys, one per row.
        layers: the layers, in the order of their first row (rows of ``layer="__all__"`` are totals
            already, not a layer); ``index`` maps each to its position.
        layer_of: per row, its layer's index in ``layers`` (-1: a total).
        groups: per (phase, kind), its rows; ``total_keys`` the key of each group's total.
        grad_rows: the training gradients' rows (``param_grad``) of a layer; ``activation_rows`` the
            training activations' (the ranking reads them).
    """

    keys: list[SeriesKey]
    layers: tuple[str, ...]
    index: Mapping[str, int]
    layer_of: np.ndarray
    groups: tuple[np.ndarray, ...]
    total_keys: tuple[SeriesKey, ...]
    grad_rows: np.ndarray
    activation_rows: np.ndarray

    @classmethod
    def of(cls, keys: list[SeriesKey]) -> Layout:
        """The layout of a table with these keys."""
        layers: dict[str, int] = {}
        groups: dict[tuple[str, str], list[int]] = {}
        layer_of = np.empty(len(keys), dtype=np.intp)
        grads: list[int] = []
        activations: list[int] = []
        for i, key in enumerate(keys):
            groups.setdefault((key.phase, key.kind), []).append(i)
            if key.layer == ALL_LAYERS:
                layer_of[i] = -1
                continue
            layer_of[i] = layers.setdefault(key.layer, len(layers))
            if key.phase == "train":
                if key.kind == "param_grad":
                    grads.append(i)
                elif key.kind == "activation":
                    activations.append(i)
        return cls(
            keys=keys,
            layers=tuple(layers),
            index=layers,
            layer_of=layer_of,
            groups=tuple(np.array(rows, dtype=np.intp) for rows in groups.values()),
            total_keys=tuple(SeriesKey(phase, ALL_LAYERS, kind, "") for phase, kind in groups),
            grad_rows=np.array(grads, dtype=np.intp),
            activation_rows=np.array(activations, dtype=np.intp),
        )


@dataclass(slots=True)
class Served:
    """What one scrape serves of the per-layer families.

    Attributes:
        level: ``"full"`` (within the budget), ``"core"`` or ``"worst"`` (see the module documentation).
        stats: ``streamwatch_tensor``'s values by statistic, one per row of ``keys`` (NaN: absent).
        keys: the rows served.
        extras: the ``streamwatch_tensor`` samples served beside the table (opt-in metric values).
        histograms: bucket counts by histogram (:func:`histogram_series`).
        detectors: the detectors' per-layer samples served.
        wanted: per-layer series before the budget; ``exported``: served.
        layers: layers served in detail; ``of_layers``: the table's layers.
    """

    level: Level
    stats: dict[str, np.ndarray]
    keys: list[SeriesKey]
    extras: list[Sample]
    histograms: dict[HistogramKey, np.ndarray]
    detectors: list[Sample]
    wanted: int
    exported: int
    layers: int
    of_layers: int


def histogram_series(samples: Sequence[Sample]) -> dict[HistogramKey, np.ndarray]:
    """Bucket-count samples (``streamwatch_tensor_histogram``, label ``bucket``) as one vector per
    histogram (a missing bucket counts 0).

    Example:
        >>> from streamwatch import Sample
        >>> labels = {"phase": "train", "layer": "fc", "kind": "param_grad", "param": "weight", "index": ""}
        >>> samples = [Sample("streamwatch_tensor_histogram", {**labels, "bucket": b}, 2.0) for b in "02"]
        >>> histogram_series(samples)
        {('train', 'fc', 'param_grad', 'weight', ''): array([2., 0., 2.])}
    """
    buckets: dict[HistogramKey, dict[int, float]] = {}
    for s in samples:
        key = tuple(s.labels.get(name, "") for name in TENSOR_VALUES.labels)
        buckets.setdefault(key, {})[int(s.labels["bucket"])] = s.value
    out: dict[HistogramKey, np.ndarray] = {}
    for key, counts in buckets.items():
        vector = np.zeros(max(counts) + 1)
        vector[list(counts)] = list(counts.values())
        out[key] = vector
    return out


def _histogram_totals(series: Mapping[HistogramKey, np.ndarray]) -> dict[HistogramKey, np.ndarray]:
    """One histogram per (phase, kind) under ``layer="__all__"``: bucket counts added (the buckets of
    one kind are the same for every layer; a histogram with other buckets is left out of the total)."""
    out: dict[HistogramKey, np.ndarray] = {}
    for key, vector in series.items():
        total = (key[0], ALL_LAYERS, key[_KIND], "", "")
        seen = out.get(total)
        if seen is None:
            out[total] = vector.copy()
        elif seen.shape == vector.shape:
            seen += vector
    return out


def _buckets(series: Mapping[HistogramKey, np.ndarray], edges: Mapping[str, tuple[float, ...]]) -> int:
    """The ``le`` series these histograms are served as (one per bound; none without bounds)."""
    return sum(len(edges.get(key[_KIND], ())) for key in series)


DEAD_FRACTION_HIGH = 0.5
"""A layer whose training activations have more dead units than this ranks among the worst: the threshold
of the shipped ``StreamwatchDeadUnitsHigh`` alert (dashboards/rules/streamwatch.rules.yml)."""


@dataclass(frozen=True, slots=True)
class Signals:
    """What the ranking reads of each layer (one value per layer; NaN: unknown, read as 0).

    Attributes:
        nonfinite: non-finite values in its tensors (a count, or 1 per tensor where only flagged).
        origin: whether the run's first non-finite value started there (``streamwatch_first_nonfinite_info``).
        out_of_band: decades its update/weight ratio lies above (+) or below (-) UpdateRatioBand's band
            (``-inf``: not updated; ``streamwatch_update_ratio_out_of_band``).
        spikes: gradient-norm spikes GradientSpike counted (``streamwatch_grad_norm_spikes_total``).
        grad_ratio: its gradient norm over its baseline (``streamwatch_grad_norm_ratio``).
        dead: the largest dead-unit fraction of its training activations.
        grad_norm: the norm of its training gradients.
        served: whether the last scrape served it in detail.
    """

    nonfinite: np.ndarray
    origin: np.ndarray
    out_of_band: np.ndarray
    spikes: np.ndarray
    grad_ratio: np.ndarray
    dead: np.ndarray
    grad_norm: np.ndarray
    served: np.ndarray

    def rank(self) -> np.ndarray:
        """The layers' indices, the worst first.

        First by tier: non-finite values (3: the layer where the run's first one started ahead of the
        others); flagged by a detector, out of the update-ratio band or a gradient-norm spike counted
        (2); more than :data:`DEAD_FRACTION_HIGH` of its units dead (1); the rest (0). Within a tier the
        layers the last scrape served come first, so the layers served stay the same from scrape to
        scrape until a tier changes (a series that comes and goes costs Prometheus a new series each
        time, and a spike counter that came back would read as a new spike). Then the most non-finite
        values, the most decades above the band, the most spikes, the largest gradient-norm ratio, the
        most decades below the band, the largest dead fraction, the largest gradient norm; ties keep the
        layers' order.

        Example:
            >>> z, nan, no = np.zeros(4), np.full(4, np.nan), np.zeros(4, dtype=bool)
            >>> Signals(z, no, z, z, np.array([1.0, 30.0, np.nan, 1.1]), z, z, no).rank().tolist()
            [1, 3, 0, 2]
            >>> band, served = np.array([0.0, 0.0, -np.inf, 2.0]), np.array([0, 1, 0, 0], dtype=bool)
            >>> Signals(z, no, band, nan, nan, nan, z, served).rank().tolist()  # above the band first
            [3, 2, 1, 0]
            >>> nonfinite, origin = np.array([0, 0, 2.0, 1.0]), np.array([0, 0, 0, 1], dtype=bool)
            >>> Signals(nonfinite, origin, z, z, z, z, z, no).rank().tolist()  # where the first began first
            [3, 2, 0, 1]
        """

        def known(values: np.ndarray) -> np.ndarray:
            magnitude: np.ndarray = np.nan_to_num(values, nan=0.0, posinf=np.inf, neginf=-np.inf)
            return magnitude

        nonfinite, band, spikes, dead = (
            known(v) for v in (self.nonfinite, self.out_of_band, self.spikes, self.dead)
        )
        above, below = np.maximum(band, 0.0), np.maximum(-band, 0.0)
        flagged = (band != 0) | (spikes > 0)
        tier = np.where(nonfinite > 0, 3, np.where(flagged, 2, np.where(dead > DEAD_FRACTION_HIGH, 1, 0)))
        keys = (
            tier,
            self.origin & (nonfinite > 0),
            self.served,
            nonfinite,
            above,
            spikes,
            known(self.grad_ratio),
            below,
            dead,
            known(self.grad_norm),
        )
        # lexsort sorts by its last key first, ascending and stable: negated for the largest first
        return np.lexsort([-np.asarray(k, dtype=np.float64) for k in reversed(keys)])


class Budget:
    """The series budget of one collector: :meth:`serve` picks what a scrape serves of the per-layer
    families. Keeps the last :class:`Layout`; not thread-safe (the collector serialises its scrapes).

    Args:
        series: the most per-layer series to serve (``expose(series_budget=...)``).
    """

    def __init__(self, series: int) -> None:
        self.series = series
        self._layout: Layout | None = None
        self._served: set[str] = set()  # the layers the last scrape served in detail (worst level)

    def layout(self, keys: list[SeriesKey]) -> Layout:
        """The layout of ``keys``: the last one if the keys are the same (the store hands out the same
        key objects, so comparing costs a pointer per row)."""
        layout = self._layout
        if layout is None or layout.keys != keys:
            layout = self._layout = Layout.of(keys)
        return layout

    def serve(
        self,
        table: np.ndarray,
        keys: list[SeriesKey],
        *,
        extras: list[Sample],
        histograms: dict[HistogramKey, np.ndarray],
        edges: Mapping[str, tuple[float, ...]],
        detectors: list[Sample],
        origin: str | None = None,
    ) -> Served:
        """What to serve of the table (``store.table()``), the ``streamwatch_tensor`` samples beside it,
        the histograms (with their bounds by kind) and the detectors' per-layer samples; ``origin`` is the
        layer where the run's first non-finite value started, if known."""
        stats = {name: table[:, i] for i, name in enumerate(COLUMNS)} | derive(table)
        layout = self.layout(keys)
        layers = len(layout.layers)
        known = sum(int(np.count_nonzero(~np.isnan(v))) for v in stats.values())
        wanted = known + len(extras) + _buckets(histograms, edges) + len(detectors)
        if wanted <= self.series:
            self._served = set()
            return Served("full", stats, keys, extras, histograms, detectors, wanted, wanted, layers, layers)
        core_known = np.zeros(len(keys), dtype=np.intp)
        for stat in CORE_STATS:
            core_known += ~np.isnan(stats[stat])
        core_extras = [s for s in extras if s.labels.get("stat") in CORE_STATS]
        histogram_totals = _histogram_totals(histograms)
        buckets = _buckets(histogram_totals, edges)
        exported = int(core_known.sum()) + len(core_extras) + buckets + len(detectors)
        if exported <= self.series:
            self._served = set()
            core = {stat: stats[stat] for stat in CORE_STATS}
            return Served(
                "core", core, keys, core_extras, histogram_totals, detectors, wanted, exported, layers, layers
            )
        served = self._worst(layout, table, stats, core_known, core_extras, buckets, detectors, origin)
        served.histograms, served.wanted = histogram_totals, wanted
        return served

    def _worst(
        self,
        layout: Layout,
        table: np.ndarray,
        stats: dict[str, np.ndarray],
        core_known: np.ndarray,
        extras: list[Sample],
        buckets: int,
        detectors: list[Sample],
        origin: str | None,
    ) -> Served:
        """The ``worst`` level (``histograms`` and ``wanted`` left for the caller to fill in)."""
        n = len(layout.layers)
        total_table = totals(table, layout.groups)
        total_stats = {name: total_table[:, i] for i, name in enumerate(COLUMNS)} | derive(total_table)
        served_stats = {stat: total_stats[stat] for stat in CORE_STATS}
        fixed = sum(int(np.count_nonzero(~np.isnan(v))) for v in served_stats.values()) + buckets
        # each layer's series: its core statistics, its values beside the table, its detector series
        rows = layout.layer_of >= 0
        cost = np.bincount(layout.layer_of[rows], weights=core_known[rows], minlength=n)
        index = layout.index
        for s in (*extras, *detectors):
            layer = s.labels.get("layer", "")
            i = index.get(layer)
            if i is not None:
                cost[i] += 1
            elif layer == ALL_LAYERS:  # a total: always served (a layer without table rows: never)
                fixed += 1
        order = self._signals(layout, table, stats, detectors, origin).rank()
        fits = int(np.searchsorted(np.cumsum(cost[order]), self.series - fixed, side="right"))
        kept = np.zeros(n + 1, dtype=bool)  # (index -1, a total's row: never a kept layer's)
        kept[order[:fits]] = True
        self._served = {layout.layers[i] for i in order[:fits]}
        names = self._served | {ALL_LAYERS}
        served_rows = np.flatnonzero(kept[layout.layer_of])
        for stat, values in served_stats.items():
            served_stats[stat] = np.concatenate((values, stats[stat][served_rows]))
        served_keys = [*layout.total_keys, *(layout.keys[i] for i in served_rows)]
        served_extras = [s for s in extras if s.labels.get("layer", "") in names]
        served_detectors = [s for s in detectors if s.labels.get("layer", "") in names]
        exported = sum(int(np.count_nonzero(~np.isnan(v))) for v in served_stats.values())
        exported += buckets + len(served_extras) + len(served_detectors)
        return Served(
            "worst", served_stats, served_keys, served_extras, {}, served_detectors, 0, exported, fits, n
        )

    def _signals(
        self,
        layout: Layout,
        table: np.ndarray,
        stats: dict[str, np.ndarray],
        detectors: list[Sample],
        origin: str | None,
    ) -> Signals:
        """What the ranking reads of each layer, vectorised over the table's rows."""
        n = len(layout.layers)
        index = layout.index
        detector = {name: np.full(n, np.nan) for name in _SIGNALS}
        for s in detectors:
            values = detector.get(s.name)
            i = index.get(s.labels.get("layer", ""))
            if values is not None and i is not None:
                values[i] = s.value
        rows = layout.layer_of >= 0
        nonfinite = np.nan_to_num(table[rows, _NONFINITE], nan=0.0)
        grads = layout.grad_rows
        sumsq = np.nan_to_num(table[grads, _SUMSQ], nan=0.0)
        dead = np.zeros(n)
        activations = layout.activation_rows
        np.fmax.at(dead, layout.layer_of[activations], stats["dead_fraction"][activations])
        served = self._served
        first = np.zeros(n, dtype=bool)
        at = layout.index.get(origin) if origin is not None else None
        if at is not None:
            first[at] = True
        return Signals(
            nonfinite=np.bincount(layout.layer_of[rows], weights=nonfinite, minlength=n),
            origin=first,
            out_of_band=detector[UPDATE_RATIO_OUT_OF_BAND.name],
            spikes=detector[GRAD_NORM_SPIKES.name],
            grad_ratio=detector[GRAD_NORM_RATIO.name],
            dead=dead,
            grad_norm=np.sqrt(np.bincount(layout.layer_of[grads], weights=sumsq, minlength=n)),
            served=np.array([name in served for name in layout.layers], dtype=bool)
            if served
            else np.zeros(n, dtype=bool),
        )
