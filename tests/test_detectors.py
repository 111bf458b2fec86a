"""The built-in detectors (``streamwatch.detectors``, docs/detectors.md).

Every value a detector reports is checked against a plain reference computed here:

* :func:`reference`, a scalar loop written from the formulas in docs/detectors.md (EWM mean and mean absolute
  deviation with the ``max(alpha, 1/t)`` warm-start, winsorisation at the threshold, robust z-score or ratio);
* :func:`closed_form`, the same baseline as explicit numpy weight matrices (valid while nothing is
  winsorised), so the scalar loop is itself checked against something that shares none of its code;
* for real training, the gradient norms and update ratios computed with torch from the parameters
  themselves (not from streamwatch's summaries), and the losses the training loop saw.

Unit tests feed hand-made step records (records that lack a value, non-finite values, layers that come and
go, zero baselines); the training tests inject faults at known steps — a batch that spikes the loss, a
gradient hook that multiplies one layer's gradient, a learning rate far too high or too low for one layer —
and check the per-step values (through the detector's ``chain()`` into a collecting sink), the latest values
in ``watch.snapshot()`` and on ``/metrics`` (``promtool check metrics``), and that a failing detector stops
only itself and is counted and reported.
"""

from __future__ import annotations

import contextlib
import math
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import streamwatch as sw
from streamwatch import detectors, testing
from streamwatch._detectors import Values
from streamwatch._record import Sample, SeriesKey, StepRecord
from tests.promtool import check_metrics
from tests.training import Step, Train

C = math.sqrt(math.pi / 2)  # mean absolute deviation -> sigma, for normal noise


# -- references ---------------------------------------------------------------------------------------------


@dataclass
class Reference:
    scores: list[float | None]  # per value: the reported score (None: none reported)
    counts: list[float | None]  # per value: the spike count published (on the first value and on a spike)
    spikes: int
    mean: float
    dev: float


def reference(
    xs: Sequence[float | None], *, kind: str, threshold: float, alpha: float = 0.05, warmup: int = 20
) -> Reference:
    """The detectors' baseline as docs/detectors.md writes it, one value at a time.

    ``kind="z"`` (LossSpike): score = (x - m) / max(sqrt(pi/2) d, 1e-9 max(|m|, 1)), winsorised at
    m +- threshold * scale. ``kind="ratio"`` (GradientSpike): score = x / m (none while m == 0), winsorised
    at threshold * m. None or non-finite values are skipped.
    """
    n, m, d, spikes = 0, 0.0, 0.0, 0
    scores: list[float | None] = []
    counts: list[float | None] = []
    for x in xs:
        if x is None or not math.isfinite(x):
            scores.append(None)
            counts.append(None)
            continue
        score, entering = None, x
        if n >= warmup:
            if kind == "z":
                scale = max(C * d, 1e-9 * max(abs(m), 1.0))
                score = (x - m) / scale
                entering = min(max(x, m - threshold * scale), m + threshold * scale)
            elif m > 0:
                score = x / m
                entering = min(x, threshold * m)
            if score is not None and score > threshold:
                spikes += 1
        counts.append(float(spikes) if n == 0 or (score is not None and score > threshold) else None)
        if n > 0:  # the deviation from the mean before this value
            d += max(alpha, 1 / n) * (abs(entering - m) - d)
        m += max(alpha, 1 / (n + 1)) * (entering - m)
        n += 1
        scores.append(score)
    return Reference(scores, counts, spikes, m, d)


