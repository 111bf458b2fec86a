"""The Triton kernels (``streamwatch/_triton_kernels.py``) against float64 references, the C kernel and
the torch path.

Without a GPU they run on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``, set here
before Triton is imported) with ``STREAMWATCH_KERNEL=triton``; on a machine with CUDA the same tests run
the compiled kernels on CUDA tensors. Skipped where Triton is not installed (CI installs it:
pyproject's ``dev`` extra).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytest.importorskip("triton")  # (conftest.py set TRITON_INTERPRET=1 where there is no GPU)

# The interpreter reduces a block's minimum with numpy's nanmin, which warns on a slice of NaN only (a GPU
# skips NaN silently): the kernels take min and max again without NaN where there is one.
pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")

import streamwatch as sw  # noqa: E402
from streamwatch import _torchpath, _triton  # noqa: E402
from streamwatch._schema import COLUMN_NAMES, DEVICE_INDEX, DEVICE_NAMES  # noqa: E402
from streamwatch._torchpath import Packing  # noqa: E402
from tests.recording import record_run  # noqa: E402
from tests.test_kernel import LAYOUTS, assert_values_match, fused, reference, values_of  # noqa: E402
from tests.test_launches import COUNT_OPS  # noqa: E402


@pytest.fixture(autouse=True)
def triton_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors take the kernels (through the interpreter) where there is no GPU."""
    if DEVICE.type == "cpu":
        monkeypatch.setenv("STREAMWATCH_KERNEL", "triton")


@pytest.fixture
def arena() -> _triton.Arena:
    kernels = _triton.load()
    assert kernels is not None, _triton.status()
    return _triton.Arena(kernels, DEVICE)


def kernel_values(
    arena: _triton.Arena,
    x: torch.Tensor,
    unit_dim: int | None = None,
    bounds: tuple[float, float] | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """One tensor's device values (exact non-finite count) and per-unit counts through the kernels."""
    with np.errstate(invalid="ignore", over="ignore"):  # (the interpreter computes inf - inf in numpy)
        row = arena.summarize(x.to(DEVICE), unit_dim=unit_dim, bounds=bounds)
        values = arena.table(True, [row])[0].cpu().numpy()
    units = None if row.unit_counts is None else row.unit_counts.cpu().double().numpy()
    return values, units


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sparsity", [0.0, 0.97, 1.0])
def test_every_layout_matches_the_float64_reference(
    arena: _triton.Arena, layout: str, dtype: torch.dtype, sparsity: float
) -> None:
    shape, unit_dim = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(hash((layout, sparsity)) % 2**31)
    x = torch.randn(shape, generator=gen, dtype=dtype)
    x[torch.rand(shape, generator=gen) < sparsity] = 0
    got, got_units = kernel_values(arena, x, unit_dim)
    want, want_units = reference(x, unit_dim)
    assert_values_match(got, want, x)
    if unit_dim is not None:
        np.testing.assert_array_equal(got_units, want_units, err_msg="active samples per unit")


@pytest.mark.parametrize("bounds", [(-1.0, 1.0), (0.0, 1.0), (0.0, 6.0), (0.0, float("inf"))])
@pytest.mark.parametrize("layout", ["linear", "nchw", "channel_last_sequence"])
def test_saturation_bounds_follow_monitorch(
    arena: _triton.Arena, bounds: tuple[float, float], layout: str
) -> None:
    shape, unit_dim = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=gen).clamp(*bounds)
    x[:, :1] = bounds[0]  # a unit saturated at the lower bound for every sample
    _, got_units = kernel_values(arena, x, unit_dim, bounds)
    _, want_units = reference(x, unit_dim, bounds)
    np.testing.assert_array_equal(got_units, want_units)


finite = st.floats(-1e4, 1e4, allow_nan=False, width=32)
special = st.sampled_from([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-30])  # (x⁴ stays finite)
shapes = st.lists(st.integers(1, 9), min_size=1, max_size=4)


