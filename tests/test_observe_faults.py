"""observe() and watch.step() under faults: refused arguments, failures part-way, checkpointing, accuracy.

Each test trains a real (tiny) model through the public API and checks every number against a plain
torch reference computed here. The rule under test: monitoring never changes training and never dies
quietly — a bad argument gets a clear error naming it, and whatever fails leaves the watch consistent.
"""

from __future__ import annotations

import fractions
import inspect
import re
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import streamwatch as sw
import streamwatch._buffer
from streamwatch import ops
from streamwatch._taps import KINDS
from tests.training import Train, same_weights


class Boom(Exception):
    pass


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _hooks(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Every hook streamwatch could have left behind, counted per place (zero everywhere: none)."""
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        counts[f"module {name!r} forward"] = len(module._forward_hooks)
        counts[f"module {name!r} forward_pre"] = len(module._forward_pre_hooks)
        counts[f"module {name!r} call slot"] = int("_compiled_call_impl" in module.__dict__)
        counts[f"module {name!r} backward"] = len(module._backward_hooks)
        counts[f"module {name!r} backward_pre"] = len(module._backward_pre_hooks)
    for name, param in model.named_parameters():
        counts[f"param {name} post_accumulate_grad"] = len(param._post_accumulate_grad_hooks or {})
        counts[f"param {name} tensor"] = len(param._backward_hooks or {})
    if opt is not None:
        counts["optimizer step_pre"] = len(opt._optimizer_step_pre_hooks)
        counts["optimizer step_post"] = len(opt._optimizer_step_post_hooks)
    counts["global forward"] = len(nn.modules.module._global_forward_hooks)
    counts["global forward_pre"] = len(nn.modules.module._global_forward_pre_hooks)
    return counts


def _streamwatch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("streamwatch")]


def _layer0(record: sw.StepRecord) -> tuple[float, float]:
    """Count and sum of squares of layer 0's activation row."""
    i = record.keys.index(sw.SeriesKey("train", "0", "activation", ""))
    return float(record.column("count")[i]), float(record.column("sumsq")[i])


# -- finding 1: a step() that raises leaves the watch consistent --------------------------------------

STEP_FAULTS: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "loss_string": ({"loss": "abc"}, TypeError, "`loss`"),
    "loss_not_scalar": ({"loss": torch.ones(3)}, ValueError, "`loss`"),
    "targets_list": ({"targets": [0, 1, 2]}, TypeError, "`targets`"),
    "targets_wrong_batch": ({"targets": torch.zeros(5, dtype=torch.long)}, ValueError, "`targets`"),
    "batch_size_zero": ({"batch_size": 0}, ValueError, "`batch_size`"),
}


@pytest.mark.parametrize(("bad", "error", "names"), STEP_FAULTS.values(), ids=STEP_FAULTS)
def test_a_refused_step_is_dropped_and_never_merged_into_the_next(
    bad: dict[str, Any], error: type[Exception], names: str
) -> None:
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[torch.Tensor] = []
    model[0].register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    recs = sw.sinks.collect()
    with sw.observe(model, opt, sinks=[recs], every=1) as watch:
        for step in range(3):
            x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            args: dict[str, Any] = {"loss": loss, "outputs": logits, "targets": y, "batch_size": 64}
            if step == 1:
                with pytest.raises(error, match=re.escape(names)):
                    watch.step(**(args | bad))
            else:
                watch.step(**args)
        stats = watch.statistics()
    assert (stats.steps, stats.sampled, stats.failed_steps) == (3, 2, 1)
    assert [r.step for r in recs.items] == [0, 2]  # step 1 has no record; its rows went nowhere
    for record, activation in zip(recs.items, (seen[0], seen[2]), strict=True):
        count, sumsq = _layer0(record)
        assert count == activation.numel() == 512
        assert sumsq == pytest.approx(float(activation.double().pow(2).sum()), rel=1e-6)
        assert record.scalars["batch_size"] == 64


def test_an_error_inside_step_drops_the_step_warns_and_is_raised_at_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[torch.Tensor] = []
    model[0].register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    seal = streamwatch._buffer.StepBuffer.seal
    calls = {"n": 0}

    def flaky(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise Boom("sealing failed")
        return seal(self, *args, **kwargs)

    monkeypatch.setattr(streamwatch._buffer.StepBuffer, "seal", flaky)
    recs = sw.sinks.collect()
    watch = sw.observe(model, opt, sinks=[recs], every=1)
    for step in range(3):
        x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 1:  # training goes on; the failure is warned about, never raised into the loop
            with pytest.warns(RuntimeWarning, match=r"(?s)^streamwatch: .*Boom: sealing failed"):
                watch.step(loss=loss)
        else:
            watch.step(loss=loss)
    with pytest.raises(sw.PipelineError, match="sealing failed") as info:
        watch.close()
    assert isinstance(info.value.__cause__, Boom)
    stats = watch.statistics()
    assert (stats.steps, stats.sampled, stats.failed_steps) == (3, 2, 1)
    assert [r.step for r in recs.items] == [0, 2]
    count, sumsq = _layer0(recs.items[1])
    assert count == 512
    assert sumsq == pytest.approx(float(seen[2].double().pow(2).sum()), rel=1e-6)


# -- finding 2: observe() that fails part-way undoes everything ---------------------------------------


class BindFails(sw.metrics.PNorm):
    def bind(self, binding: Any) -> None:
        super().bind(binding)
        raise Boom("bind failed")


def _fail_registering_post_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise Boom("cannot register")

    monkeypatch.setattr(torch.optim.Optimizer, "register_step_post_hook", refuse)


def _fail_registering_grad_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    original = torch.Tensor.register_post_accumulate_grad_hook
    calls = {"n": 0}

    def flaky(self: torch.Tensor, hook: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise Boom("cannot register")
        return original(self, hook)

    monkeypatch.setattr(torch.Tensor, "register_post_accumulate_grad_hook", flaky)


def _fail_starting_the_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Any) -> Any:
        raise Boom("cannot start")

    monkeypatch.setattr(sw.Worker, "start", refuse)


CONSTRUCTION_FAULTS: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], dict[str, Any]]] = {
    "metric_bind": (lambda mp: None, {"metrics": [BindFails(kinds=("activation",))]}),
    "optimizer_hook": (_fail_registering_post_hooks, {}),
    # (gradient hooks are registered only without an optimizer: with one, gradients are read at its pre-step)
    "param_grad_hook": (_fail_registering_grad_hooks, {"optimizer": None}),
    "worker_start": (_fail_starting_the_thread, {}),
}


