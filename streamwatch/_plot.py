"""A recorded run as one PNG: loss and accuracy, gradient norms, update/weight ratios, dead units.

:func:`series` turns a :class:`streamwatch.sinks.RunData` into plain lists (one value per
record, NaN where a record lacks the series); :func:`plot` draws them on a 2×2 grid with matplotlib,
which is an optional dependency: it is imported inside :func:`plot` only, never by ``import streamwatch``.
The figure is a ``matplotlib.figure.Figure`` drawn by the Agg canvas, so no pyplot state is touched.

Panels:

(a) ``loss`` and train ``accuracy`` (twin y axes) over steps, ``eval/accuracy`` where recorded, and the
    values given to ``watch.log`` (on the loss axis, up to ``top`` names, dots where they are sparse);
(b) per-layer gradient norm: the L2 norm of each layer's ``param_grad`` ``weight`` row, as a heatmap
    (layers on y, steps on x, log10 colour scale);
(c) per-layer update/weight ratio ``√(Σ update² / Σ param²)`` over the layer's parameters (the
    ``update`` and ``param`` rows of the same record), log y;
(d) per-layer dead-unit rate (``dead_fraction`` of ``activation`` rows) over steps.

Each per-layer panel shows up to ``top`` layers (those with the largest values); the title says how many
were left out. A panel with nothing to draw says "no data".
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

from streamwatch._families import ALL_LAYERS, LOGGED, stepped_weight_sumsq
from streamwatch._validate import check_int
from streamwatch._version import extra

if TYPE_CHECKING:
    from streamwatch.sinks import RunData

__all__ = ["Series", "plot", "series"]


class Series(TypedDict):
    """What :func:`series` returns: one value per record, aligned with ``steps`` (NaN where absent)."""

    steps: list[int]
    loss: list[float]
    accuracy: list[float]
    eval_accuracy: list[float]
    logged: dict[str, list[float]]
    grad_l2: dict[str, list[float]]
    update_ratio: dict[str, list[float]]
    dead: dict[str, list[float]]


def _layer_name(layer: str) -> str:
    return layer or "<root>"


def series(run: RunData) -> Series:
    """The values :func:`plot` draws, one per record of ``run`` (NaN where a record lacks the series).

    * ``loss``, ``accuracy``, ``eval_accuracy``: the record's scalars ``loss``, ``accuracy`` and
      ``eval/accuracy``;
    * ``logged``: per name, the values given to ``watch.log`` (the scalars ``log/<name>``);
    * ``grad_l2``: per layer, the ``l2`` of its ``param_grad`` row named ``weight``;
    * ``update_ratio``: per layer, ``√(Σ sumsq(update) / Σ sumsq(param))`` over the layer's parameters
      that have both rows in the record;
    * ``dead``: per ``activation`` row (``layer``, or ``layer[index]`` for a leaf of a tuple output), its
      ``dead_fraction`` (rows without units are left out).

    Layers are in order of first appearance.

    Example:
        >>> import tempfile, pathlib
        >>> from streamwatch import SeriesKey, StepRecord
        >>> from streamwatch.sinks import RunFile, read_run
        >>> from streamwatch.testing import table
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "run.jsonl"
        >>> key = SeriesKey("train", "fc", "param_grad", "weight")
        >>> sink = RunFile(path)
        >>> row = table(count=2, sumsq=9, min=-3, zeros=1, fill=0.0)
        >>> sink.send(StepRecord(0, 0.0, 0, (key,), row, {"loss": 0.5}))
        >>> sink.close()
        >>> s = series(read_run(path))
        >>> s["steps"], s["loss"], s["grad_l2"]
        ([0], [0.5], {'fc': [3.0]})
    """
    records = run.records
    n = len(records)
    out = Series(
        steps=[r.step for r in records],
        loss=[float(r.scalars.get("loss", math.nan)) for r in records],
        accuracy=[float(r.scalars.get("accuracy", math.nan)) for r in records],
        eval_accuracy=[float(r.scalars.get("eval/accuracy", math.nan)) for r in records],
        logged={},
        grad_l2={},
        update_ratio={},
        dead={},
    )
    for j, record in enumerate(records):
        for name, value in record.scalars.items():
            if name.startswith(LOGGED):
                out["logged"].setdefault(name[len(LOGGED) :], [math.nan] * n)[j] = float(value)
        if not len(record.keys):
            continue
        sumsq = record.column("sumsq")
        derived = record.stat("l2"), record.stat("dead_fraction")
        l2, dead = derived
        params: dict[tuple[str, str], float] = {}
        updates: dict[tuple[str, str], float] = {}
        for i, key in enumerate(record.keys):
            if key.phase != "train":
                continue
            layer = _layer_name(key.layer)
            if key.kind == "param_grad" and key.name == "weight":
                out["grad_l2"].setdefault(layer, [math.nan] * n)[j] = float(l2[i])
            elif key.kind == "param":
                params[(layer, key.name)] = float(sumsq[i])
            elif key.kind == "update":
                updates[(layer, key.name)] = float(sumsq[i])
            elif key.kind == "activation" and not math.isnan(dead[i]):
                name = layer + (f"[{key.name}]" if key.name else "")
                out["dead"].setdefault(name, [math.nan] * n)[j] = float(dead[i])
        for key in record.keys:  # a reduced record's total: over the stepped weights
            if key.kind == "update" and key.layer == ALL_LAYERS and key.phase == "train":
                stepped = stepped_weight_sumsq(record, key)
                if stepped is not None:
                    params[(_layer_name(key.layer), key.name)] = stepped
        totals: dict[str, list[float]] = {}
        for (layer, name), u in updates.items():
            if (layer, name) in params:
                pair = totals.setdefault(layer, [0.0, 0.0])
                pair[0] += u
                pair[1] += params[(layer, name)]
        for layer, (u, w) in totals.items():
            ratio = math.sqrt(u / w) if w > 0 else math.nan
            out["update_ratio"].setdefault(layer, [math.nan] * n)[j] = ratio
    return out


def _pick(values: dict[str, list[float]], top: int) -> tuple[list[str], int]:
    """The ``top`` layers with the largest finite values (in their original order), and how many are left."""
    if len(values) <= top:
        return list(values), 0

    def peak(layer: str) -> float:
        finite = np.asarray(values[layer], dtype=np.float64)
        finite = finite[np.isfinite(finite)]
        return float(finite.max()) if finite.size else -math.inf

    chosen = set(sorted(values, key=peak, reverse=True)[:top])
    return [layer for layer in values if layer in chosen], len(values) - top


def _title(ax: Any, text: str, left: int, total: int) -> None:
    if left:
        text += f"\n(top {total - left} of {total} layers; {left} more not shown)"
    ax.set_title(text, fontsize=10)


def _no_data(ax: Any, why: str) -> None:
    ax.text(0.5, 0.5, f"no data\n({why})", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def _edges(steps: np.ndarray, last: float) -> np.ndarray:
    """Cell edges of sampled steps: each cell from its step to the next sampled one (what a heatmap knows
    until the next sample), the last one to ``last``, the run's last step, plus one.

    Example:
        >>> _edges(np.array([0.0, 10.0, 40.0]), 99.0).tolist()
        [0.0, 10.0, 40.0, 100.0]
    """
    return np.append(steps, max(last, steps[-1]) + 1.0)


def plot(run: RunData, out: str | Path, *, top: int = 12, rank: int | None = None) -> Path:
    """Draw ``run`` as a 2×2 PNG (see the module documentation for the panels) and write it to ``out``.

    Args:
        run: a run file read back with :func:`streamwatch.sinks.read_run`.
        out: the PNG file to write (its directory must exist).
        top: at most this many layers per per-layer panel (the largest values); the rest are counted in
            the panel's title.
        rank: the rank drawn, of a run file holding several ranks' records (default: the first
            record's); the title names it. One rank's steps make one line: several ranks' on one would
            zigzag between them.

    Returns:
        ``out``, as a Path.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'streamwatch-torch[demo]'``).
        ValueError: ``top`` is not a positive int, or the run file has no record of ``rank``.

    Example::

        from streamwatch.sinks import read_run
        plot(read_run("run.jsonl"), "run.png")
    """
    check_int(top, "top")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import LogNorm
        from matplotlib.figure import Figure
    except ImportError as error:  # pragma: no cover - matplotlib is installed in the test environment
        raise ImportError(f"streamwatch plot needs matplotlib: {extra('demo')}") from error

    ranks = sorted({r.rank for r in run.records})
    if rank is not None and rank not in ranks:
        raise ValueError(
            f"{run.path} has no record of rank {rank!r}; its ranks: {', '.join(map(str, ranks)) or 'none'}"
        )
    title = f"streamwatch run: {run.path.name}"
    if len(ranks) > 1:
        chosen = rank if rank is not None else run.records[0].rank
        run = dataclasses.replace(run, records=[r for r in run.records if r.rank == chosen])
        title += f", rank {chosen} of {len(ranks)}"
    out = Path(out)
    data = series(run)
    steps = np.asarray(data["steps"], dtype=np.float64)
    fig = Figure(figsize=(14, 9), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    (ax_loss, ax_grad), (ax_ratio, ax_dead) = fig.subplots(2, 2)
    rows = sum(1 for record in run.records if record.keys)
    fig.suptitle(f"{title} ({len(steps)} steps, {rows} with layer statistics)")
    span = None  # every panel's x axis: the run's steps (a little room for a point at either end)
    if len(steps):
        pad = 0.01 * (float(steps.max()) - float(steps.min()) + 1.0)
        span = (float(steps.min()) - pad, float(steps.max()) + 1.0 + pad)

    # (a) loss and accuracy
    ax_loss.set_title("(a) loss and accuracy", fontsize=10)
    loss = np.asarray(data["loss"], dtype=np.float64)
    acc = np.asarray(data["accuracy"], dtype=np.float64)
    eval_acc = np.asarray(data["eval_accuracy"], dtype=np.float64)
    logged = {name: np.asarray(values, dtype=np.float64) for name, values in data["logged"].items()}
    if not len(steps) or not (
        np.isfinite(loss).any()
        or np.isfinite(acc).any()
        or np.isfinite(eval_acc).any()
        or any(np.isfinite(values).any() for values in logged.values())
    ):
        _no_data(ax_loss, "no loss or accuracy recorded")
    else:
        handles = []
        if np.isfinite(loss).any():
            ok = np.isfinite(loss)
            handles += ax_loss.plot(steps[ok], loss[ok], color="tab:red", label="loss (train)")
        for name in list(logged)[:top]:  # your own values (watch.log), on the loss axis
            ok = np.isfinite(logged[name])
            if ok.any():
                style = ".-" if ok.mean() > 0.5 else "o--"  # (sparse: a validation loss every N steps)
                handles += ax_loss.plot(steps[ok], logged[name][ok], style, markersize=3, label=name)
        ax_loss.set_xlabel("step")
        ax_loss.set_ylabel("loss")
        ax_acc = ax_loss.twinx()
        for values, label, style in ((acc, "accuracy (train)", "-"), (eval_acc, "accuracy (eval)", "o--")):
            ok = np.isfinite(values)
            if ok.any():
                handles += ax_acc.plot(steps[ok], values[ok] * 100, style, color="tab:blue", label=label)
        ax_acc.set_ylabel("accuracy (%)")
        ax_acc.set_ylim(0, 100)
        ax_loss.legend(handles=handles, loc="center right", fontsize=8)

    # (b) gradient norm heatmap
    grads = data["grad_l2"]
    layers, left = _pick(grads, top)
    _title(ax_grad, "(b) gradient norm per layer (param_grad weight, L2)", left, len(grads))
    matrix = np.array([grads[layer] for layer in layers], dtype=np.float64).reshape(len(layers), len(steps))
    matrix[~(matrix > 0)] = np.nan  # log scale: zeros and non-finite values are left blank
    sampled = np.isfinite(matrix).any(axis=0)  # the steps with gradient rows: a column each
    matrix = matrix[:, sampled]
    if not layers or not np.isfinite(matrix).any():
        _no_data(ax_grad, "no param_grad weight rows")
    else:
        finite = matrix[np.isfinite(matrix)]
        vmin, vmax = float(finite.min()), float(finite.max())
        if vmax <= vmin:
            vmin, vmax = vmin / 2, vmax * 2
        mesh = ax_grad.pcolormesh(
            _edges(steps[sampled], float(steps.max())),
            np.arange(len(layers) + 1) - 0.5,
            np.ma.masked_invalid(matrix),
            norm=LogNorm(vmin=vmin, vmax=vmax),
            cmap="viridis",
            shading="flat",
        )
        ax_grad.set_yticks(np.arange(len(layers)), layers, fontsize=8)
        ax_grad.invert_yaxis()
        ax_grad.set_xlabel("step")
        ax_grad.set_ylabel("layer")
        fig.colorbar(mesh, ax=ax_grad, label="gradient L2 norm (log10 scale)")

    # (c) update/weight ratio
    ratios = data["update_ratio"]
    layers, left = _pick(ratios, top)
    _title(ax_ratio, "(c) update/weight ratio per layer √(Σu²/Σw²)", left, len(ratios))
    drawn = False
    for layer in layers:
        values = np.asarray(ratios[layer], dtype=np.float64)
        ok = np.isfinite(values) & (values > 0)
        if ok.any():
            ax_ratio.plot(steps[ok], values[ok], ".-", label=layer)
            drawn = True
    if drawn:
        ax_ratio.set_yscale("log")
        ax_ratio.set_xlabel("step")
        ax_ratio.set_ylabel("‖update‖ / ‖weight‖ (ratio)")
        ax_ratio.legend(fontsize=7, ncol=2)
    else:
        _no_data(ax_ratio, "no update and param rows")

    # (d) dead units
    dead = data["dead"]
    layers, left = _pick(dead, top)
    _title(ax_dead, "(d) dead-unit rate per layer (activation)", left, len(dead))
    drawn = False
    for layer in layers:
        values = np.asarray(dead[layer], dtype=np.float64)
        ok = np.isfinite(values)
        if ok.any():
            ax_dead.plot(steps[ok], values[ok] * 100, ".-", label=layer)
            drawn = True
    if drawn:
        ax_dead.set_xlabel("step")
        ax_dead.set_ylabel("dead units (%)")
        ax_dead.set_ylim(-2, 102)
        ax_dead.legend(fontsize=7, ncol=2)
    else:
        _no_data(ax_dead, "no activation rows with units")

    if span is not None:
        for ax in (ax_loss, ax_grad, ax_ratio, ax_dead):
            ax.set_xlim(*span)  # one step axis: a panel with a few samples is read against the run
    fig.savefig(out, format="png")
    return out
