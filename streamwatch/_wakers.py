"""Waking waiters across threads and event loops: the channel's bridge between its sync and async faces.

A blocked async sender or receiver waits on an event of its own loop (asyncio or trio); the other side,
on any thread, wakes it through that loop's thread-safe call. Nothing here imports trio unless a trio
task is running (it is detected through ``sys.modules``).

Example:
    >>> import asyncio
    >>> async def main() -> bool:
    ...     wake, wait = async_waker()
    ...     wake()
    ...     await wait()
    ...     return True
    >>> asyncio.run(main())
    True
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["Waker", "async_waker", "wake_all"]

Waker = Callable[[], None]
"""Wakes one waiter; safe to call from any thread, and more than once."""


def wake_all(wakers: list[Waker]) -> None:
    for wake in wakers:
        wake()
    wakers.clear()


def _trio_token() -> Any:
    """The running trio loop's token, or None outside trio.

    Read without importing trio (and without sniffio, which anyio no longer depends on): code can only
    be running under trio if trio is already imported.
    """
    trio = sys.modules.get("trio")
    if trio is None:
        return None
    try:
        return trio.lowlevel.current_trio_token()
    except RuntimeError:  # trio is imported, but this is not a trio task
        return None


def async_waker() -> tuple[Waker, Callable[[], Any]]:
    """A ``(wake, wait)`` pair for the running event loop; ``wake`` may be called from any thread."""
    token = _trio_token()
    if token is not None:
        import trio

        trio_event = trio.Event()

        def wake_trio() -> None:
            try:
                token.run_sync_soon(trio_event.set)
            except trio.RunFinishedError:  # the loop is gone; nobody is waiting any more
                pass

        return wake_trio, trio_event.wait

    loop = asyncio.get_running_loop()
    asyncio_event = asyncio.Event()

    def wake_asyncio() -> None:
        try:
            loop.call_soon_threadsafe(asyncio_event.set)
        except RuntimeError:  # the loop is closed
            pass

    return wake_asyncio, asyncio_event.wait
