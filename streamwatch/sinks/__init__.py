"""Sinks: where pipeline outputs go (callbacks, lists, async subscribers, the Prometheus exporter, run
files)."""

from streamwatch.sinks._callback import Callback, Collect, callback, collect
from streamwatch.sinks._prometheus import DEFAULT_PORT, Exporter
from streamwatch.sinks._runformat import RunFileError
from streamwatch.sinks._runreader import RunData, read_run
from streamwatch.sinks._runwriter import RunFile
from streamwatch.sinks._subscription import Subscription, subscribe
from streamwatch.sinks._tensorboard import TensorBoard

__all__ = [
    "DEFAULT_PORT",
    "Callback",
    "Collect",
    "Exporter",
    "RunData",
    "RunFile",
    "RunFileError",
    "Subscription",
    "TensorBoard",
    "callback",
    "collect",
    "read_run",
    "subscribe",
]
