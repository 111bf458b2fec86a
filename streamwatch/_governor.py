"""The overhead governor: the sampling interval that holds monitoring's measured cost to a budget.

A :class:`Governor` lives on the training thread. It is told where each step ends, measures the wall
time of every step with its clock, and answers whether the next step is sampled. It knows nothing of
torch, taps or channels: it sees step times only, so what it measures is monitoring's real cost end to
end — hook dispatch, the summaries, the hand-off, and the worker thread's GIL time as far as it slows
the training thread — not an estimate of streamwatch's own code.

What it measures:
    Steps are of three sorts. A *sampled* step is summarised. The step after a sampled step is its
    *shadow*: the worker handles the sampled step's record then, so its GIL time (and any other
    deferred work) lands there. Any other step is *clean*. The baseline ``b`` is the median time of
    the last ``baseline_window`` clean steps. Each sampled step gives one cost sample: its time plus
    its shadow's, relative to the baseline, ``(t_sampled + t_shadow) / b - 2`` (or
    ``t_sampled / b - 1`` when the next step is sampled too, whose own sample then carries the
    spill). The cost ratio ``r`` is the median of the last ``cost_window`` cost samples, floored at
    0: sampling one step costs ``r`` plain steps. It is never below the median of their lower bounds
    from own time: the monitor's own seconds in each sampled step (passed to :meth:`Governor.tick`)
    over the baseline, less a clean step's own share. Where a step's noise is many times what
    sampling costs (a long step on a busy node), the time samples alone can read 0, and sample every
    step; own time is exact.

How it sets the interval:
    Sampling one step in ``N`` costs ``r / N`` of the run's time on top of the floor ``f`` (what the
    unsampled steps cost), so the interval is the smallest
    ``N`` with ``f + r / N <= budget``, ``N = ceil(r / (budget - f))``, at least 1 (the ceiling where
    ``f >= budget``). Two ceilings cap it so that
    dashboards never go stale, whichever comes first: ``max_interval`` steps, and ``max_seconds`` of
    time (the interval is at most ``max_seconds / b`` steps, and a step is sampled whenever
    ``max_seconds`` have passed since the last sampled step began, however long the steps are). Where
    a ceiling binds, monitoring costs more than the budget and :attr:`Governor.overhead_ratio` shows
    it. Sampled steps are moved by up to ``N // 4`` steps either side of every ``N``-th step, by a
    deterministic equidistributed sequence (no random state is touched), so a periodic pattern in the
    step times (gradient accumulation, a prefetcher that falls behind every fourth batch) cannot alias
    with the interval; the mean interval stays ``N``.

Outliers:
    Medians, so one slow step (a data-loader stall, a checkpoint) moves nothing. A cost sample counts
    at most twice the larger of the current ``r`` and the budget, and the interval at most doubles
    per cost sample (it may shrink at once). A burst of stalls that fills half the cost window thus
    moves the interval up by at most 2x per sample, and in the tests never beyond double its value;
    an unclipped median could send it to the ceiling, where it would wait long for new samples.

Start-up:
    The first step is sampled, so a dashboard has data at once. The first ``warmup`` step times
    (allocation, autotuning, compilation) are discarded. Until there are 3 clean steps and 3 cost
    samples the interval is 3 (sampled, shadow, clean); from there it doubles per cost sample
    until it reaches ``ceil(r / budget)``: at most about ``2 * N`` steps.

Probes:
    At intervals 1 and 2 no step is clean, yet the baseline must stay fresh: whenever ``probe``
    steps have passed without a clean step, the next steps are left unsampled until one is.

Adaptation:
    The windows slide, so the estimates follow a new regime (an eval phase, a new sequence length, a
    slower node). The baseline follows within ``baseline_window // 2 + REFRESH`` clean steps (its median
    is retaken every ``REFRESH``): at least one step in 3 is clean at an interval of 3 or more, and one in
    ``probe + 2`` below that. Cost samples are ratios to the baseline of their time, so a change that
    slows every step alike needs nothing more. A cost ratio that falls is followed within ``cost_window //
    2 + 1`` sampled steps, and one that rises within about as many per doubling. With the defaults, and
    ``N`` the larger of the old and the new interval, the interval is back within 1 of its new value at
    most ``80 + 8 * N`` steps after a change in step times (tested for cost ratios that change up to
    50-fold either way), plus ``4 * dark_pairs`` where the step time itself moved by ``DARK_DRIFT`` or
    more (the floor's unseen part is measured again), plus up to ``QUIET_MAX`` for filed step ends.
    The floor follows a change in own time within ``3 * FLOOR_WINDOW + REFRESH`` clean steps (two
    whole blocks of the new time, see *The floor*), and a change in the unseen part at its next
    measurement where the change is more than ``DARK_AGREE`` standard errors (the reading replaces the
    pool); a smaller one moves the pool's mean by its share, 1 of up to ``DARK_POOL``, per measurement.

The floor:
    Two parts. The seen part is the monitor's own time on clean steps, passed to
    :meth:`Governor.tick`, over the rest of the step: the median of the means of the last
    ``FLOOR_BLOCKS`` blocks of ``FLOOR_WINDOW`` clean steps (before there are as many, the mean of all),
    so that one stall inside the monitor's code moves it by nothing. The clean steps of a measurement
    of the unseen part are not in it: they all end at full boundaries, the measurement's cost, not an
    unsampled step's (measured often, the demo MLP's read twice its quiet steps' own time). The unseen
    part is what own time cannot show (torch's dispatch of a module with a hook, caches the monitor
    leaves cold): the governor asks for *dark pairs* (:attr:`Governor.dark`), two steps the caller
    runs with the monitor entirely out of the way. ``dark_pairs`` pairs make a measurement; it runs
    once calibrated and again when the baseline moves by ``DARK_DRIFT`` either way, only where the
    interval is ``DARK_MIN_INTERVAL`` or more, and each pair only with 4 steps of room before the next
    sampled step: no sampled step moves. A measurement reads the mean of the faster half of the clean
    steps between the pairs, each less its own time, less that of the second dark steps, over those
    clean steps' median, with its standard error (a shared machine slows steps down and never speeds
    them up: the faster half holds the signal; on the demo MLP it read with 0.6 times the median's
    spread). The unseen part is the inverse-variance weighted mean of the last ``DARK_POOL`` readings
    that agree within ``DARK_AGREE`` standard errors (one that does not replaces them), never below 0,
    held in seconds from the latest measurement: one reading alone, replacing the last, moved the floor
    and through ``N = ceil(r / (budget - f))`` the interval 2-7x between measurements of one stable
    model.

Guards:
    A step time that is zero, negative, NaN or infinite (a coarse or broken clock) is ignored and
    counted in ``rejected``. Only positive, finite times enter a window, so no estimate divides by
    zero or by a negative number, and the interval is always in ``[1, max_interval]``. A clock that
    goes back restarts the time ceiling from its new reading rather than postponing it.

Use:
    Create the governor when observing starts: the first step begins then and is sampled
    (:attr:`Governor.sampling`). Call :meth:`Governor.tick` once at every step boundary as the very
    last thing, after the sampled step's record has been handed off, so that the hand-off is charged
    to the step that caused it; ``tick`` returns whether the step beginning now is sampled. A caller
    for whom a tick costs too much may file up to :attr:`Governor.quiet` step ends in a row instead
    (:attr:`Governor.filed`, each before :attr:`Governor.deadline`); the next tick measures them
    first. After a tick that sets :attr:`Governor.dark`, run the next two steps dark and tick both
    ends after them with ``at=`` their readings, or call :meth:`Governor.decline_dark`. One thread
    ticks (not thread-safe); :meth:`Governor.statistics` returns a frozen snapshot and may be called
    from any thread.

Example:
    >>> from streamwatch._governor import Governor
    >>> from streamwatch.testing import FakeClock
    >>> clock = FakeClock()
    >>> gov = Governor(budget=0.02, clock=clock)
    >>> for _ in range(2000):  # a sampled step takes 20 % longer than a plain one
    ...     clock.advance(0.120 if gov.sampling else 0.100)
    ...     next_is_sampled = gov.tick()
    >>> gov.interval, round(gov.cost_ratio, 6), round(gov.overhead_ratio, 6)
    (10, 0.2, 0.02)
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from ._clock import Clock

__all__ = ["Governor", "GovernorStatistics", "check_budget"]

CALIBRATION_INTERVAL = 3
"""The interval while the governor has too few measurements to choose one (sampled, shadow, clean)."""

_CALIBRATION_COUNT = 3  # clean and cost samples needed (fewer if a window is smaller) before deciding
REFRESH = 8
"""Once calibrated, the baseline and floor medians (and the interval from them) are retaken every
``REFRESH`` clean steps and before every cost sample, not on every step: a clean step then costs an
append. The estimates lag by at most ``REFRESH - 1`` clean steps."""
QUIET_MAX = 256
"""At most this many step ends in a row are filed (:attr:`Governor.filed`) before a tick measures them:
the interval and the estimates then lag by at most that many steps more."""
FLOOR_WINDOW = QUIET_MAX + 1
"""The floor's seen part is taken over blocks of this many clean steps: each block's mean own-time ratio,
a mean, not a median, so that a cost paid on one clean step in several (a tick, and the quiet step after
it that carries the tick's rest) counts in full: a block holds a whole run of filed step ends and its
tick."""
FLOOR_BLOCKS = 3
"""The seen part is the median of the last this many block means (before there are as many, the mean of
every clean step so far): own time is measured exactly, but a stall inside the monitor's code (the
machine took the thread away for milliseconds) is exact too, and in a plain mean one such step of a
sub-millisecond model moved the floor by several percent for a whole window. The median drops the block
that holds it."""
DARK_PAIRS = 96
"""Dark steps measured per calibration of the floor's unseen part (see *The floor* above): pairs of
steps run with the monitor entirely out of the way, each pair followed by two lit steps."""
DARK_MIN_INTERVAL = 8
"""Dark pairs run only between sampled steps at least this far apart (never delaying one); below it,
where sampling costs far more than the floor, the unseen part is not measured."""
DARK_DECLINES = 4
"""A measurement is given up after this many declined pairs (and tried again after the next drift)."""
DARK_DRIFT = 1.5
"""The unseen part is measured again when the baseline has moved by this factor either way since."""
DARK_POOL = 8
"""The unseen part is the weighted mean of the last this many measurements that agree (see *The floor*)."""
DARK_AGREE = 3.0
"""A measurement agrees with the ones held when they differ by at most this many standard errors; one that
does not replaces them (the unseen part changed: it is followed at once)."""
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0  # the phase sequence k·φ mod 1 spreads sampled steps evenly
_EPSILON = 1e-9  # a quotient that is an integer up to rounding (0.2 / 0.02, 1.0 / 0.1) is that integer


@dataclass(frozen=True, slots=True)
class GovernorStatistics:
    """A snapshot of a :class:`Governor`: what it measured and what it chose.

    ``cost_ratio``, ``overhead_ratio`` and ``step_seconds`` are None until there are enough
    measurements to decide (see the module docstring, *Start-up*).
    """

    budget: float
    """The budget: the fraction of the run's time monitoring may cost."""
    interval: int
    """The current sampling interval: one step in ``interval`` is sampled."""
    cost_ratio: float | None
    """``r``: what sampling one step costs, as a fraction of a plain step's time."""
    overhead_ratio: float | None
    """``floor + r / interval``: what monitoring costs now, as a fraction of the run's time."""
    floor_ratio: float
    """What an unsampled step costs (streamwatch's own time in it, over the rest of the step): the part
    of the cost no interval removes; 0 until measured."""
    step_seconds: float | None
    """The baseline: the median time of the recent clean (unmonitored) steps."""
    steps: int
    """Steps that have ended (calls to :meth:`Governor.tick`, and step ends filed since the last)."""
    sampled: int
    """Steps chosen to be sampled, the first step and the one now running included."""
    rejected: int
    """Step times ignored because they were zero, negative, NaN or infinite."""
    unseen_ratio: float | None
    """The part of :attr:`floor_ratio` that only dark steps show (torch's dispatch of the root module's
    hook, caches left cold for the user's code): None until measured, and without dark steps."""
    dark_steps: int
    """Steps run dark so far (two per measurement)."""