@pytest.mark.parametrize(("inject", "kwargs"), CONSTRUCTION_FAULTS.values(), ids=CONSTRUCTION_FAULTS)
def test_observe_that_fails_part_way_leaves_no_hook_no_thread_and_the_model_free(
    monkeypatch: pytest.MonkeyPatch, inject: Callable[[pytest.MonkeyPatch], None], kwargs: dict[str, Any]
) -> None:
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before, threads = _hooks(model, opt), _streamwatch_threads()
    assert not any(before.values())
    sink = sw.sinks.collect()
    with monkeypatch.context() as mp:
        inject(mp)
        rest = {k: v for k, v in kwargs.items() if k != "optimizer"}
        with pytest.raises(Boom):
            sw.observe(model, kwargs.get("optimizer", opt), sinks=[sink], **rest)
    assert _hooks(model, opt) == before
    assert _streamwatch_threads() == threads
    assert not sink.closed  # the user's sink was never touched: it can be passed again
    metric = kwargs.get("metrics", [None])[0]
    if metric is not None:
        assert metric.binding is None
    # the model is free, and observing it again works: one record per step, right numbers
    with sw.observe(model, opt, sinks=[sink], every=1) as watch:
        x = torch.randn(16, 4)
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        watch.step()
    assert len(sink.items) == 1
    count, _ = _layer0(sink.items[0])
    assert count == 16 * 8


def _scripted_whole() -> tuple[nn.Module, str]:
    return torch.jit.script(_mlp()), "`model`"


def _scripted_part() -> tuple[nn.Module, str]:
    model = nn.Sequential(nn.Linear(4, 8), torch.jit.script(nn.Sequential(nn.ReLU(), nn.Linear(8, 3))))
    return model, "'1'"


def _traced() -> tuple[nn.Module, str]:
    return torch.jit.trace(_mlp(), torch.randn(2, 4)), "`model`"


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("build", [_scripted_whole, _scripted_part, _traced], ids=["script", "part", "trace"])
def test_a_torchscript_model_is_refused_with_a_clear_error(
    build: Callable[[], tuple[nn.Module, str]],
) -> None:
    model, named = build()
    threads = _streamwatch_threads()
    with pytest.raises(TypeError, match=r"TorchScript") as info:
        sw.observe(model, every=1)
    assert named in str(info.value)
    assert "eager" in str(info.value)
    assert _streamwatch_threads() == threads
    eager = [m for m in model.modules() if not isinstance(m, torch.jit.ScriptModule)]
    assert not any(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in eager)
    with pytest.raises(TypeError, match=r"TorchScript"):  # refused again: never half-registered
        sw.observe(model, every=1)


