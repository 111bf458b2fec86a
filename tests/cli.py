"""The command line as a user runs it, in a child process: ``python -m streamwatch ...`` from this
checkout. Every child is remembered, and :func:`reap` (an autouse fixture of the command-line tests
calls it after each test) kills what is still running: a test that fails or times out part way never
leaves a demo training or serving behind it, competing with the tests that follow."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_children: list[subprocess.Popen[str]] = []


def env() -> dict[str, str]:
    """The child's environment: this checkout first on the path, one OpenMP thread."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def streamwatch(*args: str, cwd: Path) -> subprocess.Popen[str]:
    """``python -m streamwatch *args`` in ``cwd``, its output piped (text), remembered for :func:`reap`.

    SIGINT is reset to its default in the child, so Ctrl-C reaches the demo even when the suite runs as
    a background job (which a shell starts with SIGINT ignored, and a child would inherit: Python then
    installs no handler)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamwatch", *args],
        cwd=cwd,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )
    _children.append(proc)
    return proc


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def reap() -> list[list[str]]:
    """Kill every child still running and wait for it; the command lines of those it killed."""
    killed = []
    while _children:
        proc = _children.pop()
        if proc.poll() is None:
            proc.kill()
            killed.append([str(a) for a in proc.args])  # type: ignore[union-attr]
        proc.communicate()  # (closes the pipes)
    return killed
