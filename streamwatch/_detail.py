"""``observe(detail=...)``: which ranks export per-layer series, and what the other ranks export instead.

A 7B-parameter model observed on every rank of a 1 024-rank job is tens of millions of Prometheus series
(docs/scale.md has the numbers). ``detail=`` picks the ranks that keep per-layer series; every other rank
reduces each step record, on its worker thread, to one row per ``(phase, kind)`` under the layer
:data:`streamwatch._families.ALL_LAYERS` (``"__all__"``): counts, sums, sums of squares, zeros and
non-finite counts added over the layers, the extremes combined, the statistics derived from those. Those
rows are the rank's totals, so the PromQL that sums sums of squares over layers and ranks (global norms,
per-rank gradient norms, non-finite counts) gives the same answer whichever ranks keep detail, and the
step-level series (loss, step time and its parts, learning rates) and streamwatch's own metrics (drops,
queue, overhead, errors) are served by every rank as before.

The reduction happens before the record reaches any sink: the series store (``snapshot()``, ``/metrics``,
the console view), a run file and your own pipelines all see the reduced record, so
``streamwatch replay`` of a reduced rank's run file serves exactly what that rank served live.

Policies (:data:`DETAIL_MODES`, or a callable):

* ``"all"`` (default): every rank keeps per-layer series.
* ``"rank0"``: only global rank 0.
* ``"local_rank0"``: one rank per node (``LOCAL_RANK == 0``, which torchrun sets).
* ``"none"``: no rank; every rank serves its totals only.
* a callable ``(rank, local_rank, world_size) -> bool``, called once by ``observe()``: e.g.
  ``lambda rank, local_rank, world_size: rank % 64 == 0`` keeps one rank in 64.

Example:
    >>> check_detail("local_rank0")
    'local_rank0'
    >>> keeps_detail("local_rank0", rank=9, local_rank=1, world_size=16)
    False
    >>> keeps_detail(lambda rank, local_rank, world_size: rank % 8 == 0, rank=8, local_rank=0, world_size=16)
    True
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable
from typing import Literal, TypeAlias

import numpy as np
import torch

from streamwatch._families import ALL_LAYERS, STEPPED_WEIGHT_SUMSQ
from streamwatch._record import PendingRecord, SeriesKey, StepRecord
from streamwatch._schema import COLUMN
from streamwatch._summary import totals

__all__ = [
    "DETAIL_MODES",
    "Detail",
    "DetailMode",
    "check_detail",
    "keeps_detail",
    "position",
    "reduce_record",
    "resolver",
    "this_rank_keeps_detail",
]

DetailMode = Literal["all", "rank0", "local_rank0", "none"]
Detail: TypeAlias = DetailMode | Callable[[int, int, int], bool]
"""What ``observe(detail=...)`` takes: a mode, or ``(rank, local_rank, world_size) -> bool``."""

DETAIL_MODES: tuple[DetailMode, ...] = ("all", "rank0", "local_rank0", "none")
"""The named policies of ``observe(detail=...)``."""

_SUMSQ = COLUMN["sumsq"]


def check_detail(detail: object) -> Detail:
    """``detail=`` checked: one of :data:`DETAIL_MODES` or a callable, else an error saying what to pass.

    Example:
        >>> check_detail("rank0")
        'rank0'
        >>> check_detail("rank_0")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Expected `detail` to be one of ('all', 'rank0', 'local_rank0', 'none') or a callable ...
    """
    if isinstance(detail, str) and detail in DETAIL_MODES:
        return detail
    if callable(detail) and not isinstance(detail, str | bytes | type):
        return detail  # its signature is checked when it is called
    error = ValueError if isinstance(detail, str) else TypeError
    raise error(
        f"Expected `detail` to be one of {DETAIL_MODES} or a callable (rank, local_rank, world_size) -> "
        f"bool, got {detail!r}"
    )


def _env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"Expected ${name} to be an integer (torchrun sets it), got {value!r}") from None


def position() -> tuple[int, int | None, int]:
    """This process's ``(rank, local_rank, world_size)``: rank and world size from ``torch.distributed``
    once it is initialised, else torchrun's ``RANK``/``WORLD_SIZE`` (0 and 1 without them); the local rank
    from ``LOCAL_RANK`` (None when it is unset in a multi-process job; 0 in a single process)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = int(torch.distributed.get_rank()), int(torch.distributed.get_world_size())
    else:
        rank, world = _env_int("RANK", 0) or 0, _env_int("WORLD_SIZE", 1) or 1
    local = _env_int("LOCAL_RANK", None)
    if local is None and world == 1:
        local = 0
    return rank, local, world


