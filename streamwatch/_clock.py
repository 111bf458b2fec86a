"""Time, injected: every component that reads a clock takes a ``Clock`` so tests never sleep."""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "monotonic"]


class Clock(Protocol):
    """A zero-argument callable returning seconds from an arbitrary, non-decreasing origin."""

    def __call__(self) -> float: ...


monotonic: Clock = time.monotonic
"""The default clock: :func:`time.monotonic`."""
