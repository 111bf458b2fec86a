"""observe(): hooks in and out, garbage collection, flushing on close, failures, argument validation."""

from __future__ import annotations

import gc
import inspect
import re
import threading
import types
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import streamwatch as sw
import streamwatch._channel
import streamwatch._clip_tap
import streamwatch._taps
import streamwatch._tapstate
import streamwatch._triton
from streamwatch._observe import STATS
from streamwatch._taps import KINDS
from tests.threads import JOIN_S, spawn, wait_until
from tests.training import Train


class Boom(Exception):
    pass


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def _hooks(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Every hook streamwatch could install, counted per place."""
    counts = {}
    for name, module in model.named_modules():
        counts[f"module {name!r} forward"] = len(module._forward_hooks)
        counts[f"module {name!r} forward_pre"] = len(module._forward_pre_hooks)
        counts[f"module {name!r} call slot"] = int("_compiled_call_impl" in module.__dict__)
        counts[f"module {name!r} backward"] = len(module._backward_hooks)
    for name, param in model.named_parameters():
        counts[f"param {name} post_accumulate_grad"] = len(param._post_accumulate_grad_hooks or {})
        counts[f"param {name} tensor"] = len(param._backward_hooks or {})
    counts["optimizer step_pre"] = len(opt._optimizer_step_pre_hooks)
    counts["optimizer step_post"] = len(opt._optimizer_step_post_hooks)
    counts["global forward"] = len(nn.modules.module._global_forward_hooks)
    counts["global forward_pre"] = len(nn.modules.module._global_forward_pre_hooks)
    return counts


# -- hooks and references ------------------------------------------------------------------------------


def test_close_removes_every_hook_and_later_training_records_nothing(train: Train) -> None:
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _hooks(model, opt)
    assert not any(before.values())
    recs = sw.sinks.collect()
    watch = sw.observe(model, opt, cadence={"param": 1, "update": 1}, sinks=[recs], every=1)
    during = _hooks(model, opt)
    assert during["optimizer step_pre"] == during["optimizer step_post"] == 1
    assert during["module '0' forward"] == 1
    # gradients are read at the optimizer's pre-step; the one hook here, in the first step only, moves the
    # rows compiled code made out of the graph after each backward (TapState.drain)
    assert during["param 0.weight post_accumulate_grad"] == 1
    assert during["param 0.bias post_accumulate_grad"] == 0
    train(model, opt, watch, 2)
    watch.close()
    assert watch.closed
    assert _hooks(model, opt) == before
    received = len(recs.items)
    assert received == 2
    train(model, opt, None, 2)  # training after close works, and nothing is summarised any more
    assert len(recs.items) == received
    assert watch.statistics().steps == 2
    assert watch.statistics().hook_errors == 0
    with pytest.raises(
        RuntimeError, match=r"^this Watch is closed; create a new one with streamwatch\.observe\(\)$"
    ):
        watch.step()
    watch.close()  # idempotent


class _Table(nn.Module):
    """Returns its own Parameter (a learned positional table): a module output that is a leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 4))

    def forward(self) -> torch.Tensor:
        return self.weight


class _WithTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table, self.fc = _Table(), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x + self.table())


def test_gradient_hooks_on_leaf_tensors_last_one_step_and_go_at_close() -> None:
    # a module output that is a Parameter, and an input made with requires_grad: their gradient hooks sit
    # on tensors that outlive the step; they piled up (one more per sampled step, each summarising the
    # same gradient again) and stayed after close(), still writing into the closed watch
    torch.manual_seed(0)
    model = _WithTable()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4, requires_grad=True)  # (as adversarial training makes its input)
    recs = sw.sinks.collect()
    grads = []
    taps = ("input", "input_grad", "activation", "output_grad")
    with sw.observe(model, opt, every=1, taps=taps, sinks=[recs]) as watch:
        for _ in range(4):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            x.grad = None
            loss.backward()
            assert model.table.weight.grad is not None
            assert x.grad is not None
            grads.append((model.table.weight.grad.clone(), x.grad.clone()))
            opt.step()
            watch.step(loss=loss)
            assert len(model.table.weight._backward_hooks or {}) == 0  # gone at the step boundary
    assert len(model.table.weight._backward_hooks or {}) == len(x._backward_hooks or {}) == 0
    assert len(recs.items) == 4
    for record, (table_grad, x_grad) in zip(recs.items, grads, strict=True):
        for key, grad in (
            (("train", "table", "output_grad", ""), table_grad),
            (("train", "fc", "input_grad", "0"), x_grad),
        ):
            i = record.keys.index(sw.SeriesKey(*key))
            assert record.column("count")[i] == grad.numel()  # once per step, not once per step so far
            assert record.column("sumsq")[i] == pytest.approx(float(grad.double().pow(2).sum()), rel=1e-6)