def check_budget(value: object, name: str = "budget") -> float:
    """``value`` as a budget: a real number in (0, 1), else a ``ValueError`` naming ``name`` (``observe()``
    checks its ``overhead=`` with it, so both say the same).

    Example:
        >>> check_budget(0.05, "overhead")
        0.05
        >>> check_budget(2, "overhead")
        Traceback (most recent call last):
        ...
        ValueError: Expected `overhead` to be a number in (0, 1) (0.02 is 2 %), got 2
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"Expected `{name}` to be a number in (0, 1) (0.02 is 2 %), got {value!r}")
    return float(value)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"Expected `{name}` to be an integer >= {minimum}, got {value!r}")
    return value


def _check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"Expected `{name}` to be a finite number of seconds > 0, got {value!r}")
    return float(value)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _faster_half(values: Sequence[float]) -> tuple[float, float]:
    """The mean of the smaller half of ``values`` (at least one), and its standard error.

    A trimmed mean: a shared machine slows steps down and never speeds them up, so the slower half
    carries most of a step time's noise and the faster half most of its signal. The standard error is
    Tukey and McLaughlin's for a trimmed mean: the deviation of the sample with its trimmed values set
    to the nearest kept one, over ``kept / n * sqrt(n)``.
    """
    ordered = sorted(values)
    n = len(ordered)
    kept = (n + 1) // 2
    mean = sum(ordered[:kept]) / kept
    if n < 2:
        return mean, 0.0
    cut = ordered[kept - 1]
    winsorized = ordered[:kept] + [cut] * (n - kept)
    centre = sum(winsorized) / n
    deviation = math.sqrt(sum((x - centre) ** 2 for x in winsorized) / (n - 1))
    return mean, deviation / (kept / n * math.sqrt(n))


def _pooled(readings: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The inverse-variance weighted mean of ``(value, standard error)`` readings, and its standard error
    (an error of 0, a noiseless reading, weighs as one of 1e-9)."""
    weights = [1.0 / max(error, 1e-9) ** 2 for _, error in readings]
    total = sum(weights)
    mean = sum(w * value for w, (value, _) in zip(weights, readings, strict=True)) / total
    return mean, 1.0 / math.sqrt(total)


