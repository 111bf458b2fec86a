"""The clip tap (streamwatch/_clip_tap.py): the gradient norm before clipping on every step, training
untouched, and GradientSpike scoring it (docs/detectors.md, "Gradient clipping").

References: the norm before clipping recomputed from the gradients in the loop (torch, float64, before
the call), the detector's fold from ``tests.test_detectors.reference`` (the formulas written out),
training compared with an unwatched run bit for bit."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streamwatch as sw
from streamwatch import detectors
from streamwatch._clip_tap import ORIGINAL, watch_clipping
from streamwatch._record import StepRecord, StepScalars
from tests.test_detectors import grad, record, reference, run, same, series

Opener = Callable[[nn.Module, torch.optim.Optimizer], sw.Watch]


def clipped_loop(
    open_watch: Opener | None, steps: int, explode: int | None = None
) -> tuple[nn.Module, sw.Watch | None, list[float], list[float]]:
    """A clipped MLP run (Dropout: the RNG matters) under ``open_watch(model, opt)`` (None: no watch,
    which is closed at the end); returns the model, the watch, each step's norm before clipping
    recomputed from the gradients, and what clip_grad_norm_ returned."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = None if open_watch is None else open_watch(model, opt)
    expected, returned = [], []
    for step in range(steps):
        x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
        if step == explode:
            x = 300.0 * x
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
        expected.append(float(torch.linalg.vector_norm(grads)))
        params = model.parameters() if step % 2 else list(model.parameters())  # a generator or a list
        returned.append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
        opt.step()
        if watch is not None:
            watch.step(loss=loss)
    if watch is not None:
        watch.close()
    return model, watch, expected, returned


def rng_state() -> tuple[object, ...]:
    return torch.get_rng_state().tolist(), random.getstate(), np.random.get_state()[1].tolist()


@pytest.mark.parametrize("every", [None, 1], ids=["governor", "every=1"])
def test_every_steps_norm_before_clipping_is_recorded_and_training_is_identical(every: int | None) -> None:
    random.seed(1)
    np.random.seed(1)
    bare, _, expected, returned = clipped_loop(None, 60)
    after = rng_state()
    random.seed(1)
    np.random.seed(1)
    records = sw.sinks.collect()
    watched, _, _, got = clipped_loop(lambda m, o: sw.observe(m, o, every=every, sinks=[records]), 60)
    assert rng_state() == after
    assert got == returned
    for a, b in zip(bare.state_dict().values(), watched.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    norms = [s.scalars.get("log/grad_norm") for r in records.items for s in r.every_step()]
    assert len(norms) == 60  # every step, sampled or not
    assert norms == returned  # what clip_grad_norm_ returned, as it returned it
    same(norms, expected, rel=1e-5)  # float32 partial norms against a float64 reference
    assert torch.nn.utils.clip_grad_norm_ is ORIGINAL  # put back at close
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is ORIGINAL


def test_only_two_norms_over_the_watched_models_parameters_are_taken() -> None:
    model, other = nn.Linear(4, 2), nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = sw.sinks.collect()
    with sw.observe(model, opt, every=1, sinks=[records]) as watch:
        for step, (params, norm_type) in enumerate(
            [(other.parameters(), 2.0), (model.parameters(), math.inf), (model.weight, "2"), ([], 2.0)]
        ):
            for m in (model, other):
                m(torch.randn(3, 4)).pow(2).sum().backward()
            before = float(torch.linalg.vector_norm(model.weight.grad.double()))
            total = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type=norm_type)
            if step == 2:  # a single tensor of the watched model, norm type given as a string
                assert float(total) == pytest.approx(before, rel=1e-6)
                taken = float(total)
            opt.step()
            opt.zero_grad()
            other.zero_grad()
            watch.step()
    norms = [s.scalars.get("log/grad_norm") for r in records.items for s in r.every_step()]
    assert norms == [None, None, taken, None]


def test_nested_watches_and_restoring() -> None:
    a, b = nn.Linear(2, 1), nn.Linear(2, 1)
    seen: list[tuple[str, float]] = []
    first = watch_clipping(a.parameters(), lambda t: seen.append(("a", float(t))), print)
    both = [*a.parameters(), *b.parameters()]
    second = watch_clipping(both, lambda t: seen.append(("ab", float(t))), print)
    for m in (a, b):
        m(torch.ones(1, 2)).sum().backward()
    norm_b = float(torch.nn.utils.clip_grad_norm_(b.parameters(), 10.0))
    first.remove()
    norm_a = float(torch.nn.utils.clip_grad_norm_(a.parameters(), 10.0))
    assert torch.nn.utils.clip_grad_norm_ is not ORIGINAL  # the second still listens
    second.remove()
    second.remove()  # idempotent
    assert seen == [("ab", norm_b), ("ab", norm_a)]
    assert torch.nn.utils.clip_grad_norm_ is ORIGINAL


