"""The overhead governor, driven by a fake clock and synthetic step times: no real timing anywhere.

The reference values are computed here from the definitions, never by running the governor: the
smallest interval that meets the budget is ``ceil(r / budget)``, and the realised overhead of a run is
``r`` × the fraction of steps that were sampled.
"""

from __future__ import annotations

import math
import random
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import FrozenInstanceError, dataclass, field
from itertools import pairwise

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from streamwatch._governor import (
    CALIBRATION_INTERVAL,
    DARK_DRIFT,
    DARK_PAIRS,
    FLOOR_WINDOW,
    QUIET_MAX,
    Governor,
    GovernorStatistics,
)
from streamwatch.testing import FakeClock

PLAIN = 0.01  # seconds per plain step
# The documented adaptation bound (module docstring, *Adaptation*): with the default windows the
# interval is within 1 of its new value at most 80 + 8 * N steps after a change, N the larger interval,
# plus one measurement of the floor's unseen part (4 steps per dark pair) where the step time moved by
# DARK_DRIFT or more.
REACTION_BASE, REACTION_PER_STEP = 80, 8


def reaction_bound(old: int, new: int, slowdown: float = 1.0) -> int:
    remeasured = not 1 / DARK_DRIFT < slowdown < DARK_DRIFT
    return REACTION_BASE + REACTION_PER_STEP * max(old, new) + (4 * DARK_PAIRS if remeasured else 0)


def smallest_interval(ratio: float, budget: float) -> int:
    """The reference: the smallest N >= 1 with ratio / N <= budget."""
    n = 1
    while ratio / n > budget * (1 + 1e-12):
        n += 1
    return n


@dataclass
class Run:
    """What a driven governor did: one entry per step."""

    sampled: list[bool] = field(default_factory=list)
    intervals: list[int] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)  # when each step began
    seconds: list[float] = field(default_factory=list)  # how long each step took

    def realised_overhead(self, ratio: float, start: int = 0) -> float:
        """The cost monitoring had over steps ``start:``, given that a sampled step costs ``ratio``."""
        sampled = self.sampled[start:]
        return ratio * sum(sampled) / len(sampled)

    def gaps(self) -> list[int]:
        """Steps between the starts of consecutive sampled steps."""
        at = [i for i, s in enumerate(self.sampled) if s]
        return [b - a for a, b in pairwise(at)]


StepTime = Callable[[int, bool, bool], float]  # (step, sampled, previous step sampled) -> seconds


def drive(gov: Governor, clock: FakeClock, steps: int, step_time: StepTime, run: Run | None = None) -> Run:
    run = run if run is not None else Run()
    previous = run.sampled[-1] if run.sampled else False
    for i in range(len(run.sampled), len(run.sampled) + steps):
        sampled = gov.sampling
        seconds = step_time(i, sampled, previous)
        run.sampled.append(sampled)
        run.starts.append(clock())
        run.seconds.append(seconds)
        clock.advance(seconds)
        gov.tick()
        run.intervals.append(gov.interval)
        previous = sampled
    return run


def costing(ratio: float, plain: float = PLAIN) -> StepTime:
    """A sampled step takes ``1 + ratio`` plain steps."""
    return lambda _i, sampled, _previous: plain * (1 + ratio) if sampled else plain


def settle_steps(interval: int) -> int:
    return 2_000 + 40 * interval


# -- arguments ----------------------------------------------------------------------------------------


BUDGET = "a number in (0, 1) (0.02 is 2 %)"
SECONDS = "a finite number of seconds > 0"
BAD_ARGUMENTS: list[tuple[str, object, str]] = [
    ("budget", 0, BUDGET),
    ("budget", 1.0, BUDGET),
    ("budget", math.nan, BUDGET),
    ("budget", True, BUDGET),
    ("max_interval", 0, "an integer >= 1"),
    ("max_interval", 10.0, "an integer >= 1"),
    ("max_seconds", 0.0, SECONDS),
    ("max_seconds", math.inf, SECONDS),
    ("warmup", -1, "an integer >= 0"),
    ("baseline_window", 0, "an integer >= 1"),
    ("cost_window", 0, "an integer >= 1"),
    ("probe", 0, "an integer >= 1"),
    ("dark_pairs", -1, "an integer >= 0"),
]


@pytest.mark.parametrize(
    ("name", "value", "expected"), BAD_ARGUMENTS, ids=[f"{n}={v!r}" for n, v, _ in BAD_ARGUMENTS]
)
def test_bad_arguments_are_refused_by_name(name: str, value: object, expected: str) -> None:
    message = f"^Expected `{name}` to be {re.escape(expected)}, got {re.escape(repr(value))}$"
    with pytest.raises(ValueError, match=message):
        Governor(**{name: value})  # type: ignore[arg-type]


def test_a_clock_must_be_callable() -> None:
    with pytest.raises(TypeError, match=r"^Expected `clock` to be a callable returning seconds, got 3$"):
        Governor(clock=3)  # type: ignore[arg-type]


# -- start-up -----------------------------------------------------------------------------------------


def test_the_first_step_is_sampled_and_nothing_is_claimed_before_it_is_measured() -> None:
    gov = Governor(clock=FakeClock())
    assert gov.sampling
    assert gov.interval == CALIBRATION_INTERVAL
    assert (gov.cost_ratio, gov.overhead_ratio, gov.step_seconds) == (None, None, None)
    stats = gov.statistics()
    assert (stats.steps, stats.sampled, stats.rejected) == (0, 1, 0)


def test_warmup_steps_are_not_measured() -> None:
    clock = FakeClock()
    gov = Governor(0.02, clock=clock, warmup=5, max_seconds=1e6)
    slow_start: StepTime = lambda i, _s, _p: 100.0 if i < 5 else PLAIN  # noqa: E731
    drive(gov, clock, 6, slow_start)  # steps 0-4 are warm-up; 5 is the first clean one measured
    assert gov.step_seconds == pytest.approx(PLAIN)


def test_calibration_samples_one_step_in_three_until_it_has_measurements() -> None:
    clock = FakeClock()
    gov = Governor(0.02, clock=clock, warmup=0)
    run = drive(gov, clock, 6, costing(0.2))
    assert run.sampled == [True, False, False, True, False, False]