@pytest.mark.parametrize("every", [1, None], ids=["every=1", "governor"])
def test_an_evaluation_after_the_last_step_is_sent_at_close(train: Train, every: int | None) -> None:
    """A final validation pass, after the last ``watch.step()``, is a record of its own at close (the
    next step's number, evaluation rows only, no step time); an unfinished training step is not."""
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recs = sw.sinks.collect()
    x = torch.randn(5, 4)
    watch = sw.observe(model, opt, sinks=[recs], every=every)
    train(model, opt, watch, 2)
    model.eval()
    with torch.no_grad():
        first = model[0]
        assert isinstance(first, nn.Linear)
        expected = nn.functional.linear(x, first.weight, first.bias)  # not through the hooked module
        model(x)
    watch.close()
    last = recs.items[-1]
    assert last.step == 2
    assert {key.phase for key in last.keys} == {"eval"}
    assert "step_seconds" not in last.scalars
    assert "loss" not in last.scalars
    (row,) = [i for i, key in enumerate(last.keys) if key.layer == "0" and key.kind == "activation"]
    assert last.column("count")[row] == expected.numel()
    torch.testing.assert_close(last.stat("mean")[row], expected.double().mean().item())
    torch.testing.assert_close(last.stat("l2")[row], expected.double().norm().item())
    # a training forward that never reached watch.step(): not a completed step, nothing is sent
    model.train()
    recs2 = sw.sinks.collect()
    with sw.observe(model, opt, sinks=[recs2], every=1) as watch2:
        model(x).sum().backward()
    assert recs2.items == []
    assert watch2.statistics().steps == 0


def test_with_block_exception_propagates_and_hooks_are_removed(train: Train) -> None:
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _hooks(model, opt)
    recs = sw.sinks.collect()
    watch = sw.observe(model, opt, sinks=[recs], every=1)

    def loop() -> None:
        with watch:
            train(model, opt, watch, 2)
            model(torch.randn(8, 4)).sum().backward()  # an unfinished step: never sent
            raise Boom("mid-training")

    with pytest.raises(Boom, match=r"^mid-training$"):
        loop()
    assert watch.closed
    assert _hooks(model, opt) == before
    assert [r.step for r in recs.items] == [0, 1]
    assert recs.closed
    with sw.observe(model, opt, every=1):  # the model is free to observe again
        pass


def test_with_block_exception_keeps_pipeline_failures_as_a_note(train: Train) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    go = threading.Event()

    def explode(record: sw.StepRecord) -> None:
        assert go.wait(JOIN_S)  # fail after step() returned: no warning races the loop's own error
        raise Boom("sink failed")

    watch = sw.observe(model, opt, every=1)
    watch.pipe(sw.source() | sw.sinks.callback(explode))

    def loop() -> None:
        with watch:
            train(model, opt, watch, 1)
            go.set()
            wait_until(lambda: watch.statistics().pipeline_failures == 1, "the pipeline failed")
            raise KeyError("the loop's own error")

    with pytest.raises(KeyError) as info:
        loop()
    notes = getattr(info.value, "__notes__", [])
    assert len(notes) == 1
    assert notes[0].startswith("streamwatch: 1 pipeline failed on the worker thread")
    assert "Boom: sink failed" in notes[0]