@pytest.mark.filterwarnings("ignore:Lazy modules are a new feature:UserWarning")
def test_a_lazy_module_before_its_first_forward_is_refused_then_observed_after_it() -> None:
    """``nn.LazyLinear`` makes its parameters at its first forward; before it, torch refuses their hooks
    (the error was torch's, from deep in hook registration). The refusal says what to do, leaves nothing
    attached, and after one forward the same model is observed and its weights recorded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.LazyLinear(2))
    threads = _streamwatch_threads()
    hooks = [(dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in model.modules()]  # (torch's own)
    with pytest.raises(
        ValueError, match=r"lazy module has not made yet \(0\.weight, 0\.bias, 2\.weight, \.\.\.\)"
    ):
        sw.observe(model, every=1)
    assert _streamwatch_threads() == threads
    assert [(dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in model.modules()] == hooks
    model(torch.randn(3, 5))  # the parameters are made
    records = sw.sinks.collect()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sw.observe(model, opt, every=1, cadence={"param": 1}, sinks=[records]) as watch:
        model(torch.randn(3, 5)).pow(2).mean().backward()
        opt.step()
        watch.step()
    weight = records.items[0].keys.index(sw.SeriesKey("train", "0", "param", "weight"))
    assert records.items[0].column("sum")[weight] == pytest.approx(
        float(model[0].weight.detach().double().sum())
    )


def test_per_sample_gradients_with_torch_func_are_skipped_counted_and_the_plain_forward_recorded() -> None:
    """torch's per-sample-gradient recipe (``vmap(grad(...))`` over ``functional_call``, as DP-SGD
    loops use it) calls the observed modules inside the transforms, with functorch's wrapped tensors:
    three hook errors a step, raised again at ``close()``, crashed the loop's end. Now those calls are
    skipped and counted (``skipped["functorch"]``, one per tensor), the loop's own forward is recorded
    against torch, and training is bit for bit as unobserved."""
    from torch.func import functional_call, grad, vmap

    def run(observe: bool) -> tuple[nn.Module, list[sw.StepRecord], list[torch.Tensor], sw.Watch | None]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        records = sw.sinks.collect()
        watch = sw.observe(model, opt, every=1, sinks=[records]) if observe else None

        def loss_of_one(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(functional_call(model, params, (x[None],)), y[None])

        hidden = []
        for k in range(3):
            g = torch.Generator().manual_seed(k)
            x, y = torch.randn(4, 3, generator=g), torch.randint(0, 2, (4,), generator=g)
            params = {n: p.detach() for n, p in model.named_parameters()}
            per_sample = vmap(grad(loss_of_one), in_dims=(None, 0, 0))(params, x, y)
            for n, p in model.named_parameters():
                p.grad = per_sample[n].clamp(-1.0, 1.0).mean(0)  # (clipped per sample, then averaged)
            opt.step()
            with torch.no_grad():
                hidden.append(nn.functional.linear(x, model[0].weight, model[0].bias))  # (its reference)
                loss = nn.functional.cross_entropy(model(x), y)
            if watch is not None:
                watch.step(loss=loss)
        if watch is not None:
            watch.close()  # (raised the hook errors before)
        return model, records.items, hidden, watch

    plain, _, _, _ = run(False)
    model, records, hidden, watch = run(True)
    assert same_weights(plain, model)
    assert watch is not None
    assert watch.statistics().hook_errors == 0
    assert watch.statistics().skipped == {"functorch": 3 * 3}  # 3 modules, one call each in the vmap
    for record, h in zip(records, hidden, strict=True):
        row = record.keys.index(sw.SeriesKey("eval", "0", "activation", ""))
        assert record.column("count")[row] == h.numel()
        assert record.column("sum")[row] == pytest.approx(float(h.double().sum()), rel=1e-6)


# -- finding 3: train accuracy for every common target layout ------------------------------------------

N = 12


def _reference_accuracy(layout: str, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[int, int]:
    """(correct, total) the plain torch way, for each documented layout."""
    o, t = outputs.detach(), targets.detach()
    if layout in ("indices", "indices_class_last"):
        hits = o.argmax(-1) == t
    elif layout == "indices_class_first":
        hits = o.argmax(1) == t
    elif layout in ("one_hot", "probabilities"):
        hits = o.argmax(-1) == t.argmax(-1)
    elif layout in ("binary", "binary_float", "binary_n1", "binary_n1_n1", "multi_label", "mask"):
        hits = (o.reshape(t.shape) > 0) == (t > 0.5)
    elif layout == "predicted":
        hits = o == t
    else:
        raise AssertionError(layout)
    return int(hits.sum()), hits.numel()


# layout -> (model output shape, make targets from a generator)
LAYOUTS: dict[str, tuple[tuple[int, ...], Callable[[torch.Generator], torch.Tensor]]] = {
    "indices": ((N, 4), lambda g: torch.randint(0, 4, (N,), generator=g)),
    "indices_class_last": ((N, 5, 4), lambda g: torch.randint(0, 4, (N, 5), generator=g)),
    "indices_class_first": ((N, 4, 3, 2), lambda g: torch.randint(0, 4, (N, 3, 2), generator=g)),
    "one_hot": ((N, 4), lambda g: nn.functional.one_hot(torch.randint(0, 4, (N,), generator=g), 4).float()),
    "probabilities": ((N, 4), lambda g: torch.rand(N, 4, generator=g).softmax(-1)),
    "binary": ((N,), lambda g: torch.randint(0, 2, (N,), generator=g)),
    "binary_float": ((N,), lambda g: torch.randint(0, 2, (N,), generator=g).float()),
    "binary_n1": ((N, 1), lambda g: torch.randint(0, 2, (N,), generator=g)),
    "binary_n1_n1": ((N, 1), lambda g: torch.randint(0, 2, (N, 1), generator=g).float()),
    "multi_label": ((N, 4), lambda g: torch.randint(0, 2, (N, 4), generator=g).bool()),
    "mask": ((N, 1, 3, 3), lambda g: torch.randint(0, 2, (N, 1, 3, 3), generator=g).float()),
}


@pytest.mark.parametrize("layout", [*LAYOUTS, "predicted"])
def test_train_accuracy_of_every_supported_layout_matches_torch(layout: str) -> None:
    torch.manual_seed(0)
    shape, make_targets = LAYOUTS["indices" if layout == "predicted" else layout]
    features = int(torch.Size(shape[1:]).numel())
    shaped = nn.Unflatten(1, shape[1:]) if len(shape) > 1 else nn.Flatten(0)
    model = nn.Sequential(nn.Linear(6, features), shaped)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    recs = sw.sinks.collect()
    expected = []
    with sw.observe(model, opt, sinks=[recs], every=1) as watch:
        for _ in range(3):
            x, targets = torch.randn(N, 6, generator=g), make_targets(g)
            outputs = model(x)
            loss = outputs.float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if layout == "predicted":  # already-decided labels
                outputs = outputs.argmax(-1)
            expected.append(_reference_accuracy(layout, outputs, targets))
            watch.step(loss=loss, outputs=outputs, targets=targets, batch_size=N)
        assert watch.statistics().failed_steps == 0
    for record, (correct, total) in zip(recs.items, expected, strict=True):
        assert record.scalars["correct"] == correct
        assert record.scalars["total"] == total
        assert record.scalars["accuracy"] == pytest.approx(correct / total)
        assert 0 <= record.scalars["accuracy"] <= 1


REFUSED_LAYOUTS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
    "batch_mismatch": (torch.randn(8, 4), torch.zeros(7, dtype=torch.long)),
    "float_indices": (torch.randn(8, 4), torch.zeros(8)),
    "soft_targets_3d": (torch.randn(8, 4, 3), torch.rand(8, 4, 3)),
    "complex_targets": (torch.randn(8, 4), torch.zeros(8, dtype=torch.complex64)),
    "predicted_shape": (torch.zeros(8, dtype=torch.long), torch.zeros(8, 2, dtype=torch.long)),
    "one_hot_integer": (torch.randn(8, 4), nn.functional.one_hot(torch.arange(8) % 4, 4)),
    "integer_mask": (torch.randn(8, 3, 3), torch.zeros(8, 3, 3, dtype=torch.long)),
    "no_classes": (torch.randn(8, 0), torch.zeros(8, dtype=torch.long)),
    "no_classes_first": (torch.randn(8, 0, 3), torch.zeros(8, 3, dtype=torch.long)),
}


@pytest.mark.parametrize(("outputs", "targets"), REFUSED_LAYOUTS.values(), ids=REFUSED_LAYOUTS)
def test_an_unreadable_accuracy_layout_is_refused_naming_the_shapes(
    outputs: torch.Tensor, targets: torch.Tensor
) -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    recs = sw.sinks.collect()
    with sw.observe(model, sinks=[recs], every=1) as watch:
        model(torch.randn(8, 4))
        with pytest.raises(ValueError, match=r"`targets`") as info:
            watch.step(outputs=outputs, targets=targets)
        message = str(info.value)
        assert str(list(outputs.shape)) in message
        assert str(list(targets.shape)) in message
        model(torch.randn(8, 4))
        watch.step()
    assert [r.step for r in recs.items] == [1]
    assert _layer0(recs.items[0])[0] == 32  # one forward's activation, not two


@pytest.mark.parametrize("classes_at", ["last", "first"])
@pytest.mark.parametrize("every", [1, None], ids=["every_1", "governor"])
def test_an_ambiguous_layout_after_settled_steps_is_scored_as_they_were(
    classes_at: str, every: int | None
) -> None:
    # before: with a variable sequence length t, the step where t equals the class count raised
    # "the classes could be the last or the second dimension" out of watch.step(): training stopped
    classes = 4
    torch.manual_seed(0)
    model = nn.Linear(3, classes)
    recs = sw.sinks.collect()
    expected: list[tuple[int, int]] = []
    with sw.observe(model, sinks=[recs], every=every) as watch:
        for t in (3, 5, 4, 6, 4):
            logits = model(torch.randn(8, t, 3))  # [8, t, C]
            outputs = logits if classes_at == "last" else logits.transpose(1, 2)  # or [8, C, t]
            targets = torch.randint(0, classes, (8, t))
            hits = (logits.argmax(-1) == targets).sum()
            expected.append((int(hits), 8 * t))
            watch.step(loss=logits.mean(), outputs=outputs, targets=targets, batch_size=8)
        assert watch.flush()
        stats = watch.statistics()
    assert stats.failed_steps == 0
    assert "ambiguous_accuracy" not in stats.skipped
    scored = {r.step: (r.scalars["correct"], r.scalars["total"]) for r in recs.items if "total" in r.scalars}
    assert scored  # the first step at least: sampled under the governor too
    for step, (correct, total) in scored.items():
        assert (correct, total) == expected[step]


def test_an_ambiguous_layout_before_any_settled_one_is_skipped_counted_and_warned_once() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 4)
    recs = sw.sinks.collect()
    with warnings.catch_warnings(record=True) as seen, sw.observe(model, sinks=[recs], every=1) as watch:
        warnings.simplefilter("always")
        for _ in range(3):
            logits = model(torch.randn(8, 4, 3))
            watch.step(loss=logits.mean(), outputs=logits, targets=torch.randint(0, 4, (8, 4)))
        # a step that is not ambiguous settles it: the ambiguous layout is scored from then on
        logits = model(torch.randn(8, 5, 3))
        targets = torch.randint(0, 4, (8, 5))
        watch.step(loss=logits.mean(), outputs=logits, targets=targets)
        logits = model(torch.randn(8, 4, 3))
        targets = torch.randint(0, 4, (8, 4))
        watch.step(loss=logits.mean(), outputs=logits, targets=targets)
        assert watch.flush()
        stats = watch.statistics()
    (warned,) = [w for w in seen if "train accuracy skipped" in str(w.message)]
    assert warned.category is RuntimeWarning
    assert re.search(r"\[8, 4, 4\].*reshape to \[M, C\]", str(warned.message))
    assert stats.failed_steps == 0
    assert stats.skipped["ambiguous_accuracy"] == 3
    assert [r.step for r in recs.items] == [0, 1, 2, 3, 4]
    assert ["total" in r.scalars for r in recs.items] == [False, False, False, True, True]
    assert all("loss" in r.scalars for r in recs.items)
    assert recs.items[-1].scalars["correct"] == int((logits.argmax(-1) == targets).sum())


@pytest.mark.parametrize(
    "kwargs",
    [{"outputs": torch.randn(4, 2)}, {"targets": torch.zeros(4, dtype=torch.long)}],
    ids=["outputs_only", "targets_only"],
)
def test_outputs_without_targets_or_the_reverse_is_refused(kwargs: dict[str, Any]) -> None:
    with (
        sw.observe(nn.Linear(2, 2), every=1) as watch,
        pytest.raises(ValueError, match=r"`outputs`.*`targets`"),
    ):
        watch.step(**kwargs)


# -- finding 4: activation checkpointing is one forward, not two ---------------------------------------


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.block = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            h = self.block(x)
        else:
            h = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(h)


def _run_checkpointed(train: Train, reentrant: bool | None) -> list[sw.StepRecord]:
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recs = sw.sinks.collect()
    every = dict.fromkeys(KINDS, 1)
    # inputs that require grad (the reentrant checkpoint needs one), drawn step by step from the global RNG
    batches = ((torch.randn(16, 4, requires_grad=True), torch.randint(0, 3, (16,))) for _ in range(3))
    with sw.observe(model, opt, taps=KINDS, cadence=every, sinks=[recs], metrics=(), every=1) as watch:
        train(model, opt, watch, data=batches, report_outputs=False)
        assert watch.statistics().hook_errors == 0
    return list(recs.items)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_layers_are_summarised_once_like_without_checkpointing(
    reentrant: bool, train: Train
) -> None:
    reference = _run_checkpointed(train, None)
    observed = _run_checkpointed(train, reentrant)
    assert len(observed) == len(reference) == 3
    for ref, got in zip(reference, observed, strict=True):
        assert {k.phase for k in got.keys} == {"train"}  # no phantom evaluation series
        assert sorted(got.keys) == sorted(ref.keys)
        for key in ref.keys:
            i, j = ref.keys.index(key), got.keys.index(key)
            assert got.column("count")[j] == ref.column("count")[i], key
            assert got.stat("l2")[j] == pytest.approx(ref.stat("l2")[i], rel=1e-5), key
            assert got.stat("mean")[j] == pytest.approx(ref.stat("mean")[i], rel=1e-5, abs=1e-9), key


def test_a_checkpointed_block_in_evaluation_is_still_an_eval_forward() -> None:
    torch.manual_seed(0)
    model = Checkpointed(True)
    recs = sw.sinks.collect()
    with sw.observe(model, sinks=[recs], taps=("activation",), every=1) as watch:
        model.eval()
        with torch.no_grad():
            model(torch.randn(4, 4, requires_grad=True))
        watch.step()
    assert {k.phase for k in recs.items[0].keys} == {"eval"}


# -- a model left in eval mode while it trains ------------------------------------------------------------


def _dropout_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.ReLU(), nn.BatchNorm1d(8), nn.Linear(8, 3))


def _line() -> int:
    """The caller's line number."""
    frame = inspect.currentframe()
    caller = None if frame is None else frame.f_back
    assert caller is not None
    return caller.f_lineno


