"""streamwatch: a live, low-overhead PyTorch training monitor."""

from streamwatch import ops, sinks
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
    PipelineError,
    RecvTimeout,
    SendTimeout,
    StreamwatchError,
    WouldBlock,
)
from streamwatch._pipeline import Chain, Node, Operator, Pipeline, Sink, Source, Stream, source
from streamwatch._worker import Worker, WorkerStatistics

__all__ = [
    "OVERFLOW_POLICIES",
    "Chain",
    "ChannelClosed",
    "ChannelStatistics",
    "Empty",
    "EndOfChannel",
    "Full",
    "Lagged",
    "Node",
    "Operator",
    "OverflowPolicy",
    "Permit",
    "Pipeline",
    "PipelineError",
    "Receiver",
    "RecvTimeout",
    "SendTimeout",
    "Sender",
    "Sink",
    "Source",
    "Stream",
    "StreamwatchError",
    "Worker",
    "WorkerStatistics",
    "WouldBlock",
    "channel",
    "ops",
    "sinks",
    "source",
]
