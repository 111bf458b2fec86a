"""Operators by example: reprs, argument errors, edge cases, counters. Properties: test_ops_properties.py."""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pytest

import streamwatch as sw
from streamwatch import ops
from streamwatch._pipeline import Chain, Node, Stream
from streamwatch.ops._combine import ZipNode
from streamwatch.testing import FakeClock


def run(op: sw.Operator, items: Iterable[Any]) -> list[Any]:
    out = sw.sinks.collect()
    (sw.source() | op | out).run(items)
    return out.items


def run_timed(
    op_for_clock: Callable[[FakeClock], sw.Operator], arrivals: Sequence[tuple[float, Any]]
) -> list[Any]:
    """Push each item at its absolute time (seconds), then close."""
    clock = FakeClock()
    out = sw.sinks.collect()
    pipeline = sw.source() | op_for_clock(clock) | out
    for at, item in arrivals:
        clock.advance(at - clock())
        pipeline.push(item)
    pipeline.close()
    return out.items


def is_even(x: int) -> bool:
    return x % 2 == 0


# -- public namespace --------------------------------------------------------------------------------


def test_ops_exports_exactly_the_operators_sorted() -> None:
    expected = ["ewm", "filter", "map", "max", "mean", "min", "scan", "std", "subsample", "sum"]
    expected += ["window", "window_time", "zip"]
    assert ops.__all__ == expected
    assert ops.__all__ == sorted(ops.__all__)
    assert all(callable(getattr(ops, name)) for name in ops.__all__)


# -- reprs -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        pytest.param(ops.map(abs), "<map abs>", id="map-builtin"),
        pytest.param(ops.map(lambda x: x), "<map <lambda>>", id="map-lambda"),
        pytest.param(ops.filter(is_even), "<filter is_even>", id="filter"),
        pytest.param(ops.scan(operator.add, 0), "<scan add init=0>", id="scan"),
        pytest.param(ops.scan(max, None), "<scan max init=None>", id="scan-none"),
        pytest.param(ops.subsample(10), "<subsample n=10>", id="subsample"),
        pytest.param(ops.window(64), "<window size=64>", id="window-tumbling"),
        pytest.param(ops.window(64, step=64), "<window size=64>", id="window-step-equal"),
        pytest.param(ops.window(64, step=16), "<window size=64 step=16>", id="window-sliding"),
        pytest.param(ops.window_time(5), "<window_time seconds=5.0>", id="window_time"),
        pytest.param(
            ops.window_time(5, step=0.5), "<window_time seconds=5.0 step=0.5>", id="window_time-step"
        ),
        pytest.param(ops.ewm(0.1), "<ewm alpha=0.1>", id="ewm"),
        pytest.param(ops.mean(), "<mean>", id="mean"),
        pytest.param(ops.min(), "<min>", id="min"),
        pytest.param(ops.max(), "<max>", id="max"),
        pytest.param(ops.sum(), "<sum>", id="sum"),
        pytest.param(ops.std(), "<std ddof=0>", id="std"),
        pytest.param(ops.std(ddof=1), "<std ddof=1>", id="std-ddof"),
        pytest.param(
            ops.map(abs) | ops.window(3) | ops.mean(), "<map abs> | <window size=3> | <mean>", id="chain"
        ),
    ],
)
def test_operator_repr(op: sw.Operator, expected: str) -> None:
    assert repr(op) == expected


def test_repr_of_nested_function_leaves_out_locals() -> None:
    def double(x: int) -> int:
        return 2 * x

    assert repr(ops.map(double)) == "<map double>"
    assert repr(ops.map(lambda x: x)) == "<map <lambda>>"


def test_zip_repr() -> None:
    a, b = sw.source(), sw.source()
    assert repr(ops.zip(a, b, key=len)) == "<zip 2 streams key=len max_pending=64>"
    assert repr(ops.zip(a, b, a, key=len, max_pending=3)) == "<zip 3 streams key=len max_pending=3>"
    out = sw.sinks.collect()
    assert repr(ops.zip(a, b, key=len) | ops.mean() | out) == (
        "<pipeline <zip 2 streams key=len max_pending=64> | <mean> | <collect>>"
    )


