"""Summaries: device scalars of one tensor, and the host-side merge/derive, against plain references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamwatch import _kernel, testing
from streamwatch._schema import COLUMN
from streamwatch._summary import COLUMNS, DEVICE_STATS, Raw, derive, finalize, summarize, totals, unit_dim_for

finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)


def reference_row(x: np.ndarray, unit_axis: int | None) -> dict[str, float]:
    x = x.astype(np.float64)
    units = dead = samples = active = math.nan
    if unit_axis is not None:
        # (sample, unit) pairs active anywhere in their positions; a unit is dead if active in none
        pairs = np.any(np.moveaxis(x, unit_axis, 1).reshape(x.shape[0], x.shape[unit_axis], -1) != 0, axis=2)
        units, samples = float(pairs.shape[1]), float(pairs.shape[0])
        dead, active = float(np.sum(~pairs.any(axis=0))), float(pairs.sum())
    return {
        "count": float(x.size),
        "sum": float(x.sum()),
        "sumsq": float((x * x).sum()),
        "min": float(x.min()),
        "max": float(x.max()),
        "zeros": float(np.sum(x == 0)),
        "nonfinite": float(np.sum(~np.isfinite(x))),
        "units": units,
        "dead": dead,
        "samples": samples,
        "active": active,
        "sumabs": float(np.abs(x).sum()),
        "sumcube": float((x * x * x).sum()),
        "sumfourth": float(((x * x) * (x * x)).sum()),
    }


def tolerance(x: np.ndarray) -> dict[str, float]:
    """Absolute tolerances per column for float32 sums: relative to the sum of the terms' magnitudes (a
    signed sum may cancel to far less than its rounding error)."""
    magnitudes = reference_row(np.abs(x), None)
    return {column: 1e-5 * abs(np.nan_to_num(magnitudes[column])) + 1e-3 for column in COLUMNS}


def shape_reference(x: np.ndarray) -> dict[str, float]:
    """mean_abs, skewness and (excess) kurtosis of ``x`` in float64 from its central moments, two-pass:
    population moments, as scipy.stats.skew/kurtosis with bias=True."""
    x = x.astype(np.float64).ravel()
    centred = x - x.mean()
    m2 = float(np.mean(centred**2))
    kurtosis = float(np.mean(centred**4)) / m2**2
    return {
        "mean_abs": float(np.abs(x).mean()),
        "skewness": float(np.mean(centred**3)) / m2**1.5,
        "kurtosis": kurtosis,
        "excess_kurtosis": kurtosis - 3.0,
    }


def assert_shape_statistics(got: dict[str, float], x: np.ndarray, rtol: float = 1e-4) -> None:
    """mean |x|, skewness and (excess) kurtosis against :func:`shape_reference`: skewness (which may be 0)
    and excess kurtosis to ``rtol`` of 1 + |skewness| and of the kurtosis, the others relatively."""
    want = shape_reference(x)
    np.testing.assert_allclose(got["mean_abs"], want["mean_abs"], rtol=1e-5, err_msg="mean_abs")
    np.testing.assert_allclose(got["kurtosis"], want["kurtosis"], rtol=rtol, err_msg="kurtosis")
    atol = rtol * want["kurtosis"]
    np.testing.assert_allclose(got["excess_kurtosis"], want["excess_kurtosis"], atol=atol, err_msg="excess")
    skew_atol = rtol * (1 + abs(want["skewness"]))
    np.testing.assert_allclose(got["skewness"], want["skewness"], atol=skew_atol, err_msg="skewness")


def kernel_table(x: torch.Tensor) -> np.ndarray:
    """The table row of ``x`` (float32/float64) from the fused kernel's device values: the columns that
    copy them, and the count."""
    kernel = _kernel.load()
    assert kernel is not None
    out = np.zeros(_kernel.NSTATS)
    kernel.summarize(x.contiguous(), out)
    values = dict(zip(DEVICE_STATS, out.tolist(), strict=True))
    return testing.table(count=x.numel(), **{c: values[c] for c in COLUMNS if c in values})


def raw_of(tensors: list[torch.Tensor], keys: list[str], unit_dim: int | None, counted: bool) -> Raw:
    """What the step buffer hands the worker, built by hand (per-unit counts of a key add up)."""
    rows = [summarize(t, unit_dim=unit_dim, count_nonfinite=counted) for t in tensors]
    merged: dict[str, torch.Tensor] = {}
    for key, row in zip(keys, rows, strict=True):
        if row.unit_counts is not None:
            merged[key] = merged[key] + row.unit_counts if key in merged else row.unit_counts
    units = np.array([0.0 if r.unit_counts is None else r.unit_counts.numel() for r in rows])
    samples = np.array([float(r.samples) for r in rows])
    dead, active = np.full(len(rows), np.nan), np.full(len(rows), np.nan)
    seen: set[str] = set()
    for i, key in enumerate(keys):
        if key in merged and key not in seen:
            seen.add(key)
            dead[i] = float((merged[key] == 0).sum())
            active[i] = float(merged[key].sum())
    values = torch.stack([torch.stack([s.double() for s in r.scalars]) for r in rows]).numpy()
    counts = np.array([float(t.numel()) for t in tensors])
    return Raw(tuple(keys), counts, units, values, dead, counted, samples, active)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.lists(finite, min_size=6, max_size=6)),
        min_size=1,
        max_size=6,
    ),
    st.booleans(),
)
def test_finalize_merges_rows_of_a_key_like_concatenating_their_tensors(rows, zero_some) -> None:
    keys = [k for k, _ in rows]
    tensors = []
    for i, (_, values) in enumerate(rows):
        t = torch.tensor(values, dtype=torch.float32).reshape(2, 3)
        if zero_some and i % 2 == 0:
            t[:, 1] = 0.0
        tensors.append(t)
    out_keys, table = finalize(raw_of(tensors, keys, unit_dim=1, counted=True))
    assert list(out_keys) == list(dict.fromkeys(keys))
    for row_index, key in enumerate(out_keys):
        parts = [t.numpy() for k, t in zip(keys, tensors, strict=True) if k == key]
        ref = reference_row(np.concatenate(parts, axis=0), unit_axis=1)
        got = dict(zip(COLUMNS, table[row_index], strict=True))
        atol = tolerance(np.concatenate(parts, axis=0))
        for column in COLUMNS:
            np.testing.assert_allclose(got[column], ref[column], rtol=1e-5, atol=atol[column], err_msg=column)


@pytest.mark.parametrize(
    ("shape", "channel_last", "axis"),
    [
        ((4, 3), False, 1),
        ((4, 3, 5), False, 1),
        ((4, 3, 5), True, 2),
        ((2, 3, 4, 4), False, 1),
        ((7,), False, None),
    ],
    ids=["linear", "seq-first", "seq-channel-last", "nchw", "1d"],
)
def test_summarize_matches_a_numpy_reference(shape, channel_last, axis) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).relu()
    unit_dim = unit_dim_for(x, channel_last)
    assert unit_dim == axis
    _, table = finalize(raw_of([x], ["k"], unit_dim=unit_dim, counted=True))
    ref, atol = reference_row(x.numpy(), axis), tolerance(x.numpy())
    for column, value in zip(COLUMNS, table[0], strict=True):
        np.testing.assert_allclose(value, ref[column], rtol=1e-5, atol=atol[column], err_msg=column)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_nonfinite_is_a_free_flag_by_default_and_an_exact_count_on_request(bad) -> None:
    x = torch.tensor([[1.0, bad, 2.0], [bad, 0.0, 3.0]])
    _, flagged = finalize(raw_of([x], ["k"], unit_dim=None, counted=False))
    _, counted = finalize(raw_of([x], ["k"], unit_dim=None, counted=True))
    assert flagged[0, COLUMN["nonfinite"]] == 1.0
    assert counted[0, COLUMN["nonfinite"]] == 2.0
    _, clean = finalize(raw_of([torch.ones(2, 2)], ["k"], unit_dim=None, counted=False))
    assert clean[0, COLUMN["nonfinite"]] == 0.0


DISTRIBUTIONS = {
    "normal": lambda g, n: torch.randn(n, generator=g),
    "shifted-normal": lambda g, n: 3.0 + torch.randn(n, generator=g),  # |mean| = 3 std: still reported
    "uniform": lambda g, n: torch.rand(n, generator=g) - 0.2,
    "exponential": lambda g, n: -torch.rand(n, generator=g).log(),
    "relu": lambda g, n: torch.randn(n, generator=g).relu(),
    "heavy-tailed": lambda g, n: torch.randn(n, generator=g) ** 3,
}


@pytest.mark.parametrize("path", ["torch", "kernel"])
@pytest.mark.parametrize("shape", [(4096,), (64, 33, 5)], ids=["flat", "strided-size"])
@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_shape_statistics_match_the_central_moments(name: str, shape: tuple[int, ...], path: str) -> None:
    """Skewness, kurtosis and mean |x| from the mergeable sums equal the two-pass central moments."""
    g = torch.Generator().manual_seed(7)
    x = DISTRIBUTIONS[name](g, math.prod(shape)).reshape(shape)
    if path == "torch":
        _, table = finalize(raw_of([x], ["k"], unit_dim=None, counted=True))
    else:
        table = kernel_table(x)
    assert_shape_statistics({k: float(v[0]) for k, v in derive(table).items()}, x.numpy())


def test_shape_statistics_merge_across_calls_and_shards() -> None:
    """A tensor split into shards (ranks) or calls (a module called twice): the raw sums add, and the
    skewness and kurtosis of the total are the whole tensor's."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3000, generator=g).exp()  # skewed, heavy right tail
    shards = list(x.split([1000, 1500, 500]))
    _, rows = finalize(raw_of(shards, ["a", "b", "c"], unit_dim=None, counted=True))
    _, merged = finalize(raw_of(shards, ["k", "k", "k"], unit_dim=None, counted=True))
    for table in (totals(rows, [[0, 1, 2]]), merged):
        assert_shape_statistics({k: float(v[0]) for k, v in derive(table).items()}, x.numpy())