# -- the interval meets the budget --------------------------------------------------------------------


@pytest.mark.parametrize("budget", [0.01, 0.02, 0.05])
@pytest.mark.parametrize("ratio", [0.01, 0.2, 1.0, 5.0])
def test_converges_to_the_smallest_interval_that_meets_the_budget(ratio: float, budget: float) -> None:
    clock = FakeClock()
    gov = Governor(budget, clock=clock)
    expected = smallest_interval(ratio, budget)
    steps = settle_steps(expected)
    run = drive(gov, clock, steps, costing(ratio))
    assert gov.interval == expected
    assert gov.cost_ratio == pytest.approx(ratio)
    assert gov.overhead_ratio == pytest.approx(ratio / expected)
    realised = run.realised_overhead(ratio, start=steps // 2)
    assert realised <= budget * 1.03  # the mean gap is the interval, up to the end effects of the phases
    if expected > 1:  # not wastefully below: ceil(r / budget) leaves less than 1/N of the budget unused
        assert realised >= budget * (expected - 1) / expected * 0.97


@pytest.mark.parametrize(("ratio", "budget"), [(0.2, 0.02), (1.0, 0.05), (5.0, 0.02)])
def test_noisy_step_times_still_meet_the_budget(ratio: float, budget: float) -> None:
    rng = random.Random(7)
    clock = FakeClock()
    # (no dark pairs: this driver runs every step lit, so a measurement of the floor's unseen part would
    # read the noise alone, a floor of about one standard error (pinned by its own test below), and move
    # the interval by it: here the cost samples' noise is under test)
    gov = Governor(budget, clock=clock, dark_pairs=0)
    expected = smallest_interval(ratio, budget)

    def noisy(_i: int, sampled: bool, _previous: bool) -> float:
        return PLAIN * (1 + ratio if sampled else 1) * rng.uniform(0.95, 1.05)

    steps = settle_steps(expected) * 2
    run = drive(gov, clock, steps, noisy)
    assert budget * 0.8 <= run.realised_overhead(ratio, start=steps // 2) <= budget * 1.1
    assert abs(gov.interval - expected) <= max(1, 0.15 * expected)


def test_the_worker_time_in_the_shadow_step_is_part_of_the_cost() -> None:
    clock = FakeClock()
    gov = Governor(0.02, clock=clock)

    def spill(_i: int, sampled: bool, previous: bool) -> float:  # 0.1 in the sampled step, 0.1 after it
        return PLAIN * (1.1 if sampled else 1) + (PLAIN * 0.1 if previous and not sampled else 0)

    drive(gov, clock, 2_000, spill)
    assert gov.cost_ratio == pytest.approx(0.2)
    assert gov.interval == 10


def test_cheap_sampling_samples_nearly_every_step_but_keeps_probing_the_baseline() -> None:
    clock = FakeClock()
    gov = Governor(0.02, clock=clock, probe=8)
    run = drive(gov, clock, 2_000, costing(0.001))
    tail = run.sampled[500:]
    assert gov.interval == 1
    assert 0.7 <= sum(tail) / len(tail) < 1
    clean = [i for i in range(501, 2_000) if not run.sampled[i] and not run.sampled[i - 1]]
    assert max(b - a for a, b in pairwise(clean)) <= 8 + 2


# -- outliers -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ratio", "budget", "seed"),
    [(0.2, 0.02, seed) for seed in range(6)] + [(1.0, 0.05, 0), (1.0, 0.01, 7), (5.0, 0.02, 0)],
)
@pytest.mark.parametrize("pattern", ["random", "periodic"])
def test_one_step_in_twenty_fifty_times_slower_barely_moves_the_interval(
    ratio: float, budget: float, seed: int, pattern: str
) -> None:
    rng = random.Random(seed)
    expected = smallest_interval(ratio, budget)

    def stalls(i: int, sampled: bool, previous: bool) -> float:
        stalled = rng.random() < 1 / 20 if pattern == "random" else i % 20 == seed
        return costing(ratio)(i, sampled, previous) * (50 if stalled else 1)

    clock = FakeClock()
    gov = Governor(budget, clock=clock)
    steps = settle_steps(expected) * 2
    run = drive(gov, clock, steps, stalls)
    settled = run.intervals[steps // 4 :]
    off = sum(abs(n - expected) > 1 for n in settled)
    assert off <= 0.1 * len(settled)  # within 1 of the clean interval on 90 % of the steps ...
    assert max(settled) <= 2 * expected  # ... and never more than doubled (module docstring, *Outliers*)
    assert abs(gov.interval - expected) <= 1


def test_aliasing_with_a_periodic_slow_step_is_broken_by_the_phase_sequence() -> None:
    # every 10th step is 3x slower (say, an optimizer step after gradient accumulation); at a fixed
    # interval of 10 every sampled step would be one, or none would be
    clock = FakeClock()
    gov = Governor(0.02, clock=clock)

    def accumulate(i: int, sampled: bool, previous: bool) -> float:
        return costing(0.2)(i, sampled, previous) * (3 if i % 10 == 9 else 1)

    run = drive(gov, clock, 10_000, accumulate)
    phases = {i % 10 for i, s in enumerate(run.sampled[2_000:], start=2_000) if s}
    assert len(phases) >= 5
    assert 0.08 <= sum(run.sampled[2_000:]) / 8_000 <= 0.2


# -- adaptation ---------------------------------------------------------------------------------------


def settled_after(intervals: Sequence[int], target: int) -> int:
    """Steps until the interval is within 1 of ``target`` for good."""
    return max((i + 1 for i, n in enumerate(intervals) if abs(n - target) > 1), default=0)


@pytest.mark.parametrize(
    ("before", "after"),
    [
        pytest.param((PLAIN, 0.2), (2 * PLAIN, 0.1), id="steps-2x-slower-same-absolute-cost"),
        pytest.param((PLAIN, 0.2), (PLAIN / 2, 0.4), id="steps-2x-faster-same-absolute-cost"),
        pytest.param((PLAIN, 0.1), (PLAIN, 1.0), id="cost-10x"),
        pytest.param((PLAIN, 1.0), (PLAIN, 0.1), id="cost-tenth"),
        pytest.param((PLAIN, 0.1), (PLAIN, 5.0), id="cost-50x"),
        pytest.param((PLAIN, 5.0), (PLAIN, 0.1), id="cost-fiftieth"),
        pytest.param((PLAIN, 0.01), (PLAIN, 0.5), id="from-every-step"),
        pytest.param((PLAIN, 0.5), (PLAIN, 0.01), id="to-every-step"),
    ],
)
@pytest.mark.parametrize("budget", [0.02, 0.05])
def test_reacts_to_a_change_within_the_documented_bound(
    before: tuple[float, float], after: tuple[float, float], budget: float
) -> None:
    clock = FakeClock()
    gov = Governor(budget, clock=clock)
    old = smallest_interval(before[1], budget)
    drive(gov, clock, settle_steps(old), costing(before[1], plain=before[0]))
    assert gov.interval == old
    new = smallest_interval(after[1], budget)
    bound = reaction_bound(old, new, after[0] / before[0])
    run = drive(gov, clock, bound + 10 * new + 100, costing(after[1], plain=after[0]))
    assert settled_after(run.intervals, new) <= bound


@settings(max_examples=25, deadline=None)
@given(
    budget=st.sampled_from([0.01, 0.02, 0.05]),
    before=st.floats(min_value=0.005, max_value=2.0),
    factor=st.floats(min_value=1 / 50, max_value=50),
    slowdown=st.sampled_from([0.5, 1.0, 2.0]),
)
def test_any_change_is_followed_within_the_documented_bound(
    budget: float, before: float, factor: float, slowdown: float
) -> None:
    after = min(before * factor, 2.0)
    clock = FakeClock()
    gov = Governor(budget, clock=clock)
    old, new = smallest_interval(before, budget), smallest_interval(after, budget)
    drive(gov, clock, settle_steps(old), costing(before))
    bound = reaction_bound(old, new, slowdown)
    run = drive(gov, clock, bound + 10 * new + 100, costing(after, plain=PLAIN * slowdown))
    assert settled_after(run.intervals, new) <= bound


def test_a_change_that_slows_every_step_alike_keeps_the_interval() -> None:
    clock = FakeClock()
    gov = Governor(0.02, clock=clock)
    run = Run()
    for plain in (PLAIN, 2 * PLAIN, PLAIN / 4, PLAIN):  # a slower node, a shorter sequence, ...
        drive(gov, clock, 2_000, costing(0.2, plain=plain), run)
    assert set(run.intervals[1_000:]) == {10}


# -- ceilings -----------------------------------------------------------------------------------------


def test_max_interval_bounds_the_interval_and_every_gap() -> None:
    clock = FakeClock()
    gov = Governor(0.01, clock=clock, max_interval=50)
    run = drive(gov, clock, 5_000, costing(100.0))  # would need an interval of 10 000
    assert gov.interval == 50
    assert max(run.gaps()) <= 50
    assert gov.overhead_ratio == pytest.approx(100.0 / 50)  # honest: far above the budget


def test_max_seconds_bounds_the_time_between_sampled_steps() -> None:
    clock = FakeClock()
    gov = Governor(0.01, clock=clock, max_seconds=1.0)
    run = drive(gov, clock, 3_000, costing(5.0, plain=0.1))  # 500 steps would be 50 s
    assert gov.interval == 10  # as many 0.1 s steps as fit in a second
    starts = [t for t, s in zip(run.starts, run.sampled, strict=True) if s]
    assert max(b - a for a, b in pairwise(starts)) <= 1.0 + 0.1 * 6 + 1e-9


def test_a_step_longer_than_max_seconds_samples_the_next_one() -> None:
    clock = FakeClock()
    gov = Governor(0.01, clock=clock, max_seconds=5.0)
    drive(gov, clock, 2_000, costing(1.0))
    assert gov.interval == 100
    clock.advance(6.0)  # one long step, e.g. an evaluation between two training steps
    assert gov.tick()


# -- guards -------------------------------------------------------------------------------------------


class ScriptedClock:
    """Returns the readings it is given, in order, then the last one for ever."""

    def __init__(self, readings: Sequence[float]) -> None:
        self.readings = list(readings)
        self.now = 0.0

    def __call__(self) -> float:
        if self.readings:
            self.now = self.readings.pop(0)
        return self.now


class OddClock:
    """Reads ``clock``, but once in ``every`` readings ``odd(the previous reading)`` instead."""

    def __init__(self, clock: FakeClock, odd: Callable[[float], float], every: int) -> None:
        self.clock, self.odd, self.every = clock, odd, every
        self.reads, self.last = 0, clock()

    def __call__(self) -> float:
        self.reads += 1
        self.last = self.odd(self.last) if self.reads % self.every == 0 else self.clock()
        return self.last


@pytest.mark.parametrize(
    "odd",
    [
        pytest.param(lambda last: last, id="zero"),  # and the next step is read as two steps
        pytest.param(lambda last: last - PLAIN, id="negative"),
        pytest.param(lambda last: math.nan, id="nan"),
        pytest.param(lambda last: math.inf, id="inf"),
        pytest.param(lambda last: -math.inf, id="-inf"),
        pytest.param(lambda last: last + 1e300, id="huge-then-negative"),
    ],
)
def test_odd_step_times_are_ignored_and_counted(odd: Callable[[float], float]) -> None:
    clock = FakeClock()
    gov = Governor(0.02, clock=OddClock(clock, odd, every=50))
    drive(gov, clock, 3_000, costing(0.2))
    stats = gov.statistics()
    assert stats.rejected >= 3_000 // 50
    assert gov.interval == 10  # as without the odd readings
    assert gov.cost_ratio == pytest.approx(0.2)
    assert gov.step_seconds == pytest.approx(PLAIN)


def test_a_clock_that_jumps_back_does_not_postpone_the_time_ceiling() -> None:
    clock = FakeClock()
    offset = [0.0]
    gov = Governor(0.01, clock=lambda: clock() + offset[0], max_seconds=10.0)
    drive(gov, clock, 3_000, costing(50.0, plain=0.1))
    assert gov.interval == 100  # as many 0.1 s steps as fit in 10 s
    offset[0] = -1_000.0  # the clock is set back by 1000 s; from now on one step in 3 takes 5 s

    def uneven(i: int, sampled: bool, previous: bool) -> float:
        return 5.0 if i % 3 == 0 else costing(50.0, plain=0.1)(i, sampled, previous)

    run = drive(gov, clock, 300, uneven)
    starts = [t for t, s in zip(run.starts, run.sampled, strict=True) if s]
    assert starts[0] - run.starts[0] <= 5.0 + 10.0 + 5.0  # counted from the first reading after the jump
    assert max(b - a for a, b in pairwise(starts)) <= 10.0 + 5.0 + 1e-9


def test_a_stopped_clock_never_calibrates_and_still_samples() -> None:
    gov = Governor(0.02, clock=lambda: 5.0, max_interval=100)
    sampled = [gov.tick() for _ in range(300)]
    assert gov.statistics().rejected == 300
    assert gov.cost_ratio is None
    assert gov.interval == CALIBRATION_INTERVAL
    assert sum(sampled) == 100


def test_a_vanishing_baseline_divides_nothing_by_zero() -> None:
    # steps of the smallest positive float, then of a second: a quotient by the baseline overflows
    tiny = 5e-324
    readings = [i * tiny for i in range(40)] + [1.0 + i for i in range(40)]
    gov = Governor(0.02, clock=ScriptedClock(readings), max_interval=30, warmup=0)
    for _ in range(79):
        gov.tick()
        assert 1 <= gov.interval <= 30
    assert gov.step_seconds == tiny
    assert gov.cost_ratio == 0.0  # from the tiny steps; the infinite cost samples were not kept
    assert gov.overhead_ratio == 0.0


def test_a_huge_cost_ratio_reaches_the_ceiling_without_overflow() -> None:
    clock = FakeClock()
    gov = Governor(0.01, clock=clock, max_seconds=1e9)
    drive(gov, clock, 6_000, costing(1e12, plain=1e-9))
    assert gov.interval == 1_000
    assert gov.overhead_ratio == pytest.approx(1e12 / 1_000, rel=1e-3)


@settings(max_examples=60, deadline=None)
@given(
    times=st.lists(
        st.one_of(
            st.floats(min_value=0, max_value=10, allow_nan=False),
            st.sampled_from([0.0, 1e-9, PLAIN, 120.0]),
        ),
        min_size=1,
        max_size=400,
    ),
    sampled_extra=st.floats(min_value=0, max_value=50, allow_nan=False),
    budget=st.floats(min_value=1e-4, max_value=0.9),
    max_interval=st.integers(min_value=1, max_value=60),
    max_seconds=st.floats(min_value=1e-3, max_value=100),
    warmup=st.integers(min_value=0, max_value=6),
)
# A dark pair's first step crossing the time ceiling (found by CI): the pair ends, the next step is
# sampled; a ceiling crossed in its second step samples the step after it.
@example(
    times=[0.0] * 8 + [1.0] * 3 + [0.0] * 7 + [1.0] * 5 + [3.0, 1.0, 1.0, 3.0, 1.0, 1.0, 0, 0, 4.0, 0, 0],
    sampled_extra=9.0,
    budget=0.5,
    max_interval=8,
    max_seconds=14.0,
    warmup=0,
)
@example(
    times=[0.0] * 8 + [1.0] * 7 + [2.0] + [1.0] * 5 + [0.0, 1.0],
    sampled_extra=11.0,
    budget=0.5,
    max_interval=8,
    max_seconds=14.0,
    warmup=0,
)
def test_the_ceilings_hold_for_any_step_times(
    times: list[float],
    sampled_extra: float,
    budget: float,
    max_interval: int,
    max_seconds: float,
    warmup: int,
) -> None:
    clock = FakeClock()
    gov = Governor(budget, clock=clock, max_interval=max_interval, max_seconds=max_seconds, warmup=warmup)
    step_time: StepTime = lambda i, sampled, _p: times[i] * (1 + sampled_extra if sampled else 1)  # noqa: E731
    run = drive(gov, clock, len(times), step_time)
    assert all(1 <= n <= max_interval for n in run.intervals)
    assert all(gap <= max_interval for gap in run.gaps())
    at = [i for i, s in enumerate(run.sampled) if s]
    for a, b in pairwise(at):  # a sampled step begins within max_seconds of the last, plus one step
        assert run.starts[b] - run.starts[a] < max_seconds + run.seconds[b - 1] + 1e-9
    end = run.starts[-1] + run.seconds[-1]
    if not gov.sampling:  # since the last sampled step began, no boundary has crossed the ceiling
        last = run.starts[at[-1]]
        assert len(run.sampled) - at[-1] < max_interval
        assert all(t - last < max_seconds for t in [*run.starts[at[-1] + 1 :], end])
    stats = gov.statistics()
    for value in (stats.cost_ratio, stats.overhead_ratio, stats.step_seconds):
        assert value is None or (math.isfinite(value) and value >= 0)


@settings(max_examples=60, deadline=None)
@given(
    readings=st.lists(
        st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=-10, max_value=10)),
        max_size=200,
    )
)
def test_any_clock_readings_never_crash_or_leave_the_range(readings: list[float]) -> None:
    gov = Governor(0.02, clock=ScriptedClock([0.0, *readings]), max_interval=40)
    for _ in readings:
        gov.tick()
        assert 1 <= gov.interval <= 40
    stats = gov.statistics()
    assert stats.steps == len(readings)
    for value in (stats.cost_ratio, stats.overhead_ratio, stats.step_seconds):
        assert value is None or (math.isfinite(value) and value >= 0)


