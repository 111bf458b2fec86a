"""The divergence benchmark's harness (benchmarks/divergence/): its ground-truth criterion, its judging of
firings, and one real scenario end to end at a few hundred steps. No timing: ``make bench-divergence``
measures; this proves the harness says what it claims."""

from __future__ import annotations

import doctest
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "divergence"))

import harness
import scenarios

from streamwatch import detectors


def reference_divergence(losses: list[float], w: int = 10, k: float = 2.0) -> int | None:
    """The criterion written out again, plainly: every step, every earlier window, from scratch."""
    for t in range(len(losses)):
        if not math.isfinite(losses[t]):
            return t
        if t < 2 * w - 1:
            continue
        current = np.median(losses[t - w + 1 : t + 1])
        best = min(np.median(losses[s - w + 1 : s + 1]) for s in range(w - 1, t - w + 1))
        if current > k * best:
            return t
    return None


def test_harness_doctests_pass() -> None:
    assert doctest.testmod(harness).failed == 0


@pytest.mark.parametrize("seed", range(6))
def test_divergence_step_matches_the_plain_criterion(seed: int) -> None:
    rng = np.random.default_rng(seed)
    falling = 2.0 * np.exp(-np.arange(200) / 60) + 0.3 + 0.1 * rng.standard_normal(200) ** 2
    losses = falling.tolist()
    if seed % 2:  # a divergence: the loss climbs from a random step on
        start = int(rng.integers(60, 150))
        losses[start:] = (np.asarray(losses[start:]) * np.exp(np.arange(200 - start) / 15)).tolist()
    if seed == 4:
        losses[120] = math.nan
    expected = reference_divergence(losses)
    assert harness.divergence_step(losses) == expected
    assert (expected is not None) == (seed % 2 == 1 or seed == 4)


def test_divergence_ignores_a_few_spikes_and_rejects_bad_arguments() -> None:
    losses = [1.0] * 100
    for t in (30, 31, 32, 33, 60):  # four bad batches in a row and one more: the median of ten holds
        losses[t] = 50.0
    assert harness.divergence_step(losses) is None
    with pytest.raises(ValueError, match=r"^Expected `window` >= 1 and `factor` > 1, got 10 and 1$"):
        harness.divergence_step(losses, factor=1)


def test_verdicts_place_firings_against_onset_and_divergence() -> None:
    firings = [harness.Firing(50, 50), harness.Firing(120, 125), harness.Firing(140, 140)]
    assert harness.verdict(firings, 100, 150) == harness.Verdict(25, 1, True)  # warned when known, at 125
    assert harness.verdict(firings, 100, 124) == harness.Verdict(None, 1, True)  # known too late: missed
    assert harness.verdict(firings, None, None) == harness.Verdict(None, 3, False)  # a control: all false
    assert harness.Verdict(None, 1, True).cell() == "**missed** (1 fa)"
    assert harness.Verdict(None, 0, False).cell() == "0 fa"


def test_baselines_fire_on_a_jump() -> None:
    losses = [1.0 + 0.01 * (t % 3) for t in range(80)] + [10.0]
    assert harness.zscore_firings(losses) == [harness.Firing(80, 80)]
    assert harness.spike_detection_firings(losses) == [harness.Firing(80, 80)]
    assert harness.zscore_firings([1.0] * 10 + [math.inf]) == [harness.Firing(10, 10)]


def test_a_scenario_diverges_where_the_criterion_says_and_detectors_are_judged() -> None:
    scenario = next(s for s in scenarios.SCENARIOS if s.name == "corrupt_batches")
    bare = harness.train(scenario, None, after=3)
    watched = harness.train(scenario, {"every": 1}, after=3)
    assert watched.losses == bare.losses  # monitoring never changes training
    d = bare.divergence
    assert d is not None
    assert scenario.onset is not None
    assert scenario.onset <= d < scenario.onset + 20
    assert d == reference_divergence(bare.losses)
    assert len(bare.losses) == d + 4
    assert [r.step for r in watched.records] == list(range(len(bare.losses)))
    firings = harness.detector_firings(detectors.LossSpike(), watched.records)
    warned = [f for f in firings if f.step >= scenario.onset]
    assert warned[0] == harness.Firing(scenario.onset, scenario.onset)  # the first corrupt batch
    early = sum(f.step < scenario.onset for f in firings)
    assert harness.verdict(firings, scenario.onset, d) == harness.Verdict(d - scenario.onset, early, True)


def test_scenarios_are_reproducible() -> None:
    scenario = next(s for s in scenarios.SCENARIOS if s.name == "fp16_overflow")
    first, second = scenario.build(), scenario.build()
    assert [float(first.step(t)) for t in range(5)] == [float(second.step(t)) for t in range(5)]
