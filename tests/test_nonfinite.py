"""Where the first NaN/Inf started (``watch.statistics().first_nonfinite``), the per-step sentinel and its
escalation, and the reactions (``observe(on_nonfinite=...)``), on real training with injected faults.

Every expected origin comes from a plain-torch reference: the same training run again, without
streamwatch, with torch's own hooks recording each non-finite tensor in the order torch produced it
(:func:`_torch_reference`); the backward case is also compared with ``torch.autograd.detect_anomaly()``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import subprocess
import threading
import types
import urllib.request
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

import streamwatch as sw
from streamwatch import detectors, testing
from streamwatch._nonfinite import Sentinel, find_first
from streamwatch._replay import Replay
from streamwatch._report import report
from streamwatch.sinks import RunFile, read_run
from tests.torchrun import finish, free_ports, launch

FAULTY = "2"  # the injected module's name in _model()
LR = 0.05


class _NaNGrad(torch.autograd.Function):
    """The identity forward; a backward that returns NaN (a NaN produced only in backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("nan"))


class Faulty(nn.Module):
    """A linear layer that can inject a fault: ``"forward"`` (a NaN in one output column) or
    ``"backward"`` (its output's gradient becomes NaN inside its own backward)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)
        self.bias = nn.Parameter(torch.zeros(n_out))
        self.fault: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.fault == "forward":
            y = y * torch.where(torch.arange(y.shape[-1]) == 1, float("nan"), 1.0)
        elif self.fault == "backward":
            y = _NaNGrad.apply(y)
        return y


def _model() -> tuple[nn.Sequential, torch.optim.SGD]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), Faulty(16, 16), nn.ReLU(), nn.Linear(16, 3))
    faulty = model[2]
    others = [p for name, p in model.named_parameters() if not name.startswith(f"{FAULTY}.")]
    # the injected module's parameters in their own group: the "lr" fault sets only its learning rate
    opt = torch.optim.SGD([{"params": others}, {"params": list(faulty.parameters())}], lr=LR)
    return model, opt


def _train(
    model: nn.Sequential,
    opt: torch.optim.Optimizer,
    steps: int,
    fault: str,
    at: set[int],
    watch: sw.Watch | None = None,
    on_step: Callable[[int], None] | None = None,
) -> None:
    """A training loop that survives faults as long runs do: a step whose loss is not finite is skipped
    and the weights roll back to the last good ones. ``fault`` happens on the steps in ``at``."""
    faulty = model[2]
    assert isinstance(faulty, Faulty)
    g = torch.Generator().manual_seed(1)
    good = [p.detach().clone() for p in model.parameters()]
    for step in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        faulty.fault = fault if step in at and fault in ("forward", "backward") else None
        opt.param_groups[1]["lr"] = math.inf if step in at and fault == "lr" else LR
        loss = F.cross_entropy(model(x), y)
        if torch.isfinite(loss):
            good = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            loss.backward()
            opt.step()
        else:  # roll back (the user's loop reads its loss: this is not streamwatch's sync)
            with torch.no_grad():
                for p, saved in zip(model.parameters(), good, strict=True):
                    p.copy_(saved)
        if watch is not None:
            watch.step(loss=loss)
        if on_step is not None:
            on_step(step)


@dataclasses.dataclass(frozen=True)
class Origin:
    step: int
    layer: str
    kind: str
    param: str
    direction: str


def _torch_reference(fault: str, at: set[int], steps: int, sampled: Callable[[int], bool]) -> Origin:
    """The first non-finite tensor, in the order torch produced it, of the first *sampled* step that had
    one — plain torch hooks on every leaf module's output and its gradient, every parameter's gradient
    and the optimizer's updates; no streamwatch."""
    model, opt = _model()
    events: list[tuple[str, str, str]] = []
    first: list[Origin] = []
    current = [0]

    def bad(t: torch.Tensor) -> bool:
        return not bool(torch.isfinite(t).all())

    for name, module in model.named_modules():
        if next(module.children(), None) is not None:
            continue

        def forward_hook(module: nn.Module, inputs: Any, output: torch.Tensor, name: str = name) -> None:
            if bad(output):
                events.append(("activation", name, ""))
            if output.requires_grad:
                output.register_hook(lambda g: events.append(("output_grad", name, "")) if bad(g) else None)

        module.register_forward_hook(forward_hook)
    params = list(model.named_parameters())
    for qualified, param in params:
        layer, _, pname = qualified.rpartition(".")
        param.register_post_accumulate_grad_hook(
            lambda p, layer=layer, pname=pname: (
                events.append(("param_grad", layer, pname)) if bad(p.grad) else None
            )
        )
    before: list[torch.Tensor] = []
    opt.register_step_pre_hook(
        lambda *_: before.__setitem__(slice(None), [p.detach().clone() for _, p in params])
    )

    def after_step(*_: Any) -> None:
        for (qualified, p), old in zip(params, before, strict=True):
            if bad(p.detach() - old):
                layer, _, pname = qualified.rpartition(".")
                events.append(("update", layer, pname))

    opt.register_step_post_hook(after_step)
    directions = {
        "activation": "forward",
        "output_grad": "backward",
        "param_grad": "backward",
        "update": "optimizer",
    }

    def on_step(step: int) -> None:
        if events and not first and sampled(step):
            kind, layer, pname = events[0]
            first.append(Origin(step, layer, kind, pname, directions[kind]))
        events.clear()
        current[0] = step + 1

    _train(model, opt, steps, fault, at, on_step=on_step)
    assert first, "the reference saw no non-finite tensor"
    return first[0]


def _observed(first: sw.FirstNonFinite | None) -> Origin:
    assert first is not None
    return Origin(first.step, first.layer, first.kind, first.param, first.direction)


