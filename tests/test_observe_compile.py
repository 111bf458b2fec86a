"""``torch.compile`` of an observed model: streamwatch's hooks must add no graph breaks, and the compiled
model must still train and be recorded.

``observe()`` is attached before ``torch.compile`` (as documented). Graph breaks are counted with
``torch._dynamo.explain`` for one forward in training mode, observed vs the same model unobserved.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import streamwatch as sw
from streamwatch import SeriesKey
from streamwatch._gradprobe import CALLS


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(32, 8, generator=generator), torch.randint(0, 4, (32,), generator=generator)


def accumulate(
    loss: Callable[[int], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    watch: sw.Watch | None,
    steps: int,
    micro_batches: int,
) -> None:
    """``steps`` optimizer steps of ``micro_batches`` backward passes of ``loss(step)`` each (gradient
    accumulation), ``watch.step()`` after each."""
    for step in range(steps):
        for _ in range(micro_batches):
            loss(step).backward()
        optimizer.step()
        optimizer.zero_grad()
        if watch is not None:
            watch.step()


def streamwatch_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    """The messages of the warnings streamwatch gave."""
    return [str(w.message) for w in caught if "streamwatch" in str(w.message)]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def graph_breaks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> tuple[int, list[str]]:
    """Graph breaks in one traced call of ``fn(x)``, with their reasons."""
    torch._dynamo.reset()
    counters.clear()
    explained = torch._dynamo.explain(fn)(x)
    reasons = [str(reason.reason) for reason in explained.break_reasons]
    reasons += [reason.splitlines()[0] + ": " + reason.splitlines()[1] for reason in counters["graph_break"]]
    return explained.graph_break_count, reasons


@pytest.mark.parametrize(
    "sampled",
    [
        pytest.param(True, id="sampled"),
        pytest.param(False, id="not_sampled"),
    ],
)
def test_observe_adds_no_graph_breaks(sampled: bool) -> None:
    x, _ = batch()
    plain = make_model()
    expected, _ = graph_breaks(lambda x: plain(x), x)
    assert expected == 0

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with sw.observe(model, optimizer, every=2) as watch:
        if not sampled:
            watch.step()  # step 1 of every=2: nothing samples, hooks only check a flag
        breaks, reasons = graph_breaks(lambda x: model(x), x)
    assert (breaks, reasons) == (expected, [])


def test_forward_side_taps_add_no_graph_breaks() -> None:
    """Every tap but output_grad traces into one graph, summaries included, on a sampled step."""
    x, _ = batch()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    records = sw.sinks.collect()
    taps = ("input", "activation", "param", "param_grad", "update")
    with sw.observe(model, optimizer, taps=taps, sinks=[records], every=1) as watch:
        breaks, reasons = graph_breaks(lambda x: model(x), x)
        watch.step()
    assert (breaks, reasons) == (0, [])
    (record,) = records.items
    # (no optimizer step ran: no gradient, no update; the weights are read at the step's end)
    assert {(key.layer, key.kind) for key in record.keys} == {
        (layer, kind) for layer in ("0", "1", "2") for kind in ("input", "activation")
    } | {("0", "param"), ("2", "param")}
    with torch.no_grad():
        hidden = model[0](x)
    index = record.keys.index(SeriesKey("train", "0", "activation", ""))
    assert record.column("sum")[index] == pytest.approx(float(hidden.sum()), rel=1e-4)


# Importing inductor imports torch.utils.mkldnn, which uses the deprecated torch.jit.script_method.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_observed_model_trains_and_is_recorded() -> None:
    x, y = batch()
    reference = make_model()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    records = sw.sinks.collect()
    losses = []
    with sw.observe(model, optimizer, cadence={"param": 1, "update": 1}, sinks=[records], every=1) as watch:
        compiled = torch.compile(model)  # after observe(), as documented
        for _ in range(5):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(compiled(x), y)
            loss.backward()
            optimizer.step()
            watch.step(loss=loss)
            losses.append(float(loss.detach()))
    assert watch.statistics().hook_errors == 0
    assert losses[-1] < losses[0]
    assert [record.step for record in records.items] == list(range(5))
    first = records.items[0]
    for layer in ("0", "1", "2"):
        assert SeriesKey("train", layer, "activation", "") in first.keys
        # (a tensor hook inside a compiled forward would break the graph: the probe takes its place)
        assert SeriesKey("train", layer, "output_grad", "") in first.keys
    assert "compiled_grad_hook" not in watch.statistics().skipped
    for layer in ("0", "2"):
        for kind in ("param", "param_grad", "update"):
            assert SeriesKey("train", layer, kind, "weight") in first.keys
    assert first.scalars["loss"] == pytest.approx(losses[0])

    # The rows summarise the same tensors eager mode computes.
    hidden = reference[0](x)
    nn.functional.cross_entropy(reference[2](torch.relu(hidden)), y).backward()
    index = first.keys.index(SeriesKey("train", "0", "activation", ""))
    sums = first.column("sum")[index], first.column("sumsq")[index]
    hidden = hidden.detach()
    assert sums == pytest.approx((float(hidden.sum()), float(hidden.pow(2).sum())), rel=1e-4)
    index = first.keys.index(SeriesKey("train", "0", "param_grad", "weight"))
    assert first.column("sumsq")[index] == pytest.approx(
        float(reference[0].weight.grad.pow(2).sum()), rel=1e-4
    )


@pytest.mark.parametrize("micro_batches", [2, 12])
def test_a_compiled_forward_is_compiled_once_not_at_every_step(micro_batches: int) -> None:
    """The taps' bookkeeping inside the graph (rows, output-gradient probes, a skipped input-gradient
    tap, counted) reads no Python value that changes from step to step or from micro-batch to
    micro-batch: dynamo compiles the forward once,
    where a counter read there made it compile again at every step, the step's rows (their number) at
    every micro-batch, until its limit of 8 variants, after which the model ran eagerly, and the noted
    skip once more for the later micro-batches of a step. A graph's rows and skips wait in
    ``TapState.inbox`` and ``skipped_in_graph``, moved out after each backward (``TapState.drain``)."""
    x, y = batch()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counters.clear()
    records = sw.sinks.collect()
    taps = ("activation", "output_grad", "input_grad", "param_grad")  # (input_grad: skipped in a graph)
    with sw.observe(model, optimizer, every=1, taps=taps, sinks=[records]) as watch:
        compiled = torch.compile(model, backend="eager")
        accumulate(lambda _: nn.functional.cross_entropy(compiled(x), y), optimizer, watch, 6, micro_batches)
        assert counters["frames"]["ok"] == 1
        assert watch.statistics().skipped["compiled_grad_hook"] == 6  # once per step
        assert watch.statistics().hook_errors == 0
    # every micro-batch's activations and output gradients are in its step's row (the same batch here)
    for record in records.items:
        for kind in ("activation", "output_grad"):
            index = record.keys.index(SeriesKey("train", "0", kind, ""))
            assert record.column("count")[index] == micro_batches * 32 * 16


@pytest.mark.parametrize("every", [1, 2])
def test_a_model_first_compiled_at_a_later_step_is_compiled_once(every: int) -> None:
    """Three steps eager, then compiled, 12 micro-batches a step: the drain hook is in on every step
    whose forward hooks record, so the rows of the step in which compiled code first runs leave the graph
    after each backward too. Before, it was in for step 0 only: that step's micro-batches were each a
    new variant, and from the 8th the forward ran uncompiled for good."""
    x, y = batch()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counters.clear()
    records = sw.sinks.collect()
    micro_batches = 12
    with (
        warnings.catch_warnings(record=True) as caught,
        sw.observe(model, optimizer, every=every, sinks=[records]) as watch,
    ):
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend="eager")

        def loss(step: int) -> torch.Tensor:  # (three steps eager, then compiled)
            return nn.functional.cross_entropy((model if step < 3 else compiled)(x), y)

        accumulate(loss, optimizer, watch, 7, micro_batches)
        # (every=2: compiled first on an unsampled step, without hooks; then with them, sampled and not)
        assert counters["frames"]["ok"] == (1 if every == 1 else 3)
    assert streamwatch_warnings(caught) == []
    assert [r.step for r in records.items] == list(range(0, 7, every))
    for record in records.items:
        index = record.keys.index(SeriesKey("train", "0", "activation", ""))
        assert record.column("count")[index] == micro_batches * 32 * 16


class _Holder(nn.Module):
    """A LightningModule's shape: the model is a submodule, and the step calls it, never the holder."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()


