"""The divergence benchmark's harness: train a scenario under a watch, find where it diverged, judge.

**The ground truth: one criterion** (:func:`divergence_step`), applied to the run's own losses. With
``W = 10`` and ``K = 2``, let ``M(t)`` be the median of the losses of steps ``t - W + 1 .. t`` (the trailing
window) and ``B(t)`` the lowest ``M(s)`` of the windows that ended at least ``W`` steps before (``s <= t -
W``): the best smoothed level the run had reached. The run *diverges* at the first step ``t`` whose loss is
not finite, or with ``M(t) > K * B(t)``: its smoothed loss has at least doubled from the best it had
reached. A median of ten ignores a few bad batches (a noisy run does not diverge by a spike), and the
comparison with the best level rather than the first losses judges a run that had learned something and lost
it (a dying-ReLU collapse back to chance) the same as one whose loss blows up.

**Judging a detector.** A detector *fires* at a step when its spike (``Drift``: alarm) counter rises on that
step's value (``UpdateRatioBand``: a layer out of its band). What matters to a person is when the alert can
be known: the step of the record that carried the value to the worker (under the governor an unsampled
step's loss rides with a later record: :attr:`Firing.known`). A scenario's fault starts at its stated onset;
the warning is the first firing known between the onset and the divergence step, the lead the steps from it
to the divergence; a firing before the onset (or on a control, any firing) is a false alarm. No firing known
by the divergence step is *missed*.

The detectors run after the run on the records it sent (the same pure functions of records as the watch's
own, pushed one step at a time so each firing is placed on its step); Lightning's ``SpikeDetection`` (its
defaults, the real class) and a plain rolling z-score see the same run's losses, one step at a time.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import streamwatch as sw
from streamwatch import detectors

WINDOW = 10
"""W: the trailing window whose median is the smoothed loss."""

FACTOR = 2.0
"""K: diverged when the smoothed loss exceeds K times the best smoothed loss reached before."""

AFTER = 20
"""Steps trained past the divergence step (the detectors' late firings are not needed beyond that)."""

ZSCORE_WINDOW = 50
ZSCORE_THRESHOLD = 3.0
"""The plain z-score: the loss against the mean and standard deviation of the 50 steps before it, > 3."""


def divergence_step(losses: Sequence[float], window: int = WINDOW, factor: float = FACTOR) -> int | None:
    """The first step at which ``losses`` diverged by the criterion above, or None.

    >>> divergence_step([1.0] * 30 + [2.5] * 10)
    35
    >>> divergence_step([1.0] * 30 + [float("nan")]), divergence_step([1.0, 5.0] * 30)
    (30, None)
    """
    if window < 1 or factor <= 1:
        raise ValueError(f"Expected `window` >= 1 and `factor` > 1, got {window} and {factor}")
    best = math.inf
    medians: list[float] = []
    for t, loss in enumerate(losses):
        if not math.isfinite(loss):
            return t
        if t + 1 < window:
            continue
        medians.append(float(np.median(losses[t + 1 - window : t + 1])))
        ended = len(medians) - 1 - window  # the window that ended W steps before this one
        if ended >= 0:
            best = min(best, medians[ended])
            if medians[-1] > factor * best:
                return t
    return None


@dataclass
class Trace:
    """One scenario trained once under one watch configuration."""

    losses: list[float]
    records: list[sw.StepRecord]
    divergence: int | None
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def train(scenario: Any, watch_options: dict[str, Any] | None, after: int = AFTER) -> Trace:
    """Train ``scenario`` (fresh, from its seed) under ``observe(model, opt, **watch_options)`` (None: no
    watch), up to its ``steps`` or ``after`` steps past the divergence step; the watch's records are kept."""
    import time

    run = scenario.build()
    records = sw.sinks.collect()
    watch = None
    if watch_options is not None:
        # the detectors run live too, as in a user's watch: their alarms escalate sampling, which changes
        # when later records arrive (judging below is on the records, by fresh detectors)
        live = [*detectors.DEFAULT_DETECTORS, detectors.Drift()]
        watch = sw.observe(run.model, run.optimizer, sinks=[records], detectors=live, **watch_options)
    losses: list[float] = []
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the sentinel's non-finite warnings: diverging is the point
            for t in range(scenario.steps):
                loss = run.step(t)
                if watch is not None:
                    watch.step(loss=loss)
                losses.append(float(loss))
                found = divergence_step(losses)
                if found is not None and t >= found + after:
                    break
    finally:
        if watch is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                watch.close()
    seconds = time.perf_counter() - start
    return Trace(losses, list(records.items), divergence_step(losses), seconds)


# -- firings ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Firing:
    """A detector fired on step ``step``'s value, known to the worker when the record of step ``known``
    arrived (``known == step`` for a sampled step's own values)."""

    step: int
    known: int


def _counts(samples: Iterable[sw.Sample]) -> tuple[float, bool]:
    spikes, out = 0.0, False
    for s in samples:
        if s.name.endswith(("_spikes", "_alarms")):  # (a chain's samples: counters without _total)
            spikes += s.value
        elif s.name == "streamwatch_update_ratio_out_of_band" and s.value != 0:
            out = True
    return spikes, out


def detector_firings(detector: detectors.Detector, records: Sequence[sw.StepRecord]) -> list[Firing]:
    """Where ``detector`` fires on ``records``: each record's steps pushed one at a time through the
    detector's own chain (:meth:`Detector.chain`), its spike counters (or out-of-band values) read after
    each."""
    outputs: list[list[sw.Sample]] = []
    pipeline = sw.source() | detector.chain() | sw.sinks.callback(outputs.append)
    firings: list[Firing] = []
    before = 0.0
    for record in records:
        for item in record.every_step():
            outputs.clear()
            pipeline.push(item)
            if not outputs:
                continue
            spikes, out = _counts(outputs[-1])
            if spikes > before or out:
                firings.append(Firing(item.step, record.step))
            before = spikes
    pipeline.close()
    return firings


def spike_detection_firings(losses: Sequence[float]) -> list[Firing]:
    """Lightning's ``SpikeDetection`` with its defaults (the installed class's own ``_is_spike`` and
    ``_update_stats``, as its ``on_train_batch_end`` calls them, less the barrier and the raise: a
    spike ends a Lightning run, here it is counted and the run goes on)."""
    from lightning.pytorch.callbacks import SpikeDetection

    spike = SpikeDetection()
    firings = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t, value in enumerate(losses):
            loss = torch.tensor(value)
            if t >= spike.warmup and spike._is_spike(loss):
                firings.append(Firing(t, t))
            elif spike.finite_only:
                spike._update_stats(loss)
    return firings


def zscore_firings(
    losses: Sequence[float], window: int = ZSCORE_WINDOW, threshold: float = ZSCORE_THRESHOLD
) -> list[Firing]:
    """A plain z-score: the loss against the mean and (sample) standard deviation of the ``window``
    finite losses before it; fires above ``threshold`` or on a non-finite loss."""
    firings, history = [], []
    for t, loss in enumerate(losses):
        if not math.isfinite(loss):
            firings.append(Firing(t, t))
            continue
        if len(history) >= window:
            recent = np.asarray(history[-window:])
            sd = recent.std(ddof=1)
            if sd > 0 and (loss - recent.mean()) / sd > threshold:
                firings.append(Firing(t, t))
        history.append(loss)
    return firings


# -- verdicts --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """A detector on a scenario: ``lead`` steps of warning before the divergence (None: missed, or a
    control), ``false_alarms`` firings before the onset (on a control: all of them)."""

    lead: int | None
    false_alarms: int
    diverged: bool

    def cell(self) -> str:
        fa = f" ({self.false_alarms} fa)" if self.false_alarms and self.diverged else ""
        if not self.diverged:
            return "0 fa" if not self.false_alarms else f"**{self.false_alarms} fa**"
        return ("**missed**" if self.lead is None else str(self.lead)) + fa


def verdict(firings: Sequence[Firing], onset: int | None, divergence: int | None) -> Verdict:
    """Judge ``firings`` against a scenario's onset and its measured divergence step."""
    if onset is None or divergence is None:
        return Verdict(None, len(firings), False)
    false_alarms = sum(1 for f in firings if f.step < onset)
    warned = [f.known for f in firings if f.step >= onset and f.known <= divergence]
    lead = divergence - min(warned) if warned else None
    return Verdict(lead, false_alarms, True)


Judge = Callable[[Trace], list[Firing]]
