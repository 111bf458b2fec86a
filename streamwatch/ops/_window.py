"""Windowed operators: count windows (``window``), time windows (``window_time``) and ``ewm``.

Windows are emitted as fresh ``list`` objects, ready for a reduction (:func:`streamwatch.ops.mean`, ...).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Any

from streamwatch._clock import Clock, monotonic
from streamwatch._pipeline import Emit, Node, Operator
from streamwatch.ops._checks import as_float, check_callable, positive_int, positive_number

__all__ = ["Ewm", "Window", "WindowTime", "ewm", "window", "window_time"]


# -- window ------------------------------------------------------------------------------------------


class WindowNode(Node):
    # Invariant: `buf` (maxlen=size) holds the last `size` items and the next window is complete when
    # `due` reaches 0; `due` was last reset to `period` (`size` for the first window, then `step`).
    __slots__ = ("buf", "due", "period", "size", "step")

    def __init__(self, emit: Emit, size: int, step: int) -> None:
        super().__init__(emit)
        self.size = size
        self.step = step
        self.buf: deque[Any] = deque(maxlen=size)
        self.due = size
        self.period = size

    def push(self, item: Any) -> None:
        self.buf.append(item)
        self.due -= 1
        if not self.due:
            self.due = self.period = self.step
            self.emit(list(self.buf))

    def close(self) -> None:
        # The next window holds the last `size - due` items; flush it only if one of them arrived after
        # the last emitted window (`period - due` items did).
        taken = self.size - self.due
        if taken > 0 and self.period > self.due:
            self.emit(list(islice(self.buf, len(self.buf) - taken, None)))


@dataclass(frozen=True, slots=True, repr=False)
class Window(Operator):
    """Count-based windows. See :func:`window`."""

    size: int
    step: int

    def open(self, emit: Emit) -> WindowNode:
        return WindowNode(emit, self.size, self.step)

    def __repr__(self) -> str:
        step = "" if self.step == self.size else f" step={self.step}"
        return f"<window size={self.size}{step}>"


def window(size: int, step: int | None = None) -> Window:
    """Group items into lists of ``size`` consecutive items, a new window every ``step`` items.

    Windows start at items ``0, step, 2*step, ...``. ``step`` defaults to ``size`` (tumbling windows);
    ``step < size`` gives overlapping (sliding) windows, ``step > size`` leaves gaps (hopping windows)
    whose items are never emitted.

    ::

        input : 1 2 3 4 5 6 7 |
        window(3)
        output:     [1,2,3] [4,5,6] [7]|

    At close, at most one partial window is flushed: the one starting at the next window start, holding
    the items from there to the end, provided one of them is in no emitted window yet. So tumbling and
    hopping windows flush their incomplete tail, and sliding windows never emit a window whose items were
    all emitted already (``window(3, step=1)`` over ``1 2 3 4`` gives ``[1,2,3] [2,3,4]`` and nothing at
    close; over ``1 2`` it gives ``[1,2]`` at close).

    Args:
        size: items per window (>= 1).
        step: items between window starts (>= 1); ``None`` means ``size``.

    Example:
        >>> import streamwatch as sw
        >>> from streamwatch import ops
        >>> out = sw.sinks.collect()
        >>> (sw.source() | ops.window(3, step=2) | out).run([1, 2, 3, 4, 5, 6])
        >>> out.items
        [[1, 2, 3], [3, 4, 5], [5, 6]]
    """
    size = positive_int("size", size)
    return Window(size, size if step is None else positive_int("step", step))


# -- window_time -------------------------------------------------------------------------------------


class WindowTimeNode(Node):
    # Window k is [start, end) with start = t0 + k*step and end = start + seconds, except that when
    # seconds == span*step the end is computed as t0 + (k+span)*step, the very float that starts window
    # k+span: so tumbling windows never overlap or leave a gap through rounding.
    # Invariants: `buf` holds (time, item) for exactly the items of window k seen so far, each with
    # start <= time < end; `fresh` says whether one of them was appended after the last emitted window.
    __slots__ = ("buf", "clock", "end", "fresh", "k", "seconds", "span", "start", "step", "t0")

    def __init__(self, emit: Emit, seconds: float, step: float, clock: Clock) -> None:
        super().__init__(emit)
        self.seconds = seconds
        self.step = step
        span = round(seconds / step)
        self.span = span if span >= 1 and span * step == seconds else 0
        self.clock = clock
        self.buf: deque[tuple[float, Any]] = deque()
        self.t0 = 0.0
        self.k = -1  # no item yet
        self.start = self.end = -math.inf
        self.fresh = False

    def push(self, item: Any) -> None:
        t = self.clock()
        if t >= self.end:
            self._advance(t)
        if t >= self.start:  # otherwise `t` falls in a gap between hopping windows
            self.buf.append((t, item))
            self.fresh = True

    def _advance(self, t: float) -> None:
        """Emit every non-empty window that ends at or before ``t``; stop at the window containing it."""
        if self.k < 0:
            self.t0 = t
            self._goto(0)
            return
        buf = self.buf
        while t >= self.end:
            if buf:
                self.fresh = False
                self.emit([item for _, item in buf])
            k = self.k + 1
            start = self.t0 + k * self.step
            while buf and buf[0][0] < start:
                buf.popleft()
            if not buf:  # every window before the one ending after `t` is empty: jump over them
                k = self._first_ending_after(t, k)
            self._goto(k)

    def _end_of(self, k: int) -> float:
        if self.span:
            return self.t0 + (k + self.span) * self.step
        return self.t0 + k * self.step + self.seconds

    def _first_ending_after(self, t: float, lo: int) -> int:
        """The smallest window index >= ``lo`` whose end is after ``t``, exactly (ends grow with k)."""
        k = max(lo, math.floor((t - self.t0 - self.seconds) / self.step) + 1)
        while k > lo and self._end_of(k - 1) > t:
            k -= 1
        while self._end_of(k) <= t:
            k += 1
        return k

    def _goto(self, k: int) -> None:
        self.k = k
        self.start = self.t0 + k * self.step
        self.end = self._end_of(k)

    def close(self) -> None:
        if self.fresh:
            self.fresh = False
            self.emit([item for _, item in self.buf])


@dataclass(frozen=True, slots=True, repr=False)
class WindowTime(Operator):
    """Time-based windows. See :func:`window_time`."""

    seconds: float
    step: float
    clock: Clock

    def open(self, emit: Emit) -> WindowTimeNode:
        return WindowTimeNode(emit, self.seconds, self.step, self.clock)

    def __repr__(self) -> str:
        step = "" if self.step == self.seconds else f" step={self.step}"
        return f"<window_time seconds={self.seconds}{step}>"


def window_time(seconds: float, step: float | None = None, clock: Clock = monotonic) -> WindowTime:
    """Group items by arrival time into windows ``[start, start + seconds)``.

    Window starts are ``t0, t0 + step, t0 + 2*step, ...`` where ``t0`` is the arrival time of the first
    item, read from ``clock()`` when the item is pushed. ``step`` defaults to ``seconds`` (tumbling);
    smaller overlaps windows, larger leaves gaps whose items are never emitted.

    There are no timers: a window is emitted when the first item at or after its end arrives, or at
    close. Empty windows are skipped (a long pause costs nothing), and at close the current window is
    emitted if it holds an item not emitted yet. When ``seconds`` is a multiple of ``step``, window ends
    are computed on the same grid as window starts, so tumbling windows split time exactly, with no
    item in two windows through float rounding.

    ::

        input : 1 2 . . 3 . 4 . . . . 5 |      (one column per second)
        window_time(4)
        output:         [1,2]         [3,4] [5]|

    Args:
        seconds: window length (> 0).
        step: time between window starts (> 0); ``None`` means ``seconds``.
        clock: a non-decreasing clock in seconds; :class:`streamwatch.testing.FakeClock` in tests.

    Example:
        >>> import streamwatch as sw
        >>> from streamwatch import ops
        >>> from streamwatch.testing import FakeClock
        >>> clock, out = FakeClock(), sw.sinks.collect()
        >>> p = sw.source() | ops.window_time(4, clock=clock) | out
        >>> for x, wait in [(1, 1), (2, 3), (3, 2), (4, 5), (5, 0)]:
        ...     p.push(x)
        ...     clock.advance(wait)
        >>> p.close()
        >>> out.items
        [[1, 2], [3, 4], [5]]
    """
    seconds = positive_number("seconds", seconds)
    check_callable("clock", clock)
    return WindowTime(seconds, seconds if step is None else positive_number("step", step), clock)


# -- ewm ---------------------------------------------------------------------------------------------


class EwmNode(Node):
    __slots__ = ("alpha", "beta", "started", "y")

    def __init__(self, emit: Emit, alpha: float) -> None:
        super().__init__(emit)
        self.alpha = alpha
        self.beta = 1.0 - alpha
        self.started = False
        self.y: Any = None

    def push(self, item: Any) -> None:
        if self.started:
            # (alpha 1: the item as it is, also after an inf or NaN, which 0 * y would turn into NaN)
            self.y = y = self.alpha * item + self.beta * self.y if self.beta else self.alpha * item
        else:
            self.started = True
            self.y = y = item
        self.emit(y)


@dataclass(frozen=True, slots=True, repr=False)
class Ewm(Operator):
    """Exponentially weighted mean. See :func:`ewm`."""

    alpha: float

    def open(self, emit: Emit) -> EwmNode:
        return EwmNode(emit, self.alpha)

    def __repr__(self) -> str:
        return f"<ewm alpha={self.alpha}>"


def ewm(alpha: float) -> Ewm:
    """Exponentially weighted mean, emitted for every item.

    ``y[0] = x[0]`` and ``y[t] = alpha * x[t] + (1 - alpha) * y[t-1]``: pandas'
    ``Series.ewm(alpha=alpha, adjust=False).mean()`` without its NaN skipping (a NaN propagates; with
    ``alpha=1`` each item is emitted as it is: an inf or NaN before it is left out).
    Items may be numbers or numpy arrays (elementwise); arrays are never modified in place.

    ::

        input : 0   4   4   0 |
        ewm(0.5)
        output: 0   2   3   1.5 |

    Args:
        alpha: smoothing factor, ``0 < alpha <= 1`` (``1`` emits the items unchanged).

    Example:
        >>> import streamwatch as sw
        >>> from streamwatch import ops
        >>> out = sw.sinks.collect()
        >>> (sw.source() | ops.ewm(0.5) | out).run([0, 4, 4, 0])
        >>> out.items
        [0, 2.0, 3.0, 1.5]
    """
    message = f"Expected `alpha` to be a number in (0, 1], got {alpha!r}"
    a = as_float(alpha, message)
    if not 0 < a <= 1:
        raise ValueError(message)
    return Ewm(a)