# -- what it reports ----------------------------------------------------------------------------------


def test_statistics_is_a_frozen_snapshot_of_the_properties() -> None:
    clock = FakeClock()
    gov = Governor(0.05, clock=clock)
    run = drive(gov, clock, 1_000, costing(1.0))
    stats = gov.statistics()
    assert isinstance(stats, GovernorStatistics)
    assert stats == GovernorStatistics(
        budget=0.05,
        interval=20,
        cost_ratio=pytest.approx(1.0),  # type: ignore[arg-type]
        overhead_ratio=pytest.approx(0.05),  # type: ignore[arg-type]
        floor_ratio=0.0,
        step_seconds=pytest.approx(PLAIN),  # type: ignore[arg-type]
        steps=1_000,
        sampled=sum(run.sampled) + gov.sampling,
        rejected=0,
        unseen_ratio=0.0,  # dark steps as long as lit ones: nothing unseen
        dark_steps=2 * DARK_PAIRS,  # one measurement, when the governor first calibrated
    )
    with pytest.raises(FrozenInstanceError):
        stats.interval = 3  # type: ignore[misc]


# -- the floor: what unsampled steps cost ------------------------------------------------------------


def drive_with_floor(
    gov: Governor, clock: FakeClock, steps: int, ratio: float, own: float, sampled_own: bool = True
) -> None:
    """Plain steps of ``PLAIN`` seconds of which ``own`` are the monitor's own; sampled steps cost
    ``ratio`` plain steps more (their own time ``own`` too, or 0 without ``sampled_own``)."""
    for _ in range(steps):
        sampled = gov.sampling
        clock.advance(PLAIN * (1 + ratio) if sampled else PLAIN)
        gov.tick(own if sampled_own or not sampled else 0.0)


