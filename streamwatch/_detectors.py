"""The detectors' implementation; the public face and the overview are in :mod:`streamwatch.detectors`.

Every smoothed detector's chain is ``map(extract) | filter(present) | scan(fold, Baseline.empty()) |
map(samples)``: :meth:`_Smoothed.fold` is the one place the baseline and the scores are computed, one
series of a record (the loss; the global and per-layer gradient norms) at a time in float arithmetic —
one C call (``_fused.ewm_fold``) when the compiled module is there, else the plain-Python loop
(:meth:`_Smoothed.fold_reference`) that is its reference, bit for bit. A record brings one to a few
hundred series, and numpy's per-call cost on arrays that small is larger than the arithmetic. The state
is an immutable :class:`Baseline` (``ops.scan`` starts every pipeline from the same initial state).

The pipeline a detector runs on the worker (:meth:`Detector.pipeline`) ends in the scan instead: each
state goes to the store as the latest (``SeriesStore.later``), which makes the samples from it when it
is read — once per scrape or snapshot rather than once per record, serving exactly what publishing
every record's samples would have left.

Example:
    >>> from streamwatch import StepRecord
    >>> from streamwatch.testing import table
    >>> values = LossSpike().extract(StepRecord(0, 0.0, 0, (), table(0), {"loss": 0.5}))
    >>> values.names, values.values
    (('',), (0.5,))
"""

from __future__ import annotations

import abc
import functools
import math
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

import numpy as np

from streamwatch import ops
from streamwatch._clip_tap import GRAD_NORM
from streamwatch._families import (
    GRAD_NORM_RATIO,
    GRAD_NORM_SPIKES,
    LAYER_UPDATE_RATIO,
    LOGGED,
    LOSS_SPIKES,
    LOSS_ZSCORE,
    UPDATE_RATIO_OUT_OF_BAND,
    Family,
    stepped_weight_sumsq,
)
from streamwatch._kernel import ewm_fold
from streamwatch._pipeline import Operator, Pipeline, Sink, describe, source
from streamwatch._record import Sample, SeriesKey, StepRecord
from streamwatch._store import SeriesStore
from streamwatch._validate import check_int, check_real

__all__ = [
    "DEFAULT_DETECTORS",
    "GLOBAL",
    "Baseline",
    "Detector",
    "GradientSpike",
    "LossSpike",
    "UpdateRatioBand",
    "Values",
    "Watched",
    "attach",
    "check_detectors",
    "pipelines",
]

GLOBAL = "__all__"
"""The ``layer`` label of the global gradient norm (as for the series budget's aggregates)."""

MAD_TO_SIGMA = math.sqrt(math.pi / 2)
"""σ / E|x − μ| for a normal distribution: the mean absolute deviation times this estimates σ."""

SCALE_FLOOR = 1e-9
"""The loss z-score's scale is at least this fraction of the baseline (of 1 below 1): a constant history
gives finite z-scores."""


# -- what flows between the stages ---------------------------------------------------------------------


class Values(NamedTuple):
    """One record's values for a detector: a value per named series (NaN: this record has none)."""

    names: tuple[str, ...]
    values: tuple[float, ...]


class Baseline(NamedTuple):
    """A smoothed detector's state after a record, one entry per series (an immutable value: ``ops.scan``
    starts every pipeline from the same initial state, and each fold returns a new one; a named tuple,
    built once per record and series-set, costs a fraction of a frozen dataclass).

    Attributes:
        names: the series (``""`` for the loss; ``"__all__"`` and the layers for gradients).
        n: finite values folded into each baseline.
        mean: the exponentially weighted mean (of winsorised values once warmed up).
        dev: the exponentially weighted mean absolute deviation from the previous mean.
        score: each series' score for the last record (z-score or ratio); NaN where none was reported.
        fresh: the series that had a finite value in the last record.
        spikes: sampled steps whose score exceeded the threshold, per series.
        last: each series' latest finite score (NaN before its first): what the store serves.
    """

    names: tuple[str, ...]
    n: tuple[int, ...]
    mean: tuple[float, ...]
    dev: tuple[float, ...]
    score: tuple[float, ...]
    fresh: tuple[bool, ...]
    spikes: tuple[int, ...]
    last: tuple[float, ...]

    @classmethod
    def empty(cls) -> Baseline:
        """The state before the first record: no series."""
        return cls((), (), (), (), (), (), (), ())

    def aligned(self, values: Values) -> tuple[Baseline, tuple[float, ...]]:
        """This state grown by the series ``values`` brings for the first time, and ``values`` laid out
        over its series (NaN for the series the record lacks)."""
        if values.names == self.names:
            return self, values.values
        index = {name: i for i, name in enumerate(self.names)}
        new = tuple(name for name in values.names if name not in index)
        state = self
        if new:
            k = len(new)
            state = Baseline(
                self.names + new,
                self.n + (0,) * k,
                self.mean + (0.0,) * k,
                self.dev + (0.0,) * k,
                self.score + (math.nan,) * k,
                self.fresh + (False,) * k,
                self.spikes + (0,) * k,
                self.last + (math.nan,) * k,
            )
            index.update({name: len(self.names) + i for i, name in enumerate(new)})
        laid = [math.nan] * len(state.names)
        for name, x in zip(values.names, values.values, strict=True):
            laid[index[name]] = x
        return state, tuple(laid)

    def __repr__(self) -> str:
        return f"<baseline series={len(self.names)}>"


