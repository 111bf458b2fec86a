"""Reading a run file back: :func:`read_run` checks every line (the format: ``_runformat.py``) and
rebuilds every complete step exactly, into a :class:`RunData`.

A run file is read while it may still be written, or after its writer was killed: a last line cut short
(or one that does not parse) is a step the crash interrupted, skipped and reported (``truncated``,
``problems``); a bad line before the last one is a :class:`RunFileError` naming the file, the line,
what is wrong and the last good step. A file written with other columns than this version's is read
with its tables rearranged to this version's columns (NaN where one is missing), and said so in
``problems``. Reading takes no lock: it leaves a writer alone.

Example:
    >>> import tempfile, pathlib, numpy as np
    >>> from streamwatch import SeriesKey, StepRecord
    >>> from streamwatch.sinks import RunFile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "run.jsonl"
    >>> key = SeriesKey("train", "fc", "param_grad", "weight")
    >>> sink = RunFile(path)
    >>> sink.send(StepRecord(4, 1.5, 0, (key,), np.zeros((1, 11)), {"loss": 0.25}))
    >>> sink.close()
    >>> run = read_run(path)
    >>> run.last_good_step, run.records[0].keys == (key,), run.records[0].scalars, run.truncated
    (4, True, {'loss': 0.25}, False)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any

import numpy as np

from streamwatch._record import SeriesKey, StepRecord
from streamwatch._summary import COLUMNS
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

__all__ = ["RunData", "read_lines", "read_run"]


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
    """Read a run file written by :class:`streamwatch.sinks.RunFile`.

    A last line without its newline, or one that does not parse, is a step cut short by a crash: the run
    is read up to the last complete step, ``truncated`` is set and the reason is in ``problems``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
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
        read_lines(path, f, size, run, keep=True)
    return run