def test_closed_watch_lets_the_model_be_garbage_collected(train: Train) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = sw.observe(model, opt, cadence={"param": 1, "update": 1}, every=1)
    train(model, opt, watch, 2)
    watch.close()
    ref = weakref.ref(model)
    del model, opt
    gc.collect()
    assert ref() is None
    assert watch.closed  # the Watch itself is still alive
    assert watch.statistics().steps == 2
    assert any(s.name == "streamwatch_tensor" for s in watch.snapshot())


def test_closed_watch_lets_the_parameters_be_garbage_collected(train: Train) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = sw.observe(model, opt, every=1)
    train(model, opt, watch, 1)
    watch.close()
    ref = weakref.ref(model[0].weight)
    del model, opt
    gc.collect()
    assert watch.closed
    assert ref() is None


def test_observing_an_observed_model_raises_until_the_first_watch_closes(train: Train) -> None:
    model = _model()
    line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
    first = sw.observe(model, every=1)
    with pytest.raises(
        RuntimeError,
        match=rf"^Sequential is already observed by another Watch \(made at {re.escape(__file__)}:{line}\); "
        r"close that one first: watch\.close\(\), or streamwatch\.unobserve\(model\) where you no longer "
        r"hold it \(a notebook cell run again\)\. One Watch per model: use watch\.pipe\(\) to add pipelines "
        r"to it$",
    ):
        sw.observe(model, every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"^Sequential is already observed"):
        sw.observe(model, opt, every=5)
    assert len(model[0]._forward_hooks) == 1  # the refused Watch installed nothing
    first.close()
    recs = sw.sinks.collect()
    with sw.observe(model, opt, sinks=[recs], every=1) as second:
        train(model, opt, second, 1)
    assert len(recs.items) == 1


def test_unobserve_closes_the_watch_of_a_model_whose_watch_was_not_kept(train: Train) -> None:
    """A notebook cell run twice: the first ``observe()``'s Watch is alive (a cell's output, a callback
    still holds it) but the loop no longer holds it, so the second is refused; ``streamwatch.unobserve
    (model)`` closes it (its last records sent, every hook out), and the model can be observed again. On a
    model no Watch observes it does nothing and says so."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recs = sw.sinks.collect()
    elsewhere = [sw.observe(model, opt, sinks=[recs], every=1)]  # (held, but not by the loop below)
    train(model, opt, elsewhere[0], 2)
    with pytest.raises(RuntimeError, match=r"streamwatch\.unobserve\(model\)"):
        sw.observe(model, opt, every=1)
    assert sw.unobserve(model) is True
    assert recs.closed
    assert [r.step for r in recs.items] == [0, 1]
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert "_compiled_call_impl" not in model.__dict__
    assert sw.unobserve(model) is False
    with sw.observe(model, opt, every=1) as again:
        train(model, opt, again, 1)
    assert sw.unobserve(model) is False  # (closed by its with-block)
    with pytest.raises(TypeError, match=r"`model` to be a torch\.nn\.Module, got str"):
        sw.unobserve("model")  # type: ignore[arg-type]
    assert elsewhere[0].closed


def test_a_watch_dropped_without_close_pauses_and_is_closed_by_the_next_observe(train: Train) -> None:
    """A Watch nothing holds (a function that returned without ``close()``, a notebook's output
    overwritten) is collected: its hooks, still on the model, do nothing from then on (before they were
    paused, with ``every=1`` they summarised every step into a buffer nobody drained: 6 rows and 1.7 kB a
    step, and a step 10x slower), and the next ``observe()`` closes it as ``close()`` would: its steps
    reach its sinks, its hooks and its worker thread are gone, and the model can be observed again."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = set(threading.enumerate())
    recs = sw.sinks.collect()
    watch = sw.observe(model, opt, sinks=[recs], every=1)
    (worker,) = set(threading.enumerate()) - before
    train(model, opt, watch, 3)
    del watch
    gc.collect()
    entry = model.__dict__["_compiled_call_impl"]  # (the dropped taps, reached through the root's slot)
    cells = [c.cell_contents for c in entry.__closure__]
    (start,) = [c for c in cells if inspect.ismethod(c) and c.__name__ == "_root_forward_start"]
    dropped = start.__self__
    assert dropped.state.paused
    train(model, opt, None, 2)  # (the loop goes on: nothing is summarised)
    assert len(dropped.state.buffer) == 0
    assert dropped.state.hook_errors == 0
    assert worker.is_alive()  # (closed on the user's thread, not in the collection)
    assert not recs.closed
    again_recs = sw.sinks.collect()
    with sw.observe(model, opt, sinks=[again_recs], every=1) as again:
        assert recs.closed
        assert [r.step for r in recs.items] == [0, 1, 2]
        worker.join(JOIN_S)
        assert not worker.is_alive()
        assert all(len(m._forward_hooks) == 1 for m in model.modules())  # (the new Watch's only)
        train(model, opt, again, 1)
    assert [r.step for r in again_recs.items] == [0]
    assert torch.nn.utils.clip_grad_norm_ is streamwatch._clip_tap.ORIGINAL


