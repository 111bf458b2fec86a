"""streamwatch: a live, low-overhead PyTorch training monitor."""

from streamwatch import ops, sinks
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

__all__ = [
    "Chain",
    "ChannelClosed",
    "Empty",
    "EndOfChannel",
    "Full",
    "Lagged",
    "Node",
    "Operator",
    "Pipeline",
    "PipelineError",
    "RecvTimeout",
    "SendTimeout",
    "Sink",
    "Source",
    "Stream",
    "StreamwatchError",
    "WouldBlock",
    "ops",
    "sinks",
    "source",
]