@pytest.mark.parametrize(
    ("floor", "ratio", "budget"),
    [(0.005, 1.0, 0.02), (0.01, 0.5, 0.05), (0.0, 1.0, 0.05), (0.015, 1.9321, 0.02)],  # no N on a knife-edge
)
def test_the_floor_is_paid_first_and_sampling_gets_the_rest_of_the_budget(
    floor: float, ratio: float, budget: float
) -> None:
    clock = FakeClock()
    gov = Governor(budget, clock=clock)
    own = PLAIN * floor / (1 + floor)  # own / (PLAIN - own) == floor
    drive_with_floor(gov, clock, settle_steps(smallest_interval(ratio, budget - floor)), ratio, own)
    assert gov.floor_ratio == pytest.approx(floor)
    assert gov.interval == smallest_interval(ratio, budget - floor)
    assert gov.overhead_ratio == pytest.approx(floor + ratio / gov.interval)
    assert gov.overhead_ratio <= budget * (1 + 1e-9)


def test_a_floor_over_the_budget_samples_at_the_ceiling_and_says_so() -> None:
    clock = FakeClock()
    gov = Governor(0.02, max_interval=200, clock=clock)
    own = PLAIN * 0.03 / 1.03  # unsampled steps alone cost 3 %
    drive_with_floor(gov, clock, 20_000, 1.0, own)
    assert gov.interval == 200
    assert gov.overhead_ratio == pytest.approx(0.03 + 1.0 / 200)
    assert gov.statistics().floor_ratio == pytest.approx(0.03)