def test_unobserve_closes_a_dropped_watch_at_once(train: Train) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recs = sw.sinks.collect()
    watch = sw.observe(model, opt, sinks=[recs], every=1)
    train(model, opt, watch, 2)
    del watch
    gc.collect()
    assert not recs.closed  # (dropped: paused, waiting to be closed)
    assert sw.unobserve(model) is True
    assert recs.closed
    assert [r.step for r in recs.items] == [0, 1]
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert sw.unobserve(model) is False


def test_a_module_two_observed_models_share_is_refused_to_the_second_watch() -> None:
    # before: both were accepted, and the second watch's rows for the shared layer held both models'
    # passes (count 128 where its own pass gives 64)
    shared = nn.Linear(4, 4)
    a, b = nn.Sequential(shared, nn.Linear(4, 2)), nn.Sequential(shared, nn.Linear(4, 3))
    first = sw.observe(a, every=1)
    with pytest.raises(
        RuntimeError,
        match=r"^Layer '0' \(Linear\) of Sequential is already observed by another Watch, as layer '0' of a "
        r"Sequential: .*leave the shared module out of this one with select=$",
    ):
        sw.observe(b, every=1)
    assert len(b[1]._forward_hooks) == 0  # the refused Watch installed nothing
    recs = sw.sinks.collect()
    with sw.observe(b, select="1", sinks=[recs], every=1) as second:  # the shared layer left out: fine
        b(torch.randn(16, 4))
        a(torch.randn(16, 4))
        second.step()
    assert {k.layer for k in recs.items[0].keys} == {"1"}
    first.close()
    with sw.observe(b, sinks=[recs], every=1) as third:  # once the first watch closed: its to take
        b(torch.randn(16, 4))
        third.step()
    (row,) = [i for i, k in enumerate(recs.items[-1].keys) if k.layer == "0" and k.kind == "activation"]
    assert recs.items[-1].column("count")[row] == 16 * 4  # its own pass only


def test_a_watch_on_a_submodule_of_an_observed_model_is_refused() -> None:
    model = _model()
    with sw.observe(model, every=1), pytest.raises(RuntimeError, match=r"already observed by another Watch"):
        sw.observe(model[0], every=1)
    sw.observe(model[0], every=1).close()  # released by the first one's close()


def test_another_models_optimizer_is_warned_about_naming_the_mismatch() -> None:
    # before: accepted silently, its update and weight taps then watched nothing of the model
    model, other = _model(), nn.Linear(3, 3)
    with pytest.warns(
        UserWarning, match=r"`optimizer` \(SGD, 2 parameters\) steps none of `model`'s 4 parameters"
    ) as caught:
        watch = sw.observe(model, torch.optim.SGD(other.parameters(), lr=0.1), every=1)
    watch.close()
    assert [w.filename for w in caught] == [__file__]  # at the observe() call
    with pytest.warns(UserWarning, match=r"without an optimizer no update is recorded") as caught:
        sw.observe(model, taps=("activation", "update"), every=1).close()
    assert [w.filename for w in caught] == [__file__]
    both = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an optimizer that steps the model among others: quietly
        sw.observe(model, both, every=1).close()


# -- flushing and backpressure ------------------------------------------------------------------------


