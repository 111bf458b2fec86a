"""Operators: the steps between a source and a sink, composed with ``|``.

Families, one module each:

* **transform** — item by item: :func:`map`, :func:`filter`, :func:`scan`, :func:`subsample`.
* **window** — group or smooth over time: :func:`window` (count), :func:`window_time` (clock),
  :func:`ewm` (exponentially weighted mean).
* **reduce** — one value per window: :func:`mean`, :func:`std`, :func:`min`, :func:`max`, :func:`sum`.
* **combine** — :func:`zip` aligns several streams by a key such as the step number.

Every operator is a frozen, printable description; the state lives in the pipeline built from it, so one
operator can serve many pipelines.

Example:
    >>> from streamwatch import ops
    >>> ops.map(abs) | ops.window(64, step=16) | ops.std(ddof=1)
    <map abs> | <window size=64 step=16> | <std ddof=1>
"""

from streamwatch.ops._combine import zip
from streamwatch.ops._reduce import max, mean, min, std, sum
from streamwatch.ops._transform import filter, map, scan, subsample
from streamwatch.ops._window import ewm, window, window_time

__all__ = [
    "ewm",
    "filter",
    "map",
    "max",
    "mean",
    "min",
    "scan",
    "std",
    "subsample",
    "sum",
    "window",
    "window_time",
    "zip",
]