def test_operators_are_frozen_and_compare_by_value() -> None:
    op = ops.window(4, step=2)
    assert op == ops.window(4, step=2)
    assert hash(op) == hash(ops.window(4, step=2))
    assert op != ops.window(4)
    with pytest.raises(AttributeError):
        op.size = 3  # type: ignore[misc]


# -- argument errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        pytest.param(lambda: ops.map(3), TypeError, r"^Expected `fn` to be callable, got 3$", id="map"),
        pytest.param(
            lambda: ops.filter(None), TypeError, r"^Expected `pred` to be callable, got None$", id="filter"
        ),
        pytest.param(
            lambda: ops.scan("add", 0), TypeError, r"^Expected `fn` to be callable, got 'add'$", id="scan"
        ),
        pytest.param(
            lambda: ops.subsample(0), ValueError, r"^Expected `n` to be a positive integer, got 0$", id="n0"
        ),
        pytest.param(
            lambda: ops.subsample(2.0),
            TypeError,
            r"^Expected `n` to be a positive integer, got 2.0$",
            id="n-f",
        ),
        pytest.param(
            lambda: ops.subsample(True),
            TypeError,
            r"^Expected `n` to be a positive integer, got True$",
            id="n-b",
        ),
        pytest.param(
            lambda: ops.window(0),
            ValueError,
            r"^Expected `size` to be a positive integer, got 0$",
            id="size0",
        ),
        pytest.param(
            lambda: ops.window(-3),
            ValueError,
            r"^Expected `size` to be a positive integer, got -3$",
            id="neg",
        ),
        pytest.param(
            lambda: ops.window("3"),
            TypeError,
            r"^Expected `size` to be a positive integer, got '3'$",
            id="str",
        ),
        pytest.param(
            lambda: ops.window(True),
            TypeError,
            r"^Expected `size` to be a positive integer, got True$",
            id="b",
        ),
        pytest.param(
            lambda: ops.window(3, 0),
            ValueError,
            r"^Expected `step` to be a positive integer, got 0$",
            id="step0",
        ),
        pytest.param(
            lambda: ops.window(3, 1.5),
            TypeError,
            r"^Expected `step` to be a positive integer, got 1.5$",
            id="step-f",
        ),
        pytest.param(
            lambda: ops.window_time(0),
            ValueError,
            r"^Expected `seconds` to be a finite number > 0, got 0$",
            id="seconds0",
        ),
        pytest.param(
            lambda: ops.window_time(math.inf),
            ValueError,
            r"^Expected `seconds` to be a finite number > 0, got inf$",
            id="seconds-inf",
        ),
        pytest.param(
            lambda: ops.window_time(math.nan),
            ValueError,
            r"^Expected `seconds` to be a finite number > 0, got nan$",
            id="seconds-nan",
        ),
        pytest.param(
            lambda: ops.window_time(True),
            TypeError,
            r"^Expected `seconds` to be a finite number > 0, got True$",
            id="seconds-bool",
        ),
        pytest.param(
            lambda: ops.window_time(1, step=-1),
            ValueError,
            r"^Expected `step` to be a finite number > 0, got -1$",
            id="time-step",
        ),
        pytest.param(
            lambda: ops.window_time(1, clock=0.0),
            TypeError,
            r"^Expected `clock` to be callable, got 0.0$",
            id="clock",
        ),
        pytest.param(
            lambda: ops.ewm(0), ValueError, r"^Expected `alpha` to be a number in \(0, 1\], got 0$", id="a0"
        ),
        pytest.param(
            lambda: ops.ewm(1.5),
            ValueError,
            r"^Expected `alpha` to be a number in \(0, 1\], got 1.5$",
            id="a-big",
        ),
        pytest.param(
            lambda: ops.ewm("0.1"),
            TypeError,
            r"^Expected `alpha` to be a number in \(0, 1\], got '0.1'$",
            id="a-str",
        ),
        pytest.param(
            lambda: ops.std(-1),
            ValueError,
            r"^Expected `ddof` to be a non-negative integer, got -1$",
            id="ddof-neg",
        ),
        pytest.param(
            lambda: ops.std(0.5),
            TypeError,
            r"^Expected `ddof` to be a non-negative integer, got 0.5$",
            id="ddof-f",
        ),
        pytest.param(
            lambda: ops.zip(sw.source(), key=len),
            TypeError,
            r"^Expected at least 2 streams to zip, got 1$",
            id="zip1",
        ),
        pytest.param(
            lambda: ops.zip(sw.source(), ops.map(abs), key=len),
            TypeError,
            r"^Expected `streams\[1\]` to be a Stream \(e.g. streamwatch.source\(\)\), got <map abs>$",
            id="zip-not-stream",
        ),
        pytest.param(
            lambda: ops.zip(sw.source(), sw.source(), key="step"),
            TypeError,
            r"^Expected `key` to be callable, got 'step'$",
            id="zip-key",
        ),
        pytest.param(
            lambda: ops.zip(sw.source(), sw.source(), key=len, max_pending=0),
            ValueError,
            r"^Expected `max_pending` to be a positive integer, got 0$",
            id="zip-max-pending",
        ),
    ],
)
def test_invalid_arguments_are_rejected_at_construction(
    make: Callable[[], object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        make()


def test_numpy_integers_are_accepted_as_sizes() -> None:
    assert ops.window(np.int64(3), step=np.int32(1)) == ops.window(3, step=1)
    assert type(ops.window(np.int64(3)).size) is int


# -- transform ---------------------------------------------------------------------------------------


def test_map_filter_scan() -> None:
    assert run(ops.map(lambda x: x * 10), [1, 2]) == [10, 20]
    assert run(ops.filter(is_even), range(7)) == [0, 2, 4, 6]
    assert run(ops.filter(lambda x: x), [0, "", "a", None, 3]) == ["a", 3]
    assert run(ops.scan(operator.add, 10), [1, 2, 3]) == [11, 13, 16]
    assert run(ops.scan(operator.add, 10), []) == []


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        pytest.param(1, [0, 1, 2, 3, 4, 5, 6], id="identity"),
        pytest.param(3, [0, 3, 6], id="every-3rd"),
        pytest.param(10, [0], id="longer-than-input"),
    ],
)
def test_subsample_keeps_items_0_n_2n(n: int, expected: list[int]) -> None:
    assert run(ops.subsample(n), range(7)) == expected


