"""Sinks: where pipeline outputs go (callbacks, lists, async subscribers; Prometheus and files later)."""

from streamwatch.sinks._callback import Callback, Collect, callback, collect
from streamwatch.sinks._subscription import Subscription, subscribe

__all__ = ["Callback", "Collect", "Subscription", "callback", "collect", "subscribe"]
