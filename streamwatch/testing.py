"""Test helpers shipped with the package: a fake clock (never ``sleep`` in a test), and summary tables
built by column name (never by width or offset: the columns are declared in ``streamwatch._schema``)."""

from __future__ import annotations

from streamwatch._summary import table

__all__ = ["FakeClock", "table"]


class FakeClock:
    """A manual clock for windows and timeouts in tests.

    Example:
        >>> from streamwatch.testing import FakeClock
        >>> clock = FakeClock()
        >>> clock.advance(1.5)
        >>> clock()
        1.5
    """

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move time forward; moving it backwards is a bug in the test and raises ``ValueError``."""
        if seconds < 0:
            raise ValueError(f"Expected `seconds` to be >= 0, got {seconds!r}")
        self.now += seconds

    def __repr__(self) -> str:
        return f"<FakeClock now={self.now}>"