@pytest.mark.parametrize(("noise", "own", "interval"), [(0.0, 0.0, 1), (0.0, 0.1, 5), (0.3, 0.1, None)])
def test_a_sampled_steps_own_time_bounds_its_cost_where_step_times_hide_it(
    noise: float, own: float, interval: int | None
) -> None:
    """By the clock a sampled step costs nothing (no slower than a plain one, or lost in noise of
    ±30 % of a step); the monitor's own time in it (10 % of a step, measured exactly) still holds
    the interval where that cost fits the budget: ``ceil(0.1 / 0.02) = 5``, not 1."""
    clock = FakeClock()
    gov = Governor(0.02, clock=clock)
    rng = random.Random(3)
    for _ in range(3_000):
        sampled = gov.sampling
        clock.advance(PLAIN * (1 + noise * (2 * rng.random() - 1)))
        gov.tick(own=own * PLAIN if sampled else 0.0)
    assert gov.cost_ratio is not None
    if interval is not None:  # (no noise: exactly)
        assert gov.interval == interval
        assert gov.cost_ratio == pytest.approx(own)
    else:
        assert gov.cost_ratio >= 0.09
        assert gov.interval >= 5


@pytest.mark.parametrize("own", [-1.0, math.nan, math.inf, 1.5 * PLAIN, 2 * PLAIN])
def test_odd_own_times_never_become_a_floor(own: float) -> None:
    clock = FakeClock()
    gov = Governor(0.05, clock=clock)
    # (on unsampled steps only: 1.5 plain steps of own time in a sampled step of 2 would be a cost)
    drive_with_floor(gov, clock, 2_000, 1.0, own, sampled_own=False)
    assert gov.floor_ratio == 0.0
    assert gov.interval == 20


def test_repr_shows_the_budget_and_what_was_measured() -> None:
    clock = FakeClock()
    gov = Governor(0.05, clock=clock)
    assert repr(gov) == "<Governor budget=0.05 interval=3 cost_ratio=None overhead_ratio=None>"
    drive(gov, clock, 1_000, costing(1.0))
    assert re.fullmatch(r"<Governor budget=0\.05 interval=20 cost_ratio=1 overhead_ratio=0\.05>", repr(gov))


def test_the_global_random_state_is_untouched() -> None:
    state = random.getstate()
    clock = FakeClock()
    drive(Governor(0.02, clock=clock), clock, 2_000, costing(0.2))
    assert random.getstate() == state


# -- forced steps: sampled by someone else (the watch's escalation) ------------------------------------


