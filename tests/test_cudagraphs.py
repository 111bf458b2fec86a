"""Values CUDA graphs overwrite before streamwatch reads them (``streamwatch/_cudagraphs.py``).

``torch.compile(mode="reduce-overhead")`` replays CUDA graphs whose outputs share one memory pool: when a
new pass starts, cudagraph trees mark the storage of every output of the last pass still alive, and
reading one raises ("accessing tensor output of CUDAGraphs that has been overwritten by a subsequent
run"). Without a GPU, :class:`Overwritten` stands in for such a tensor: its data pointer raises torch's
message and any op reading it raises too; its shape, dtype and device still read. The tests mark what a
real pass would have marked (the rows of a step's first micro-batch, the losses of earlier steps) and
check that streamwatch drops exactly those, counts them, warns once, records the rest, and never
changes training. ``tests/test_cuda.py`` runs the real thing on a GPU.
"""

from __future__ import annotations

import dataclasses
import math
import types
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import streamwatch as sw
from streamwatch import SeriesKey
from streamwatch._cudagraphs import REASON, GraphMemory, overwritten
from streamwatch._outbox import Outbox, StepLog
from streamwatch._record import STEP_VALUE
from streamwatch._tapstate import TapState
from tests.test_nonfinite import _RingOnCpu

MESSAGE = (
    "Error: accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run. "
    "Stack trace: [test]. To prevent overwriting, clone the tensor outside of torch.compile() "
    "or call torch.compiler.cudagraph_mark_step_begin() before each model invocation."
)
"""What torch 2.13 raises (``format_dealloc_msg``, ``torch/_inductor/cudagraph_trees.py``)."""

_METADATA = {"__get__", "size", "dim", "numel", "stride", "__repr__", "__format__"}


class Overwritten(torch.Tensor):
    """A tensor whose memory a later CUDA graph pass reused: reading it raises as torch does."""

    @staticmethod
    def of(x: torch.Tensor) -> Overwritten:
        return torch.Tensor._make_subclass(Overwritten, x.detach())

    def data_ptr(self) -> int:  # type: ignore[override]
        raise RuntimeError(MESSAGE)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise RuntimeError(MESSAGE)


def test_the_stand_in_raises_where_torch_does() -> None:
    x = Overwritten.of(torch.ones(3))
    assert x.shape == (3,)
    assert x.dtype == torch.float32
    assert x.device.type == "cpu"
    with pytest.raises(RuntimeError, match="overwritten by a subsequent run"):
        torch.cat([x, x])
    assert overwritten(x)
    assert not overwritten(torch.ones(3))
    # a tensor without storage is not "overwritten": only torch's CUDA graph message says so
    with torch._subclasses.fake_tensor.FakeTensorMode():
        assert not overwritten(torch.ones(3))


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(32, 8, generator=generator), torch.randint(0, 4, (32,), generator=generator))
        for _ in range(2)
    ]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_second_pass_reads_no_output_of_the_first() -> None:
    """A repeated key's per-unit counts are added at the step's end, not in the next pass's graph: under
    CUDA graphs that graph would take the first pass's output as an input, and replaying it after the
    first pass's memory was reused raises in the user's forward."""
    graphs: list[torch.fx.GraphModule] = []
    calls: list[list[torch.Tensor]] = []  # what each call of a compiled graph was given

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        graphs.append(gm)

        def run(*args: Any) -> Any:
            calls.append([a for a in args if isinstance(a, torch.Tensor)])
            return gm.forward(*args)

        return run

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    records = sw.sinks.collect()
    with sw.observe(model, optimizer, every=1, sinks=[records]) as watch:
        compiled = torch.compile(model, backend=backend)
        made: set[int] = set()
        for i, (x, y) in enumerate(batches()):
            nn.functional.cross_entropy(compiled(x), y).backward()
            if i == 0:
                buffer = watch._state.buffer
                rows = list(buffer.device_rows.values())
                made = {
                    t.untyped_storage().data_ptr()
                    for r in rows
                    for t in (r.gram, r.unit_counts)
                    if t is not None
                }
        optimizer.step()
        watch.step()
    assert len(graphs) == 1  # (the second pass runs the first's graph)
    assert len(calls) == 2
    assert made
    assert not [t for t in calls[1] if t.untyped_storage().data_ptr() in made]
    (record,) = records.items
    # the two passes' per-unit counts still add up: a unit active in 32 of 64 samples is alive
    index = record.keys.index(SeriesKey("train", "1", "activation", ""))
    with torch.no_grad():
        hidden = [model[1](model[0](x)) for x, _ in batches()]  # (weights before the step: not stepped yet)
    assert record.column("dead")[index] == pytest.approx(
        float(((hidden[0] > 0).sum(0) + (hidden[1] > 0).sum(0) == 0).sum()), abs=0
    )