# -- window ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "step", "n", "expected"),
    [
        pytest.param(3, None, 7, [[1, 2, 3], [4, 5, 6], [7]], id="tumbling-partial-tail"),
        pytest.param(3, None, 6, [[1, 2, 3], [4, 5, 6]], id="tumbling-exact"),
        pytest.param(3, None, 2, [[1, 2]], id="shorter-than-size"),
        pytest.param(3, None, 0, [], id="empty"),
        pytest.param(1, None, 3, [[1], [2], [3]], id="size-1"),
        pytest.param(3, 1, 5, [[1, 2, 3], [2, 3, 4], [3, 4, 5]], id="sliding-no-tail"),
        pytest.param(3, 2, 6, [[1, 2, 3], [3, 4, 5], [5, 6]], id="sliding-tail-with-new-item"),
        pytest.param(3, 2, 5, [[1, 2, 3], [3, 4, 5]], id="sliding-tail-all-emitted"),
        pytest.param(3, 1, 2, [[1, 2]], id="sliding-shorter-than-size"),
        pytest.param(2, 3, 7, [[1, 2], [4, 5], [7]], id="hopping-tail"),
        pytest.param(2, 3, 6, [[1, 2], [4, 5]], id="hopping-gap-item-never-emitted"),
        pytest.param(2, 3, 3, [[1, 2]], id="hopping-gap-at-end"),
    ],
)
def test_window(size: int, step: int | None, n: int, expected: list[list[int]]) -> None:
    assert run(ops.window(size, step), range(1, n + 1)) == expected


def test_window_emits_a_fresh_list_each_time() -> None:
    seen: list[list[int]] = []

    def keep_and_mutate(w: list[int]) -> None:
        seen.append(w)
        w.append(-1)

    (sw.source() | ops.window(2, step=1) | sw.sinks.callback(keep_and_mutate)).run([1, 2, 3])
    assert seen == [[1, 2, -1], [2, 3, -1]]


# -- window_time -------------------------------------------------------------------------------------


def test_window_time_tumbling() -> None:
    arrivals = [(0, 1), (1, 2), (4, 3), (6, 4), (11, 5)]
    assert run_timed(lambda c: ops.window_time(4, clock=c), arrivals) == [[1, 2], [3, 4], [5]]


