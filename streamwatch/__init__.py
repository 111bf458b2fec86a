"""streamwatch: a live, low-overhead PyTorch training monitor."""

from __future__ import annotations

import typing as _typing

from streamwatch import detectors, metrics, ops, sinks
from streamwatch._attach import unobserve
from streamwatch._channel import (
    OVERFLOW_POLICIES,
    ChannelStatistics,
    OverflowPolicy,
    Permit,
    Receiver,
    Sender,
    channel,
)
from streamwatch._exceptions import (
    ChannelClosed,
    Empty,
    EndOfChannel,
    Full,
    Lagged,
    NonFiniteError,
    PipelineError,
    RecvTimeout,
    SendTimeout,
    StreamwatchError,
    WouldBlock,
)
from streamwatch._nonfinite import FirstNonFinite
from streamwatch._observe import (
    DEFAULT_METRICS,
    DEFAULT_OVERHEAD,
    SCALAR_SECONDS,
    Sample,
    Watch,
    observe,
)
from streamwatch._pipeline import Operator, Pipeline, Sink, source
from streamwatch._record import SeriesKey, StepRecord
from streamwatch._select import Select
from streamwatch._store import SeriesSource, SeriesStore, WatchStatistics
from streamwatch._version import version as _installed_version
from streamwatch._worker import Worker, WorkerStatistics

__all__ = [
    "DEFAULT_METRICS",
    "DEFAULT_OVERHEAD",
    "OVERFLOW_POLICIES",
    "SCALAR_SECONDS",
    "ChannelClosed",
    "ChannelStatistics",
    "Empty",
    "EndOfChannel",
    "FirstNonFinite",
    "Full",
    "Lagged",
    "NonFiniteError",
    "Operator",
    "OverflowPolicy",
    "Permit",
    "Pipeline",
    "PipelineError",
    "Receiver",
    "RecvTimeout",
    "Sample",
    "Select",
    "SendTimeout",
    "Sender",
    "SeriesKey",
    "SeriesSource",
    "SeriesStore",
    "Sink",
    "StepRecord",
    "StreamwatchError",
    "Watch",
    "WatchStatistics",
    "Worker",
    "WorkerStatistics",
    "WouldBlock",
    "channel",
    "detectors",
    "live",
    "metrics",
    "observe",
    "ops",
    "sinks",
    "source",
    "unobserve",
]

__version__ = _installed_version()
"""The installed version (of the ``streamwatch-torch`` distribution); ``0+unknown`` in a source tree."""

if _typing.TYPE_CHECKING:
    from streamwatch._console import Live


def live(
    watch: Watch,
    *,
    total_steps: int | None = None,
    url: str | None = None,
    every: int = 50,
    file: _typing.IO[str] | None = None,
) -> Live:
    """Show a watch's progress in your own training loop: the live view of ``streamwatch demo`` on a
    terminal (loss, accuracy, per-layer norms, dead units, non-finite values, streamwatch's own cost),
    plain log lines in a notebook or when the output is not a terminal. Use it as a context manager and
    call ``update()`` once per step, after ``watch.step()``.

    Args:
        watch: what to show (``streamwatch.observe(...)``).
        total_steps: the run's length, for the progress bar (None: unknown).
        url: the ``/metrics`` URL to show (``watch.expose().url``).
        every: steps between log lines (the live view redraws at most ~10 times a second instead).
        file: where to write (default ``sys.stdout``).

    The live view needs rich (``pip install 'streamwatch-torch[demo]'``); without it, log lines.
    ``import streamwatch`` imports neither: the view's module is imported by this call.

    Example:
        >>> import torch, streamwatch as sw
        >>> model = torch.nn.Linear(3, 2)
        >>> with sw.observe(model) as watch, sw.live(watch, total_steps=3, every=3) as progress:
        ...     for step in range(3):
        ...         model(torch.randn(4, 3)).pow(2).mean().backward()
        ...         watch.step()
        ...         progress.update()  # doctest: +ELLIPSIS
        streamwatch
        step      3  loss      nan ...
    """
    from streamwatch._console import Live

    return Live(watch, total_steps=total_steps, url=url, every=every, file=file)


_MOVED = {
    "Chain": ("streamwatch._pipeline", "what composing operators with | gives"),
    "Node": ("streamwatch._pipeline", "an operator's runtime state inside a pipeline"),
    "Source": ("streamwatch._pipeline", "what streamwatch.source() returns"),
    "Stream": ("streamwatch._pipeline", "a source with operators, before its sink"),
}


def __getattr__(name: str) -> object:
    """Names that left the public namespace (internals): still importable, with a ``DeprecationWarning``
    saying where they live now (removed in a later release)."""
    from streamwatch._deprecated import moved_name

    return moved_name(__name__, _MOVED, name)