class _Unobserved(nn.Sequential):
    pass


class Passes:
    """CUDA graphs' memory, on the CPU: the tensors each compiled pass handed over (the rows waiting in
    ``TapState.inbox`` when they are moved into the step) stay readable until the next pass begins
    (:meth:`begin`), which marks every one the step buffer still holds as overwritten. A copy made in
    between is not theirs and stays readable."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.made: dict[int, torch.Tensor] = {}  # (held: an id is not reused while the test runs)
        drain = TapState.drain

        def recording(state: TapState) -> None:
            for _, _, row, _ in state.inbox:
                self.made[id(row.gram)] = row.gram
            drain(state)

        monkeypatch.setattr(TapState, "drain", recording)

    def begin(self, buffer: Any) -> int:
        """A new pass begins: the rows of earlier passes the buffer holds are overwritten; how many."""
        marked = 0
        for index, row in list(buffer.device_rows.items()):
            if id(row.gram) not in self.made:
                continue
            buffer.device_rows[index] = dataclasses.replace(
                row,
                gram=Overwritten.of(row.gram),
                low=Overwritten.of(row.low),
                high=Overwritten.of(row.high),
                unit_counts=None if row.unit_counts is None else Overwritten.of(row.unit_counts),
            )
            first, counts = buffer.unit_counts.get(buffer.keys[index], (None, None))
            if first == index and isinstance(counts, torch.Tensor):
                buffer.unit_counts[buffer.keys[index]] = (first, Overwritten.of(counts))
            marked += 1
        return marked


# Importing inductor imports torch.utils.mkldnn, which uses the deprecated torch.jit.script_method.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_rows_cuda_graphs_overwrote_are_dropped_and_counted_once_then_copied_while_readable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two micro-batches a step: in the first step the second pass overwrites the first one's rows, which
    are dropped (the step's rows are the last pass's), counted and warned about; from then on each pass's
    rows are copied when they move into the step, after its backward, and every pass is recorded."""
    passes = Passes(monkeypatch)
    reference = _Unobserved(*make_model())  # (a class of its own: dynamo shares no graph between them)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    plain = torch.compile(reference, backend="aot_eager")
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    records = sw.sinks.collect()
    steps, marked = 3, []
    with (
        warnings.catch_warnings(record=True) as caught,
        sw.observe(model, optimizer, every=1, sinks=[records]) as watch,
    ):
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend="aot_eager")
        for _ in range(steps):
            for x, y in batches():
                marked.append(passes.begin(watch._state.buffer))
                nn.functional.cross_entropy(compiled(x), y).backward()
                nn.functional.cross_entropy(plain(x), y).backward()
            optimizer.step()
            reference_opt.step()
            optimizer.zero_grad()
            reference_opt.zero_grad()
            watch.step()
        stats = watch.statistics()
    assert stats.hook_errors == 0
    assert stats.failed_steps == 0
    assert [r.step for r in records.items] == list(range(steps))
    assert marked == [0, 3, 0, 0, 0, 0]  # (the first step's first pass: three activations; then copies)
    assert stats.skipped[REASON] == 3
    said = [w for w in caught if "CUDA graphs" in str(w.message)]
    assert len(said) == 1
    assert "mode='max-autotune-no-cudagraphs'" in str(said[0].message)
    # Training is the same as the same compiled model unobserved.
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    # The first step's activation rows are its last pass's, the others' both passes': recomputed from
    # the passes' tensors with the step's weights.
    model_then = make_model()
    opt_then = torch.optim.SGD(model_then.parameters(), lr=0.1)
    for record in records.items:
        recorded = batches()[1:] if record.step == 0 else batches()
        with torch.no_grad():
            per_layer: list[list[torch.Tensor]] = [[], [], []]
            for x, _ in recorded:
                hidden = model_then[0](x)
                per_layer[0].append(hidden)
                per_layer[1].append(model_then[1](hidden))
                per_layer[2].append(model_then[2](per_layer[1][-1]))
        for layer, outs in zip(("0", "1", "2"), per_layer, strict=True):
            out = torch.cat(outs)
            index = record.keys.index(SeriesKey("train", layer, "activation", ""))
            assert record.column("count")[index] == out.numel()
            assert record.column("sum")[index] == pytest.approx(float(out.double().sum()), rel=1e-5, abs=1e-6)
            assert record.column("max")[index] == pytest.approx(float(out.max()), rel=1e-6)
        index = record.keys.index(SeriesKey("train", "1", "activation", ""))
        alive = sum((out > 0).sum(0) for out in per_layer[1])
        assert record.column("dead")[index] == float((alive == 0).sum())
        for x, y in batches():  # (the next record's weights)
            nn.functional.cross_entropy(model_then(x), y).backward()
        opt_then.step()
        opt_then.zero_grad()


