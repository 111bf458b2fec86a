"""Closing a Watch: flush every completed step to every sink, take every hook out, give the model back.

:class:`Closing` holds the parts ``close()`` closes, apart from the :class:`~streamwatch.Watch` itself, so
that a Watch is closed whichever way its run ends (docs/observe.md#close):

- ``watch.close()`` (or the end of its ``with`` block) closes it there;
- a Watch nothing holds any longer (a function that returned without ``close()``, a notebook's output
  overwritten) is collected: a finalizer pauses its hooks at once (safe at any moment) and hands its
  :class:`Closing` to ``_attach.OBSERVED``, which closes it on the user's thread at the next ``observe()``
  or at exit (taking hooks out from inside a garbage collection is not safe);
- a Watch still held when the interpreter exits is closed by ``_attach.close_at_exit``.

Example:
    >>> import torch, streamwatch as sw
    >>> recs = sw.sinks.collect()
    >>> def train():  # (returns without close())
    ...     model = torch.nn.Linear(2, 1)
    ...     watch = sw.observe(model, sinks=[recs], every=1)
    ...     for _ in range(3):
    ...         model(torch.ones(1, 2)).sum().backward()
    ...         watch.step()
    >>> train()
    >>> sw.observe(torch.nn.Linear(2, 1), every=1).close()  # (the next observe() closes the dropped one)
    >>> [r.step for r in recs.items], recs.closed
    ([0, 1, 2], True)
"""

from __future__ import annotations

import math
import time
import weakref
from typing import Any

from torch import nn

from streamwatch._boundary import StepBoundary
from streamwatch._channel import Sender
from streamwatch._exceptions import PipelineError
from streamwatch._failures import Failures
from streamwatch._store import SeriesStore
from streamwatch._worker import Worker, give_up
from streamwatch.sinks._prometheus import Exporter

__all__ = ["Closing"]


class Closing:
    """What ``close()`` closes, in order: the step boundary's last work on the training thread, the
    exporters, the last record, the model's claim, the channel, the worker and its sinks (at most
    ``wait`` seconds), the store's final values; then what failed is raised. ``stuck`` and
    ``unflushed``: what a timed-out close left behind (``statistics()``). ``site``: where ``observe()``
    made the Watch, and ``timeout`` its ``close_timeout``, for a Watch closed after it was dropped."""

    def __init__(
        self,
        *,
        boundary: StepBoundary,
        sender: Sender[Any],
        worker: Worker,
        failures: Failures,
        store: SeriesStore,
        exporters: list[Exporter],
        model: weakref.ref[nn.Module],
        claimed: list[tuple[str, nn.Module]],
        site: str,
        timeout: float | None,
    ) -> None:
        self.boundary = boundary
        self.sender = sender
        self.worker = worker
        self.failures = failures
        self.store = store
        self.exporters = exporters  # (the Watch's own list: serve() adds to it)
        self.model = model
        self.claimed = claimed
        self.site = site
        self.timeout = timeout  # observe(close_timeout=...): how long a close nobody called waits
        self.stuck: tuple[str, ...] = ()
        self.unflushed = 0

    @property
    def closed(self) -> bool:
        return self.boundary.closed

    def close(self, wait: float | None) -> None:
        """Close, waiting at most ``wait`` seconds (None: forever) for the sinks; idempotent. Raises
        what ``Watch.close()`` documents."""
        from streamwatch._attach import OBSERVED  # (_attach closes dropped Watches through this class)

        boundary = self.boundary
        if boundary.closed:
            return
        deferred = boundary.finish()  # (what a dark pair's last step raised: raised once closed)
        for exporter in self.exporters:  # the final values stay readable through snapshot()
            exporter.close()
        deadline = None if wait is None else time.monotonic() + wait
        evaluation_sent = boundary.send_last(wait)
        OBSERVED.release(self.model(), self.claimed)
        self.claimed.clear()  # (the Watch's own list: it holds the modules)
        self.sender.close()
        errors = self.failures.warned()
        finished = True
        try:  # (what is left of the wait: the evaluation record's send may have used some)
            self.worker.close(None if deadline is None else max(deadline - time.monotonic(), 1e-3))
        except PipelineError as err:
            errors.extend(err.errors)
        except TimeoutError:
            finished = False  # the worker may still be in the store: leave it be
            self.stuck, self.unflushed, stuck_errors = give_up(
                self.worker,
                self.sender,
                wait or math.inf,
                evaluation_sent,  # (a TimeoutError: wait was a number)
            )
            errors.extend(stuck_errors)
        if finished:
            self.store.apply()  # the final values, and a metric failing on them, before reporting
        errors.extend(self.failures.take())
        if errors:
            failed = PipelineError(errors)
            if deferred is None:
                raise failed from errors[0][1]
            deferred.add_note(f"streamwatch: {failed}")
        if deferred is not None:
            raise deferred
