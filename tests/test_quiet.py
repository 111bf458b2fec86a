"""The short ways a step ends: quiet steps and dark pairs.

A quiet step (``StepBoundary._quiet_step``: an unsampled step between unsampled steps) skips what such a step
does not need (the record, the metrics, the arming) and files the step's end with the governor instead of
ticking it. A dark pair (``StepBoundary._dark_step``: the governor's measurement of what its own time misses)
runs two steps with no streamwatch hook and nothing at the boundary between them but a clock reading;
the second boundary runs both. Everything a user can see must be as if the full boundary had run: the
same records, the same sampled steps, the same errors (a dark step's one boundary later), the same
non-finite reactions, bit-identical training. Real torch training throughout; the governor's clock is
faked where a test compares the sampled steps with a reference governor or needs dark pairs to happen.
"""

from __future__ import annotations

import collections
import math
import random
import time
import types
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import streamwatch as sw
from streamwatch import _boundary, _kernel, _observe
from streamwatch._boundary import StepBoundary
from streamwatch._governor import DARK_PAIRS, Governor
from streamwatch._nonfinite import Sentinel
from streamwatch._step_args import dark_ready
from streamwatch.testing import FakeClock
from tests.test_governor_observe import _batches
from tests.test_governor_observe import _train_step as _train
from tests.training import root_seen

PLAIN, COST, BUDGET = 0.010, 0.5, 0.05  # the governor settles at ceil(COST / BUDGET) = 10