def test_compiled_code_that_calls_a_submodule_not_the_observed_root_is_compiled_once() -> None:
    """Lightning compiles ``training_step``, which calls ``self.net(x)``: the observed root module (the
    LightningModule) is never called, so its hook cannot tell that compiled code runs. The taps in the
    graph tell it: the hooks stay in and the rows leave the graph after each backward from the second
    step on too, so 12 micro-batches a step compile the step once, and nothing is warned."""
    x, y = batch()
    holder = _Holder()
    optimizer = torch.optim.SGD(holder.parameters(), lr=0.1)
    counters.clear()
    records = sw.sinks.collect()
    micro_batches = 12

    @torch.compile(backend="eager")
    def training_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(holder.net(x), y)

    with (
        warnings.catch_warnings(record=True) as caught,
        sw.observe(holder, optimizer, every=1, sinks=[records]) as watch,
    ):
        warnings.simplefilter("always")
        accumulate(lambda _: training_step(x, y), optimizer, watch, 4, micro_batches)
        assert counters["frames"]["ok"] == 1
        assert "compiled_grad_hook" not in watch.statistics().skipped
    assert streamwatch_warnings(caught) == []
    assert len(records.items) == 4
    for record in records.items:
        for kind in ("activation", "output_grad"):
            index = record.keys.index(SeriesKey("train", "net.0", kind, ""))
            assert record.column("count")[index] == micro_batches * 32 * 16


