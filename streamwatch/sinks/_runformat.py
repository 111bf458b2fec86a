"""The run file format: how a :class:`streamwatch.StepRecord` becomes lines of a run file, and how lines
become records again. The one home of the format's name, version and field names: the writer
(:class:`streamwatch.sinks.RunFile`, in ``_runwriter.py``) and the reader
(:func:`streamwatch.sinks.read_run`, in ``_runreader.py``) both go through the functions here.

Format (``"streamwatch-run"``, version 1)
-----------------------------------------

A run file is UTF-8 `JSON Lines <https://jsonlines.org>`_: one compact JSON object per line, each line
ending with ``\\n``. Three kinds of line exist (and a rare fourth, below):

1. The **header**, the first line and only there::

       {"format": "streamwatch-run", "version": 1, "columns": ["count", "sum", ...], "created": 1700000000.5,
        "edges": {"param_grad": [-10000, ..., "inf"]}}

   ``columns`` names the columns of every row (``streamwatch._summary.COLUMNS`` of the writer);
   ``created`` is the ``time.time()`` at which the file was started; ``edges`` (optional, absent in
   older files) is :attr:`streamwatch.StepRecord.edges` of the records that follow: histogram bucket upper
   bounds by tap kind, what a reader needs to serve the ``histogram`` extras as Prometheus histograms.
   If a later record carries other edges (a run appended with other buckets), an **edges** line
   ``{"edges": {...}}`` declares them before that record's line.

2. A **keys** line, written the first time a step uses series the file has not named yet (just before
   that step's line)::

       {"keys": [[0, "train", "fc", "activation", ""], [1, "train", "fc", "param_grad", "weight"]]}

   Each entry is ``[id, phase, layer, kind, name]`` (a :class:`streamwatch.SeriesKey`). Ids are small
   ints, 0, 1, 2, … in order of first use, defined once and stable within the file.

3. A **step** line per :class:`streamwatch.StepRecord`::

       {"step": 3, "time": 1700000001.25, "rank": 0,
        "rows": [[0, 256, 12.5, 40.25, 0.0, 3.5, 128, 0, 16, 2, 16, 100], ...],
        "scalars": {"loss": 0.6931, "accuracy": 0.5},
        "extras": [[1, "spectral_norm", [2.75]]]}

   (on one line). ``rows`` holds the record's table in row order, each row its key id followed by one
   value per header column; ``extras`` holds opt-in metric vectors as ``[key_id, stat, [v, ...]]``.
   ``order`` (optional: written only when the rows are not already in execution order) holds each row's
   position in the step's execution (:attr:`streamwatch.StepRecord.order`), integers, one per row;
   readers that do not know it ignore it, and without it the row order is the execution order.
   ``start`` (optional: written only when not 0) is the first step of the run that wrote the record
   (:attr:`streamwatch.StepRecord.start_step`: the step a resumed run went on from).

Numbers: floats are written with ``repr`` (shortest exact round trip); floats that are whole numbers
below 2**53 in magnitude are written as JSON integers (``256`` rather than ``256.0``; ``-0.0`` keeps its
sign as a float). JSON has no NaN or infinity, so non-finite floats are written as the **strings**
``"nan"``, ``"inf"`` and ``"-inf"``; no other string appears where a number is expected.

How the file is written (durability, appending, locking) is in ``_runwriter.py``'s docstring; how it is
read back (a last line cut short by a crash, another version's columns) in ``_runreader.py``'s.

Example:
    >>> from streamwatch import SeriesKey, StepRecord
    >>> from streamwatch.testing import table
    >>> key = SeriesKey("train", "fc", "param_grad", "weight")
    >>> row = table(count=8, sum=2.0, sumsq=6.0, min=-1.0, max=2.0, zeros=1, nonfinite=float("nan"), fill=0)
    >>> record = StepRecord(0, 1.5, 0, (key,), row, {"loss": 0.25})
    >>> lines = keys_line([(0, key)]) + step_line(record, [0], [])
    >>> print(lines, end="")  # a row: its key's id, then the header's columns  # doctest: +ELLIPSIS
    {"keys":[[0,"train","fc","param_grad","weight"]]}
    {"step":0,"time":1.5,"rank":0,"rows":[[0,8,2,6,-1,2,1,"nan",0,0,0,0...]],"scalars":{"loss":0.25},"extras":[]}
    >>> keys = {}
    >>> first, second = (load_line(line.encode() + b"\\n") for line in lines.splitlines())
    >>> line_kind(first), parse_keys(first, keys), line_kind(second)
    ('keys', None, 'step')
    >>> parse_step(second, keys, COLUMNS, None, {}).scalars
    {'loss': 0.25}
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal, TypeGuard

import numpy as np

from streamwatch._record import SeriesKey, StepRecord
from streamwatch._summary import COLUMNS

__all__ = [
    "FORMAT",
    "VERSION",
    "RunFileError",
    "edges_line",
    "header_line",
    "is_cut_header",
    "keys_line",
    "line_kind",
    "load_line",
    "parse_edges",
    "parse_header",
    "parse_keys",
    "parse_step",
    "step_line",
]

FORMAT = "streamwatch-run"
"""The ``format`` field of a run file's header."""