@st.composite
def tensors(draw: st.DrawFn) -> tuple[torch.Tensor, int | None]:
    """A tensor with zeros, NaN, ±inf mixed in, any float dtype (bf16/fp16 cast from float32), maybe a
    strided view (a transpose or a step), and a unit dimension where it has two or more. Under the
    interpreter, bf16 subnormals become signed zeros (its cast of them is wrong, a GPU's is not)."""
    shape = draw(shapes)
    n = int(np.prod(shape))
    values = draw(st.lists(st.one_of(finite, special), min_size=n, max_size=n))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]))
    x = torch.tensor(values, dtype=torch.float64).view(shape).to(dtype)
    if dtype == torch.bfloat16 and DEVICE.type == "cpu":  # (the interpreter's cast to float32 gets
        x = torch.where(x.abs() < torch.finfo(dtype).tiny, x * 0, x)  # subnormals wrong: CONTRIBUTING.md)
    view = draw(st.sampled_from(["plain", "transposed", "stepped"]))
    if view == "transposed" and x.dim() >= 2:
        x = x.transpose(0, -1)
    elif view == "stepped" and x.shape[-1] > 1:
        x = x[..., ::2]
    unit_dim = draw(st.sampled_from([None, 1, x.dim() - 1])) if x.dim() >= 2 else None
    return x, unit_dim


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=tensors())
def test_equal_the_reference_the_c_kernel_and_the_torch_path(arena: _triton.Arena, case: tuple) -> None:
    """On generated tensors: the float64 reference of the values as stored (bf16/fp16 rounded), the C
    kernel (float32/float64, contiguous copies) and the torch path (its NaN counts as zero for
    ``nonzero``; it leaves ``nonfinite`` out unless counted)."""
    x, unit_dim = case
    got, got_units = kernel_values(arena, x, unit_dim)
    want, want_units = reference(x.double(), unit_dim)
    rtol = 1e-12 if x.dtype == torch.float64 else 2e-5
    assert_values_match(got, want, x.double(), rtol=rtol)
    if unit_dim is not None:
        np.testing.assert_array_equal(got_units, want_units)
    if x.dtype in (torch.float32, torch.float64):
        c_values, c_units = fused(x.contiguous(), unit_dim)
        assert_values_match(got, c_values, x.double(), rtol=rtol)
        if unit_dim is not None:
            np.testing.assert_array_equal(got_units, c_units)
    row = _torchpath.summarize(x, unit_dim=unit_dim, count_nonfinite=True)
    torch_values = row.values().double().numpy()
    for name in ("min", "max", "nonfinite"):
        i = DEVICE_INDEX[name]
        np.testing.assert_array_equal(got[i], torch_values[i], err_msg=name)


def test_packed_tensors_match_one_by_one_and_the_torch_path(arena: _triton.Arena) -> None:
    """One launch for a pack: every tensor's values (the padding of its last chunk never read: an
    all-positive tensor keeps its minimum), in order and reversed, an empty tensor with no extremes."""
    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 5, generator=gen) + 5,
        torch.randn(2000, generator=gen),
        torch.empty(0),
        torch.ones(1),
    ]
    pack = Packing([t.shape for t in tensors], DEVICE, torch.float32)
    pack.fill([t.to(DEVICE) for t in tensors])
    for reverse in (False, True):
        rows = arena.summarize_packed(pack, reverse=reverse)
        got = arena.table(True, rows).cpu().numpy()
        for values, t in zip(got, tensors[::-1] if reverse else tensors, strict=True):
            assert_values_match(values, values_of(t), t)
    full = [t for t in tensors if t.numel()]  # (the torch path refuses an empty tensor in a pack)
    pack = Packing([t.shape for t in full], DEVICE, torch.float32)
    pack.fill([t.to(DEVICE) for t in full])
    want = _torchpath.device_values(_torchpath.summarize_packed(pack), False).view(3, -1).double().cpu()
    got = arena.table(False, arena.summarize_packed(pack)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_a_step_of_rows_is_one_finalize_in_the_order_given(arena: _triton.Arena) -> None:
    """``device_values`` of arena rows beside torch-path rows (compiled code): the rows' values in the
    order they were given, float64."""
    a, b, c = torch.randn(7), torch.randn(3, 4), torch.randn(5)
    rows = [arena.summarize(a.to(DEVICE)), _torchpath.summarize(b.to(DEVICE)), arena.summarize(c.to(DEVICE))]
    got = _torchpath.device_values(rows, False).view(3, -1).cpu().numpy()
    for values, t in zip(got, (a, b, c), strict=True):
        assert_values_match(np.append(values, 0.0), values_of(t), t)
    assert _torchpath.device_values(rows[::2], False).dtype == torch.float64


def test_the_same_input_gives_bit_identical_values(arena: _triton.Arena) -> None:
    x = torch.randn((64, 128, 9) if DEVICE.type == "cuda" else (8, 16, 9)).to(
        DEVICE
    )  # (the interpreter is slow)
    first = arena.table(True, [arena.summarize(x, unit_dim=1)])
    second = arena.table(True, [arena.summarize(x, unit_dim=1)])
    assert torch.equal(first, second)


def test_large_float32_sums_stay_accurate() -> None:
    kernels = _triton.load()
    assert kernels is not None
    x = torch.full((1 << 21,), 0.1, dtype=torch.float32) + torch.linspace(0, 1e-3, 1 << 21)
    got = _triton.summarize_values(x.to(DEVICE)).cpu().numpy()
    assert_values_match(got, values_of(x), x)


def assert_same_records(got: list[sw.StepRecord], want: list[sw.StepRecord]) -> None:
    """Four records each, key for key, their tables equal within float32 rounding (NaN where NaN)."""
    assert len(got) == len(want) == 4
    for a, b in zip(got, want, strict=True):
        assert a.keys == b.keys
        np.testing.assert_allclose(
            np.asarray(a.table), np.asarray(b.table), rtol=1e-5, atol=1e-5, equal_nan=True
        )


def train_records(tmp_path: Path, route: str, monkeypatch: pytest.MonkeyPatch) -> list:
    monkeypatch.setenv("STREAMWATCH_KERNEL", route)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).to(
        DEVICE
    )
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 12, generator=gen).to(DEVICE), torch.randint(0, 4, (32,), generator=gen).to(DEVICE)
    run = record_run(tmp_path / f"{route}.jsonl", model, x, y, 4, lr=0.1, stats=("nonfinite", "dead"))
    return run.records


