"""The Drift detector (streamwatch/_drift.py, docs/detectors.md): its CUSUM against a plain reference
written from the formulas, every step under the governor equal to every=1, and what it skips."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streamwatch as sw
from streamwatch import detectors
from streamwatch._detectors import check_detectors
from streamwatch._record import StepRecord, StepScalars
from streamwatch.testing import table

C = math.sqrt(math.pi / 2)


def reference(xs: list[float | None], h: float = 10.0, k: float = 0.5, alpha: float = 0.05, warmup: int = 20):
    """(the sum after each value, alarms after each value) on log(x); None/non-finite/≤0 skipped."""
    mean, dev, n, s, alarms = 0.0, 0.0, 0, 0.0, 0
    sums, counts = [], []
    for raw in xs:
        if raw is None or not math.isfinite(raw) or raw <= 0:
            sums.append(None)
            counts.append(alarms)
            continue
        x = math.log(raw)
        entering = x
        if n >= warmup:
            scale = max(C * dev, 1e-9 * max(abs(mean), 1.0))
            s = max(0.0, s + min((x - mean) / scale, 6.0) - k)
            if s > h:
                alarms, s = alarms + 1, 0.0
            entering = float(np.clip(x, mean - 6 * scale, mean + 6 * scale))
        if n > 0:
            dev += max(alpha, 1 / n) * (abs(entering - mean) - dev)
        mean += max(alpha, 1 / (n + 1)) * (entering - mean)
        n += 1
        sums.append(s if n > warmup else None)
        counts.append(alarms)
    return sums, counts


def drifting(n: int, start: int, rate: float, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    noise = np.exp(0.1 * rng.standard_normal(n))
    return (noise * np.where(np.arange(n) >= start, rate ** (np.arange(n) - start), 1.0)).tolist()


def records(losses: list[float | None], every: int, norms: list[float] | None = None) -> list[StepRecord]:
    """Records of a run sampled every ``every`` steps, each carrying the steps before it; the last step
    is always a record (close()'s)."""
    out, carried = [], []
    for step, loss in enumerate(losses):
        scalars = {} if loss is None else {"loss": loss}
        if norms is not None:
            scalars["log/grad_norm"] = norms[step]
        if step % every and step != len(losses) - 1:
            carried.append(StepScalars(step, 0.0, scalars))
            continue
        out.append(StepRecord(step, 0.0, 0, (), table(0), scalars, steps=tuple(carried)))
        carried = []
    return out


def served(detector: detectors.Detector, items: list[StepRecord]) -> dict[tuple[str, str], float]:
    store = sw.SeriesStore(metrics=())
    pipeline = detector.pipeline(store)
    for r in items:
        pipeline.push(r)
    return {(s.name, s.labels.get("series", "")): s.value for s in store.samples() if "drift" in s.name}


@pytest.mark.parametrize("seed", range(3))
def test_the_cusum_equals_the_reference_step_by_step(seed: int) -> None:
    losses: list[float | None] = list(drifting(160, 100, 1.03, seed))
    losses[30], losses[50], losses[70] = None, math.nan, -1.0  # skipped, never read as zero
    sums, counts = reference(losses)
    out: list[list[sw.Sample]] = []
    pipeline = sw.source() | detectors.Drift().chain() | sw.sinks.callback(out.append)
    for r in records(losses, 1):
        before = len(out)
        pipeline.push(r)
        if len(out) == before:
            out.append([])
    got_sums = [next((s.value for s in o if s.name == "streamwatch_drift_cusum"), None) for o in out]
    got_counts = [next((s.value for s in o if s.name == "streamwatch_drift_alarms"), None) for o in out]
    skipped = {30, 50, 70}
    for i, (g, e) in enumerate(zip(got_sums, sums, strict=True)):
        if i not in skipped:
            assert (g is None and e is None) or g == pytest.approx(e, rel=1e-12), i
    assert [o for i, o in enumerate(out) if i in skipped] == [[], [], []]
    assert [g for i, g in enumerate(got_counts) if i not in skipped] == [
        c for i, c in enumerate(counts) if i not in skipped
    ]
    assert counts[99] == 0  # quiet before the drift
    assert counts[-1] >= 1  # and alarms on it
    first = counts.index(1)
    assert 100 < first < 130


@pytest.mark.parametrize("every", [3, 25, 1000])
def test_every_step_is_read_whatever_the_sampling(every: int) -> None:
    losses = drifting(200, 120, 1.04, 5)
    norms = drifting(200, 150, 1.1, 6)
    assert served(detectors.Drift(), records(losses, every, norms)) == served(
        detectors.Drift(), records(losses, 1, norms)
    )
    sums, counts = reference(losses)
    got = served(detectors.Drift(), records(losses, every, norms))
    assert got[("streamwatch_drift_alarms", "loss")] == counts[-1] >= 1
    assert got[("streamwatch_drift_cusum", "loss")] == pytest.approx(sums[-1], rel=1e-12)
    assert got[("streamwatch_drift_alarms", "grad_norm")] == reference(norms)[1][-1] >= 1


def test_a_single_spike_never_alarms_alone() -> None:
    losses = drifting(100, 1000, 1.0, 2)
    losses[60] *= 1e6
    assert reference(losses)[1][-1] == 0
    assert served(detectors.Drift(), records(losses, 1))[("streamwatch_drift_alarms", "loss")] == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"threshold": 0}, r"^Expected `threshold` to be a finite number > 0, got 0$"),
        ({"slack": -1.0}, r"^Expected `slack` to be a finite number >= 0, got -1.0$"),
        ({"alpha": 2.0}, r"^Expected `alpha` to be a number in \(0, 1\], got 2.0$"),
        ({"warmup": 1}, r"^Expected `warmup` to be an integer >= 2"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        detectors.Drift(**kwargs)


def test_in_a_watch_under_the_governor_and_every_step_alike() -> None:
    results = []
    for every in (None, 1):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        found = [*detectors.DEFAULT_DETECTORS, detectors.Drift()]
        with sw.observe(model, opt, every=every, detectors=found) as watch:
            for step in range(150):
                x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
                scale = 1.0 if step < 100 else 1.05 ** (step - 100)  # the inputs drift: the loss climbs
                loss = F.cross_entropy(model(scale * x), y)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                watch.step(loss=loss)
        results.append(
            {(s.name, s.labels.get("series")): s.value for s in watch.snapshot() if "drift" in s.name}
        )
    assert results[0] == results[1]
    assert set(results[0]) == {
        ("streamwatch_drift_alarms", "loss"),
        ("streamwatch_drift_cusum", "loss"),
        ("streamwatch_drift_alarms", "grad_norm"),
        ("streamwatch_drift_cusum", "grad_norm"),
    }
    assert results[0][("streamwatch_drift_alarms", "loss")] >= 1


def test_drift_is_a_detector_like_the_others() -> None:
    assert detectors.Drift() in check_detectors([detectors.LossSpike(), detectors.Drift()])
    assert dataclasses.is_dataclass(detectors.Drift)
    with pytest.raises(ValueError, match="two"):
        check_detectors([detectors.Drift(), detectors.Drift(threshold=4)])


@pytest.mark.parametrize("detector", ["LossSpike", "Drift"])
def test_a_detector_firing_on_an_unsampled_step_escalates_sampling(detector: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    records = sw.sinks.collect()
    chosen = [detectors.LossSpike()] if detector == "LossSpike" else [detectors.Drift()]
    bad = range(45, 46) if detector == "LossSpike" else range(41, 50)  # a spike, or a climb
    with sw.observe(model, opt, every=10, escalate=5, detectors=chosen, sinks=[records]) as watch:
        for step in range(80):
            x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
            scale = 1.0 if step not in bad else (30.0 if detector == "LossSpike" else 1.6 ** (step - 40))
            loss = F.cross_entropy(model(scale * x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            watch.step(loss=loss)
            if step % 10 == 0 or step == 45:
                watch.flush()  # the worker has judged every step up to this record before the next step
        stats = watch.statistics()
    sampled = [r.step for r in records.items if r.keys]
    assert stats.escalations == 1
    if detector == "LossSpike":
        # the spike passed LossSpike's line: step 45 was sent at once (a scalar record) and judged at the
        # flush, after step 46's sampling was decided: 47-51 in full
        assert [r.step for r in records.items if not r.keys][:1] == [45]
        first = 47
    else:  # a climb under the line: judged when step 50's record arrived, after step 51's sampling
        first = 52
    escalated_steps = list(range(first, first + 5))
    assert sampled == sorted({0, 10, 20, 30, 40, 50, 60, 70, *escalated_steps})
    escalated = [r for r in records.items if first <= r.step < first + 5]
    assert all({"activation", "param_grad", "param", "update"} <= {k.kind for k in r.keys} for r in escalated)
    assert stats.sentinel_trips == 0


def test_no_alarm_no_escalation_and_escalate_0_turns_it_off() -> None:
    for escalate, bad in ((100, None), (0, 45)):
        torch.manual_seed(0)
        model = nn.Linear(8, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with sw.observe(model, opt, every=10, escalate=escalate) as watch:
            for step in range(60):
                scale = 30.0 if step == bad else 1.0
                loss = F.cross_entropy(model(scale * torch.randn(16, 8)), torch.randint(0, 3, (16,)))
                opt.zero_grad()
                loss.backward()
                opt.step()
                watch.step(loss=loss)
                if step % 10 == 0:
                    watch.flush()
            stats = watch.statistics()
        assert stats.escalations == 0
        assert stats.sampled == 6
