"""Log-spaced, sign-aware histograms against an independent reference written with plain comparisons."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from syncs import no_host_sync

from streamwatch.metrics._histogram import Buckets, histogram

SMALL = Buckets(lo=0, hi=1, per_decade=1)  # edges 1, 10: eight buckets


def reference(values: np.ndarray, buckets: Buckets) -> np.ndarray:
    """The documented convention, one value at a time: non-finite first, then value order, every finite
    bucket ``(lower, upper]``, exact zero apart. ``values`` are compared exactly, as float64."""
    edges = list(buckets.magnitudes)
    k = len(edges) - 1
    counts = np.zeros(2 * k + 6)
    for value in np.asarray(values, dtype=np.float64).reshape(-1):
        if not math.isfinite(value):
            index = 0
        elif value == 0:
            index = k + 3
        elif value > 0:  # (0, e_0] is K+4, (e_(j-1), e_j] is K+4+j, (e_K, inf) is 2K+5
            index = k + 4 + sum(1 for e in edges if e < value)
        else:  # (-e_j, -e_(j-1)] holds magnitudes in [e_(j-1), e_j): K+2-j; (-e_0, 0) is K+2
            index = k + 2 - sum(1 for e in edges if e <= -value)
        counts[index] += 1
    return counts


def spread(n: int, buckets: Buckets, seed: int) -> np.ndarray:
    """Both signs over every decade and beyond, exact zeros, NaN and ±inf, and the edges themselves."""
    rng = np.random.default_rng(seed)
    magnitudes = 10.0 ** rng.uniform(buckets.lo - 3, buckets.hi + 3, n)
    values = magnitudes * rng.choice([-1.0, 1.0], n)
    values[rng.random(n) < 0.05] = 0.0
    edges = np.asarray(buckets.magnitudes)
    special = [np.nan, np.inf, -np.inf, -0.0, 5e-324, -5e-324]
    return np.concatenate([values, edges, -edges, special])


@pytest.mark.parametrize(
    "buckets", [Buckets(), SMALL, Buckets(lo=-3, hi=2, per_decade=3), Buckets(lo=-5, hi=5, per_decade=10)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_the_reference_over_many_decades(buckets: Buckets, dtype: torch.dtype) -> None:
    values = torch.from_numpy(spread(2000, buckets, seed=len(buckets))).to(dtype)
    counts = histogram(values, buckets)
    assert counts.dtype == torch.float64
    assert counts.shape == (len(buckets),)
    np.testing.assert_array_equal(counts.numpy(), reference(values.double().numpy(), buckets))
    assert counts.sum() == values.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_values_on_and_next_to_every_edge(dtype: torch.dtype) -> None:
    """Upper-inclusive: ``e`` closes the bucket ending at it, ``-e`` the one starting at it; the next
    representable value either side lands in the neighbour. float32 edges are not the float64 edges:
    the reference compares the exact values."""
    buckets = Buckets(lo=-3, hi=2, per_decade=3)
    finfo = np.finfo(np.float32 if dtype == torch.float32 else np.float64)
    edges = np.asarray(buckets.magnitudes).astype(finfo.dtype)
    near = np.concatenate([edges, np.nextafter(edges, finfo.dtype.type(0)), np.nextafter(edges, finfo.max)])
    values = torch.from_numpy(np.concatenate([near, -near]))
    np.testing.assert_array_equal(
        histogram(values, buckets).numpy(), reference(values.double().numpy(), buckets)
    )


def test_the_closedness_convention_on_a_small_example() -> None:
    values = torch.tensor([-20.0, -10.0, -5.0, -1.0, -0.5, 0.0, 0.5, 1.0, 5.0, 10.0, 20.0, math.nan])
    expected = [
        1,  # nan
        2,  # (-inf, -10]: -20, -10
        2,  # (-10, -1]: -5, -1
        1,  # (-1, 0): -0.5
        1,  # 0
        2,  # (0, 1]: 0.5, 1
        2,  # (1, 10]: 5, 10
        1,  # (10, inf): 20
    ]
    assert histogram(values, SMALL).tolist() == expected
    assert SMALL.labels() == [
        "nonfinite",
        "(-inf, -10]",
        "(-10, -1]",
        "(-1, 0)",
        "0",
        "(0, 1]",
        "(1, 10]",
        "(10, +inf)",
    ]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_counted_exactly(dtype: torch.dtype) -> None:
    buckets = Buckets(lo=-4, hi=3, per_decade=2)
    values = torch.from_numpy(spread(500, buckets, seed=3)).to(dtype)  # overflow to ±inf, underflow to 0
    counts = histogram(values, buckets)
    np.testing.assert_array_equal(counts.numpy(), reference(values.double().numpy(), buckets))


def test_extreme_decades_beyond_float32_range() -> None:
    """Edges below float32's smallest subnormal or above its largest finite value still classify exactly."""
    for buckets in (Buckets(lo=-47, hi=-36, per_decade=2), Buckets(lo=30, hi=40, per_decade=1)):
        values = torch.from_numpy(spread(300, buckets, seed=4)).float()
        np.testing.assert_array_equal(
            histogram(values, buckets).numpy(), reference(values.double().numpy(), buckets)
        )