def _watch_with_a_held_pipeline(overflow: Any, capacity: int) -> tuple[Any, ...]:
    """A watch whose user pipeline blocks on ``gate`` (``entered`` is set once it holds a record)."""
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gate, entered = threading.Event(), threading.Event()
    slow: list[int] = []

    def held(record: sw.StepRecord) -> None:
        entered.set()
        assert gate.wait(JOIN_S)
        slow.append(record.step)

    recs = sw.sinks.collect()
    watch = sw.observe(model, opt, overflow=overflow, capacity=capacity, sinks=[recs], every=1)
    watch.pipe(sw.source() | sw.sinks.callback(held))
    return model, opt, watch, recs, gate, entered, slow


def test_close_flushes_every_completed_step_through_a_slow_pipeline_with_block(train: Train) -> None:
    model, opt, watch, recs, gate, entered, slow = _watch_with_a_held_pipeline("block", 2)

    def run() -> None:
        train(model, opt, watch, 6)
        model(torch.randn(8, 4)).sum().backward()  # a step that is never completed with step()

    trainer = spawn(run)
    assert entered.wait(JOIN_S)  # the worker holds step 0 in the slow pipeline
    # steps 1 and 2 fill the channel, so step 3 must wait for room: nothing is dropped
    wait_until(lambda: watch.statistics().queue_len == 2, "the channel is full")
    assert trainer.is_alive()
    assert slow == []
    gate.set()
    trainer.finish()
    closer = spawn(watch.close)
    closer.finish()
    assert slow == [0, 1, 2, 3, 4, 5]
    assert [r.step for r in recs.items] == [0, 1, 2, 3, 4, 5]
    stats = watch.statistics()
    assert (stats.steps, stats.sampled, stats.records_received) == (6, 6, 6)
    assert stats.dropped_oldest == stats.dropped_newest == 0
    assert stats.queue_high_water == 2


def test_drop_oldest_keeps_training_going_and_counts_every_drop(train: Train) -> None:
    model, opt, watch, recs, gate, entered, slow = _watch_with_a_held_pipeline("drop_oldest", 1)
    train(model, opt, watch, 1)
    assert entered.wait(JOIN_S)  # step 0 is in the worker's hands, out of the channel
    train(model, opt, watch, 5)  # never blocks: steps 1..4 are each evicted by the next one
    stats = watch.statistics()
    assert (stats.steps, stats.sampled, stats.dropped_oldest, stats.dropped_newest) == (6, 6, 4, 0)
    assert stats.queue_len == 1
    gate.set()
    watch.close()
    assert slow == [0, 5]
    assert [r.step for r in recs.items] == [0, 5]
    stats = watch.statistics()
    assert stats.records_received + stats.dropped_oldest == stats.sampled
    assert stats.sampled + stats.dropped_newest == stats.steps


def test_flush_waits_for_every_sent_record_when_newer_ones_were_dropped(
    monkeypatch: pytest.MonkeyPatch, train: Train
) -> None:
    # drop_newest: a dropped record was never sent, so it must not count as handled (flush() returned
    # True while the sent records still waited in the channel, the worker idle between two of them)
    gate = threading.Event()
    receive = streamwatch._channel.Receiver.recv_many

    def held_receive(self: Any, limit: int, timeout: float | None = None) -> Any:
        assert gate.wait(JOIN_S)  # the worker takes nothing until the gate opens
        return receive(self, limit, timeout)

    monkeypatch.setattr(streamwatch._channel.Receiver, "recv_many", held_receive)
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recs = sw.sinks.collect()
    watch = sw.observe(model, opt, overflow="drop_newest", capacity=2, sinks=[recs], every=1)
    train(model, opt, watch, 6)  # steps 0 and 1 queued, 2..5 dropped
    stats = watch.statistics()
    assert (stats.sampled, stats.dropped_newest, stats.records_received) == (2, 4, 0)
    assert not watch.flush(timeout=0.2)  # two sent, none handled
    assert watch.snapshot() == []
    gate.set()
    assert watch.flush(timeout=JOIN_S)
    assert [r.step for r in recs.items] == [0, 1]
    assert watch.statistics().records_received == 2
    watch.close()


# -- failures -----------------------------------------------------------------------------------------