class _Checkpointed(nn.Module):
    """Two residual blocks under activation checkpointing (torch.utils.checkpoint), then a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)) for _ in range(2)
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x)


# (dynamo reads the .grad of a checkpointed block's input as it takes it in: a warning that pytest's
# settings turn into an error inside dynamo; a training script sees nothing)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
@pytest.mark.parametrize("whole", [False, True], ids=["dynamo default", "side effects skipped in backward"])
def test_activation_checkpointing_under_compile_records_each_forward_once(whole: bool) -> None:
    """A compiled model with checkpointed blocks: dynamo refuses Python side effects inside a checkpoint
    region by default (eager checkpointing would replay them in the recomputation), so streamwatch's
    hooks break the graph at each checkpointed block, which runs as its own compiled frames with every
    tap. With ``skip_fwd_side_effects_in_bwd_under_checkpoint`` the model compiles whole, as it does
    unobserved. Either way each micro-batch's forward is summarised once, never again in the
    recomputation."""
    import torch._dynamo.config as config

    x, y = batch()
    plain = _Checkpointed()
    with config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=whole):
        assert graph_breaks(lambda x: plain(x), x)[0] == 0  # (unobserved: one graph)
        model = _Checkpointed()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        records = sw.sinks.collect()
        torch._dynamo.reset()
        counters.clear()
        with sw.observe(model, optimizer, every=1, sinks=[records]) as watch:
            compiled = torch.compile(model, backend="eager")
            accumulate(lambda _: nn.functional.cross_entropy(compiled(x), y), optimizer, watch, 3, 2)
        breaks = sum(counters["graph_break"].values())
    assert breaks == 0 if whole else breaks > 0
    assert watch.statistics().hook_errors == 0
    assert len(records.items) == 3
    for record in records.items:  # two micro-batches of 32, each summarised once
        for layer, units in (("blocks.0.0", 8), ("blocks.1.2", 8), ("head", 4)):
            for kind in ("activation", "output_grad"):
                index = record.keys.index(SeriesKey("train", layer, kind, ""))
                assert record.column("count")[index] == 2 * 32 * units, (layer, kind)
    # step 0's values against the same layer of a fresh copy (the weights before the first step)
    with torch.no_grad():
        hidden = _Checkpointed().blocks[0][0](x)
    index = records.items[0].keys.index(SeriesKey("train", "blocks.0.0", "activation", ""))
    assert records.items[0].column("sum")[index] == pytest.approx(2 * float(hidden.sum()), rel=1e-4)


class _InPlace(nn.Module):
    """A Linear whose output an in-place ReLU changes (as torchvision's ResNets do): a probe's output may
    not be a view."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 16)
        self.act = nn.ReLU(inplace=True)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.fc(x)))


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_output_gradients_of_a_compiled_model_are_recorded_as_eager_ones_are(backend: str) -> None:
    """Under compile an output's gradient is summarised by the probe (``_gradprobe``) inside the graph,
    forward and backward, with no graph break: the same rows as an eager model's, with 2 micro-batches a
    step, and the weights trained as an unobserved compiled model trains them."""
    x, y = batch()

    Run = tuple[list[sw.StepRecord], list[torch.Tensor], sw.Watch | None]

    def train(observed: bool, compiled: bool) -> Run:
        model = _InPlace()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        records = sw.sinks.collect()
        watch = sw.observe(model, optimizer, every=1, sinks=[records]) if observed else None
        run = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
        accumulate(lambda _: nn.functional.cross_entropy(run(x), y), optimizer, watch, 3, 2)
        if watch is not None:
            watch.close()
        return records.items, [p.detach().clone() for p in model.parameters()], watch

    torch._dynamo.reset()
    counters.clear()
    compiled, weights, watch = train(observed=True, compiled=True)
    assert sum(counters["graph_break"].values()) == 0  # (fullgraph=True would have raised too)
    assert watch is not None
    assert "compiled_grad_hook" not in watch.statistics().skipped
    assert watch.statistics().hook_errors == 0
    torch._dynamo.reset()
    _, unobserved, _ = train(observed=False, compiled=True)
    assert all(torch.equal(a, b) for a, b in zip(weights, unobserved, strict=True))
    eager, _, _ = train(observed=True, compiled=False)
    for got, want in zip(compiled, eager, strict=True):
        for layer in ("fc", "act", "out"):
            key = SeriesKey("train", layer, "output_grad", "")
            i, j = got.keys.index(key), want.keys.index(key)
            for name in ("count", "zeros", "sumsq", "min", "max", "sumabs", "sumfourth"):
                assert got.column(name)[i] == pytest.approx(want.column(name)[j], rel=1e-5), name
            # (sums of signed values cancel: compared on the scale of their absolute counterparts)
            top = max(abs(want.column("min")[j]), abs(want.column("max")[j]))
            scale = {"sum": want.column("sumabs")[j], "sumcube": top * want.column("sumsq")[j]}
            for name, size in scale.items():
                assert got.column(name)[i] == pytest.approx(want.column(name)[j], abs=1e-5 * size), name
    # against a plain reference: the first step's gradient w.r.t. fc's output, both micro-batches
    model = _InPlace()
    hidden = model.fc(x)
    hidden.retain_grad()
    nn.functional.cross_entropy(model.out(torch.relu(hidden)), y).backward()
    grad = hidden.grad.double()
    index = compiled[0].keys.index(SeriesKey("train", "fc", "output_grad", ""))
    assert compiled[0].column("count")[index] == 2 * grad.numel()
    assert compiled[0].column("sum")[index] == pytest.approx(2 * float(grad.sum()), rel=1e-6)
    assert compiled[0].column("sumsq")[index] == pytest.approx(2 * float(grad.square().sum()), rel=1e-6)
    assert compiled[0].column("max")[index] == pytest.approx(float(grad.max()), rel=1e-6)