def test_a_training_run_records_what_the_torch_path_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Activations, gradients, weights and updates with per-unit activity and exact non-finite counts:
    every record's keys and table through the kernels equal the torch path's."""
    route = "triton" if DEVICE.type == "cpu" else ""
    got = train_records(tmp_path, route, monkeypatch)
    want = train_records(tmp_path, "torch", monkeypatch)
    assert_same_records(got, want)
    kinds = {key.kind for key in got[-1].keys}
    assert {"activation", "param_grad", "param", "update"} <= kinds


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_triton, "_loaded", None)
    monkeypatch.setattr(_triton, "_failure", None)


def test_a_missing_triton_falls_back_to_torch_with_one_warning(
    fresh_loader: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing() -> None:
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(_triton, "_import", missing)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _triton.load() is None
        assert _triton.load() is None
    assert len(seen) == 1
    assert "STREAMWATCH_KERNEL=torch" in str(seen[0].message)
    assert _triton.status().startswith("torch: the Triton kernels are unavailable (ImportError")


def test_forcing_the_torch_path_loads_nothing(fresh_loader: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMWATCH_KERNEL", "torch")
    assert _triton.load() is None
    assert _triton.status() == "torch: STREAMWATCH_KERNEL=torch"


def test_kernels_compile_into_a_temporary_cache_not_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unless the user says where (``TRITON_CACHE_DIR``, ``TRITON_HOME``), Triton caches what it
    compiles for streamwatch in a temporary folder of the process, not under the home folder."""
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_HOME", raising=False)
    monkeypatch.setattr(_triton, "_cache_dir", None)
    _triton._own_cache()
    chosen = os.environ["TRITON_CACHE_DIR"]
    assert not chosen.startswith(str(Path.home()))
    assert Path(chosen).is_dir()
    monkeypatch.setenv("TRITON_CACHE_DIR", "/tmp/mine")
    monkeypatch.setattr(_triton, "_cache_dir", None)
    _triton._own_cache()
    assert os.environ["TRITON_CACHE_DIR"] == "/tmp/mine"


def test_layouts_map_to_samples_units_positions() -> None:
    x = torch.empty(2, 3, 4, 5)
    assert _triton._layout(x, 1) == (2, 3, 20, 60, 20, 1)
    assert _triton._layout(x.permute(0, 2, 3, 1), 3) == (2, 3, 20, 60, 20, 1)  # NHWC memory, units last
    assert _triton._layout(x.transpose(2, 3), 1) is None  # positions no single stride walks: copied
    assert _triton._layout(x, None) == (1, 1, 120, 0, 0, 1)
    assert _triton._layout(x.transpose(0, 1), None) == (3, 2, 20, 20, 60, 1)
    assert DEVICE_NAMES[-1] == "nonfinite"