def test_empty_and_scalar_tensors() -> None:
    empty = histogram(torch.empty(0, 3), Buckets())
    assert empty.shape == (len(Buckets()),)
    assert empty.sum() == 0
    scalar = histogram(torch.tensor(0.0), SMALL)
    assert scalar.tolist() == [0, 0, 0, 0, 1, 0, 0, 0]


def test_integer_and_non_contiguous_inputs() -> None:
    grid = torch.arange(-12.0, 12.0).reshape(4, 6)
    np.testing.assert_array_equal(histogram(grid.T, SMALL).numpy(), reference(grid.numpy(), SMALL))
    np.testing.assert_array_equal(histogram(grid.long(), SMALL).numpy(), reference(grid.numpy(), SMALL))


def test_counts_add_across_tensors() -> None:
    buckets = Buckets(lo=-6, hi=3, per_decade=2)
    a = torch.from_numpy(spread(700, buckets, seed=5)).float()
    b = torch.from_numpy(spread(300, buckets, seed=6)).float()
    assert torch.equal(histogram(torch.cat([a, b]), buckets), histogram(a, buckets) + histogram(b, buckets))


def test_zero_sits_in_the_middle_and_off_edge_values_mirror() -> None:
    buckets = Buckets(lo=-2, hi=2, per_decade=2)
    rng = np.random.default_rng(7)
    values = torch.from_numpy(10.0 ** rng.uniform(-4, 4, 400))  # no value is exactly an edge
    positive, negative = histogram(values, buckets), histogram(-values, buckets)
    middle = len(buckets) // 2
    assert histogram(torch.zeros(3), buckets)[middle] == 3
    assert torch.equal(positive[middle + 1 :], negative[1:middle].flip(0))
    assert positive[: middle + 1].sum() == 0


