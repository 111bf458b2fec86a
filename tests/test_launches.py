"""Launch budgets on the torch path (the ops CUDA tensors take), counted on a CPU with a dispatch mode.

Every count here is of aten ops dispatched on the training thread (``benchmarks/count_ops.py``, imported
from its file, holds the counter and the models: one home for what docs/performance.md#launch-counts
prints). Values are checked against float64 references computed here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

import streamwatch as sw
from streamwatch import _torchpath
from streamwatch._schema import DEVICE_NAMES
from streamwatch._torchpath import Packing, device_values, summarize, summarize_packed


def _count_ops() -> ModuleType:
    path = Path(__file__).parents[1] / "benchmarks" / "count_ops.py"
    spec = importlib.util.spec_from_file_location("count_ops", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("count_ops", module)
    spec.loader.exec_module(module)
    return module


COUNT_OPS = _count_ops()

BUDGET = {"mlp": 110, "mlp bf16": 110, "transformer": 250, "transformer bf16": 250}
"""Ops a sampled step may add (measured 102 and 240; before the leaner summaries 538 and 2086)."""


@pytest.fixture
def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMWATCH_KERNEL", "torch")


@pytest.fixture(autouse=True)
def few_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors take the ops CUDA tensors take (a CPU takes faster ones by default: the test below)."""
    monkeypatch.setattr(_torchpath, "FEW_LAUNCHES_ON_CPU", True)


@pytest.mark.parametrize("case", list(BUDGET))
def test_a_sampled_step_dispatches_few_ops_and_never_stacks_mixed_dtypes(torch_path: None, case: str) -> None:
    """One sampled step with every kind at cadence 1, float32 and under bf16 autocast: its added ops
    stay within the budget, at most 4 per summary row on average, and no ``stack``/``cat`` receives
    inputs of two dtypes (bf16 extremes beside float32 sums were one stack of 224 inputs)."""
    plain, observed, rows = COUNT_OPS.count_case(case)
    added = observed.total - plain.total
    assert added <= BUDGET[case], sorted((observed.ops - plain.ops).items())
    assert added / rows <= 4.0
    assert observed.mixed == 0
    assert observed.ops["stack"] - plain.ops["stack"] <= 1
    assert observed.ops["cat"] - plain.ops["cat"] <= 3


def _reference(x: torch.Tensor) -> dict[str, float]:
    v = x.detach().double().reshape(-1).numpy()
    return {
        "sum": v.sum(),
        "sumsq": (v * v).sum(),
        "min": v.min(),
        "max": v.max(),
        "nonzero": float((v != 0).sum()),
        "sumabs": np.abs(v).sum(),
        "sumcube": (v**3).sum(),
        "sumfourth": (v**4).sum(),
        "nonfinite": float((~np.isfinite(v)).sum()),
    }


def _assert_values(values: torch.Tensor, x: torch.Tensor) -> None:
    want = _reference(x)
    got = dict(zip(DEVICE_NAMES, values.double().tolist(), strict=False))
    for name, value in got.items():
        # float32 sums: off by ~1e-7 of the sum of their terms' magnitudes
        scale = {"sum": "sumabs", "sumcube": "sumfourth"}.get(name, name)
        magnitude = want[scale] if name != "sumcube" else np.sqrt(want["sumsq"] * want["sumfourth"])
        assert value == pytest.approx(want[name], rel=1e-5, abs=1e-5 * magnitude + 1e-6), name


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 33, generator=g)
    return [
        x,
        x.relu(),
        x.t(),  # a strided view, read as it is
        (x * 3).to(torch.bfloat16),
        (x * 100).to(torch.float16),  # x² overflows float16: accumulated in float32
        torch.randn(2, 3, 5, 7, generator=g, dtype=torch.float64),
        torch.randn(1, generator=g) + 5,
        torch.zeros(4, 4),
    ]


def test_one_tensor_is_four_ops_and_its_values_match_a_float64_reference() -> None:
    for x in _tensors():
        summarize(x)  # (its scratch views made once: shapes repeat every step)
        with COUNT_OPS.OpCounter() as counter:
            row = summarize(x)
        assert counter.count.total == 4, (x.shape, x.dtype, counter.count.ops)
        _assert_values(row.values(), x)