_EWM_FOLD = ewm_fold()
"""The compiled fold of a smoothed detector (None: :meth:`_Smoothed.fold_reference`'s Python)."""


def _present(item: object) -> bool:
    return item is not None


class _Publish(Sink):
    """The end of a detector's pipeline (its :meth:`Detector.chain`): its samples become the store's
    latest values."""

    __slots__ = ("detector", "store")

    def __init__(self, store: SeriesStore, detector: Detector) -> None:
        self.store = store
        self.detector = detector

    def send(self, item: Any) -> None:
        if item:
            self.store.put(item)

    def __repr__(self) -> str:
        return f"<publish {describe(self.detector)}>"


class _PublishLatest(Sink):
    """The end of a built-in detector's pipeline: each state is handed to the store as the latest
    (``store.later``), which makes the detector's samples from it when it is read — once per scrape or
    snapshot, not once per record. What the store then serves is what publishing every record's samples
    would have left (:meth:`_Smoothed.published`, :meth:`UpdateRatioBand.published`)."""

    __slots__ = ("alarm", "count", "detector", "later", "line", "publish")

    def __init__(
        self,
        store: SeriesStore,
        detector: Any,
        alarm: Callable[[], object] | None = None,
        line: Callable[[float], object] | None = None,
    ) -> None:
        self.later = store.later
        self.detector = detector
        self.publish = detector.published
        self.alarm = alarm  # called when a Baseline's spike count rises (the watch escalates)
        self.line = line  # called with LossSpike's spike line after each record (the watch's quiet step)
        self.count = 0

    def send(self, item: Any) -> None:
        if self.alarm is not None:
            count = sum(item.spikes)
            if count > self.count:
                self.alarm()
            self.count = count
        if self.line is not None:
            self.line(self.detector.spike_line(item))
        self.later(self, self.publish, item)

    def __repr__(self) -> str:
        return f"<publish {describe(self.detector)}>"


# -- the detectors ---------------------------------------------------------------------------------------


class Detector(abc.ABC):
    """A built-in detector: a frozen description whose :meth:`chain` turns step records into
    :class:`streamwatch.Sample` lists; :meth:`pipeline` ends it in a series store.

    Subclasses are frozen dataclasses: one object can serve many pipelines (the state lives in the
    pipeline's nodes, as for every operator).
    """

    alarms: ClassVar[bool] = False
    """Whether :meth:`pipeline` takes an ``alarm`` (called when the detector fires: a watch escalates)."""

    @abc.abstractmethod
    def chain(self) -> Operator:
        """The operators from a :class:`streamwatch.StepRecord` to the list of samples it yields."""

    def pipeline(self, store: SeriesStore, alarm: Callable[[], object] | None = None) -> Pipeline:
        """``source() | chain() | publish(store)``: a pipeline that receives every record and puts this
        detector's values into ``store`` (``watch.store``, or a replay's). ``alarm()`` is called when the
        detector fires, by the detectors whose :attr:`alarms` is true (the others never call it)."""
        return source() | self.chain() | _Publish(store, self)