@pytest.mark.parametrize("every", [1, None], ids=["every_1", "governor"])
def test_training_left_in_eval_mode_after_a_validation_is_warned_once_at_the_optimizer_step(
    every: int | None,
) -> None:
    """The classic bug: a validation calls ``model.eval()`` and training goes on without ``model.train()``.
    The optimizer's next sampled step warns, once, pointing at the loop's ``optimizer.step()`` line; the
    rows say what was run (``eval`` forwards, ``train`` gradients)."""
    torch.manual_seed(0)
    model = _dropout_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    recs = sw.sinks.collect()
    options: dict[str, Any] = {"every": every} if every else {}

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(16, 4), torch.randint(0, 3, (16,))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sw.observe(model, opt, sinks=[recs], **options) as watch:
            for step in range(2500):
                if step == 5:  # a validation that leaves the model in eval mode
                    model.eval()
                    with torch.no_grad():
                        model(batch()[0])
                x, y = batch()
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                line = _line() + 1
                opt.step()
                watch.step(loss=loss)
                if caught and step > 5 + 20:  # (a few steps more: warned once only)
                    break
    found = [w for w in caught if "eval mode" in str(w.message)]
    assert len(found) == 1, [str(w.message) for w in caught]
    assert issubclass(found[0].category, RuntimeWarning)
    assert "model.train()" in str(found[0].message)
    assert (found[0].filename, found[0].lineno) == (__file__, line)
    assert len(caught) == 1  # (nothing else to say about this loop)
    assert watch.statistics().hook_errors == 0
    late = [r for r in recs.items if r.step > 5 and r.rows("param_grad")]
    assert late, "a sampled step after the validation"
    assert all({k.phase for k in r.keys if k.kind == "activation"} == {"eval"} for r in late)
    assert all(not r.rows("output_grad") for r in late)