@pytest.mark.parametrize("positions", [False, True], ids=["2-D", "4-D"])
def test_per_unit_activity_is_one_more_op_or_two_with_positions(positions: bool) -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 6, 3, 3, generator=g).relu() if positions else torch.randn(8, 6, generator=g).relu()
    x[:, 2] = 0.0  # a dead unit
    summarize(x, unit_dim=1)
    with COUNT_OPS.OpCounter() as counter:
        row = summarize(x, unit_dim=1)
    assert counter.count.total == (6 if positions else 5), counter.count.ops
    active = (x != 0).reshape(8, 6, -1).any(-1).sum(0).double()
    assert row.unit_counts is not None
    assert row.samples == 8
    np.testing.assert_array_equal(row.unit_counts.double().numpy(), active.numpy())


def test_non_finite_values_and_the_exact_count() -> None:
    x = torch.randn(5, 7)
    x[1, 2], x[3, 3] = float("inf"), -float("inf")
    row = summarize(x, count_nonfinite=True)
    values = dict(zip(DEVICE_NAMES, row.values().tolist(), strict=True))
    assert (values["min"], values["max"], values["nonfinite"]) == (-np.inf, np.inf, 2.0)
    x[0, 0] = float("nan")
    values = dict(zip(DEVICE_NAMES, summarize(x, count_nonfinite=True).values().tolist(), strict=True))
    assert np.isnan([values["sum"], values["min"], values["max"]]).all()
    assert values["nonfinite"] == 3.0


def test_a_pack_summarises_every_tensor_in_a_fixed_number_of_ops() -> None:
    g = torch.Generator().manual_seed(5)
    shapes = [(300, 7), (300,), (1500, 3), (1,), (1024,)]
    tensors = [torch.randn(*shape, generator=g) * (i + 1) for i, shape in enumerate(shapes)]
    tensors[3].zero_()
    pack = Packing([t.shape for t in tensors], torch.device("cpu"), torch.float32)
    pack.fill(tensors)
    summarize_packed(pack)
    with COUNT_OPS.OpCounter() as counter:
        pack.fill(tensors)
        rows = summarize_packed(pack)
    assert counter.count.total == 11, counter.count.ops  # (whatever the number of tensors: see below)
    fewer = Packing([t.shape for t in tensors[:2]], torch.device("cpu"), torch.float32)
    fewer.fill(tensors[:2])
    summarize_packed(fewer)
    with COUNT_OPS.OpCounter() as again:
        fewer.fill(tensors[:2])
        summarize_packed(fewer)
    assert again.count.total == 11
    for row, x in zip(rows, tensors, strict=True):
        _assert_values(row.values(), x)
    values = device_values(rows, False).view(len(rows), -1)  # one cat of the pack's whole Gram matrices
    for got, x in zip(values, tensors, strict=True):
        _assert_values(got, x)
    backward = summarize_packed(pack, reverse=True)  # (gradients come in reverse order)
    for row, x in zip(backward, tensors[::-1], strict=True):
        _assert_values(row.values(), x)


def test_inexact_matrix_products_make_the_sums_float64() -> None:
    """Where float32 products may run in bfloat16 or TF32 (``set_float32_matmul_precision``), the Gram
    matrix is float64: the sums stay exact to float32 rounding of the elements."""
    matmul = torch.backends.mkldnn.matmul
    was = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        x = torch.randn(100, 10) + 3
        row = summarize(x)
    finally:
        matmul.fp32_precision = was
    assert row.gram.dtype == torch.float64
    _assert_values(row.values(), x)


def test_autocast_leaves_the_sums_in_float32() -> None:
    x = torch.randn(32, 16) + 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        row = summarize(x)
    assert row.gram.dtype == torch.float32
    _assert_values(row.values(), x)