@pytest.mark.parametrize(
    "values",
    [
        [1.0 + 0.01 * math.sin(i) for i in range(1000)],  # |mean| = 140 std: cancellation, not a value
        [2.5] * 10,  # no spread
        [4.0],  # one element
    ],
    ids=["mean-far-beyond-the-spread", "constant", "one-element"],
)
def test_shape_statistics_are_unknown_where_the_sums_cannot_give_them(values: list[float]) -> None:
    x = torch.tensor(values)
    _, table = finalize(raw_of([x], ["k"], unit_dim=None, counted=False))
    got = {k: float(v[0]) for k, v in derive(table).items()}
    for stat in ("skewness", "kurtosis", "excess_kurtosis"):
        assert math.isnan(got[stat]), stat
    assert got["mean_abs"] == pytest.approx(float(x.double().abs().mean()), rel=1e-6)  # that one is fine


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_shape_statistics_of_a_nonfinite_tensor(bad: float) -> None:
    """A NaN makes every new sum NaN; an infinity makes Σ|x| and Σx⁴ infinite: mean |x| is then NaN or
    inf (like the mean), skewness and kurtosis unknown (NaN) — on both paths."""
    x = torch.tensor([1.0, -2.0, bad, 0.5])
    _, table = finalize(raw_of([x], ["k"], unit_dim=None, counted=True))
    for t in (table, kernel_table(x)):
        got = {k: float(v[0]) for k, v in derive(t).items()}
        assert math.isnan(got["mean_abs"]) if math.isnan(bad) else got["mean_abs"] == math.inf
        assert math.isnan(got["skewness"])
        assert math.isnan(got["kurtosis"])


