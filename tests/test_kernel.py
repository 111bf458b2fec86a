"""The fused CPU kernel against float64 numpy references and against the eager torch summary.

Layouts cover every branch of ``_fused_body.h``: no units (one flat run), units innermost (Linear,
channel-last: B == 1, A >= 1), units with positions after them (NCHW: B > 1), lengths that are not a
multiple of the vector lanes or of the float64 flush chunk, saturation bounds, NaN and ±inf.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from streamwatch import _kernel
from streamwatch._summary import saturation_bounds, summarize

KERNEL = _kernel.load()
if KERNEL is None:  # pragma: no cover - the suite requires a C compiler (README, Development)
    pytest.fail(f"the fused kernel did not build: {_kernel.status()}", pytrace=False)


def fused(
    x: torch.Tensor, unit_dim: int | None = None, bounds: tuple[float, float] | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    assert KERNEL is not None
    out = np.full(_kernel.NSTATS, -7.0)
    units = None if unit_dim is None else np.zeros(x.shape[unit_dim])
    KERNEL.summarize(x, out, unit_dim=unit_dim, units=units, bounds=bounds)
    return out, units


def reference(
    x: torch.Tensor, unit_dim: int | None = None, bounds: tuple[float, float] | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """sum, sumsq, min, max, nonzero, nonfinite in float64; active samples per unit (monitorch)."""
    a = x.detach().double().numpy()
    with np.errstate(invalid="ignore", over="ignore"):
        stats = np.array(
            [
                a.sum(),
                (a * a).sum(),
                a.min(),  # NaN propagates, as in torch.aminmax
                a.max(),
                np.count_nonzero(a),
                np.count_nonzero(~np.isfinite(a)),
            ]
        )
    if unit_dim is None:
        return stats, None
    xs = x.detach()
    if bounds is None:
        act = (xs != 0) & ~xs.isnan()
    else:  # monitorch: active unless isclose to a finite saturation bound, in the tensor's dtype
        act = ~xs.isnan()
        for bound in bounds:
            if np.isfinite(bound):
                act &= ~torch.isclose(xs, torch.tensor(bound, dtype=xs.dtype))
    per_sample = act.movedim(unit_dim, 1).reshape(x.shape[0], x.shape[unit_dim], -1).any(dim=2)
    return stats, per_sample.sum(0).double().numpy()


def assert_matches(
    x: torch.Tensor, unit_dim: int | None = None, bounds: tuple[float, float] | None = None
) -> None:
    got, got_units = fused(x, unit_dim, bounds)
    want, want_units = reference(x, unit_dim, bounds)
    rtol = 1e-12 if x.dtype == torch.float64 else 1e-5
    scale = float(np.nan_to_num(np.abs(x.double().numpy()), posinf=0.0).sum()) + 1.0
    np.testing.assert_allclose(got[0], want[0], rtol=rtol, atol=rtol * scale, equal_nan=True, err_msg="sum")
    np.testing.assert_allclose(got[1], want[1], rtol=rtol, equal_nan=True, err_msg="sumsq")
    np.testing.assert_array_equal(got[2:], want[2:], err_msg="min, max, nonzero, nonfinite")
    if unit_dim is not None:
        np.testing.assert_array_equal(got_units, want_units, err_msg="active samples per unit")


LAYOUTS = {
    # name: (shape, unit_dim) — channel_last puts units last (A > 1 when there are positions)
    "flat_odd_length": ((1021,), None),
    "flat_over_one_chunk": ((3 * 1024 + 5,), None),
    "linear": ((33, 17), 1),
    "linear_one_unit": ((9, 1), 1),
    "linear_one_sample": ((1, 40), 1),
    "nchw": ((5, 7, 6, 6), 1),
    "nchw_big_positions": ((2, 3, 40, 41), 1),
    "ncl_1d": ((4, 6, 19), 1),
    "ncdhw": ((2, 3, 4, 5, 6), 1),
    "channel_last_nhwc": ((3, 5, 4, 8), 3),
    "channel_last_sequence": ((4, 11, 16), 2),
    "nchw_runs_over_blocks": ((3, 4, 9, 11), 1),  # B = 99: three early-exit blocks and a remainder
    "channel_last_many_rows": ((3, 13, 24), 2),  # A = 13: past the every-4-rows all-active check
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.97, 1.0])
def test_every_layout_matches_the_float64_reference(layout: str, dtype: torch.dtype, sparsity: float) -> None:
    shape, unit_dim = LAYOUTS[layout]
    g = torch.Generator().manual_seed(hash((layout, sparsity)) % 2**31)
    x = torch.randn(shape, generator=g, dtype=dtype) * 3
    x[torch.rand(shape, generator=g) < sparsity] = 0  # whole dead units at sparsity 1.0
    assert_matches(x, unit_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("length", [1, 17, 1024, 3 * 1024 + 5])
def test_the_difference_of_two_tensors_without_materialising_it(dtype: torch.dtype, length: int) -> None:
    """An update Δ = after − before: the same six values as summarising the subtraction."""
    assert KERNEL is not None
    g = torch.Generator().manual_seed(length)
    after = torch.randn(length, generator=g, dtype=dtype)
    before = after + 0.01 * torch.randn(length, generator=g, dtype=dtype)
    before[::3] = after[::3]  # unchanged elements: zeros of Δ
    out = np.full(_kernel.NSTATS, -7.0)
    KERNEL.run_diff(after, before, out.ctypes.data)
    want, _ = reference(after - before)
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    np.testing.assert_allclose(out[:2], want[:2], rtol=rtol, atol=rtol * float((after - before).abs().sum()))
    np.testing.assert_array_equal(out[2:], want[2:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_difference_counts_nan_and_infinities(dtype: torch.dtype) -> None:
    assert KERNEL is not None
    after = torch.arange(40, dtype=dtype)
    before = torch.zeros(40, dtype=dtype)
    after[3], before[3] = float("inf"), float("inf")  # inf - inf = NaN
    after[7] = float("-inf")
    before[11] = float("nan")
    out = np.zeros(_kernel.NSTATS)
    KERNEL.run_diff(after, before, out.ctypes.data)
    want, _ = reference(after - before)
    np.testing.assert_array_equal(out, want)  # sums are NaN, min/max NaN, 3 non-finite
    assert out[5] == 3
    assert np.isnan(out[2:4]).all()
    finite = torch.arange(8, dtype=dtype)
    finite[2] = float("inf")
    KERNEL.run_diff(finite, torch.zeros(8, dtype=dtype), out.ctypes.data)
    assert out[3] == float("inf")  # +inf without NaN: max is inf
    assert out[5] == 1


def test_the_difference_refuses_mismatched_tensors() -> None:
    assert KERNEL is not None
    out = np.zeros(_kernel.NSTATS)
    with pytest.raises(ValueError, match=r"one dtype and size.*float32\[3\] and torch.float64\[3\]"):
        KERNEL.run_diff(torch.zeros(3), torch.zeros(3, dtype=torch.float64), out.ctypes.data)
    with pytest.raises(ValueError, match="one dtype and size"):
        KERNEL.run_diff(torch.zeros(3), torch.zeros(4), out.ctypes.data)


def test_dead_units_and_units_active_in_only_one_position() -> None:
    x = torch.zeros(4, 3, 5, 5)
    x[0, 1, 4, 4] = 2.0  # unit 1 active in sample 0 at one position only
    x[2, 1, 0, 0] = -1.0
    x[3, 2] = 0.5
    assert_matches(x, 1)
    _, units = fused(x, 1)
    assert units is not None
    assert units.tolist() == [0.0, 2.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_activity_found_only_at_the_end_of_a_run_or_in_the_last_row(dtype: torch.dtype) -> None:
    """The activity scan stops early for units already known active; units whose only active element
    is the last one of a long run (NCHW), or in the last row after the all-active checks (channel
    last), must still count — and NaN is never active."""
    x = torch.zeros(3, 4, 7, 10, dtype=dtype)  # B = 70: two blocks of 32 and 6 more
    x[0, 0, 6, 9] = 1.0  # the last position of unit 0's run in sample 0
    x[1, 1, 3, 1] = -2.0  # inside the second block
    x[:, 2] = 5.0  # unit 2: active everywhere (found in the first block)
    x[2, 3] = float("nan")  # unit 3: NaN only, never active
    x[2, 3, 6, 9] = 0.0
    assert_matches(x, 1)
    assert fused(x, 1)[1].tolist() == [1.0, 1.0, 3.0, 0.0]  # type: ignore[union-attr]
    y = torch.ones(2, 9, 6, dtype=dtype)  # channel last: A = 9 rows of 6 units
    y[:, :, 4] = 0.0
    y[1, 8, 4] = 3.0  # unit 4 active only in the last row of sample 1
    y[:, :, 5] = 0.0
    y[0, 0, 5] = 1.0  # unit 5 active only in the first row of sample 0
    assert_matches(y, 2)
    assert fused(y, 2)[1].tolist() == [2.0, 2.0, 2.0, 2.0, 1.0, 1.0]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "bounds", [(0.0, 1.0), (-1.0, 1.0), (-float("inf"), 0.0), (-1.7580993408473766, float("inf"))]
)
@pytest.mark.parametrize("layout", ["linear", "nchw", "channel_last_nhwc"])
def test_saturation_bounds_follow_monitorch(bounds: tuple[float, float], layout: str) -> None:
    shape, unit_dim = LAYOUTS[layout]
    g = torch.Generator().manual_seed(3)
    x = torch.rand(shape, generator=g) * (
        bounds[1] - bounds[0] if np.isfinite(bounds[1] - bounds[0]) else 4.0
    )
    x += bounds[0] if np.isfinite(bounds[0]) else -2.0
    # pin some units (or whole samples of them) exactly at, and just inside the isclose tolerance of, a bound
    finite = [b for b in bounds if np.isfinite(b)]
    x.select(unit_dim, 0).fill_(finite[0])
    x.select(unit_dim, 1).fill_(finite[-1] * (1 + 1e-6))
    x[0].select(unit_dim - 1, 2).fill_(finite[-1])
    assert_matches(x, unit_dim, bounds)


def test_bounds_of_real_modules_match_the_torch_path() -> None:
    """The kernel and the eager summary agree on dead units for every saturating module."""
    g = torch.Generator().manual_seed(5)
    for module in (
        torch.nn.Sigmoid(),
        torch.nn.Tanh(),
        torch.nn.ReLU6(),
        torch.nn.Hardtanh(-2, 3),
        torch.nn.ELU(0.5),
    ):
        bounds = saturation_bounds(module)
        y = module(torch.randn(16, 12, generator=g) * 30)  # large inputs saturate
        _, units = fused(y, 1, bounds)
        row = summarize(y, unit_dim=1, bounds=bounds)
        assert row.unit_counts is not None
        np.testing.assert_array_equal(units, row.unit_counts.double().numpy(), err_msg=type(module).__name__)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nan_and_infinities(dtype: torch.dtype) -> None:
    x = torch.randn(6, 40, dtype=dtype)
    x[1, 3] = float("inf")
    x[2, 39] = -float("inf")
    assert_matches(x, 1)  # infinities: counted, min/max infinite, no NaN
    out, _ = fused(x)
    assert (out[2], out[3], out[5]) == (-np.inf, np.inf, 2)
    x[4, 0] = float("nan")
    assert_matches(x, 1)  # NaN propagates to sum, min and max; a NaN element is never active
    out, _ = fused(x)
    assert np.isnan(out[[0, 2, 3]]).all()
    assert out[5] == 3
    every = torch.full((3, 2), float("nan"), dtype=dtype)
    assert_matches(every, 1)


def test_agrees_with_the_eager_torch_summary() -> None:
    g = torch.Generator().manual_seed(11)
    for shape, unit_dim in LAYOUTS.values():
        x = torch.randn(shape, generator=g).relu()
        out, units = fused(x, unit_dim)
        row = summarize(x, unit_dim=unit_dim, count_nonfinite=True)
        eager = np.array([float(s) for s in row.scalars])
        np.testing.assert_allclose(out, eager, rtol=1e-5, atol=1e-4)
        if unit_dim is not None:
            assert row.unit_counts is not None
            np.testing.assert_array_equal(units, row.unit_counts.double().numpy())


def test_repeated_calls_add_active_samples_in_place() -> None:
    """A module called twice in a step: its per-unit counts accumulate in the same vector."""
    assert KERNEL is not None
    a, b = torch.randn(5, 8).relu(), torch.randn(7, 8).relu()
    units = np.zeros(8)
    out = np.zeros(_kernel.NSTATS)
    KERNEL.summarize(a, out, unit_dim=1, units=units)
    KERNEL.summarize(b, out, unit_dim=1, units=units)
    want = reference(a, 1)[1] + reference(b, 1)[1]  # type: ignore[operator]
    np.testing.assert_array_equal(units, want)


def test_a_failing_kernel_call_leaves_the_step_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row whose summary raises is not half-added: no garbage row, no arena range without units,
    and the rows around it resolve to the reference."""
    assert KERNEL is not None
    from streamwatch._record import SeriesKey, StepBuffer

    buffer = StepBuffer()
    a, bad, c = torch.randn(6, 4).relu(), torch.randn(3, 5), torch.randn(2, 3).relu()
    ka, kbad, kc = (SeriesKey("train", name, "activation", "") for name in ("a", "bad", "c"))
    buffer.add_host(KERNEL, ka, a, unit_dim=1)
    real_run = type(KERNEL).run

    def failing(self: Any, x: torch.Tensor, *args: Any) -> None:
        if x is bad:
            raise RuntimeError("boom")
        real_run(self, x, *args)

    monkeypatch.setattr(type(KERNEL), "run", failing)
    for replace in (False, True):
        with pytest.raises(RuntimeError, match="boom"):
            buffer.add_host(KERNEL, kbad, bad, unit_dim=1, replace=replace)
        with pytest.raises(RuntimeError, match="boom"):  # a known key, replaced: the old row stays
            buffer.add_host(KERNEL, ka, bad, unit_dim=1, replace=True)
    buffer.add_host(KERNEL, kc, c, unit_dim=1)
    pending = buffer.seal(step=0, rank=0, step_scalars={}, host_scalars={}, nonfinite_counted=True)
    assert pending is not None
    record = pending.resolve()
    assert record.keys == (ka, kc)
    for row, x in enumerate((a, c)):
        stats, units = reference(x, 1)
        assert units is not None
        np.testing.assert_allclose(record.column("sum")[row], stats[0], rtol=1e-6)
        assert record.column("count")[row] == x.numel()
        assert record.column("units")[row] == x.shape[1]
        assert record.column("dead")[row] == np.count_nonzero(units == 0)


