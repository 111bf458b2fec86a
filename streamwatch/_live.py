"""The live console view of ``streamwatch demo`` and :func:`streamwatch.live`: a series store's latest
values rendered with ``rich``.

``rich`` is an optional dependency (the ``demo`` extra); it is imported here only, never by
``import streamwatch``.

Example:
    >>> import io, torch, streamwatch as sw
    >>> from rich.console import Console
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> with sw.observe(model) as watch:
    ...     console = Console(width=100, record=True, file=io.StringIO(), color_system=None)
    ...     view = LiveView(watch, total_steps=10, url="http://127.0.0.1:16400/metrics", title="demo")
    ...     console.print(view.render(0))
    ...     text = console.export_text()
    >>> text.startswith("demo") and "0/10" in text and "—" in text
    True
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

from streamwatch._version import extra

try:
    from rich.console import Console, Group, RenderableType
    from rich.live import Live
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text
except ImportError as _err:  # pragma: no cover - rich is installed wherever the tests run
    raise ImportError(f"streamwatch's live view needs rich: {extra('demo')} ({_err})") from _err

from streamwatch._record import Sample
from streamwatch._store import SeriesSource, WatchStatistics

__all__ = ["MISSING", "LiveView", "Observed", "format_count", "format_ms", "format_percent", "format_value"]

MISSING = "—"
"""Shown for a value that is not known (yet)."""

_TENSOR = "streamwatch_tensor"
_MIN_INTERVAL = 0.1  # seconds between frames: at most ~10 refreshes per second
_now = time.monotonic  # the throttle's clock (a seam for tests)


class Observed(Protocol):
    """What the view reads: a series store (:class:`streamwatch.SeriesSource`) and the statistics of the
    monitoring that feeds it — a :class:`streamwatch.Watch` has both."""

    @property
    def store(self) -> SeriesSource:
        """The latest values."""
        ...

    def statistics(self) -> WatchStatistics:
        """How the monitoring is doing."""
        ...


def format_value(value: float | None) -> str:
    """A statistic, compactly: ``1.23e-02``; ``—`` when missing (None); ``nan``/``inf`` as they are (a
    loss or a norm that went non-finite is what the view is for).

    Example:
        >>> format_value(0.0123), format_value(None), format_value(float("nan")), format_value(-math.inf)
        ('1.23e-02', '—', 'nan', '-inf')
    """
    if value is None:
        return MISSING
    return f"{value:.2e}"


def format_percent(value: float | None) -> str:
    """A fraction as a percentage with one decimal: ``0.125`` → ``12.5%``; ``—`` when missing.

    Example:
        >>> format_percent(0.125), format_percent(None)
        ('12.5%', '—')
    """
    if value is None or math.isnan(value):
        return MISSING
    return f"{100.0 * value:.1f}%"


def format_count(value: float | None) -> str:
    """A count as an integer: ``3.0`` → ``3``; ``—`` when missing.

    Example:
        >>> format_count(3.0), format_count(None)
        ('3', '—')
    """
    if value is None or math.isnan(value) or math.isinf(value):
        return MISSING
    return str(round(value))


def format_ms(seconds: float | None) -> str:
    """Seconds as milliseconds: ``0.00123`` → ``1.23 ms``; ``—`` when missing.

    Example:
        >>> format_ms(0.00123), format_ms(float("nan"))
        ('1.23 ms', '—')
    """
    if seconds is None or math.isnan(seconds):
        return MISSING
    return f"{1000.0 * seconds:.2f} ms"


@dataclass
class _Layer:
    """One layer's latest values, gathered from the snapshot (train phase)."""

    activation_l2: float | None = None
    param_grad_l2: float | None = None
    output_grad_l2: float | None = None
    update_l2: float | None = None
    dead_fraction: float | None = None
    nonfinite: float | None = None
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def grad_l2(self) -> float | None:
        """The weight's gradient norm, or the output gradient's for a layer without parameters."""
        return self.param_grad_l2 if self.param_grad_l2 is not None else self.output_grad_l2


