"""Progress of your own training loop on the console: :func:`streamwatch.live` — the live view on a
terminal, plain log lines in a notebook or a pipe.

Presentation at the edge: this module reads a watch only through its public surface (``store``,
``statistics()``, ``snapshot()``), and ``import streamwatch`` does not import it (``streamwatch.live``
imports it when called). ``rich`` (the ``demo`` extra) is imported only for the live view, on a
terminal; the log lines need nothing.

Example:
    >>> import io, torch, streamwatch as sw
    >>> model = torch.nn.Linear(3, 2)
    >>> out = io.StringIO()  # not a terminal: log lines
    >>> with sw.observe(model, every=1) as watch, Live(watch, every=2, file=out) as progress:
    ...     for _ in range(3):
    ...         model(torch.randn(4, 3)).pow(2).mean().backward()
    ...         watch.step(loss=0.5)
    ...         progress.update()
    >>> [line.split()[:2] for line in out.getvalue().splitlines()]
    [['streamwatch'], ['step', '2'], ['step', '3']]
"""

from __future__ import annotations

import math
import sys
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

from streamwatch._store import SeriesSource, WatchStatistics
from streamwatch._validate import check_int
from streamwatch._version import extra

if TYPE_CHECKING:
    from streamwatch._live import LiveView

__all__ = ["Live", "in_notebook", "log_line"]


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (a notebook, JupyterLab, VS Code's notebooks): there a
    live display that redraws in place is not what a cell's output should be.

    Example:
        >>> in_notebook()
        False
    """
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    shell = get_ipython() if callable(get_ipython) else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def log_line(store: SeriesSource, stats: WatchStatistics, step: int, loss: float | None = None) -> str:
    """One line of progress after ``step`` steps: the train loss (``loss``, the step's own, where the
    caller has it; else the store's latest, which an unsampled step reaches with the next record, up to
    a second later) and the latest accuracy, records dropped, the worker's lag, streamwatch's mean time
    per step, the sampling interval (and, under the overhead governor, what it measured against its
    budget).

    Example:
        >>> import torch, streamwatch as sw
        >>> with sw.observe(torch.nn.Linear(2, 1), every=1) as watch:
        ...     watch.step(loss=0.25)
        ...     _ = watch.flush()
        ...     line = log_line(watch.store, watch.statistics(), 1)
        >>> line.split()[:6]
        ['step', '1', 'loss', '0.2500', 'accuracy', 'nan']
    """
    latest = {(s.name, s.labels.get("phase")): s.value for s in store.samples(table_rows=False)}
    if loss is None:
        loss = latest.get(("streamwatch_loss", "train"), math.nan)
    accuracy = latest.get(("streamwatch_accuracy", "train"), math.nan)
    dropped = stats.dropped_oldest + stats.dropped_newest
    # streamwatch's own time per step, the mean over the run (as the live view shows it: the last step's
    # alone is mostly an unsampled one's under the governor), then the interval and what it measured
    own = stats.overhead_seconds_total / stats.steps if stats.steps else 0.0
    line = (
        f"step {step:>6}  loss {loss:8.4f}  accuracy {accuracy:8.3f}  dropped {dropped}  "
        f"lag {stats.worker_lag_seconds * 1e3:6.1f} ms  overhead {own * 1e3:6.3f} ms/step  "
        f"sampled 1 in {stats.sampling_interval}"
    )
    if stats.overhead_budget is not None:  # the governor: what it measured against its budget
        ratio = stats.overhead_ratio
        measured = "—" if ratio is None or math.isnan(ratio) else f"{100 * ratio:.1f}%"
        line += f" (measured overhead {measured}, budget {100 * stats.overhead_budget:.1f}%)"
    return line


class Live:
    """What :func:`streamwatch.live` returns: call :meth:`update` once per training step, inside
    ``with``. On a terminal it draws the live view (the one ``streamwatch demo`` shows; needs rich, the
    ``demo`` extra); in a notebook, when ``file`` is not a terminal, or without rich, it prints a log
    line every ``every`` steps and one for the last step on leaving the ``with`` block.

    Args:
        watch: the :class:`streamwatch.Watch` to show (its ``store`` and ``statistics()``).
        total_steps: the steps the run will take, for the progress bar (None: unknown).
        url: the ``/metrics`` URL to show (``watch.expose(...).url``).
        every: steps between log lines (the live view redraws at most ~10 times a second instead).
        file: where to write (default ``sys.stdout``).
        title: the view's first words.

    Attributes:
        mode: ``"live"`` (the rich view) or ``"lines"``.
    """

    def __init__(
        self,
        watch: Any,
        *,
        total_steps: int | None = None,
        url: str | None = None,
        every: int = 50,
        file: IO[str] | None = None,
        title: str = "streamwatch",
    ) -> None:
        if total_steps is not None:
            check_int(total_steps, "total_steps", minimum=0)
        self.every = check_int(every, "every")
        self.watch = watch
        self.file = file
        self.total_steps = total_steps
        self.url = url
        self.title = title
        self._view: LiveView | None = None
        self._note: str | None = None
        self.mode = "live" if self._terminal() else "lines"
        self._step = 0
        self._logged: int | None = None

    def _terminal(self) -> bool:
        file = self.file if self.file is not None else sys.stdout
        isatty = getattr(file, "isatty", None)
        if in_notebook() or not (callable(isatty) and isatty()):
            return False
        try:
            import rich  # noqa: F401
        except ImportError:
            self._note = f"(the live view needs rich: {extra('demo')}; printing log lines)"
            return False
        return True

    def __enter__(self) -> Live:
        self._step, self._logged = 0, None
        if self.mode == "live":
            from rich.console import Console

            from streamwatch._live import LiveView

            console = Console(file=self.file) if self.file is not None else None
            self._view = LiveView(
                self.watch, total_steps=self.total_steps, url=self.url, console=console, title=self.title
            )
            self._view.__enter__()
        else:
            header = f"{self.title}: {self.url}" if self.url else self.title
            self._print(f"{header} {self._note}" if self._note else header)
        return self

    def update(self, step: int | None = None) -> None:
        """Show progress after ``step`` steps (default: one more than the last update). Cheap: the
        view redraws at most ~10 times a second, and a log line is printed every ``every`` steps."""
        self._step = self._step + 1 if step is None else check_int(step, "step", minimum=0)
        if self._view is not None:
            self._view.update(self._step)
        elif self._step % self.every == 0:
            self._log()

    def _log(self) -> None:
        watch = self.watch
        self._print(log_line(watch.store, watch.statistics(), self._step))
        self._logged = self._step

    def _print(self, line: str) -> None:
        print(line, file=self.file if self.file is not None else sys.stdout, flush=True)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        view, self._view = self._view, None
        if view is not None:
            view.__exit__(exc_type, exc, traceback)
        elif self._logged != self._step and self._step:
            self._log()  # the last step's line
