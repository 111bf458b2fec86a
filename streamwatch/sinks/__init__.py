"""Sinks: where pipeline outputs go (callbacks, lists, async subscribers, the Prometheus exporter)."""

from streamwatch.sinks._callback import Callback, Collect, callback, collect
from streamwatch.sinks._prometheus import DEFAULT_PORT, Exporter
from streamwatch.sinks._subscription import Subscription, subscribe

__all__ = [
    "DEFAULT_PORT",
    "Callback",
    "Collect",
    "Exporter",
    "Subscription",
    "callback",
    "collect",
    "subscribe",
]
