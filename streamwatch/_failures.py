"""Failures: what went wrong in a Watch's hooks, metrics and pipelines, warned once and raised at close.

Nothing streamwatch runs may stop training: a hook's exception is caught and counted in the tap state, a
pipeline that raises is stopped by the worker, a worker-side metric or publisher by the series store, a
reaction callable by the non-finite tracker. :class:`Failures` collects them from those four places. At a
step's end, anything new is warned about once (a ``RuntimeWarning`` pointing at the user's
``watch.step()``); at ``close()`` everything is raised together as one
:class:`streamwatch.PipelineError`.

Example:
    >>> import warnings, torch, streamwatch as sw
    >>> model = torch.nn.Linear(2, 1)
    >>> watch = sw.observe(model, every=1)
    >>> _ = watch.pipe(sw.source() | sw.sinks.callback(lambda record: 1 / 0))
    >>> _ = model(torch.ones(1, 2)); watch.step(); _ = watch.flush()
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     _ = model(torch.ones(1, 2)); watch.step()
    >>> "ZeroDivisionError" in str(caught[0].message)
    True
    >>> try:
    ...     watch.close()
    ... except sw.PipelineError as err:
    ...     print(type(err.errors[0][1]).__name__)
    ZeroDivisionError
"""

from __future__ import annotations

import sys
import warnings

from streamwatch._exceptions import PipelineError
from streamwatch._nonfinite import NonFiniteTracker
from streamwatch._store import SeriesStore
from streamwatch._tapstate import TapState
from streamwatch._worker import Worker

__all__ = ["Failures", "user_frame"]

Failure = tuple[str, BaseException]


class Failures:
    """The failures of one Watch: in its hooks (``state``), its worker's pipelines, its series store's
    metrics and publishers, its non-finite tracker's reaction."""

    def __init__(
        self, state: TapState, store: SeriesStore, tracker: NonFiniteTracker, worker: Worker
    ) -> None:
        self._state = state
        self._store = store
        self._tracker = tracker
        self._worker = worker
        self._warned: list[Failure] = []  # warned about, raised again at close
        self._seen = (0, 0, 0)  # hook errors, store failures, tracker failures taken so far

    def new(self) -> bool:
        """Whether anything failed since the last look (cheap: the common step has nothing)."""
        counts = (len(self._state.errors), len(self._store.failures), len(self._tracker.failures))
        return self._worker.has_errors or counts != self._seen

    def warn(self) -> None:
        """Warn about what failed since the last look, once; it is raised again at close."""
        new: list[Failure] = []
        try:
            self._worker.check()
        except PipelineError as err:
            new.extend(err.errors)
        new.extend(self.take())
        if new:
            self._warned.extend(new)
            warnings.warn(
                f"streamwatch: {PipelineError(new)} — training continues; these are raised again at close()",
                RuntimeWarning,
                stacklevel=user_frame(),
            )

    def take(self) -> list[Failure]:
        """The store's, the tracker's and the hooks' failures not taken yet (now taken)."""
        hook_errors, stored, tracked = self._state.errors, self._store.failures, self._tracker.failures
        hooks, store_seen, tracker_seen = self._seen
        new = [*stored[store_seen:], *tracked[tracker_seen:]]
        new.extend(("<tap>", exc) for exc in hook_errors[hooks:])
        self._seen = (len(hook_errors), len(stored), len(tracked))
        return new

    def warned(self) -> list[Failure]:
        """The failures warned about during the run, handed over once (close() raises them)."""
        warned, self._warned = self._warned, []
        return warned


def user_frame(through: str = "") -> int:
    """The ``stacklevel`` that points a warning, raised by this function's caller, at the first frame
    outside streamwatch: the user's ``watch.step()`` call, however deep the boundary's calls are. With
    ``through="torch"``, outside torch too: a hook's warning points at the user's ``optimizer.step()``.

    Example:
        >>> user_frame() >= 1, user_frame("torch") >= 1
        (True, True)
    """
    level, frame = 1, sys._getframe(1)  # level 1: the caller, who warns
    while frame is not None and _ours(frame.f_globals.get("__name__", ""), through):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


def _ours(module: str, through: str = "") -> bool:
    if through and (module == through or module.startswith(through + ".")):
        return True
    return module == "streamwatch" or module.startswith("streamwatch.")