CASES = {
    # fault: (expected kind, direction) — the reference decides the step and the parameter
    "forward": ("activation", "forward"),
    "backward": ("param_grad", "backward"),
    "lr": ("update", "optimizer"),
}


EVERY_KIND = {"param": 1, "update": 1}


@pytest.mark.parametrize("fault", sorted(CASES))
def test_a_fault_with_every_kind_sampled_is_reported_at_its_origin_at_once(fault: str) -> None:
    model, opt = _model()
    with sw.observe(model, opt, cadence=EVERY_KIND, every=1) as watch:
        _train(model, opt, 12, fault, {5}, watch)
        assert watch.flush()
        first = watch.statistics().first_nonfinite
    reference = _torch_reference(fault, {5}, 12, sampled=lambda step: True)
    assert _observed(first) == reference
    kind, direction = CASES[fault]
    assert (reference.step, reference.layer, reference.kind, reference.direction) == (
        5,
        FAULTY,
        kind,
        direction,
    )
    assert first is not None
    assert first.certain
    assert first.rank == 0
    assert first.phase == "train"


def test_a_fault_on_a_resumed_runs_first_step_is_certain() -> None:
    """A run resumed at step 100 (``start_step=100``): a NaN in its first step's forward is certain to be
    the first, as nothing unrecorded came before it in this run (it was "uncertain" while only step 0
    counted as a run's first)."""
    model, opt = _model()
    with sw.observe(model, opt, cadence=EVERY_KIND, every=1, start_step=100) as watch:
        _train(model, opt, 3, "forward", {0}, watch)
        assert watch.flush()
        first = watch.statistics().first_nonfinite
    assert first is not None
    assert (first.step, first.layer, first.certain) == (100, FAULTY, True)


def test_a_resumed_session_is_judged_without_the_last_sessions_records() -> None:
    """A run file holding two sessions: the second resumed at step 4 and recorded step 8 first, with
    a NaN. Step 7 of the *first* session was recorded in full, which made step 8 look certain; the
    live watch had said uncertain (steps 4-7 of this session were not recorded)."""
    from streamwatch import SeriesKey, StepRecord
    from streamwatch._nonfinite import NonFiniteTracker

    key = SeriesKey("train", "fc", "activation", "")
    tracker = NonFiniteTracker(None, None)
    for step in range(8):
        tracker.send(StepRecord(step, 0.0, 0, (key,), testing.table(count=4, fill=0.0)))
    tracker.send(StepRecord(8, 0.0, 0, (key,), testing.table(count=4, nonfinite=1, fill=0.0), start_step=4))
    assert tracker.first is not None
    assert (tracker.first.step, tracker.first.certain) == (8, False)


def test_a_resumed_session_is_full_with_its_own_kinds() -> None:
    """The first session tapped the opt-in ``input`` kind, the resumed one does not: judged with the run's
    kinds, none of the second session's records was "full", and its first NaN, at its start, read as
    uncertain where the live watch had said certain."""
    from streamwatch import SeriesKey, StepRecord
    from streamwatch._nonfinite import NonFiniteTracker

    def record(step: int, start: int, kinds: tuple[str, ...], bad: bool = False) -> StepRecord:
        keys = tuple(SeriesKey("train", "fc", kind, "") for kind in kinds)
        flags = [float(bad and kind == "activation") for kind in kinds]
        table = testing.table(count=4, nonfinite=flags, fill=0.0)
        return StepRecord(step, 0.0, 0, keys, table, start_step=start)

    tracker = NonFiniteTracker(None, None)
    for step in range(4):
        tracker.send(record(step, 0, ("input", "activation", "param_grad")))
    for step in range(4, 8):
        tracker.send(record(step, 4, ("activation", "param_grad"), bad=step == 6))
    assert tracker.first is not None
    assert (tracker.first.step, tracker.first.certain) == (6, True)


@pytest.mark.parametrize("fault", sorted(CASES))
def test_with_the_default_cadence_a_recurring_fault_is_pinned_down_by_the_escalation(fault: str) -> None:
    """Updates are sampled on one step in 10 by default: at step 5 the record cannot rule out that step
    4's unrecorded update started it (an Inf learning rate even shows first in step 6's forward). The
    value is marked uncertain; the sentinel trip escalates to every kind on every step, and the
    recurrence at 11 gives the certain origin, which replaces it."""
    model, opt = _model()
    seen: list[sw.FirstNonFinite | None] = []
    with sw.observe(model, opt, every=1) as watch:
        _train(
            model,
            opt,
            16,
            fault,
            {5, 11},
            watch,
            on_step=lambda s: seen.append(watch.flush() and watch.statistics().first_nonfinite),
        )
        first = watch.statistics().first_nonfinite
    trip = 5 if fault == "forward" else 6
    early = seen[trip]
    assert early is not None
    assert not early.certain
    assert early.step == (6 if fault == "lr" else 5)
    reference = _torch_reference(fault, {5, 11}, 16, sampled=lambda step: step > trip)
    assert _observed(first) == reference
    kind, direction = CASES[fault]
    assert (reference.step, reference.layer, reference.kind, reference.direction) == (
        11,
        FAULTY,
        kind,
        direction,
    )
    assert first is not None
    assert first.certain