class _Shared(nn.Module):
    """One layer applied to two inputs of different sizes in each forward (as an encoder-decoder shares
    its embedding between sequences of different lengths)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.shared(x).relu()) + self.head(self.shared(x[:8]).relu()).mean(0)


def _shared_records(compiled: bool, model: nn.Module | None = None) -> tuple[list[sw.StepRecord], int]:
    """Two steps of two micro-batches of ``model`` (``_Shared()``), compiled or not: the records and the
    output gradients skipped."""
    x, y = batch()
    model = _Shared() if model is None else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    records = sw.sinks.collect()
    torch._dynamo.reset()
    counters.clear()
    with sw.observe(model, optimizer, every=1, sinks=[records]) as watch:
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        accumulate(lambda _: nn.functional.cross_entropy(run(x), y), optimizer, watch, 2, 2)
    if compiled:
        assert counters["stats"]["unique_graphs"] == 1  # (the probe's call count is 0 when a pass begins)
    return list(records.items), watch.statistics().skipped.get("compiled_grad_hook", 0)


def test_a_layer_called_twice_in_a_pass_has_both_output_gradients_recorded_under_compile() -> None:
    """Autograd adds every gradient a leaf gets in one backward before its hook runs, so one sink would
    carry the two calls' summaries as one sum (right for sums, not for min and max): each call has a sink
    of its own, and the shared layer's row under compile is eager mode's, both calls merged, its min and
    max against a plain reference."""
    compiled, skipped = _shared_records(compiled=True)
    eager, _ = _shared_records(compiled=False)
    assert skipped == 0
    key = SeriesKey("train", "shared", "output_grad", "")
    for got, want in zip(compiled, eager, strict=True):
        i, j = got.keys.index(key), want.keys.index(key)
        assert got.column("count")[i] == want.column("count")[j] == 2 * (32 + 8) * 16
        for column in ("sum", "sumsq", "min", "max"):
            assert got.column(column)[i] == pytest.approx(want.column(column)[j], rel=1e-6, abs=1e-12)
    # both outputs' gradients, against a plain reference (step 0, both micro-batches the same)
    x, y = batch()
    model = _Shared()
    first, second = model.shared(x), model.shared(x[:8])
    first.retain_grad()
    second.retain_grad()
    out = model.head(first.relu()) + model.head(second.relu()).mean(0)
    nn.functional.cross_entropy(out, y).backward()
    grad = torch.cat([first.grad.flatten(), second.grad.flatten()]).double()
    i = compiled[0].keys.index(key)
    assert compiled[0].column("min")[i] == pytest.approx(float(grad.min()), rel=1e-6)
    assert compiled[0].column("max")[i] == pytest.approx(float(grad.max()), rel=1e-6)
    assert compiled[0].column("sumsq")[i] == pytest.approx(2 * float(grad.square().sum()), rel=1e-6)


class _Loop(nn.Module):
    """One cell applied ``CALLS + 2`` times in each forward (a recurrence unrolled in Python)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(CALLS + 2):
            x = torch.tanh(self.shared(x))
        return self.head(x)