class _Smoothed(Detector):
    """A score of each new value against an exponentially weighted baseline of the values before it.

    The baseline of each series, updated with every finite value ``x`` after scoring it:

    * the ``t``-th value enters with weight ``a = max(alpha, 1/t)``: the first ``1/alpha`` values make a
      plain mean, later ones an EWM (``mean += a * (x - mean)``), so the baseline is unbiased from the
      start rather than pulled towards its first value;
    * the deviation ``|x - mean|`` (from the mean before the update: the prediction error) is averaged
      the same way, over the ``t - 1`` deviations seen;
    * once ``warmup`` values are in, each value is scored, and enters the baseline winsorised at the
      threshold (:meth:`_score` says where): a value that is not a spike enters as it is, a spike as if
      it were exactly at the threshold, so one outlier cannot drag the baseline (or inflate the scale)
      far enough to hide the next one.
    """

    threshold: float
    alpha: float
    warmup: int
    scores: ClassVar[Family]
    """The family of the scores (a gauge)."""
    counts: ClassVar[Family]
    """The family of the spike counts (a counter)."""
    label: ClassVar[str]
    """The label naming a series (``""``: one series, no label)."""
    per_step: ClassVar[bool] = False
    """Whether it reads values every step has (the loss): then it folds the unrecorded steps a record
    carries too (``StepRecord.steps``), not only the recorded ones."""

    def _check(self) -> None:
        check_real(self.threshold, "threshold", above=0, finite=True)
        check_real(self.alpha, "alpha", above=0, at_most=1)
        check_int(self.warmup, "warmup", minimum=2, note="a baseline needs a mean and a deviation")

    @abc.abstractmethod
    def extract(self, record: StepRecord) -> Values | None:
        """The record's values, or None if it has none (skipped)."""

    @abc.abstractmethod
    def _score(self, mean: float, dev: float, x: float) -> tuple[float, float, float]:
        """``(score, low, high)``: the score of ``x`` against a warmed-up baseline, and the bounds it
        enters the baseline within (NaN score: none)."""

    def samples(self, state: Baseline) -> list[Sample]:
        """The samples to publish after a record: for each series it had a value for, the score (once
        warmed up) and the spike count when it is new or changed (the store keeps the latest values)."""
        scores, counts, label, threshold = self.scores.name, self.counts.name, self.label, self.threshold
        out: list[Sample] = []
        for name, fresh, n, score, spikes in zip(
            state.names, state.fresh, state.n, state.score, state.spikes, strict=True
        ):
            if not fresh:
                continue
            labels = {label: name} if label else {}
            if n == 1 or score > threshold:  # NaN compares False
                out.append(Sample(counts, labels, float(spikes)))
            if score == score:
                out.append(Sample(scores, labels, score))
        return out

    def published(self, state: Baseline) -> list[Sample]:
        """Every value the store serves after ``state``: for each series with a finite value so far, its
        spike count and its latest score (once it has one) — what :meth:`samples` of every record up to
        ``state`` leaves in a store, made once per read."""
        scores, counts, label = self.scores.name, self.counts.name, self.label
        out: list[Sample] = []
        for name, n, last, spikes in zip(state.names, state.n, state.last, state.spikes, strict=True):
            if not n:
                continue
            labels = {label: name} if label else {}
            out.append(Sample(counts, labels, float(spikes)))
            if last == last:
                out.append(Sample(scores, labels, last))
        return out

    def fold(self, state: Baseline, values: Values) -> Baseline:
        """Score one record's values against ``state`` and fold them in: the next state.

        In one C call when the compiled module has it and the score is a built-in one (the same bits as
        :meth:`fold_reference`, the plain-Python fold it falls back to)."""
        state, xs = state.aligned(values)
        if not xs:
            return state
        kind = _C_SCORES.get(type(self)._score)
        if kind is None or _EWM_FOLD is None:
            return self._fold(state, xs)
        n, mean, dev, score, fresh, spikes, last = _EWM_FOLD(
            xs,
            state.n,
            state.mean,
            state.dev,
            state.spikes,
            state.last,
            float(self.threshold),
            float(self.alpha),
            self.warmup,
            kind,
            MAD_TO_SIGMA,
            SCALE_FLOOR,
        )
        return Baseline(state.names, n, mean, dev, score, fresh, spikes, last)

    def fold_reference(self, state: Baseline, values: Values) -> Baseline:
        """:meth:`fold` in plain Python: the reference (and the fallback without the compiled module)."""
        state, xs = state.aligned(values)
        if not xs:
            return state
        return self._fold(state, xs)

    def _fold(self, state: Baseline, xs: tuple[float, ...]) -> Baseline:
        threshold, alpha, warmup, isfinite, score_of = (
            self.threshold,
            self.alpha,
            self.warmup,
            math.isfinite,
            self._score,
        )
        nan = math.nan
        rows = []  # (n, mean, dev, score, fresh, spikes, last) per series
        for x, n, m, d, k, last in zip(
            xs, state.n, state.mean, state.dev, state.spikes, state.last, strict=True
        ):
            if not isfinite(x):
                rows.append((n, m, d, nan, False, k, last))
                continue
            score = nan
            entering = x
            if n >= warmup:
                score, low, high = score_of(m, d, x)
                if score > threshold:
                    k += 1
                if score == score:
                    last = score
                entering = low if low > x else x  # clipped into [low, high]: min(max(x, low), high)
                entering = high if high < entering else entering
            if n:  # the deviation from the mean before this value; weight max(alpha, 1/n)
                a = 1.0 / n
                d += (a if a > alpha else alpha) * (abs(entering - m) - d)
            a = 1.0 / (n + 1)
            m += (a if a > alpha else alpha) * (entering - m)
            rows.append((n + 1, m, d, score, True, k, last))
        ns, means, devs, scores, fresh, spikes, lasts = zip(*rows, strict=True)
        return Baseline(state.names, ns, means, devs, scores, fresh, spikes, lasts)

    def chain(self) -> Operator:
        return (
            ops.map(self.extract_steps)
            | ops.filter(_present)
            | ops.scan(self.fold_steps, Baseline.empty())
            | ops.map(self.samples)
        )

    alarms: ClassVar[bool] = True

    def pipeline(self, store: SeriesStore, alarm: Callable[[], object] | None = None) -> Pipeline:
        """``chain()`` into ``store``, with the samples made from the latest baseline when the store is
        read (the same values as publishing each record's, once per read); ``alarm()`` is called on each
        record that raised a spike count."""
        return (
            source()
            | ops.map(self.extract_steps)
            | ops.filter(_present)
            | ops.scan(self.fold_steps, Baseline.empty())
            | _PublishLatest(store, self, alarm, self._line_to(alarm))
        )

    def _line_to(self, alarm: object) -> Callable[[float], object] | None:
        """Where the spike line goes after each record (None: nowhere; :class:`LossSpike` overrides)."""
        return None

    def extract_steps(self, record: StepRecord) -> list[Values] | None:
        """What the detector folds of a record, oldest first: :meth:`extract` of the record (a detector
        of per-step values, ``per_step``, also of each unrecorded step it carries); None: nothing."""
        if self.per_step and record.steps:
            found = [self.extract(step) for step in record.every_step()]
            kept = [values for values in found if values is not None]
            return kept or None
        values = self.extract(record)
        return None if values is None else [values]

    def fold_steps(self, state: Baseline, values: list[Values]) -> Baseline:
        """:meth:`fold` each of a record's values in turn."""
        for one in values:
            state = self.fold(state, one)
        return state