@pytest.fixture
def quiet_calls(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[bool]:
    """How often the quiet path was tried, by whether it took the step."""
    counts: collections.Counter[bool] = collections.Counter()
    original = StepBoundary._quiet_step

    def counted(self: StepBoundary, *args: object) -> bool:
        took = original(self, *args)
        counts[took] += 1
        return took

    monkeypatch.setattr(StepBoundary, "_quiet_step", counted)
    return counts


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


@pytest.mark.parametrize("jitter", [0.0, 0.2], ids=["steady", "jittered"])
def test_quiet_steps_sample_exactly_what_a_ticking_governor_samples(
    monkeypatch: pytest.MonkeyPatch, quiet_calls: collections.Counter[bool], jitter: float
) -> None:
    """Jittered: step times vary by up to 20 %, so cost samples move the interval both ways all run
    long; a shadow step's end (its cost sample) must tick, not be filed, or the shrinking interval is
    acted on one stretch late and the sampled steps move."""
    rng = random.Random(0)
    clock, reference_clock = FakeClock(), FakeClock()
    monkeypatch.setattr(_observe, "_governor_clock", clock)
    reference = Governor(BUDGET, clock=reference_clock)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    records = sw.sinks.collect()
    chosen = []
    with sw.observe(model, opt, overhead=BUDGET, sentinel=("loss",), sinks=[records]) as watch:
        for step, (x, y) in enumerate(_batches(1500)):
            if reference.sampling:
                chosen.append(step)
            plain = PLAIN * (1 + jitter * rng.random())
            seconds = plain * (1 + COST) if reference.sampling else plain
            clock.advance(seconds)
            reference_clock.advance(seconds)
            loss, out = _train(model, opt, x, y)
            watch.step(loss=loss, outputs=out, targets=y, batch_size=12)
            reference.tick()
        watch.flush()
        stats = watch.statistics()
    assert quiet_calls[True] > 500  # most steps after the dark pairs' measurement were quiet
    assert [r.step for r in records.items] == [*chosen, 1499]  # (and close()'s final record)
    assert stats.steps == 1500
    assert stats.dark_steps == reference.statistics().dark_steps > 0
    assert stats.sampling_interval == reference.interval
    if not jitter:
        assert reference.interval == 10


@pytest.mark.parametrize("every", [5, None], ids=["every=5", "governor"])
def test_a_bad_argument_on_a_quiet_step_raises_on_that_step(
    every: int | None, monkeypatch: pytest.MonkeyPatch, quiet_calls: collections.Counter[bool]
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(_observe, "_governor_clock", clock)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    kwargs = {"every": every} if every else {"overhead": BUDGET, "sentinel": ("loss",)}
    bad_calls = [
        ({"loss": "stack"}, "Expected `loss` to be a scalar"),
        ({"batch_size": 0}, "batch_size"),
        ({"outputs": torch.zeros(12, 3)}, "`outputs` and `targets` together"),
        ({"outputs": [0.0], "targets": torch.zeros(12)}, "`outputs` to be a torch.Tensor"),
    ]
    with sw.observe(model, opt, **kwargs) as watch:
        governor = watch._governor
        steps = 0
        for kwargs_bad, message in bad_calls:
            for x, y in _batches(200):  # until the next step end may be quiet
                if watch._state.quiet and steps > 20:
                    break
                clock.advance(PLAIN * (1 + COST) if governor is not None and governor.sampling else PLAIN)
                loss, _ = _train(model, opt, x, y)
                watch.step(loss=loss)
                steps += 1
            assert watch._state.quiet > 0
            loss, _ = _train(model, opt, *next(_batches(1)))
            call = {"loss": loss, **kwargs_bad}
            if call["loss"] == "stack":
                call["loss"] = torch.stack([loss, loss])
            with pytest.raises((TypeError, ValueError), match=message):
                watch.step(**call)
            steps += 1
        stats = watch.statistics()
    assert quiet_calls[True] > 0
    assert stats.failed_steps == len(bad_calls)
    assert stats.steps == steps


def test_a_bad_layout_on_a_quiet_step_is_refused_at_the_next_full_boundary(
    quiet_calls: collections.Counter[bool],
) -> None:
    """Layouts (which need the shapes) are checked at full boundaries; a quiet step checks the types only.
    With ``every=4``, steps 1, 2, 5, 6 and 9 end quietly; step 7 ends at a full boundary (the next step is
    sampled: its hooks go in), which refuses the layout, naming the shapes; so does sampled step 8 (no
    record), and step 9 is quiet again."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    records = sw.sinks.collect()
    with sw.observe(model, opt, every=4, sinks=[records]) as watch:
        bad = torch.zeros(12, 3, 5, 5)  # targets that fit no layout with [12, 3] outputs
        refused, messages = [], []
        for step, (x, y) in enumerate(_batches(10)):
            loss, out = _train(model, opt, x, y)
            try:
                watch.step(loss=loss, outputs=out, targets=y if step < 5 else bad)
            except ValueError as err:
                refused.append(step)
                messages.append(str(err))
        stats = watch.statistics()
    assert quiet_calls[True] == 5
    assert refused == [7, 8]
    assert all("[12, 3]" in message for message in messages)
    assert [r.step for r in records.items] == [0, 4, 9]  # (9: close()'s final record, quiet step 9's)
    assert stats.failed_steps == 2


LOSS_FORMS: dict[str, Callable[[float], object]] = {
    "float32": lambda v: torch.tensor(v),  # the C check at data_ptr()
    "float64": lambda v: torch.tensor(v, dtype=torch.float64),  # the C check too
    "bfloat16": lambda v: torch.tensor(v, dtype=torch.bfloat16),  # item()
    "one-element": lambda v: torch.tensor([v]),  # item(): not 0-d
    "view": lambda v: torch.tensor([0.0, v])[1],  # a 0-d view at an offset: data_ptr() includes it
    "float": lambda v: v,
}


@pytest.fixture(params=["fused", "torch"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """With the compiled module's finiteness checks, and with STREAMWATCH_KERNEL=torch (item() only)."""
    if request.param == "torch":
        monkeypatch.setenv("STREAMWATCH_KERNEL", "torch")
    elif _kernel.scalar_reader() is None:
        pytest.skip("the compiled module is not built")
    return str(request.param)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("form", list(LOSS_FORMS))
def test_a_non_finite_loss_on_a_quiet_step_raises_on_that_step(bad: float, form: str, kernel: str) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    make = LOSS_FORMS[form]
    with sw.observe(model, opt, every=50, on_nonfinite="raise") as watch:
        assert (watch._boundary._read_f32 is not None) is (kernel == "fused")
        for x, y in _batches(20):
            loss, _ = _train(model, opt, x, y)
            watch.step(loss=make(loss.item()))
        assert watch._state.quiet > 0  # (the finite losses above were quiet steps)
        assert watch.statistics().steps == 20
        with pytest.raises(sw.NonFiniteError, match="step 20"):
            watch.step(loss=make(bad))


def test_a_plain_cpu_loss_is_read_without_item_on_quiet_steps(
    monkeypatch: pytest.MonkeyPatch, quiet_calls: collections.Counter[bool], kernel: str
) -> None:
    """The quiet step's look at a 0-d float CPU loss is one C call; ``Tensor.item()`` (a dispatch through
    torch) only where that module is not there."""
    items = collections.Counter[str]()
    item = torch.Tensor.item

    def counted(self: torch.Tensor) -> object:
        items["item"] += 1
        return item(self)

    monkeypatch.setattr(torch.Tensor, "item", counted)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with sw.observe(model, opt, every=50) as watch:
        per_quiet_step = []
        for x, y in _batches(40):
            loss, _ = _train(model, opt, x, y)
            before, quiet_before = items["item"], quiet_calls[True]
            watch.step(loss=loss)
            if quiet_calls[True] > quiet_before:
                per_quiet_step.append(items["item"] - before)
    assert len(per_quiet_step) >= 35
    assert set(per_quiet_step) == ({0} if kernel == "fused" else {1})


def test_an_evaluation_pass_in_a_quiet_stretch_is_recorded_with_its_step(
    quiet_calls: collections.Counter[bool],
) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    records = sw.sinks.collect()
    with sw.observe(model, opt, every=100, sinks=[records]) as watch:
        for step, (x, y) in enumerate(_batches(30)):
            loss, _ = _train(model, opt, x, y)
            if step == 17:
                model.eval()
                with torch.no_grad():
                    evaluated = model(x)
                model.train()
            watch.step(loss=loss)
        watch.flush()
    assert quiet_calls[True] > 20
    assert [r.step for r in records.items] == [0, 17, 29]  # (29: close()'s final record)
    eval_record = records.items[1]
    assert {key.phase for key in eval_record.keys} == {"eval"}
    key = next(k for k in eval_record.keys if k.layer == "2" and k.kind == "activation")
    row = eval_record.keys.index(key)
    assert eval_record.stat("mean")[row] == pytest.approx(evaluated.double().mean().item(), rel=1e-5)


def test_a_device_loss_or_an_int_loss_takes_the_full_boundary() -> None:
    """What the quiet path does not handle falls back to the full boundary: same results."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with sw.observe(model, opt, every=10) as watch:
        for x, y in _batches(3):
            _train(model, opt, x, y)
            watch.step(loss=2)  # an int: accepted as a number
        stats = watch.statistics()
    assert stats.steps == 3
    assert stats.failed_steps == 0


# -- dark pairs -------------------------------------------------------------------------------------------


def _governed(
    monkeypatch: pytest.MonkeyPatch, **kwargs: object
) -> tuple[nn.Module, torch.optim.Optimizer, sw.Watch, FakeClock]:
    clock = FakeClock()
    monkeypatch.setattr(_observe, "_governor_clock", clock)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    options: dict = {"overhead": BUDGET, "sentinel": ("loss",), **kwargs}
    return model, opt, sw.observe(model, opt, **options), clock


def _until_dark(watch: sw.Watch, model: nn.Module, opt: torch.optim.Optimizer, clock: FakeClock) -> int:
    """Train until the next step runs dark; the steps trained."""
    governor = watch._governor
    assert governor is not None
    for step, (x, y) in enumerate(_batches(3_000)):
        if watch._boundary._dark:
            return step
        clock.advance(PLAIN * (1 + COST) if governor.sampling else PLAIN)
        loss, _ = _train(model, opt, x, y)
        watch.step(loss=loss)
    raise AssertionError("no dark pair in 3000 steps")


def test_dark_pairs_run_without_any_streamwatch_hook_and_end_with_both_boundaries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    records = sw.sinks.collect()
    model, opt, watch, clock = _governed(monkeypatch, sinks=[records])
    governor = watch._governor
    assert governor is not None
    hookless = 0
    with watch:
        for x, y in _batches(1500):
            if not root_seen(model):
                hookless += 1
                assert watch._boundary._dark  # (no hook only in a dark pair)
                model.eval()  # an evaluation pass in a dark step: not summarised, counted
                with torch.no_grad():
                    model(x)
                model.train()
            clock.advance(PLAIN * (1 + COST) if governor.sampling else PLAIN)
            loss, _ = _train(model, opt, x, y)
            watch.step(loss=loss, batch_size=12)
        watch.flush()
        stats = watch.statistics()
    assert stats.dark_steps == hookless == 2 * DARK_PAIRS
    assert stats.skipped == {"dark_step": hookless}
    assert not any(k.phase == "eval" for r in records.items for k in r.keys)
    assert stats.steps == 1500
    assert stats.failed_steps == 0
    assert not root_seen(model)  # (closed: every hook out)
    assert governor.unseen_ratio == 0.0  # (the fake clock gave dark steps the lit steps' time)
    # sampled records only (no scalar record: < 1 s), and close()'s final record of the last step
    assert all(r.keys for r in records.items[:-1] if r.step > 0)
    assert records.items[-1].step == 1499
    assert not records.items[-1].keys


def test_a_bad_argument_in_a_dark_step_is_raised_one_boundary_later(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, watch, clock = _governed(monkeypatch)
    with watch:
        steps = _until_dark(watch, model, opt, clock)
        loss, _ = _train(model, opt, *next(_batches(1)))
        watch.step(loss=loss, batch_size=0)  # the first dark step only keeps its arguments
        with pytest.raises(ValueError, match="batch_size"):
            watch.step(loss=loss)  # the second runs both boundaries
        assert root_seen(model)  # the root module is seen again
        stats = watch.statistics()
    assert stats.failed_steps == 1
    assert stats.steps == steps + 2


def test_a_nan_in_a_dark_step_trips_the_sentinel_for_that_step(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, watch, clock = _governed(monkeypatch, on_nonfinite="raise")
    with watch:
        steps = _until_dark(watch, model, opt, clock)
        watch.step(loss=math.nan)
        with pytest.raises(sw.NonFiniteError, match=f"step {steps}"):
            watch.step(loss=1.0)


@pytest.mark.parametrize("crossed_in", [1, 2])
def test_the_time_ceiling_crossed_in_a_dark_pair_samples_the_next_step(
    monkeypatch: pytest.MonkeyPatch, crossed_in: int
) -> None:
    model, opt, watch, clock = _governed(monkeypatch)
    governor = watch._governor
    assert governor is not None
    with watch:
        steps = _until_dark(watch, model, opt, clock)
        before = governor.statistics()  # (the pair's two steps counted as dark already)
        batches = _batches(3)
        for dark in range(1, crossed_in + 1):  # the step that crosses the deadline is a long one
            clock.advance(governor.deadline - clock() if dark == crossed_in else PLAIN)
            loss, _ = _train(model, opt, *next(batches))
            watch.step(loss=loss)
        assert not watch._boundary._dark  # the pair is over: at the crossing, not a step later
        assert root_seen(model)  # (the root module is seen again)
        assert governor.sampling  # the time ceiling samples the step that begins now
        clock.advance(PLAIN * (1 + COST))
        loss, _ = _train(model, opt, *next(batches))
        watch.step(loss=loss)
        stats = watch.statistics()
    assert stats.steps == steps + crossed_in + 1
    assert governor.statistics().sampled == before.sampled + 1
    assert stats.dark_steps == before.dark_steps - 2 + crossed_in  # a pair cut short: one dark step


def test_both_refusals_in_a_dark_pair_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, watch, clock = _governed(monkeypatch)
    with watch:
        steps = _until_dark(watch, model, opt, clock)
        loss, _ = _train(model, opt, *next(_batches(1)))
        watch.step(loss=loss, batch_size=0)
        with pytest.raises(ValueError, match="got 0") as raised:
            watch.step(loss=loss, batch_size=-3)
        stats = watch.statistics()
    assert any("refused too" in note and "got -3" in note for note in raised.value.__notes__)
    assert stats.failed_steps == 2
    assert stats.steps == steps + 2


def test_a_dark_pairs_first_step_reads_its_loss_when_called(monkeypatch: pytest.MonkeyPatch) -> None:
    # a loop that keeps its loss in one buffer, overwritten in place each step: the first dark step's
    # NaN must be seen as that step's, not replaced by the next step's value before its boundary runs
    model, opt, watch, clock = _governed(monkeypatch, on_nonfinite="raise")
    buffer = torch.zeros(())
    with watch:
        steps = _until_dark(watch, model, opt, clock)
        buffer.fill_(math.nan)
        watch.step(loss=buffer)
        buffer.fill_(1.0)
        with pytest.raises(sw.NonFiniteError, match=f"step {steps}"):
            watch.step(loss=buffer)
        stats = watch.statistics()
    assert stats.sentinel_trips == 1


def test_a_dark_steps_train_accuracy_is_its_own_with_buffers_overwritten_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # outputs and labels kept in buffers the loop overwrites each step: the first dark step's scalar
    # record (due at every boundary here) must score that step's predictions, not the next step's
    monkeypatch.setattr(_boundary, "SCALAR_SECONDS", 0.0)
    records = sw.sinks.collect()
    model, opt, watch, clock = _governed(monkeypatch, sinks=[records])
    governor = watch._governor
    assert governor is not None
    outputs, labels = torch.zeros(12, 3), torch.zeros(12, dtype=torch.long)
    truth = {}
    with watch:
        for step, (x, y) in enumerate(_batches(1500)):
            clock.advance(PLAIN * (1 + COST) if governor.sampling else PLAIN)
            loss, _ = _train(model, opt, x, y)
            outputs.zero_()
            outputs[:, 1] = 1.0  # predicts class 1 for every sample
            labels.zero_()
            labels[: step % 13] = 1  # so step % 13 predictions are right
            truth[step] = float(step % 13)
            watch.step(loss=loss, outputs=outputs, targets=labels, batch_size=12)
        watch.flush()
        stats = watch.statistics()
    assert stats.dark_steps > 0
    scored = {r.step: r.scalars["correct"] for r in records.items}
    assert len(scored) > 1000  # (a record at nearly every boundary)
    assert scored == {step: truth[step] for step in scored}


def test_no_dark_pair_follows_a_loss_it_could_not_read_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # a float64 loss (or one of shape [1], or on a device) is read by torch at the boundary: a dark
    # pair's first step could not read it when called, so the governor's asks are declined
    model, opt, watch, clock = _governed(monkeypatch)
    governor = watch._governor
    assert governor is not None
    with watch:
        for x, y in _batches(1500):
            clock.advance(PLAIN * (1 + COST) if governor.sampling else PLAIN)
            loss, _ = _train(model, opt, x, y)
            watch.step(loss=loss.double())
        stats = watch.statistics()
    assert stats.steps == 1500
    assert stats.dark_steps == 0
    assert governor.statistics().dark_steps == 0


def test_closing_after_a_dark_pairs_first_step_raises_its_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, watch, clock = _governed(monkeypatch, on_nonfinite="raise")
    records = watch.statistics()
    steps = _until_dark(watch, model, opt, clock)
    watch.step(loss=math.nan)  # the last step: nothing after it but close()
    with pytest.raises(sw.NonFiniteError, match=f"step {steps}"):
        watch.close()
    assert watch.closed
    assert not root_seen(model)
    assert watch.statistics().steps == steps + 1 > records.steps
    # the same inside a with block whose body failed: the body's exception stays, ours is a note
    model, opt, watch, clock = _governed(monkeypatch, on_nonfinite="raise")

    def loop() -> None:
        with watch:
            _until_dark(watch, model, opt, clock)
            watch.step(loss=math.nan)
            raise KeyError("the loop's own error")

    with pytest.raises(KeyError) as raised:
        loop()
    assert any("non-finite" in note for note in raised.value.__notes__)
    assert not root_seen(model)


def test_a_negated_view_loss_is_recorded_with_its_sign() -> None:
    # z.conj().imag is a 0-d float32 view whose memory holds +2 and whose value is -2 (torch's neg bit)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    records = sw.sinks.collect()
    loss = torch.tensor(1 + 2j, dtype=torch.complex64).conj().imag
    assert loss.is_neg()
    assert loss.item() == -2.0
    with sw.observe(model, opt, every=1, sinks=[records]) as watch:
        _train(model, opt, *next(_batches(1)))
        watch.step(loss=loss)
    assert [r.scalars["loss"] for r in records.items] == [loss.item()]


def test_closing_in_a_dark_pair_runs_its_first_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, watch, clock = _governed(monkeypatch)
    steps = _until_dark(watch, model, opt, clock)
    watch.step(loss=1.0)
    assert "_compiled_call_impl" in model.__dict__  # (the dark pair's bare entry, counting evaluations)
    watch.close()
    assert watch.statistics().steps == steps + 1
    assert "_compiled_call_impl" not in model.__dict__  # (nothing left in the slot)
    assert not root_seen(model)


def test_a_dark_pairs_first_call_is_counted_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # statistics().steps counts watch.step() calls, also while a dark pair's first boundary waits for its
    # second (a run that stops there, or a reader in between, sees every call)
    model, opt, watch, clock = _governed(monkeypatch)
    with watch:
        steps = _until_dark(watch, model, opt, clock)
        watch.step(loss=1.0)
        assert watch._boundary._dark == 1  # (in the pair: the first boundary has not run)
        assert watch.statistics().steps == steps + 1
        watch.step(loss=1.0)
        assert not watch._boundary._dark
        assert watch.statistics().steps == steps + 2


def test_training_is_bit_identical_through_dark_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    def train(watched: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        clock = FakeClock()
        monkeypatch.setattr(_observe, "_governor_clock", clock)
        # (the sentinel's gradient-norm trial is timed on the real clock: on a loaded machine it may keep
        # the check, whose device-free probe still makes every step's end a full one: no dark pair)
        watch = sw.observe(model, opt, overhead=BUDGET, sentinel=("loss",)) if watched else None
        for _ in range(600):
            x, y = torch.randn(12, 6), torch.randint(0, 3, (12,))
            if watch is not None and watch._governor is not None:
                clock.advance(PLAIN * (1 + COST) if watch._governor.sampling else PLAIN)
            loss, _ = _train(model, opt, x, y)
            if watch is not None:
                watch.step(loss=loss)
        if watch is not None:
            assert watch.statistics().dark_steps > 0
            watch.close()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(train(False), train(True), strict=True):
        assert torch.equal(a, b)


def test_a_dark_pair_counts_only_streamwatch_time_as_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step's boundary runs at the second's: its own time starts then, not at its reading
    (which would count the user's whole second step as streamwatch's)."""
    model, opt, watch, clock = _governed(monkeypatch)
    with watch:
        _until_dark(watch, model, opt, clock)
        before = watch.statistics().overhead_seconds_total
        watch.step(loss=1.0)
        time.sleep(0.05)  # the user's second dark step
        watch.step(loss=1.0)
        spent = watch.statistics().overhead_seconds_total - before
    assert 0 < spent < 0.025


def test_a_dark_pairs_logged_values_stay_with_their_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # watch.log() before each end of a dark pair: both boundaries run at the second end, and each must
    # ship its own step's values (the first's were taken by the second's, and the second had none)
    records = sw.sinks.collect()
    model, opt, watch, clock = _governed(monkeypatch, sinks=[records])
    with watch:
        steps = _until_dark(watch, model, opt, clock)
        for k in range(3):
            loss, _ = _train(model, opt, *next(_batches(1)))
            watch.log(mark=float(steps + k), only_first=1.0) if k == 0 else watch.log(mark=float(steps + k))
            watch.step(loss=loss)
    logged = {s.step: dict(s.scalars) for r in records.items for s in r.every_step() if s.step >= steps}
    assert [logged[steps + k].get("log/mark") for k in range(3)] == [steps, steps + 1, steps + 2]
    assert [("log/only_first" in logged[steps + k]) for k in range(3)] == [True, False, False]


# -- a device loss ------------------------------------------------------------------------------------------


class _ProbesKept(Sentinel):
    """A sentinel whose device batches are kept, not launched: the quiet path's device-loss handling
    observed on the CPU with ``meta`` tensors (a loss that is not on the CPU, with no data to read)."""

    def __init__(self) -> None:
        super().__init__(grad_norm=False, batch=4, batch_seconds=math.inf)
        self.batches: list[list[int]] = []
        self._pinned, self._events = self._allocate()  # (allocated once, at the first probe: here first)

    def _allocate(self) -> tuple[torch.Tensor, list[object]]:
        return torch.zeros((self.slots, self.batch + 1), dtype=torch.float64), []

    def _queue(self) -> None:
        batch, self._probes = self._probes, []
        assert all(probe.device.type == "meta" and probe.ndim == 0 for _, probe in batch)
        self.batches.append([step for step, _ in batch])


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_a_device_loss_ends_a_quiet_step_with_a_view_for_the_sentinel_and_the_step_log(
    quiet_calls: collections.Counter[bool],
) -> None:
    """A 0-d loss on a device no longer makes every step's end a full boundary: the quiet step hands
    a view of it (``aten.detach``: no kernel, no copy, no read) to the sentinel, which checks it with its
    batch, and to the step log, which ships it with the next record's one copy."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    watch = sw.observe(model, opt, every=1000, sentinel=("loss",))
    sentinel = _ProbesKept()
    watch._boundary.guard.sentinel = sentinel
    x, y = next(iter(_batches(1)))
    loss, _ = _train(model, opt, x, y)
    watch.step(loss=loss)  # step 0: sampled, a CPU loss (a meta one could not be copied to the host)
    losses, counted = [], _Ops()
    for _ in range(9):
        _train(model, opt, x, y)
        losses.append(torch.tensor(0.5, device="meta", requires_grad=True) * 1)  # (a graph's output)
        with counted:
            watch.step(loss=losses[-1])
    assert quiet_calls[True] == 9
    assert counted.ops == ["aten.detach"] * 9  # one view per step: nothing launched, nothing read
    assert sentinel.batches == [[1, 2, 3, 4], [5, 6, 7, 8]]  # (step 9 waits for its batch)
    entries = watch._boundary._outbox.steps.entries
    assert [entry[0] for entry in entries] == list(range(1, 10))
    for entry, loss_now in zip(entries, losses, strict=True):
        kept = entry[3]
        assert isinstance(kept, torch.Tensor)
        assert kept.device.type == "meta"
        assert not kept.requires_grad
        assert kept is not loss_now  # (detached: the graph is not kept alive by the log)
    assert watch.statistics().steps == 10
    entries.clear()  # (meta values cannot be copied to the host: the record's copy is tested on CUDA)
    sentinel._probes.clear()
    watch.close()


def test_a_dark_pair_may_follow_a_device_loss() -> None:
    assert dark_ready(torch.tensor(0.5, device="meta"))
    assert dark_ready(torch.tensor(0.5, device="meta", dtype=torch.bfloat16))
    assert not dark_ready(torch.tensor([0.5], device="meta"))  # (shape [1]: read one call late)
    assert not dark_ready(torch.tensor(1, device="meta"))  # (an integer loss: the full boundary's)
    assert not dark_ready(torch.tensor(0.5, dtype=torch.float64))  # (a CPU float64: read by torch later)


class _RingInFlight(Sentinel):
    """A sentinel whose batches of ``meta`` probes are "copied" into a host ring at once, flags from
    ``bad`` (the steps to report as failed), with events the test completes by hand: copies in flight
    across quiet steps, observed on the CPU."""

    def __init__(self, bad: set[int], high: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        super().__init__(grad_norm=False, batch=4, batch_seconds=math.inf)
        self.bad = bad
        self.high = high  # steps whose loss reads 100.0 (the others 0.5)
        self.done: list[bool] = [False] * self.slots
        self._pinned, self._events = self._allocate()
        self._free = list(range(self.slots))

    def _allocate(self) -> tuple[torch.Tensor, list[object]]:
        return torch.zeros((self.slots, self.batch + 1), dtype=torch.float64), [
            types.SimpleNamespace(query=lambda slot=slot: self.done[slot]) for slot in range(self.slots)
        ]

    def _queue(self) -> None:
        batch, self._probes = self._probes, []
        steps = [step for step, _ in batch]
        slot = self._free.pop()
        values = [math.nan if step in self.bad else 100.0 if step in self.high else 0.5 for step in steps]
        self._pinned[slot, : len(steps)] = torch.tensor(values)  # type: ignore[index]
        self.done[slot] = False
        self._pending.append((slot, steps))

    def complete(self) -> None:
        self.done = [True] * self.slots


def test_a_device_loss_batch_in_flight_leaves_the_steps_quiet_and_a_failed_step_is_reported(
    quiet_calls: collections.Counter[bool],
) -> None:
    """A batch's copy in flight no longer makes the next steps full boundaries: a quiet step polls the
    events (no wait) and frees what completed. A failed step read that way ends the quiet run at once:
    the full boundary reports it."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    watch = sw.observe(model, opt, every=1000, sentinel=("loss",))
    sentinel = _RingInFlight(bad={6})
    watch._boundary.guard.sentinel = sentinel
    x, y = next(iter(_batches(1)))
    loss, _ = _train(model, opt, x, y)
    watch.step(loss=loss)  # step 0: sampled, a CPU loss

    def device_step() -> None:
        _train(model, opt, x, y)
        watch.step(loss=torch.tensor(0.5, device="meta"))

    try:
        for _ in range(5):  # steps 1-5: the batch of 1-4 goes into flight at step 4
            device_step()
        assert [steps for _, steps in sentinel._pending] == [[1, 2, 3, 4]]
        assert quiet_calls == {True: 5}  # (step 5 polled a copy still in flight)
        sentinel.complete()
        device_step()  # step 6 polls: 1-4 were finite, their slot is free again
        assert sentinel._pending == collections.deque()
        assert quiet_calls == {True: 6}
        for _ in range(2):  # steps 7-8: the batch of 5-8 (6 fails) in flight
            device_step()
        assert quiet_calls == {True: 8}
        assert sentinel.quiet_poll()  # (not completed: nothing known yet)
        sentinel.complete()
        assert not sentinel.quiet_poll()  # completed: step 6 read, kept for the next check
        assert not sentinel.takes_quiet_probes
        assert sentinel.check(9, None, ()) == [6]  # (as the full boundary's check reports it)
        assert sentinel.takes_quiet_probes
    finally:
        sentinel._probes.clear()
        watch._boundary._outbox.steps.entries.clear()  # (meta values cannot be copied to the host)
        watch.close()


def test_a_device_loss_past_the_spike_line_ends_the_quiet_run_with_a_scalar_record(
    quiet_calls: collections.Counter[bool],
) -> None:
    """A device loss is compared with LossSpike's line when the sentinel reads its batch (no sync): a
    quiet step that reads one past it stops, and that step's full boundary sends the step log in a
    scalar record at once (the detectors judge the spike there), as for a CPU loss past the line."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    watch = sw.observe(model, opt, every=1000, sentinel=("loss",))
    sentinel = _RingInFlight(bad=set(), high={3})
    sentinel.alarm = watch._boundary.guard.alarm
    watch._boundary.guard.sentinel = sentinel
    x, y = next(iter(_batches(1)))
    loss, _ = _train(model, opt, x, y)
    watch.step(loss=loss)  # step 0: sampled, a CPU loss
    assert watch.flush()  # (its record judged: LossSpike posts no line after it that could replace ours)
    sent: list[tuple[int, bool]] = []
    outbox = watch._boundary._outbox
    real_send = outbox.send
    outbox.send = lambda step, *args, **kwargs: sent.append((step, args[4]))  # type: ignore[method-assign]
    watch._boundary.guard.alarm.post_line(10.0)  # (as LossSpike posts it after a record)

    def device_step() -> None:
        _train(model, opt, x, y)
        watch.step(loss=torch.tensor(0.5, device="meta"))

    try:
        for _ in range(5):  # steps 1-5: the batch of 1-4 (step 3's loss 100) in flight from step 4
            device_step()
        assert quiet_calls == {True: 5}
        assert sent == []
        sentinel.complete()
        device_step()  # step 6 reads the batch: step 3 passed the line
        assert quiet_calls == {True: 5, False: 1}
        assert sent == [(6, False)]  # a scalar record (no layer rows) at once, shipping steps 1-5's values
        device_step()
        assert quiet_calls == {True: 6, False: 1}  # (and quiet again)
    finally:  # (what the boundary sends is captured: meta values cannot be copied to the host)
        sentinel._probes.clear()
        outbox.steps.entries.clear()
        outbox.send = real_send  # type: ignore[method-assign]
        watch.close()