def keeps_detail(detail: Detail, *, rank: int, local_rank: int | None, world_size: int) -> bool:
    """Whether the process at ``(rank, local_rank, world_size)`` keeps per-layer series under ``detail``.

    ``local_rank`` None (``LOCAL_RANK`` unset in a multi-process job) is refused by ``"local_rank0"``,
    which could not tell the nodes apart; a callable gets ``0`` then (the exporter's ``local_rank``
    label and port offset take the rank instead: unique on every host).

    Raises:
        ValueError: ``"local_rank0"`` without a local rank.
        TypeError: the callable cannot take the three arguments, or returned something other than a bool.
        ValueError: the callable raised (the message names ``detail``; the error is its cause).

    Example:
        >>> [keeps_detail("rank0", rank=r, local_rank=r % 8, world_size=16) for r in (0, 8)]
        [True, False]
    """
    if detail == "all":
        return True
    if detail == "none":
        return False
    if detail == "rank0":
        return rank == 0
    if detail == "local_rank0":
        if local_rank is None:
            raise ValueError(
                f"detail='local_rank0' needs the local rank, but $LOCAL_RANK is not set (rank {rank} of "
                f"{world_size}): launch with torchrun, which sets it, set LOCAL_RANK yourself (e.g. from "
                "SLURM_LOCALID), or pass detail= a callable (rank, local_rank, world_size) -> bool"
            )
        return local_rank == 0
    assert callable(detail)
    args = (rank, 0 if local_rank is None else local_rank, world_size)
    try:
        inspect.signature(detail).bind(*args)
    except TypeError as err:  # (a signature that cannot take the three: say what detail= must be)
        raise TypeError(
            f"Expected `detail` to be a callable (rank, local_rank, world_size) -> bool, got {detail!r}, "
            f"which cannot be called with three arguments: {err}"
        ) from None
    except ValueError:  # no signature to read (some builtins): the call says
        pass
    try:
        answer = detail(*args)
    except Exception as err:  # the user's policy failed: say it was detail=, keep its traceback
        raise ValueError(
            f"`detail` (a callable) raised {type(err).__name__} for (rank={rank}, local_rank={local_rank}, "
            f"world_size={world_size}): {err}; it must return True or False for every rank (observe() "
            "attached nothing)"
        ) from err
    if not isinstance(answer, bool | np.bool_):
        raise TypeError(
            f"Expected `detail` (a callable) to return a bool for (rank={rank}, local_rank={local_rank}, "
            f"world_size={world_size}), got {answer!r}"
        )
    return bool(answer)


def this_rank_keeps_detail(detail: object) -> bool:
    """:func:`check_detail`, then :func:`keeps_detail` at this process's :func:`position`."""
    checked = check_detail(detail)
    rank, local_rank, world_size = position()
    return keeps_detail(checked, rank=rank, local_rank=local_rank, world_size=world_size)


def _stepped_weight_sumsq(record: StepRecord) -> np.ndarray | None:
    """Σ sumsq of the training weights with an ``update`` row in ``record`` (None without update rows or
    without their weights' rows; NaN if none of those is known).

    Example:
        >>> keys = tuple(SeriesKey("train", layer, kind, "weight")
        ...              for layer, kind in (("head", "param"), ("body", "param"), ("head", "update")))
        >>> from streamwatch.testing import table
        >>> _stepped_weight_sumsq(StepRecord(0, 0.0, 0, keys, table(sumsq=[4.0, 100.0, 1e-4]))).tolist()
        [4.0]
    """
    stepped = {(k.layer, k.name) for k in record.keys if k.kind == "update" and k.phase == "train"}
    if not stepped:
        return None
    rows = [
        i
        for i, k in enumerate(record.keys)
        if k.kind == "param" and k.phase == "train" and (k.layer, k.name) in stepped
    ]
    if not rows:
        return None  # (no weight rows this step, another cadence: the last known value stays served)
    column = record.table[rows, _SUMSQ]
    known = ~np.isnan(column)
    return np.array([float(column[known].sum()) if known.any() else math.nan], dtype=np.float64)


