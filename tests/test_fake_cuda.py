"""The torch path on CUDA tensors, without a GPU: fake CUDA tensors (``tests/fakecuda.py``).

Inside ``FakeTensorMode`` a tensor made with ``device="cuda"`` is a CUDA tensor without data: the torch
path takes its CUDA branch (not the CPU one that ``FEW_LAUNCHES_ON_CPU`` stands in for in
``tests/test_launches.py``), every op dispatches as on a GPU, and reading a value raises. A recording
dispatch mode inside the fake mode sees every op streamwatch dispatches, with its inputs' dtypes and
devices: each ``cat``/``stack`` of the step boundary must see exactly one dtype (CUDA's ``cat`` copies
inputs of mixed dtypes one by one) and leave its result on the GPU.

What cannot run here, and why (``tests/fakecuda.py``): ``backward()`` (autograd asks the CUDA runtime for
a stream), so there are no output-gradient rows and gradients are assigned by hand; and the record's copy
into a pinned slot on a side stream (streams and events need the CUDA runtime), so the whole-step test
seals the step's buffer itself, without a slot pool, and ``watch.step()`` then ships an empty record.
``tests/test_cuda.py`` runs both on a GPU.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fakecuda
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import streamwatch as sw
from streamwatch import _buffer, _torchpath
from streamwatch._schema import DEVICE_NAMES
from streamwatch._torchpath import Packings, device_values, summarize, summarize_packed

CUDA = torch.device("cuda", 0)


@dataclass
class Join:
    """One ``cat`` or ``stack`` call: its inputs' dtypes and devices, its result's."""

    op: str
    dtypes: set[torch.dtype]
    devices: set[torch.device]
    dtype: torch.dtype
    device: torch.device


@dataclass
class Seen:
    """What a :class:`_Recorder` saw: every op by name, every join, every read back to the host."""

    ops: collections.Counter[str] = field(default_factory=collections.Counter)
    joins: list[Join] = field(default_factory=list)
    host_reads: list[str] = field(default_factory=list)  # a value read, or a device tensor copied to the host


class _Recorder(TorchDispatchMode):
    """Records every aten op dispatched on this thread (inside the fake mode: it sees fake tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = Seen()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        self.seen.ops[name] += 1
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        if name in ("cat", "stack"):
            tensors = args[0]
            join = Join(name, {t.dtype for t in tensors}, {t.device for t in tensors}, out.dtype, out.device)
            self.seen.joins.append(join)
        elif name == "_local_scalar_dense" or (
            name in ("_to_copy", "copy_")
            and out.device.type == "cpu"
            and any(t.device.type == "cuda" for t in inputs)
        ):
            self.seen.host_reads.append(name)
        return out


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory: pytest.TempPathFactory) -> None:
    reason = fakecuda.enable(Path(tmp_path_factory.mktemp("fakecuda")))
    if reason is not None:
        pytest.skip(reason)


@contextmanager
def on_fake_cuda() -> Iterator[Seen]:
    """Fake tensors, a recorder inside them, and this thread's scratch released before and after (a
    fake CUDA buffer left in it would be taken by a real CUDA test later in this process)."""
    _torchpath.release_scratch()
    try:
        with FakeTensorMode(), _Recorder() as recorder:
            yield recorder.seen
    finally:
        _torchpath.release_scratch()


def _one_dtype_on_the_gpu(joins: list[Join]) -> None:
    assert joins, "no cat or stack seen"
    for join in joins:
        assert len(join.dtypes) == 1, join
        assert join.devices == {CUDA}, join
        assert join.device == CUDA, join