def _mlp(layers: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers - 1):
        blocks += [nn.Linear(16, 16), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(16, 4)), torch.randn(8, 16), torch.randint(0, 4, (8,))


def _launches(case: str) -> tuple[int, int, int, str]:
    """``(Triton launches, torch kernels, rows, what they were)`` a sampled step adds, every kind at
    cadence 1, after two steps that made every buffer (the first step's update makes the pack of the
    weights after a step; the arena grows to what a step needs). Copies between host and device (on a
    GPU only) are not counted among the kernels: the test after the next counts them."""
    plain, observed, rows = COUNT_OPS.count_case(case, route="triton", device=DEVICE.type)
    added = observed.ops.copy()
    added.subtract(plain.ops)
    named = ", ".join(f"{op} {n}" for op, n in sorted(added.items()) if n)
    named += f"; transfers: {observed.transfers}"
    kernels = observed.kernels - plain.kernels - (len(observed.transfers) - len(plain.transfers))
    return observed.triton, kernels, rows, named


@pytest.mark.parametrize("case", ["mlp", "transformer bf16"])
def test_a_sampled_step_is_one_launch_per_tapped_tensor_and_a_few(case: str) -> None:
    """One Triton launch per activation and output gradient, one per pack of each parameter kind, one
    finalize; the torch ops left are four multi-tensor copies (the packs of gradients, weights, the
    weights before the step and after it: the update is read from the last two, never stored) and at the
    boundary two ``cat``, one conversion and the unit counts zeroed. (The torch path takes 86 and 214
    kernels for these: ``benchmarks/count_ops.py``.)"""
    triton, kernels, rows, ops = _launches(case)
    params = len(list(COUNT_OPS.CASES[case][0]()[0].parameters()))
    tapped = rows - 3 * params  # activations and output gradients
    assert triton == tapped + 3 + 1  # + a pack per parameter kind + the finalize
    scalars = DEVICE.type == "cuda"  # a device loss: its conversion to the table's dtype (on a CPU, read)
    assert kernels <= 4 + 4 + scalars, ops  # pack copies + the boundary (two cats, a conversion, zeroing)
    assert triton + kernels <= tapped + 12 + scalars, ops  # 2 per parameter kind, 1 updates, 5 boundary


def test_a_sampled_step_copies_its_table_off_the_device_once() -> None:
    """On a GPU a sampled step moves one tensor between host and device: its table, into pinned memory
    (asynchronously, on a side stream). Nothing is uploaded: the arena's index tensors are made once.
    On a CPU nothing moves."""
    plain, observed, _ = COUNT_OPS.count_case("transformer bf16", route="triton", device=DEVICE.type)
    assert plain.transfers == []
    if DEVICE.type == "cuda":
        assert len(observed.transfers) == 1, observed.transfers
        assert observed.transfers[0].startswith("cuda:0->cpu "), observed.transfers
    else:
        assert observed.transfers == []


def test_parameter_kinds_do_not_launch_more_for_more_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 32-layer MLP's sampled step adds launches for its activations and output gradients only: its
    96 parameters, gradients and updates take the launches the 4-layer MLP's 12 take."""
    monkeypatch.setitem(COUNT_OPS.CASES, "mlp4", (lambda: _mlp(4), None))
    monkeypatch.setitem(COUNT_OPS.CASES, "mlp32", (lambda: _mlp(32), None))
    small, large = _launches("mlp4"), _launches("mlp32")
    tapped = [rows - 3 * 2 * layers for (_, _, rows, _), layers in ((small, 4), (large, 32))]
    assert large[0] - small[0] == tapped[1] - tapped[0]  # Triton: only the tapped tensors' launches
    assert large[1] == small[1]  # torch kernels: the same