@dataclass(frozen=True)
class LossSpike(_Smoothed):
    """The loss's robust z-score against an exponentially weighted baseline of its recent history.

    For every step with a finite loss ``x`` (each record's, and those of the unsampled steps it carries:
    ``StepRecord.steps``), once ``warmup`` losses are in the baseline::

        z = (x - mean) / max(sqrt(pi/2) * dev, 1e-9 * max(|mean|, 1))

    with ``mean`` and ``dev`` the EWM mean and mean absolute deviation of the previous losses (see
    docs/detectors.md; ``sqrt(pi/2) * dev`` estimates σ for normal noise, so ``z`` reads in standard
    deviations). The value enters the baseline winsorised at ``mean ± threshold * scale``.

    Served: ``streamwatch_loss_zscore`` (the last step's z; absent during the warm-up) and
    ``streamwatch_loss_spikes_total`` (steps with ``z > threshold``; 0 from the first loss on).

    In a watch it also posts its spike line after each record (:meth:`spike_line`): an unsampled step
    whose CPU loss passes it is sent at once, so it is judged at its own step (docs/detectors.md).

    Args:
        threshold: a z above it is a spike. 6: normal noise exceeds it about once in 10⁹ steps, so in a
            long run with heavy-tailed minibatch losses and an estimated scale it still stays quiet,
            while a diverging step or a corrupt batch is typically tens of σ out.
        alpha: the EWM weight of a new value (0.05: a memory of about 20 steps).
        warmup: losses in the baseline before z is reported (20: one memory length, 19 deviations).

    Example:
        >>> LossSpike(threshold=8)
        LossSpike(threshold=8, alpha=0.05, warmup=20)
    """

    threshold: float = 6.0
    alpha: float = 0.05
    warmup: int = 20
    scores: ClassVar[Family] = LOSS_ZSCORE
    counts: ClassVar[Family] = LOSS_SPIKES
    label: ClassVar[str] = ""
    per_step: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self._check()

    def extract(self, record: StepRecord) -> Values | None:
        """The record's train loss (None without one)."""
        loss = record.scalars.get("loss")
        if loss is None:
            return None
        return Values(_LOSS, (float(loss),))

    def _score(self, mean: float, dev: float, x: float) -> tuple[float, float, float]:
        scale = max(MAD_TO_SIGMA * dev, SCALE_FLOOR * max(abs(mean), 1.0))
        margin = self.threshold * scale
        return (x - mean) / scale, mean - margin, mean + margin

    def spike_line(self, state: Baseline) -> float:
        """The loss the next step must pass to be a spike against ``state`` (``inf`` while warming up):
        ``mean + threshold * scale``, the upper bound a value enters the baseline within.

        Example:
            >>> spike = LossSpike(warmup=2)
            >>> state = spike.fold(spike.fold(Baseline.empty(), Values(("",), (1.0,))), Values(("",), (3.0,)))
            >>> round(spike.spike_line(state), 3)  # mean 2, deviation 2: 2 + 6 * sqrt(pi/2) * 2
            17.04
        """
        if not state.names or state.n[0] < self.warmup:
            return math.inf
        return self._score(state.mean[0], state.dev[0], state.mean[0])[2]

    def _line_to(self, alarm: object) -> Callable[[float], object] | None:
        """A watch's alarm (:class:`streamwatch._guard.Alarm`) takes the spike line: its quiet step sends
        a step whose loss passes it at once."""
        line = getattr(alarm, "post_line", None)
        return line if callable(line) else None