def test_window_time_boundary_belongs_to_next_window() -> None:
    arrivals = [(0, "a"), (3.5, "b"), (4, "c"), (8, "d")]
    assert run_timed(lambda c: ops.window_time(4, clock=c), arrivals) == [["a", "b"], ["c"], ["d"]]


def test_window_time_starts_at_first_arrival() -> None:
    arrivals = [(100, "a"), (103, "b"), (104, "c")]
    assert run_timed(lambda c: ops.window_time(4, clock=c), arrivals) == [["a", "b"], ["c"]]


def test_window_time_skips_empty_windows() -> None:
    arrivals = [(0, "a"), (25, "b"), (26, "c")]
    assert run_timed(lambda c: ops.window_time(4, clock=c), arrivals) == [["a"], ["b", "c"]]


def test_window_time_sliding_emits_each_nonempty_window_and_no_repeat_at_close() -> None:
    # Windows [0,4) [2,6) [4,8) [6,10): the last holds only "c", which [4,8) already emitted.
    arrivals = [(0, "a"), (3, "b"), (5, "c"), (9, "d")]
    expected = [["a", "b"], ["b", "c"], ["c"], ["d"]]
    assert run_timed(lambda c: ops.window_time(4, step=2, clock=c), arrivals) == expected
    assert run_timed(lambda c: ops.window_time(4, step=2, clock=c), arrivals[:3]) == [["a", "b"], ["b", "c"]]


def test_window_time_hopping_drops_items_in_gaps() -> None:
    # Windows [0,2) [5,7) [10,12): "b" (t=3) and "d" (t=8) fall in gaps.
    arrivals = [(0, "a"), (3, "b"), (5, "c"), (8, "d"), (10.5, "e")]
    assert run_timed(lambda c: ops.window_time(2, step=5, clock=c), arrivals) == [["a"], ["c"], ["e"]]
    assert run_timed(lambda c: ops.window_time(2, step=5, clock=c), arrivals[:4]) == [["a"], ["c"]]


def test_window_time_long_pause_jumps_instead_of_looping() -> None:
    arrivals = [(0, "a"), (1e9, "b"), (1e9 + 0.0005, "c")]
    started = time.perf_counter()
    result = run_timed(lambda c: ops.window_time(0.001, clock=c), arrivals)
    assert time.perf_counter() - started < 1.0
    assert result == [["a"], ["b", "c"]]


def test_window_time_long_pause_with_sliding_windows() -> None:
    arrivals = [(0, "a"), (5, "b"), (1e7, "c")]
    result = run_timed(lambda c: ops.window_time(10, step=0.5, clock=c), arrivals)
    # "a" is only in window 0; "b" (t=5) is in the 11 windows starting at 0, 0.5, ..., 5.
    assert result == [["a", "b"]] + [["b"]] * 10 + [["c"]]


def test_window_time_uses_the_monotonic_clock_by_default() -> None:
    assert ops.window_time(60).clock is time.monotonic
    assert run(ops.window_time(60), [1, 2, 3]) == [[1, 2, 3]]


# -- ewm ---------------------------------------------------------------------------------------------


def test_ewm_follows_pandas_adjust_false() -> None:
    # pandas.Series([0, 4, 4, 0]).ewm(alpha=0.5, adjust=False).mean()
    assert run(ops.ewm(0.5), [0, 4, 4, 0]) == [0, 2.0, 3.0, 1.5]
    assert run(ops.ewm(1), [3, 1, 2]) == [3, 1.0, 2.0]


def test_ewm_on_arrays_is_elementwise_and_leaves_inputs_alone() -> None:
    xs = [np.array([0.0, 10.0]), np.array([4.0, 0.0])]
    result = run(ops.ewm(0.25), xs)
    np.testing.assert_allclose(result[1], [1.0, 7.5])
    np.testing.assert_array_equal(xs[1], [4.0, 0.0])


def test_ewm_propagates_nan() -> None:
    result = run(ops.ewm(0.5), [1.0, math.nan, 1.0])
    assert result[0] == 1.0
    assert math.isnan(result[1])
    assert math.isnan(result[2])