class Floor:
    """What an unsampled step costs (module docstring, *The floor*): the seen part, the monitor's own
    time on clean steps in blocks of :data:`FLOOR_WINDOW`, and the unseen part, measured with dark pairs
    and pooled over the measurements that agree.

    Attributes:
        seen: the seen part, a fraction of the rest of a step (:meth:`take_seen` retakes it).
        unseen: seconds per step the monitor costs that own time misses (None until measured).
        unseen_at: the step time it was measured at (a drift from it asks for a new measurement).
        darks, lights: the running measurement's second dark steps and the clean steps between pairs.
        pool: the readings it is pooled from: (fraction of their lit steps, standard error).
    """

    __slots__ = ("_count", "_sum", "blocks", "darks", "lights", "pool", "seen", "unseen", "unseen_at")

    def __init__(self, dark_pairs: int) -> None:
        self.blocks: deque[float] = deque(maxlen=FLOOR_BLOCKS)  # mean own ratios of whole blocks
        self._sum = 0.0  # the own ratios of the block being filled, and how many
        self._count = 0
        self.seen = 0.0
        self.unseen: float | None = None
        self.unseen_at: float | None = None
        self.pool: deque[tuple[float, float]] = deque(maxlen=DARK_POOL)
        self.darks: deque[float] = deque(maxlen=max(1, dark_pairs))
        self.lights: list[float] = []

    def restart(self) -> None:
        """A new measurement of the unseen part begins."""
        self.darks.clear()
        self.lights = []

    def unseen_ratio(self, step_seconds: float | None) -> float | None:
        """The unseen part as a fraction of a plain step of ``step_seconds``; None until measured."""
        if self.unseen is None or step_seconds is None:
            return None
        return self.unseen / step_seconds

    def add_seen(self, ratio: float) -> None:
        """A clean step's own-time ratio, into the block being filled (a whole block: its mean, kept)."""
        self._sum += ratio
        self._count += 1
        if self._count == FLOOR_WINDOW:
            self.blocks.append(self._sum / FLOOR_WINDOW)
            self._sum, self._count = 0.0, 0

    def take_seen(self) -> None:
        """The floor's seen part: the median of the last :data:`FLOOR_BLOCKS` block means, or until there
        are as many, the mean of every clean step so far (plain sums: a few hundred small ratios lose
        nothing that matters, and ``math.fsum`` takes four times as long)."""
        blocks = self.blocks
        if len(blocks) == FLOOR_BLOCKS:
            self.seen = _median(blocks)
        elif blocks or self._count:
            count = len(blocks) * FLOOR_WINDOW + self._count
            self.seen = (sum(blocks) * FLOOR_WINDOW + self._sum) / count

    def measure_unseen(self, step_seconds: float | None) -> bool:
        """A measurement's last dark pair ended: its reading is the faster half's mean of the clean steps
        between the pairs, each less its own time, less the faster half's mean of the dark steps, as a
        fraction of those clean steps' median, with its standard error. The unseen part is the weighted
        mean of the readings that agree (:data:`DARK_POOL`, :data:`DARK_AGREE`), never below 0, held in
        seconds at the latest measurement's median. Each light step's own time is its own (those steps
        end at full boundaries, whose own time the floor's blocks, mostly quiet steps, would
        understate). ``step_seconds``: the baseline now (the lights' median: its window is theirs).
        True when a reading was taken (the governor's estimates are then retaken)."""
        darks, lights = self.darks, self.lights
        self.lights = []
        if not lights or not darks:
            return False
        # A fraction of the measurement's own lit steps (their median), not of the baseline: a spell of
        # stalls at its end moves the baseline's 15 steps, and would shrink a reading and its error alike.
        level = _median(lights)
        (light, light_error), (dark, dark_error) = _faster_half(lights), _faster_half(darks)
        reading, error = (light - dark) / level, math.hypot(light_error, dark_error) / level
        pool = self.pool
        if pool:
            held, held_error = _pooled(pool)
            if abs(reading - held) > DARK_AGREE * math.hypot(error, held_error):
                pool.clear()  # the unseen part moved: the new reading alone
        pool.append((reading, error))
        # No margin for noise: a budget wants the cost's best estimate, not a low one (a noise margin of
        # two standard errors took half the real unseen part of a small model's step on a noisy VM, and
        # the governor sampled too often for its budget). Noise alone reads as a small positive cost
        # about half the time (below 0 is 0): the error errs toward sampling less.
        self.unseen = max(0.0, _pooled(pool)[0]) * level
        self.unseen_at = step_seconds
        return True