def test_forced_steps_measure_nothing_and_their_shadows_are_not_clean() -> None:
    """An escalation samples every step in full for a while: those steps are slow and spend their time
    in the monitor's own code. Told so (``forced``), the governor takes none of them (nor the step after
    each, its shadow) as a clean step, a floor or a cost: the baseline, the floor, the cost and the
    interval come out of the episode exactly as they went in."""
    clock = FakeClock()
    gov = Governor(0.02, clock=clock)
    own = PLAIN * 0.005 / 1.005  # a floor of 0.5 %
    drive_with_floor(gov, clock, settle_steps(smallest_interval(1.0, 0.015)), 1.0, own)
    before = (gov.step_seconds, gov.floor_ratio, gov.cost_ratio, gov.interval)
    assert before == (
        pytest.approx(PLAIN),
        pytest.approx(0.005),
        pytest.approx(1.0),
        smallest_interval(1.0, 0.015),
    )
    escalated = 1000  # (long enough to fill two of the floor's blocks with clean steps, unforced)
    for _ in range(escalated):  # escalated: every step 5 plain steps long, 4 of them the monitor's own
        clock.advance(5 * PLAIN)
        gov.tick(4 * PLAIN, forced=True)
    clock.advance(3 * PLAIN)  # the shadow of the last one (worker time spilling over): not clean either
    gov.tick(own)
    after = (gov.step_seconds, gov.floor_ratio, gov.cost_ratio, gov.interval)
    assert after == before
    # unforced, the same episode moves the floor and the baseline (what the flag prevents)
    control = Governor(0.02, clock=(clock2 := FakeClock()))
    drive_with_floor(control, clock2, settle_steps(smallest_interval(1.0, 0.015)), 1.0, own)
    for _ in range(escalated):
        clock2.advance(5 * PLAIN)
        control.tick(4 * PLAIN)
    assert control.floor_ratio > 50 * before[1]  # the escalated steps moved the floor 0.5 % -> over 25 %


# -- filed step ends: the watch's quiet steps ------------------------------------------------------------


def drive_filing(
    gov: Governor, clock: FakeClock, steps: int, step_time: StepTime, own: Callable[[int], float]
) -> tuple[Run, int]:
    """Like :func:`drive`, but a step end is filed (not ticked) whenever the governor allows it, as the
    watch's quiet path does; returns the run and how many step ends were filed."""
    run, quiet, filed = Run(), 0, 0
    previous = False
    for i in range(steps):
        sampled = gov.sampling
        seconds = step_time(i, sampled, previous)
        run.sampled.append(sampled)
        run.starts.append(clock())
        clock.advance(seconds)
        reading = clock()
        if quiet and reading < gov.deadline:
            gov.filed.append((reading, own(i)))
            quiet -= 1
            filed += 1
        else:
            gov.tick(own(i))
            quiet = gov.quiet
        previous = sampled
    return run, filed


def test_filed_step_ends_are_measured_as_ticks() -> None:
    """Filing a step end instead of ticking changes nothing the governor decides or measures: the same
    steps are sampled and the same statistics come out (step times settle on one interval here, so no
    estimate moves inside a filed stretch)."""
    ticked_clock, filed_clock = FakeClock(), FakeClock()
    # (no dark pairs: when a measurement of the unseen part starts depends on when a tick looks)
    ticked = Governor(0.05, dark_pairs=0, clock=ticked_clock)
    filer = Governor(0.05, dark_pairs=0, clock=filed_clock)
    ticked_run = Run()
    steps = 3_000
    for i in range(steps):
        ticked_run.sampled.append(ticked.sampling)
        ticked_clock.advance(costing(0.5)(i, ticked.sampling, False))
        ticked.tick(0.0002)
    filed_run, filed = drive_filing(filer, filed_clock, steps, costing(0.5), lambda _i: 0.0002)
    assert filed > steps // 2  # most step ends were filed
    assert filed_run.sampled == ticked_run.sampled
    filer.tick(0.0002)  # (measures what is still filed)
    ticked.tick(0.0002)
    assert filer.statistics() == ticked.statistics()
    assert filer.floor_ratio == pytest.approx(0.0002 / (PLAIN - 0.0002))


def test_quiet_promises_only_unsampled_steps_within_the_cap() -> None:
    clock = FakeClock()
    gov = Governor(0.02, clock=clock)
    run, _ = drive_filing(gov, clock, 5_000, costing(1.0), lambda _i: 0.0)
    assert gov.interval == 50
    assert 0 <= gov.quiet <= QUIET_MAX
    gaps = run.gaps()[20:]  # filing never delays a sampled step: the gaps are the interval's
    assert statistics.fmean(gaps) == pytest.approx(50, rel=0.05)
    assert max(gaps) <= 50 + 50 // 4


def test_filed_steps_respect_the_time_ceiling() -> None:
    """A reading at or past ``deadline`` is ticked, not filed, so the time ceiling still samples it:
    here steps become 10x slower at once, while a stretch of filed step ends (measured only at the
    next tick) would otherwise carry the interval of the fast steps past the ceiling."""
    clock = FakeClock()
    gov = Governor(0.01, max_seconds=1.0, clock=clock)

    def step_time(i: int, sampled: bool, _previous: bool) -> float:
        plain = PLAIN if i < 2_000 else 10 * PLAIN
        return plain * 6 if sampled else plain

    run, filed = drive_filing(gov, clock, 3_000, step_time, lambda _i: 0.0)
    assert filed > 1_000
    at = [start for start, sampled in zip(run.starts, run.sampled, strict=True) if sampled]
    assert max(b - a for a, b in pairwise(at)) <= 1.0 + 10 * PLAIN + 1e-9  # (the step that crosses it)


def test_the_floor_is_the_mean_own_time_so_a_periodic_cost_counts() -> None:
    """Own time paid on one clean step in eight (the tick that measures filed step ends) counts in full:
    the floor is the mean own ratio, which a median would miss."""
    clock = FakeClock()
    gov = Governor(0.05, clock=clock)
    own = [0.0001] * 7 + [0.0009]
    drive_filing(gov, clock, 4_000, costing(0.5), lambda i: own[i % 8])
    expected = statistics.fmean(o / (PLAIN - o) for o in own)
    assert gov.floor_ratio == pytest.approx(expected, rel=0.1)
    assert gov.floor_ratio > 1.5 * statistics.median(o / (PLAIN - o) for o in own)


# -- dark steps: the floor's unseen part ------------------------------------------------------------------


def drive_dark(
    gov: Governor,
    clock: FakeClock,
    steps: int,
    ratio: float,
    unseen: float,
    decline: bool = False,
    plain: float = PLAIN,
    own: Callable[[Governor], float] = lambda _gov: 0.0,
) -> Run:
    """Steps of ``plain`` seconds (sampled ones ``ratio`` plain steps more), of which ``unseen`` are the
    monitor's cost its own time does not show and ``own(gov)`` its own time: a dark step (asked for with
    ``gov.dark``: this step and the next) takes ``plain - unseen - own``. Both step ends of a pair are
    ticked after it, with readings."""
    run, dark_left, readings = Run(), 0, []
    for _ in range(steps):
        sampled = gov.sampling
        run.sampled.append(sampled)
        dark = dark_left > 0
        mine = own(gov)
        clock.advance(plain - unseen - mine if dark else plain * (1 + ratio) if sampled else plain)
        if dark:
            readings.append(clock())
            dark_left -= 1
            if dark_left:
                continue
            for reading in readings:
                gov.tick(at=reading)
            readings = []
        else:
            gov.tick(mine)
        if gov.dark:
            if decline:
                gov.decline_dark()
            else:
                dark_left = 2
    return run