def _layers(samples: Iterable[Sample]) -> dict[str, _Layer]:
    """Per-layer values, in the snapshot's (forward) order of first appearance."""
    layers: dict[str, _Layer] = {}
    for sample in samples:
        if sample.name != _TENSOR:
            continue
        labels = sample.labels
        if labels.get("phase", "train") != "train":
            continue
        layer = layers.setdefault(labels.get("layer", ""), _Layer())
        kind, param, stat, index = (
            labels.get("kind"),
            labels.get("param", ""),
            labels.get("stat"),
            labels.get("index", ""),
        )
        if stat == "nonfinite":
            layer.nonfinite = (layer.nonfinite or 0.0) + sample.value
        if index not in ("", "0"):  # a tuple/dict output: the first leaf stands for the layer
            continue
        if kind == "activation" and stat == "l2" and layer.activation_l2 is None:
            layer.activation_l2 = sample.value
        elif kind == "activation" and stat == "dead_fraction" and layer.dead_fraction is None:
            layer.dead_fraction = sample.value
        elif kind == "param_grad" and param == "weight" and stat == "l2":
            layer.param_grad_l2 = sample.value
        elif kind == "output_grad" and stat == "l2" and layer.output_grad_l2 is None:
            layer.output_grad_l2 = sample.value
        elif kind == "update" and param == "weight" and stat == "l2":
            layer.update_l2 = sample.value
    return layers


def _scalar(samples: Iterable[Sample], name: str, **labels: str) -> float | None:
    """The value of the sample ``name{labels}`` (NaN included: a NaN loss is shown), or None."""
    for sample in samples:
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    return None


