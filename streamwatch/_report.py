"""``streamwatch report``: a plain-text summary of a run file read back with
:func:`streamwatch.sinks.read_run` (steps, last loss and accuracy and the last of each value given to
``watch.log``, the worst layers, the first non-finite value). Presentation: it reads a
:class:`streamwatch.sinks.RunData` and nothing in the library imports it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from streamwatch._families import LOGGED
from streamwatch._nonfinite import NonFiniteTracker
from streamwatch._record import StepRecord
from streamwatch._summary import derive

if TYPE_CHECKING:
    from streamwatch.sinks import RunData

__all__ = ["report"]


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
        >>> from streamwatch.sinks import RunFile, read_run
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
        with_rows = sum(1 for r in records if len(r.keys))
        lines.append(
            f"steps recorded: {len(records)} (steps {min(steps)}..{max(steps)}, "
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}; "
            f"{with_rows} with layer statistics)"
        )
    else:
        lines.append("steps recorded: 0")
    if run.truncated:
        last = run.last_good_step
        lines.append(
            "truncated: yes " + ("(no complete step)" if last is None else f"(read up to step {last})")
        )
    lines.extend(f"problem: {problem}" for problem in run.problems)
    logged = sorted({name for r in records for name in r.scalars if name.startswith(LOGGED)})
    for name in ("loss", "accuracy", *logged):  # (then the values given to watch.log, by name)
        found = next(((r.step, r.scalars[name]) for r in reversed(records) if name in r.scalars), None)
        shown = name.removeprefix(LOGGED)
        lines.append(f"last {shown}: " + (f"{_fmt(found[1])} (step {found[0]})" if found else "n/a"))

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