def test_a_kernel_that_fails_hands_over_to_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launch that fails in the middle of a run (a specialisation that would not compile at its first
    use): one warning, the tensor at hand and every later one summarised by the torch path, every step
    recorded with the torch path's values, and the status (``statistics().kernel``) saying why."""
    kernels = _triton.load()
    assert kernels is not None
    monkeypatch.setattr(kernels, "failed", None)  # (restored for the tests after this one)

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("would not compile")

    class Broken:
        def __getitem__(self, grid: object) -> object:
            return broken

    monkeypatch.setattr(kernels.module, "tile_partials", Broken())
    with pytest.warns(RuntimeWarning, match="a Triton kernel failed") as seen:
        got = train_records(tmp_path, "triton" if DEVICE.type == "cpu" else "", monkeypatch)
    assert len([w for w in seen if "Triton kernel failed" in str(w.message)]) == 1
    assert _triton.status() == "torch: a Triton kernel failed (RuntimeError: would not compile)"
    want = train_records(tmp_path, "torch", monkeypatch)
    assert_same_records(got, want)


def _train_for_state(
    route: str | None, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, torch.Tensor], int]:
    """Five steps of a model with dropout and batch norm (observed on ``route`` at ``every=1``, every
    kind, or not observed): every parameter, gradient and buffer, the RNG state, and the records."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4)
    ).to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 12, generator=gen).to(DEVICE), torch.randint(0, 4, (32,), generator=gen).to(DEVICE)
    records = sw.sinks.collect()
    watch = None
    if route is not None:
        monkeypatch.setenv("STREAMWATCH_KERNEL", route)
        cadence = dict.fromkeys(("activation", "output_grad", "param", "param_grad", "update"), 1)
        watch = sw.observe(model, opt, every=1, cadence=cadence, sinks=[records])
    torch.manual_seed(2)
    for _ in range(5):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if watch is not None:
            watch.step(loss=loss)
    if watch is not None:
        watch.close()
    state = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    state |= {f"grad {n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    state |= {f"buffer {n}": b.clone() for n, b in model.named_buffers()}
    state["rng"] = torch.get_rng_state()
    state["training"] = torch.tensor([m.training for m in model.modules()])
    return state, len(records.items)


def test_training_is_bit_identical_on_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels only read: with every step and every kind summarised by them, weights, gradients,
    buffers, the training flag and the RNG end bit for bit as without streamwatch."""
    want, _ = _train_for_state(None, monkeypatch)
    got, records = _train_for_state("triton" if DEVICE.type == "cpu" else "", monkeypatch)
    assert records == 5
    assert got.keys() == want.keys()
    differ = [name for name in want if not torch.equal(got[name], want[name])]
    assert differ == []


