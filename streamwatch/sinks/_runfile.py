"""Run files: every step record appended to one JSON Lines file, read back exactly after a crash.

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

Durability: every step (with its keys line, if any) is written with one ``write()`` of complete lines
and flushed, so a killed process leaves every completed step readable; at worst the last line is cut
short, which :func:`read_run` reports as ``truncated`` and skips. ``RunFile(..., fsync=True)`` also
``os.fsync``-s after each step, which survives power loss as well, at the cost of a disk sync per step.
Memory is bounded: the sink keeps only the key-id map.

Appending: a ``RunFile`` on an existing, non-empty run file continues it — every line is checked as
:func:`read_run` checks it (another format, version or columns, or a corrupt line before the last one, is
a :class:`RunFileError` naming the file and the line, and nothing is written), the key ids in use are
read, and new steps follow the old ones (their numbers go on from the old ones only if the run resumed
with ``observe(start_step=)``). A truncated last line left by a crash is cut off first.

Paths are checked when the sink is made: a missing directory, a directory or a file that cannot be
created or appended to is a :class:`RunFileError` saying what to do. Failures that only show when
writing (a full disk, a file-size limit) stop the sink's pipeline on the worker thread, which counts and
reports them (``watch.statistics().pipeline_failures``, a warning, a ``PipelineError`` at close) while
every other sink keeps running.

Example:
    >>> import tempfile, pathlib
    >>> from streamwatch import SeriesKey, StepRecord
    >>> from streamwatch.testing import table
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "run.jsonl"
    >>> key = SeriesKey("train", "fc", "param_grad", "weight")
    >>> row = table(count=8, sum=2.0, sumsq=6.0, min=-1.0, max=2.0, zeros=1, nonfinite=float("nan"), fill=0)
    >>> sink = RunFile(path)
    >>> sink.send(StepRecord(0, 1.5, 0, (key,), row, {"loss": 0.25}))
    >>> sink.close()
    >>> run = read_run(path)
    >>> run.last_good_step, run.records[0].keys == (key,), run.records[0].scalars
    (0, True, {'loss': 0.25})
    >>> for line in path.read_text().splitlines()[1:]:  # a row: its key's id, the header's columns
    ...     print(line)  # doctest: +ELLIPSIS
    {"keys":[[0,"train","fc","param_grad","weight"]]}
    {"step":0,"time":1.5,"rank":0,"rows":[[0,8,2,6,-1,2,1,"nan",0,0,0,0...]],"scalars":{"loss":0.25},"extras":[]}
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import IO, Any, TypeGuard

import numpy as np

from streamwatch._nonfinite import NonFiniteTracker
from streamwatch._pipeline import Sink
from streamwatch._record import SeriesKey, StepRecord
from streamwatch._summary import COLUMNS, derive

_fcntl: ModuleType | None
try:
    import fcntl as _fcntl
except ImportError:  # (Windows: no advisory locks; the in-process check still holds)
    _fcntl = None

__all__ = ["FORMAT", "VERSION", "RunData", "RunFile", "RunFileError", "read_run", "report"]

FORMAT = "streamwatch-run"
"""The ``format`` field of a run file's header."""

VERSION = 1
"""The run file format version this module writes and reads."""

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_EXACT_INT = 2.0**53