def test_no_eval_mode_warning_for_evaluations_a_frozen_batchnorm_or_generation_before_training() -> None:
    """Forwards in eval mode with gradients on that are not the training: a validation that forgot
    ``torch.no_grad()`` (then ``model.train()``), generation in eval mode before a training forward in the
    same step (RL), a BatchNorm frozen with ``model.train(); bn.eval()``: no warning (pytest makes one an
    error), on every step."""
    torch.manual_seed(0)
    model = _dropout_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with sw.observe(model, opt, every=1) as watch:
        for step in range(12):
            x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
            if step % 3 == 0:  # an evaluation without no_grad, between steps
                model.eval()
                model(x).sum()
                model.train()
            if step % 3 == 1:  # generation in eval mode (gradients on) before this step's training forward
                model.eval()
                model(x)
                model.train()
            if step >= 6:
                model[3].eval()  # a frozen BatchNorm inside a training model
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            watch.step(loss=loss)
    assert watch.statistics().steps == 12


# -- watch.step() per micro-batch -----------------------------------------------------------------------


def _mistaken_loop(
    every: int | None, body: Callable[[nn.Module, torch.optim.Optimizer, sw.Watch, int], int], more: int
) -> tuple[list[warnings.WarningMessage], sw.Watch, int]:
    """Train ``_mlp()`` with SGD under ``observe(every=every)`` (None: the governor), one ``body(model, opt,
    watch, step)`` per step (it returns its ``watch.step()``'s line), until ``more`` steps after the first
    warning (at most 4000); the warnings caught, the watch, the line."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    options: dict[str, Any] = {"every": every} if every else {}
    line, warned_at = 0, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sw.observe(model, opt, **options) as watch:
            for step in range(4000):
                line = body(model, opt, watch, step)
                warned_at = step if caught and warned_at is None else warned_at
                if warned_at is not None and step >= warned_at + more:
                    break
    return caught, watch, line


def _batch_loss(model: nn.Module) -> torch.Tensor:
    return nn.functional.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,)))


@pytest.mark.parametrize("every", [1, None], ids=["every_1", "governor"])
def test_watch_step_per_micro_batch_under_accumulation_is_warned_once_at_the_watch_step(
    every: int | None,
) -> None:
    """Gradient accumulation over 4 micro-batches with ``watch.step()`` after each one (not after the
    optimizer's step): warned once, at the loop's ``watch.step()`` line, naming the counts."""

    def body(model: nn.Module, opt: torch.optim.Optimizer, watch: sw.Watch, step: int) -> int:
        (_batch_loss(model) / 4).backward()
        if step % 4 == 3:
            opt.step()
            opt.zero_grad()
        line = _line() + 1
        watch.step()
        return line

    caught, _, line = _mistaken_loop(every, body, more=160)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert issubclass(caught[0].category, RuntimeWarning)
    message = str(caught[0].message)
    assert re.search(r"ended \d+ sampled steps in which no observed\s+optimizer stepped, and \d+ in", message)
    assert "once, after optimizer.step()" in message
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)


def test_no_micro_batch_warning_for_steps_a_scaler_skips_or_one_step_per_watch_step() -> None:
    """Steps without an optimizer step that are not micro-batches: a ``GradScaler``'s first steps (before
    the optimizer ever stepped) and a rare skip later; and accumulation done right (``watch.step()`` after
    the optimizer's step). No warning (pytest makes one an error), every step sampled."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with sw.observe(model, opt, every=1) as watch:
        for step in range(60):
            loss = nn.functional.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,)))
            opt.zero_grad()
            loss.backward()
            if step >= 6 and step % 10 != 0:  # (skipped: the first six, then one in ten)
                opt.step()
            watch.step(loss=loss)
        for _ in range(10):  # accumulation over 3 micro-batches, watch.step() once per optimizer step
            for _ in range(3):
                model(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            watch.step()
    assert watch.statistics().steps == 70


@pytest.mark.parametrize("every", [1, None], ids=["every_1", "governor"])
def test_optimizer_step_after_watch_step_is_warned_once_not_taken_for_an_unseen_forward(
    every: int | None,
) -> None:
    """``watch.step()`` before ``optimizer.step()``: each step's gradients are stepped in the next step,
    before its forward. Warned once, at the loop's ``watch.step()`` line, saying so (not that a forward
    went unseen, which nothing counts)."""

    def body(model: nn.Module, opt: torch.optim.Optimizer, watch: sw.Watch, step: int) -> int:
        loss = _batch_loss(model)
        opt.zero_grad()
        loss.backward()
        line = _line() + 1
        watch.step(loss=loss)
        opt.step()
        return line

    caught, watch, line = _mistaken_loop(every, body, more=40)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "the loop calls optimizer.step() after watch.step()" in str(caught[0].message)
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)
    assert "unseen_forward" not in watch.statistics().skipped


