"""Window reductions: ``mean``, ``min``, ``max``, ``std``, ``sum`` turn each window into one value.

A window is a sequence (normally a list from :func:`streamwatch.ops.window`). Its items are either all
numbers, reduced with plain Python arithmetic, or all numpy arrays of one shape (e.g. one value per
layer), stacked and reduced along the window axis, elementwise. The first item picks the path.

Non-finite values propagate rather than being skipped or warned about: a NaN anywhere in a window makes
its mean, std, sum, min and max NaN (as numpy's ``min``/``max``, unlike Python's). An empty window
produces no output and is counted as ``"<op>.empty"`` in :meth:`streamwatch.Pipeline.counters`.
"""

from __future__ import annotations

import builtins
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamwatch._pipeline import Emit, Node, Operator
from streamwatch.ops._checks import as_int

__all__ = ["Max", "Mean", "Min", "Std", "Sum", "max", "mean", "min", "std", "sum"]


# -- pure reductions: numbers (`_*_scalar`) and stacked arrays, window axis first (`_*_array`) ---------


def _fsum(values: Sequence[Any]) -> float:
    try:
        return math.fsum(values)
    except (ValueError, OverflowError):  # inf - inf or an overflow: the plain float sum gives nan or inf
        return builtins.sum(map(_float_or_inf, values), 0.0)