def test_shape_statistics_of_an_empty_row_or_an_old_record_are_unknown() -> None:
    """A count of 0, or a record from a run file written before these columns existed (NaN there)."""
    empty = derive(testing.table(1, fill=0.0))
    old = derive(testing.table(count=4, sum=2.0, sumsq=6.0, min=-1.0, max=2.0))  # sumabs... absent: NaN
    for derived in (empty, old):
        for stat in ("mean_abs", "skewness", "kurtosis", "excess_kurtosis"):
            assert math.isnan(float(derived[stat][0])), stat


def test_bf16_sums_accumulate_in_float32_against_a_float64_reference() -> None:
    """A bf16 tensor (the torch path): Σ|x|, Σx³ and Σx⁴ of its values exactly as numpy gives them in
    float64, to float32 rounding — x⁴ of bf16 values of 300 would overflow float16, not float32."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3000, generator=g) * 300).to(torch.bfloat16)
    _, table = finalize(raw_of([x], ["k"], unit_dim=None, counted=False))
    values = x.double().numpy()
    ref, atol = reference_row(values, None), tolerance(values)
    for column in ("sum", "sumsq", "sumabs", "sumcube", "sumfourth"):
        np.testing.assert_allclose(table[0, COLUMN[column]], ref[column], rtol=1e-5, atol=atol[column])
    assert_shape_statistics({k: float(v[0]) for k, v in derive(table).items()}, values)


def test_a_key_whose_calls_overflow_both_ways_merges_to_nan_without_a_warning() -> None:
    """One call of a module sums to +inf, the next to -inf: the step's merged sum is NaN (unknown), and
    numpy's "invalid value" warning, an error under filterwarnings=error, no longer escapes the worker."""
    big = torch.finfo(torch.float32).max
    up, down = torch.full((4,), big), torch.full((4,), -big)
    keys, table = finalize(raw_of([up, down], ["k", "k"], unit_dim=None, counted=True))
    assert keys == ("k",)
    assert math.isnan(table[0, COLUMN["sum"]])
    assert table[0, COLUMN["sumsq"]] == math.inf


