"""Writing a run file: the :class:`RunFile` sink appends every step record to one JSON Lines file (the
format: ``_runformat.py``), readable after a crash with :func:`streamwatch.sinks.read_run`.

Durability: every step (with its keys line, if any) is written with one ``write()`` of complete lines
and flushed, so a killed process leaves every completed step readable; at worst the last line is cut
short, which :func:`~streamwatch.sinks.read_run` reports as ``truncated`` and skips.
``RunFile(..., fsync=True)`` also ``os.fsync``-s after each step, which survives power loss as well, at
the cost of a disk sync per step. Memory is bounded: the sink keeps only the key-id map.

Appending: a ``RunFile`` on an existing, non-empty run file continues it — every line is checked as
:func:`~streamwatch.sinks.read_run` checks it (another format, version or columns, or a corrupt line
before the last one, is a :class:`RunFileError` naming the file and the line, and nothing is written),
the key ids in use are read, and new steps follow the old ones (their numbers go on from the old ones
only if the run resumed with ``observe(start_step=)``). A truncated last line left by a crash is cut off
first.

Paths are checked when the sink is made: a missing directory, a directory or a file that cannot be
created or appended to is a :class:`RunFileError` saying what to do. Failures that only show when
writing (a full disk, a file-size limit) stop the sink's pipeline on the worker thread, which counts and
reports them (``watch.statistics().pipeline_failures``, a warning, a ``PipelineError`` at close) while
every other sink keeps running.

Example:
    >>> import tempfile, pathlib
    >>> from streamwatch import SeriesKey, StepRecord
    >>> from streamwatch.sinks import read_run
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
import os
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import IO, Any

from streamwatch._pipeline import Sink
from streamwatch._record import SeriesKey, StepRecord
from streamwatch._summary import COLUMNS
from streamwatch.sinks._runformat import (
    RunFileError,
    edges_line,
    header_line,
    keys_line,
    parse_header,
    step_line,
)
from streamwatch.sinks._runreader import RunData, read_lines

_fcntl: ModuleType | None
try:
    import fcntl as _fcntl
except ImportError:  # (Windows: no advisory locks; the in-process check still holds)
    _fcntl = None

__all__ = ["RunFile"]


@dataclass(frozen=True, slots=True)
class _Scan:
    """What an existing file holds: its key ids, where its complete lines end, its size, its last edges."""

    keys: dict[int, SeriesKey]
    good_end: int
    size: int
    edges: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    last_step: int | None = None  # the step of its last complete record


def _scan_for_append(path: Path) -> _Scan:
    """Check an existing run file line by line as :func:`~streamwatch.sinks.read_run` does and collect its
    keys, for :class:`RunFile` to continue it; a :class:`RunFileError` naming the line if it cannot be
    continued."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return _Scan({}, 0, 0)
        run = RunData(path, {})
        try:
            keys, good_end, edges = read_lines(path, f, size, run, keep=False)
        except RunFileError as error:
            raise RunFileError(
                f"cannot append to {error}; write to a new file, or remove or repair that line"
            ) from None
    if good_end == 0:  # (a header cut short: written again from the start)
        return _Scan({}, 0, size)
    columns, _ = parse_header(run.header)  # (checked by read_lines: raises nothing here)
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
    documentation for the format). Read it back with :func:`~streamwatch.sinks.read_run`, summarise it with
    ``python -m streamwatch report``.

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
        >>> from streamwatch.sinks import read_run
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
            >>> from streamwatch.sinks import read_run
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
                if edges:
                    self._edges = edges
                self._write(f, header_line(time.time(), edges))
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

    def _id(self, key: SeriesKey, new: list[tuple[int, SeriesKey]]) -> int:
        i = self._ids.get(key)
        if i is None:
            i = self._ids[key] = len(self._ids)
            new.append((i, key))
        return i

    def send(self, item: Any) -> None:
        """Append one line per step the record carries (its unrecorded steps' values, then the record
        itself, with a keys line first if it uses new series), flushed."""
        if not isinstance(item, StepRecord):
            raise TypeError(f"RunFile expects StepRecord items, got {type(item).__name__}")
        if self._forked:
            raise RunFileError(
                f"{self} was opened by the parent process before this one was forked from it: the "
                "parent writes it; make a RunFile of this process's own (its own path)"
            )
        f = self._open(item.edges)
        text = ""
        if item.edges and dict(item.edges) != dict(self._edges):
            text = edges_line(item.edges)
            self._edges = item.edges
        for record in item.every_step():
            new: list[tuple[int, SeriesKey]] = []
            ids = [self._id(SeriesKey(*key), new) for key in record.keys]
            extra_ids = [self._id(SeriesKey(*key), new) for key, _stat in record.extras]
            if new:
                text += keys_line(new)
            text += step_line(record, ids, extra_ids)
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