def _float_or_inf(value: Any) -> float:
    """``float(value)``, or ±inf for a number too large for a float (an int of 400 digits)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _first_nan(window: Sequence[Any]) -> Any:
    for x in window:
        if x != x:
            return x
    return None


def _sum_scalar(window: Sequence[Any]) -> Any:
    return builtins.sum(window)  # keeps ints exact


def _mean_scalar(window: Sequence[Any]) -> float:
    return _fsum(window) / len(window)


def _std_scalar(window: Sequence[Any], ddof: int) -> float:
    dof = len(window) - ddof
    if dof <= 0:
        return math.nan
    m = _mean_scalar(window)
    deviations = [x - m for x in window]
    return math.sqrt(_fsum([d * d for d in deviations]) / dof)


def _min_scalar(window: Sequence[Any]) -> Any:
    nan = _first_nan(window)
    return builtins.min(window) if nan is None else nan


def _max_scalar(window: Sequence[Any]) -> Any:
    nan = _first_nan(window)
    return builtins.max(window) if nan is None else nan


def _std_array(stacked: np.ndarray[Any, Any], ddof: int) -> Any:
    if stacked.shape[0] - ddof <= 0:  # numpy would warn; `[()]` makes 0-d a scalar like `std` does
        return np.full(stacked.shape[1:], np.nan)[()]
    return stacked.std(axis=0, ddof=ddof)


def _stack(window: Sequence[Any]) -> np.ndarray[Any, Any]:
    try:
        stacked: np.ndarray[Any, Any] = np.stack(window)
    except ValueError as err:
        shapes = sorted({np.shape(x) for x in window})
        raise ValueError(
            f"Expected every item of a window to be an array of one shape, got shapes {shapes}"
        ) from err
    return stacked


_SCALARS = (int, float, numbers.Number)  # int, float first: cheaper than the ABC (numpy scalars, ...)


# -- one node class per reduction, so counters read "mean.empty", "std.empty", ... -------------------


class _ReduceNode(Node):
    __slots__ = ("empty",)

    def __init__(self, emit: Emit) -> None:
        super().__init__(emit)
        self.empty = 0

    def push(self, item: Any) -> None:
        if not len(item):
            self.empty += 1
        elif isinstance(item[0], _SCALARS):
            self.emit(self._scalar(item))
        else:
            stacked = _stack(item)
            with np.errstate(invalid="ignore", over="ignore"):  # non-finite values propagate silently
                self.emit(self._array(stacked))

    def _scalar(self, window: Sequence[Any]) -> Any:
        raise NotImplementedError

    def _array(self, stacked: np.ndarray[Any, Any]) -> Any:
        raise NotImplementedError

    def counters(self) -> dict[str, int]:
        return {"empty": self.empty}


class MeanNode(_ReduceNode):
    __slots__ = ()
    _scalar = staticmethod(_mean_scalar)

    def _array(self, stacked: np.ndarray[Any, Any]) -> Any:
        return stacked.mean(axis=0)


class SumNode(_ReduceNode):
    __slots__ = ()
    _scalar = staticmethod(_sum_scalar)

    def _array(self, stacked: np.ndarray[Any, Any]) -> Any:
        return stacked.sum(axis=0)


class MinNode(_ReduceNode):
    __slots__ = ()
    _scalar = staticmethod(_min_scalar)

    def _array(self, stacked: np.ndarray[Any, Any]) -> Any:
        return stacked.min(axis=0)


class MaxNode(_ReduceNode):
    __slots__ = ()
    _scalar = staticmethod(_max_scalar)

    def _array(self, stacked: np.ndarray[Any, Any]) -> Any:
        return stacked.max(axis=0)


class StdNode(_ReduceNode):
    __slots__ = ("ddof",)

    def __init__(self, emit: Emit, ddof: int) -> None:
        super().__init__(emit)
        self.ddof = ddof

    def _scalar(self, window: Sequence[Any]) -> float:
        return _std_scalar(window, self.ddof)

    def _array(self, stacked: np.ndarray[Any, Any]) -> Any:
        return _std_array(stacked, self.ddof)


# -- operators ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, repr=False)
class Mean(Operator):
    """Mean of each window. See :func:`mean`."""

    def open(self, emit: Emit) -> MeanNode:
        return MeanNode(emit)

    def __repr__(self) -> str:
        return "<mean>"


@dataclass(frozen=True, slots=True, repr=False)
class Sum(Operator):
    """Sum of each window. See :func:`sum`."""

    def open(self, emit: Emit) -> SumNode:
        return SumNode(emit)

    def __repr__(self) -> str:
        return "<sum>"


@dataclass(frozen=True, slots=True, repr=False)
class Min(Operator):
    """Minimum of each window. See :func:`min`."""

    def open(self, emit: Emit) -> MinNode:
        return MinNode(emit)

    def __repr__(self) -> str:
        return "<min>"


@dataclass(frozen=True, slots=True, repr=False)
class Max(Operator):
    """Maximum of each window. See :func:`max`."""

    def open(self, emit: Emit) -> MaxNode:
        return MaxNode(emit)

    def __repr__(self) -> str:
        return "<max>"


@dataclass(frozen=True, slots=True, repr=False)
class Std(Operator):
    """Standard deviation of each window. See :func:`std`."""

    ddof: int

    def open(self, emit: Emit) -> StdNode:
        return StdNode(emit, self.ddof)

    def __repr__(self) -> str:
        return f"<std ddof={self.ddof}>"


def mean() -> Mean:
    """The mean of each window (a float, or an array for windows of arrays).

    Example:
        >>> import streamwatch as sw
        >>> from streamwatch import ops
        >>> out = sw.sinks.collect()
        >>> (sw.source() | ops.window(2) | ops.mean() | out).run([1, 2, 3, 4, 5])
        >>> out.items
        [1.5, 3.5, 5.0]
    """
    return Mean()


def sum() -> Sum:
    """The sum of each window (ints stay ints).

    Example:
        >>> import numpy as np
        >>> import streamwatch as sw
        >>> from streamwatch import ops
        >>> out = sw.sinks.collect()
        >>> (sw.source() | ops.window(2) | ops.sum() | out).run([np.array([1, 2]), np.array([10, 20])])
        >>> out.items
        [array([11, 22])]
    """
    return Sum()


def min() -> Min:
    """The minimum of each window; NaN if the window holds a NaN.

    Example:
        >>> import streamwatch as sw
        >>> from streamwatch import ops
        >>> out = sw.sinks.collect()
        >>> (sw.source() | ops.window(3) | ops.min() | out).run([3, 1, 2, 5, float("nan"), 4])
        >>> out.items
        [1, nan]
    """
    return Min()


def max() -> Max:
    """The maximum of each window; NaN if the window holds a NaN.

    Example:
        >>> import streamwatch as sw
        >>> from streamwatch import ops
        >>> out = sw.sinks.collect()
        >>> (sw.source() | ops.window(3) | ops.max() | out).run([3, 1, 2, 5, 6, 4])
        >>> out.items
        [3, 6]
    """
    return Max()


def std(ddof: int = 0) -> Std:
    """The standard deviation of each window.

    Population standard deviation by default, as numpy; ``ddof=1`` gives the sample standard deviation.
    A window of at most ``ddof`` items gives NaN.

    Args:
        ddof: delta degrees of freedom: the divisor is ``len(window) - ddof``.

    Example:
        >>> import streamwatch as sw
        >>> from streamwatch import ops
        >>> out = sw.sinks.collect()
        >>> (sw.source() | ops.window(4) | ops.std() | out).run([1, 3, 1, 3])
        >>> out.items
        [1.0]
    """
    message = f"Expected `ddof` to be a non-negative integer, got {ddof!r}"
    n = as_int(ddof, message)
    if n < 0:
        raise ValueError(message)
    return Std(n)