def test_the_sentinel_drops_losses_cuda_graphs_overwrote_and_copies_from_then_on() -> None:
    skipped: dict[str, int] = {}
    ring = _RingOnCpu(grad_norm=False, slots=4, batch=4, batch_seconds=math.inf)
    ring.memory = memory = GraphMemory(skipped)
    for step, value in enumerate([1.0, math.nan, 2.0]):  # earlier steps' losses: overwritten
        ring._push(step, Overwritten.of(torch.tensor(value)))
    with pytest.warns(RuntimeWarning, match="losses the sentinel kept"):
        ring._push(3, torch.tensor(math.inf))  # this step's, still readable: a batch of 4 goes out
    assert [steps for _, steps in ring._pending] == [[3]]
    assert ring.complete() == [3]
    assert skipped == {REASON: 3}
    assert memory.copy
    # From now on a device loss the sentinel keeps is a copy, no longer a view of the pass's memory.
    for step, copy in ((4, True), (5, False)):
        memory.copy = copy
        assert ring.check(step, torch.tensor(0.25, device="meta"), ()) == []
        (kept,) = [probe for at, probe in ring._probes if at == step]
        assert kept._is_view() is not copy


def test_values_of_unsampled_steps_cuda_graphs_overwrote_are_dropped_and_counted() -> None:
    """The step log's device values go into the record's copy; overwritten ones are dropped, counted,
    and the other steps keep theirs."""
    skipped: dict[str, int] = {}
    outbox = types.SimpleNamespace(steps=StepLog(), state=types.SimpleNamespace(memory=GraphMemory(skipped)))
    alive = torch.tensor(0.5, device="meta")  # (a device value, never read here)
    outbox.steps.add(7, 0.0, 0.1, Overwritten.of(torch.empty((), device="meta")), 8, [0.1], None)
    outbox.steps.add(
        8, 0.0, 0.1, alive, 8, [0.1], {"grad_norm": Overwritten.of(torch.empty((), device="meta"))}
    )
    device: dict[str, torch.Tensor] = {}
    with pytest.warns(RuntimeWarning, match="2 values of unsampled steps"):
        shipped = Outbox._ship_steps(outbox, device)  # type: ignore[arg-type]
    assert [step for step, _, _ in shipped] == [7, 8]
    assert shipped[0][2]["lr/0"] == 0.1
    assert shipped[1][2]["batch_size"] == 8.0
    assert list(device) == [f"{STEP_VALUE}1/loss"]
    assert skipped == {REASON: 2}
    # a Watch copies a device loss it keeps once CUDA graphs overwrote one
    memory = GraphMemory({})
    assert memory.keep(alive) is alive
    memory.copy = True
    assert memory.keep(alive) is not alive