def test_ewm_of_alpha_1_emits_items_unchanged_after_inf_and_nan() -> None:
    # (0 * inf is NaN: the previous value must not enter at all)
    assert run(ops.ewm(1), [math.inf, 1.0, -math.inf, 2.0]) == [math.inf, 1.0, -math.inf, 2.0]
    result = run(ops.ewm(1), [math.nan, 1.0])
    assert math.isnan(result[0])
    assert result[1] == 1.0


def test_a_mean_of_numbers_too_large_for_a_float_is_inf_not_an_error() -> None:
    assert run(ops.window(2) | ops.mean(), [10**400, 10**400, -(10**400), 1]) == [math.inf, -math.inf]


# -- reductions --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reduce", "expected"),
    [
        pytest.param(ops.mean(), [2.0, 4.5], id="mean"),
        pytest.param(ops.sum(), [6, 9], id="sum"),
        pytest.param(ops.min(), [1, 4], id="min"),
        pytest.param(ops.max(), [3, 5], id="max"),
        pytest.param(ops.std(), [math.sqrt(2 / 3), 0.5], id="std"),
        pytest.param(ops.std(ddof=1), [1.0, math.sqrt(0.5)], id="std-ddof1"),
    ],
)
def test_reductions_on_numbers(reduce: sw.Operator, expected: list[float]) -> None:
    result = run(ops.window(3) | reduce, [3, 1, 2, 4, 5])
    assert result == pytest.approx(expected)


def test_sum_keeps_ints_exact() -> None:
    big = 2**70
    result = run(ops.window(2) | ops.sum(), [big, 1])
    assert result == [big + 1]
    assert type(result[0]) is int


@pytest.mark.parametrize("reduce", [ops.mean(), ops.sum(), ops.min(), ops.max(), ops.std()], ids=repr)
@pytest.mark.parametrize("position", [0, 1, 2], ids=["nan-first", "nan-middle", "nan-last"])
def test_nan_propagates_through_reductions(reduce: sw.Operator, position: int) -> None:
    window = [1.0, 2.0, 3.0]
    window[position] = math.nan
    [result] = run(reduce, [window])
    assert math.isnan(result)
    [array_result] = run(reduce, [[np.array([x, 0.0]) for x in window]])
    assert math.isnan(array_result[0])
    assert not math.isnan(array_result[1])


@pytest.mark.parametrize("reduce", [ops.mean(), ops.sum(), ops.min(), ops.max(), ops.std()], ids=repr)
def test_infinities_propagate_without_warnings(reduce: sw.Operator) -> None:
    window = [math.inf, -math.inf, 1.0]
    [result] = run(reduce, [window])
    [array_result] = run(reduce, [[np.array([x]) for x in window]])
    np.testing.assert_array_equal(array_result, [result])


@pytest.mark.parametrize(
    ("reduce", "expected"),
    [
        pytest.param(ops.mean(), [[2.0, 20.0], [4.0, 40.0]], id="mean"),
        pytest.param(ops.sum(), [[6.0, 60.0], [4.0, 40.0]], id="sum"),
        pytest.param(ops.min(), [[1.0, 10.0], [4.0, 40.0]], id="min"),
        pytest.param(ops.max(), [[3.0, 30.0], [4.0, 40.0]], id="max"),
        pytest.param(ops.std(), [[math.sqrt(2 / 3), 10 * math.sqrt(2 / 3)], [0.0, 0.0]], id="std"),
    ],
)
def test_reductions_on_arrays_reduce_the_window_axis(
    reduce: sw.Operator, expected: list[list[float]]
) -> None:
    items = [np.array([x, 10 * x]) for x in (1.0, 2.0, 3.0, 4.0)]
    result = run(ops.window(3) | reduce, items)
    assert len(result) == 2
    for got, want in zip(result, expected, strict=True):
        assert isinstance(got, np.ndarray)
        np.testing.assert_allclose(got, want)


def test_std_of_too_few_items_is_nan_without_warning() -> None:
    [scalar] = run(ops.std(ddof=1), [[5.0]])
    assert math.isnan(scalar)
    [array] = run(ops.std(ddof=1), [[np.array([1.0, 2.0])]])
    assert array.shape == (2,)
    assert np.isnan(array).all()


def test_empty_windows_are_counted_not_emitted() -> None:
    out = sw.sinks.collect()
    pipeline = sw.source() | ops.mean() | out
    pipeline.run([[], [1, 3], []])
    assert out.items == [2.0]
    assert pipeline.counters() == {"mean.empty": 2}