def test_dark_steps_measure_what_own_time_misses_and_the_floor_pays_it() -> None:
    clock = FakeClock()
    gov = Governor(0.02, clock=clock)
    unseen = 0.01 * PLAIN  # 1 % of a step that no own time shows (hook dispatch, cold caches)
    drive_dark(gov, clock, 3_000, 1.0, unseen)
    stats = gov.statistics()
    assert stats.dark_steps == 2 * DARK_PAIRS
    assert stats.unseen_ratio == pytest.approx(unseen / PLAIN)  # (no noise: no standard error to take off)
    assert stats.floor_ratio == pytest.approx(0.01)
    assert gov.interval == smallest_interval(1.0, 0.02 - 0.01)  # sampling gets the rest of the budget


def test_the_unseen_part_is_each_light_step_less_its_own_time() -> None:
    """The lit steps between dark pairs end at full boundaries (every step end ticks while a
    measurement runs), whose own time is larger than a quiet step's: each is taken less its own, not
    less the floor window's mean."""
    clock = FakeClock()
    gov = Governor(0.02, clock=clock)
    unseen = 0.01 * PLAIN
    measuring = 0.08 * PLAIN  # a full boundary's own time; a quiet stretch's steps own a tenth of it
    own: Callable[[Governor], float] = lambda g: measuring if g._dark_todo else measuring / 10  # noqa: E731
    drive_dark(gov, clock, 3_000, 1.0, unseen, own=own)
    assert gov.statistics().dark_steps == 2 * DARK_PAIRS
    assert gov.unseen_ratio == pytest.approx(unseen / PLAIN)
    assert gov.floor_ratio == pytest.approx(unseen / PLAIN + (measuring / 10) / (PLAIN - measuring / 10))


def test_dark_pairs_never_move_a_sampled_step() -> None:
    """A pair runs only where the next sampled step is at least 4 steps away, and the pair and the step
    after it are unsampled: the same steps are sampled as without dark pairs."""
    runs = []
    for pairs in (0, DARK_PAIRS):
        clock = FakeClock()
        runs.append(drive_dark(Governor(0.02, dark_pairs=pairs, clock=clock), clock, 3_000, 1.0, 0.0))
    assert runs[0].sampled == runs[1].sampled


def noisy(rng: random.Random) -> StepTime:
    """Steps of ``PLAIN`` (sampled ones twice that) with ±5 % of uniform noise: dark steps included."""
    return lambda _i, sampled, _p: PLAIN * (2 if sampled else 1) * rng.uniform(0.95, 1.05)


def test_noise_alone_reads_as_an_unseen_cost_of_about_one_standard_error_at_most() -> None:
    """Dark steps as long as the others, with ±5 % of noise: the estimate has no margin for noise
    (a budget wants the best estimate), so it reads 0 (clamped) about half the time and a small cost
    otherwise: never more than a few standard errors of the difference of the two medians."""
    sigma = 0.10 / 12**0.5  # σ of the uniform noise, in plain steps
    error = 1.2533 * sigma * (2 / DARK_PAIRS) ** 0.5  # the standard error of the difference of medians
    readings = []
    for seed in range(8):
        clock = FakeClock()
        gov = Governor(0.02, clock=clock)
        drive(gov, clock, 3_000, noisy(random.Random(seed)))
        assert gov.statistics().dark_steps == 2 * DARK_PAIRS
        assert gov.unseen_ratio is not None
        readings.append(gov.unseen_ratio)
    assert 0.0 in readings  # (noise below 0 reads 0)
    assert max(readings) < 4 * error
    assert sum(readings) / len(readings) < error


def test_a_step_time_that_moves_measures_the_unseen_part_again() -> None:
    clock = FakeClock()
    gov = Governor(0.02, clock=clock)
    drive_dark(gov, clock, 3_000, 1.0, 0.01 * PLAIN)
    assert gov.unseen_ratio == pytest.approx(0.01)
    # steps twice as long (beyond DARK_DRIFT) with twice the unseen seconds: measured again
    drive_dark(gov, clock, 3_000, 1.0, 0.04 * PLAIN, plain=2 * PLAIN)
    assert gov.statistics().dark_steps == 4 * DARK_PAIRS
    assert gov.step_seconds == pytest.approx(2 * PLAIN)
    assert gov.unseen_ratio == pytest.approx(0.02)


def test_declined_pairs_run_lit_and_a_measurement_is_given_up_after_a_few() -> None:
    clock = FakeClock()
    gov = Governor(0.02, clock=clock)
    drive_dark(gov, clock, 3_000, 1.0, 0.01 * PLAIN, decline=True)
    stats = gov.statistics()
    assert stats.dark_steps == 0
    assert stats.unseen_ratio is None
    assert stats.floor_ratio == 0.0
    assert gov.interval == smallest_interval(1.0, 0.02)
    quiet = []  # given up: step ends may be filed again (no measurement keeps every one ticking)
    for _ in range(100):
        clock.advance(PLAIN * 2 if gov.sampling else PLAIN)
        gov.tick()
        quiet.append(gov.quiet)
    assert max(quiet) > 0


# -- a steady floor: successive measurements, stalls ------------------------------------------------------