def test_accepts_only_plain_contiguous_cpu_float32_and_float64() -> None:
    assert KERNEL is not None
    x = torch.randn(4, 6)
    assert all(KERNEL.accepts(t) for t in (x, x.double(), torch.nn.Parameter(x)))
    assert not KERNEL.accepts(x.t())  # strided view: the torch path reads it as it is
    assert not any(KERNEL.accepts(t) for t in (x.half(), x.bfloat16()))

    class Sub(torch.Tensor):
        pass

    assert not KERNEL.accepts(x.as_subclass(Sub))  # subclasses' memory is not what their ops see


def test_float32_sums_stay_accurate_over_millions_of_elements() -> None:
    """Float32 lanes are flushed to float64 every chunk: no drift on a large, biased tensor."""
    x = torch.full((4_000_000,), 0.1) + torch.randn(4_000_000) * 1e-3
    out, _ = fused(x)
    want = x.double().sum().item()
    assert abs(out[0] - want) / want < 1e-6
    assert abs(out[1] - x.double().square().sum().item()) / out[1] < 1e-6


def test_the_library_is_cached_and_rebuilt_when_missing(tmp_path: Path) -> None:
    """A fresh cache dir builds the library; a second process reuses it without building."""
    script = textwrap.dedent(
        """
        import time
        from streamwatch import _kernel
        start = time.perf_counter()
        kernel = _kernel.load()
        print(_kernel.status(), round(time.perf_counter() - start, 3))
        """
    )
    env = {**os.environ, "STREAMWATCH_CACHE_DIR": str(tmp_path)}
    env.pop("STREAMWATCH_KERNEL", None)
    first = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert first.stdout.startswith(f"fused: {tmp_path}"), first.stdout + first.stderr
    built = sorted(p.name for p in tmp_path.iterdir())
    assert [name[-3:] for name in built] == [".so"]  # one library, no temporary files left behind
    mtime = (tmp_path / built[0]).stat().st_mtime_ns
    second = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert second.stdout.split()[:2] == first.stdout.split()[:2]
    assert (tmp_path / built[0]).stat().st_mtime_ns == mtime  # reused, not rebuilt
    ctypes.CDLL(str(tmp_path / built[0])).streamwatch_abi_version()


def test_without_a_compiler_training_falls_back_to_torch_and_says_why(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import logging, torch, streamwatch as sw
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
        with sw.observe(model) as watch:
            model(torch.randn(2, 3)).sum().backward()
            watch.step()
        print("KERNEL", watch.statistics().kernel)
        print("ROWS", len(watch.snapshot()) > 0)
        """
    )
    env = {**os.environ, "STREAMWATCH_CACHE_DIR": str(tmp_path), "CC": "", "PATH": str(tmp_path)}
    env.pop("STREAMWATCH_KERNEL", None)
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "KERNEL torch: the fused CPU kernel is unavailable (no C compiler found" in result.stdout
    assert "ROWS True" in result.stdout
    assert "summaries use eager torch" in result.stderr  # logged once, as a warning


def test_statistics_name_the_kernel_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    import streamwatch as sw

    model = torch.nn.Linear(2, 2)
    with sw.observe(model) as watch:
        assert watch.statistics().kernel.startswith("fused: ")
    monkeypatch.setenv("STREAMWATCH_KERNEL", "torch")
    with sw.observe(model) as watch:
        assert watch.statistics().kernel == "torch: STREAMWATCH_KERNEL=torch"