def reduce_record(record: StepRecord) -> StepRecord:
    """``record`` with one row per ``(phase, kind)`` under ``layer="__all__"`` in place of its per-layer
    rows, each column combined over the rows as the schema says (``streamwatch._summary.totals``):
    ``count``, ``sum``, ``sumsq``, ``zeros``, ``nonfinite``, ``units``, ``dead`` and ``active`` added,
    ``min``/``max`` combined, ``samples`` set so that ``activation_rate`` is the fraction of active
    (sample, unit) pairs over all the layers. Unknown (NaN) values are left out of a total, as PromQL's
    ``sum`` leaves out absent series; a total with no known value is unknown. Opt-in
    metric values are dropped, except ``histogram`` bucket counts, which are added per ``(phase, kind)``;
    the ``update`` total gets :data:`STEPPED_WEIGHT_SUMSQ`, the update/weight ratio's denominator.
    Step-level values (``scalars``) and ``edges`` are kept as they are.

    Example:
        >>> keys = tuple(SeriesKey("train", layer, "param_grad", "weight") for layer in ("a", "b"))
        >>> from streamwatch.testing import table
        >>> rows = table(count=4, sumsq=[9.0, 16.0], min=[-1.0, -3.0], max=[2.0, 1.0], fill=0.0)
        >>> reduced = reduce_record(StepRecord(0, 0.0, 0, keys, rows, {"loss": 1.0}))
        >>> reduced.keys, float(reduced.stat("l2")[0]), float(reduced.column("min")[0]), reduced.scalars
        ((SeriesKey(phase='train', layer='__all__', kind='param_grad', name=''),), 5.0, -3.0, {'loss': 1.0})
    """
    groups: dict[tuple[str, str], list[int]] = {}
    for i, key in enumerate(record.keys):
        groups.setdefault((key.phase, key.kind), []).append(i)
    table = totals(record.table, list(groups.values()))
    table.setflags(write=False)
    keys = tuple(SeriesKey(phase, ALL_LAYERS, kind, "") for phase, kind in groups)
    extras: dict[tuple[SeriesKey, str], np.ndarray] = {}
    for (key, stat), vector in record.extras.items():
        if stat != "histogram":
            continue
        merged = (SeriesKey(key.phase, ALL_LAYERS, key.kind, ""), stat)
        seen = extras.get(merged)
        if seen is None:
            extras[merged] = np.array(vector, dtype=np.float64)
        elif seen.shape == vector.shape:  # the buckets of one kind are the same for every layer
            extras[merged] = seen + vector
    stepped = _stepped_weight_sumsq(record)
    if stepped is not None:
        extras[(SeriesKey("train", ALL_LAYERS, "update", ""), STEPPED_WEIGHT_SUMSQ)] = stepped
    for vector in extras.values():
        vector.setflags(write=False)
    positions = record.execution_order()  # each total runs where its first layer's row ran
    order = tuple(int(positions[rows].min()) for rows in groups.values())
    return StepRecord(
        record.step,
        record.time,
        record.rank,
        keys,
        table,
        record.scalars,
        extras,
        record.edges,
        order,
        record.start_step,
    )


def _resolve_reduced(pending: PendingRecord) -> StepRecord:
    """The worker's ``prepare`` on a rank without per-layer detail: resolve, then :func:`reduce_record`."""
    return reduce_record(pending.resolve())


def resolver(detailed: bool) -> Callable[[PendingRecord], StepRecord]:
    """What the worker turns each :class:`PendingRecord` into a record with: as it is on a rank that keeps
    per-layer detail, reduced to per-``(phase, kind)`` totals on any other.

    Example:
        >>> resolver(True) is PendingRecord.resolve, resolver(False).__name__
        (True, '_resolve_reduced')
    """
    return PendingRecord.resolve if detailed else _resolve_reduced