VERSION = 1
"""The run file format version this package writes and reads."""

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_EXACT_INT = 2.0**53


class RunFileError(ValueError):
    """A file that is not a run file, a run file with a corrupt line before its last one, or a path a
    :class:`streamwatch.sinks.RunFile` cannot write (the message names the path, what is wrong and what
    to do).

    Example:
        >>> issubclass(RunFileError, ValueError)
        True
    """


def _encode(value: float) -> float | int | str:
    """A float as JSON: whole numbers as ints, non-finite as ``"nan"``/``"inf"``/``"-inf"``, else itself."""
    if value != value:
        return "nan"
    if value == math.inf:
        return "inf"
    if value == -math.inf:
        return "-inf"
    if value.is_integer() and abs(value) < _EXACT_INT and (value != 0 or math.copysign(1.0, value) > 0):
        return int(value)
    return value


def _decode(value: Any) -> float:
    """The inverse of :func:`_encode`; a ValueError for anything else."""
    if isinstance(value, float):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise ValueError(
                f"an integer of {len(str(abs(value)))} digits is too large for a float"
            ) from None
    if isinstance(value, str) and value in _NONFINITE:
        return _NONFINITE[value]
    raise ValueError(f"expected a number or 'nan'/'inf'/'-inf', got {value!r}")