@pytest.mark.parametrize("fault", sorted(CASES))
def test_a_fault_on_an_unsampled_step_escalates_and_its_recurrence_is_captured(fault: str) -> None:
    """every=50: the fault at step 7 is not sampled. The sentinel sees the non-finite loss (at 7 for a
    forward NaN; at 8 for the others, whose NaN weights show in the next forward), sampling escalates to
    every step and every kind, and the recurrence at 13 is recorded with its origin."""
    model, opt = _model()
    with sw.observe(model, opt, every=50, escalate=20) as watch:
        _train(model, opt, 40, fault, {7, 13}, watch)
        assert watch.flush()
        stats = watch.statistics()
    trip = 7 if fault == "forward" else 8
    escalated = set(range(trip + 1, trip + 21))
    reference = _torch_reference(fault, {7, 13}, 40, sampled=lambda s: s % 50 == 0 or s in escalated)
    got = _observed(stats.first_nonfinite)
    assert got == reference
    kind, direction = CASES[fault]
    assert (got.step, got.layer, got.kind, got.direction) == (13, FAULTY, kind, direction)
    assert stats.first_nonfinite is not None
    assert stats.first_nonfinite.certain
    assert stats.escalations == 1
    assert stats.sentinel_trips == 2  # the fault and its recurrence
    assert stats.sampled == 1 + 20  # step 0, then the escalation; step 40 is not reached
    assert stats.escalated_until is None  # over at step trip + 21 <= 40


def test_without_escalation_the_unsampled_fault_is_never_recorded() -> None:
    """The control for the test above: escalate=0 leaves the sparse sampling alone, so nothing is found."""
    model, opt = _model()
    with sw.observe(model, opt, every=50, escalate=0) as watch:
        _train(model, opt, 40, "forward", {7, 13}, watch)
        assert watch.flush()
        stats = watch.statistics()
    assert stats.first_nonfinite is None
    assert (stats.sentinel_trips, stats.escalations, stats.sampled) == (2, 0, 1)


def test_the_gradient_norm_sentinel_trips_on_the_step_itself() -> None:
    """A NaN only in backward leaves the loss finite: sentinel=("loss", "grad_norm") trips at step 7,
    the loss alone only at 8 (when the NaN weights reach the forward)."""
    trips = {}
    for checks in (("loss",), ("loss", "grad_norm")):
        model, opt = _model()
        with sw.observe(model, opt, every=50, escalate=5, sentinel=checks) as watch:
            escalated: list[int] = []

            def note(step: int, watch: sw.Watch = watch, escalated: list[int] = escalated) -> None:
                if watch.statistics().escalated_until is not None:
                    escalated.append(step)

            _train(model, opt, 10, "backward", {7}, watch, on_step=note)
        trips[checks] = escalated[0]
    assert trips == {("loss",): 8, ("loss", "grad_norm"): 7}


def test_backward_origin_matches_detect_anomaly() -> None:
    """torch.autograd.detect_anomaly() names the backward function that returned the NaN and the forward
    call that made it: Faulty.forward, the module streamwatch reports."""
    model, opt = _model()
    faulty = model[2]
    assert isinstance(faulty, Faulty)
    faulty.fault = "backward"
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autograd.detect_anomaly():
            loss = F.cross_entropy(model(x), y)
            with pytest.raises(RuntimeError, match=r"Function '_NaNGradBackward' returned nan values"):
                loss.backward()
    traceback = "\n".join(str(w.message) for w in caught)
    assert "in forward\n    y = _NaNGrad.apply(y)" in traceback  # the forward call: Faulty.forward
    anomaly_module = next(
        name for name, m in model.named_modules() if isinstance(m, Faulty)
    )  # the forward's owner
    model, opt = _model()
    with sw.observe(model, opt, every=1) as watch:
        _train(model, opt, 3, "backward", {1}, watch)
        assert watch.flush()
        first = watch.statistics().first_nonfinite
    assert first is not None
    assert first.layer == anomaly_module == FAULTY
    assert first.direction == "backward"


# -- reactions ------------------------------------------------------------------------------------------


def test_raise_stops_the_loop_at_the_faulty_step_with_the_origin() -> None:
    model, opt = _model()
    done: list[int] = []
    with (
        sw.observe(model, opt, on_nonfinite="raise", every=1) as watch,
        pytest.raises(sw.NonFiniteError) as info,
    ):
        _train(model, opt, 20, "forward", {5}, watch, on_step=done.append)
    err = info.value
    assert isinstance(err, FloatingPointError)
    assert isinstance(err, sw.StreamwatchError)
    assert done == [0, 1, 2, 3, 4]  # raised from step 5's own watch.step(): 0 steps late
    got = (err.step, err.phase, err.layer, err.kind, err.param, err.index, err.direction, err.rank)
    assert got == (5, "train", FAULTY, "activation", "", "", "forward", 0)
    assert f"layer '{FAULTY}'" in str(err)