def test_a_failing_recorder_never_reaches_training() -> None:
    model = nn.Linear(2, 1)
    failures: list[Exception] = []

    def broken(total: torch.Tensor) -> None:
        raise RuntimeError("broken sink")

    handle = watch_clipping(model.parameters(), broken, failures.append)
    try:
        model(torch.ones(1, 2)).sum().backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    finally:
        handle.remove()
    assert math.isfinite(float(total))
    assert [str(e) for e in failures] == ["broken sink"]


def test_a_replaced_wrapper_is_left_in_place() -> None:
    model = nn.Linear(2, 1)
    handle = watch_clipping(model.parameters(), lambda t: None, print)
    theirs = torch.nn.utils.clip_grad_norm_
    mine = lambda *args, **kwargs: theirs(*args, **kwargs)  # noqa: E731  (someone wraps ours)
    torch.nn.utils.clip_grad_norm_ = mine
    try:
        handle.remove()
        assert torch.nn.utils.clip_grad_norm_ is mine  # not ours to undo
        assert torch.nn.utils.clip_grad.clip_grad_norm_ is ORIGINAL
    finally:
        torch.nn.utils.clip_grad_norm_ = ORIGINAL


def preclip_records(norms: list[float], every: int) -> list[StepRecord]:
    """Records of a clipping run: a sampled step (gradient rows clipped at 1) every ``every`` steps,
    carrying the unsampled steps before it with their pre-clip norms only."""
    out, carried = [], []
    for step, norm in enumerate(norms):
        if step % every:
            carried.append(StepScalars(step, 0.0, {"loss": 1.0, "log/grad_norm": norm}))
            continue
        clipped = min(norm, 1.0)
        rows = {grad("0"): clipped * clipped}
        base = record(step, rows, loss=1.0, **{"log/grad_norm": norm})
        out.append(dataclasses.replace(base, steps=tuple(carried)))
        carried = []
    return out


def test_gradient_spike_scores_every_steps_norm_before_clipping() -> None:
    rng = np.random.default_rng(3)
    norms = (2.0 + 0.3 * rng.standard_normal(91)).tolist()  # (step 90: sampled, the last record)
    norms[61] *= 50  # an explosion clipping contains, on an unsampled step
    ref = reference(norms, kind="ratio", threshold=10.0)
    assert ref.spikes == 1
    items = run(detectors.GradientSpike(layers=False), preclip_records(norms, 1))
    same(series(items, "streamwatch_grad_norm_ratio", layer="__all__"), ref.scores)
    same(series(items, "streamwatch_grad_norm_spikes", layer="__all__"), ref.counts)
    for every in (1, 10):  # what the watch serves: the same whether the steps were sampled or carried
        store = sw.SeriesStore(metrics=())
        pipeline = detectors.GradientSpike(layers=False).pipeline(store)
        for r in preclip_records(norms, every):
            pipeline.push(r)
        served = {s.name: s.value for s in store.samples() if s.labels.get("layer") == "__all__"}
        assert served["streamwatch_grad_norm_spikes"] == 1.0
        assert served["streamwatch_grad_norm_ratio"] == pytest.approx(ref.scores[-1], rel=1e-12)
    # without the pre-clip norm the clipped rows show nothing
    plain = [dataclasses.replace(r, scalars={}) for r in preclip_records([min(n, 1.0) for n in norms], 1)]
    items = run(detectors.GradientSpike(layers=False), plain)
    assert series(items, "streamwatch_grad_norm_spikes", layer="__all__")[0] == 0.0
    assert all(s is None for s in series(items, "streamwatch_grad_norm_spikes", layer="__all__")[1:])


def test_an_explosion_that_clipping_contains_is_counted_end_to_end() -> None:
    counts = {}
    for every in (None, 1):
        _, watch, _, _ = clipped_loop(lambda m, o, every=every: sw.observe(m, o, every=every), 60, explode=45)
        assert watch is not None
        latest = {(s.name, s.labels.get("layer")): s.value for s in watch.snapshot()}
        counts[every] = latest[("streamwatch_grad_norm_spikes", "__all__")]
        assert latest[("streamwatch_grad_norm", None)] > 0
    assert counts == {None: 1.0, 1: 1.0}


def test_it_calls_what_was_there_and_skips_totals_that_are_not_plain_tensors() -> None:
    class Sharded(torch.Tensor):  # stands for a DTensor total (FSDP2), whose value may need a collective
        pass

    calls: list[str] = []

    def theirs(parameters, max_norm, *args: object) -> torch.Tensor:  # type: ignore[no-untyped-def]
        calls.append("theirs")
        total = ORIGINAL(parameters, max_norm, *args)
        return total.as_subclass(Sharded) if max_norm < 1 else total

    model = nn.Linear(2, 1)
    seen: list[float] = []
    torch.nn.utils.clip_grad_norm_ = theirs
    try:
        handle = watch_clipping(model.parameters(), lambda t: seen.append(float(t)), print)
        model(torch.ones(1, 2)).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # a Sharded total: not recorded
        plain = torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        handle.remove()
        assert torch.nn.utils.clip_grad_norm_ is theirs  # put back as it was
    finally:
        torch.nn.utils.clip_grad_norm_ = ORIGINAL
    assert calls == ["theirs", "theirs"]
    assert seen == [float(plain)]