class RunFileError(ValueError):
    """A file that is not a run file, a run file with a corrupt line before its last one, or a path a
    :class:`RunFile` cannot write (the message names the path, what is wrong and what to do).

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


def _dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _reject_constant(name: str) -> float:
    raise ValueError(f"bare {name} is not valid in a run file (non-finite floats are strings)")


def _loads(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:  # e.g. "[[[[…": no run file line nests more than a few levels
        raise ValueError("JSON nested too deeply to be a run file line") from None


def _encode_edges(edges: Mapping[str, Sequence[float]]) -> dict[str, list[float | int | str]]:
    return {kind: [_encode(float(b)) for b in bounds] for kind, bounds in edges.items()}


def _parse_edges(obj: Any) -> Mapping[str, tuple[float, ...]]:
    """An ``edges`` object (header field or line): tap kind -> ascending bucket upper bounds."""
    if not isinstance(obj, dict):
        raise ValueError(f"'edges' must be an object of tap kind -> list of bounds, got {obj!r}")
    out: dict[str, tuple[float, ...]] = {}
    for kind, bounds in obj.items():
        if not isinstance(bounds, list):
            raise ValueError(f"'edges' of {kind!r} must be a list of numbers, got {bounds!r}")
        out[kind] = tuple(_values(bounds, len(bounds), f"edges of {kind!r}"))
    return MappingProxyType(out)


def _check_header(obj: Any) -> list[str]:
    """The header's columns; a ValueError naming what is wrong otherwise."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        found = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"not a streamwatch run file (header format {found!r}, expected {FORMAT!r})")
    if obj.get("version") != VERSION:
        raise ValueError(f"unsupported run file version {obj.get('version')!r} (this reader reads {VERSION})")
    columns = obj.get("columns")
    if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
        raise ValueError(f"header 'columns' must be a list of strings, got {columns!r}")
    return columns


def _parse_keys(obj: dict[str, Any], keys: dict[int, SeriesKey]) -> None:
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


@dataclass(frozen=True, slots=True)
class _Scan:
    """What an existing file holds: its key ids, where its complete lines end, its size, its last edges."""

    keys: dict[int, SeriesKey]
    good_end: int
    size: int
    edges: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    last_step: int | None = None  # the step of its last complete record