_LOSS = ("",)


@functools.lru_cache(maxsize=16)
def _grad_layout(keys: tuple[SeriesKey, ...]) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """(the train ``param_grad`` rows, each one's series, the series) of a record layout (cached).

    Series 0 is the global norm; rows that are already totals over the layers (``layer="__all__"``: a
    rank without per-layer detail, ``observe(detail=...)``) count towards it only.
    """
    layers: dict[str, int] = {GLOBAL: 0}
    rows = [i for i, k in enumerate(keys) if k.kind == "param_grad" and k.phase == "train"]
    index = [layers.setdefault(keys[i].layer, len(layers)) for i in rows]
    return np.array(rows, dtype=np.intp), np.array(index, dtype=np.intp), tuple(layers)


@dataclass(frozen=True)
class GradientSpike(_Smoothed):
    """The global and every layer's gradient norm over its exponentially weighted mean.

    For each sampled step with gradient rows, the norms ``g = sqrt(Σ sumsq)`` of the train
    ``param_grad`` rows — all of them (``layer="__all__"``) and each layer's (weight and bias together) —
    and, once ``warmup`` norms are in the baseline::

        ratio = g / mean

    with ``mean`` the EWM of the previous norms (no ratio while ``mean`` is 0). The norm enters the
    baseline winsorised at ``threshold * mean``. In a run that clips with ``clip_grad_norm_`` the global
    norm is the norm before clipping instead (the step's ``log/grad_norm``, which the clip tap records on
    every step, sampled or not): every step's is scored, as the loss's is by :class:`LossSpike`.

    Served: ``streamwatch_grad_norm_ratio{layer}`` and ``streamwatch_grad_norm_spikes_total{layer}``
    (steps with ``ratio > threshold``; 0 from the first gradients on).

    Args:
        threshold: a ratio above it is a spike. 10, as the ``StreamwatchGradientExplosion`` rule:
            minibatch noise moves a gradient norm by a factor of 2–3 around its mean, an explosion by
            orders of magnitude.
        alpha: the EWM weight of a new norm (0.05: a memory of about 20 sampled steps).
        warmup: norms in the baseline before the ratio is reported (20).
        layers: also each layer's norm (False: only the global one).

    Example:
        >>> GradientSpike(layers=False)
        GradientSpike(threshold=10.0, alpha=0.05, warmup=20, layers=False)
    """

    threshold: float = 10.0
    alpha: float = 0.05
    warmup: int = 20
    layers: bool = True
    scores: ClassVar[Family] = GRAD_NORM_RATIO
    counts: ClassVar[Family] = GRAD_NORM_SPIKES
    label: ClassVar[str] = "layer"

    def __post_init__(self) -> None:
        self._check()
        if not isinstance(self.layers, bool):
            raise TypeError(f"Expected `layers` to be True or False, got {self.layers!r}")

    def extract(self, record: StepRecord) -> Values | None:
        """The global and per-layer gradient norms (None without gradient rows or a pre-clip norm); the
        global one is the norm before clipping where the step has it (``log/grad_norm``)."""
        preclip = record.scalars.get(_PRECLIP)
        rows, index, names = _grad_layout(record.keys)
        if not rows.size:
            return None if preclip is None else Values(_GLOBAL, (float(preclip),))
        sumsq = record.column("sumsq")[rows]
        if not self.layers:
            return Values(_GLOBAL, (_root(sum(sumsq.tolist())) if preclip is None else float(preclip),))
        # float sums: an overflow is inf, and a NaN row a NaN norm, without numpy's warnings
        per_series = np.bincount(index, weights=sumsq, minlength=len(names)).tolist()
        norms = list(map(_root, per_series))
        norms[0] = _root(sum(per_series)) if preclip is None else float(preclip)  # the global norm
        return Values(names, tuple(norms))

    def extract_steps(self, record: StepRecord) -> list[Values] | None:
        """The pre-clip norms of the unsampled steps ``record`` carries (a run that clips with
        ``clip_grad_norm_``: every step's), oldest first, then :meth:`extract` of the record."""
        carried = (one.scalars.get(_PRECLIP) for one in record.steps)
        found = [Values(_GLOBAL, (float(norm),)) for norm in carried if norm is not None]
        own = self.extract(record)
        if own is not None:
            found.append(own)
        return found or None

    def _score(self, mean: float, dev: float, x: float) -> tuple[float, float, float]:
        if mean > 0:
            return x / mean, -math.inf, self.threshold * mean
        return math.nan, -math.inf, math.inf


