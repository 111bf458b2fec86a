"""Reading a run file back: :func:`read_run` checks every line (the format: ``_runformat.py``) and
rebuilds every complete step exactly, into a :class:`RunData`.

A run file is read while it may still be written, or after its writer was killed: a last line cut short
(or one that does not parse) is a step the crash interrupted, skipped and reported (``truncated``,
``problems``); a bad line before the last one is a :class:`RunFileError` naming the file, the line,
what is wrong and the last good step. A file written with other columns than this version's is read
with its tables rearranged to this version's columns (NaN where one is missing), and said so in
``problems``. Reading takes no lock: it leaves a writer alone.

Example:
    >>> import tempfile, pathlib
    >>> from streamwatch import SeriesKey, StepRecord
    >>> from streamwatch.sinks import RunFile
    >>> from streamwatch.testing import table
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "run.jsonl"
    >>> key = SeriesKey("train", "fc", "param_grad", "weight")
    >>> sink = RunFile(path)
    >>> sink.send(StepRecord(4, 1.5, 0, (key,), table(count=1, fill=0.0), {"loss": 0.25}))
    >>> sink.close()
    >>> run = read_run(path)
    >>> run.last_good_step, run.records[0].keys == (key,), run.records[0].scalars, run.truncated
    (4, True, {'loss': 0.25}, False)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from streamwatch._record import SeriesKey, StepRecord
from streamwatch._summary import COLUMNS, DERIVED, derive
from streamwatch._version import extra
from streamwatch.sinks._runformat import (
    RunFileError,
    is_cut_header,
    line_kind,
    load_line,
    parse_edges,
    parse_header,
    parse_keys,
    parse_step,
)

if TYPE_CHECKING:
    import pandas

__all__ = ["RUN_FILE", "RunData", "find_run_file", "rank_file", "read_lines", "read_run"]

RUN_FILE = "run.jsonl"
"""The run file's name in a run directory (``streamwatch demo``'s, a trainer callback's ``run_dir=``)."""


def rank_file(rank: int) -> str:
    """The name of rank ``rank``'s run file in the run directory of a job of several processes (each
    process appends to a file of its own).

    Example:
        >>> rank_file(3)
        'run-rank3.jsonl'
    """
    return f"run-rank{rank}.jsonl"


def find_run_file(path: str | Path) -> Path:
    """The run file ``path`` names: ``path`` itself if it is not a directory; in a run directory, its
    ``run.jsonl``, else its only rank file (``run-rank{N}.jsonl``). What :func:`read_run` and the command
    line read.

    Raises:
        FileNotFoundError: nothing at ``path``, or a directory without a run file, or one with the run
            files of several ranks (the message lists them: pass one).

    Example:
        >>> import tempfile
        >>> run_dir = Path(tempfile.mkdtemp())
        >>> (run_dir / "run-rank0.jsonl").touch()
        >>> find_run_file(run_dir).name
        'run-rank0.jsonl'
        >>> (run_dir / "run-rank1.jsonl").touch()
        >>> find_run_file(run_dir)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        FileNotFoundError: ... holds the run files of 2 ranks (run-rank0.jsonl, run-rank1.jsonl): pass one ...
    """
    path = Path(path)
    if not path.is_dir():
        if not path.exists():
            raise FileNotFoundError(f"no run directory or run file at {path}")
        return path
    if (path / RUN_FILE).exists():
        return path / RUN_FILE
    ranks = sorted(path.glob("run-rank*.jsonl"), key=lambda p: (len(p.name), p.name))
    if len(ranks) == 1:
        return ranks[0]
    if ranks:
        names = ", ".join(p.name for p in ranks)
        raise FileNotFoundError(
            f"{path} holds the run files of {len(ranks)} ranks ({names}): pass one of them"
        )
    raise FileNotFoundError(f"{path} is a directory without a run file ({RUN_FILE}): is it a run directory?")


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

    def to_pandas(self, stats: Iterable[str] = ()) -> pandas.DataFrame:
        """The run as a ``pandas.DataFrame`` with one row per recorded step, in the file's order.

        Columns: ``step``, ``rank``, ``time`` (``time.time()`` seconds at the step's end:
        ``pandas.to_datetime(df.time, unit="s")`` makes dates of them), then every step-level value the
        records carry, by its run-file name (``loss``, ``lr/0``, ``batch_size``, ``step_seconds``,
        ``accuracy``, ...; NaN in a row whose record lacks it). With ``stats``, also one column per
        tapped tensor and statistic, ``"<phase>/<layer>/<kind>[/<param or index>]:<stat>"`` (the layer
        ``""`` of the root module reads ``<root>``), for each statistic named: a summary column
        (``count``, ``sum``, ``sumsq``, ``min``, ``max``, ...) or a derived one (``l2``, ``mean``,
        ``std``, ``dead_fraction``, ...).

        Needs pandas, an optional extra (``pip install 'streamwatch-torch[pandas]'``).

        Raises:
            ImportError: pandas is not installed (the message names the extra).
            ValueError: an unknown statistic in ``stats``.

        Example:
            >>> from streamwatch import SeriesKey
            >>> from streamwatch.testing import table as make_table
            >>> key = SeriesKey("train", "fc", "param_grad", "weight")
            >>> table = make_table(count=4, sum=2.0, sumsq=16.0, min=-1.0, max=2.0, zeros=1, fill=0.0)
            >>> run = RunData(Path("run.jsonl"), {}, [StepRecord(0, 1.5, 0, (key,), table, {"loss": 0.5})])
            >>> frame = run.to_pandas(stats=["l2"])  # doctest: +SKIP
            >>> list(frame.columns), frame["train/fc/param_grad/weight:l2"].tolist()  # doctest: +SKIP
            (['step', 'rank', 'time', 'loss', 'train/fc/param_grad/weight:l2'], [4.0])
        """
        try:
            import pandas
        except ImportError as err:
            raise ImportError(f"RunData.to_pandas() needs pandas: {extra('pandas')} ({err})") from err
        return pandas.DataFrame(_frame_columns(self.records, _check_stats(stats)))