def test_calls_past_the_probes_sinks_are_skipped_and_counted_once_per_step() -> None:
    """A cell called ``CALLS + 2`` times a pass: the first ``CALLS`` outputs' gradients are recorded (the
    row holds their elements), the last two are skipped, counted once per step (two steps). Nothing is
    warned (the cell's 10 activation rows a pass were once read as 10 evaluation passes)."""
    compiled, skipped = _shared_records(compiled=True, model=_Loop())
    eager, _ = _shared_records(compiled=False, model=_Loop())
    key = SeriesKey("train", "shared", "output_grad", "")
    assert skipped == 2
    for got, want in zip(compiled, eager, strict=True):
        assert got.column("count")[got.keys.index(key)] == 2 * CALLS * 32 * 8
        assert want.column("count")[want.keys.index(key)] == 2 * (CALLS + 2) * 32 * 8


def _saved_for_backward(observed: bool) -> int:
    """Bytes a sampled step's Inductor-compiled forward keeps for the backward (``saved_tensors_hooks``
    see what the compiled function saves)."""
    torch._dynamo.reset()
    model = _InPlace()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch()
    watch = sw.observe(model, optimizer, every=1) if observed else None
    compiled = torch.compile(model)
    saved: list[int] = []
    for _ in range(2):
        saved.clear()

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if watch is not None:
            watch.step()
    if watch is not None:
        watch.close()
    return sum(saved)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_sampled_compiled_step_keeps_no_more_for_the_backward_than_unobserved() -> None:
    """Under Inductor the taps and the output-gradient probes (a copy of each output) keep nothing more
    for the backward than the unobserved model does: the copies are recomputed, not saved (activation
    memory, measured on the CPU by what the compiled function saves)."""
    assert _saved_for_backward(observed=True) == _saved_for_backward(observed=False) > 0


