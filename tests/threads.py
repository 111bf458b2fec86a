"""Thread helpers shared by the tests: run a function on a thread, join with a bound, never hang."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import anyio.to_thread

JOIN_S = 10.0  # bound on every join: a hang fails the test instead of the 120 s session timeout


def wait_until(predicate: Callable[[], object], what: str) -> None:
    """Spin, yielding the GIL, until ``predicate()`` holds; fail after JOIN_S instead of hanging."""
    deadline = time.monotonic() + JOIN_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0)


class Spawned(threading.Thread):
    """Runs ``fn(*args)`` on its own daemon thread, keeping its result or exception."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        super().__init__(daemon=True)
        self.fn, self.args = fn, args
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as exc:
            self.error = exc

    def finish(self, timeout: float = JOIN_S) -> Any:
        """Join (bounded); return the result or re-raise the thread's exception."""
        self.join(timeout)
        return self._outcome(timeout)

    async def finish_async(self) -> Any:
        """Join without blocking the event loop (the thread may still need it to make progress)."""
        await anyio.to_thread.run_sync(self.join, JOIN_S)
        return self._outcome(JOIN_S)

    def _outcome(self, timeout: float) -> Any:
        assert not self.is_alive(), f"{self.fn!r} still running after {timeout} s"
        if self.error is not None:
            raise self.error
        return self.result


def spawn(fn: Callable[..., Any], *args: Any) -> Spawned:
    """Start ``fn(*args)`` on a thread now."""
    spawned = Spawned(fn, *args)
    spawned.start()
    return spawned