def _line(obj: object) -> str:
    """``obj`` as one compact JSON line, newline included."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False) + "\n"


def _encode_edges(edges: Mapping[str, Sequence[float]]) -> dict[str, list[float | int | str]]:
    return {kind: [_encode(float(b)) for b in bounds] for kind, bounds in edges.items()}


# ---- writing: records to lines ---------------------------------------------------------------------


def header_line(created: float, edges: Mapping[str, Sequence[float]] | None = None) -> str:
    """The first line of a new run file: this version's format and columns, made at ``created``.

    Example:
        >>> header_line(1.5)[:43]
        '{"format":"streamwatch-run","version":1,"co'
    """
    # ("format" first: a reader tells a header cut short by its first bytes, _HEADER_START)
    header: dict[str, object] = {
        "format": FORMAT,
        "version": VERSION,
        "columns": list(COLUMNS),
        "created": created,
    }
    if edges:
        header["edges"] = _encode_edges(edges)
    return _line(header)


def keys_line(keys: Sequence[tuple[int, SeriesKey]]) -> str:
    """The line naming new series, as ``(id, key)`` pairs.

    Example:
        >>> keys_line([(0, SeriesKey("train", "fc", "activation", ""))])
        '{"keys":[[0,"train","fc","activation",""]]}\\n'
    """
    return _line({"keys": [[i, key.phase, key.layer, key.kind, key.name] for i, key in keys]})


def edges_line(edges: Mapping[str, Sequence[float]]) -> str:
    """The line declaring the histogram edges of the records that follow.

    Example:
        >>> edges_line({"param_grad": [0.5, float("inf")]})
        '{"edges":{"param_grad":[0.5,"inf"]}}\\n'
    """
    return _line({"edges": _encode_edges(edges)})


def step_line(record: StepRecord, ids: Sequence[int], extra_ids: Sequence[int]) -> str:
    """The line of one step record: ``ids`` are the file's ids of its keys (row by row), ``extra_ids``
    those of its extras' keys (in the order of ``record.extras``). An example is in the module docstring.
    """
    rows = [[i, *map(_encode, values)] for i, values in zip(ids, record.table.tolist(), strict=True)]
    extras = [
        [i, stat, [_encode(v) for v in np.asarray(value, np.float64).tolist()]]
        for i, ((_key, stat), value) in zip(extra_ids, record.extras.items(), strict=True)
    ]
    line: dict[str, object] = {
        "step": int(record.step),
        "time": _encode(float(record.time)),
        "rank": int(record.rank),
        "rows": rows,
        "scalars": {name: _encode(float(v)) for name, v in record.scalars.items()},
        "extras": extras,
    }
    if record.start_step:  # (a resumed run's records: 0, the default, is left out)
        line["start"] = int(record.start_step)
    order = record.order
    if len(order) == len(record.keys) and any(position != i for i, position in enumerate(order)):
        line["order"] = [int(position) for position in order]
    return _line(line)


# ---- reading: lines to records ---------------------------------------------------------------------


def _reject_constant(name: str) -> float:
    raise ValueError(f"bare {name} is not valid in a run file (non-finite floats are strings)")


def load_line(raw: bytes) -> Any:
    """One line of a run file as JSON; a ValueError saying what is wrong (no newline: cut short).

    Example:
        >>> load_line(b'{"keys":[]}\\n')
        {'keys': []}
        >>> load_line(b'{"keys":[]}')
        Traceback (most recent call last):
        ValueError: the line has no newline (cut short)
    """
    if not raw.endswith(b"\n"):
        raise ValueError("the line has no newline (cut short)")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except RecursionError:  # e.g. "[[[[…": no run file line nests more than a few levels
        raise ValueError("JSON nested too deeply to be a run file line") from None


_HEADER_START = _line({"format": FORMAT}).encode()[:-2]
"""The first bytes of every header :func:`header_line` writes: ``{"format":"streamwatch-run"``."""


def is_cut_header(line: bytes) -> bool:
    """Whether ``line``, the file's only and unterminated line, is a header cut short by a crash.

    Example:
        >>> is_cut_header(b'{"format":"streamwatch-run","vers'), is_cut_header(b'{"form')
        (True, True)
        >>> is_cut_header(b"hello"), is_cut_header(b'{"format":"streamwatch-run"}\\n')
        (False, False)
    """
    return not line.endswith(b"\n") and (line.startswith(_HEADER_START) or _HEADER_START.startswith(line))


def _values(values: Any, width: int, what: str) -> list[float]:
    if not isinstance(values, list) or len(values) != width:
        raise ValueError(f"{what} must have {width} values, got {values!r}")
    return [_decode(v) for v in values]


def parse_edges(obj: dict[str, Any]) -> Mapping[str, tuple[float, ...]]:
    """The ``edges`` of a header or an edges line: tap kind -> ascending bucket upper bounds."""
    edges = obj["edges"]
    if not isinstance(edges, dict):
        raise ValueError(f"'edges' must be an object of tap kind -> list of bounds, got {edges!r}")
    out: dict[str, tuple[float, ...]] = {}
    for kind, bounds in edges.items():
        if not isinstance(bounds, list):
            raise ValueError(f"'edges' of {kind!r} must be a list of numbers, got {bounds!r}")
        out[kind] = tuple(_values(bounds, len(bounds), f"edges of {kind!r}"))
    return MappingProxyType(out)


def parse_header(obj: Any) -> tuple[list[str], Mapping[str, tuple[float, ...]]]:
    """The header's columns and edges (none: empty); a ValueError naming what is wrong otherwise.

    Example:
        >>> parse_header({"format": "streamwatch-run", "version": 2})
        Traceback (most recent call last):
        ValueError: unsupported run file version 2 (this reader reads 1)
    """
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        found = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"not a streamwatch run file (header format {found!r}, expected {FORMAT!r})")
    if obj.get("version") != VERSION:
        raise ValueError(f"unsupported run file version {obj.get('version')!r} (this reader reads {VERSION})")
    columns = obj.get("columns")
    if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
        raise ValueError(f"header 'columns' must be a list of strings, got {columns!r}")
    edges: Mapping[str, tuple[float, ...]] = parse_edges(obj) if "edges" in obj else MappingProxyType({})
    return columns, edges


def line_kind(obj: Any) -> Literal["keys", "edges", "step"]:
    """Which kind of line (after the header) ``obj`` is; a ValueError if none."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "keys" in obj:
        return "keys"
    if "edges" in obj and "step" not in obj:
        return "edges"
    if "step" in obj:
        return "step"
    raise ValueError(f"neither a keys nor a step line (fields {sorted(obj)})")


def parse_keys(obj: dict[str, Any], keys: dict[int, SeriesKey]) -> None:
    """Add the series a keys line names to ``keys`` (id -> key); a ValueError for an id defined twice."""
    entries = obj["keys"]
    if not isinstance(entries, list):
        raise ValueError("'keys' must be a list")
    for entry in entries:
        if (
            not isinstance(entry, list)
            or len(entry) != 5
            or not isinstance(entry[0], int)
            or isinstance(entry[0], bool)
            or not all(isinstance(part, str) for part in entry[1:])
        ):
            raise ValueError(f"a key must be [id, phase, layer, kind, name], got {entry!r}")
        if entry[0] in keys:
            raise ValueError(f"key id {entry[0]} is defined twice")
        keys[entry[0]] = SeriesKey(*entry[1:])


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_step(
    obj: dict[str, Any],
    keys: Mapping[int, SeriesKey],
    columns: Sequence[str],
    remap: np.ndarray | None,
    edges: Mapping[str, tuple[float, ...]],
) -> StepRecord:
    """The record of a step line whose rows hold ``columns``, with the series ``keys`` named so far;
    ``remap`` (for other columns than this version's) picks this version's columns from them, with
    index ``len(columns)`` for NaN where one is missing. A ValueError says what is wrong."""
    step, rank, stamp = obj.get("step"), obj.get("rank"), obj.get("time")
    if not (_is_int(step) and _is_int(rank)):
        raise ValueError(f"'step' and 'rank' must be integers, got {step!r} and {rank!r}")

    def key_of(i: Any) -> SeriesKey:
        if not _is_int(i) or i not in keys:
            raise ValueError(f"unknown key id {i!r}")
        return keys[i]

    rows, scalars, extras = obj.get("rows"), obj.get("scalars"), obj.get("extras", [])
    if not isinstance(rows, list) or not isinstance(scalars, dict) or not isinstance(extras, list):
        raise ValueError("'rows' must be a list, 'scalars' an object and 'extras' a list")
    width = len(columns)
    row_keys: list[SeriesKey] = []
    table = np.empty((len(rows), width), dtype=np.float64)
    for r, row in enumerate(rows):
        if not isinstance(row, list) or not row:
            raise ValueError(f"a row must be [key_id, value, ...], got {row!r}")
        row_keys.append(key_of(row[0]))
        table[r] = _values(row[1:], width, f"row {r}")
    if remap is not None:  # another version's columns: this version's order, NaN where missing
        table = np.concatenate([table, np.full((len(rows), 1), np.nan)], axis=1)[:, remap]
    table.setflags(write=False)
    extra: dict[tuple[SeriesKey, str], np.ndarray] = {}
    for entry in extras:
        if not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[1], str):
            raise ValueError(f"an extra must be [key_id, stat, [values]], got {entry!r}")
        if not isinstance(entry[2], list):
            raise ValueError(f"an extra's values must be a list, got {entry[2]!r}")
        vector = np.array(_values(entry[2], len(entry[2]), "an extra"), dtype=np.float64)
        vector.setflags(write=False)
        extra[(key_of(entry[0]), entry[1])] = vector
    start = obj.get("start", 0)
    if not _is_int(start) or start < 0:
        raise ValueError(f"'start' must be an integer >= 0 (the run's first step), got {start!r}")
    order = obj.get("order", [])
    if not isinstance(order, list) or (order and (len(order) != len(rows) or not all(map(_is_int, order)))):
        raise ValueError(f"'order' must be a list of one integer per row, got {order!r}")
    return StepRecord(
        step=step,
        time=_decode(stamp),
        rank=rank,
        keys=tuple(row_keys),
        table=table,
        scalars={str(name): _decode(v) for name, v in scalars.items()},
        extras=extra,
        edges=edges,
        order=tuple(order),
        start_step=start,
    )
