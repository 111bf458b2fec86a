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
from streamwatch._pipeline import Chain, Node, Operator, Pipeline, Sink, Source, Stream, source
from streamwatch._record import SeriesKey, StepRecord
from streamwatch._select import Select
from streamwatch._store import SeriesSource, SeriesStore, WatchStatistics
from streamwatch._worker import Worker, WorkerStatistics

__all__ = [
    "DEFAULT_METRICS",
    "DEFAULT_OVERHEAD",
    "OVERFLOW_POLICIES",
    "SCALAR_SECONDS",
    "Chain",
    "ChannelClosed",
    "ChannelStatistics",
    "Empty",
    "EndOfChannel",
    "FirstNonFinite",
    "Full",
    "Lagged",
    "Node",
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
    "Source",
    "StepRecord",
    "Stream",
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
