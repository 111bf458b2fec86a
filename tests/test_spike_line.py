"""A loss spike on an unsampled step reaches the detectors at that step, not with the next record.

``LossSpike`` posts its spike line (``mean + threshold * scale`` of its baseline) to the watch after
each record; the training thread compares each step's CPU loss with it (one float comparison) and sends
a step whose loss passes it in a scalar record at once. Each test trains a real model and compares what
arrives with the losses the loop saw and with the plain reference of ``tests/test_detectors.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import streamwatch as sw
import streamwatch._boundary as boundary
from streamwatch import detectors
from streamwatch._detectors import Baseline, Values
from streamwatch._guard import Alarm
from tests.test_detectors import C, batches, mlp, reference

SPIKE = 60


class Arrivals:
    """Each record as the worker gets it: its step, the unsampled steps it carries, whether it has rows."""

    def __init__(self) -> None:
        self.records: list[tuple[int, list[int], bool]] = []

    def __call__(self, record: sw.StepRecord) -> None:
        self.records.append((record.step, [s.step for s in record.steps], bool(record.keys)))

    def steps(self) -> list[int]:
        return [step for step, _, _ in self.records]


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    watch: sw.Watch,
    data: Iterator[tuple[torch.Tensor, torch.Tensor]],
    *,
    as_float: bool,
    flush_at: tuple[int, ...],
) -> list[float]:
    """The loop: SGD on the MLP; ``watch.flush()`` after the steps ``flush_at``, so that the worker has
    judged the records sent so far (the line it posts, its alarm, are then known to the test)."""
    losses = []
    for i, (x, y) in enumerate(data):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        watch.step(loss=loss.item() if as_float else loss)
        if i in flush_at:
            watch.flush()
    return losses


def run(
    monkeypatch: pytest.MonkeyPatch, *, spike: int | None, as_float: bool = False, **options: object
) -> tuple[Arrivals, list[float], sw.Watch]:
    monkeypatch.setattr(boundary, "SCALAR_SECONDS", 1e9)  # (no once-a-second record: only the line's)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    arrivals = Arrivals()
    with sw.observe(model, opt, every=25, **options) as watch:  # type: ignore[arg-type]
        watch.pipe(sw.source() | sw.sinks.callback(arrivals))
        losses = train(
            model, opt, watch, batches(80, spike_at=spike), as_float=as_float, flush_at=(55, SPIKE)
        )
    return arrivals, losses, watch


@pytest.mark.parametrize("as_float", [False, True], ids=["tensor", "float"])
def test_a_spike_on_an_unsampled_step_is_sent_and_judged_at_that_step(
    monkeypatch: pytest.MonkeyPatch, as_float: bool
) -> None:
    arrivals, losses, watch = run(monkeypatch, spike=SPIKE, as_float=as_float)
    # the line the worker posted after the record of step 50 (the last before the flush at 55)
    ref = reference(losses[:51], kind="z", threshold=6.0)
    line = ref.mean + 6.0 * max(C * ref.dev, 1e-9 * max(abs(ref.mean), 1.0))
    assert max(losses[51:SPIKE]) < line < losses[SPIKE]  # (only the spike passes it)
    _step, carried, rows = arrivals.records[arrivals.steps().index(SPIKE)]
    assert carried == list(range(51, SPIKE))
    assert not rows
    assert arrivals.steps()[:3] == [0, 25, 50]
    # LossSpike fired on it, and its alarm escalated: every step from then on is sampled in full. From step
    # 62 as a rule (the worker judges the spike's record while step 60's boundary decides step 61's
    # sampling); from step 61 when the worker's alarm lands before that decision (seen once, on a loaded
    # machine): both are the escalation working, a thread's timing apart
    escalated = [s for s, _, rows in arrivals.records if s > SPIKE and rows]
    assert escalated in (list(range(SPIKE + 2, 80)), list(range(SPIKE + 1, 80)))
    assert watch.statistics().escalations >= 1
    assert watch.statistics().scalar_records == 1  # (the spike's: none once a second here; 79 escalated)
    everything = reference(losses, kind="z", threshold=6.0)
    assert [i for i, z in enumerate(everything.scores) if z is not None and z > 6] == [SPIKE]


def test_steps_under_the_line_wait_for_the_next_record(monkeypatch: pytest.MonkeyPatch) -> None:
    arrivals, _losses, watch = run(monkeypatch, spike=None)
    assert arrivals.steps() == [0, 25, 50, 75, 79]  # (79: the last step, shipped at close)
    assert all(not carried or carried[-1] == step - 1 for step, carried, _ in arrivals.records)
    assert watch.statistics().escalations == 0
    assert watch.statistics().scalar_records == 1  # (step 79's, at close)


def test_without_loss_spike_no_line_is_posted(monkeypatch: pytest.MonkeyPatch) -> None:
    arrivals, _losses, _ = run(monkeypatch, spike=SPIKE, detectors=(detectors.GradientSpike(),))
    assert SPIKE not in arrivals.steps()  # (the spike rides with the record of step 75)
    assert [step for step, carried, _ in arrivals.records if SPIKE in carried] == [75]


def test_the_spike_line_is_the_references_upper_bound() -> None:
    """``LossSpike.spike_line``: inf while warming up, then exactly where z passes the threshold."""
    spike = detectors.LossSpike(threshold=4.0, warmup=5)
    xs = [1.0, 1.2, 0.9, 1.1, 1.05, 0.95, 1.3]
    state = Baseline.empty()
    for i, x in enumerate(xs):
        line = spike.spike_line(state)
        assert line == math.inf if i < 5 else math.isfinite(line)  # (the warm-up: no line)
        state = spike.fold(state, Values(("",), (x,)))
    ref = reference(xs, kind="z", threshold=4.0, warmup=5)
    line = spike.spike_line(state)
    assert line == pytest.approx(ref.mean + 4.0 * C * ref.dev, rel=1e-12)
    # a value at the line scores the threshold; just past it, a spike
    above = spike.fold(state, Values(("",), (math.nextafter(line, math.inf),)))
    assert above.spikes[0] == 1
    assert spike.fold(state, Values(("",), (line - 1e-9,))).spikes[0] == 0


def test_a_device_loss_is_never_read_for_the_line() -> None:
    class State:
        quiet = 0

    alarm = Alarm(State())
    alarm.post_line(1.0)
    assert alarm.crossed(2.0)
    assert alarm.crossed(torch.tensor(2.0))
    assert alarm.crossed(torch.tensor([2.0]))
    assert not alarm.crossed(torch.tensor(2.0, device="meta"))  # (not on the CPU: no sync, no read)
    assert not alarm.crossed(torch.tensor([2.0, 3.0]))
    assert not alarm.crossed(None)
    assert not alarm.crossed(0.5)
    assert not alarm.crossed(math.nan)