def test_upper_bounds_give_exact_cumulative_le_counts() -> None:
    buckets = Buckets(lo=-3, hi=2, per_decade=2)
    values = spread(1000, buckets, seed=8)
    bounds = buckets.upper_bounds()
    assert len(bounds) == len(buckets) - 1
    assert all(a < b for a, b in itertools.pairwise(bounds))
    assert bounds[-1] == math.inf
    assert bounds[len(buckets) // 2 - 1] == 0.0  # the zero bucket's bound (index shifted by one)
    cumulative = np.cumsum(histogram(torch.from_numpy(values), buckets).numpy()[1:])
    finite = values[np.isfinite(values)]
    assert cumulative.tolist() == [np.count_nonzero(finite <= b) for b in bounds]


@pytest.mark.parametrize("buckets", [Buckets(), SMALL, Buckets(lo=-1, hi=3, per_decade=100)])
def test_labels_and_magnitudes(buckets: Buckets) -> None:
    labels = buckets.labels()
    k = (buckets.hi - buckets.lo) * buckets.per_decade
    assert len(labels) == len(buckets) == 2 * k + 6
    assert len(set(labels)) == len(labels)
    assert labels[0] == "nonfinite"
    assert labels[len(buckets) // 2] == "0"
    edges = buckets.magnitudes
    assert len(edges) == k + 1
    assert all(a < b for a, b in itertools.pairwise(edges))
    for i, edge in enumerate(edges):
        assert edge == pytest.approx(10.0 ** (buckets.lo + i / buckets.per_decade), rel=1e-15)
        if i % buckets.per_decade == 0:  # whole decades are exact
            assert edge == float(f"1e{buckets.lo + i // buckets.per_decade}")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lo": 1, "hi": 1}, "lo < hi"),
        ({"lo": 2, "hi": -2}, "lo < hi"),
        ({"per_decade": 0}, "per_decade must be >= 1"),
        ({"lo": -8.0}, "lo must be an int"),
        ({"hi": True}, "hi must be an int"),
        ({"per_decade": "4"}, "per_decade must be an int"),
        ({"hi": 400}, "within"),
    ],
)
def test_buckets_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Buckets(**kwargs)  # type: ignore[arg-type]


def test_buckets_are_hashable_values() -> None:
    assert Buckets() == Buckets(lo=-8, hi=4, per_decade=4)
    assert len({Buckets(), Buckets(), SMALL}) == 2


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), max_size=40),
    lo=st.integers(-6, 3),
    span=st.integers(1, 4),
    per_decade=st.integers(1, 4),
)
def test_any_float32_values_match_the_reference(
    values: list[float], lo: int, span: int, per_decade: int
) -> None:
    buckets = Buckets(lo=lo, hi=lo + span, per_decade=per_decade)
    x = torch.tensor(values, dtype=torch.float32)
    np.testing.assert_array_equal(histogram(x, buckets).numpy(), reference(np.asarray(values), buckets))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_without_a_host_sync() -> None:
    buckets = Buckets(lo=-4, hi=3, per_decade=3)
    values = torch.from_numpy(spread(5000, buckets, seed=9))
    on_device = {dtype: values.to(dtype).cuda() for dtype in (torch.float64, torch.float32, torch.float16)}
    with no_host_sync():
        counts = {dtype: histogram(x, buckets) for dtype, x in on_device.items()}
    for dtype, got in counts.items():
        assert got.device.type == "cuda"
        expected = reference(values.to(dtype).double().numpy(), buckets)
        np.testing.assert_array_equal(got.cpu().numpy(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "buckets", [Buckets(), Buckets(lo=-3, hi=1, per_decade=1), Buckets(lo=-20, hi=20, per_decade=10)]
)
def test_the_fused_cpu_kernel_counts_exactly_what_the_torch_path_counts(
    dtype: torch.dtype, buckets: Buckets
) -> None:
    """On the CPU the fused kernel guesses each bucket from the exponent bits, then settles it against the
    exact bounds: the counts must equal torch.bucketize's, on edges, next to edges and across decades."""
    from streamwatch import _kernel
    from streamwatch.metrics._histogram import _histogram_torch

    assert _kernel.load() is not None  # the suite builds the kernel (CONTRIBUTING.md)
    g = torch.Generator().manual_seed(len(buckets))
    wide = torch.randn(20_000, generator=g, dtype=dtype) * torch.exp(
        torch.randn(20_000, generator=g, dtype=dtype) * 8
    )
    wide[::7] = 0
    edges = torch.tensor(buckets.magnitudes, dtype=torch.float64).to(dtype)
    near = torch.cat(
        [edges, torch.nextafter(edges, torch.zeros_like(edges)), torch.nextafter(edges, 2 * edges)]
    )
    special = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), -0.0, 1e-300, -1e-300], dtype=torch.float64
    )
    x = torch.cat([wide, near, -near, special.to(dtype)])
    fused = histogram(x, buckets)
    torch_counts = _histogram_torch(x.reshape(-1), buckets)
    assert torch.equal(fused, torch_counts)
    assert fused.sum() == x.numel()