def test_a_gradient_trip_on_an_unsampled_step_is_named_the_gradients_not_the_loss(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A finite loss with an inf gradient (a GradScaler's overflow) on a step the sentinel alone saw: the
    warning said "non-finite loss" and the error ``kind='loss'``, sending the reader to the wrong place."""
    for reaction in ("warn", "raise"):
        model, opt = _model()
        g = torch.Generator().manual_seed(7)
        caplog.clear()
        with (
            caplog.at_level(logging.WARNING, "streamwatch"),
            sw.observe(model, opt, every=50, sentinel=("loss", "grad_norm"), on_nonfinite=reaction) as watch,
        ):
            for step in range(5):
                x, y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                if step == 3:
                    bias = model[4].bias.grad
                    assert bias is not None
                    bias[0] = math.inf
                    assert math.isfinite(float(loss.detach()))
                else:
                    opt.step()  # (skipped on the bad step, as a GradScaler skips it)
                if reaction == "raise" and step == 3:
                    with pytest.raises(sw.NonFiniteError) as info:
                        watch.step(loss=loss)
                    assert (info.value.step, info.value.kind, info.value.direction) == (
                        3,
                        "grad_norm",
                        "backward",
                    )
                    break
                watch.step(loss=loss)
        if reaction == "warn":
            assert "non-finite gradients at step 3 (sentinel)" in caplog.text
            assert "non-finite loss" not in caplog.text


def test_raise_for_a_nan_the_loss_does_not_show_comes_at_most_one_step_late() -> None:
    """A NaN only in backward: the loss of step 5 is finite. The worker finds it in step 5's record; the
    training thread learns it at the latest at step 6, whose loss the NaN weights make non-finite."""
    model, opt = _model()
    faulty = model[2]
    assert isinstance(faulty, Faulty)
    done: list[int] = []

    def loop(watch: sw.Watch) -> None:
        for step in range(20):
            faulty.fault = "backward" if step == 5 else None
            loss = F.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 3, (16,)))
            opt.zero_grad()
            loss.backward()
            opt.step()  # no guard: the NaN gradient reaches the weights
            watch.step(loss=loss)
            done.append(step)

    with (
        sw.observe(model, opt, on_nonfinite="raise", every=1) as watch,
        pytest.raises(sw.NonFiniteError) as info,
    ):
        loop(watch)
    assert done[-1] in (4, 5)  # raised from step 5's or step 6's watch.step()
    err = info.value
    assert (err.step, err.layer, err.kind, err.param, err.direction) == (
        5,
        FAULTY,
        "param_grad",
        "bias",
        "backward",
    )


def test_raise_on_an_unsampled_step_names_what_the_sentinel_saw() -> None:
    model, opt = _model()
    done: list[int] = []
    with (
        sw.observe(model, opt, every=50, on_nonfinite="raise") as watch,
        pytest.raises(sw.NonFiniteError, match=r"the step was not sampled") as info,
    ):
        _train(model, opt, 20, "forward", {7}, watch, on_step=done.append)
    assert done[-1] == 6
    err = info.value
    assert (err.step, err.layer, err.kind, err.direction) == (7, "", "loss", "forward")


def test_warn_logs_once_per_episode(caplog: pytest.LogCaptureFixture) -> None:
    model, opt = _model()
    with (
        caplog.at_level(logging.WARNING, logger="streamwatch"),
        sw.observe(model, opt, cadence=EVERY_KIND, every=1) as watch,
    ):
        _train(model, opt, 12, "forward", {3, 4, 8}, watch)  # two episodes: steps 3-4, step 8
        assert watch.flush()
        stats = watch.statistics()
    found = [r.getMessage() for r in caplog.records if "non-finite value first at" in r.getMessage()]
    assert len(found) == 2, found
    assert found[0].startswith(
        f"streamwatch: non-finite value first at step 3, rank 0: activation of layer '{FAULTY}'"
    )
    assert "step 8" in found[1]
    assert stats.nonfinite_episodes == 2
    assert _observed(stats.first_nonfinite).step == 3


def test_a_callable_gets_each_episode_on_the_worker_thread() -> None:
    got: list[tuple[sw.FirstNonFinite, str]] = []
    model, opt = _model()
    with sw.observe(
        model,
        opt,
        cadence=EVERY_KIND,
        on_nonfinite=lambda v: got.append((v, threading.current_thread().name)),
        every=1,
    ) as watch:
        _train(model, opt, 12, "lr", {3, 8}, watch)
        assert watch.flush()
        first = watch.statistics().first_nonfinite
    assert [(v.step, v.layer, v.kind, v.param) for v, _ in got] == [
        (3, FAULTY, "update", "weight"),
        (8, FAULTY, "update", "weight"),
    ]
    assert {thread for _, thread in got} == {"streamwatch-worker"}
    assert got[0][0] == first


def test_a_raising_callable_stops_only_itself_counted_and_reported() -> None:
    calls: list[int] = []

    def fails(value: sw.FirstNonFinite) -> None:
        calls.append(value.step)
        raise KeyError("callback bug")

    model, opt = _model()
    watch = sw.observe(model, opt, cadence=EVERY_KIND, on_nonfinite=fails, every=1)
    with pytest.warns(RuntimeWarning, match=r"on_nonfinite callback .*KeyError: 'callback bug'"):
        _train(model, opt, 12, "forward", {3, 8}, watch, on_step=lambda step: watch.flush() and None)
    stats = watch.statistics()
    assert calls == [3]  # stopped after it raised: the second episode does not call it
    assert stats.pipeline_failures == 1
    assert stats.first_nonfinite is not None
    assert stats.first_nonfinite.step == 3
    assert stats.nonfinite_episodes == 2
    assert stats.steps == 12  # training went on
    with pytest.raises(sw.PipelineError, match="callback bug"):
        watch.close()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"on_nonfinite": "ignore"},
            ValueError,
            r'^Expected `on_nonfinite` to be "warn", "raise" or a callable',
        ),
        ({"on_nonfinite": None}, ValueError, r"^Expected `on_nonfinite` .* got None$"),
        ({"escalate": -1}, ValueError, r"^Expected `escalate` to be an integer >= 0 .* got -1$"),
        ({"escalate": True}, ValueError, r"^Expected `escalate` to be an integer >= 0 .* got True$"),
        ({"escalate": 2.5}, ValueError, r"^Expected `escalate` to be an integer >= 0 .* got 2.5$"),
        (
            {"sentinel": "loss"},
            ValueError,
            r"^Expected `sentinel` to be a collection of \('loss', 'grad_norm'\)",
        ),
        ({"sentinel": ("nan",)}, ValueError, r"^Expected `sentinel` .* got \('nan',\)$"),
        (
            {"detectors": detectors.LossSpike()},
            TypeError,
            r"^Expected a collection of detectors, got the single",
        ),
        (
            {"detectors": [detectors.LossSpike(), detectors.LossSpike()]},
            ValueError,
            r"^Expected at most one LossSpike",
        ),
        ({"detectors": [object()]}, TypeError, r"^Expected every entry of `detectors` to be"),
    ],
    ids=lambda v: str(v) if not isinstance(v, dict) else ",".join(v),
)
def test_bad_arguments_are_refused_before_anything_is_attached(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    model, opt = _model()
    with pytest.raises(error, match=message):
        sw.observe(model, opt, **kwargs)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not opt._optimizer_step_pre_hooks
    assert not opt._optimizer_step_post_hooks
    with sw.observe(model, opt, every=1):  # not half-observed: it can be observed now
        pass


# -- served, recorded, replayed ------------------------------------------------------------------------


def test_first_nonfinite_and_escalation_are_served_on_metrics(tmp_path: Path) -> None:
    model, opt = _model()
    with sw.observe(model, opt, every=50, escalate=100) as watch:
        exporter = watch.expose(port=0, run="nan")
        _train(model, opt, 20, "backward", {7, 13}, watch)
        assert watch.flush()
        body = urllib.request.urlopen(exporter.url, timeout=10).read().decode()
        stats = watch.statistics()
    families = {f.name: f.samples for f in text_string_to_metric_families(body)}
    (info,) = families["streamwatch_first_nonfinite_info"]
    labels = {
        k: v for k, v in info.labels.items() if k not in ("run", "rank", "local_rank", "world_size", "host")
    }
    first = stats.first_nonfinite
    assert first is not None
    assert labels == first.labels()
    assert info.value == 1.0
    assert labels == {
        "phase": "train",
        "layer": FAULTY,
        "kind": "param_grad",
        "param": "bias",
        "index": "",
        "direction": "backward",
        "certain": "true",
    }
    assert info.labels["rank"] == "0"
    (step,) = families["streamwatch_first_nonfinite_step"]
    assert step.value == 13.0
    assert [s.value for s in families["streamwatch_sentinel_trips"]] == [2.0]  # steps 8 and 14
    assert [s.value for s in families["streamwatch_escalations"]] == [1.0]
    assert [s.value for s in families["streamwatch_escalated"]] == [1.0]  # until step 109
    promtool = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, text=True)
    assert promtool.returncode == 0, promtool.stdout + promtool.stderr


def test_the_run_file_report_and_replay_show_what_the_live_run_showed(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    model, opt = _model()
    with sw.observe(model, opt, sinks=[RunFile(path)], cadence=EVERY_KIND, every=1) as watch:
        _train(model, opt, 30, "lr", {24}, watch)
        assert watch.flush()
        live = watch.snapshot()
        first = watch.statistics().first_nonfinite
    assert first is not None
    run = read_run(path)
    text = report(run)
    expected = f"step 24, rank 0, layer '{FAULTY}', kind update, name 'weight', direction optimizer"
    assert f"first non-finite: {expected} (+3 more rows)\n" in text  # bias update, weights
    with Replay(run, port=0, speed=0) as replay:
        assert replay.wait_until_done(30)
        replayed = replay.store.samples()
        assert replay.statistics().first_nonfinite == first

    def keyed(samples: list[sw.Sample]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}

    assert keyed(replayed) == keyed(live)  # detectors' series and the first non-finite value included
    assert {s.name for s in replayed} >= {
        "streamwatch_first_nonfinite_info",
        "streamwatch_loss_spikes",
        "streamwatch_grad_norm_ratio",
        "streamwatch_layer_update_ratio",
    }


def test_the_execution_order_survives_the_run_file(tmp_path: Path) -> None:
    """Rows laid out in another order than they ran: the record carries the order, the run file keeps
    it, and the first non-finite tensor is the one that ran first, not the first row."""
    keys = (sw.SeriesKey("train", "b", "param_grad", "weight"), sw.SeriesKey("train", "a", "activation", ""))
    table = testing.table(2, nonfinite=1, fill=0.0)
    record = sw.StepRecord(4, 0.0, 0, keys, table, {"loss": math.nan}, order=(9, 2))
    path = tmp_path / "run.jsonl"
    sink = RunFile(path)
    sink.send(record)
    sink.close()
    (back,) = read_run(path).records
    assert back.order == (9, 2)
    first = find_first(back)
    assert first is not None
    assert (first.layer, first.kind, first.direction) == ("a", "activation", "forward")
    # without the activation row, the loss (after the forward, before the backward) is the first
    only_grad = sw.StepRecord(4, 0.0, 0, keys[:1], table[:1], {"loss": math.nan}, order=(9,))
    loss = find_first(only_grad)
    assert loss is not None
    assert (loss.kind, loss.layer, loss.direction) == ("loss", "", "forward")


def test_records_carry_the_execution_order_of_the_hooks() -> None:
    """forward rows, then backward rows in the order autograd ran them, then updates before weights."""
    model, opt = _model()
    recs = sw.sinks.collect()
    order: list[tuple[str, str, str]] = []
    for name, module in model.named_modules():
        if next(module.children(), None) is None:
            module.register_forward_hook(lambda m, i, o, name=name: order.append((name, "activation", "")))
    for qualified, param in model.named_parameters():
        layer, _, pname = qualified.rpartition(".")
        param.register_post_accumulate_grad_hook(
            lambda p, layer=layer, pname=pname: order.append((layer, "param_grad", pname))
        )
    with sw.observe(
        model,
        opt,
        sinks=[recs],
        cadence={"param": 1, "update": 1},
        taps=("activation", "param_grad", "update", "param"),
        every=1,
    ) as watch:
        _train(model, opt, 1, "none", set(), watch)
    (record,) = recs.items
    ran = [record.keys[i] for i in np.argsort(record.execution_order())]
    assert [(k.layer, k.kind, k.name) for k in ran if k.kind in ("activation", "param_grad")] == order
    kinds = [k.kind for k in ran]
    assert kinds.index("update") > max(i for i, k in enumerate(kinds) if k == "param_grad")
    assert kinds.index("param") > max(i for i, k in enumerate(kinds) if k == "update")


# -- the sentinel itself ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_the_sentinel_trips_on_every_non_finite_value(value: float) -> None:
    sentinel = Sentinel(grad_norm=False)
    assert sentinel.check(0, torch.tensor(1.5), ()) == []
    assert sentinel.check(1, torch.tensor(value), ()) == [1]
    assert sentinel.check(2, value, ()) == [2]
    assert sentinel.check(3, None, ()) == []
    assert sentinel.trips == 2
    grads = Sentinel(grad_norm=True)
    assert grads.check(0, 1.0, [torch.ones(3), torch.tensor([1.0, value])]) == [0]
    assert grads.check(1, 1.0, [torch.ones(3)]) == []


def test_the_gradient_check_does_not_overflow_in_half_precision() -> None:
    """float16 gradients, every element finite, whose 2-norm (and sum of norms) is above float16's
    65504: the check took the norms in float16 and tripped on finite gradients."""
    big = torch.full((64, 64), 2000.0, dtype=torch.float16)
    assert torch.isfinite(big).all()
    assert not torch.isfinite(torch._foreach_norm([big])[0])  # what the old check read
    grads = Sentinel(grad_norm=True)
    assert grads.check(0, 1.0, [big, big.clone(), torch.ones(3, dtype=torch.bfloat16)]) == []
    bad = big.clone()
    bad[3, 5] = math.nan
    assert grads.check(1, 1.0, [big, bad]) == [1]
    bad[3, 5] = -math.inf
    assert grads.check(2, 1.0, [bad.to(torch.bfloat16), torch.ones(2)]) == [2]
    assert grads.trips == 2
    # float64 (1e300 is finite there), empty and complex gradients: checked in their own dtype
    wide = torch.full((3,), 1e300, dtype=torch.float64)
    assert grads.check(3, 1.0, [wide, torch.zeros(0), torch.tensor([1 + 2j]), big]) == []
    wide[1] = math.nan
    assert grads.check(4, 1.0, [wide, torch.zeros(0)]) == [4]
    assert grads.check(5, 1.0, [torch.tensor([1 + 2j, complex(math.inf, 0)])]) == [5]
    # sparse gradients (an Embedding(sparse=True)): their stored values
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,), check_invariants=True)
    assert grads.check(6, 1.0, [sparse, sparse.coalesce()]) == []
    poisoned = torch.sparse_coo_tensor([[0, 2]], [1.0, math.nan], (4,), check_invariants=True)
    assert grads.check(7, 1.0, [poisoned]) == [7]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
        csr = torch.tensor([[0.0, math.inf], [1.0, 0.0]]).to_sparse_csr()
    assert grads.check(8, 1.0, [csr]) == [8]


def test_monitoring_with_faults_and_escalation_leaves_training_bit_identical() -> None:
    def run(observe: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        model, opt = _model()
        torch.manual_seed(3)
        if observe:
            with sw.observe(model, opt, every=7, escalate=5, sentinel=("loss", "grad_norm")) as watch:
                _train(model, opt, 30, "backward", {4, 12, 20}, watch)
        else:
            _train(model, opt, 30, "backward", {4, 12, 20})
        return [p.detach().clone() for p in model.parameters()], torch.get_rng_state()

    plain, observed = run(False), run(True)
    for a, b in zip(plain[0], observed[0], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(plain[1], observed[1])


# -- two ranks --------------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_nan_on_one_rank_of_a_two_rank_gloo_run_names_that_rank(tmp_path: Path) -> None:
    """Rank 1's layer "1" outputs a NaN at step 6. Each rank reports its own first non-finite value: rank 1
    the activation in the forward; rank 0, whose own forward and output gradients were finite, the
    all-reduced (NaN) parameter gradients its optimizer was about to apply, in the same step: the last
    layer's first, where its backward began. The earliest in (step, direction) is the origin: rank 1."""
    script = Path(__file__).parent / "scripts" / "ddp_train.py"
    out = tmp_path / "run"
    out.mkdir()
    base = free_ports(2)
    proc = launch(
        script,
        2,
        out,
        "--port",
        str(base),
        "--out",
        str(out),
        "--steps",
        "10",
        "--nan-forward-rank",
        "1",
        "--nan-step",
        "6",
    )
    try:
        paths = [out / f"snapshot-{rank}.json" for rank in (0, 1)]
        for _ in range(900):
            if all(p.exists() for p in paths):
                break
            if proc.poll() is not None:
                break
            threading.Event().wait(0.1)
        assert all(p.exists() for p in paths), (out / "torchrun.log").read_text(errors="replace")[-3000:]
        firsts = [json.loads(p.read_text())["first_nonfinite"] for p in paths]
    finally:
        finish(proc, out)
    by_rank = {f["rank"]: (f["step"], f["layer"], f["kind"], f["direction"]) for f in firsts}
    assert by_rank[1] == (6, "1", "activation", "forward")
    # rank 0 saw its first NaN in the gradients DDP averaged with rank 1's (param_grad is what the
    # optimizer applies: docs/scale.md), in the same step, after its own finite forward
    assert by_rank[0] == (6, "2", "param_grad", "backward")
    rank_order = {"forward": 0, "backward": 1, "optimizer": 2}
    origin = min(firsts, key=lambda f: (f["step"], rank_order[f["direction"]]))
    assert origin["rank"] == 1


def test_raise_again_while_an_episode_goes_on_names_its_origin() -> None:
    """A loop that catches NonFiniteError and goes on: the next non-finite step (after a finite one in
    between for the sentinel) raises again, naming the episode's origin."""
    model, opt = _model()
    errors: list[sw.NonFiniteError] = []
    with sw.observe(model, opt, cadence=EVERY_KIND, on_nonfinite="raise", every=1) as watch:
        faulty = model[2]
        assert isinstance(faulty, Faulty)
        for step in range(8):
            faulty.fault = "forward" if step in (3, 5) else None
            loss = F.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 3, (16,)))
            try:
                watch.step(loss=loss)  # no backward: the weights stay finite
            except sw.NonFiniteError as err:
                errors.append(err)
    assert [(e.step, e.layer, e.kind) for e in errors] == [
        (3, FAULTY, "activation"),
        (5, FAULTY, "activation"),
    ]