def closed_form(xs: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """(mean after each value, mean absolute deviation after each value) as explicit weighted sums: the
    first ``1/alpha`` values (deviations) averaged with equal weights, then an EWM with weight ``alpha``
    (pandas' ``ewm(alpha, adjust=False)`` started from that average). No winsorisation."""
    k = round(1 / alpha)
    n = len(xs)

    def smooth(values: np.ndarray) -> np.ndarray:
        out = np.empty(len(values))
        count = np.arange(1, len(values) + 1)
        head = min(k, len(values))
        out[:head] = np.cumsum(values[:head]) / count[:head]
        if len(values) > k:
            t = np.arange(k, len(values))
            lag = t[:, None] - t[None, :]
            weights = np.where(lag >= 0, alpha * (1 - alpha) ** np.maximum(lag, 0), 0.0)
            start = (1 - alpha) ** (t - (k - 1)) * out[k - 1]
            out[k:] = start + weights @ values[k:]
        return out

    means = smooth(xs)
    deviations = np.abs(xs[1:] - means[:-1])  # each value against the mean before it
    devs = np.concatenate([[0.0], smooth(deviations)])
    assert len(devs) == n
    return means, devs


def test_the_scalar_reference_agrees_with_the_closed_form() -> None:
    rng = np.random.default_rng(0)
    xs = 2.0 + 0.1 * rng.standard_normal(200)
    means, devs = closed_form(xs, 0.05)
    for t in (1, 5, 20, 21, 57, 200):
        ref = reference(list(xs[:t]), kind="z", threshold=6.0)
        assert ref.spikes == 0  # nothing winsorised: the closed form applies
        assert ref.mean == pytest.approx(means[t - 1], rel=1e-12)
        assert ref.dev == pytest.approx(devs[t - 1], rel=1e-12)
    assert devs[-1] * C == pytest.approx(0.1, rel=0.2)  # sqrt(pi/2) * MAD estimates sigma


# -- records by hand ----------------------------------------------------------------------------------------


def record(step: int, rows: dict[SeriesKey, float] | None = None, **scalars: float) -> StepRecord:
    """A step record whose rows have only their sum of squares set."""
    keys = tuple(rows or {})
    table = testing.table(len(keys), sumsq=list((rows or {}).values()), fill=0.0)
    table.setflags(write=False)
    return StepRecord(step, 0.0, 0, keys, table, scalars)


def grad(layer: str, name: str = "weight", phase: str = "train") -> SeriesKey:
    return SeriesKey(phase, layer, "param_grad", name)


def run(detector: detectors.Detector, records: Sequence[StepRecord]) -> list[list[Sample]]:
    """The samples the detector yields for each record (``[]`` for a record it skips)."""
    out = sw.sinks.collect()
    pipeline = sw.source() | detector.chain() | out
    items: list[list[Sample]] = []
    for r in records:
        before = len(out.items)
        pipeline.push(r)
        assert len(out.items) - before in (0, 1)
        items.append(out.items[-1] if len(out.items) > before else [])
    pipeline.close()
    return items


def value(samples: list[Sample], name: str, **labels: str) -> float | None:
    found = [
        s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) <= 1
    return found[0] if found else None


def series(items: list[list[Sample]], name: str, **labels: str) -> list[float | None]:
    return [value(samples, name, **labels) for samples in items]


def same(actual: Sequence[float | None], expected: Sequence[float | None], rel: float = 1e-12) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if e is None:
            assert a is None, (i, a)
        else:
            assert a == pytest.approx(e, rel=rel, abs=1e-300), (i, a, e)


# -- LossSpike: pure logic ----------------------------------------------------------------------------------


def noisy_losses(n: int, spikes: dict[int, float], seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    losses = 2.0 * np.exp(-np.arange(n) / 150) + 0.05 * rng.standard_normal(n)  # a decreasing, noisy loss
    for at, size in spikes.items():
        losses[at] += size
    return [float(x) for x in losses]


def test_loss_zscores_and_spike_counts_equal_the_reference() -> None:
    losses = noisy_losses(300, {60: 3.0, 61: 2.5, 150: 0.2, 200: 5.0})
    items = run(detectors.LossSpike(), [record(i, loss=x) for i, x in enumerate(losses)])
    ref = reference(losses, kind="z", threshold=6.0)
    same(series(items, "streamwatch_loss_zscore"), ref.scores)
    counts = series(items, "streamwatch_loss_spikes")
    same(counts, ref.counts)
    assert counts[0] == 0.0  # the counter is there from the first loss, the z-score after warm-up
    assert ref.spikes == 3  # 60, 61 and 200; 150 (about 4 sigma) is not a spike
    assert [i for i, c in enumerate(counts) if c is not None] == [0, 60, 61, 200]  # first value, then changes
    assert [i for i, z in enumerate(ref.scores) if z is not None and z > 6] == [60, 61, 200]
    # the loss decreases: the baseline lags it (the EWM of the last ~20 steps) and the lag widens the scale
    z60 = series(items, "streamwatch_loss_zscore")[60]
    assert z60 is not None
    assert z60 > 10


def test_a_spike_enters_the_baseline_winsorised_so_the_next_one_is_still_caught() -> None:
    losses = [1.0 + 0.01 * math.sin(i) for i in range(40)]
    losses[25] = 100.0
    losses[27] = 1.5  # about 44 robust sigma: caught although a huge spike came just before it
    items = run(detectors.LossSpike(), [record(i, loss=x) for i, x in enumerate(losses)])
    ref = reference(losses, kind="z", threshold=6.0)
    same(series(items, "streamwatch_loss_zscore"), ref.scores)
    assert ref.spikes == 2
    assert ref.scores[27] is not None
    assert ref.scores[27] > 40
    # without winsorisation the first spike would have lifted the baseline and its scale, hiding the second
    unclipped = reference(losses, kind="z", threshold=math.inf)
    assert unclipped.scores[27] is not None
    assert unclipped.scores[27] < 0


def test_loss_zscores_follow_the_closed_form_while_nothing_is_winsorised() -> None:
    losses = np.array(noisy_losses(120, {}, seed=3))
    means, devs = closed_form(losses, 0.05)
    items = run(detectors.LossSpike(), [record(i, loss=float(x)) for i, x in enumerate(losses)])
    z = series(items, "streamwatch_loss_zscore")
    expected = [None] * 20 + ((losses[20:] - means[19:-1]) / (C * devs[19:-1])).tolist()
    same(z, expected, rel=1e-9)


def test_records_without_a_finite_loss_are_skipped_not_read_as_zero() -> None:
    losses: list[float | None] = list(noisy_losses(60, {}, seed=1))
    losses[10] = None  # a record without a loss (e.g. a step that sampled other kinds only)
    losses[30] = float("nan")
    losses[31] = float("inf")
    records = [record(i) if x is None else record(i, loss=x) for i, x in enumerate(losses)]
    items = run(detectors.LossSpike(), records)
    ref = reference(losses, kind="z", threshold=6.0)
    same(series(items, "streamwatch_loss_zscore"), ref.scores)
    assert items[10] == items[30] == items[31] == []  # nothing published for them
    assert ref.spikes == 0
    same(series(items, "streamwatch_loss_spikes"), ref.counts)
    # the skipped values are exactly absent: the same z-scores as the series without them
    kept = [x for x in losses if x is not None and math.isfinite(x)]
    assert [z for z in ref.scores if z is not None] == [
        z for z in reference(kept, kind="z", threshold=6.0).scores if z is not None
    ]


def test_a_constant_loss_gives_finite_zscores() -> None:
    losses = [0.5] * 25 + [0.5 + 1e-3]
    items = run(detectors.LossSpike(), [record(i, loss=x) for i, x in enumerate(losses)])
    z = series(items, "streamwatch_loss_zscore")
    assert z[20:25] == [0.0] * 5
    assert z[25] == pytest.approx(1e-3 / 1e-9, rel=1e-6)  # the scale floor: 1e-9 of max(|mean|, 1)
    assert series(items, "streamwatch_loss_spikes")[-1] == 1


def test_loss_spike_options() -> None:
    losses = noisy_losses(80, {40: 0.4})
    for threshold, alpha, warmup in ((3.0, 0.1, 5), (6.0, 0.2, 2), (10.0, 1.0, 3)):
        detector = detectors.LossSpike(threshold=threshold, alpha=alpha, warmup=warmup)
        items = run(detector, [record(i, loss=x) for i, x in enumerate(losses)])
        ref = reference(losses, kind="z", threshold=threshold, alpha=alpha, warmup=warmup)
        same(series(items, "streamwatch_loss_zscore"), ref.scores)
        same(series(items, "streamwatch_loss_spikes"), ref.counts)
        assert sum(z is not None for z in ref.scores) == len(losses) - warmup


# -- GradientSpike: pure logic ------------------------------------------------------------------------------


def grad_records(norms: dict[str, list[float | None]]) -> list[StepRecord]:
    """Records with a weight and a bias gradient row per layer (sum of squares split 3:1); None: the layer
    has no rows in that record."""
    steps = len(next(iter(norms.values())))
    out = []
    for i in range(steps):
        rows = {}
        for layer, values_ in norms.items():
            v = values_[i]
            if v is not None:
                rows[grad(layer, "weight")] = 0.75 * v * v
                rows[grad(layer, "bias")] = 0.25 * v * v
        out.append(record(i, rows, loss=1.0))
    return out


def test_gradient_ratios_per_layer_and_global_equal_the_reference() -> None:
    rng = np.random.default_rng(4)
    n = 80
    a = (1.0 + 0.2 * rng.standard_normal(n)).tolist()
    b = (0.01 * np.exp(0.3 * rng.standard_normal(n))).tolist()
    a[50] *= 40  # layer "enc" explodes at step 50
    b[65] *= 15  # layer "dec" at 65: too small to move the global norm past 10x
    items = run(detectors.GradientSpike(), grad_records({"enc": list(a), "dec": list(b)}))
    total = [math.sqrt(x * x + y * y) for x, y in zip(a, b, strict=True)]
    for layer, norms in (("enc", a), ("dec", b), ("__all__", total)):
        ref = reference(norms, kind="ratio", threshold=10.0)
        same(series(items, "streamwatch_grad_norm_ratio", layer=layer), ref.scores, rel=1e-9)
        same(series(items, "streamwatch_grad_norm_spikes", layer=layer), ref.counts)
        assert ref.spikes == 1


def test_records_without_gradients_layers_that_come_late_and_non_finite_norms() -> None:
    n = 60
    a: list[float | None] = [1.0 + 0.1 * math.cos(i) for i in range(n)]
    late: list[float | None] = [None] * 30 + [2.0 + 0.1 * math.sin(i) for i in range(30)]
    a[45] = float("nan")  # a NaN gradient: skipped for the layer and for the global norm
    norms = {"a": a, "late": late}
    records = grad_records(norms)
    for i in (5, 6, 40):  # records that sampled no gradients (other kinds only): skipped entirely
        records[i] = record(i, {SeriesKey("train", "a", "activation", ""): 4.0}, loss=1.0)
        a[i] = late[i] = None
    eval_row = record(
        50,
        {
            **dict(zip(records[50].keys, records[50].column("sumsq"), strict=True)),
            grad("a", phase="eval"): 1e9,
        },
        loss=1.0,
    )
    records[50] = eval_row  # an eval-phase gradient row is not the training gradient
    items = run(detectors.GradientSpike(), records)
    for i in (5, 6, 40):
        assert items[i] == []
    total: list[float | None] = []
    for x, y in zip(a, late, strict=True):
        present = [v for v in (x, y) if v is not None]
        total.append(math.sqrt(sum(v * v for v in present)) if present else None)
    for layer, values_ in (("a", a), ("late", late), ("__all__", total)):
        ref = reference(values_, kind="ratio", threshold=10.0)
        same(series(items, "streamwatch_grad_norm_ratio", layer=layer), ref.scores, rel=1e-9)
    assert (
        series(items, "streamwatch_grad_norm_ratio", layer="late")[:50] == [None] * 50
    )  # 20 values of warm-up
    assert series(items, "streamwatch_grad_norm_spikes", layer="late")[30] == 0.0


def test_a_zero_gradient_baseline_gives_no_ratio() -> None:
    norms: list[float | None] = [*([0.0] * 25), 1.0, 2.0]
    items = run(detectors.GradientSpike(layers=False), grad_records({"x": norms}))
    assert series(items, "streamwatch_grad_norm_ratio", layer="__all__")[20:] == [None] * 5 + [
        None,
        2.0 / (1.0 / 20),
    ]
    assert {s.labels["layer"] for samples in items for s in samples} == {"__all__"}  # layers=False


def test_rows_that_total_every_layer_count_towards_the_global_norm_only() -> None:
    """A rank without per-layer detail (``observe(detail=...)``) sends ``layer="__all__"`` rows."""
    rng = np.random.default_rng(5)
    norms = (1.0 + 0.1 * rng.standard_normal(30)).tolist()
    norms[25] *= 50
    reduced = [record(i, {grad("__all__", ""): v * v}, loss=1.0) for i, v in enumerate(norms)]
    items = run(detectors.GradientSpike(), reduced)
    assert {s.labels["layer"] for samples in items for s in samples} == {"__all__"}
    ref = reference(norms, kind="ratio", threshold=10.0)
    same(series(items, "streamwatch_grad_norm_ratio", layer="__all__"), ref.scores, rel=1e-9)
    same(series(items, "streamwatch_grad_norm_spikes", layer="__all__"), ref.counts)
    assert ref.spikes == 1
    # beside per-layer rows, such a row adds to the global norm and names no layer of its own
    values_ = detectors.GradientSpike().extract(record(0, {grad("__all__", ""): 9.0, grad("a"): 16.0}))
    assert values_ is not None
    assert values_.names == ("__all__", "a")
    assert values_.values == (5.0, 4.0)


# -- UpdateRatioBand: pure logic ----------------------------------------------------------------------------


def test_update_ratio_per_layer_and_decades_out_of_band() -> None:
    def key(layer: str, kind: str, name: str) -> SeriesKey:
        return SeriesKey("train", layer, kind, name)

    rows = {
        key("a", "param", "weight"): 300.0,
        key("a", "param", "bias"): 100.0,
        key("a", "update", "weight"): 3e-4,
        key("a", "update", "bias"): 1e-4,  # ratio sqrt(4e-4 / 400) = 1e-3: inside
        key("b", "param", "weight"): 1.0,
        key("b", "update", "weight"): 4.0,  # ratio 2: log10(2 / 0.1) above
        key("c", "param", "weight"): 1.0,
        key("c", "update", "weight"): 1e-14,  # ratio 1e-7: two decades below
        key("d", "param", "weight"): 1.0,
        key("d", "update", "weight"): 0.0,  # not updated: -inf decades
        key("e", "param", "weight"): 0.0,
        key("e", "update", "weight"): 1.0,  # zero weights: no ratio
        key("f", "param", "weight"): 1.0,  # no update row: no ratio
        SeriesKey("eval", "g", "update", "weight"): 1.0,  # not the training phase
        SeriesKey("eval", "g", "param", "weight"): 1.0,
    }
    (samples,) = run(detectors.UpdateRatioBand(), [record(0, rows)])
    ratio = {s.labels["layer"]: s.value for s in samples if s.name == "streamwatch_layer_update_ratio"}
    band = {s.labels["layer"]: s.value for s in samples if s.name == "streamwatch_update_ratio_out_of_band"}
    assert ratio == pytest.approx({"a": 1e-3, "b": 2.0, "c": 1e-7, "d": 0.0}, rel=1e-12)
    assert band == pytest.approx({"a": 0.0, "b": math.log10(20), "c": -2.0, "d": -math.inf}, rel=1e-12)
    assert math.copysign(1, band["a"]) == 1  # 0, not -0.0
    (samples,) = run(detectors.UpdateRatioBand(low=1e-8, high=3.0), [record(0, rows)])
    band = {s.labels["layer"]: s.value for s in samples if s.name == "streamwatch_update_ratio_out_of_band"}
    assert band == {"a": 0.0, "b": 0.0, "c": 0.0, "d": -math.inf}


def test_records_without_update_rows_are_skipped() -> None:
    only_weights = record(0, {SeriesKey("train", "a", "param", "weight"): 1.0})
    assert run(detectors.UpdateRatioBand(), [only_weights, record(1, loss=2.0)]) == [[], []]


def test_update_ratio_of_rows_that_total_every_layer() -> None:
    """A rank without per-layer detail (``observe(detail=...)``): the whole model's ratio."""
    rows = {
        SeriesKey("train", "__all__", "param", ""): 4.0,
        SeriesKey("train", "__all__", "update", ""): 4e-8,
    }
    (samples,) = run(detectors.UpdateRatioBand(), [record(0, rows)])
    assert [(s.name, s.labels, s.value) for s in samples] == [
        ("streamwatch_layer_update_ratio", {"layer": "__all__"}, pytest.approx(1e-4, rel=1e-12)),
        ("streamwatch_update_ratio_out_of_band", {"layer": "__all__"}, 0.0),
    ]


# -- the compiled fold and the store's publication of the latest state ------------------------------------


def random_values(rng: np.random.Generator, n: int) -> list[Values]:
    """Records' values over series that come and go: lognormal norms, now and then 100x spikes, NaN,
    ±inf, zeros and negative values."""
    out = []
    for _ in range(n):
        names = tuple(f"l{i}" for i in sorted(rng.choice(12, size=int(rng.integers(1, 12)), replace=False)))
        xs = np.exp(rng.normal(size=len(names))) * np.where(rng.random(len(names)) < 0.03, 100.0, 1.0)
        odd = rng.random(len(names))
        xs = np.where(odd < 0.03, np.nan, xs)
        xs = np.where((odd >= 0.03) & (odd < 0.05), np.inf, xs)
        xs = np.where((odd >= 0.05) & (odd < 0.07), 0.0, xs)
        xs = np.where((odd >= 0.07) & (odd < 0.09), -xs, xs)
        out.append(Values(names, tuple(xs.tolist())))
    return out


def identical(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Two baselines field by field: the same types and the same bits (NaN where NaN)."""
    return all(
        type(x) is type(y) and (x == y or (x != x and y != y))
        for p, q in zip(a, b, strict=True)
        for x, y in zip(p, q, strict=True)
    )


@pytest.mark.parametrize(
    "detector",
    [
        detectors.LossSpike(warmup=3),
        detectors.LossSpike(),
        detectors.LossSpike(threshold=0.5, alpha=1.0, warmup=2),
        detectors.GradientSpike(warmup=3),
        detectors.GradientSpike(threshold=2.0, alpha=0.3),
    ],
    ids=repr,
)
def test_the_compiled_fold_is_the_python_reference_to_the_bit(detector: Any) -> None:
    from streamwatch import _detectors

    assert _detectors._EWM_FOLD is not None, "the compiled module has no ewm_fold(): rebuild it"
    fast = slow = _detectors.Baseline.empty()
    for values in random_values(np.random.default_rng(7), 1500):
        fast, slow = detector.fold(fast, values), detector.fold_reference(slow, values)
        assert identical(fast, slow), (values, fast, slow)
    assert sum(slow.spikes) > 0
    assert slow.names


def test_a_detector_with_its_own_score_folds_in_python() -> None:
    @dataclass(frozen=True)
    class Doubled(detectors.GradientSpike):
        def _score(self, mean: float, dev: float, x: float) -> tuple[float, float, float]:
            ratio, low, high = super()._score(mean, dev, x)
            return 2 * ratio, low, high

    norms = [1.0] * 5 + [4.0]
    items = run(Doubled(warmup=5, layers=False), grad_records({"x": norms}))
    assert series(items, "streamwatch_grad_norm_ratio", layer="__all__")[-1] == 8.0  # 2 * 4 / 1


def published(store: sw.SeriesStore) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for s in store.samples()
        if s.name != "streamwatch_step"
    }


@pytest.mark.parametrize("make", [detectors.LossSpike, detectors.GradientSpike, detectors.UpdateRatioBand])
def test_the_store_serves_what_publishing_every_records_samples_would_leave(make: Any) -> None:
    """``pipeline(store)`` hands the store its latest state; read after any record, the store serves
    exactly what putting each record's samples (``chain()``) would have left."""
    detector = make(warmup=3) if make is not detectors.UpdateRatioBand else make()
    rng = np.random.default_rng(11)
    lazy, eager = sw.SeriesStore(metrics=()), sw.SeriesStore(metrics=())
    pipeline = detector.pipeline(lazy)
    chained = sw.source() | detector.chain() | sw.sinks.callback(eager.put)
    for step, values in enumerate(random_values(rng, 300)):
        rows: dict[SeriesKey, float] = {}
        for name, x in zip(values.names, values.values, strict=True):
            rows[grad(name)] = x * x if math.isfinite(x) else x
            rows[SeriesKey("train", name, "param", "weight")] = abs(x) * 1e3
            rows[SeriesKey("train", name, "update", "weight")] = x * 1e-3 if step % 3 else math.nan
        loss = {"loss": values.values[0]} if step % 5 else {}
        r = record(step, rows, **loss)
        pipeline.push(r)
        chained.push(r)
        if step % 7 == 0 or step > 290:
            assert published(lazy) == published(eager), step
    assert published(lazy)  # something was served


def test_a_failure_to_publish_stops_that_detector_only_and_is_reported() -> None:
    class Unpublishable(detectors.LossSpike):
        def published(self, state: Any) -> list[Sample]:
            raise RuntimeError("publishing bug")

    store = sw.SeriesStore(metrics=())
    broken = Unpublishable(warmup=2).pipeline(store)
    going = detectors.GradientSpike(warmup=2).pipeline(store)
    for step in range(6):
        r = record(step, {grad("a"): 1.0 + step}, loss=1.0 + step)
        broken.push(r)
        going.push(r)
    served = published(store)  # the read publishes: the failure is kept, the other values served
    assert ("streamwatch_grad_norm_ratio", (("layer", "a"),)) in served
    assert not [name for name, _ in served if name.startswith("streamwatch_loss_")]
    assert [(where, str(exc)) for where, exc in store.failures] == [
        (f"SeriesStore publishing {broken.sink!r}", "publishing bug")
    ]
    broken.push(record(6, loss=9.0))  # refused from now on: listed once
    store.samples()
    assert len(store.failures) == 1


# -- arguments --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: detectors.LossSpike(threshold=0), "threshold"),
        (lambda: detectors.LossSpike(threshold=math.inf), "threshold"),
        (lambda: detectors.LossSpike(threshold=True), "threshold"),
        (lambda: detectors.LossSpike(alpha=0), "alpha"),
        (lambda: detectors.GradientSpike(alpha=1.5), "alpha"),
        (lambda: detectors.GradientSpike(warmup=1), "warmup"),
        (lambda: detectors.GradientSpike(warmup=2.5), "warmup"),  # type: ignore[arg-type]
        (lambda: detectors.UpdateRatioBand(low=0.1, high=0.01), "low"),
        (lambda: detectors.UpdateRatioBand(low=-1.0), "low"),
    ],
)
def test_bad_arguments_are_refused(make: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_collections_are_refused() -> None:
    store = sw.SeriesStore()
    with pytest.raises(TypeError, match=r"single detector .* pass \[LossSpike"):
        detectors.pipelines(store, detectors.LossSpike())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Detector"):
        detectors.pipelines(store, [detectors.LossSpike(), "loss"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at most one LossSpike"):
        detectors.pipelines(store, [detectors.LossSpike(), detectors.LossSpike(threshold=3)])
    with pytest.raises(TypeError, match="True or False"):
        detectors.GradientSpike(layers=1)  # type: ignore[arg-type]
    assert detectors.pipelines(store, ()) == []


def test_the_defaults_are_the_documented_ones() -> None:
    documented = (
        detectors.LossSpike(threshold=6.0, alpha=0.05, warmup=20),
        detectors.GradientSpike(threshold=10.0, alpha=0.05, warmup=20, layers=True),
        detectors.UpdateRatioBand(low=1e-5, high=1e-1),
    )
    assert documented == detectors.DEFAULT_DETECTORS


# -- real training with injected faults ---------------------------------------------------------------------


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))


def batches(
    steps: int, spike_at: int | None = None, seed: int = 1
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable task (labels from a fixed linear map); at ``spike_at`` the inputs are scaled up and the
    labels permuted, so the model is confidently wrong: the loss spikes on that step only."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 3, generator=g)
    for i in range(steps):
        x = torch.randn(64, 8, generator=g)
        y = (x @ w).argmax(-1)
        if i == spike_at:
            x, y = 10 * x, (y + 1) % 3
        yield x, y


def collected(watch: sw.Watch, detector: detectors.Detector) -> sw.sinks.Collect:
    """Every record's samples from ``detector``, beside the ones attached to the store."""
    out = sw.sinks.collect()
    watch.pipe(sw.source() | detector.chain() | out)
    return out


def latest(watch: sw.Watch, name: str, **labels: str) -> float | None:
    return value([s for s in watch.snapshot() if s.name == name], name, **labels)


def test_an_injected_loss_spike_is_caught_at_its_step(train: Train) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sw.observe(model, opt, every=1) as watch:
        steps = collected(watch, detectors.LossSpike())
        losses = train(model, opt, watch, data=batches(60, spike_at=45))
    ref = reference(losses, kind="z", threshold=6.0)
    same(series(steps.items, "streamwatch_loss_zscore"), ref.scores)
    assert [i for i, z in enumerate(ref.scores) if z is not None and z > 6] == [45]
    assert ref.scores[45] is not None
    assert ref.scores[45] > 20
    assert latest(watch, "streamwatch_loss_spikes") == 1.0
    assert latest(watch, "streamwatch_loss_zscore") == pytest.approx(ref.scores[-1], rel=1e-12)
    assert watch.statistics().pipeline_failures == 0


def layer_norms(model: nn.Sequential) -> dict[str, float]:
    """Each layer's gradient norm and the global one, from the parameters' ``.grad`` with torch."""
    norms = {
        str(i): float(
            torch.linalg.vector_norm(
                torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
            )
        )
        for i, m in enumerate(model)
        if isinstance(m, nn.Linear)
    }
    norms["__all__"] = math.sqrt(sum(v * v for v in norms.values()))
    return norms


def test_an_injected_gradient_explosion_is_caught_in_its_layer(train: Train) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    explode = {"at": 35, "step": 0}

    def scale(g: torch.Tensor) -> torch.Tensor:  # layer 2's weight gradient x 300 at one step
        return g * 300 if explode["step"] == explode["at"] else g

    middle = model[2]
    assert isinstance(middle, nn.Linear)
    middle.weight.register_hook(scale)
    seen: list[dict[str, float]] = []

    def count(step: Step) -> None:
        explode["step"] += 1

    with sw.observe(model, opt, every=1) as watch:
        steps = collected(watch, detectors.GradientSpike())
        train(
            model,
            opt,
            watch,
            data=batches(50),
            before_opt_step=lambda s: seen.append(layer_norms(model)),
            after_watch_step=count,
        )
    assert len(steps.items) == len(seen) == 50
    for layer in ("__all__", "0", "2", "4"):
        ref = reference([norms[layer] for norms in seen], kind="ratio", threshold=10.0)
        same(series(steps.items, "streamwatch_grad_norm_ratio", layer=layer), ref.scores, rel=1e-5)
        assert latest(watch, "streamwatch_grad_norm_spikes", layer=layer) == ref.spikes
        assert latest(watch, "streamwatch_grad_norm_ratio", layer=layer) == pytest.approx(
            ref.scores[-1], rel=1e-5
        )
    ratios = series(steps.items, "streamwatch_grad_norm_ratio", layer="2")
    assert ratios[35] is not None
    assert ratios[35] > 100
    assert latest(watch, "streamwatch_grad_norm_spikes", layer="2") == 1.0  # that step only
    assert latest(watch, "streamwatch_grad_norm_spikes", layer="__all__") == 1.0
    assert latest(watch, "streamwatch_grad_norm_spikes", layer="0") == 0.0  # the layers it did not touch


def test_a_learning_rate_out_of_band_is_caught_per_layer(train: Train) -> None:
    model = mlp()
    first, middle, last = model[0], model[2], model[4]
    opt = torch.optim.SGD(
        [
            {"params": first.parameters(), "lr": 50.0},  # far too high: updates larger than a tenth of w
            {"params": middle.parameters(), "lr": 0.05},
            {"params": last.parameters(), "lr": 1e-6},  # far too low
        ]
    )
    before: list[dict[str, list[torch.Tensor]]] = []
    expected: list[dict[str, float]] = []

    def copy(step: Step) -> None:
        before.append({str(i): [p.detach().clone() for p in model[i].parameters()] for i in (0, 2, 4)})

    def ratio(step: Step) -> None:
        out = {}
        for layer, old in before[-1].items():
            new = list(model[int(layer)].parameters())
            du = sum(float((n.detach() - o).double().pow(2).sum()) for n, o in zip(new, old, strict=True))
            w = sum(float(n.detach().double().pow(2).sum()) for n in new)
            out[layer] = math.sqrt(du / w)
        expected.append(out)

    with sw.observe(model, opt, cadence={"param": 1, "update": 1}, every=1) as watch:
        steps = collected(watch, detectors.UpdateRatioBand())
        train(model, opt, watch, data=batches(6), before_opt_step=copy, after_opt_step=ratio)
    for i, samples in enumerate(steps.items):
        for layer, r in expected[i].items():
            assert value(samples, "streamwatch_layer_update_ratio", layer=layer) == pytest.approx(r, rel=1e-5)
            band = 0.0 if 1e-5 <= r <= 0.1 else math.log10(r / (0.1 if r > 0.1 else 1e-5)) if r else -math.inf
            assert value(samples, "streamwatch_update_ratio_out_of_band", layer=layer) == pytest.approx(
                band, rel=1e-4, abs=1e-12
            )
    last_ratio = expected[-1]
    assert last_ratio["0"] > 0.1
    assert 1e-5 < last_ratio["2"] < 0.1
    assert last_ratio["4"] < 1e-5
    assert latest(watch, "streamwatch_update_ratio_out_of_band", layer="0") > 0  # type: ignore[operator]
    assert latest(watch, "streamwatch_update_ratio_out_of_band", layer="2") == 0.0
    assert latest(watch, "streamwatch_update_ratio_out_of_band", layer="4") < -1  # type: ignore[operator]


def test_detector_values_are_served_on_metrics_and_promtool_accepts_them(train: Train) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sw.observe(model, opt, cadence={"param": 1, "update": 1}, every=1) as watch:
        exporter = watch.expose(port=0, run="detectors")
        train(model, opt, watch, data=batches(30, spike_at=25))
        # the built-in detectors run before the store counts a record: flush() waits for their values
        assert watch.flush()
        snapshot = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in watch.snapshot()}
        body = urllib.request.urlopen(exporter.url, timeout=10).read().decode()
    check_metrics(body)
    for family, kind in (
        ("streamwatch_loss_zscore", "gauge"),
        ("streamwatch_loss_spikes_total", "counter"),
        ("streamwatch_grad_norm_ratio", "gauge"),
        ("streamwatch_grad_norm_spikes_total", "counter"),
        ("streamwatch_layer_update_ratio", "gauge"),
        ("streamwatch_update_ratio_out_of_band", "gauge"),
    ):
        assert f"# TYPE {family} {kind}\n" in body
    served = {}
    for line in body.splitlines():
        name = line.split("{")[0]
        if name.startswith(
            (
                "streamwatch_loss_",
                "streamwatch_grad_norm_",
                "streamwatch_layer_update",
                "streamwatch_update_ratio",
            )
        ):
            labels = dict(
                part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(",")
            )
            layer = labels.get("layer", '""').strip('"')
            served[(name.removesuffix("_total"), layer)] = float(line.rsplit(" ", 1)[1])
    assert served[("streamwatch_loss_spikes", "")] == 1.0
    assert {layer for name, layer in served if name == "streamwatch_grad_norm_ratio"} == {
        "__all__",
        "0",
        "2",
        "4",
    }
    for (name, layer), value in served.items():
        key = (name, (("layer", layer),) if layer else ())
        assert snapshot[key] == value


# -- a failing detector -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Breaking(detectors.LossSpike):
    """A LossSpike that raises on its tenth record."""

    def extract(self, record: StepRecord) -> Values | None:
        if record.step == 9:
            raise RuntimeError("detector bug")
        return super().extract(record)


def test_attach_adds_only_detectors_the_watch_does_not_run(train: Train) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sw.observe(model, opt, every=1) as watch:  # the defaults are built in
        assert watch.detectors == detectors.DEFAULT_DETECTORS
        with pytest.raises(
            ValueError, match=r"^Expected detectors the watch does not run yet, got LossSpike"
        ):
            detectors.attach(watch, [detectors.LossSpike(threshold=8.0)])
    with sw.observe(model, opt, detectors=[detectors.LossSpike()], every=1) as watch:
        detectors.attach(watch, [detectors.GradientSpike(layers=False)])
        with pytest.raises(ValueError, match=r"got GradientSpike"):
            detectors.attach(watch, [detectors.GradientSpike()])  # attached once already
        train(model, opt, watch, data=batches(3))
        assert watch.flush()
    names = {(s.name, s.labels.get("layer")) for s in watch.snapshot() if "spikes" in s.name}
    assert names == {("streamwatch_loss_spikes", None), ("streamwatch_grad_norm_spikes", "__all__")}
    with sw.observe(model, opt, detectors=(), every=1) as watch:
        assert watch.detectors == ()
        train(model, opt, watch, data=batches(3))
        assert watch.flush()
    assert not [s for s in watch.snapshot() if "spikes" in s.name or "zscore" in s.name]


def closed_anyway(watch: sw.Watch) -> None:
    """Close a watch that a failing test left open (its own errors are that test's, not reported twice)."""
    if not watch.closed:
        with contextlib.suppress(sw.PipelineError):
            watch.close()


def test_a_failing_detector_stops_only_itself_and_is_counted_and_reported(
    train: Train, request: pytest.FixtureRequest
) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = sw.observe(model, opt, every=1)
    request.addfinalizer(lambda: closed_anyway(watch))  # a failure here must not leak into the next test
    store = sw.SeriesStore(metrics=())  # their own store: whatever detectors the watch runs itself
    chosen = [Breaking(warmup=2), detectors.GradientSpike(warmup=2)]
    broken, going = (watch.pipe(p) for p in detectors.pipelines(store, chosen))
    losses = collected(watch, detectors.LossSpike(warmup=2))
    grads = collected(watch, detectors.GradientSpike(warmup=2))

    def steps() -> None:
        train(model, opt, watch, data=batches(12))
        assert watch.flush()
        train(model, opt, watch, data=batches(20, seed=2))  # the warning comes at a later watch.step()

    with pytest.warns(RuntimeWarning, match="detector bug"):
        steps()
    with pytest.raises(sw.PipelineError, match="detector bug") as raised:
        watch.close()
    assert "Breaking" in str(raised.value)
    assert watch.statistics().pipeline_failures == 1
    assert watch.statistics().steps == 32  # training went on
    assert broken.closed
    assert isinstance(broken.error, RuntimeError)
    assert going.error is None
    # the failing one stopped after its last good record (step 8); the other one saw all 32
    published = {(s.name, s.labels.get("layer", "")): s.value for s in store.samples()}
    assert published[("streamwatch_loss_zscore", "")] == series(losses.items, "streamwatch_loss_zscore")[8]
    assert len(grads.items) == 32
    last = value(grads.items[-1], "streamwatch_grad_norm_ratio", layer="__all__")
    assert published[("streamwatch_grad_norm_ratio", "__all__")] == last
