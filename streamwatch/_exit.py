"""What streamwatch does at interpreter exit: first what flushes (the Watches left open, ``_attach``), then
what cleans up (Triton's temporary cache folder, which a last summary may still need).

One ``atexit`` handler for the package, so the order does not depend on which module was imported first
(``atexit`` runs handlers newest first). Python runs no exit handler when a signal such as SIGTERM kills
the process (docs/observe.md#close says how to flush then), nor after ``os._exit``.

Example:
    >>> from streamwatch import _exit
    >>> _exit.at_exit(lambda: None, cleanup=True)
"""

from __future__ import annotations

import atexit
from collections.abc import Callable

__all__ = ["at_exit"]

_flush: list[Callable[[], object]] = []
_cleanup: list[Callable[[], object]] = []


def at_exit(hook: Callable[[], object], *, cleanup: bool = False) -> None:
    """Call ``hook`` at interpreter exit: with ``cleanup``, after every hook without it. A hook handles
    its own errors (one that raises is skipped: exit goes on)."""
    (_cleanup if cleanup else _flush).append(hook)


def _run() -> None:
    for hook in (*_flush, *_cleanup):
        try:
            hook()
        except Exception:  # (at exit nothing can be done about it; a flush hook warns for itself)
            pass


atexit.register(_run)
