"""The ``Drift`` detector: a one-sided CUSUM of every step's log loss and log gradient norm before clipping.

A spike detector (``LossSpike``, ``GradientSpike``) asks whether one value is far from its recent
history. A run that drifts upwards — a learning rate climbing past the edge of stability, attention logits
growing — moves its own history along with it, a little every step, and no single value is far out.
CUSUM (Page, 1954) adds the small excesses up: with ``z`` each value's robust z-score against the same
baseline ``LossSpike`` keeps (an EWM mean and mean absolute deviation, the value entering winsorised)::

    S ← max(0, S + min(z, 6) − slack)          alarm when S > threshold, then S ← 0

``z`` is capped at 6 so that one spike (the spike detectors' business) adds at most ``6 − slack`` and never
alarms alone: an alarm needs several steps in a row above the baseline. The values are read on their log
scale (``log(loss)``, ``log(grad_norm)``): a divergence multiplies them, and a scale-free score needs no
per-run tuning. Values that are missing, not finite or not positive are skipped (never read as zero).

Every step is read: the unsampled steps' scalars ride with the next record (``record.steps``), so the
detector's values are the same under the governor as with ``every=1``. Series: ``loss`` (the training
loss) and ``grad_norm`` (the norm before clipping: the clip tap's ``log/grad_norm``, ``_clip_tap.py``).

Example:
    >>> import streamwatch as sw
    >>> from streamwatch.testing import table
    >>> alarms = []
    >>> pipeline = sw.source() | Drift().chain() | sw.sinks.callback(alarms.append)
    >>> noise = [0.1, -0.05, 0.02, -0.12, 0.07, -0.02]  # a noisy flat loss, then up 4 % a step from 60
    >>> for step in range(90):
    ...     loss = (1.0 + noise[step % 6]) * 1.04 ** max(0, step - 60)
    ...     pipeline.push(sw.StepRecord(step, 0.0, 0, (), table(0), {"loss": loss}))
    ...     if alarms[-1][0].value and not alarms[-2][0].value: print("alarm at step", step)
    alarm at step 69
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from streamwatch import ops
from streamwatch._clip_tap import GRAD_NORM
from streamwatch._detectors import Detector
from streamwatch._families import DRIFT_ALARMS, DRIFT_CUSUM, LOGGED
from streamwatch._pipeline import Operator, Pipeline, Sink, source
from streamwatch._record import Sample, StepRecord
from streamwatch._store import SeriesStore
from streamwatch._validate import check_int, check_real

__all__ = ["CAP", "Drift", "DriftState"]

CAP = 6.0
"""A z-score adds at most this to the sum (one spike never alarms alone)."""

_C = math.sqrt(math.pi / 2)  # σ / E|x − μ| for normal noise
_SERIES = (("loss", "loss"), ("grad_norm", LOGGED + GRAD_NORM))  # (series, the step scalar it reads)


class _Series(NamedTuple):
    n: int  # values in the baseline
    mean: float
    dev: float
    cusum: float
    alarms: int


class DriftState(NamedTuple):
    """The detector's state after a record: each series' baseline, sum and alarm count (immutable)."""

    series: tuple[tuple[str, _Series], ...]

    @classmethod
    def empty(cls) -> DriftState:
        return cls(())


def _present(item: object) -> bool:
    return item is not None


@dataclass(frozen=True)
class Drift(Detector):
    """A one-sided CUSUM of every step's log loss and log pre-clip gradient norm (module docstring).

    Served: ``streamwatch_drift_cusum{series}`` (the sum after the last step, once warmed up) and
    ``streamwatch_drift_alarms_total{series}`` (times the sum passed ``threshold``; 0 from the first
    value on), ``series`` being ``loss`` or ``grad_norm``.

    Args:
        threshold: the sum that alarms (10: about four steps in a row at 3 σ, or twenty at 1 σ). On
            normal noise with a known scale, one false alarm in about 140 000 steps (Siegmund's
            approximation of the average run length, ``(e^{2kb} − 2kb − 1) / 2k²`` with ``b = h + 1.166``);
            chosen on the divergence suite (docs/detectors.md).
        slack: subtracted from every z-score (0.5: a drift of half a σ a step is ignored).
        alpha: the baseline's EWM weight (0.05, as ``LossSpike``).
        warmup: values in the baseline before the sum starts (20).

    Example:
        >>> Drift()
        Drift(threshold=10.0, slack=0.5, alpha=0.05, warmup=20)
    """

    threshold: float = 10.0
    slack: float = 0.5
    alpha: float = 0.05
    warmup: int = 20

    def __post_init__(self) -> None:
        check_real(self.threshold, "threshold", above=0, finite=True)
        check_real(self.slack, "slack", at_least=0, finite=True)
        check_real(self.alpha, "alpha", above=0, at_most=1)
        check_int(self.warmup, "warmup", minimum=2, note="a baseline needs a mean and a deviation")

    def chain(self) -> Operator:
        return (
            ops.map(self.extract_steps)
            | ops.filter(_present)
            | ops.scan(self.fold, DriftState.empty())
            | ops.map(self.samples)
        )

    alarms: ClassVar[bool] = True

    def pipeline(self, store: SeriesStore, alarm: Callable[[], object] | None = None) -> Pipeline:
        """``chain()`` into ``store``; ``alarm()`` is called on each record that raised an alarm count."""
        return (
            source()
            | ops.map(self.extract_steps)
            | ops.filter(_present)
            | ops.scan(self.fold, DriftState.empty())
            | _Publish(store, self, alarm)
        )

    def extract_steps(self, record: StepRecord) -> list[tuple[tuple[str, float], ...]] | None:
        """Each step's positive finite values, oldest first: the steps ``record`` carries, then its own."""
        found = [_values(one.scalars) for one in record.steps]
        found.append(_values(record.scalars))
        kept = [values for values in found if values]
        return kept or None

    def fold(self, state: DriftState, steps: list[tuple[tuple[str, float], ...]]) -> DriftState:
        """Fold each step's values into their series, in order."""
        series = dict(state.series)
        for values in steps:
            for name, x in values:
                series[name] = self._step(series.get(name, _Series(0, 0.0, 0.0, 0.0, 0)), math.log(x))
        return DriftState(tuple(series.items()))

    def _step(self, s: _Series, x: float) -> _Series:
        n, m, d, cusum, alarms = s
        entering = x
        if n >= self.warmup:
            scale = max(_C * d, 1e-9 * max(abs(m), 1.0))
            z = (x - m) / scale
            cusum = max(0.0, cusum + min(z, CAP) - self.slack)
            if cusum > self.threshold:
                alarms += 1
                cusum = 0.0
            entering = min(max(x, m - CAP * scale), m + CAP * scale)
        if n:
            d += max(self.alpha, 1.0 / n) * (abs(entering - m) - d)
        m += max(self.alpha, 1.0 / (n + 1)) * (entering - m)
        return _Series(n + 1, m, d, cusum, alarms)

    def samples(self, state: DriftState) -> list[Sample]:
        """The sum (once warmed up) and the alarm count of every series seen."""
        out = []
        for name, s in state.series:
            labels = {"series": name}
            out.append(Sample(DRIFT_ALARMS.name, labels, float(s.alarms)))
            if s.n > self.warmup:
                out.append(Sample(DRIFT_CUSUM.name, dict(labels), s.cusum))
        return out


class _Publish(Sink):
    """The end of :meth:`Drift.pipeline`: the state's samples into the store, and the alarm when the
    state's alarm count rose."""

    __slots__ = ("alarm", "count", "detector", "store")

    def __init__(self, store: SeriesStore, detector: Drift, alarm: Callable[[], object] | None) -> None:
        self.store, self.detector, self.alarm = store, detector, alarm
        self.count = 0

    def send(self, item: DriftState) -> None:
        count = sum(s.alarms for _, s in item.series)
        if self.alarm is not None and count > self.count:
            self.alarm()
        self.count = count
        self.store.put(self.detector.samples(item))

    def __repr__(self) -> str:
        return f"<publish {self.detector!r}>"


def _values(scalars: object) -> tuple[tuple[str, float], ...]:
    return tuple(_positive(scalars))


def _positive(scalars: object) -> Iterator[tuple[str, float]]:
    get = scalars.get  # type: ignore[attr-defined]
    for name, key in _SERIES:
        x = get(key)
        if x is not None and math.isfinite(x) and x > 0:
            yield name, float(x)