def test_windows_of_arrays_with_different_shapes_are_rejected() -> None:
    message = r"^Expected every item of a window to be an array of one shape, got shapes \[\(2,\), \(3,\)\]$"
    with pytest.raises(ValueError, match=message):
        run(ops.mean(), [[np.zeros(2), np.zeros(3)]])


def test_reductions_accept_numpy_scalars_and_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    assert run(ops.mean(), [[np.float32(1.0), np.float32(2.0)]]) == [1.5]
    [result] = run(ops.max(), [[torch.tensor([1.0, 5.0]), torch.tensor([3.0, 2.0])]])
    np.testing.assert_array_equal(result, [3.0, 5.0])


# -- zip ---------------------------------------------------------------------------------------------


def zip_run(*streams: Stream, items: Iterable[Any], **kwargs: Any) -> tuple[list[Any], dict[str, int]]:
    out = sw.sinks.collect()
    pipeline = ops.zip(*streams, **kwargs) | out
    pipeline.run(items)
    return out.items, pipeline.counters()


def test_zip_aligns_branches_with_different_cadences_by_key() -> None:
    steps = sw.source()
    every_3 = steps | ops.subsample(3) | ops.map(lambda s: ("loss", s))
    every_2 = steps | ops.subsample(2) | ops.map(lambda s: ("grad", s))
    items, counters = zip_run(every_3, every_2, items=range(20), key=operator.itemgetter(1))
    assert items == [(("loss", s), ("grad", s)) for s in (0, 6, 12, 18)]
    # every_3 emitted 7 items and every_2 10; 4 of each matched.
    assert counters == {"zip.unmatched": (7 - 4) + (10 - 4), "zip.replaced": 0}


def test_zip_emits_as_soon_as_every_side_has_the_key() -> None:
    seen: list[Any] = []
    source = sw.source()
    left = source | ops.filter(lambda it: it[0] == "L")
    right = source | ops.filter(lambda it: it[0] == "R")
    pipeline = ops.zip(left, right, key=operator.itemgetter(1)) | sw.sinks.callback(seen.append)
    pipeline.push(("R", 1))
    pipeline.push(("R", 2))
    assert seen == []
    pipeline.push(("L", 2))
    assert seen == [(("L", 2), ("R", 2))]
    pipeline.close()
    # ("R", 1) was dropped when key 2 matched: it can never match now.
    assert pipeline.counters() == {"zip.unmatched": 1, "zip.replaced": 0}


def test_zip_three_streams_in_argument_order() -> None:
    source = sw.source()
    a = source | ops.map(lambda s: f"a{s}")
    b = source | ops.subsample(2) | ops.map(lambda s: f"b{s}")
    c = source | ops.subsample(3) | ops.map(lambda s: f"c{s}")
    items, counters = zip_run(a, b, c, items=range(7), key=lambda x: int(x[1:]))
    assert items == [("a0", "b0", "c0"), ("a6", "b6", "c6")]
    assert counters == {"zip.unmatched": (7 - 2) + (4 - 2) + (3 - 2), "zip.replaced": 0}


def test_zip_newer_item_with_same_key_replaces_older() -> None:
    source = sw.source()
    left = source | ops.filter(lambda it: it[0] == "L")
    right = source | ops.filter(lambda it: it[0] == "R")
    items, counters = zip_run(
        left, right, items=[("L", 1, "old"), ("L", 1, "new"), ("R", 1, "r")], key=operator.itemgetter(1)
    )
    assert items == [(("L", 1, "new"), ("R", 1, "r"))]
    assert counters == {"zip.unmatched": 0, "zip.replaced": 1}


def test_zip_evicts_oldest_beyond_max_pending() -> None:
    source = sw.source()
    left = source | ops.filter(lambda it: it[0] == "L")
    right = source | ops.filter(lambda it: it[0] == "R")
    pushes = [("L", k) for k in range(5)] + [("R", 0), ("R", 3), ("R", 4)]
    items, counters = zip_run(left, right, items=pushes, key=operator.itemgetter(1), max_pending=2)
    # Left keeps only keys 3 and 4: 0, 1 and 2 were evicted when 2, 3 and 4 arrived.
    assert items == [(("L", 3), ("R", 3)), (("L", 4), ("R", 4))]
    assert counters == {"zip.unmatched": 3 + 1, "zip.replaced": 0}


