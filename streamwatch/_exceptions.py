"""Every public exception streamwatch raises, in one tree.

Each class derives from :class:`StreamwatchError` *and* from the builtin a caller would
naturally catch, so ``except TimeoutError`` and ``except StreamwatchError`` both work::

    StreamwatchError(Exception)
    ├── WouldBlock(BlockingIOError)       a *_nowait call could not proceed right now
    │   ├── Full                          send side: the channel is at capacity (hands the item back)
    │   └── Empty                         receive side: nothing buffered, senders still open
    ├── SendTimeout(TimeoutError)         send/reserve waited `timeout` seconds for room (hands the item back)
    ├── RecvTimeout(TimeoutError)         recv waited `timeout` seconds for an item
    ├── ChannelClosed(BrokenPipeError)    send on a closed channel (hands the item back); says who closed it
    ├── EndOfChannel(EOFError)            receive on a channel that is closed *and* drained
    ├── Lagged(RuntimeError)              a subscriber fell behind; ``missed`` items were overwritten
    ├── PipelineError(RuntimeError)       a pipeline raised on the worker; the original is ``__cause__``
    └── NonFiniteError(FloatingPointError) a NaN/Inf appeared and observe(on_nonfinite="raise") was asked for

Errors that hand an item back carry it as ``.item`` so nothing is lost silently: the caller
decides whether to retry, drop (and count) or re-raise.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ChannelClosed",
    "Empty",
    "EndOfChannel",
    "Full",
    "Lagged",
    "NonFiniteError",
    "PipelineError",
    "RecvTimeout",
    "SendTimeout",
    "StreamwatchError",
    "WouldBlock",
]


class StreamwatchError(Exception):
    """Base class of every exception streamwatch raises on purpose."""


class WouldBlock(StreamwatchError, BlockingIOError):
    """A ``*_nowait`` operation could not complete without blocking.

    Catch this to handle both :class:`Full` and :class:`Empty`.
    """

    def __init__(self, message: str, item: Any = None) -> None:
        super().__init__(message)
        self.item = item


class Full(WouldBlock):
    """``send_nowait`` / ``reserve_nowait`` found the channel at capacity; ``.item`` is handed back."""


class Empty(WouldBlock):
    """``recv_nowait`` found nothing buffered while senders are still open (not the same as closed)."""


class SendTimeout(StreamwatchError, TimeoutError):
    """``send(item, timeout=...)`` or ``reserve(timeout=...)`` gave up; ``.item`` is handed back."""

    def __init__(self, message: str, item: Any = None) -> None:
        super().__init__(message)
        self.item = item


class RecvTimeout(StreamwatchError, TimeoutError):
    """``recv(timeout=...)`` waited the full timeout and no item arrived."""


class ChannelClosed(StreamwatchError, BrokenPipeError):
    """Send on a closed channel; ``.item`` is handed back.

    ``by`` says who closed it: ``"sender"`` (you closed this sender — your bug) or
    ``"receiver"`` (the consumer went away — the other side's decision).
    """

    def __init__(self, message: str, item: Any = None, by: str = "receiver") -> None:
        super().__init__(message)
        self.item = item
        self.by = by


class EndOfChannel(StreamwatchError, EOFError):
    """Receive on a channel that is closed and has no buffered items left. Iteration ends on it."""


class Lagged(StreamwatchError, RuntimeError):
    """A subscriber was too slow: ``missed`` items were overwritten before it read them.

    Like tokio's ``broadcast::error::RecvError::Lagged(n)``: the subscription stays usable and the
    next receive returns the oldest item still buffered.
    """

    def __init__(self, missed: int) -> None:
        super().__init__(
            f"subscriber lagged: {missed} item(s) were overwritten before it read them; "
            "read faster or subscribe with a larger capacity"
        )
        self.missed = missed


class PipelineError(StreamwatchError, RuntimeError):
    """A pipeline raised while the worker fed it; the first original exception is ``__cause__``.

    ``pipeline`` is the failing pipeline's repr and ``errors`` holds every ``(pipeline, exception)``
    pair not yet reported, in the order they happened.
    """

    def __init__(self, errors: list[tuple[str, BaseException]]) -> None:
        lines = [f"  {name}: {type(exc).__name__}: {exc}" for name, exc in errors]
        n = len(errors)
        taps = sum(name == "<tap>" for name, _ in errors)
        if taps == 0:
            head = (
                f"{n} pipeline{'s' if n > 1 else ''} failed on the worker thread and "
                f"{'were' if n > 1 else 'was'} stopped (the others kept running)"
            )
        elif taps == n:
            calls = f"{n} hook call{'s' if n > 1 else ''}"
            head = f"{calls} failed on the training thread (caught; training continued)"
        else:
            head = (
                f"{n} failures while monitoring ({taps} in hooks, caught; {n - taps} in pipelines, stopped)"
            )
        super().__init__(head + ":\n" + "\n".join(lines))
        self.errors = errors
        self.pipeline = errors[0][0] if errors else ""


class NonFiniteError(StreamwatchError, FloatingPointError):
    """A NaN or an Inf appeared in the observed training (``observe(on_nonfinite="raise")``), raised from
    a later ``watch.step()`` (how late: docs/nonfinite.md). Your training produced it, not streamwatch.

    The attributes are those of ``watch.statistics().first_nonfinite`` for the episode that raised:
    ``step``, ``phase``, ``layer``, ``kind``, ``param``, ``index``, ``direction`` (``"forward"``,
    ``"backward"`` or ``"optimizer"``) and ``rank``. When the step had no record (it was not sampled),
    only the sentinel saw it: ``kind`` is ``"loss"`` (or ``"grad_norm"``) and ``layer`` is ``""``.

    Example:
        >>> err = NonFiniteError("boom", step=3, phase="train", layer="fc", kind="activation", param="",
        ...                      index="", direction="forward", rank=0)
        >>> isinstance(err, FloatingPointError), err.layer, err.direction
        (True, 'fc', 'forward')
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        phase: str,
        layer: str,
        kind: str,
        param: str,
        index: str,
        direction: str,
        rank: int,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.phase = phase
        self.layer = layer
        self.kind = kind
        self.param = param
        self.index = index
        self.direction = direction
        self.rank = rank