def test_the_live_view_shows_the_first_nonfinite_value_and_the_escalation() -> None:
    import io

    from rich.console import Console

    from streamwatch._live import LiveView

    model, opt = _model()
    console = Console(width=200, record=True, file=io.StringIO(), color_system=None)
    with sw.observe(model, opt, every=50, escalate=30) as watch:
        view = LiveView(watch, total_steps=20, console=console)
        console.print(view.render(0))
        _train(model, opt, 20, "forward", {7, 13}, watch)
        assert watch.flush()
        console.print(view.render(20))
    text = " ".join(console.export_text().split())
    assert "first non-finite none" in text  # before
    assert f"first non-finite step 13, rank 0: activation of layer '{FAULTY}' (forward, train)" in text
    assert "escalated until step 38" in text


@pytest.mark.parametrize(
    ("width", "budget", "pause", "kept"),
    [(4, 0.5, 0.01, True), (1024, 0.01, 0.0, False)],
    ids=["cheap: kept", "dear: dropped"],
)
def test_under_a_governor_the_gradient_norm_check_is_kept_only_where_the_budget_allows_it(
    width: int, budget: float, pause: float, kept: bool
) -> None:
    """overhead= with the default sentinel: the gradient-norm check is timed over the first 8 steps with
    gradients, and kept if it costs at most a quarter of the budget per step: a 4-wide layer's gradients
    in a 10 ms step under a 50 % budget, yes; a 1024 x 1024 layer's in its own short step under 1 %, no."""
    torch.manual_seed(0)
    model = nn.Linear(width, width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with sw.observe(model, opt, overhead=budget) as watch:
        for step in range(12):
            if pause:
                threading.Event().wait(pause)
            loss = model(torch.randn(8, width)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            watch.step(loss=loss)
            if step == 3:
                assert watch.statistics().sentinel == ("loss",)  # on trial: not yet decided
        checks = watch.statistics().sentinel
    assert checks == (("loss", "grad_norm") if kept else ("loss",))
    with sw.observe(model, opt, every=1) as watch:  # a fixed interval: the loss only, unless asked
        assert watch.statistics().sentinel == ("loss",)
    with sw.observe(model, opt, sentinel=(), every=1) as watch:
        assert watch.statistics().sentinel == ()


class _FakeEvent:
    """An event the test completes by hand (``done``), standing in for ``torch.cuda.Event``."""

    def __init__(self) -> None:
        self.done = False
        self.recorded = 0

    def query(self) -> bool:
        return self.done


class _RingOnCpu(Sentinel):
    """The CUDA ring path run on CPU tensors: probes go through ``_push`` (as a device loss's would),
    their flags into a plain host tensor, with fake events; ``_wait`` completes one."""

    def _allocate(self) -> tuple[torch.Tensor, list[Any]]:
        self.fakes = [_FakeEvent() for _ in range(self.slots)]
        return torch.zeros((self.slots, self.batch + 1), dtype=torch.float64), list(self.fakes)

    def _record(self, event: Any, device: torch.device) -> None:
        event.done = False
        event.recorded += 1

    def _wait(self, event: Any) -> None:
        event.done = True

    def complete(self) -> list[int]:
        for event in self.fakes:
            event.done = True
        return self._poll()


def test_the_device_ring_checks_batches_reports_a_trip_once_its_copy_completed_and_carries_when_full() -> (
    None
):
    ring = _RingOnCpu(grad_norm=False, slots=2, batch=2, batch_seconds=math.inf)

    def step(index: int, value: float) -> list[int]:
        ring._push(index, torch.tensor(value))
        return ring._poll() if ring._pending else []

    assert step(0, 1.0) == []  # waits for its batch: nothing checked yet
    assert ring._pending == collections.deque()
    assert step(1, math.nan) == []  # the batch of steps 0-1 is checked: its copy in flight
    assert [steps for _, steps in ring._pending] == [[0, 1]]
    assert step(2, 1.0) == []
    assert step(3, 1.0) == []  # both slots in flight
    assert step(4, math.inf) == []
    assert step(5, 1.0) == []  # no free slot: steps 4-5 folded into a carry on the "device"
    assert step(6, 1.0) == []
    assert step(7, 1.0) == []  # still carried (reported at step 4, its first)
    assert ring.complete() == [1]  # step 1's copy completed: the trip is known now, a batch late
    assert step(8, 1.0) == []
    assert step(9, -math.inf) == []  # the carry (steps 4-7) and steps 8-9 take a freed slot
    assert [steps for _, steps in ring._pending] == [[4, 8, 9]]
    assert ring.complete() == [4, 9]
    assert step(10, 1.0) == []
    assert step(11, 1.0) == []
    assert ring.complete() == []
    assert all(e.recorded for e in ring.fakes)
    # close(): the half batch left and the copies in flight are read, waiting for them
    assert step(12, math.nan) == []
    assert ring.drain() == [12]
    assert ring.trips == 1  # (drain counts; the polls above were called by hand)
    assert ring.idle


def test_the_device_ring_checks_at_once_when_the_batch_is_old() -> None:
    ring = _RingOnCpu(grad_norm=False, slots=4, batch=16, batch_seconds=0.0)
    ring._push(0, torch.tensor(1.0))
    ring._push(1, torch.tensor(math.nan, dtype=torch.bfloat16))
    assert [steps for _, steps in ring._pending] == [[0], [1]]
    assert ring.complete() == [1]
    # a loss and gradients in several dtypes: one probe, non-finite exactly when one of them is
    from streamwatch._nonfinite import _largest

    big = torch.tensor(60000.0, dtype=torch.float16)
    assert math.isfinite(float(_largest([torch.tensor(1.0), big, torch.tensor(1e300, dtype=torch.float64)])))
    assert not math.isfinite(
        float(_largest([torch.tensor(1.0), torch.tensor(math.nan, dtype=torch.float16)]))
    )
    assert not math.isfinite(float(_largest([torch.tensor(-math.inf), big])))


def test_the_device_ring_gives_a_device_loss_past_the_spike_line_to_take_crossed() -> None:
    """The ring holds the probes' values (float32), so a batch read also compares each device loss with
    LossSpike's line as it is then: a finite one past it is kept for ``take_crossed`` (the boundary sends
    the step log at once); a non-finite one is a trip, not a crossing; a probe that is not the loss alone
    (with the gradients' largest magnitude) and a carry (the largest magnitude of a range) are never
    compared."""
    alarm = types.SimpleNamespace(line=math.inf)
    ring = _RingOnCpu(grad_norm=False, slots=1, batch=3, batch_seconds=math.inf)
    ring.alarm = alarm
    for step, value in enumerate([1.0, 5.0, 1e300]):  # step 1 would pass a line of 3, none is posted
        ring._push(step, torch.tensor(value, dtype=torch.float64))  # (1e300: finite, read exactly)
    assert ring.complete() == []
    assert ring.take_crossed() == []
    alarm.line = 3.0
    for step, value in enumerate([1.0, 5.0, math.inf], start=3):
        ring._push(step, torch.tensor(value, dtype=torch.bfloat16))
    assert [steps for _, steps in ring._pending] == [[3, 4, 5]]  # (in flight: nothing known yet)
    assert ring.takes_quiet_probes
    assert ring.complete() == [5]  # +inf: a trip
    assert not ring.quiet_poll()  # step 4 passed the line: a quiet step stops for it
    assert ring.take_crossed() == [4]
    assert ring.take_crossed() == []
    assert ring.quiet_poll()
    # the gradient-norm check's probes (the loss's and the gradients' largest magnitude): no line
    ring.set_grad_norm(True)
    ring._check_grads = lambda step, grads, tripped: [torch.stack([g.abs().amax() for g in grads]).amax()]  # type: ignore[method-assign]
    for step in (6, 7, 8):  # (gradients "on a device": their largest magnitude, 100, is the probe)
        assert ring.check(step, None, [torch.tensor([100.0, -1.0])]) == []
    assert ring._no_line == {6, 7, 8}
    assert ring.complete() == []
    assert ring.take_crossed() == []
    assert ring._no_line == set()
    ring.set_grad_norm(False)
    # a full ring: the next batch is carried (its largest magnitude), never compared with the line
    for step, value in enumerate([1.0, 9.0, 1.0, 1.0, 1.0, 1.0], start=9):
        ring._push(step, torch.tensor(value))
    assert [steps for _, steps in ring._pending] == [[9, 10, 11]]
    assert ring._carry is not None
    assert float(ring._carry) == 1.0
    assert ring.complete() == []
    assert ring.take_crossed() == [10]
    ring._push(15, torch.tensor(1.0))
    ring._push(16, torch.tensor(1.0))
    ring._push(17, torch.tensor(4.0))
    assert [steps for _, steps in ring._pending] == [[12, 15, 16, 17]]
    assert ring.complete() == []
    assert ring.take_crossed() == [17]
    assert ring._no_line == set()


def test_ranks_interleaved_in_one_record_stream_are_judged_each_on_its_own() -> None:
    # a run file with two ranks' records interleaved: rank 0's finite step 10 said nothing about rank 1's
    # step 10, yet made rank 1's step 11 look "certain" and replace its real (uncertain) start at step 10
    from streamwatch._nonfinite import NonFiniteTracker

    keys = (sw.SeriesKey("train", "0", "activation", ""), sw.SeriesKey("train", "0", "output_grad", ""))

    def record(step: int, rank: int, bad: bool) -> sw.StepRecord:
        table = testing.table(count=4.0, nonfinite=[1.0 if bad else 0.0, 0.0], fill=0.0)
        return sw.StepRecord(step, float(step), rank, keys, table, {"loss": 1.0})

    tracker = NonFiniteTracker(None, reaction=None)
    for step in (5, 10, 11):  # rank 1 not recorded at steps 6-9: its step 10 is uncertain
        tracker.send(record(step, 0, bad=False))
        tracker.send(record(step, 1, bad=step >= 10))
    assert tracker.first is not None
    assert (tracker.first.step, tracker.first.rank, tracker.first.certain) == (10, 1, False)
    assert tracker.episodes == 1  # rank 0's finite records in between do not end rank 1's episode
