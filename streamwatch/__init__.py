"""streamwatch: a live, low-overhead PyTorch training monitor."""

from importlib import metadata as _metadata

from streamwatch import detectors, metrics, ops, sinks
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
from streamwatch._observe import DEFAULT_METRICS, DEFAULT_OVERHEAD, SCALAR_SECONDS, Sample, Watch, observe
from streamwatch._pipeline import Operator, Pipeline, Sink, source
from streamwatch._record import SeriesKey, StepRecord
from streamwatch._select import Select
from streamwatch._store import SeriesSource, SeriesStore, WatchStatistics
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
    "metrics",
    "observe",
    "ops",
    "sinks",
    "source",
]

try:
    __version__ = _metadata.version("streamwatch")
except _metadata.PackageNotFoundError:  # pragma: no cover - imported from a source tree that is not installed
    __version__ = "0+unknown"

_MOVED = {
    "Chain": ("streamwatch._pipeline", "what composing operators with | gives"),
    "Node": ("streamwatch._pipeline", "an operator's runtime state inside a pipeline"),
    "Source": ("streamwatch._pipeline", "what streamwatch.source() returns"),
    "Stream": ("streamwatch._pipeline", "a source with operators, before its sink"),
}


def __getattr__(name: str) -> object:
    """Names that left the public namespace (internals): still importable, with a ``DeprecationWarning``
    saying where they live now (removed in a later release)."""
    moved = _MOVED.get(name)
    if moved is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    import warnings

    module, why = moved
    warnings.warn(
        f"{__name__}.{name} is internal ({why}) and leaves the public API; it is {module}.{name} for now "
        "and will be removed",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), name)