_GLOBAL = (GLOBAL,)
_PRECLIP = LOGGED + GRAD_NORM
"""A step's gradient norm before clipping (the clip tap's, or a trainer's ``grad_norm``), as a scalar."""


def _root(sumsq: float) -> float:
    """√sumsq as a norm: NaN for a NaN or (in a corrupt record) negative sum of squares, never an error."""
    return math.sqrt(sumsq) if sumsq >= 0 else math.nan


@functools.lru_cache(maxsize=16)
def _update_layout(keys: tuple[SeriesKey, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[str, ...]]:
    """(train ``update`` rows, their ``param`` rows, each pair's layer index, the layers) (cached)."""
    weights = {(k.layer, k.name): i for i, k in enumerate(keys) if k.kind == "param" and k.phase == "train"}
    layers: dict[str, int] = {}
    updates, params, index = [], [], []
    for i, k in enumerate(keys):
        j = weights.get((k.layer, k.name))
        if k.kind == "update" and k.phase == "train" and j is not None:
            updates.append(i)
            params.append(j)
            index.append(layers.setdefault(k.layer, len(layers)))
    return (
        np.array(updates, dtype=np.intp),
        np.array(params, dtype=np.intp),
        np.array(index, dtype=np.intp),
        tuple(layers),
    )


@dataclass(frozen=True)
class UpdateRatioBand(Detector):
    """Every layer's update/weight ratio against a band.

    For each sampled step with ``update`` and ``param`` rows (both kinds every 10th sampled step by
    default), per layer, over its parameters with both rows::

        ratio = sqrt(Σ update sumsq / Σ weight sumsq)          # ‖Δw‖ / ‖w‖
        out_of_band = log10(ratio / high) if ratio > high, log10(ratio / low) if ratio < low, else 0

    A layer whose weights are all zero has no ratio; one that was not updated at all has ratio 0 and
    ``out_of_band = -inf``. No warm-up and no memory: a wrong learning rate is persistent, and the
    alert's ``for:`` asks for persistence.

    Served: ``streamwatch_layer_update_ratio{layer}`` and ``streamwatch_update_ratio_out_of_band{layer}``.

    Args:
        low, high: the band. 1e-5 and 1e-1: two decades either side of the classic ~1e-3 heuristic, so
            learning-rate warm-up and decay and Adam-style updates (about lr / rms(w), 1e-3 to 5e-2) stay
            inside, while a layer changing by a tenth of its norm per step is unstable and one changing
            by less than 1e-5 is not learning.

    Example:
        >>> UpdateRatioBand(low=1e-4)
        UpdateRatioBand(low=0.0001, high=0.1)
    """

    low: float = 1e-5
    high: float = 1e-1

    def __post_init__(self) -> None:
        low = check_real(self.low, "low", above=0, finite=True)
        high = check_real(self.high, "high", above=0, finite=True)
        if not low < high:
            raise ValueError(f"Expected `low` < `high`, got low={self.low!r}, high={self.high!r}")

    def extract(self, record: StepRecord) -> Values | None:
        """Each layer's update/weight ratio (None without update and weight rows)."""
        updates, params, index, names = _update_layout(record.keys)
        if not updates.size:
            return None
        sumsq = record.column("sumsq")
        n = len(names)
        weights = np.bincount(index, weights=sumsq[params], minlength=n)
        if names == _GLOBAL:  # a rank without per-layer detail: the total of the stepped weights only
            stepped = stepped_weight_sumsq(record, record.keys[updates[0]])
            if stepped is not None:
                weights = np.array([stepped])
        with np.errstate(all="ignore"):
            ratio = np.sqrt(np.bincount(index, weights=sumsq[updates], minlength=n) / weights)
        return Values(names, tuple(ratio.tolist()))

    def samples(self, values: Values) -> list[Sample]:
        """``streamwatch_layer_update_ratio`` and ``streamwatch_update_ratio_out_of_band`` per layer with a
        finite ratio."""
        low, high = self.low, self.high
        out: list[Sample] = []
        for name, ratio in zip(values.names, values.values, strict=True):
            if not math.isfinite(ratio):
                continue
            if ratio > high:
                excess = math.log10(ratio / high)
            elif ratio < low:
                excess = math.log10(ratio / low) if ratio > 0 else -math.inf
            else:
                excess = 0.0
            labels = {"layer": name}
            out.append(Sample(LAYER_UPDATE_RATIO.name, labels, ratio))
            out.append(Sample(UPDATE_RATIO_OUT_OF_BAND.name, labels, excess + 0.0))  # no -0.0
        return out

    def published(self, latest: Values) -> list[Sample]:
        """Every value the store serves after ``latest`` (each layer's latest finite ratio)."""
        return self.samples(latest)

    def chain(self) -> Operator:
        return ops.map(self.extract) | ops.filter(_present) | ops.map(self.samples)

    def pipeline(self, store: SeriesStore, alarm: Callable[[], object] | None = None) -> Pipeline:
        """``chain()`` into ``store``, with the samples made from each layer's latest finite ratio when the
        store is read (the same values as publishing each record's, once per read). No alarm: a band is a
        state, not an event (its alert waits 10 minutes)."""
        return (
            source()
            | ops.map(self.extract)
            | ops.filter(_present)
            | ops.scan(_latest_finite, _NO_VALUES)
            | _PublishLatest(store, self)
        )


_NO_VALUES = Values((), ())


def _latest_finite(latest: Values, values: Values) -> Values:
    """``latest`` with the finite values of ``values`` in place of (or after) those of the same names."""
    merged = dict(zip(latest.names, latest.values, strict=True))
    isfinite = math.isfinite
    merged.update((name, x) for name, x in zip(values.names, values.values, strict=True) if isfinite(x))
    return Values(tuple(merged), tuple(merged.values()))


_C_SCORES: dict[Any, int] = {LossSpike._score: 0, GradientSpike._score: 1}
"""The scores the compiled fold computes, by the method that is its reference (a subclass that overrides
``_score`` folds in Python)."""

DEFAULT_DETECTORS: tuple[Detector, ...] = (LossSpike(), GradientSpike(), UpdateRatioBand())
"""The detectors with their documented defaults (docs/detectors.md)."""


def check_detectors(detectors: object) -> tuple[Detector, ...]:
    """``detectors`` checked: a collection of detectors, at most one of each class (two would serve the
    same series), read once (``observe(detectors=...)`` checks its argument with this before attaching
    anything).

    Raises:
        TypeError: not a collection of detectors (a single detector is refused, naming the fix).
        ValueError: two detectors of one class.

    Example:
        >>> check_detectors([LossSpike()])
        (LossSpike(threshold=6.0, alpha=0.05, warmup=20),)
    """
    if isinstance(detectors, Detector):
        raise TypeError(
            f"Expected a collection of detectors, got the single detector {detectors!r}: pass "
            f"[{detectors!r}] (or replace one of streamwatch.detectors.DEFAULT_DETECTORS with it)"
        )
    if isinstance(detectors, str | bytes) or not isinstance(detectors, Iterable):
        raise TypeError(
            f"Expected `detectors` to be a collection of streamwatch detectors, got {detectors!r}"
        )
    out = tuple(detectors)
    seen: set[type] = set()
    for detector in out:
        if not isinstance(detector, Detector):
            raise TypeError(
                "Expected every entry of `detectors` to be a streamwatch.detectors.Detector, "
                f"got {detector!r}"
            )
        if type(detector) in seen:
            raise ValueError(
                f"Expected at most one {type(detector).__name__} in `detectors`: two would serve the same "
                "series"
            )
        seen.add(type(detector))
    return out


def pipelines(
    store: SeriesStore,
    detectors: Iterable[Detector] = DEFAULT_DETECTORS,
    alarm: Callable[[], object] | None = None,
) -> list[Pipeline]:
    """One pipeline per detector, each publishing into ``store``: hand them to a worker that feeds it
    step records (each is stopped alone if it fails). ``alarm()`` is called when a spike or drift
    detector fires (a watch's escalation).

    Raises:
        TypeError: ``detectors`` is not a collection of detectors.
        ValueError: two detectors of one class.

    Example:
        >>> import streamwatch as sw
        >>> [str(p).split(" | ")[1].split()[1] for p in pipelines(sw.SeriesStore())]
        ['_Smoothed.extract_steps>', 'GradientSpike.extract_steps>', 'UpdateRatioBand.extract>']
    """
    return [detector.pipeline(store, alarm) for detector in check_detectors(detectors)]


class Watched(Protocol):
    """What :func:`attach` reads of a watch (a :class:`streamwatch.Watch`)."""

    @property
    def detectors(self) -> tuple[Detector, ...]:
        """The detectors ``observe()`` runs."""
        ...

    @property
    def store(self) -> SeriesStore:
        """The series store the detectors publish into."""
        ...

    def pipe(self, pipeline: Pipeline) -> Pipeline:
        """Attach a pipeline to the watch's worker."""
        ...


_ATTACHED: weakref.WeakKeyDictionary[Watched, set[type[Detector]]] = weakref.WeakKeyDictionary()
"""The detector classes :func:`attach` added to each watch (beside those ``observe()`` built in)."""


def attach(watch: Watched, detectors: Iterable[Detector] = DEFAULT_DETECTORS) -> list[Pipeline]:
    """Attach detectors to a running watch (each with ``watch.pipe``, publishing into ``watch.store``).

    ``observe()`` runs :data:`DEFAULT_DETECTORS` already (``observe(detectors=...)`` chooses them); this
    adds detectors to a watch made with fewer (``detectors=()``). Their values appear in
    ``watch.snapshot()`` and on ``/metrics``. They see the records that arrive from now on; a
    ``watch.flush()`` may return before they have seen the last one (``close()`` waits for them).

    Raises:
        TypeError: ``detectors`` is not a collection of detectors.
        ValueError: two detectors of one class, or one of a class the watch already runs (two would
            serve the same series).

    Example:
        >>> import torch, streamwatch as sw
        >>> from streamwatch import detectors
        >>> model = torch.nn.Linear(3, 1)
        >>> with sw.observe(model, every=1, detectors=()) as watch:
        ...     _ = detectors.attach(watch, [detectors.LossSpike(warmup=2)])
        ...     for _ in range(4):
        ...         loss = model(torch.randn(8, 3)).pow(2).mean()
        ...         loss.backward()
        ...         watch.step(loss=loss)
        >>> sorted({s.name for s in watch.snapshot() if s.name.startswith("streamwatch_loss_")})
        ['streamwatch_loss_spikes', 'streamwatch_loss_zscore']
    """
    chosen = check_detectors(detectors)
    running = {type(d) for d in watch.detectors} | _ATTACHED.get(watch, set())
    clash = [d for d in chosen if type(d) in running]
    if clash:
        raise ValueError(
            f"Expected detectors the watch does not run yet, got {clash[0]!r}: a {type(clash[0]).__name__} "
            "already runs on it (observe() runs streamwatch.detectors.DEFAULT_DETECTORS unless told "
            "otherwise); to configure it, pass it to observe(detectors=[...]) instead"
        )
    _ATTACHED.setdefault(watch, set()).update(type(d) for d in chosen)
    return [watch.pipe(pipeline) for pipeline in pipelines(watch.store, chosen)]