def test_updates_are_snapshotted_by_one_copy_and_match_the_difference(
    torch_path: None, train: object
) -> None:
    """On the torch path the weights before a step are one multi-tensor copy per pack, not a clone per
    parameter, and each update row is Δ = after − before exactly as a float64 reference computes it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    records = sw.sinks.collect()
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    with sw.observe(model, opt, every=1, cadence={"update": 1}, sinks=[records], sentinel=()) as watch:
        for step in range(3):
            before = [p.detach().clone() for p in model.parameters()]
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if step == 2:
                with COUNT_OPS.OpCounter() as counter:
                    opt.step()
            else:
                opt.step()
            opt.zero_grad()
            watch.step()
            deltas = [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]
    assert counter.count.ops["clone"] == 0
    assert counter.count.ops["_foreach_copy_"] >= 1
    record = records.items[-1]
    names = [f"{layer}.{name}" for layer, name, _ in _named(model)]
    for name, delta in zip(names, deltas, strict=True):
        layer, pname = name.rsplit(".", 1)
        (i,) = [i for i, k in enumerate(record.keys) if (k.layer, k.kind, k.name) == (layer, "update", pname)]
        want = _reference(delta)
        assert record.column("sumsq")[i] == pytest.approx(want["sumsq"], rel=1e-5)
        assert record.column("sum")[i] == pytest.approx(want["sum"], rel=1e-4, abs=1e-6 * want["sumabs"])
        assert (record.column("min")[i], record.column("max")[i]) == pytest.approx((want["min"], want["max"]))


def _named(model: torch.nn.Module) -> list[tuple[str, str, torch.nn.Parameter]]:
    return [(*name.rsplit(".", 1), p) for name, p in model.named_parameters()]  # type: ignore[misc]


def test_scratch_is_released() -> None:
    summarize(torch.ones(3))
    _torchpath.release_scratch()
    assert not _torchpath._SCRATCH.rows


@pytest.mark.parametrize("unit_dim", [None, 1])
def test_a_large_tensor_is_summarised_in_slices_with_the_same_values(
    monkeypatch: pytest.MonkeyPatch, unit_dim: int | None
) -> None:
    """Beyond ``SLICE_ELEMENTS`` a tensor is read in slices along its samples (the scratch rows stay
    bounded): the values, the non-finite count and the per-unit activity are those of the whole."""
    monkeypatch.setattr(_torchpath, "SLICE_ELEMENTS", 100)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(37, 6, 5, generator=g).relu()
    x[:, 3] = 0.0
    x[5, 1, 1] = float("inf")
    row = summarize(x, unit_dim=unit_dim, count_nonfinite=True)
    finite = x.nan_to_num(posinf=0.0)
    values = dict(zip(DEVICE_NAMES, row.values().tolist(), strict=True))
    assert (values["max"], values["nonfinite"]) == (np.inf, 1.0)
    _assert_values(summarize(finite, unit_dim=unit_dim).values(), finite)
    if unit_dim is not None:
        assert row.samples == 37
        active = (x != 0).any(-1).sum(0).double()
        np.testing.assert_array_equal(row.unit_counts.double().numpy(), active.numpy())


@pytest.mark.parametrize("unit_dim", [None, 1])
def test_compiled_code_takes_plain_ops_with_the_same_values(unit_dim: int | None) -> None:
    """Under ``torch.compile`` (no scratch views, no ``out=``: Dynamo traces neither) the same values."""
    x = torch.randn(6, 5, 4).relu()
    x[:, 2] = 0.0
    eager, traced = summarize(x, unit_dim=unit_dim), _torchpath.summarize_traced(x, unit_dim, False, None)
    np.testing.assert_allclose(traced.values().numpy(), eager.values().double().numpy(), rtol=1e-6, atol=1e-6)
    if unit_dim is not None:
        np.testing.assert_array_equal(traced.unit_counts.numpy(), eager.unit_counts.double().numpy())


@pytest.mark.parametrize("unit_dim", [None, 1])
@pytest.mark.parametrize("n", [1024 * 6, 1000], ids=["chunks", "no_chunks"])
def test_a_cpu_takes_a_copy_a_multiply_and_chunked_products_with_the_same_values(
    monkeypatch: pytest.MonkeyPatch, unit_dim: int | None, n: int
) -> None:
    monkeypatch.setattr(_torchpath, "FEW_LAUNCHES_ON_CPU", False)
    g = torch.Generator().manual_seed(7)
    for x in (
        torch.randn(n // 8, 8, generator=g).relu() + 0.5,
        torch.randn(8, n // 8, generator=g).bfloat16(),
    ):
        summarize(x, unit_dim=unit_dim)
        with COUNT_OPS.OpCounter() as counter:
            row = summarize(x, unit_dim=unit_dim)
        assert ("bmm" in counter.count.ops) == (n % 1024 == 0)
        assert "pow" not in counter.count.ops
        _assert_values(row.values(), x)
        if unit_dim is not None:
            active = (x != 0).sum(0).double()
            np.testing.assert_array_equal(row.unit_counts.double().numpy(), active.numpy())