def test_failing_pipeline_warns_at_the_next_step_and_raises_at_close(train: Train) -> None:
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    original = Boom("pipeline exploded")
    go = threading.Event()

    def explode(record: sw.StepRecord) -> None:
        if record.step == 1:
            assert go.wait(JOIN_S)  # fail only once step 1's step() has returned: no race with it
            raise original

    recs = sw.sinks.collect()
    watch = sw.observe(model, opt, sinks=[recs], every=1)
    healthy = sw.sinks.collect()
    watch.pipe(sw.source() | sw.sinks.callback(explode))
    watch.pipe(sw.source() | healthy)
    train(model, opt, watch, 2)
    go.set()
    wait_until(lambda: watch.statistics().pipeline_failures == 1, "the pipeline failed")
    with pytest.warns(RuntimeWarning, match=r"(?s)^streamwatch: 1 pipeline failed .*Boom: pipeline exploded"):
        train(model, opt, watch, 1)  # the next step() surfaces it; training goes on
    train(model, opt, watch, 2)  # warned once only (filterwarnings=error would fail a second warning)
    with pytest.raises(sw.PipelineError, match=r"^1 pipeline failed on the worker thread") as info:
        watch.close()
    assert info.value.__cause__ is original
    assert [exc for _, exc in info.value.errors] == [original]
    assert watch.statistics().pipeline_failures == 1
    assert watch.statistics().hook_errors == 0
    assert [r.step for r in recs.items] == [0, 1, 2, 3, 4]  # the other pipelines kept running
    assert [r.step for r in healthy.items] == [0, 1, 2, 3, 4]
    watch.close()  # reported once: a second close is quiet


class Poisoned(torch.Tensor):
    """A tensor that breaks summarisation (the torch path's ops that read it raise: ``pow`` or a copy into
    the scratch rows, ``aminmax``) but works for everything training does."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.aminmax, torch.pow, torch.Tensor.copy_):
            raise Boom("cannot summarise this tensor")
        return super().__torch_function__(func, types, args, kwargs or {})


class Side(nn.Module):
    """Returns (x, a poisoned side tensor) — the side output is not used by the loss."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x.detach().as_subclass(Poisoned)


def test_hook_error_never_reaches_training_and_is_raised_at_close() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), Side())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recs = sw.sinks.collect()
    watch = sw.observe(model, opt, sinks=[recs], every=1)
    for step in range(3):
        out, _ = model(torch.randn(8, 4))
        loss = out.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        # each new error is warned about once, at the step() that follows it
        with pytest.warns(
            RuntimeWarning, match=r"(?s)^streamwatch: .*<tap>: Boom: cannot summarise this tensor"
        ):
            watch.step(loss=loss)
        assert watch.statistics().hook_errors == step + 1  # one per forward of Side
    with pytest.raises(sw.PipelineError, match=r"cannot summarise this tensor") as info:
        watch.close()
    assert isinstance(info.value.__cause__, Boom)
    assert len(info.value.errors) == 3
    # everything else was summarised: the failing leaf lost its row, nothing more
    keys = set(recs.items[-1].keys)
    assert sw.SeriesKey("train", "1", "activation", "0") in keys
    assert sw.SeriesKey("train", "1", "activation", "1") not in keys
    assert sw.SeriesKey("train", "0", "param_grad", "weight") in keys


def test_hook_error_messages_blame_the_hook_not_a_pipeline() -> None:
    model = nn.Sequential(nn.Linear(4, 3), Side())
    watch = sw.observe(model, every=1)
    model(torch.randn(8, 4))[0].sum().backward()
    line = "  <tap>: Boom: cannot summarise this tensor"
    head = re.escape("1 hook call failed on the training thread (caught; training continued):\n" + line)
    with pytest.warns(RuntimeWarning, match=f"^streamwatch: {head} — training continues; these are raised"):
        watch.step()
    with pytest.raises(sw.PipelineError, match=f"^{head}$"):
        watch.close()
    assert watch.statistics().pipeline_failures == 0
    assert watch.statistics().hook_errors == 1