def on_a_moving_machine(
    seed: int, phases: int, unseen: Callable[[int], float] = lambda _phase: 0.003, phase_steps: int = 4_000
) -> list[GovernorStatistics]:
    """A stable model (docs/governor.md, *How steady the floor is*) on a machine whose speed moves:
    ``phases`` stretches of ``phase_steps`` steps, every other one twice as slow (everything in the step
    alike), so that each move (2x, past ``DARK_DRIFT``) measures the floor's unseen part again. A plain
    step takes ``PLAIN`` (times the speed) plus one-sided noise, an exponential draw with a mean of 4 %
    of it (a shared machine slows a step down, never speeds it up: this VM's demo MLP, in
    ``benchmarks/profile_governor_floor.py``, reads with about this noise); the monitor's own time is
    0.3 % of a plain step, its unseen cost ``unseen(phase)`` of one (a dark step is that much and its own
    time shorter), and a sampled step costs 2 plain steps more. Dark pairs run as the watch runs them:
    both ends ticked after the pair, with their readings. Returns the governor's statistics at the end
    of each phase."""
    rng = random.Random(seed)
    clock = FakeClock()
    gov = Governor(0.02, clock=clock)
    ends, dark_left, readings = [], 0, []
    for phase in range(phases):
        plain = PLAIN * (1.0 if phase % 2 == 0 else 2.0)
        for _ in range(phase_steps):
            seconds = plain * (1 + rng.expovariate(1 / 0.04))
            own = 0.003 * plain
            if dark_left:
                clock.advance(seconds - own - unseen(phase) * plain)
                readings.append(clock())
                dark_left -= 1
                if dark_left:
                    continue
                for reading in readings:
                    gov.tick(at=reading)
                readings = []
            else:
                clock.advance(seconds + 2.0 * plain if gov.sampling else seconds)
                gov.tick(own)
            if gov.dark:
                dark_left = 2
        ends.append(gov.statistics())
    return ends


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_stable_model_keeps_a_steady_interval_across_measurements_of_its_floor(seed: int) -> None:
    """Each measurement of the unseen part reads it with noise: 96 pairs on this machine give a standard
    error about as large as the part itself (0.3 % of a step), and the interval, ``ceil(r / (budget -
    f))``, magnifies it. Measurements that agree are pooled, each read by its faster half: from the fourth
    on, the interval at the end of every phase is within 25 % of what the true costs call for (the code
    before swung 0.8-7x across the same phases: one reading alone, by the median, replaced the last)."""
    expected = smallest_interval(2.0, 0.02 - 0.003 - 0.003)  # own 0.3 % + unseen 0.3 %: 143
    ends = on_a_moving_machine(seed, phases=12)
    assert ends[-1].dark_steps == 12 * 2 * DARK_PAIRS  # (one measurement per phase: each a move)
    intervals = [stats.interval for stats in ends]
    assert all(0.75 * expected <= n <= 1.25 * expected for n in intervals[3:]), intervals
    floors = [stats.floor_ratio for stats in ends[3:]]
    assert max(floors) - min(floors) < 0.005, floors  # (one reading alone: 0-0.02)


def test_a_real_change_in_the_unseen_part_is_followed_at_its_first_measurement() -> None:
    """Pooling follows no stale readings: a measurement that disagrees with the pooled ones by more than
    ``DARK_AGREE`` standard errors replaces them. The unseen part goes from 0.3 % of a step to 1.5 %
    (with a move of the machine's speed, which measures it again): the next phase reads it, not the
    pool's mean of the old one."""
    ends = on_a_moving_machine(3, phases=8, unseen=lambda phase: 0.003 if phase < 6 else 0.015)
    before, after = ends[5].unseen_ratio, ends[6].unseen_ratio
    assert before is not None
    assert after is not None
    assert before < 0.008
    assert after == pytest.approx(0.015, abs=0.005)


def test_a_stall_inside_the_monitor_does_not_move_the_floor() -> None:
    """A machine that takes the thread away for 30 plain steps while it is in the monitor's own code makes
    one clean step's own time 30 steps long, exactly measured: in a plain mean over 257 clean steps that
    moved the floor from 0.5 % to 12 % for 257 clean steps, and the interval from 67 to 268 (doubling
    per cost sample until the stall left the window). The seen part
    is the median of the last ``FLOOR_BLOCKS`` blocks' means: the one block that holds the stall moves
    nothing."""
    clock = FakeClock()
    gov = Governor(0.02, clock=clock)
    own = PLAIN * 0.005 / 1.005  # a floor of 0.5 %
    expected = smallest_interval(1.0, 0.015)
    drive_with_floor(gov, clock, settle_steps(expected), 1.0, own)
    assert (gov.interval, gov.floor_ratio) == (expected, pytest.approx(0.005))
    previous = gov.sampling
    while gov.sampling or previous:  # (to a clean step: neither sampled nor a sampled step's shadow)
        previous = gov.sampling
        drive_with_floor(gov, clock, 1, 1.0, own)
    clock.advance(31 * PLAIN)  # the step, stalled for 30 plain steps inside the monitor
    gov.tick(own + 30 * PLAIN)
    intervals, floors = [], []
    for _ in range(3 * FLOOR_WINDOW):
        drive_with_floor(gov, clock, 1, 1.0, own)
        intervals.append(gov.interval)
        floors.append(gov.floor_ratio)
    assert set(intervals) == {expected}
    assert max(floors) == pytest.approx(0.005)


def test_a_measurements_full_boundaries_are_not_in_the_floor() -> None:
    """While a measurement of the unseen part runs every step end ticks (a full boundary, here 8 % of a
    step of own time where a quiet step has a tenth of it): the measurement's cost, not an unsampled
    step's. Its clean steps are left out of the seen part, which reads the quiet steps' own time alone
    from the measurement's end on (in the window's mean they raised it from 0.8 % to up to 7.7 % after it)."""
    clock = FakeClock()
    gov = Governor(0.05, clock=clock)
    measuring = 0.08 * PLAIN
    floors: list[tuple[bool, float]] = []  # (measured yet, the floor) at each step

    def own(g: Governor) -> float:
        floors.append((g.unseen_ratio is not None, g.floor_ratio))
        return measuring if g._dark_todo else measuring / 10

    drive_dark(gov, clock, 3_000, 1.0, 0.0, own=own)
    assert gov.statistics().dark_steps == 2 * DARK_PAIRS
    quiet = (measuring / 10) / (PLAIN - measuring / 10)
    after = [floor for measured, floor in floors if measured]
    assert len(after) > 1_000
    assert max(after) == pytest.approx(quiet)