# -- finding 5: argument validation ------------------------------------------------------------------


class _Sink(sw.Sink):
    def send(self, item: Any) -> None:
        pass


OBSERVE_BAD: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "taps_none": ({"taps": None}, TypeError, "`taps`"),
    "taps_number": ({"taps": 3}, TypeError, "`taps`"),
    "taps_unhashable": ({"taps": [["activation"]]}, TypeError, "`taps`"),
    "stats_none": ({"stats": None}, TypeError, "`stats`"),
    "stats_number": ({"stats": 1}, TypeError, "`stats`"),
    "sinks_none": ({"sinks": None}, TypeError, "`sinks`"),
    "sinks_number": ({"sinks": 3}, TypeError, "`sinks`"),
    "sinks_string": ({"sinks": "stdout"}, TypeError, "`sinks`"),
    "metrics_none": ({"metrics": None}, TypeError, "`metrics`"),
    "metrics_number": ({"metrics": 2}, TypeError, "`metrics`"),
    "metrics_single_object": ({"metrics": sw.metrics.PNorm()}, TypeError, "`metrics`"),
    "cadence_list": ({"cadence": [("param", 2)]}, TypeError, "`cadence`"),
    "cadence_float": ({"cadence": {"param": 2.5}}, ValueError, "`cadence`"),
    "channel_last_str": ({"channel_last": "no"}, TypeError, "`channel_last`"),
    "channel_last_int": ({"channel_last": 0}, TypeError, "`channel_last`"),
    "every_float": ({"every": 2.0}, ValueError, "`every`"),
    "every_zero": ({"every": 0}, ValueError, "`every`"),
    "overhead_zero": ({"overhead": 0}, ValueError, "`overhead`"),
    "overhead_str": ({"overhead": "2%"}, ValueError, "`overhead`"),
    "every_and_overhead": ({"every": 2, "overhead": 0.02}, ValueError, "`every` or `overhead`"),
    "overhead_prepared_metric": (
        {"overhead": 0.02, "metrics": [sw.metrics.GradientCosine()]},
        ValueError,
        "Pass every=N (a fixed interval)",
    ),
    "overflow_none": ({"overflow": None}, ValueError, "`overflow`"),
    "capacity_float": ({"capacity": 2.5}, ValueError, "`capacity`"),
    "capacity_none": ({"capacity": None}, ValueError, "`capacity`"),
    "select_matches_nothing": ({"select": "encoder.*"}, ValueError, "`select`"),
    "select_empty_list": ({"select": []}, TypeError, "`select`"),
}


