"""The fused CPU kernel against float64 numpy references and against the eager torch summary.

Layouts cover every branch of ``_fused_body.h``: no units (one flat run), units innermost (Linear,
channel-last: B == 1, A >= 1), units with positions after them (NCHW: B > 1), lengths that are not a
multiple of the vector lanes or of the float64 flush chunk, saturation bounds, NaN and ±inf.
"""

from __future__ import annotations

import copy
import math
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import streamwatch as sw
from streamwatch import _kernel, _schema
from streamwatch._schema import DEVICE_INDEX, DEVICE_NAMES
from streamwatch._summary import saturation_bounds, summarize

KERNEL = _kernel.load()
if KERNEL is None:  # pragma: no cover - the suite installs the built kernel (CONTRIBUTING.md)
    pytest.fail(f"the fused kernel did not build: {_kernel.status()}", pytrace=False)


def fused(
    x: torch.Tensor, unit_dim: int | None = None, bounds: tuple[float, float] | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    assert KERNEL is not None
    out = np.full(_kernel.NSTATS, -7.0)
    units = None if unit_dim is None else np.zeros(x.shape[unit_dim])
    KERNEL.summarize(x, out, unit_dim=unit_dim, units=units, bounds=bounds)
    return out, units


SUMS = [d.name for d in _schema.DEVICE if d.reduce == "sum"]
"""The device values that are sums over the elements (compared with a tolerance; the rest exactly)."""


def values_of(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """Every device value of ``x`` in float64 with numpy, in the kernel's order (``_schema.DEVICE``)."""
    a = x.detach().double().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        values = {
            "sum": a.sum(),
            "sumsq": (a * a).sum(),
            "min": a.min() if a.size else np.inf,  # NaN propagates, as in torch.aminmax
            "max": a.max() if a.size else -np.inf,
            "nonzero": np.count_nonzero(a),
            "sumabs": np.abs(a).sum(),
            "sumcube": (a * a * a).sum(),
            "sumfourth": ((a * a) * (a * a)).sum(),
            "nonfinite": np.count_nonzero(~np.isfinite(a)),
        }
    return np.array([values[name] for name in DEVICE_NAMES], dtype=np.float64)


def reference(
    x: torch.Tensor, unit_dim: int | None = None, bounds: tuple[float, float] | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Every device value in float64 (:func:`values_of`); active samples per unit (monitorch)."""
    stats = values_of(x)
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
    assert_values_match(got, want, x)
    if unit_dim is not None:
        np.testing.assert_array_equal(got_units, want_units, err_msg="active samples per unit")


def assert_values_match(
    got: np.ndarray, want: np.ndarray, x: torch.Tensor, rtol: float | None = None
) -> None:
    """Device values against the reference, by name: sums to within float rounding of the sum of their
    terms' magnitudes (a signed sum cancels), the rest exactly."""
    if rtol is None:
        rtol = 1e-12 if x.dtype == torch.float64 else 1e-5
    a = np.abs(x.detach().double().numpy())
    with np.errstate(over="ignore", invalid="ignore"):
        magnitudes = values_of(a)  # Σ|term|: the scale a sum's rounding error is relative to
    for name in DEVICE_NAMES:
        i = DEVICE_INDEX[name]
        if name in SUMS:
            scale = float(np.nan_to_num(magnitudes[i], posinf=0.0)) + 1.0
            np.testing.assert_allclose(
                got[i], want[i], rtol=rtol, atol=rtol * scale, equal_nan=True, err_msg=name
            )
        else:
            np.testing.assert_array_equal(got[i], want[i], err_msg=name)


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
    assert_values_match(out, want, after - before)


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
    assert out[DEVICE_INDEX["nonfinite"]] == 3
    assert np.isnan(out[[DEVICE_INDEX["min"], DEVICE_INDEX["max"]]]).all()
    finite = torch.arange(8, dtype=dtype)
    finite[2] = float("inf")
    KERNEL.run_diff(finite, torch.zeros(8, dtype=dtype), out.ctypes.data)
    assert out[DEVICE_INDEX["max"]] == float("inf")  # +inf without NaN: max is inf
    assert out[DEVICE_INDEX["nonfinite"]] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_empty_tensor_has_sums_of_zero_and_no_extremes(dtype: torch.dtype) -> None:
    """Zero elements (the taps skip empty tensors, but the kernel must not read past them): every sum 0,
    min +inf, max -inf, nothing counted — numpy's sums of an empty array."""
    assert KERNEL is not None
    x = torch.empty(0, dtype=dtype)
    out = np.full(_kernel.NSTATS, -7.0)
    KERNEL.run(x, out.ctypes.data)
    np.testing.assert_array_equal(out, values_of(x))
    KERNEL.run_diff(x, x.clone(), out.ctypes.data)
    np.testing.assert_array_equal(out, values_of(x))


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
    got = dict(zip(DEVICE_NAMES, out.tolist(), strict=True))
    assert (got["min"], got["max"], got["nonfinite"]) == (-np.inf, np.inf, 2)
    x[4, 0] = float("nan")
    assert_matches(x, 1)  # NaN propagates to sum, min and max; a NaN element is never active
    out, _ = fused(x)
    got = dict(zip(DEVICE_NAMES, out.tolist(), strict=True))
    assert np.isnan([got["sum"], got["min"], got["max"]]).all()
    assert got["nonfinite"] == 3
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
    from streamwatch._buffer import StepBuffer
    from streamwatch._record import SeriesKey

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


def test_the_installed_library_is_used_with_no_compiler_and_nothing_written_home(tmp_path: Path) -> None:
    """At run time nothing is compiled and nothing is cached: the library comes from the package
    directory, with no compiler on PATH, and a monitored run leaves the home directory empty."""
    home = tmp_path / "home"
    home.mkdir()
    script = textwrap.dedent(
        """
        import torch, streamwatch as sw
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
        with sw.observe(model) as watch:
            for _ in range(3):
                model(torch.randn(2, 3)).sum().backward()
                watch.step()
        print("KERNEL", watch.statistics().kernel)
        """
    )
    bare = tmp_path / "bin"  # a PATH with no cc, gcc or clang
    bare.mkdir()
    env = {"PATH": str(bare), "HOME": str(home), "CC": "/nonexistent/cc"}
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    library = _kernel.library_path()
    assert library is not None
    assert library.parent == Path(_kernel.__file__).parent
    assert f"KERNEL fused: {library}" in result.stdout
    assert list(home.rglob("*")) == []


@pytest.fixture
def fresh_loader() -> Any:
    """Let a test load the kernel from elsewhere; the process's loaded kernel is restored after."""
    saved = (_kernel._loaded, _kernel._failure)
    _kernel._reset()
    yield
    _kernel._loaded, _kernel._failure = saved


def test_a_missing_library_falls_back_to_torch_with_one_warning(
    tmp_path: Path, fresh_loader: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import streamwatch as sw

    monkeypatch.delenv("STREAMWATCH_KERNEL", raising=False)
    with pytest.warns(RuntimeWarning, match=r"no _fused library in .*installed without a C compiler") as seen:
        assert _kernel.load(tmp_path) is None
    assert len(seen) == 1
    assert "pip install --force-reinstall --no-binary streamwatch streamwatch" in str(seen[0].message)
    assert "STREAMWATCH_KERNEL=torch" in str(seen[0].message)
    assert _kernel.load() is None  # decided once per process: no second look, no second warning
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
    with sw.observe(model, every=1) as watch:  # the torch path, and no further warning (filterwarnings=error)
        x = torch.randn(2, 3)
        model(x).sum().backward()
        watch.step()
    assert watch.statistics().kernel.startswith(
        "torch: the fused CPU kernel is unavailable (no _fused library"
    )
    with torch.no_grad():
        hidden = model[0](x)
    latest = {
        (s.labels["layer"], s.labels["kind"], s.labels["stat"]): s.value
        for s in watch.snapshot()
        if s.name == "streamwatch_tensor"
    }
    assert latest[("0", "activation", "count")] == 8
    # summarised by torch: the Linear's output and the ReLU's, against a plain torch reference
    assert latest[("0", "activation", "sum")] == pytest.approx(float(hidden.sum()), rel=1e-6, abs=1e-6)
    assert latest[("1", "activation", "sum")] == pytest.approx(float(hidden.relu().sum()), rel=1e-6, abs=1e-6)


def test_an_unloadable_library_falls_back_to_torch_and_names_it(tmp_path: Path, fresh_loader: None) -> None:
    suffix = _kernel.importlib.machinery.EXTENSION_SUFFIXES[0]
    (tmp_path / f"_fused{suffix}").write_bytes(b"not a shared library")
    with pytest.warns(RuntimeWarning, match=rf"_fused{re.escape(suffix)}"):
        assert _kernel.load(tmp_path) is None
    assert _kernel.status().startswith("torch: the fused CPU kernel is unavailable (")


def test_a_library_built_from_another_schema_is_refused(
    fresh_loader: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library says which column schema it was built from; one built from another (a checkout whose
    _schema.py changed since the last build) is refused with a hint, and so is its compiled module."""
    other = _schema.SIGNATURE.replace("sumsq:sum", "sumsq2:sum")
    monkeypatch.setattr(_schema, "SIGNATURE", other)
    with pytest.warns(
        RuntimeWarning, match=r"built from another column schema: it has .*sumsq.*; rebuild it"
    ):
        assert _kernel.load() is None
    assert _kernel.assembler() is None
    assert _kernel.scalar_reader() is None


def test_forcing_the_torch_path_warns_nothing(fresh_loader: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMWATCH_KERNEL", "torch")
    assert _kernel.load() is None  # filterwarnings=error: a warning would fail this test
    assert _kernel.status() == "torch: STREAMWATCH_KERNEL=torch"


def test_the_layout_cache_stays_bounded_under_ever_new_shapes() -> None:
    kernel = _kernel.load()
    assert kernel is not None
    for n in range(3 * _kernel._LAYOUT_CACHE):
        assert kernel.layout(torch.Size([n + 1, 3, 5]), 1) == (n + 1, 1, 3, 5)
    assert len(kernel._layouts) <= _kernel._LAYOUT_CACHE


def test_statistics_name_the_kernel_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    import streamwatch as sw

    model = torch.nn.Linear(2, 2)
    with sw.observe(model, every=1) as watch:
        assert watch.statistics().kernel.startswith("fused: ")
    monkeypatch.setenv("STREAMWATCH_KERNEL", "torch")
    with sw.observe(model, every=1) as watch:
        assert watch.statistics().kernel == "torch: STREAMWATCH_KERNEL=torch"


# -- the step's table in one call: _fused.assemble against numpy's finalize --------------------------


def _pending(rng: np.random.Generator, rows: int, counted: bool, repeats: bool, device: bool) -> Any:
    """A step's PendingRecord as the taps leave it: rows in the host table (the fused kernel's), some
    with per-unit counts in the arena; with ``device``, some rows and their unit counts in the copied
    values instead (torch-path summaries), then device step scalars and an extra. Values with NaN,
    ±inf, zeros; keys repeated when ``repeats``."""
    from streamwatch._record import NO_DEVICE_DATA, PendingRecord

    nstats = _kernel.NSTATS if counted else _kernel.NSTATS - 1

    def stats(k: int) -> np.ndarray:
        values = rng.normal(size=(k, _kernel.NSTATS)) * 10.0
        values[:, DEVICE_INDEX["sumsq"]] = np.abs(values[:, DEVICE_INDEX["sumsq"]])
        for name in ("sum", "sumsq", "min", "max"):  # NaN and ±inf where torch would put them
            bad = rng.random(k) < 0.1
            values[bad, DEVICE_INDEX[name]] = rng.choice([np.nan, np.inf, -np.inf], size=int(bad.sum()))
        values[:, DEVICE_INDEX["nonfinite"]] = rng.integers(0, 3, k)
        return values

    host = stats(rows + 3)
    counts = [int(c) for c in rng.integers(1, 1000, rows)]
    host[:rows, DEVICE_INDEX["nonzero"]] = [rng.integers(0, c + 1) for c in counts]  # nonzero <= count
    units = [int(u) if rng.random() < 0.6 else 0 for u in rng.integers(1, 70, rows)]  # (4-wide sums)
    samples = [int(rng.integers(1, 64)) if u else 0 for u in units]
    device_rows = sorted(int(r) for r in rng.choice(rows, size=rows // 3, replace=False)) if device else []
    unit_rows = [r for r in device_rows if units[r] and rng.random() < 0.8]
    host_units: list[tuple[int, int]] = []
    offset = 0
    for row, unit in enumerate(units):
        if unit and row not in device_rows and rng.random() < 0.8:
            host_units.append((row, offset))
            offset += unit
    arena = np.where(rng.random(offset + 5) < 0.3, 0.0, rng.integers(1, 64, offset + 5).astype(float))
    names = [f"l{i}" for i in range(max(1, rows // 2 if repeats else rows))]
    keys = [names[i % len(names)] for i in range(rows)] if repeats else names[:rows]
    data, scalar_names, extra_layout = NO_DEVICE_DATA, (), []
    if device:  # device rows' stats, the device step scalars, the unit-rows' counts, an extra
        copied = stats(len(device_rows))[:, :nstats].ravel()
        vectors = [
            np.where(rng.random(units[r]) < 0.3, 0.0, rng.integers(1, 64, units[r]).astype(float))
            for r in unit_rows
        ]
        data = torch.from_numpy(np.concatenate([copied, [0.25, 7.0], *vectors, [1.0, 2.0, 3.0]]))
        scalar_names = ("loss", "correct")
        extra_layout = [(("l0", "histogram"), 3)]
    return PendingRecord(
        step=3, time=0.0, rank=0, keys=keys, counts=counts, units=units, samples=samples, host=host,
        host_units=host_units, arena=arena, device_rows=device_rows, unit_rows=unit_rows,
        extra_layout=extra_layout, scalar_names=scalar_names, host_scalars={"total": 16.0}, data=data,
        nonfinite_counted=counted, order=list(range(rows)),
    )  # fmt: skip


@pytest.mark.parametrize("counted", [False, True], ids=["flag", "counted"])
@pytest.mark.parametrize("repeats", [False, True], ids=["unique", "repeated-keys"])
@pytest.mark.parametrize("device", [False, True], ids=["host", "host+device"])
@pytest.mark.parametrize("seed", range(6))
def test_the_compiled_table_is_numpys_to_the_bit(
    seed: int, device: bool, counted: bool, repeats: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamwatch import _record

    assert _record._ASSEMBLE is not None, "the compiled module has no assemble(): rebuild it"
    rng = np.random.default_rng(seed)
    pending = _pending(rng, int(rng.integers(1, 40)), counted, repeats, device)
    fast = pending.resolve()
    monkeypatch.setattr(_record, "_ASSEMBLE", None)  # numpy: the reference
    slow = pending.resolve()
    assert fast.keys == slow.keys
    assert np.array_equal(fast.table, slow.table, equal_nan=True)
    assert (fast.scalars, fast.order) == (slow.scalars, slow.order)
    assert fast.extras.keys() == slow.extras.keys()
    for key, value in fast.extras.items():
        np.testing.assert_array_equal(value, slow.extras[key])
    if device:
        assert fast.scalars["loss"] == 0.25
        assert fast.scalars["accuracy"] == 7.0 / 16.0
        assert fast.extras[("l0", "histogram")].tolist() == [1.0, 2.0, 3.0]
    assert not fast.table.flags.writeable
    if repeats:
        return
    # and against plain numpy: each unit-row's dead units and active pairs from its vector of counts
    # (unknown, NaN, where the row's min or max is NaN)
    flat = pending.data.numpy()
    at = len(pending.device_rows) * (_kernel.NSTATS if counted else _kernel.NSTATS - 1) + len(
        pending.scalar_names
    )
    segments = [
        (row, pending.arena[offset : offset + pending.units[row]]) for row, offset in pending.host_units
    ]
    for row in pending.unit_rows:
        segments.append((row, flat[at : at + pending.units[row]]))
        at += pending.units[row]
    for row, segment in segments:
        if np.isnan([fast.column("min")[row], fast.column("max")[row]]).any():
            assert np.isnan([fast.column(name)[row] for name in ("zeros", "dead", "active")]).all()
            continue
        assert fast.column("dead")[row] == np.count_nonzero(segment == 0)
        assert fast.column("active")[row] == segment.sum()


def test_a_steps_keys_resolve_to_one_layout_per_distinct_list_of_keys() -> None:
    from streamwatch._record import Layout, layout_of

    keys = [sw.SeriesKey("train", f"l{i}", "activation", "") for i in range(40)]
    other = [*keys[:-1], sw.SeriesKey("train", "l39", "param_grad", "weight")]
    layout = layout_of(keys)
    assert layout_of(list(keys)) is layout  # the same keys, another step's list
    assert layout_of(other) is not layout
    assert layout_of(other) == tuple(other)
    assert layout_of(keys) is layout  # recent layouts are kept: steps alternate between a few
    assert layout == tuple(keys)
    assert hash(layout) == hash(tuple(keys))
    assert layout.unique
    assert {tuple(keys): 1}[layout] == 1
    assert {layout: 2}[tuple(keys)] == 2
    assert not Layout([*keys, keys[0]]).unique
    assert type(pickle.loads(pickle.dumps(layout))) is tuple  # copies are plain tuples
    assert type(copy.deepcopy(layout)) is tuple


def test_a_layouts_remembered_order_follows_each_steps_order() -> None:
    rng = np.random.default_rng(3)
    pending = _pending(rng, 30, counted=True, repeats=False, device=False)
    shuffled = [int(i) for i in rng.permutation(30)]
    for order, expected in (
        (list(range(30)), ()),
        (shuffled, tuple(shuffled)),
        (list(range(30)), ()),
        ([*range(1, 30), 30], ()),  # increasing, but not 0..n-1: still execution order
    ):
        pending = pending._replace(order=order)
        assert pending.resolve().order == expected


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.__setitem__(0, np.empty((2, len(_schema.COLUMNS) - 1))), "table must be"),
        (lambda a: a.__setitem__(2, [1]), "`counts` to be a list"),
        (lambda a: a.__setitem__(5, [(5, 0)]), "unit row 5 is outside"),
        (lambda a: a.__setitem__(5, [(0, 99)]), "outside the arena"),
        (lambda a: a.__setitem__(5, [0]), r"\(row, offset\) pairs"),
        (
            lambda a: a.__setitem__(9, [0, 1]),
            f"2 device rows need more than the {_kernel.NSTATS - 1} values copied",
        ),
        (lambda a: a.__setitem__(9, [7]), "device row 7 is outside"),
        (
            lambda a: (a.__setitem__(10, [1]), a.__setitem__(11, _kernel.NSTATS - 2)),
            "outside the values copied",
        ),
    ],
    ids=["table-shape", "short-list", "row", "arena", "pair", "device-values", "device-row", "device-units"],
)
def test_assemble_refuses_what_does_not_fit_with_a_clear_error(change: Any, message: str) -> None:
    assemble = _kernel.assembler()
    assert assemble is not None
    args: list[Any] = [np.empty((2, len(_schema.COLUMNS))), np.zeros((2, _kernel.NSTATS)), [1, 1], [2, 2]]
    args += [[1, 1], [], np.zeros(4), False, np.zeros(_kernel.NSTATS - 1), [], [], 0]  # nothing from a device
    change(args)
    with pytest.raises((ValueError, TypeError), match=message):
        assemble(*args)


# -- train accuracy of a CPU batch in one call: _fused.correct_f32/_f64 against torch's argmax --------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(6))
def test_the_compiled_correct_count_is_torchs_argmax_count(dtype: torch.dtype, seed: int) -> None:
    count = _kernel.correct_counters()[dtype]
    g = torch.Generator().manual_seed(seed)
    rows, classes = (
        int(torch.randint(1, 300, (1,), generator=g)),
        int(torch.randint(1, 12, (1,), generator=g)),
    )
    # small integers: many ties (the first maximum wins); NaN and ±inf here and there (a NaN wins)
    scores = torch.randint(-3, 4, (rows, classes), generator=g).to(dtype)
    special = torch.rand(rows, classes, generator=g)
    scores[special < 0.05] = float("nan")
    scores[(special >= 0.05) & (special < 0.08)] = float("inf")
    scores[(special >= 0.08) & (special < 0.1)] = -float("inf")
    targets = torch.randint(-1, classes + 1, (rows,), generator=g)  # some out of range: never correct
    expected = float((scores.argmax(-1) == targets).sum())
    assert count(scores.data_ptr(), targets.data_ptr(), rows, classes) == expected


def test_train_accuracy_takes_the_compiled_count_only_where_it_is_torchs() -> None:
    from streamwatch._accuracy import TrainAccuracy
    from streamwatch._step_args import check_step

    scores, targets = torch.randn(16, 5), torch.randint(0, 5, (16,))
    expected = float((scores.argmax(-1) == targets).sum())

    def count(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | float:
        found = check_step(None, outputs, targets, None, TrainAccuracy()).accuracy
        assert found is not None
        scorer, o, t, total = found
        assert total == 16
        return scorer(o, t)

    assert count(scores, targets) == expected
    assert isinstance(count(scores, targets), float)  # the C call: a host float, no torch op
    assert count(scores.clone().requires_grad_(), targets) == expected  # (read in place: no detach)
    # a transposed (non-contiguous) batch and int32 targets go through torch, with the same answer
    strided = scores.t().contiguous().t()
    assert not strided.is_contiguous()
    assert float(count(strided, targets)) == expected
    assert isinstance(count(scores, targets.int()), torch.Tensor)
    assert float(count(scores, targets.int())) == expected


def test_the_correct_count_refuses_a_null_batch_clearly() -> None:
    count = _kernel.correct_counters()[torch.float32]
    with pytest.raises(ValueError, match="3 rows of 4 classes at NULL"):
        count(0, 0, 3, 4)
    assert count(0, 0, 0, 4) == 0.0  # an empty batch: nothing to read


# -- a sampled step's CPU loss in one call: _fused.scalar_f32 against Tensor.item() -----------------------


def test_the_compiled_scalar_read_is_torchs_item() -> None:
    read = _kernel.scalar_reader()
    assert read is not None
    values = torch.tensor([0.1, -0.0, 1e-45, 3.4e38, float("inf"), -float("inf"), float("nan"), 7.0])
    for i in range(len(values)):
        scalar = values[i]  # a 0-d view at an offset into its storage: data_ptr() points at the element
        got, expected = read(scalar.data_ptr()), scalar.item()
        assert got == expected or (math.isnan(got) and math.isnan(expected))
        assert math.copysign(1.0, got) == math.copysign(1.0, expected)  # (-0.0 stays -0.0)
    assert math.isnan(read(0))  # no storage: not a value
    with pytest.raises(TypeError, match="expected an address"):
        read(1.5)


def test_a_sampled_steps_cpu_loss_is_read_where_it_lies(summary_kernel: str) -> None:
    """The record's loss is the value of the tensor passed, a 0-d view into a larger one and a loss that
    requires grad included; a float64 loss goes through torch (rounded to float32 like a device loss)."""
    model = nn.Linear(3, 2)
    records = sw.sinks.collect()
    x = torch.randn(4, 3)
    with sw.observe(model, every=1, sinks=[records]) as watch:
        losses = torch.stack([model(x).pow(2).mean(), model(x).abs().mean()])
        watch.step(losses[1])  # a view at offset 1, requiring grad
        watch.step(torch.tensor(0.1, dtype=torch.float64))
        watch.step(torch.tensor([2.5]))  # one element, 1-d: through torch
        watch.flush()
    assert [r.scalars["loss"] for r in records.items] == [
        losses[1].item(),
        torch.tensor(0.1).item(),
        2.5,
    ]
