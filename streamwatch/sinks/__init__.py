"""Sinks: where pipeline outputs go (callbacks, lists, async subscribers; Prometheus and files later)."""

from streamwatch.sinks._callback import Callback, Collect, callback, collect

__all__ = ["Callback", "Collect", "callback", "collect"]