def _scan_for_append(path: Path) -> _Scan:
    """Check an existing run file line by line as :func:`read_run` does and collect its keys, for
    :class:`RunFile` to continue it; a :class:`RunFileError` naming the line if it cannot be continued."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return _Scan({}, 0, 0)
        run = RunData(path, {})
        try:
            keys, good_end, edges = _read_lines(path, f, size, run, keep=False)
        except RunFileError as error:
            raise RunFileError(
                f"cannot append to {error}; write to a new file, or remove or repair that line"
            ) from None
    if good_end == 0:  # (a header cut short: written again from the start)
        return _Scan({}, 0, size)
    columns = run.header.get("columns")
    if columns != list(COLUMNS):
        raise RunFileError(
            f"cannot append to {path}: the file's columns {columns} differ from this version's "
            f"{list(COLUMNS)}; write to a new file"
        )
    return _Scan(keys, good_end, size, edges, run.last_good_step)


def _check_path(path: Path) -> None:
    """Refuse, with what to do, a path :class:`RunFile` could never write: a directory, a missing or
    non-directory parent, a file that cannot be created or appended to. Leaves nothing behind."""
    where = f"RunFile({str(path)!r})"
    if path.is_dir():
        raise RunFileError(
            f"{where}: {path} is a directory; pass the path of a file, e.g. {path / 'run.jsonl'}"
        )
    missing: Path | None = None
    for ancestor in (path.parent, *path.parent.parents):
        if ancestor.is_dir():
            break
        if ancestor.exists():
            raise RunFileError(
                f"{where}: {ancestor} is a file, not a directory; choose a path in a directory"
            )
        missing = ancestor
    if missing is not None:
        raise RunFileError(
            f"{where}: the directory {missing} does not exist; create it first "
            f"(pathlib.Path({str(path.parent)!r}).mkdir(parents=True)) or choose another path"
        )
    existed = os.path.lexists(path)
    if existed and path.is_fifo():
        raise RunFileError(
            f"{where}: {path} is a pipe (FIFO): a run file is appended to and read back, which a pipe "
            "cannot be (and opening it would wait for a reader); pass the path of a regular file"
        )
    if existed and not path.is_file():
        return  # a device (e.g. /dev/full): writes fail on the worker, stopping only the sink
    try:
        with open(path, "ab"):
            pass
    except OSError as error:
        verb = "append to" if existed else "create"
        raise RunFileError(
            f"{where}: cannot {verb} {path}: {error.strerror or error}; choose a writable location "
            "or fix its permissions"
        ) from error
    if not existed:  # created at the first step, as documented: take the probe back
        with contextlib.suppress(OSError):
            path.unlink()


def _lock(f: IO[Any], path: Path, shared: bool = False) -> None:
    """Take an advisory lock on ``f`` (exclusive: this process appends; shared: a look that no other
    process appends now), or a :class:`RunFileError` saying that another process writes ``path``.

    ``flock``: it belongs to the open file, so it also stands against a second writer in this process
    (a hard link), and reading the file meanwhile leaves it alone. A child forked while it is held (a
    DataLoader's workers) gets its copy of the descriptor pointed at ``/dev/null``
    (:func:`_after_fork_in_child`), so that the lock goes with the parent's ``close()``."""
    if _fcntl is None:
        return
    try:
        _fcntl.flock(f.fileno(), (_fcntl.LOCK_SH if shared else _fcntl.LOCK_EX) | _fcntl.LOCK_NB)
    except OSError as error:
        if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return  # a file system without locks (some network mounts): nothing to check with
        raise RunFileError(
            f"{path} is being written by another process (another rank or run with the same path): "
            "each writer numbers its series itself, so two would corrupt the file; give each process "
            "its own file (e.g. run-{rank}.jsonl)"
        ) from None


_WRITERS: weakref.WeakValueDictionary[Path, RunFile] = weakref.WeakValueDictionary()
"""The run files this process writes, by resolved path (a RunFile that is closed or gone writes no more)."""
_WRITERS_LOCK = threading.Lock()
_OPENING = threading.RLock()
"""Held from a RunFile's ``open()`` until the descriptor is where the fork handler looks
(``_opening``), and by a fork meanwhile: ``open()`` releases the GIL, so without it a fork could copy
a descriptor the child's handler cannot find, whose lock would outlive the parent's ``close()``.
Reentrant: a fork from a signal handler that interrupted this thread's ``open()`` does not deadlock."""


def _after_fork_in_child() -> None:
    """In a child forked while run files were open: point the child's copies of their descriptors at
    ``/dev/null`` (one ``dup2`` each: no Python lock is taken, so a fork in the middle of the worker's
    write cannot hang here), which lets the parent's lock go with the parent's ``close()``. Those
    RunFiles refuse to write in the child (the parent writes them); ones not open yet work as usual."""
    global _WRITERS_LOCK, _OPENING
    _WRITERS_LOCK = threading.Lock()  # (another thread may have held it at the fork)
    _OPENING = threading.RLock()  # (the forking thread held the parent's: this copy is never released)
    try:
        files = [(w, w._file or w._opening) for w in list(_WRITERS.values())]
    except RuntimeError:  # (changed during the fork: nothing reliable to go by)
        return
    writers = [(w, f) for w, f in files if f is not None]
    if not writers:
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for writer, f in writers:
            with contextlib.suppress(OSError, ValueError):
                os.dup2(null, f.fileno())
            writer._forked = True
    finally:
        os.close(null)


if hasattr(os, "register_at_fork"):
    # the fork waits for an open() in flight (a local file: microseconds); nothing else takes _OPENING
    os.register_at_fork(
        before=lambda: _OPENING.acquire(),
        after_in_parent=lambda: _OPENING.release(),
        after_in_child=_after_fork_in_child,
    )


class RunFile(Sink):
    """A sink appending every :class:`streamwatch.StepRecord` to a JSON Lines run file (see the module
    documentation for the format). Read it back with :func:`read_run`, summarise it with :func:`report`.

    Args:
        path: the run file; created if missing, continued if it is a run file already.
        fsync: also ``os.fsync`` after every step (survives power loss; costs a disk sync per step).
            Without it, each step is flushed to the operating system, which survives a killed process.

    Raises:
        RunFileError: (a ``ValueError``) ``path`` exists, is not empty and is not a version-1 run file
            with these columns that reads back cleanly (the message names the line); or ``path`` cannot
            be written: its directory is missing, it is a directory, or creating or appending to it
            fails (the message says what to do); or another ``RunFile`` of this process writes to it
            and is not closed, or another process appends to it now (each numbers its series itself:
            two writers would corrupt the file; give each watch, and each rank, its own file). A
            process that starts writing the file after this one was made is found at the first step:
            this sink then fails (counted and reported, as any failing sink) and writes nothing.

    Example:
        >>> import tempfile, pathlib, torch, streamwatch as sw
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "run.jsonl"
        >>> model = torch.nn.Linear(3, 2)
        >>> with sw.observe(model, every=1, sinks=[RunFile(path)]) as watch:
        ...     for _ in range(2):
        ...         model(torch.randn(4, 3)).sum().backward()
        ...         watch.step(loss=1.0)
        >>> [r.step for r in read_run(path).records]
        [0, 1]
    """

    __slots__ = ("_edges", "_file", "_forked", "_fsync", "_ids", "_opening", "_path", "_scan", "closed")

    def __init__(self, path: str | Path, *, fsync: bool = False) -> None:
        self._path = Path(path)
        self._fsync = bool(fsync)
        self._file: IO[bytes] | None = None
        self._opening: IO[bytes] | None = None  # opened, being locked and checked: not _file yet
        self._forked = False  # this is a forked child's copy of a RunFile its parent had open
        self.closed = False
        _check_path(self._path)
        with _WRITERS_LOCK:
            where = self._path.resolve()
            other = _WRITERS.get(where)
            if other is not None and not other.closed:
                raise RunFileError(
                    f"{self._path} is being written by another RunFile of this process (another watch, "
                    "or a second sink), not closed yet: each numbers its series itself, so two writers "
                    "would corrupt the file; give each its own file, or close the other first"
                )
            self._scan = _Scan({}, 0, 0)
            _WRITERS[where] = self  # (from here the fork handler sees the probe, _opening, below)
            try:
                if self._path.is_file():  # another process appending now: said here, not at the first step
                    with _OPENING:
                        self._opening = probe = open(self._path, "rb")  # noqa: SIM115 - closed below
                    try:
                        _lock(probe, self._path, shared=True)
                        self._scan = _scan_for_append(self._path)
                    finally:
                        self._opening = None
                        probe.close()
            except BaseException:
                del _WRITERS[where]
                raise
        self._ids: dict[SeriesKey, int] = {key: i for i, key in self._scan.keys.items()}
        self._edges: Mapping[str, tuple[float, ...]] = self._scan.edges

    @property
    def path(self) -> Path:
        """Where the run is written."""
        return self._path

    @property
    def next_step(self) -> int:
        """The step after the file's last record when this sink was made (0 for a new or empty file):
        ``observe(start_step=sink.next_step)`` numbers a run appended to it after the one before's
        records, so the file's step numbers keep increasing. The file knows only recorded steps: steps
        trained after the last record, unsampled, are not counted. To go on from a trainer's own count,
        pass its global step instead.

        Example:
            >>> import tempfile, pathlib, torch, streamwatch as sw
            >>> path = pathlib.Path(tempfile.mkdtemp()) / "run.jsonl"
            >>> model = torch.nn.Linear(3, 2)
            >>> for _ in range(2):  # two sessions, one file
            ...     sink = RunFile(path)
            ...     with sw.observe(model, every=1, sinks=[sink], start_step=sink.next_step) as watch:
            ...         for _ in range(2):
            ...             watch.step(loss=1.0)
            >>> [r.step for r in read_run(path).records]
            [0, 1, 2, 3]
        """
        last = self._scan.last_step
        return 0 if last is None else last + 1

    def _open(self, edges: Mapping[str, tuple[float, ...]] | None = None) -> IO[bytes]:
        if self._file is not None:
            return self._file
        if self.closed:
            raise RuntimeError(f"RunFile({str(self._path)!r}) is closed")
        # unbuffered: each line goes straight to the file (no buffer to flush, nor its lock, which a
        # fork in the middle of a write would leave held in the child)
        # (the fork handler sees it from here: a child forked while the lock is taken gets /dev/null)
        with _OPENING:
            self._opening = f = open(self._path, "ab", buffering=0)  # noqa: SIM115 - open until close()
        try:
            _lock(f, self._path)  # (held until close: no other process appends meanwhile)
            size = f.seek(0, os.SEEK_END)
            if size != self._scan.size:  # written to since __init__: look again
                self._scan = _scan_for_append(self._path)
                self._ids = {key: i for i, key in self._scan.keys.items()}
                self._edges = self._scan.edges
            if self._scan.good_end < size:  # a line cut short by a crash
                f.truncate(self._scan.good_end)
                size = f.seek(0, os.SEEK_END)
            if size == 0:
                header = {
                    "format": FORMAT,
                    "version": VERSION,
                    "columns": list(COLUMNS),
                    "created": time.time(),
                }
                if edges:
                    header["edges"] = _encode_edges(edges)
                    self._edges = edges
                self._write(f, _dumps(header) + "\n")
        except BaseException:
            self._opening = None
            with contextlib.suppress(OSError):  # its flush would fail again: keep the first error
                f.close()
            raise
        self._file, self._opening = f, None
        return f

    def _write(self, f: IO[bytes], text: str) -> None:
        data = memoryview(text.encode("utf-8"))
        while data:  # (an unbuffered write may take part of it)
            written = f.write(data)
            if not written:
                raise OSError(f"writing {self._path} wrote nothing")
            data = data[written:]
        if self._fsync:
            os.fsync(f.fileno())

    def _id(self, key: SeriesKey, new: list[list[object]]) -> int:
        i = self._ids.get(key)
        if i is None:
            i = self._ids[key] = len(self._ids)
            new.append([i, key.phase, key.layer, key.kind, key.name])
        return i

    def send(self, item: Any) -> None:
        """Append one step record (with a keys line first if it uses new series), flushed."""
        if not isinstance(item, StepRecord):
            raise TypeError(f"RunFile expects StepRecord items, got {type(item).__name__}")
        if self._forked:
            raise RunFileError(
                f"{self} was opened by the parent process before this one was forked from it: the "
                "parent writes it; make a RunFile of this process's own (its own path)"
            )
        f = self._open(item.edges)
        new: list[list[object]] = []
        ids = [self._id(SeriesKey(*key), new) for key in item.keys]
        rows = [[i, *map(_encode, values)] for i, values in zip(ids, item.table.tolist(), strict=True)]
        extras = [
            [
                self._id(SeriesKey(*key), new),
                stat,
                [_encode(v) for v in np.asarray(value, np.float64).tolist()],
            ]
            for (key, stat), value in item.extras.items()
        ]
        line: dict[str, object] = {
            "step": int(item.step),
            "time": _encode(float(item.time)),
            "rank": int(item.rank),
            "rows": rows,
            "scalars": {name: _encode(float(v)) for name, v in item.scalars.items()},
            "extras": extras,
        }
        if item.start_step:  # (a resumed run's records: 0, the default, is left out)
            line["start"] = int(item.start_step)
        order = item.order
        if len(order) == len(item.keys) and any(position != i for i, position in enumerate(order)):
            line["order"] = [int(position) for position in order]
        text = _dumps(line) + "\n"
        if new:
            text = _dumps({"keys": new}) + "\n" + text
        if item.edges and dict(item.edges) != dict(self._edges):
            text = _dumps({"edges": _encode_edges(item.edges)}) + "\n" + text
            self._edges = item.edges
        self._write(f, text)

    def close(self) -> None:
        """Close the file (creating it with just a header if no step came)."""
        if self.closed:
            return
        try:
            self._open()
        finally:
            self.closed = True
            if self._file is not None:
                self._file.close()
                self._file = None

    def fail(self, error: BaseException) -> None:
        """The pipeline failed: keep what was written and close the file (never creating it)."""
        if self.closed:
            return
        self.closed = True
        f, self._file = self._file, None
        if f is not None:
            f.close()

    def __repr__(self) -> str:
        return f"<run file {str(self._path)!r}>"


@dataclass(slots=True)
class RunData:
    """A run file read back by :func:`read_run`.

    Attributes:
        path: the file.
        header: its header line (format, version, columns, created).
        records: every complete step, rebuilt exactly (keys, table, scalars, extras).
        last_good_step: the step of the last complete record (None if there is none).
        truncated: the last line was cut short (no newline) or does not parse; it was skipped.
        problems: what was wrong but tolerated (the truncated line, other columns than this version's).

    Example:
        >>> RunData(Path("run.jsonl"), {}).last_good_step is None
        True
    """

    path: Path
    header: dict[str, Any]
    records: list[StepRecord] = field(default_factory=list)
    last_good_step: int | None = None
    truncated: bool = False
    problems: list[str] = field(default_factory=list)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _values(values: Any, width: int, what: str) -> list[float]:
    if not isinstance(values, list) or len(values) != width:
        raise ValueError(f"{what} must have {width} values, got {values!r}")
    return [_decode(v) for v in values]


def _parse_step(
    obj: dict[str, Any],
    keys: Mapping[int, SeriesKey],
    columns: Sequence[str],
    remap: np.ndarray | None,
    edges: Mapping[str, tuple[float, ...]],
) -> StepRecord:
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


_HEADER_START = b'{"format":"' + FORMAT.encode() + b'"'


def _cut_header(line: bytes) -> bool:
    """Whether ``line``, the file's only and unterminated line, is a header cut short by a crash.

    Example:
        >>> _cut_header(b'{"format":"streamwatch-run","vers'), _cut_header(b'{"form'), _cut_header(b"hello")
        (True, True, False)
    """
    return not line.endswith(b"\n") and (line.startswith(_HEADER_START) or _HEADER_START.startswith(line))


def _read_lines(
    path: Path, f: IO[bytes], size: int, run: RunData, *, keep: bool
) -> tuple[dict[int, SeriesKey], int, Mapping[str, tuple[float, ...]]]:
    """Check every line of a run file (``f``, ``size`` bytes) into ``run`` — its records too if ``keep``;
    returns the key ids, where the last good line ends and the edges declared last.

    A last line that is cut short or does not parse sets ``run.truncated``; any other bad line is a
    :class:`RunFileError` naming the file, the line, what was wrong and the last good step.
    """
    keys: dict[int, SeriesKey] = {}
    edges: Mapping[str, tuple[float, ...]] = MappingProxyType({})
    columns: list[str] = list(COLUMNS)
    remap: np.ndarray | None = None
    position = good_end = 0
    for lineno, raw in enumerate(f, 1):
        position += len(raw)
        try:
            if not raw.endswith(b"\n"):
                raise ValueError("the line has no newline (cut short)")
            obj = _loads(raw.decode("utf-8"))
            if lineno == 1:
                columns = _check_header(obj)
                if "edges" in obj:
                    edges = _parse_edges(obj["edges"])
                run.header = obj
                if columns != list(COLUMNS):
                    index = {name: i for i, name in enumerate(columns)}
                    remap = np.array([index.get(name, len(columns)) for name in COLUMNS], dtype=np.intp)
                    run.problems.append(
                        f"columns {columns} differ from this version's {list(COLUMNS)}: "
                        "tables were rearranged (NaN where a column is missing)"
                    )
            elif not isinstance(obj, dict):
                raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
            elif "keys" in obj:
                _parse_keys(obj, keys)
            elif "edges" in obj and "step" not in obj:
                edges = _parse_edges(obj["edges"])
            elif "step" in obj:
                record = _parse_step(obj, keys, columns, remap, edges)
                if keep:
                    run.records.append(record)
                run.last_good_step = record.step
            else:
                raise ValueError(f"neither a keys nor a step line (fields {sorted(obj)})")
        except (ValueError, UnicodeDecodeError) as error:
            if lineno == 1 and position >= size and _cut_header(raw):
                run.truncated = True  # a crash or a full disk during the first write: no step recorded
                run.problems.append(f"{path}: the header line was cut short: no step was recorded")
                break
            if lineno == 1:
                raise RunFileError(f"{path}: line 1: not a streamwatch run file: {error}") from None
            where = f"{path}: line {lineno}: {error} (last good step: {run.last_good_step})"
            if position < size:
                raise RunFileError(where) from None
            run.truncated = True
            run.problems.append(f"truncated record at {where}")
            break
        good_end = position
    return keys, good_end, edges


def read_run(path: str | Path) -> RunData:
    """Read a run file written by :class:`RunFile`.

    A last line without its newline, or one that does not parse, is a step cut short by a crash: the run
    is read up to the last complete step, ``truncated`` is set and the reason is in ``problems``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        RunFileError: the file is not a run file (bad header), or a line before the last one is corrupt;
            the message names the file, the line, what was wrong and the last good step.

    Example:
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "run.jsonl"
        >>> RunFile(path).close()
        >>> with open(path, "a") as f:
        ...     _ = f.write('{"step": 0, "time": 0.0, "rank": 0, "ro')  # killed mid-write
        >>> run = read_run(path)
        >>> run.records, run.truncated, run.last_good_step
        ([], True, None)
    """
    path = Path(path)
    if not path.is_file():
        if path.exists():
            raise RunFileError(f"{path}: not a regular file")
        raise FileNotFoundError(f"run file not found: {path}")
    run = RunData(path, {})
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise RunFileError(f"{path}: empty file, not a streamwatch run file (no header)")
        _read_lines(path, f, size, run, keep=True)
    return run


def _fmt(value: float) -> str:
    return f"{value:.6g}" if math.isfinite(value) else str(value)


def _last_with(records: Sequence[StepRecord], kind: str) -> StepRecord | None:
    """The last record with training rows of ``kind`` (an evaluation pass's are not the training's)."""
    return next((r for r in reversed(records) if r.rows(kind, "train")), None)


def _worst(values: Mapping[str, float], top: int) -> list[tuple[str, float]]:
    """The ``top`` largest values, non-finite ones (the worst) first."""

    def order(item: tuple[str, float]) -> tuple[bool, float]:
        finite = math.isfinite(item[1])
        return finite, -item[1] if finite else 0.0

    return sorted(values.items(), key=order)[:top]


def report(run: RunData, *, top: int = 5) -> str:
    """A plain-text summary of a run: steps, last loss and accuracy, the ``top`` worst layers by gradient
    norm and by dead activations, and the first non-finite value.

    * gradient norm: per layer, the L2 norm of all its parameter gradients together
      (``√Σ sumsq`` over the layer's ``param_grad`` rows) in the last record that has gradients;
      non-finite norms rank first;
    * dead fraction: ``dead_fraction`` of each ``activation`` row in the last record that has
      activations (rows without units are left out);
    * first non-finite: what ``watch.statistics().first_nonfinite`` said live, recomputed from the records
      (:class:`streamwatch._nonfinite.NonFiniteTracker`): the first non-finite tensor in the step's
      execution order (step, rank, layer, kind, name, direction), marked uncertain when the step before
      it was not recorded in full.

    Example:
        >>> import tempfile, pathlib
        >>> from streamwatch import SeriesKey, StepRecord
        >>> from streamwatch.testing import table
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "run.jsonl"
        >>> sink = RunFile(path)
        >>> key = SeriesKey("train", "fc", "param_grad", "weight")
        >>> row = table(count=4, sum=2, sumsq=9, min=-1, max=2, nonfinite=1, fill=0.0)
        >>> sink.send(StepRecord(7, 0.0, 0, (key,), row))
        >>> sink.close()
        >>> print(report(read_run(path)).splitlines()[-1])  # doctest: +ELLIPSIS
        first non-finite: step 7, rank 0, layer 'fc', kind param_grad, name 'weight', direction backward; ...
    """
    records = run.records
    lines = [f"streamwatch run: {run.path}"]
    if records:
        ranks = sorted({r.rank for r in records})
        steps = [r.step for r in records]  # (a run resumed from an older checkpoint repeats steps)
        lines.append(
            f"steps recorded: {len(records)} (steps {min(steps)}..{max(steps)}, "
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
        )
    else:
        lines.append("steps recorded: 0")
    if run.truncated:
        last = run.last_good_step
        lines.append(
            "truncated: yes " + ("(no complete step)" if last is None else f"(read up to step {last})")
        )
    lines.extend(f"problem: {problem}" for problem in run.problems)
    for name in ("loss", "accuracy"):
        found = next(((r.step, r.scalars[name]) for r in reversed(records) if name in r.scalars), None)
        lines.append(f"last {name}: " + (f"{_fmt(found[1])} (step {found[0]})" if found else "n/a"))

    grads = _last_with(records, "param_grad")
    lines.append("")
    if grads is None:
        lines.append("worst layers by gradient norm: n/a (no param_grad rows)")
    else:
        sumsq: dict[str, float] = {}
        column = grads.column("sumsq")
        for i in grads.rows("param_grad", "train"):
            layer = grads.keys[i].layer
            sumsq[layer] = sumsq.get(layer, 0.0) + float(column[i])
        norms = {layer: math.sqrt(v) if v >= 0 else math.nan for layer, v in sumsq.items()}
        lines.append(f"worst layers by gradient norm (param_grad l2, step {grads.step}):")
        width = max(len(layer or "<root>") for layer in norms)
        for rank, (layer, norm) in enumerate(_worst(norms, top), 1):
            lines.append(f"  {rank:>2}. {layer or '<root>':<{width}}  {_fmt(norm)}")

    acts = _last_with(records, "activation")
    lines.append("")
    dead: dict[str, float] = {}
    if acts is not None:
        fraction = derive(acts.table)["dead_fraction"]
        for i in acts.rows("activation", "train"):
            if not math.isnan(fraction[i]):
                key = acts.keys[i]
                dead[key.layer + (f"[{key.name}]" if key.name else "")] = float(fraction[i])
    if acts is None or not dead:
        lines.append("worst layers by dead fraction: n/a (no activation rows with units)")
    else:
        lines.append(f"worst layers by dead fraction (activation, step {acts.step}):")
        width = max(len(layer or "<root>") for layer in dead)
        for rank, (layer, value) in enumerate(_worst(dead, top), 1):
            lines.append(f"  {rank:>2}. {layer or '<root>':<{width}}  {value:.2%}")

    lines.append("")
    tracker = NonFiniteTracker(None, None)  # what the live watch's worker computed, from the same records
    origin: StepRecord | None = None  # the record the first value is in (step numbers may repeat)
    for record in records:
        before = tracker.first
        tracker.send(record)
        if tracker.first is not before:
            origin = record
    first = tracker.first
    if first is None or origin is None:
        lines.append("first non-finite: none")
    else:
        record = origin
        bad = int(np.count_nonzero(record.column("nonfinite") > 0)) - (first.kind != "loss")
        more = f" (+{bad} more rows)" if bad > 0 else ""
        sure = "" if first.certain else "; uncertain: the step before was not recorded in full"
        lines.append(
            f"first non-finite: step {first.step}, rank {first.rank}, layer {first.layer!r}, kind "
            f"{first.kind}, name {first.param or first.index!r}, direction {first.direction}{more}{sure}"
        )
    return "\n".join(lines) + "\n"