@pytest.mark.parametrize(("kwargs", "error", "names"), OBSERVE_BAD.values(), ids=OBSERVE_BAD)
def test_bad_observe_arguments_are_refused_naming_them_and_leave_nothing_behind(
    kwargs: dict[str, Any], error: type[Exception], names: str
) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    threads = _streamwatch_threads()
    with pytest.raises(error, match=re.escape(names)):
        sw.observe(model, opt, **kwargs)
    assert not any(_hooks(model, opt).values())
    assert _streamwatch_threads() == threads
    with sw.observe(model, opt, every=1):  # the model is free
        pass


def test_a_select_that_matches_nothing_says_what_it_was_and_lists_module_names() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(ValueError, match=r"`select`") as info:
        sw.observe(model, select="encoder.*", every=1)
    message = str(info.value)
    assert "encoder.*" in message
    for name in ("'0'", "'1'", "'2'"):
        assert name in message


def test_a_single_sink_is_accepted_as_if_in_a_list() -> None:
    model = _mlp()
    recs = sw.sinks.collect()
    with sw.observe(model, sinks=recs, every=1) as watch:
        out = model(torch.randn(4, 4))
        out.sum().backward()
        watch.step()
    assert len(recs.items) == 1
    assert _layer0(recs.items[0])[0] == 32


def test_taps_and_stats_given_as_generators_are_read_once_and_kept() -> None:
    model = _mlp()
    recs = sw.sinks.collect()
    taps = (k for k in ("activation",))
    stats = (s for s in ("dead", "nonfinite"))
    with sw.observe(model, taps=taps, stats=stats, sinks=[recs], every=1) as watch:
        model(torch.randn(4, 4))
        watch.step()
    (record,) = recs.items
    assert {k.kind for k in record.keys} == {"activation"}


STEP_BAD: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "loss_string": ({"loss": "0.5"}, TypeError, "`loss`"),
    "loss_list": ({"loss": [0.5]}, TypeError, "`loss`"),
    "loss_bool": ({"loss": True}, TypeError, "`loss`"),
    "loss_complex_number": ({"loss": 1 + 2j}, TypeError, "`loss`"),
    "loss_vector": ({"loss": torch.ones(3)}, ValueError, "`loss`"),
    "loss_complex_tensor": ({"loss": torch.ones((), dtype=torch.complex64)}, ValueError, "`loss`"),
    "loss_beyond_float": ({"loss": 10**400}, ValueError, "`loss`"),  # (float() overflows)
    "loss_fraction_beyond_float": ({"loss": fractions.Fraction(10**400, 3)}, ValueError, "`loss`"),
    "batch_size_zero": ({"batch_size": 0}, ValueError, "`batch_size`"),
    "batch_size_negative": ({"batch_size": -8}, ValueError, "`batch_size`"),
    "batch_size_fractional": ({"batch_size": 2.5}, ValueError, "`batch_size`"),
    "batch_size_float": ({"batch_size": 8.0}, ValueError, "`batch_size`"),
    "batch_size_bool": ({"batch_size": True}, ValueError, "`batch_size`"),
    "batch_size_string": ({"batch_size": "8"}, ValueError, "`batch_size`"),
    "outputs_list": ({"outputs": [1.0, 2.0], "targets": torch.zeros(2)}, TypeError, "`outputs`"),
    "loss_numpy_vector": ({"loss": np.array([1.0, 2.0])}, TypeError, "`loss`"),
    "loss_numpy_string": ({"loss": np.array("1.0")}, TypeError, "`loss`"),
    "loss_numpy_bool": ({"loss": np.array(True)}, TypeError, "`loss`"),
}