def _check_stats(stats: Iterable[str]) -> tuple[str, ...]:
    """``to_pandas(stats=...)``: statistic names of the summary table or derived from it."""
    if isinstance(stats, str):
        stats = (stats,)
    chosen = tuple(dict.fromkeys(stats))
    unknown = [name for name in chosen if name not in COLUMNS and name not in DERIVED]
    if unknown:
        raise ValueError(
            f"Expected `stats` to name statistics of {', '.join((*COLUMNS, *DERIVED))}, got {unknown[0]!r}"
        )
    return chosen


def _column(key: SeriesKey, stat: str) -> str:
    """A tensor statistic's DataFrame column: ``"train/fc/param_grad/weight:l2"``."""
    parts = [key.phase, key.layer or "<root>", key.kind, *([key.name] if key.name else [])]
    return f"{'/'.join(parts)}:{stat}"


def _frame_columns(records: list[StepRecord], stats: tuple[str, ...]) -> dict[str, list[Any]]:
    """The DataFrame's columns, in order: step, rank, time, step-level values, tensor statistics."""
    n = len(records)
    columns: dict[str, list[Any]] = {
        "step": [r.step for r in records],
        "rank": [r.rank for r in records],
        "time": [r.time for r in records],
    }
    nan = float("nan")
    for name in dict.fromkeys(name for r in records for name in r.scalars):
        columns[name] = [r.scalars.get(name, nan) for r in records]
    if not stats:
        return columns
    wanted: dict[str, list[float]] = {}
    for i, record in enumerate(records):
        derived = derive(record.table) if any(s in DERIVED for s in stats) else {}
        values = [(record.table[:, COLUMNS.index(s)] if s in COLUMNS else derived[s]).tolist() for s in stats]
        for row, key in enumerate(record.keys):  # (columns in the order the series first appear)
            for stat, column in zip(stats, values, strict=True):
                wanted.setdefault(_column(key, stat), [nan] * n)[i] = column[row]
    return {**columns, **wanted}


def read_lines(
    path: Path, f: IO[bytes], size: int, run: RunData, *, keep: bool
) -> tuple[dict[int, SeriesKey], int, Mapping[str, tuple[float, ...]]]:
    """Check every line of a run file (``f``, ``size`` bytes) into ``run`` — its records too if ``keep``;
    returns the key ids, where the last good line ends and the edges declared last.

    A last line that is cut short or does not parse sets ``run.truncated``; any other bad line is a
    :class:`RunFileError` naming the file, the line, what was wrong and the last good step.
    :func:`read_run` reads a file with it; a ``RunFile`` checks a file it is to append to with it.
    """
    keys: dict[int, SeriesKey] = {}
    edges: Mapping[str, tuple[float, ...]] = MappingProxyType({})
    columns: list[str] = list(COLUMNS)
    remap: np.ndarray | None = None
    position = good_end = 0
    for lineno, raw in enumerate(f, 1):
        position += len(raw)
        try:
            obj = load_line(raw)
            if lineno == 1:
                columns, edges = parse_header(obj)
                run.header = obj
                if columns != list(COLUMNS):
                    index = {name: i for i, name in enumerate(columns)}
                    remap = np.array([index.get(name, len(columns)) for name in COLUMNS], dtype=np.intp)
                    run.problems.append(
                        f"columns {columns} differ from this version's {list(COLUMNS)}: "
                        "tables were rearranged (NaN where a column is missing)"
                    )
            elif (kind := line_kind(obj)) == "keys":
                parse_keys(obj, keys)
            elif kind == "edges":
                edges = parse_edges(obj)
            else:
                record = parse_step(obj, keys, columns, remap, edges)
                if keep:
                    run.records.append(record)
                run.last_good_step = record.step
        except (ValueError, UnicodeDecodeError) as error:
            if lineno == 1 and position >= size and is_cut_header(raw):
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
    """Read a run file written by :class:`streamwatch.sinks.RunFile`, or the run file of a run directory
    (``streamwatch demo``'s, a trainer callback's ``run_dir=``; :func:`find_run_file`).

    A last line without its newline, or one that does not parse, is a step cut short by a crash: the run
    is read up to the last complete step, ``truncated`` is set and the reason is in ``problems``.

    Raises:
        FileNotFoundError: ``path`` does not exist, or is a directory without one run file.
        RunFileError: the file is not a run file (bad header), or a line before the last one is corrupt;
            the message names the file, the line, what was wrong and the last good step.

    Example:
        >>> import tempfile, pathlib
        >>> from streamwatch.sinks import RunFile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "run.jsonl"
        >>> RunFile(path).close()
        >>> with open(path, "a") as f:
        ...     _ = f.write('{"step": 0, "time": 0.0, "rank": 0, "ro')  # killed mid-write
        >>> run = read_run(path)
        >>> run.records, run.truncated, run.last_good_step
        ([], True, None)
    """
    path = find_run_file(path)
    if not path.is_file():
        raise RunFileError(f"{path}: not a regular file")
    run = RunData(path, {})
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise RunFileError(f"{path}: empty file, not a streamwatch run file (no header)")
        read_lines(path, f, size, run, keep=True)
    return run
