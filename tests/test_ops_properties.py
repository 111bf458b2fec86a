"""Every operator equals a plain-Python reference implementation on random inputs.

The references below are deliberately naive (slicing, brute-force window membership, closed-form
weights): they restate the documented semantics, not the implementation.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import streamwatch as sw
from streamwatch import ops
from streamwatch._pipeline import Stream
from streamwatch.testing import FakeClock

settings.register_profile("ops", deadline=None, max_examples=150)
settings.load_profile("ops")

ints = st.lists(st.integers(-1000, 1000), max_size=40)
floats = st.floats(-1e6, 1e6, allow_nan=False)
sizes = st.integers(1, 6)
steps = st.one_of(st.none(), st.integers(1, 8))


def run(op: sw.Operator, items: Iterable[Any]) -> list[Any]:
    out = sw.sinks.collect()
    (sw.source() | op | out).run(items)
    return out.items


# -- references --------------------------------------------------------------------------------------


def ref_window(xs: Sequence[Any], size: int, step: int | None) -> list[list[Any]]:
    """Windows xs[k*step : k*step+size]; then the tail from the next start if it holds an item that is
    in no emitted window (items in the gaps of hopping windows never count)."""
    step = size if step is None else step
    out, start, emitted_end = [], 0, 0
    while start + size <= len(xs):
        out.append(list(xs[start : start + size]))
        emitted_end, start = start + size, start + step
    if start < len(xs) and len(xs) > emitted_end:
        out.append(list(xs[start:]))
    return out


def ref_window_time(
    times: Sequence[float], xs: Sequence[Any], seconds: float, step: float
) -> list[list[Any]]:
    """Brute force: window k is [t0 + k*step, end(k)); every non-empty window that ended by the last
    arrival is emitted, in order; then the window holding the last arrival, if it has an item no
    earlier window covers. (Window indices near each time are tried, with exact membership tests.)"""
    if not xs:
        return []
    t0 = times[0]
    span = round(seconds / step)  # window ends lie on the step grid when seconds is a multiple of step

    def start(k: int) -> float:
        return t0 + k * step

    def end(k: int) -> float:
        return start(k + span) if span >= 1 and span * step == seconds else start(k) + seconds

    def members(k: int) -> list[tuple[float, Any]]:
        return [(t, x) for t, x in zip(times, xs, strict=True) if start(k) <= t < end(k)]

    def first_ending_after(t: float) -> int:
        k = max(0, math.floor((t - t0 - seconds) / step) - 2)
        assert k == 0 or end(k) <= t
        while end(k) <= t:
            k += 1
        return k

    def near(t: float) -> range:
        return range(first_ending_after(t), math.floor((t - t0) / step) + 3)

    last = first_ending_after(times[-1])
    nonempty = sorted({k for t in times for k in near(t) if start(k) <= t < end(k)})
    out = [[x for _, x in members(k)] for k in nonempty if k < last]
    tail = members(last)
    if tail and (last == 0 or tail[-1][0] >= end(last - 1)):
        out.append([x for _, x in tail])
    return out


def ref_ewm(xs: Sequence[Any], alpha: float) -> list[Any]:
    """Closed form: y_t = (1-a)^t x_0 + sum_{i=1..t} a (1-a)^(t-i) x_i."""
    n = len(xs)
    weights = np.zeros((n, n))
    for t in range(n):
        weights[t, 0] = (1 - alpha) ** t
        for i in range(1, t + 1):
            weights[t, i] = alpha * (1 - alpha) ** (t - i)
    return list(np.tensordot(weights, np.asarray(xs, dtype=float), axes=1)) if n else []


def ref_mean(w: Sequence[float]) -> float:
    return sum(w) / len(w)


def ref_std(w: Sequence[float], ddof: int) -> float:
    if len(w) <= ddof:
        return math.nan
    m = ref_mean(w)
    return math.sqrt(sum((x - m) ** 2 for x in w) / (len(w) - ddof))


REDUCTIONS: list[tuple[str, Callable[[], sw.Operator], Callable[[Sequence[float]], float]]] = [
    ("mean", ops.mean, ref_mean),
    ("sum", ops.sum, sum),
    ("min", ops.min, min),
    ("max", ops.max, max),
    ("std", ops.std, lambda w: ref_std(w, 0)),
    ("std-ddof1", lambda: ops.std(ddof=1), lambda w: ref_std(w, 1)),
    ("std-ddof3", lambda: ops.std(ddof=3), lambda w: ref_std(w, 3)),
]
reductions = pytest.mark.parametrize(
    ("make", "ref"), [r[1:] for r in REDUCTIONS], ids=[r[0] for r in REDUCTIONS]
)


def assert_close(got: Sequence[Any], want: Sequence[Any]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-6, equal_nan=True)


# -- transform ---------------------------------------------------------------------------------------


@given(ints)
def test_map_and_filter_match_builtins(xs: list[int]) -> None:
    assert run(ops.map(abs), xs) == [abs(x) for x in xs]
    assert run(ops.filter(lambda x: x % 3), xs) == [x for x in xs if x % 3]


@given(ints, st.integers(-5, 5))
def test_scan_matches_accumulate_without_initial(xs: list[int], init: int) -> None:
    assert (
        run(ops.scan(operator.add, init), xs)
        == list(itertools.accumulate(xs, operator.add, initial=init))[1:]
    )
    assert run(ops.scan(max, init), xs) == list(itertools.accumulate(xs, max, initial=init))[1:]


@given(ints, st.integers(1, 10))
def test_subsample_matches_slicing(xs: list[int], n: int) -> None:
    assert run(ops.subsample(n), xs) == xs[::n]


# -- window ------------------------------------------------------------------------------------------


@given(ints, sizes, steps)
def test_window_matches_reference(xs: list[int], size: int, step: int | None) -> None:
    assert run(ops.window(size, step), xs) == ref_window(xs, size, step)


@given(ints, sizes, steps)
def test_window_tumbling_or_hopping_never_repeats_items(xs: list[int], size: int, step: int | None) -> None:
    flat = [x for w in run(ops.window(size, step), list(enumerate(xs))) for x in w]
    if step is None or step >= size:
        assert flat == sorted(set(flat))
    if step is None or step == size:
        assert flat == list(enumerate(xs))


arrival_gaps = st.lists(
    st.one_of(st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 3.0, 10.0]), st.floats(0, 5)),
    max_size=30,
)
durations = st.one_of(st.sampled_from([0.5, 1.0, 2.0, 2.5, 3.0]), st.floats(0.1, 5))


@given(arrival_gaps, durations, st.one_of(st.none(), durations))
def test_window_time_matches_reference(gaps: list[float], seconds: float, step: float | None) -> None:
    clock = FakeClock(1000.0)
    out = sw.sinks.collect()
    pipeline = sw.source() | ops.window_time(seconds, step, clock=clock) | out
    times = []
    for i, gap in enumerate(gaps):
        clock.advance(gap)
        times.append(clock())
        pipeline.push(i)
    pipeline.close()
    assert out.items == ref_window_time(times, range(len(gaps)), seconds, seconds if step is None else step)


@st.composite
def boundary_arrivals(draw: st.DrawFn) -> tuple[float, float, list[float]]:
    """Arrival times on window boundaries t0 + j*step (and ends), give or take one ulp, far from 0."""
    seconds = draw(st.floats(0.001, 5))
    step = draw(st.one_of(st.just(seconds), st.floats(0.001, 5), st.just(seconds / 2), st.just(seconds / 3)))
    t0 = draw(st.sampled_from([0.0, 1e3, 1e6, 123456.789]))
    times = [t0]
    for j in draw(st.lists(st.integers(0, 10**6), max_size=12)):
        grid = [t0 + j * step, t0 + j * step + seconds, t0 + (j + round(seconds / step)) * step]
        t = draw(st.sampled_from(grid))
        times.append(draw(st.sampled_from([t, math.nextafter(t, math.inf), math.nextafter(t, -math.inf)])))
    return seconds, step, [t0, *sorted(t for t in times[1:] if t >= t0)]


@given(boundary_arrivals())
def test_window_time_matches_reference_on_window_boundaries(case: tuple[float, float, list[float]]) -> None:
    seconds, step, times = case
    clock = FakeClock()
    out = sw.sinks.collect()
    pipeline = sw.source() | ops.window_time(seconds, step, clock=clock) | out
    for i, t in enumerate(times):
        clock.now = t
        pipeline.push(i)
    pipeline.close()
    assert out.items == ref_window_time(times, range(len(times)), seconds, step)
    if step == seconds:  # tumbling windows partition time, rounding included
        assert [x for w in out.items for x in w] == list(range(len(times)))


@given(arrival_gaps, durations)
def test_window_time_tumbling_emits_every_item_once_in_order(gaps: list[float], seconds: float) -> None:
    clock = FakeClock()
    out = sw.sinks.collect()
    pipeline = sw.source() | ops.window_time(seconds, clock=clock) | out
    for i, gap in enumerate(gaps):
        clock.advance(gap)
        pipeline.push(i)
    pipeline.close()
    assert [x for w in out.items for x in w] == list(range(len(gaps)))
    assert all(out.items)


# -- ewm ---------------------------------------------------------------------------------------------

alphas = st.floats(0.01, 1.0)


@given(st.lists(floats, max_size=30), alphas)
def test_ewm_matches_closed_form_on_floats(xs: list[float], alpha: float) -> None:
    assert_close(run(ops.ewm(alpha), xs), ref_ewm(xs, alpha))


@given(st.integers(0, 20), st.integers(1, 4), alphas, st.integers(0, 2**32 - 1))
def test_ewm_matches_closed_form_on_arrays(n: int, width: int, alpha: float, seed: int) -> None:
    xs = list(np.random.default_rng(seed).normal(size=(n, width)) * 100)
    got = run(ops.ewm(alpha), xs)
    assert all(g.shape == (width,) for g in got)
    assert_close(got, ref_ewm(xs, alpha))


# -- reductions --------------------------------------------------------------------------------------


@reductions
@given(windows=st.lists(st.lists(floats, min_size=1, max_size=10), max_size=5))
def test_reduction_on_number_windows_matches_reference(
    make: Callable[[], sw.Operator], ref: Callable[[Sequence[float]], float], windows: list[list[float]]
) -> None:
    assert_close(run(make(), windows), [ref(w) for w in windows])


@reductions
@given(windows=st.lists(st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=10), max_size=5))
def test_reduction_on_int_windows_matches_reference(
    make: Callable[[], sw.Operator], ref: Callable[[Sequence[float]], float], windows: list[list[int]]
) -> None:
    got = run(make(), windows)
    if make() in (ops.sum(), ops.min(), ops.max()):
        assert got == [ref(w) for w in windows]  # exact, and still ints
    else:
        assert_close(got, [ref(w) for w in windows])


@reductions
@given(
    n=st.integers(1, 8),
    shape=st.sampled_from([(), (1,), (3,), (2, 3)]),
    seed=st.integers(0, 2**32 - 1),
)
def test_reduction_on_array_windows_is_elementwise(
    make: Callable[[], sw.Operator],
    ref: Callable[[Sequence[float]], float],
    n: int,
    shape: tuple[int, ...],
    seed: int,
) -> None:
    window = list(np.random.default_rng(seed).normal(size=(n, *shape)) * 10)
    [got] = run(make(), [window])
    want = np.empty(shape)
    for index in np.ndindex(*shape):
        want[index] = ref([float(x[index]) for x in window])
    assert np.shape(got) == shape
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, equal_nan=True)


@reductions
@given(window=st.lists(floats, min_size=1, max_size=8), at=st.integers(0, 7))
def test_a_nan_anywhere_makes_the_reduction_nan(
    make: Callable[[], sw.Operator], ref: Callable[[Sequence[float]], float], window: list[float], at: int
) -> None:
    window.insert(at % (len(window) + 1), math.nan)
    [got] = run(make(), [window])
    assert math.isnan(got)
    [got_array] = run(make(), [[np.array([x, 1.0]) for x in window]])
    assert math.isnan(got_array[0])


# -- compositions ------------------------------------------------------------------------------------


@given(ints, sizes, steps)
def test_map_window_mean_matches_reference(xs: list[int], size: int, step: int | None) -> None:
    got = run(ops.map(lambda x: x * 0.5) | ops.window(size, step) | ops.mean(), xs)
    assert_close(got, [ref_mean(w) for w in ref_window([x * 0.5 for x in xs], size, step)])


@given(ints, st.integers(1, 5), sizes, steps)
def test_subsample_window_max_matches_reference(xs: list[int], n: int, size: int, step: int | None) -> None:
    got = run(ops.subsample(n) | ops.window(size, step) | ops.max(), xs)
    assert got == [max(w) for w in ref_window(xs[::n], size, step)]


@given(st.integers(0, 60), st.integers(1, 5), st.integers(1, 5), st.integers(1, 64))
def test_zip_of_two_subsampled_branches_emits_exactly_the_common_steps(
    n: int, every_a: int, every_b: int, max_pending: int
) -> None:
    steps = sw.source()
    a = steps | ops.subsample(every_a) | ops.map(lambda s: ("a", s))
    b = steps | ops.filter(lambda s: s % every_b == 0) | ops.map(lambda s: ("b", s))
    out = sw.sinks.collect()
    pipeline = ops.zip(a, b, key=operator.itemgetter(1), max_pending=max_pending) | out
    pipeline.run(range(n))
    a_steps, b_steps = set(range(0, n, every_a)), set(range(0, n, every_b))
    common = sorted(a_steps & b_steps)
    assert out.items == [(("a", s), ("b", s)) for s in common]
    unmatched = len(a_steps) + len(b_steps) - 2 * len(common)
    assert pipeline.counters() == {"zip.unmatched": unmatched, "zip.replaced": 0}


@st.composite
def interleaved_sides(draw: st.DrawFn) -> tuple[int, list[tuple[int, int]]]:
    """Each side's keys increase; the sides' pushes interleave arbitrarily."""
    n_sides = draw(st.integers(2, 3))
    keys = [sorted(draw(st.sets(st.integers(0, 25), max_size=12))) for _ in range(n_sides)]
    labels = [side for side, side_keys in enumerate(keys) for _ in side_keys]
    order = draw(st.permutations(labels))
    cursors = [iter(side_keys) for side_keys in keys]
    return n_sides, [(side, next(cursors[side])) for side in order]


def side_streams(n_sides: int) -> list[Stream]:
    """One stream per side of a zip, fed from one source of ``(side, key)`` pairs."""
    source = sw.source()
    return [source | ops.filter(partial(on_side, side)) for side in range(n_sides)]


def on_side(side: int, item: tuple[int, Any]) -> bool:
    return item[0] == side


@given(interleaved_sides())
def test_zip_with_increasing_keys_matches_every_common_key(case: tuple[int, list[tuple[int, int]]]) -> None:
    n_sides, pushes = case
    out = sw.sinks.collect()
    pipeline = ops.zip(*side_streams(n_sides), key=operator.itemgetter(1), max_pending=64) | out
    pipeline.run(pushes)
    per_side = [{k for side, k in pushes if side == s} for s in range(n_sides)]
    common = sorted(set.intersection(*per_side))
    assert out.items == [tuple((side, k) for side in range(n_sides)) for k in common]
    unmatched = len(pushes) - n_sides * len(common)
    assert pipeline.counters() == {"zip.unmatched": unmatched, "zip.replaced": 0}


@given(
    st.lists(st.tuples(st.integers(0, 1), st.one_of(st.integers(0, 5), st.sampled_from(["x", "y", None])))),
    st.integers(1, 4),
)
def test_zip_accounts_for_every_item(pushes: list[tuple[int, Any]], max_pending: int) -> None:
    """Whatever the keys (repeated, decreasing, unorderable): each pushed item is emitted, replaced or
    counted unmatched, exactly once, and each tuple holds items with one key."""
    out = sw.sinks.collect()
    pipeline = ops.zip(*side_streams(2), key=operator.itemgetter(1), max_pending=max_pending) | out
    pipeline.run(pushes)
    counters = pipeline.counters()
    assert len(pushes) == 2 * len(out.items) + counters["zip.unmatched"] + counters["zip.replaced"]
    for left, right in out.items:
        assert (left[0], right[0]) == (0, 1)
        assert left[1] == right[1]