def _tensors() -> list[torch.Tensor]:
    """Activations and gradients as a mixed-precision step has them: float32, bf16, float16."""
    return [
        torch.randn(64, 33, device="cuda"),
        torch.randn(16, 64, device="cuda", dtype=torch.bfloat16),
        torch.randn(5, 7, device="cuda", dtype=torch.float16),
        torch.randn(300, device="cuda", dtype=torch.bfloat16),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_fake_cuda_tensor_takes_the_four_cuda_ops(fake_cuda: None, dtype: torch.dtype) -> None:
    """The CUDA branch itself, with ``FEW_LAUNCHES_ON_CPU`` left off: ``pow``, ``sign``, ``mm``,
    ``aminmax`` (one ``vector_norm`` more for per-unit activity), the row on the GPU."""
    assert not _torchpath.FEW_LAUNCHES_ON_CPU
    with on_fake_cuda() as seen:
        x = torch.randn(32, 16, device="cuda", dtype=dtype)
        summarize(x, unit_dim=1)  # (its scratch views made once: shapes repeat every step)
        seen.ops.clear()
        row = summarize(x, unit_dim=1)
    assert seen.ops == {"pow": 1, "sign": 1, "mm": 1, "aminmax": 1, "linalg_vector_norm": 1}
    assert row.gram.device == CUDA
    assert row.gram.dtype == torch.float32
    assert row.low.dtype == row.high.dtype == torch.float32  # (read from the float32 copy: one dtype)
    assert not seen.host_reads


@pytest.mark.parametrize("counted", [False, True], ids=["flag", "counted"])
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_the_step_boundary_stacks_one_dtype_per_cat_on_fake_cuda(
    fake_cuda: None, autocast: bool, counted: bool
) -> None:
    """Rows of float32, bf16 and float16 tensors (under bf16 autocast too), per-unit rows, and two packs
    of float32 and bf16 parameters (one read in reverse, as gradients come): ``device_values`` and
    ``_buffer._flat`` (with bf16 and float32 step scalars and the per-unit counts) join them with one
    dtype per ``cat``/``stack``, into one float32 tensor on the GPU, reading nothing back."""
    with on_fake_cuda() as seen, fakecuda.cuda_autocast(torch.bfloat16) if autocast else nullcontext():
        rows = [summarize(x, count_nonfinite=counted) for x in _tensors()]
        units = [summarize(x.relu(), unit_dim=1, count_nonfinite=counted) for x in _tensors()[:3]]
        params = [
            torch.randn(64, 32, device="cuda"),
            torch.randn(64, device="cuda", dtype=torch.bfloat16),
            torch.randn(10, 64, device="cuda"),
        ]
        pack, _ = Packings().get(params)
        pack.fill(params)
        weights = summarize_packed(pack)
        grads = summarize_packed(pack, reverse=True)
        everything = [*rows, *units, *weights, *grads]
        loss = torch.randn(16, 10, device="cuda", dtype=torch.bfloat16).mean()
        scalars = [loss, torch.tensor(0.5, device="cuda")]
        vectors = [row.unit_counts for row in units if row.unit_counts is not None]
        seen.joins.clear()
        values = device_values(everything, counted)
        _one_dtype_on_the_gpu(seen.joins)
        seen.joins.clear()
        flat = _buffer._flat(everything, counted, scalars, vectors, CUDA)
        _one_dtype_on_the_gpu(seen.joins)
    width = len(DEVICE_NAMES) - (not counted)  # (nonfinite last, only when counted)
    assert (values.device, values.dtype, values.shape) == (CUDA, torch.float32, (len(everything) * width,))
    assert flat.device == CUDA
    assert flat.dtype == torch.float32
    assert flat.numel() == values.numel() + len(scalars) + sum(v.numel() for v in vectors)
    assert not seen.host_reads


@contextmanager
def _tf32_products() -> Iterator[None]:
    matmul = torch.backends.cuda.matmul
    was = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision = was


@pytest.mark.parametrize("why", ["a-float64-tensor", "tf32-products"])
def test_float64_sums_make_the_whole_step_float64_with_one_dtype_per_cat(fake_cuda: None, why: str) -> None:
    """A float64 tensor's sums are float64 (and every sum where TF32 products are allowed): the other
    rows are converted before the one ``cat``, never joined as they are."""
    with on_fake_cuda() as seen, _tf32_products() if why == "tf32-products" else nullcontext():
        tensors = _tensors()
        if why == "a-float64-tensor":
            tensors.append(torch.randn(3, 4, device="cuda", dtype=torch.float64))
        rows = [summarize(x) for x in tensors]
        seen.joins.clear()
        values = device_values(rows, False)
        flat = _buffer._flat(rows, False, [torch.tensor(1.0, device="cuda")], [], CUDA)
    _one_dtype_on_the_gpu(seen.joins)
    assert values.dtype == flat.dtype == torch.float64
    assert {row.gram.dtype for row in rows} == (
        {torch.float32, torch.float64} if why == "a-float64-tensor" else {torch.float64}
    )


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, 64, device="cuda"),  # (made on the device: module.to() fails under the fake mode)
        nn.ReLU(),
        nn.Linear(64, 64, device="cuda"),
        nn.ReLU(),
        nn.Linear(64, 10, device="cuda"),
    )


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_a_sampled_step_on_fake_cuda_stacks_one_dtype_and_reads_nothing_back(
    fake_cuda: None, monkeypatch: pytest.MonkeyPatch, autocast: bool
) -> None:
    """A model with fake CUDA parameters observed with ``every=1`` and every kind at cadence 1: the
    forward pass (under bf16 autocast too), gradients assigned by hand and the optimizer's step take
    every tap of a sampled step on the GPU path — activations, weights, gradients and updates, nothing
    skipped, no hook failing (``close()`` would raise it), no value read back and no tensor copied to
    the host; the step's buffer, sealed here, joins its rows with one dtype per ``cat``/``stack`` into
    one tensor on the GPU."""
    monkeypatch.setenv("STREAMWATCH_KERNEL", "torch")
    cadence = dict.fromkeys(("activation", "output_grad", "param", "param_grad", "update"), 1)
    with on_fake_cuda() as seen:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with sw.observe(model, opt, every=1, cadence=cadence, sentinel=()) as watch:  # (close() raises
            state = watch._boundary.state  # what a hook raised) the step's buffer, sealed below
            x = torch.randn(16, 32, device="cuda")
            for step in range(3):
                with fakecuda.cuda_autocast(torch.bfloat16) if autocast else nullcontext():
                    out = model(x)
                assert out.dtype == (torch.bfloat16 if autocast else torch.float32)
                for p in model.parameters():
                    p.grad = torch.randn_like(p)
                opt.step()
                assert not seen.host_reads, seen.host_reads  # (the taps: nothing read, nothing copied back)
                kinds = collections.Counter(key.kind for key in state.buffer.keys)
                seen.joins.clear()
                pending = state.buffer.seal(
                    step=step,
                    rank=0,
                    step_scalars={"loss": out.float().mean(), "out": out.mean()},  # float32, bf16 (autocast)
                    host_scalars={},
                    nonfinite_counted=state.count_nonfinite,
                )
                _one_dtype_on_the_gpu(seen.joins)
                assert pending is not None
                assert pending.data.dtype == torch.float32
                assert seen.host_reads == ["_to_copy"]  # (the sealed tensor's .cpu(): no slot pool here)
                seen.host_reads.clear()
                watch.step()  # (the buffer is sealed: an empty record)
            assert kinds == {"activation": 5, "param": 6, "param_grad": 6, "update": 6}
            assert state.skipped == {}