def test_failing_summaries_leave_training_bit_for_bit_unchanged(
    monkeypatch: pytest.MonkeyPatch, train: Train
) -> None:
    def trained(observe: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if not observe:
            train(model, opt, None, 3)
            return [p.detach().clone() for p in model.parameters()]
        watch = sw.observe(model, opt, cadence={"param": 1, "update": 1}, every=1)
        with pytest.warns(RuntimeWarning, match="(?s)^streamwatch: .*Boom: summaries are broken"):
            train(model, opt, watch, 3)
        assert watch.statistics().hook_errors > 0
        with pytest.raises(sw.PipelineError, match="summaries are broken") as info:
            watch.close()
        assert isinstance(info.value.__cause__, Boom)
        return [p.detach().clone() for p in model.parameters()]

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise Boom("summaries are broken")

    reference = trained(observe=False)
    monkeypatch.setattr(streamwatch._tapstate, "summarize", broken)  # the torch path
    monkeypatch.setattr(streamwatch._kernel.FusedKernel, "run", broken)  # the fused CPU kernel
    observed = trained(observe=True)
    for a, b in zip(reference, observed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# -- argument validation ------------------------------------------------------------------------------

BAD = {
    "every_zero": ({"every": 0}, ValueError, "Expected `every` to be a positive integer, got 0"),
    "every_bool": ({"every": True}, ValueError, "Expected `every` to be a positive integer, got True"),
    "taps_unknown": (
        {"taps": {"bogus"}},
        ValueError,
        f"Expected `taps` to be a collection of {KINDS}, got {{'bogus'}}",
    ),
    "taps_str": (
        {"taps": "activation"},
        ValueError,
        f"Expected `taps` to be a collection of {KINDS}, got 'activation'",
    ),
    "stats_unknown": (
        {"stats": {"x"}},
        ValueError,
        f"Expected `stats` to be a collection of {STATS}, got {{'x'}}",
    ),
    "cadence_zero": (
        {"cadence": {"param": 0}},
        ValueError,
        "Expected `cadence` to map tap kinds to positive integers, got 'param': 0",
    ),
    "cadence_unknown_kind": (
        {"cadence": {"weights": 2}},
        ValueError,
        "Expected `cadence` to map tap kinds to positive integers, got 'weights': 2",
    ),
    "overflow_unknown": (
        {"overflow": "x"},
        ValueError,
        f"Expected `overflow` to be one of {sw.OVERFLOW_POLICIES}, got 'x'",
    ),
    "select_int": (
        {"select": 42},
        TypeError,
        "Expected `select` to be None, a streamwatch.Select, a name glob, a module class or a tuple of "
        "classes, got 42",
    ),
    "optimizer_not_optimizer": (
        {"optimizer": "sgd"},
        TypeError,
        "Expected `optimizer` to be a torch.optim.Optimizer, a list of them or None, got a str: 'sgd'",
    ),
    "sinks_not_sink": ({"sinks": [print]}, TypeError, "Expected every entry of `sinks` to be a Sink, got "),
    "start_step_negative": (
        {"start_step": -1},
        ValueError,
        "Expected `start_step` to be an integer >= 0 (the steps already done when resuming), got -1",
    ),
    "start_step_not_int": (
        {"start_step": 2.0},
        ValueError,
        "Expected `start_step` to be an integer >= 0 (the steps already done when resuming), got 2.0",
    ),
}


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD.values(), ids=BAD)
def test_bad_arguments_are_refused_with_a_message_naming_them(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    model = _model()
    pattern = "^" + re.escape(message) + ("" if message.endswith("got ") else "$")
    with pytest.raises(error, match=pattern):
        sw.observe(model, **kwargs)
    assert not any(len(m._forward_hooks) for m in model.modules())
    with sw.observe(model, every=1):  # a refused observe() leaves the model free
        pass


def test_a_model_that_is_not_a_module_is_refused() -> None:
    with pytest.raises(TypeError, match=r"^Expected `model` to be a torch\.nn\.Module, got int$"):
        sw.observe(42, every=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^Expected `model` to be a torch\.nn\.Module, got function$"):
        sw.observe(lambda x: x, every=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("capacity", [0, -1], ids=["zero", "negative"])
def test_a_capacity_below_one_is_refused(capacity: int) -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"`capacity`"):
        sw.observe(model, capacity=capacity, every=1)
    with sw.observe(model, every=1):
        pass


def _collected_steps(start: int, every: int, steps: int, set_later: int | None = None) -> list[int]:
    """The steps of the records with layer rows of ``steps`` training steps numbered from ``start``."""
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = sw.sinks.collect()
    with sw.observe(model, opt, every=every, start_step=start, sinks=[records]) as watch:
        if set_later is not None:
            watch.start_step = set_later
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            watch.step(loss=1.0)
        assert watch.statistics().steps == steps  # this Watch's calls, whatever they are numbered
    return [r.step for r in records.items if r.keys]


def test_start_step_numbers_the_records_and_every_samples_by_the_steps_index() -> None:
    """A resumed run (``start_step=10``) goes on from step 10; ``every=3`` samples the steps a run
    from 0 would have sampled (12 and 15, multiples of 3), so resumed ranks and runs stay aligned."""
    assert _collected_steps(0, 3, 6) == [0, 3]
    assert _collected_steps(10, 3, 6) == [12, 15]
    assert _collected_steps(10, 1, 3) == [10, 11, 12]


def test_start_step_set_before_the_first_step_and_refused_after() -> None:
    """The Lightning callback knows the step to resume from only after ``observe()``: the property
    can be set until the first step, and refuses afterwards (records already carry the old numbers)."""
    assert _collected_steps(0, 3, 6, set_later=10) == [12, 15]  # as observe(start_step=10)
    model = _model()
    with sw.observe(model, every=1) as watch:
        with pytest.raises(ValueError, match="`start_step`"):
            watch.start_step = -3
        watch.start_step = 4
        model(torch.randn(2, 4))
        watch.step()
        with pytest.raises(
            RuntimeError, match=r"only before the first watch.step\(\); this Watch has ended 1"
        ):
            watch.start_step = 9
        assert watch.start_step == 4
        assert repr(watch).count("step=5") == 1
    with pytest.raises(RuntimeError, match="closed"):
        watch.start_step = 1


def test_the_options_defaults_are_observes() -> None:
    """Trainer callbacks check their observe() arguments over OBSERVE_DEFAULTS: it must say what
    observe()'s signature says, name for name and value for value."""
    import inspect

    from streamwatch._options import OBSERVE_DEFAULTS

    signature = inspect.signature(sw.observe).parameters
    keyword = {n: p.default for n, p in signature.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keyword == dict(OBSERVE_DEFAULTS)


def test_a_model_that_moves_after_observe_is_summarised_for_where_it_is(
    train: Train, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``observe()`` before ``model.cuda()`` (``accelerator.prepare()``, ``fabric.setup()``): the next step
    boundary sees the model's parameters on another device and loads that device's summaries, once (the
    Triton kernels for CUDA; ``tests/test_cuda.py`` moves a real model). Without a GPU the move is
    played by the boundary's view of where the first parameter is; Triton's loader is counted."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loads: list[str] = []
    monkeypatch.setattr(streamwatch._triton, "load", lambda: loads.append("triton"))
    monkeypatch.setattr(streamwatch._triton, "status", lambda: "torch: no CUDA device (counted)")
    recs = sw.sinks.collect()
    with sw.observe(model, opt, sinks=[recs], every=1) as watch:
        assert watch.statistics().kernel.startswith("fused")
        assert loads == []
        train(model, opt, watch, 1)
        taps = watch._taps
        first = next(model.parameters())
        assert taps._where is first
        taps._where = types.SimpleNamespace(device=torch.device("cuda"))  # (where the model is now)
        train(model, opt, watch, 2)
        assert loads == ["triton"]  # once
        assert watch.statistics().kernel == "torch: no CUDA device (counted)"
        assert watch._state.kernel is not None  # (CPU tensors keep the fused kernel: a model split)
        taps._where = first  # back on the CPU
        train(model, opt, watch, 1)
        assert watch.statistics().kernel.startswith("fused")
    assert loads == ["triton"]
    assert [r.step for r in recs.items] == [0, 1, 2, 3]
    assert watch.statistics().hook_errors == 0
