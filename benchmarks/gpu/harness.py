"""What every section of the GPU script shares: time budgets, child processes, freeing the device."""

from __future__ import annotations

import gc
import importlib.util
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

SKIPPED = "skipped: time budget"


class Recorder(Protocol):
    """Where a section reports as it goes: ``save()`` rewrites the result files, ``log()`` a progress line."""

    def save(self) -> None: ...

    def log(self, line: str) -> None: ...


@dataclass(frozen=True)
class Budget:
    """A deadline on ``time.monotonic()``."""

    deadline: float

    @classmethod
    def of(cls, seconds: float) -> Budget:
        return cls(time.monotonic() + seconds)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def over(self) -> bool:
        return self.left() <= 0

    def share(self, parts: int) -> Budget:
        """An equal share of what is left, for the first of ``parts`` pieces of work still to do."""
        return Budget(time.monotonic() + max(self.left(), 0.0) / max(parts, 1))


@dataclass(frozen=True)
class ChildRun:
    returncode: int | None  # None: killed at its time limit
    output: str
    seconds: float


def run_child(cmd: Sequence[str], timeout: float, cwd: Path, env: dict[str, str] | None = None) -> ChildRun:
    """Run ``cmd`` (stdout and stderr together) in its own process group, killed whole at ``timeout``
    seconds (pytest and inductor start workers of their own)."""
    start = time.monotonic()
    with subprocess.Popen(
        list(cmd),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    ) as child:
        try:
            output, _ = child.communicate(timeout=max(timeout, 1.0))
            code: int | None = child.returncode
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            output, _ = child.communicate()
            code = None
    return ChildRun(code, output or "", time.monotonic() - start)


def tail(text: str, chars: int = 3000) -> str:
    return text if len(text) <= chars else "…" + text[-chars:]


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load_kernels_file(path: Path) -> Any:
    """Another copy of ``streamwatch/_triton_kernels.py`` (``git show REV:...``) as a module of its own
    (``tiles.py --old``, ``instructions.py --old``)."""
    spec = importlib.util.spec_from_file_location("_other_triton_kernels", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
