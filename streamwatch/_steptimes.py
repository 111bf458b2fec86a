"""Every step's wall time and samples, counted on the training thread for the step counters and the
``streamwatch_step_duration_seconds`` histogram, at each step's end (the quiet step's too: a scrape sees
every step as it ends, where the step's values reach the sinks with the next record).

A sampled step is one in many: a gauge of the last step's time read by a 15 s scrape sees one step in
hundreds. These counters see every step (``watch.step()`` to ``watch.step()``, the first from
``observe()``), so ``rate()`` over them is the mean over the window and the histogram's buckets give
its quantiles. Cost: one ``bisect`` and three additions per step (well under a microsecond).

Example:
    >>> times = StepTimes()
    >>> times.add(0.02, 32); times.add(3.0, None)
    >>> times.count, round(times.seconds, 3), times.samples, times.buckets[STEP_BUCKETS.index(0.025)]
    (2, 3.02, 32, 1)
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

__all__ = ["STEP_BUCKETS", "StepTimes"]

STEP_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    float("inf"),
)
"""Upper bounds (``le``) of the step-duration buckets, seconds: from a millisecond step of a small model
to a minute-long step of a large one, about three buckets a decade."""


class StepTimes:
    """Counts of every step's wall time (per bucket of :data:`STEP_BUCKETS`, not cumulative), their sum,
    and the samples trained on. Written by the training thread only; read by the exporter's thread (a
    read may be one step behind on one counter, never torn: each attribute is replaced whole)."""

    __slots__ = ("_counts", "count", "samples", "seconds")

    def __init__(self) -> None:
        self._counts = [0] * len(STEP_BUCKETS)
        self.count = 0
        self.seconds = 0.0
        self.samples: int | None = None  # None until a step gives its batch size

    def add(self, seconds: float, batch_size: object) -> None:
        """File one step of ``seconds`` (a negative reading of a clock that stepped back counts as 0),
        with ``batch_size`` samples if it is a positive int."""
        seconds = max(seconds, 0.0)
        self._counts[bisect_left(STEP_BUCKETS, seconds)] += 1
        self.count += 1
        self.seconds += seconds
        if type(batch_size) is int and batch_size > 0:
            self.samples = (self.samples or 0) + batch_size

    def statistics(self) -> dict[str, Any]:
        """``WatchStatistics``' fields of these counts: ``step_seconds_total``, ``step_buckets``,
        ``samples_total``."""
        buckets = self.buckets
        return {"step_seconds_total": self.seconds, "step_buckets": buckets, "samples_total": self.samples}

    @property
    def buckets(self) -> tuple[int, ...]:
        """Steps per bucket of :data:`STEP_BUCKETS` (not cumulative)."""
        return tuple(self._counts)