def compiled_and_eager_records(
    compile_model: bool, observed: bool = True
) -> tuple[list[sw.StepRecord], list[torch.fx.GraphModule], dict[str, torch.Tensor]]:
    """Three steps of a small MLP (the first compiles, the second runs the compiled forward, the third
    a smaller batch), every step recorded (exact non-finite counts, per-unit activity) unless not
    ``observed``, its forward compiled (whole: ``fullgraph``) or not; the records, the graphs dynamo made
    and the training state at the end (parameters, gradients, RNG)."""
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        graphs.append(gm)
        if DEVICE.type == "cuda":  # Inductor: the op becomes a launch of the kernel from its own code
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, inputs)
        return gm.forward  # (the interpreter runs the kernels: Inductor's code for them needs a GPU)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).to(
        DEVICE
    )
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 12, generator=gen).to(DEVICE), torch.randint(0, 4, (32,), generator=gen).to(DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    records = sw.sinks.collect()
    watch = (
        sw.observe(model, optimizer, sinks=[records], every=1, stats=("nonfinite", "dead"))
        if observed
        else None
    )
    forward = torch.compile(model, backend=backend, fullgraph=True) if compile_model else model
    for batch in (32, 32, 5):  # (a new batch size: dynamo compiles again, the shapes symbolic)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(forward(x[:batch]), y[:batch])
        loss.backward()
        optimizer.step()
        if watch is not None:
            watch.step(loss=loss)
    if watch is not None:
        watch.close()
        assert watch.statistics().hook_errors == 0
    torch._dynamo.reset()
    state = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    state |= {f"grad {n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    state["rng"] = torch.get_rng_state()
    state["training"] = torch.tensor([m.training for m in model.modules()])
    return records.items, graphs, state


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_compiled_model_is_summarised_by_the_registered_op_as_in_eager_mode() -> None:
    """Under ``torch.compile(fullgraph=True)`` (no graph break) each activation is summarised by the
    registered op ``streamwatch::partials`` (the same kernels; Inductor launches them from its own code
    on a GPU), and every row the compiled run records — sums, extremes, exact non-finite counts,
    per-unit activity — equals eager mode's, with a static and with a symbolic batch size (output
    gradients through the probe, without per-unit activity: ``_gradprobe``). Training is bit-identical
    to the same compiled model's unobserved (parameters, gradients, RNG state, training flags)."""
    got, graphs, state = compiled_and_eager_records(True)
    want, _, _ = compiled_and_eager_records(False)
    _, _, unobserved = compiled_and_eager_records(True, observed=False)
    assert state.keys() == unobserved.keys()
    for name, value in state.items():
        assert torch.equal(value, unobserved[name]), name
    ops = [n for gm in graphs for n in gm.graph.nodes if n.target is torch.ops.streamwatch.partials.default]
    assert len(graphs) == 2  # (the second with a symbolic batch size)
    assert len(ops) == 2 * 5  # one per activation: 3 Linear, ReLU, Tanh
    assert len(got) == len(want) == 3
    units = [COLUMN_NAMES.index(name) for name in ("units", "dead", "samples", "active")]
    for a, b in zip(got, want, strict=True):
        rows = {key: i for i, key in enumerate(b.keys)}
        assert set(a.keys) == set(b.keys)
        picked = [rows[key] for key in a.keys]
        have, expected = np.asarray(a.table).copy(), np.asarray(b.table)[picked]
        grads = [i for i, key in enumerate(a.keys) if key.kind == "output_grad"]
        assert grads  # (the probe: output gradients without per-unit activity)
        expected[np.ix_(grads, units)] = have[np.ix_(grads, units)]
        np.testing.assert_allclose(have, expected, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert float(np.nansum(got[-1].column("active"))) > 0  # (per-unit activity was taken)


def test_a_refused_registration_leaves_compiled_code_on_the_torch_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If torch will not register ``streamwatch::partials``, one warning says so and only compiled code
    loses the kernels: eager code still takes them."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no custom ops today")

    loaded = _triton.load()
    assert loaded is not None
    monkeypatch.setattr(_triton, "_op", None)
    monkeypatch.setattr(torch.library, "triton_op", refuse)
    with pytest.warns(
        RuntimeWarning, match="no custom ops today.*inside torch.compile are summarised with torch"
    ):
        kernels = _triton.Kernels(loaded.module)
    assert kernels.op is None
    assert _triton.Kernels(loaded.module).op is None  # (warned once: not retried)
    x = torch.arange(6.0, device=DEVICE)
    arena = _triton.Arena(kernels, DEVICE)
    assert float(arena.table(False, [arena.summarize(x)])[0, 0]) == 15.0


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_failed_finalize_in_compiled_code_hands_over_to_the_torch_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When the finalize of the compiled rows fails, as any kernel failure does: one warning, that
    step's record lost and counted (``failed_steps``, the hook error reported at ``close``), and from
    the next step on the torch path: dynamo guards on the kernels' state, so the next forward is traced
    again, without the op, and recorded."""
    kernels = _triton.load()
    assert kernels is not None
    monkeypatch.setattr(kernels, "failed", None)  # (restored for the tests after this one)
    finalize = kernels.module.finalize

    class Broken:
        def __getitem__(self, grid: object) -> Any:
            def launch(*_: object, **__: object) -> None:
                raise RuntimeError("would not compile")

            return launch

    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        graphs.append(gm)
        if DEVICE.type == "cuda":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, inputs)
        return gm.forward

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 8).to(DEVICE)
    records = sw.sinks.collect()
    watch = sw.observe(model, optimizer, sinks=[records], every=1, taps=("activation",))
    forward = torch.compile(model, backend=backend, fullgraph=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(3):
            monkeypatch.setattr(kernels.module, "finalize", Broken() if step == 1 else finalize)
            optimizer.zero_grad()
            forward(x).sum().backward()
            optimizer.step()
            watch.step()
    with pytest.raises(sw.PipelineError, match="would not compile"):
        watch.close()
    assert len([w for w in seen if "a Triton kernel failed" in str(w.message)]) == 1
    ops = [sum(n.target is torch.ops.streamwatch.partials.default for n in gm.graph.nodes) for gm in graphs]
    assert ops == [3, 0]  # (traced again, on the torch path)
    assert [r.step for r in records.items] == [0, 2]
    assert len(records.items[-1].keys) == 3  # (every activation, on the torch path)
    assert watch.statistics().failed_steps == 1
    torch._dynamo.reset()
