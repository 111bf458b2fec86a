"""The TensorBoard sink (the predecessors' backend): every step record as TensorBoard scalars, and
opt-in histograms as TensorBoard histograms.

``TensorBoard(log_dir)`` is a :class:`~streamwatch.Sink` for ``observe(sinks=[...])``; it writes with
``torch.utils.tensorboard.SummaryWriter`` on the worker thread, so the training thread never waits for
it. The ``tensorboard`` package is an optional extra (``pip install 'streamwatch-torch[tensorboard]'``):
``import streamwatch`` never imports it, and creating the sink without it is a clear ``ImportError``.

Tags: ``<phase>/<kind>/<layer>[.<param or index>]/<stat>`` for tensor statistics (``stats=`` picks which,
default the norms, mean, std, extremes, zero and dead fractions and non-finite counts), and the step
scalars under their own names (``loss``, ``accuracy``, ``lr/0``, ``part/forward``, ...). Values that are
unknown (NaN) are not written. ``metrics.Histogram`` counts become TensorBoard histograms with the fixed
log-spaced bucket edges (non-finite values left out).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from streamwatch._pipeline import Sink
from streamwatch._record import SeriesKey, StepRecord
from streamwatch._version import extra

__all__ = ["DEFAULT_STATS", "TensorBoard"]

DEFAULT_STATS = ("l2", "mean", "std", "min", "max", "absmax", "zero_fraction", "dead_fraction", "nonfinite")
"""The statistics written per tensor series by default."""


_UNIT_STATS = frozenset({"dead_fraction", "activation_rate"})
"""Statistics of per-unit activity: they have a value only on rows with units (activations)."""


class TensorBoard(Sink):
    """Writes every step record to a TensorBoard log directory.

    Args:
        log_dir: the directory of the event files (created if missing).
        stats: the tensor statistics to write per series (see :data:`DEFAULT_STATS`).
        buckets: the ``streamwatch.metrics.Buckets`` of the histograms the run records (the
            ``Histogram`` metric's ``buckets``), to write them as TensorBoard histograms; None: skip them.
        flush_secs: how often the writer flushes to disk.

    Example::

        watch = sw.observe(model, opt, sinks=[sw.sinks.TensorBoard("runs/tb")])
    """

    def __init__(
        self,
        log_dir: str | Path,
        *,
        stats: Sequence[str] = DEFAULT_STATS,
        buckets: Any = None,
        flush_secs: int = 10,
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                f"the TensorBoard sink needs the tensorboard package: {extra('tensorboard')}"
            ) from err
        self.stats = tuple(stats)
        self.edges = None if buckets is None else _edges(buckets)
        self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=flush_secs)
        self._closed = False

    def send(self, item: Any) -> None:
        if not isinstance(item, StepRecord):
            raise TypeError(f"the TensorBoard sink takes StepRecords, got {type(item).__name__}")
        step, writer = item.step, self.writer
        # A row whose sums are not finite held NaN or Inf: its NaN statistics are the data's, written as
        # such (as /metrics serves them); elsewhere a NaN is a statistic without a value (no units).
        with np.errstate(invalid="ignore"):
            poisoned = ~np.isfinite(item.column("sum")) | ~np.isfinite(item.column("sumsq"))
            with_units = poisoned & (item.column("units") > 0)  # (unit statistics need units)
        for stat in self.stats:
            values = item.stat(stat)
            written = (with_units if stat in _UNIT_STATS else poisoned).tolist()
            for key, value, bad in zip(item.keys, values.tolist(), written, strict=True):
                if bad or not math.isnan(value):
                    writer.add_scalar(f"{_tag(key)}/{stat}", value, step, walltime=item.time)
        for past in item.steps:  # the unsampled steps' values (loss, learning rates, ...): every step
            for name, value in past.scalars.items():
                writer.add_scalar(name, value, past.step, walltime=past.time)
        for name, value in item.scalars.items():  # (a NaN loss is the run's news: written)
            writer.add_scalar(name, value, step, walltime=item.time)
        for (key, stat), vector in item.extras.items():
            if stat == "histogram":
                if self.edges is not None:
                    self._histogram(key, vector, step, item.time)
            elif not math.isnan(float(vector[0])):
                writer.add_scalar(f"{_tag(key)}/{stat}", float(vector[0]), step, walltime=item.time)

    def _histogram(self, key: SeriesKey, counts: np.ndarray, step: int, walltime: float) -> None:
        assert self.edges is not None
        finite = counts[1:]  # bucket 0 holds the non-finite values: not on the value axis
        if not finite.sum():
            return
        limits = self.edges
        nonzero = np.flatnonzero(finite)
        lo, hi = int(nonzero[0]), int(nonzero[-1])
        self.writer.add_histogram_raw(
            f"{_tag(key)}/values",
            min=float(limits[lo][0]),
            max=float(limits[hi][1]),
            num=int(finite.sum()),
            sum=0.0,  # not recorded with the counts; TensorBoard draws the buckets
            sum_squares=0.0,
            bucket_limits=[float(limits[i][1]) for i in range(lo, hi + 1)],
            bucket_counts=[float(c) for c in finite[lo : hi + 1]],
            global_step=step,
            walltime=walltime,
        )

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.writer.close()


def _tag(key: SeriesKey) -> str:
    name = f"{key.layer or '<root>'}.{key.name}" if key.name else (key.layer or "<root>")
    return f"{key.phase}/{key.kind}/{name}"


def _edges(buckets: Any) -> list[tuple[float, float]]:
    """(lower, upper) of every finite bucket, in value order, with infinite ends clamped to finite ones."""
    upper = list(buckets.upper_bounds())
    lower = [-math.inf, *upper[:-1]]
    finite_big = max(abs(b) for b in upper if math.isfinite(b)) * 10
    return [
        (
            max(lo, -finite_big) if not math.isfinite(lo) else lo,
            min(hi, finite_big) if not math.isfinite(hi) else hi,
        )
        for lo, hi in zip(lower, upper, strict=True)
    ]