class LiveView:
    """Renders a Watch's latest values (its store, its statistics) as a rich console view.

    Sections: a header (``title`` and the ``/metrics`` URL); a progress bar with ``step/total`` (a pulsing
    bar and ``step`` with ``total_steps=None``) and steps per second; the latest train loss and accuracy;
    a per-layer table (the first ``top`` layers, the rest summarised as ``… N more``) of activation l2,
    gradient l2 (the weight's, else the output gradient's), update l2, dead-unit rate and non-finite
    count; and streamwatch's own health (records dropped, queue, worker lag, mean overhead per step, hook
    errors, the sampling interval and, with ``observe(overhead=...)``, the measured overhead and its
    budget, an escalation after a non-finite loss, and where the run's first NaN/Inf started:
    ``statistics().first_nonfinite``, docs/nonfinite.md).
    Missing values show ``—``.

    :meth:`render` is pure (it reads ``watch.store.samples()`` and ``watch.statistics()``). As a context
    manager the view runs a :class:`rich.live.Live` display; :meth:`update` redraws it at most ~10 times
    per second and the last step passed is always drawn on exit.

    Example:
        >>> import io, torch, streamwatch as sw
        >>> from rich.console import Console
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
        >>> console = Console(width=100, record=True, file=io.StringIO(), color_system=None)
        >>> with sw.observe(model) as watch, LiveView(watch, total_steps=2, console=console) as view:
        ...     for step in range(2):
        ...         _ = model(torch.randn(8, 4))
        ...         watch.step()
        ...         view.update(step + 1)
        >>> "2/2" in console.export_text()
        True
    """

    def __init__(
        self,
        watch: Observed,
        *,
        total_steps: int | None,
        url: str | None = None,
        top: int = 8,
        console: Console | None = None,
        title: str = "streamwatch",
    ) -> None:
        if total_steps is not None and total_steps < 0:
            raise ValueError(f"Expected `total_steps` >= 0, got {total_steps}")
        if top < 1:
            raise ValueError(f"Expected `top` >= 1, got {top}")
        self.watch = watch
        self.total_steps = total_steps
        self.url = url
        self.top = top
        self.console = console
        self.title = title
        self._live: Live | None = None
        self._last_draw = -math.inf
        self._drawn: int | None = None
        self._pending: int | None = None

    # -- rendering ---------------------------------------------------------------------------------

    def render(self, step: int) -> RenderableType:
        """The whole view for ``step`` (steps completed), from the watch's latest values."""
        samples = self.watch.store.samples()
        stats = self.watch.statistics()
        step_seconds = _scalar(samples, "streamwatch_last_step_seconds")
        return Group(
            self._header(),
            self._progress(step, step_seconds),
            self._training(samples),
            self._table(samples),
            self._health(stats, step_seconds),
        )

    def _header(self) -> Text:
        header = Text(self.title, style="bold")
        header.append("  ·  ")
        header.append(self.url if self.url is not None else MISSING, style="underline")
        return header

    def _progress(self, step: int, step_seconds: float | None) -> Table:
        rate = 1.0 / step_seconds if step_seconds is not None and step_seconds > 0 else None  # (NaN: None)
        grid = Table.grid(padding=(0, 2))
        grid.add_column(width=40)
        grid.add_column()
        speed = f"{f'{rate:.1f}' if rate is not None else MISSING} steps/s"
        if self.total_steps is None:  # a run of unknown length: a pulsing bar
            grid.add_row(ProgressBar(total=None, width=40), f"{step} steps  {speed}")
            return grid
        total = max(self.total_steps, 1)
        grid.add_row(
            ProgressBar(total=total, completed=min(max(step, 0), total), width=40),
            f"{step}/{self.total_steps} steps  {speed}",
        )
        return grid

    def _training(self, samples: list[Sample]) -> Text:
        loss = _scalar(samples, "streamwatch_loss", phase="train")
        accuracy = _scalar(samples, "streamwatch_accuracy", phase="train")
        text = Text("train  ")
        text.append("loss ", style="bold")
        text.append(format_value(loss))
        text.append("   accuracy ", style="bold")
        text.append(format_percent(accuracy))
        return text

    def _table(self, samples: list[Sample]) -> Table:
        table = Table(title="layers", title_justify="left", expand=False)
        table.add_column("layer", no_wrap=True, overflow="ellipsis", max_width=32)
        for name in ("activation l2", "gradient l2", "update l2", "dead units", "non-finite"):
            table.add_column(name, justify="right", no_wrap=True)
        layers = _layers(samples)
        if not layers:
            table.add_row(MISSING, MISSING, MISSING, MISSING, MISSING, MISSING)
        for name, layer in list(layers.items())[: self.top]:
            table.add_row(
                name,
                format_value(layer.activation_l2),
                format_value(layer.grad_l2),
                format_value(layer.update_l2),
                format_percent(layer.dead_fraction),
                format_count(layer.nonfinite),
            )
        if len(layers) > self.top:
            table.add_row(Text(f"… {len(layers) - self.top} more", style="dim"), "", "", "", "", "")
        return table

    def _health(self, stats: WatchStatistics, step_seconds: float | None) -> Text:
        dropped = stats.dropped_oldest + stats.dropped_newest + stats.slots_exhausted
        text = Text("streamwatch  ", style="bold")
        text.append(f"dropped {dropped}", style="yellow" if dropped else "")
        text.append(f"   queue {stats.queue_len} (max {stats.queue_high_water})")
        text.append(f"   lag {format_ms(stats.worker_lag_seconds)}")
        text.append(f"   hook errors {stats.hook_errors}", style="red" if stats.hook_errors else "")
        # streamwatch's own time on the training thread, the mean over the run's steps: sampled and
        # unsampled alike (the last step's alone is mostly an unsampled one's under the governor)
        overhead = stats.overhead_seconds_total / stats.steps if stats.steps else None
        text.append(f"\n             overhead {format_ms(overhead)}/step")
        if overhead is not None and step_seconds is not None and step_seconds > 0:
            text.append(f" ({format_percent(overhead / step_seconds)} of a step)")
        text.append(f"\n             sampled 1 step in {stats.sampling_interval}")
        if stats.overhead_budget is not None:  # observe(overhead=...): what the governor measured
            text.append(
                f" (measured overhead {format_percent(stats.overhead_ratio)}, "
                f"budget {format_percent(stats.overhead_budget)})"
            )
        if stats.escalated_until is not None:  # a sentinel trip: every step sampled for a while
            text.append(f"   escalated until step {stats.escalated_until}", style="yellow")
        first = stats.first_nonfinite
        text.append("\n             first non-finite ")
        text.append(first.describe() if first is not None else "none", style="bold red" if first else "")
        return text

    # -- live display ------------------------------------------------------------------------------

    def __enter__(self) -> LiveView:
        self._live = Live(
            self.render(self.watch.statistics().steps),
            auto_refresh=False,
            console=self.console,
            transient=False,
        )
        self._live.start(refresh=True)
        self._last_draw = -math.inf
        self._drawn = self._pending = None
        return self

    def update(self, step: int) -> None:
        """Redraw the view for ``step``, unless the last frame is under 0.1 s old (then only remember
        ``step``: it is drawn on exit at the latest)."""
        if self._live is None:
            raise RuntimeError("LiveView.update() outside `with LiveView(...) as view:`")
        self._pending = step
        now = _now()
        if now - self._last_draw >= _MIN_INTERVAL:
            self._draw(step, now)

    def _draw(self, step: int, now: float) -> None:
        assert self._live is not None
        self._live.update(self.render(step), refresh=True)
        self._last_draw = now
        self._drawn = step

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        live, self._live = self._live, None
        if live is None:
            return
        try:
            if self._pending is not None:  # the last step, with the latest values
                live.update(self.render(self._pending), refresh=True)
        finally:
            live.stop()
            if not live.console.is_terminal:  # rich ends the last frame with a newline on terminals only
                live.console.line()