def test_zip_unorderable_keys_wait_until_close() -> None:
    source = sw.source()
    left = source | ops.filter(lambda it: it[0] == "L")
    right = source | ops.filter(lambda it: it[0] == "R")
    pushes = [("L", "x"), ("L", 2), ("L", None), ("R", 2), ("R", "x")]
    items, counters = zip_run(left, right, items=pushes, key=operator.itemgetter(1))
    # "x" < 2 raises TypeError, so nothing is dropped early and "x" still matches later.
    assert items == [(("L", 2), ("R", 2)), (("L", "x"), ("R", "x"))]
    assert counters == {"zip.unmatched": 1, "zip.replaced": 0}


def test_zip_of_one_stream_with_itself() -> None:
    source = sw.source()
    items, counters = zip_run(source, source, items=[1, 2], key=lambda x: x)
    assert items == [(1, 1), (2, 2)]
    assert counters == {"zip.unmatched": 0, "zip.replaced": 0}


def test_zip_stream_can_be_piped_further() -> None:
    source = sw.source()
    zipped = ops.zip(source | ops.map(float), source | ops.map(lambda x: x + 0.25), key=round)
    out = sw.sinks.collect()
    (zipped | ops.map(sum) | ops.window(2) | ops.mean() | out).run([1, 2, 3])
    assert out.items == [(2.25 + 4.25) / 2, 6.25]


def test_zip_node_has_no_single_input() -> None:
    node = ZipNode(print, 2, len, 1)
    with pytest.raises(TypeError, match=r"^a ZipNode has one input per side: use push_side\(side, item\)$"):
        node.push(1)


def test_zip_flushes_after_its_inputs_close() -> None:
    source = sw.source()
    windows = source | ops.window(3) | ops.map(lambda w: (len(w), w))
    counts = source | ops.window(3) | ops.map(lambda w: (len(w), len(w)))
    items, _ = zip_run(windows, counts, items=[1, 2, 3, 4], key=operator.itemgetter(0))
    # The partial window [4] is flushed at close by both branches, then matched by zip.
    assert items == [((3, [1, 2, 3]), (3, 3)), ((1, [4]), (1, 1))]


# -- composition -------------------------------------------------------------------------------------


def test_chain_is_reusable_without_sharing_state() -> None:
    chain = ops.map(lambda x: x * 10) | ops.window(2) | ops.sum()
    assert isinstance(chain, Chain)
    assert chain == ops.map(chain.ops[0].fn) | ops.window(2) | ops.sum()  # type: ignore[attr-defined]
    out_a, out_b = sw.sinks.collect(), sw.sinks.collect()
    a = sw.source() | chain | out_a
    b = sw.source() | chain | out_b
    a.push(1)
    b.push(5)
    a.push(2)
    a.close()
    b.close()
    assert out_a.items == [30]
    assert out_b.items == [50]


def test_a_custom_operator_opening_a_chain_flushes_and_counts_like_the_chain() -> None:
    class Smooth(sw.Operator):
        def open(self, emit: Callable[[Any], None]) -> Node:
            return (ops.filter(bool) | ops.window(2) | ops.std()).open(emit)

    out, plain = sw.sinks.collect(), sw.sinks.collect()
    custom = sw.source() | Smooth() | out
    direct = sw.source() | ops.filter(bool) | ops.window(2) | ops.std() | plain
    custom.run([0, 1, 3, 5])
    direct.run([0, 1, 3, 5])
    assert out.items == plain.items == [1.0, 0.0]  # the partial window [5] flushed at close (std of one: 0)
    assert custom.counters() == direct.counters() == {"std.empty": 0}


def test_counters_are_keyed_by_node_type() -> None:
    source = sw.source()
    zipped = ops.zip(source | ops.subsample(2), source | ops.subsample(3), key=lambda s: s)
    pipeline = zipped | ops.map(lambda pair: []) | ops.std() | sw.sinks.collect()
    pipeline.run(range(7))
    assert pipeline.counters() == {"std.empty": 2, "zip.unmatched": 3, "zip.replaced": 0}