def test_half_precision_sums_of_squares_do_not_overflow() -> None:
    x = torch.full((64, 64), 300.0, dtype=torch.float16)  # sumsq = 3.7e8 > float16 max 65504
    _, table = finalize(raw_of([x], ["k"], unit_dim=None, counted=False))
    np.testing.assert_allclose(table[0, COLUMN["sumsq"]], 64 * 64 * 300.0**2, rtol=1e-4)


@settings(max_examples=60, deadline=None)
@given(st.lists(finite, min_size=1, max_size=40))
def test_derived_statistics_match_numpy(values) -> None:
    x = np.array(values, dtype=np.float32)
    _, table = finalize(raw_of([torch.from_numpy(x)], ["k"], unit_dim=None, counted=False))
    got = {k: float(v[0]) for k, v in derive(table).items()}
    x64 = x.astype(np.float64)
    scale = float(np.mean(x64 * x64)) + 1.0  # var = E[x²] - mean² from float32 sums: absolute error ∝ E[x²]
    np.testing.assert_allclose(got["mean"], x64.mean(), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got["var"], x64.var(), rtol=1e-4, atol=1e-5 * scale)
    # float32 sums of squares underflow below |x| ~ 1e-19: such norms read 0 (the absolute floor)
    np.testing.assert_allclose(got["l2"], np.linalg.norm(x64), rtol=1e-5, atol=1e-18)
    np.testing.assert_allclose(got["rms"], np.sqrt(np.mean(x64 * x64)), rtol=1e-5, atol=1e-18)
    np.testing.assert_allclose(got["absmax"], np.abs(x64).max(), rtol=1e-6)
    np.testing.assert_allclose(got["zero_fraction"], np.mean(x64 == 0))
    assert math.isnan(got["dead_fraction"])  # no units taken


def test_ratios_over_an_empty_row_are_nan_not_errors() -> None:
    derived = derive(testing.table(1, fill=0.0))
    for name in ("mean", "std", "var", "rms", "zero_fraction", "dead_fraction"):
        assert math.isnan(float(derived[name][0])), name
    assert float(derived["l2"][0]) == 0.0  # the norm of nothing is 0


@pytest.mark.parametrize("nan_call", [0, 1], ids=["nan-first", "nan-second"])
def test_a_nan_in_any_call_of_a_module_makes_its_dead_units_unknown(nan_call: int) -> None:
    # one ReLU called twice in a step: with a NaN in either call, zeros and dead units are unknown (NaN),
    # as for the two inputs in one call; the merge kept the first call's dead count when the NaN came later
    import streamwatch as sw

    clean = torch.tensor([[-1.0, 1.0, 1.0], [-1.0, 1.0, 1.0]])
    bad = clean.clone()
    bad[0, 0] = math.nan
    calls = [bad, clean] if nan_call == 0 else [clean, bad]
    act = torch.nn.ReLU()
    model = torch.nn.Sequential(act)
    records = sw.sinks.collect()
    quiet = {"on_nonfinite": lambda _: None}  # (the NaN is the point: no warning)
    with sw.observe(model, None, every=1, sinks=[records], taps=("activation",), **quiet) as w:
        for x in calls:
            model(x)
        w.step(loss=1.0)
    (record,) = records.items
    (row,) = [i for i, k in enumerate(record.keys) if k.kind == "activation"]
    ref = reference_row(torch.relu(torch.cat(calls)).numpy(), unit_axis=1)
    assert math.isnan(record.column("min")[row])  # (the reference's NaN)
    for column in ("count", "units", "samples"):
        assert record.column(column)[row] == ref[column]
    for column in ("zeros", "dead", "active"):
        assert math.isnan(record.column(column)[row]), column