@pytest.mark.parametrize(("kwargs", "error", "names"), STEP_BAD.values(), ids=STEP_BAD)
def test_bad_step_arguments_are_refused_naming_them(
    kwargs: dict[str, Any], error: type[Exception], names: str
) -> None:
    model = _mlp()
    recs = sw.sinks.collect()
    with sw.observe(model, sinks=[recs], every=1) as watch:
        model(torch.randn(4, 4))
        with pytest.raises(error, match=re.escape(names)):
            watch.step(**kwargs)
        model(torch.randn(4, 4))
        watch.step(loss=0.5, batch_size=4)
        assert watch.statistics().failed_steps == 1
    (record,) = recs.items
    assert _layer0(record)[0] == 32
    assert record.scalars["loss"] == 0.5
    assert record.scalars["samples_per_second"] > 0


@pytest.mark.parametrize(
    "loss",
    [
        torch.tensor([2.5]),
        torch.tensor(3),
        0.25,
        7,
        float("nan"),
        np.float32(0.75),
        np.float64(1.5),
        np.int64(4),
        np.array(0.5),
        np.array(0.125, dtype=np.float32),
    ],
    ids=[
        "one_element",
        "int_tensor",
        "float",
        "int",
        "nan",
        "numpy_float32",
        "numpy_float64",
        "numpy_int",
        "numpy_0d_array",
        "numpy_0d_float32_array",
    ],
)
def test_every_scalar_loss_is_reported(loss: Any) -> None:
    # before: a 0-d numpy array (float() reads it exactly) was refused as not a number
    recs = sw.sinks.collect()
    with sw.observe(nn.Linear(2, 2), sinks=[recs], every=1) as watch:
        watch.step(loss=loss)
        assert watch.statistics().failed_steps == 0
    expected = float(loss.reshape(()) if isinstance(loss, torch.Tensor) else loss)
    assert recs.items[0].scalars["loss"] == pytest.approx(expected, nan_ok=True)


@pytest.mark.parametrize("timeout", [float("nan"), -1.0, "10", None, True], ids=repr)
def test_flush_refuses_a_timeout_it_could_not_honour(timeout: Any) -> None:
    # before: a NaN deadline never passes, so flush(nan) with a stuck worker waited forever
    with sw.observe(nn.Linear(2, 2), every=1) as watch, pytest.raises(ValueError, match=r"`timeout`"):
        watch.flush(timeout)


def test_flush_waits_for_the_other_pipelines_after_one_fails() -> None:
    # before: flush returned False as soon as any pipeline had failed, with records still queued for the
    # healthy ones (CI saw it as a flaky `assert watch.flush()` in a detector test); and it returned True
    # once the last record was taken, before the pipelines had it (here: 9 of 10 items)
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gate, entered = threading.Event(), threading.Event()

    def breaks(record: sw.StepRecord) -> None:
        entered.set()
        assert gate.wait(10)
        raise Boom("sink bug")

    def slow(record: sw.StepRecord) -> int:
        time.sleep(0.005)  # the rest drains well after the failure is recorded
        return record.step

    watch = sw.observe(model, opt, every=1)
    broken = watch.pipe(sw.source() | sw.sinks.callback(breaks))
    healthy = sw.sinks.collect()
    watch.pipe(sw.source() | ops.map(slow) | healthy)
    for _ in range(10):
        out = model(torch.randn(16, 4))
        opt.zero_grad()
        out.pow(2).mean().backward()
        opt.step()
        watch.step()
    assert entered.wait(10)
    gate.set()
    assert watch.flush()
    assert healthy.items == list(range(10))
    assert broken.closed
    assert isinstance(broken.error, Boom)
    with pytest.raises(sw.PipelineError, match="sink bug"):
        watch.close()
    assert watch.flush()  # closed and drained: nothing left to wait for


def test_overflow_error_raises_full_and_the_step_is_counted_not_reused() -> None:
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gate, entered = threading.Event(), threading.Event()

    def held(record: sw.StepRecord) -> None:
        entered.set()
        assert gate.wait(10)

    recs = sw.sinks.collect()
    watch = sw.observe(model, opt, overflow="error", capacity=1, sinks=[recs], every=1)
    watch.pipe(sw.source() | sw.sinks.callback(held))

    def train_step() -> None:
        out = model(torch.randn(16, 4))
        opt.zero_grad()
        out.pow(2).mean().backward()
        opt.step()

    train_step()
    watch.step()  # step 0: taken by the worker, held in the pipeline
    assert entered.wait(10)
    train_step()
    watch.step()  # step 1: waits in the channel (capacity 1)
    train_step()
    with pytest.raises(sw.Full):  # step 2: the policy the user chose
        watch.step()
    stats = watch.statistics()
    assert (stats.steps, stats.sampled, stats.failed_steps) == (3, 2, 1)
    gate.set()
    assert watch.flush()
    train_step()
    watch.step()  # step 3: a fresh step with its own number and one forward's rows
    watch.close()
    assert [r.step for r in recs.items] == [0, 1, 3]
    assert _layer0(recs.items[-1])[0] == 16 * 8