def test_a_device_without_float64_takes_no_probes_and_eager_output_gradients_stay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the probes' float64 sinks cannot be made (Apple's MPS has no float64), ``observe()`` still
    attaches: eager code records output gradients as ever, and compiled code skips them, counted."""
    from streamwatch import _taps

    def refuse(*args: object) -> None:
        raise TypeError(
            "Cannot convert a MPS Tensor to float64 dtype as the MPS framework doesn't support it"
        )

    monkeypatch.setattr(_taps, "GradProbe", refuse)
    x, y = batch()
    for compiled in (False, True):
        torch._dynamo.reset()
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        records = sw.sinks.collect()
        with sw.observe(model, optimizer, every=1, sinks=[records]) as watch:
            run = torch.compile(model, backend="eager") if compiled else model
            nn.functional.cross_entropy(run(x), y).backward()
            optimizer.step()
            watch.step()
        (record,) = records.items
        assert (SeriesKey("train", "0", "output_grad", "") in record.keys) is not compiled
        assert watch.statistics().skipped.get("compiled_grad_hook", 0) == int(compiled)


def _compiled_optimizer_run(observed: bool) -> tuple[dict[str, int], list[sw.StepRecord], list[torch.Tensor]]:
    x, y = batch()
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    records = sw.sinks.collect()
    torch._dynamo.reset()
    counters.clear()
    watch = sw.observe(model, optimizer, every=1, sinks=[records]) if observed else None
    step = torch.compile(optimizer.step, backend="eager")
    for _ in range(6):
        nn.functional.cross_entropy(model(x), y).backward()
        step()
        optimizer.zero_grad()
        if watch is not None:
            watch.step()
    if watch is not None:
        watch.close()
        assert watch.statistics().hook_errors == 0
    return dict(counters["stats"]), list(records.items), [p.detach().clone() for p in model.parameters()]


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_compiled_optimizer_step_is_traced_as_unobserved() -> None:
    """``torch.compile(optimizer.step)`` (PyTorch's recipe for a faster optimizer): streamwatch's step
    hooks run as they are, outside the graph (``guarded(..., eager=True)``), so dynamo compiles the same
    one graph of the same ops as unobserved, where tracing them compiled 7 graphs of 10 times the ops,
    guarded on the step's Python state. Weights, gradients and updates are recorded, and the weights
    train as unobserved."""
    stats, records, weights = _compiled_optimizer_run(observed=True)
    plain, _, unobserved = _compiled_optimizer_run(observed=False)
    assert stats == plain  # (unique_graphs, calls_captured)
    assert all(torch.equal(a, b) for a, b in zip(weights, unobserved, strict=True))
    assert [r.step for r in records] == list(range(6))
    assert {k.kind for k in records[0].keys} == {"activation", "output_grad", "param", "param_grad", "update"}
    # step 0's weight and update against an eager AdamW step of the same model (the compiled step's
    # traced ops round differently: within 1e-4)
    model = make_model()
    index = records[0].keys.index(SeriesKey("train", "0", "param", "weight"))
    x, y = batch()
    reference = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = model[0].weight.detach().clone()
    nn.functional.cross_entropy(model(x), y).backward()
    reference.step()
    update = records[0].keys.index(SeriesKey("train", "0", "update", "weight"))
    delta = (model[0].weight.detach() - before).double()
    assert records[0].column("sumsq")[update] == pytest.approx(float(delta.square().sum()), rel=1e-4)
    assert records[0].column("sum")[index] == pytest.approx(
        float(model[0].weight.detach().double().sum()), rel=1e-4
    )


def test_two_forwards_before_one_backward_record_both() -> None:
    """A siamese pair: the compiled model runs on two batches before one backward. Each module's probe
    takes each forward's output in a sink of its own, and dynamo compiles one more variant for the
    second forward (the probe's call count is part of the guard), not one per step."""
    torch._dynamo.reset()
    counters.clear()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x1, _ = batch()
    x2 = torch.randn(32, 8, generator=torch.Generator().manual_seed(2))
    records = sw.sinks.collect()
    with sw.observe(model, optimizer, every=1, sinks=[records]) as watch:
        compiled = torch.compile(model, backend="aot_eager")
        for _ in range(4):
            (compiled(x1) - compiled(x2)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            watch.step()
        assert counters["stats"]["unique_graphs"] == 2
        assert "compiled_grad_hook" not in watch.statistics().skipped
    for record in records.items:
        counts = {k.kind: record.column("count")[i] for i, k in enumerate(record.keys) if k.layer == "0"}
        assert counts["activation"] == counts["output_grad"] == 2 * 32 * 16  # (both forwards')


class _Twin(nn.Sequential):
    """Not the observed class: its compiled graphs never stand in for the observed model's."""


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("other", ["compiled after observe", "compiled before observe"])
def test_another_compiled_instance_of_the_class_does_not_run_the_observed_model_unseen(other: str) -> None:
    """Dynamo by default does not check that a module's empty hook dictionaries stay empty, so a graph it
    compiled for another ``nn.Sequential`` (a reference or teacher model) would run the observed one
    without streamwatch's hooks: no activation, silently. While a Watch is open the check is on, and a
    graph compiled before ``observe()`` is caught: each such step is counted and warned about once."""
    x, y = batch()
    import torch._dynamo.config as config

    assert config.skip_nnmodule_hook_guards  # (torch's default)
    twin = torch.compile(make_model(), backend="aot_eager")  # the same class as the observed model
    if other == "compiled before observe":
        twin(x)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    records = sw.sinks.collect()
    with (
        warnings.catch_warnings(record=True) as caught,
        sw.observe(model, optimizer, every=1, sinks=[records]) as watch,
    ):
        warnings.simplefilter("always")
        assert not config.skip_nnmodule_hook_guards
        compiled = torch.compile(model, backend="aot_eager")
        for step in range(3):
            if step == 2 and other == "compiled before observe":
                torch._dynamo.reset()  # what the warning says to do
            nn.functional.cross_entropy(compiled(x), y).backward()
            twin(x)
            optimizer.step()
            optimizer.zero_grad()
            watch.step()
        skipped = watch.statistics().skipped.get("unseen_forward", 0)
    assert config.skip_nnmodule_hook_guards  # (back as it was)
    seen = [any(key.kind == "activation" for key in record.keys) for record in records.items]
    said = [w for w in caught if "no streamwatch hook saw" in str(w.message)]
    if other == "compiled after observe":
        assert seen == [True, True, True]
        assert (skipped, said) == (0, [])
    else:
        assert seen == [False, False, True]
        assert skipped == 2
        assert len(said) == 1
    # the activations recorded are the observed model's own (trained two steps), not the twin's
    reference = make_model()
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        nn.functional.cross_entropy(reference(x), y).backward()
        reference_opt.step()
        reference_opt.zero_grad()
    record = records.items[-1]
    index = record.keys.index(SeriesKey("train", "0", "activation", ""))
    with torch.no_grad():
        expected, twins = reference[0](x), make_model()[0](x)
    assert record.column("sum")[index] == pytest.approx(float(expected.double().sum()), rel=1e-5)
    assert record.column("sum")[index] != pytest.approx(float(twins.double().sum()), rel=1e-3)


def test_dynamo_checks_module_hooks_while_a_watch_is_open_and_a_users_setting_stays() -> None:
    import torch._dynamo.config as config

    from streamwatch._torchhooks import HookGuards

    first, second = HookGuards(), HookGuards()
    first.hold()
    second.hold()
    assert not config.skip_nnmodule_hook_guards
    first.release()
    assert not config.skip_nnmodule_hook_guards  # (the second Watch still open)
    second.release()
    assert config.skip_nnmodule_hook_guards
    config.skip_nnmodule_hook_guards = False  # the user's own choice: left as it is
    try:
        first.hold()
        first.release()
        assert not config.skip_nnmodule_hook_guards
    finally:
        config.skip_nnmodule_hook_guards = True


@pytest.mark.parametrize("pass_ends", [True, False])
def test_evaluation_batches_of_a_compiled_model_compile_no_variant_each_when_each_pass_ends(
    pass_ends: bool,
) -> None:
    """Evaluation batches have no backward to take their rows out of the graph: ``watch.pass_ends()``
    after each (the trainer callbacks call it) does, and 12 batches compile no more variants than one;
    without it each batch is a variant, and streamwatch warns once that the model runs uncompiled past
    dynamo's limit. Every batch is recorded either way."""
    x, y = batch()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counters.clear()
    records = sw.sinks.collect()
    with (
        warnings.catch_warnings(record=True) as caught,
        sw.observe(model, optimizer, every=1, sinks=[records]) as watch,
    ):
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend="eager")
        for _ in range(3):
            nn.functional.cross_entropy(compiled(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            model.eval()
            with torch.no_grad():
                for _ in range(12):
                    compiled(x)
                    if pass_ends:
                        watch.pass_ends()
            model.train()
            watch.step()
        assert watch.statistics().hook_errors == 0
    said = [w for w in caught if "passes of a compiled model" in str(w.message)]
    if pass_ends:
        assert counters["frames"]["ok"] <= 3
        assert said == []
    else:
        assert counters["frames"]["ok"] >= 4  # (a variant a batch, to dynamo's limit; then uncompiled)
        assert len(said) == 1
    for record in records.items:
        index = record.keys.index(SeriesKey("eval", "0", "activation", ""))
        assert record.column("count")[index] == 12 * 32 * 16