class Governor:
    """Chooses which steps to sample so that monitoring's measured cost stays within ``budget``.

    Args:
        budget: the fraction of the run's time monitoring may cost, in (0, 1): 0.02 is 2 %.
        max_interval: sample at least once every ``max_interval`` steps, whatever the cost.
        max_seconds: sample at least once every ``max_seconds`` seconds (plus the step that
            crosses it), whatever the cost.
        warmup: how many of the first step times to discard (allocation, autotuning, compilation).
        baseline_window: how many recent clean step times the baseline is the median of.
        cost_window: how many recent cost samples the cost ratio is the median of.
        probe: at intervals of 1 and 2, leave steps unsampled whenever ``probe`` steps have passed
            without a clean one, to keep the baseline fresh.
        dark_pairs: dark step pairs per measurement of the floor's unseen part (see *The floor*);
            0: none (the floor is the own time alone).
        clock: seconds from a monotonic origin; step times are differences of its readings.

    Raises:
        ValueError: an argument is out of range (the message names it).

    Example:
        >>> from streamwatch.testing import FakeClock
        >>> clock = FakeClock()
        >>> gov = Governor(budget=0.05, max_interval=100, clock=clock)
        >>> gov.sampling, gov.interval, gov.cost_ratio  # the first step is sampled; nothing measured yet
        (True, 3, None)
        >>> for _ in range(500):  # sampling a step doubles its time: r = 1, so N = 1 / 0.05
        ...     clock.advance(0.2 if gov.sampling else 0.1)
        ...     _ = gov.tick()
        >>> gov
        <Governor budget=0.05 interval=20 cost_ratio=1 overhead_ratio=0.05>
    """

    __slots__ = (
        "_baseline",
        "_boundary",
        "_budget",
        "_cap",
        "_clock",
        "_cost_ratio",
        "_costs",
        "_dark_pairs",
        "_dark_phase",
        "_dark_steps",
        "_dark_todo",
        "_declined",
        "_floor",
        "_floor_parts",
        "_growth_limit",
        "_interval",
        "_last_sample_at",
        "_max_interval",
        "_max_seconds",
        "_own_costs",
        "_pending",
        "_pending_own",
        "_phase",
        "_prev_sampled",
        "_probe",
        "_rejected",
        "_sampled",
        "_sampling",
        "_since_clean",
        "_since_sample",
        "_stale",
        "_step_seconds",
        "_steps",
        "_warmup",
        "dark",
        "deadline",
        "filed",
        "quiet",
    )

    def __init__(
        self,
        budget: float = 0.02,
        *,
        max_interval: int = 1000,
        max_seconds: float = 60.0,
        warmup: int = 5,
        baseline_window: int = 15,
        cost_window: int = 7,
        probe: int = 8,
        dark_pairs: int = DARK_PAIRS,
        clock: Clock = time.perf_counter,
    ) -> None:
        checked = check_budget(budget)
        if not callable(clock):
            raise TypeError(f"Expected `clock` to be a callable returning seconds, got {clock!r}")
        self._budget = checked
        self._max_interval = _check_int("max_interval", max_interval, 1)
        self._max_seconds = _check_seconds("max_seconds", max_seconds)
        self._warmup = _check_int("warmup", warmup, 0)
        self._baseline: deque[float] = deque(maxlen=_check_int("baseline_window", baseline_window, 1))
        self._costs: deque[float] = deque(maxlen=_check_int("cost_window", cost_window, 1))
        # each cost sample's lower bound from the sampled step's own time (exact: no step-time noise)
        self._own_costs: deque[float] = deque(maxlen=cost_window)
        self._floor = 0.0  # what an unsampled step costs: the seen part and the unseen part
        self._probe = _check_int("probe", probe, 1)
        self._clock = clock
        now = float(clock())
        self._boundary: float | None = now if math.isfinite(now) else None  # where the running step began
        self._last_sample_at = self._boundary  # where the last sampled step began
        self._step_seconds: float | None = None
        self._cost_ratio: float | None = None
        self._interval = min(CALIBRATION_INTERVAL, self._max_interval)
        self._growth_limit = 2 * CALIBRATION_INTERVAL
        self._cap = self._max_interval  # the interval's ceiling in steps, from both ceilings
        self._pending: float | None = None  # a sampled step's time, waiting for its shadow
        self._pending_own = 0.0  # that step's own time (the monitor's, measured exactly)
        self._phase = 0.0
        self._sampling = True  # the first step is sampled
        self._prev_sampled = False  # whether the step before the running one was sampled
        self._since_sample = 0  # steps ended since the last sampled step began
        self._since_clean = 0  # steps ended since the last clean one
        self._steps = 0
        self._stale = 0  # clean steps filed since the medians were last taken (see REFRESH)
        self._sampled = 1
        self._rejected = 0
        self._dark_pairs = _check_int("dark_pairs", dark_pairs, 0)
        self._floor_parts = Floor(dark_pairs)  # its seen and unseen parts, and their measurements
        self._dark_todo = 0  # pairs still to run in this measurement
        self._dark_phase = 0  # the running step: 1 or 2 the first or second of a dark pair, 3 the next
        self._dark_steps = 0
        self._declined = 0
        self.dark = False
        """Whether the step beginning now starts a dark pair (set by :meth:`tick`): the caller takes the
        monitor entirely out of this step and the next one (no hook, nothing done at the boundary
        between them but reading the clock) and ticks both step ends at the boundary after, with their
        readings; or calls :meth:`decline_dark` at once if it cannot. A first step that ends at or past
        :attr:`deadline` is ticked at once instead: the time ceiling samples the next step, which ends
        the pair."""
        self.deadline = math.inf
        """The clock reading from which the time ceiling samples the next step (set by :meth:`tick`): a
        step end filed at or after it must be a :meth:`tick` instead."""
        self.quiet = 0
        """How many of the coming step ends may be filed instead of ticked: :meth:`tick` would leave the
        step after each unsampled (the interval, the step-count ceiling; never more than
        :data:`QUIET_MAX`). 0 at a sampled step's shadow, whose end takes the cost sample that may
        shrink the interval at once. What the filed ends refresh (the baseline and floor medians, every
        :data:`REFRESH` clean steps) can still move the interval by the floor's drift or, through the
        baseline, the time ceiling's: that takes effect at the next tick, after the stretch. The time
        ceiling is the filer's to check: a reading at or past :attr:`deadline` ticks."""
        self.filed: list[tuple[float, float]] = []
        """Step ends not yet measured, as ``(clock reading, own seconds)``: a caller for whom a tick costs
        too much files its quiet step ends here (at most :attr:`quiet` in a row, each before
        :attr:`deadline`) and the next :meth:`tick` measures them first, in order, as ticks."""

    # -- the training thread's side -----------------------------------------------------------------

    def tick(self, own: float = 0.0, forced: bool = False, at: float | None = None) -> bool:
        """Mark a step boundary: the running step has ended and the next one begins now.

        Measures the step that ended (clock now minus at the previous boundary), updates the interval
        and returns whether the next step is sampled (also :attr:`sampling` from now on). Cheap (a few
        microseconds); never raises for odd clock readings. Step ends filed in :attr:`filed` since the
        last tick are measured first, in order.

        Args:
            own: seconds of the step that ended spent in the monitor's own code on this thread (hooks
                and the step boundary). On clean steps it measures the floor: what monitoring costs
                on steps it does not sample, which no interval removes (:attr:`floor_ratio`).
            forced: the step that ended was sampled by someone else's decision (the watch's
                escalation after a non-finite loss samples every step in full): it is measured as
                nothing — neither a clean step, nor a cost, nor the shadow of the sampled step before
                it — and the step after it is not a clean step either (it may carry its worker time).
            at: the clock reading at the boundary, taken earlier (a dark pair's step ends, ticked at
                the boundary after them); None reads the clock now.
        """
        reading = float(self._clock()) if at is None else float(at)  # (first: the rest is the next step's)
        if self.filed:
            self._replay()
        phase = self._dark_phase
        now = self._advance(reading, own, forced)
        self.dark = False
        if phase == 1 or phase == 2:  # a dark pair's step ended: only a ceiling samples the next step
            sample = self._overdue(now)
            if sample and phase == 1:  # (the caller ends the pair early at the deadline: see dark)
                self._dark_phase = 0
                self._dark_steps -= 1
        else:
            sample = self._choose(now)
            if (
                not sample
                and self._dark_todo
                and self._since_clean == 0  # (after a clean step: the pair's neighbours are plain steps)
                and self._gap() - self._since_sample >= 4  # (room for it before the next sampled step)
            ):
                self.dark = True
                self._dark_phase = 1
                self._dark_steps += 2
        self._sampling = sample
        if sample:
            self._sampled += 1
            self._since_sample = 0
            self._last_sample_at = now if now is not None else self._last_sample_at
            self._phase = (self._phase + _GOLDEN) % 1.0
            self.quiet = 0
        elif self._dark_todo or self._dark_phase:
            self.quiet = 0  # (a measurement of the unseen part is running: every step end ticks)
        elif self._prev_sampled:
            # the step beginning now is a sampled step's shadow: its end takes the cost sample, which may
            # shrink the interval at once, so it ticks (filed, the sample would come too late)
            self.quiet = 0
        else:
            self.quiet = max(0, min(self._gap() - self._since_sample - 1, QUIET_MAX))
        last = self._last_sample_at
        self.deadline = math.inf if last is None else last + self._max_seconds
        return sample

    def decline_dark(self) -> None:
        """The caller cannot run the dark pair :attr:`dark` asked for (the step has hooks in, say): the
        two steps run lit and are measured as usual; a pair is asked for again later."""
        if self.dark:
            self.dark = False
            self._dark_phase = 0
            self._dark_steps -= 2
            self._declined += 1
            if self._declined >= DARK_DECLINES:  # not now: again when the step time has moved
                self._dark_todo = 0
                self._declined = 0
                self._floor_parts.unseen_at = self._step_seconds

    @property
    def unseen_ratio(self) -> float | None:
        """What the monitor costs beyond its own measured time, as a fraction of a plain step; None
        until dark steps measured it."""
        return self._floor_parts.unseen_ratio(self._step_seconds)

    def _replay(self) -> None:
        """Measure the step ends filed since the last tick: each as :meth:`tick` would have, every one
        leaving the next step unsampled (as it was: :attr:`quiet` promised it). Once they are plain
        clean steps, in bulk: their windows take appends, and the medians are retaken once."""
        filed = self.filed.copy()  # (emptied in place: a caller may hold its append)
        self.filed.clear()
        for k, (reading, own) in enumerate(filed):
            if (
                self._steps >= self._warmup
                and self._cost_ratio is not None
                and self._pending is None
                and not (self._prev_sampled or self._sampling or self._dark_phase or self._dark_todo)
            ):
                self._file_clean(filed[k:])
                return
            self._advance(reading, own, False)
            self._sampling = False

    def _file_clean(self, filed: list[tuple[float, float]]) -> None:
        """:meth:`_advance` for clean unsampled step ends past the warm-up, in one pass."""
        baseline, add_floor = self._baseline, self._floor_parts.add_seen
        plain = 0
        for reading, own in filed:
            boundary = self._boundary
            if boundary is None or not (math.isfinite(reading) and reading > boundary):
                self._advance(reading, own, False)  # an odd reading: the general path
                continue
            seconds = reading - boundary
            self._boundary = reading
            baseline.append(seconds)
            if 0 <= own < seconds:  # (NaN and inf fail it: not a floor)
                add_floor(own / (seconds - own))
            plain += 1
        if plain:
            self._steps += plain
            self._since_sample += plain
            self._since_clean = 0
            self._prev_sampled = False
            self._stale += plain
            if self._stale >= REFRESH:
                self._refresh()

    def _advance(self, reading: float, own: float, forced: bool) -> float | None:
        """A step ended at ``reading``: measure it; the reading if it is finite, else None."""
        now = reading if math.isfinite(reading) else None
        ended_sampled = self._sampling
        seconds = math.nan
        if now is not None:
            if self._boundary is not None:
                seconds = now - self._boundary
            self._boundary = now
            if self._last_sample_at is None or now < self._last_sample_at:
                self._last_sample_at = now  # a clock that went back must not postpone the time ceiling
        self._steps += 1
        phase = self._dark_phase
        if phase:  # a dark pair, or the step after it (which carries the pair's deferred boundaries)
            self._dark_phase = (phase + 1) % 4
            if phase == 2 and math.isfinite(seconds) and seconds > 0:
                self._floor_parts.darks.append(seconds)
                self._dark_todo -= 1
                if not self._dark_todo and self._floor_parts.measure_unseen(self._step_seconds):
                    self._refresh()
            elif not (math.isfinite(seconds) and seconds > 0):
                self._rejected += 1
            if phase == 3 and ended_sampled:  # sampled by a ceiling, with the pair's boundaries in it:
                self._pending = None  # no cost sample, but its shadow is no clean step
            else:
                ended_sampled = False
        elif forced:
            self._pending = None  # a sampled step whose shadow this was loses its cost sample
            ended_sampled = True  # (for what follows: the next step is its shadow, not a clean step)
        else:
            self._measure(seconds, ended_sampled, own)
        self._since_sample += 1
        clean = not ended_sampled and not self._prev_sampled and not phase
        self._since_clean = 0 if clean else self._since_clean + 1
        self._prev_sampled = ended_sampled
        return now

    def _measure(self, seconds: float, sampled: bool, own: float = 0.0) -> None:
        """File the time of the step that ended: a clean step's, a cost sample's, or nothing."""
        waiting = self._pending
        self._pending = None
        if not (math.isfinite(seconds) and seconds > 0):
            self._rejected += 1  # a sampled step waiting for this shadow loses its cost sample too
            return
        if self._steps <= self._warmup:
            return
        if sampled:
            if waiting is not None:
                self._add_cost(waiting / self._baseline_or_nan() - 1)
            self._pending = seconds
            self._pending_own = own if math.isfinite(own) and 0 <= own < seconds else 0.0
        elif waiting is not None:
            self._add_cost((waiting + seconds) / self._baseline_or_nan() - 2)
        elif not self._prev_sampled:
            self._baseline.append(seconds)
            if math.isfinite(own) and 0 <= own < seconds:  # (else: an odd reading, not a floor)
                if self._dark_todo:  # (what a dark step is compared with; its full boundary is the
                    self._floor_parts.lights.append(seconds - own)  # measurement's cost, not an
                else:  # unsampled step's)
                    self._floor_parts.add_seen(own / (seconds - own))
            self._stale += 1
            if self._stale >= REFRESH or self._cost_ratio is None:
                self._refresh()
        # else: the shadow of a sampled step that was not measured (warm-up, rejected): no use

    def _refresh(self) -> None:
        """The baseline and floor medians from their windows, and the interval from them."""
        self._stale = 0
        if self._baseline:
            self._step_seconds = _median(self._baseline)
        parts = self._floor_parts
        parts.take_seen()
        self._floor = parts.seen + (self.unseen_ratio or 0.0)
        baseline, at = self._step_seconds, parts.unseen_at
        if self._dark_todo and self._interval < DARK_MIN_INTERVAL:
            self._dark_todo = 0  # no room between sampled steps any more: again after the next drift
            parts.unseen_at = baseline
        elif (
            baseline is not None
            and self._cost_ratio is not None
            and self._dark_pairs
            and not self._dark_todo
            and self._interval >= DARK_MIN_INTERVAL
            and (at is None or not at / DARK_DRIFT <= baseline <= at * DARK_DRIFT)
        ):
            self._dark_todo = self._dark_pairs  # calibrated, or the step time moved: measure the unseen part
            parts.restart()
        self._update()

    def _baseline_or_nan(self) -> float:
        if self._stale:
            self._refresh()  # a cost sample is a ratio to the latest baseline
        return math.nan if self._step_seconds is None else self._step_seconds

    def _add_cost(self, cost: float) -> None:
        if not math.isfinite(cost):  # NaN without a baseline yet; inf from a vanishing baseline
            return
        # Its lower bound: the sampled step's own time over the baseline, less a clean step's own share.
        # Where the step time's noise is many times what sampling costs (a long step on a busy node),
        # the median of the cost samples can sit at 0 and the interval at 1; the monitor's own time
        # cannot (the cost no own time shows, the worker's GIL time among it, is left to the samples).
        self._own_costs.append(max(0.0, self._pending_own / self._baseline_or_nan() - self._floor_parts.seen))
        if self._cost_ratio is not None:  # a sample counts at most double: see *Outliers*
            cost = min(cost, 2 * max(self._cost_ratio, self._budget))
        self._costs.append(cost)
        self._growth_limit = 2 * self._interval  # the interval at most doubles per cost sample
        self._update()

    def _update(self) -> None:
        """Recompute the interval from the windows (all divisors here are positive and finite)."""
        ready = min(_CALIBRATION_COUNT, self._baseline.maxlen or 1)
        if self._step_seconds is None or len(self._baseline) < ready:
            return
        cap = self._max_interval
        steps_in_ceiling = self._max_seconds / self._step_seconds  # b > 0; may be inf: compared only
        if steps_in_ceiling < cap:
            cap = max(1, int(steps_in_ceiling + _EPSILON))
        self._cap = cap
        if len(self._costs) < min(_CALIBRATION_COUNT, self._costs.maxlen or 1):
            self._interval = min(CALIBRATION_INTERVAL, cap)
            return
        ratio = max(0.0, _median(self._costs), _median(self._own_costs) if self._own_costs else 0.0)
        self._cost_ratio = ratio
        left = self._budget - self._floor  # what sampling may cost on top of the floor
        need = ratio / left if left > 0 else math.inf
        limit = min(cap, self._growth_limit)
        if need <= 1:
            self._interval = 1
        elif need >= limit:
            self._interval = limit
        else:
            self._interval = max(1, math.ceil(need - _EPSILON))

    def _choose(self, now: float | None) -> bool:
        """Whether the step that begins now is sampled: the ceilings, then probes, then the interval."""
        if self._overdue(now):
            return True
        if self._since_clean >= self._probe:
            return False
        return self._since_sample >= self._gap()

    def _overdue(self, now: float | None) -> bool:
        """Whether a ceiling samples the step that begins now: ``max_seconds`` since the last sampled
        step began (by :attr:`deadline`'s arithmetic), or ``max_interval`` steps."""
        last = self._last_sample_at
        if now is not None and last is not None and now >= last + self._max_seconds:
            return True
        return self._since_sample >= self._max_interval

    def _gap(self) -> int:
        """The interval, shifted by up to a quarter of it by the phase sequence, within the ceiling."""
        gap = self._interval
        spread = gap // 4
        if spread:
            gap += math.floor((2 * self._phase - 1) * spread + 0.5)
        return max(1, min(gap, self._cap))

    # -- what it measured ---------------------------------------------------------------------------

    @property
    def sampling(self) -> bool:
        """Whether the step running now is sampled (True for the first step)."""
        return self._sampling

    @property
    def budget(self) -> float:
        """The fraction of the run's time monitoring may cost."""
        return self._budget

    @property
    def interval(self) -> int:
        """The current sampling interval ``N`` (the mean number of steps between sampled steps)."""
        return self._interval

    @property
    def cost_ratio(self) -> float | None:
        """``r``: sampling one step (with its shadow) costs ``r`` plain steps; None until measured."""
        return self._cost_ratio

    @property
    def overhead_ratio(self) -> float | None:
        """``floor + r / N``: monitoring's measured amortised cost, a fraction of the run's time; None
        until measured. Above the budget only where a ceiling forces sampling more often, or where the
        floor alone is over it."""
        return None if self._cost_ratio is None else self._floor + self._cost_ratio / self._interval

    @property
    def floor_ratio(self) -> float:
        """What an unsampled step costs, as a fraction of a plain step (0 until measured)."""
        return self._floor

    @property
    def step_seconds(self) -> float | None:
        """The baseline: the median time of the recent clean steps; None until measured."""
        return self._step_seconds

    def statistics(self) -> GovernorStatistics:
        """A frozen snapshot of what the governor measured and chose (safe to call from any thread)."""
        ratio = self._cost_ratio
        interval = self._interval
        return GovernorStatistics(
            budget=self._budget,
            interval=interval,
            cost_ratio=ratio,
            overhead_ratio=None if ratio is None else self._floor + ratio / interval,
            floor_ratio=self._floor,
            step_seconds=self._step_seconds,
            steps=self._steps + len(self.filed),
            sampled=self._sampled,
            rejected=self._rejected,
            unseen_ratio=self.unseen_ratio,
            dark_steps=self._dark_steps,
        )

    def __repr__(self) -> str:
        ratio, overhead = (
            "None" if value is None else f"{value:.3g}" for value in (self._cost_ratio, self.overhead_ratio)
        )
        return (
            f"<Governor budget={self._budget:g} interval={self._interval} "
            f"cost_ratio={ratio} overhead_ratio={overhead}>"
        )
