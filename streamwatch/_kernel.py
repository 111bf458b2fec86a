"""The fused CPU summary kernel: built once with the system C compiler, loaded with ctypes.

Eager torch needs four to five passes per tensor for the summary (sum, sum of squares, min/max, a sign
mask and its count) plus ~10 µs of dispatch each. ``_fused.c`` does it in one pass — and counts
non-finite elements exactly, for free — writing straight into the step's host table. The library is
loaded with ``ctypes.PyDLL``, which keeps the GIL during the call: releasing it (``CDLL``) let the
worker thread take the GIL at every call, and the training thread then waited for it to come back —
measured, a 1 024-element bias took 69 µs instead of 13 µs inside a training loop.

The shared library is compiled on first use into a cache directory (``$STREAMWATCH_CACHE_DIR``, else
``$XDG_CACHE_HOME/streamwatch``, else ``~/.cache/streamwatch``), named by a hash of the sources and the
compiler command, and reused by every later process. Building takes a few seconds, once. Without a C
compiler (or with ``STREAMWATCH_KERNEL=torch``) streamwatch falls back to the eager torch summary and
says why in :func:`status` and one logged warning; results are the same apart from the non-finite
column, which is then a 0/1 presence flag unless ``stats`` asks for the exact count.

The kernel serves CPU tensors that are contiguous float32/float64; everything else (CUDA, half
precision, strided views, code being traced by ``torch.compile``) takes the torch path.

Example:
    >>> import numpy as np, torch
    >>> from streamwatch import _kernel
    >>> kernel = _kernel.load()  # None without a C compiler
    >>> out = np.zeros(6)
    >>> kernel.summarize(torch.tensor([1.0, -2.0, 0.0, float("inf")]), out)
    >>> out.tolist()  # sum, sumsq, min, max, nonzero, nonfinite
    [inf, inf, -2.0, inf, 3.0, 1.0]
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["NSTATS", "Activity", "FusedKernel", "load", "status"]

_LOG = logging.getLogger("streamwatch")
_SOURCES = ("_fused.c", "_fused_body.h")
_FLAGS = ("-O3", "-funroll-loops", "-std=gnu11", "-shared", "-fPIC", "-fno-math-errno")
_ABI = 4
NSTATS = 6
"""Values the kernel writes per tensor: sum, sumsq, min, max, nonzero, nonfinite."""
_RTOL, _ATOL = 1e-5, 1e-8  # torch.isclose's defaults, as in _summary._inside


class Activity(ctypes.Structure):
    """What "active" means for per-unit activity (``activity_t`` in ``_fused.c``)."""

    _fields_ = (
        ("bounded", ctypes.c_int32),
        ("has_lo", ctypes.c_int32),
        ("has_hi", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("lo", ctypes.c_double),
        ("hi", ctypes.c_double),
        ("tol_lo", ctypes.c_double),
        ("tol_hi", ctypes.c_double),
    )

    @classmethod
    def of(cls, bounds: tuple[float, float] | None) -> Activity:
        """Nonzero-is-active (``bounds=None``) or away-from-the-saturation-bounds (monitorch)."""
        if bounds is None:
            return cls(0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0)
        lo, hi = bounds
        has_lo, has_hi = np.isfinite(lo), np.isfinite(hi)
        return cls(
            1,
            int(has_lo),
            int(has_hi),
            0,
            lo if has_lo else 0.0,
            hi if has_hi else 0.0,
            _ATOL + _RTOL * abs(lo) if has_lo else 0.0,
            _ATOL + _RTOL * abs(hi) if has_hi else 0.0,
        )


_NONZERO = Activity.of(None)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_ARGTYPES = [
    ctypes.c_void_p,  # x
    ctypes.c_int64,  # N
    ctypes.c_int64,  # A
    ctypes.c_int64,  # U
    ctypes.c_int64,  # B
    ctypes.POINTER(Activity),
    ctypes.c_void_p,  # out
    ctypes.c_void_p,  # units_out
    ctypes.c_void_p,  # flags
]


class _Flags(threading.local):
    """Per-thread int32 scratch for the kernel's per-unit flags (hooks run on several threads)."""

    def __init__(self) -> None:
        self.buffer = np.zeros(1024, dtype=np.int32)
        self.address = int(self.buffer.ctypes.data)

    def at_least(self, n: int) -> int:
        if self.buffer.size < n:
            self.buffer = np.zeros(max(n, 2 * self.buffer.size), dtype=np.int32)
            self.address = int(self.buffer.ctypes.data)
        return self.address


class FusedKernel:
    """The loaded library: one call per tensor."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._fns: dict[torch.dtype, Any] = {}
        for dtype, name in (
            (torch.float32, "streamwatch_summarize_f32"),
            (torch.float64, "streamwatch_summarize_f64"),
        ):
            fn = getattr(lib, name)
            fn.argtypes = _ARGTYPES
            fn.restype = ctypes.c_int
            self._fns[dtype] = fn
        self._diffs: dict[torch.dtype, Any] = {}
        for dtype, name in (
            (torch.float32, "streamwatch_summarize_diff_f32"),
            (torch.float64, "streamwatch_summarize_diff_f64"),
        ):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            self._diffs[dtype] = fn
        self._histograms: dict[torch.dtype, Any] = {}
        for dtype, name in (
            (torch.float32, "streamwatch_histogram_f32"),
            (torch.float64, "streamwatch_histogram_f64"),
        ):
            fn = getattr(lib, name)
            fn.argtypes = [
                ctypes.c_void_p,  # x
                ctypes.c_int64,  # n
                ctypes.c_void_p,  # bounds
                ctypes.c_int64,  # nb
                ctypes.c_double,  # lo
                ctypes.c_double,  # per decade
                ctypes.c_int64,  # k
                ctypes.c_void_p,  # counts (nb + 1 float64, added to)
                ctypes.c_void_p,  # zeros (1 float64, added to)
            ]
            fn.restype = ctypes.c_int
            self._histograms[dtype] = fn
        self._flags = _Flags()
        self._layouts: dict[tuple[torch.Size, int], tuple[int, int, int, int]] = {}
        self._activities: dict[tuple[float, float], Activity] = {}

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether ``x`` can take the fused path: a plain CPU tensor, contiguous float32/float64.

        Tensor subclasses (DTensor, FSDP's views, user subclasses with ``__torch_function__``) take
        the torch path: their raw memory is not necessarily what their ops see.
        """
        return x.dtype in self._fns and type(x) in _PLAIN and x.device.type == "cpu" and x.is_contiguous()

    def layout(self, shape: torch.Size, unit_dim: int) -> tuple[int, int, int, int]:
        """``shape`` as ``(N, A, U, B)`` around ``unit_dim`` (cached: shapes repeat every step)."""
        key = (shape, unit_dim)
        found = self._layouts.get(key)
        if found is None:
            a = b = 1
            for d in shape[1:unit_dim]:
                a *= d
            for d in shape[unit_dim + 1 :]:
                b *= d
            found = self._layouts[key] = (shape[0], a, shape[unit_dim], b)
        return found

    def run(
        self,
        x: torch.Tensor,
        out: int,
        layout: tuple[int, int, int, int] | None = None,
        units: int = 0,
        bounds: tuple[float, float] | None = None,
    ) -> None:
        """The raw call, for the hot path: ``out`` and ``units`` are addresses (see :meth:`summarize`)."""
        fn = self._fns[x.dtype]
        if layout is None:
            fn(x.data_ptr(), x.numel(), 1, 1, 1, _NONZERO, out, None, None)
            return
        activity = _NONZERO if bounds is None else self._activity(bounds)
        n, a, u, b = layout
        fn(x.data_ptr(), n, a, u, b, activity, out, units, self._flags.at_least(2 * u))

    def run_diff(self, a: torch.Tensor, b: torch.Tensor, out: int) -> None:
        """The statistics of ``a - b`` into the row at address ``out``, without materialising the
        difference. Both must pass :meth:`accepts`, with the same dtype and number of elements."""
        if a.dtype != b.dtype or a.numel() != b.numel():
            raise ValueError(
                f"run_diff needs two tensors of one dtype and size, got {a.dtype}[{a.numel()}] and "
                f"{b.dtype}[{b.numel()}]"
            )
        self._diffs[a.dtype](a.data_ptr(), b.data_ptr(), a.numel(), out)

    def histogram(
        self,
        x: torch.Tensor,
        bounds: torch.Tensor,
        lo: int,
        per_decade: int,
        counts: torch.Tensor,
        zeros: torch.Tensor,
    ) -> bool:
        """Add ``x``'s log-spaced histogram counts (``torch.bucketize(x, bounds)``, non-finite elements in
        bucket 0) into ``counts`` (``len(bounds) + 1`` float64) and its exact zeros into ``zeros``; False
        (nothing added) if the layout is not the one the kernel knows. ``x`` must pass :meth:`accepts`,
        ``bounds`` be contiguous in ``x``'s dtype (see ``metrics/_histogram.py``)."""
        nb = bounds.numel()
        k = (nb - 4) // 2
        rc = self._histograms[x.dtype](
            x.data_ptr(),
            x.numel(),
            bounds.data_ptr(),
            nb,
            lo,
            per_decade,
            k,
            counts.data_ptr(),
            zeros.data_ptr(),
        )
        return bool(rc == 0)

    def _activity(self, bounds: tuple[float, float]) -> Activity:
        found = self._activities.get(bounds)
        if found is None:
            found = self._activities[bounds] = Activity.of(bounds)
        return found

    def summarize(
        self,
        x: torch.Tensor,
        out: np.ndarray,
        *,
        unit_dim: int | None = None,
        units: np.ndarray | None = None,
        bounds: tuple[float, float] | None = None,
    ) -> None:
        """Write ``x``'s :data:`NSTATS` values into ``out`` (a float64 row); with ``unit_dim``, ADD the
        number of samples in which each unit was active into ``units`` (float64, one per unit).

        ``x`` must pass :meth:`accepts` and be non-empty; ``out`` and ``units`` must be C-contiguous
        float64 arrays of the right length (they are written through their addresses).
        """
        if unit_dim is None or units is None:
            self.run(x, out.ctypes.data)
        else:
            self.run(x, out.ctypes.data, self.layout(x.shape, unit_dim), units.ctypes.data, bounds)


_lock = threading.Lock()
_loaded: FusedKernel | None = None
_failure: str | None = None  # why the build failed, once it did (never retried in this process)


def _forced_off() -> bool:
    return os.environ.get("STREAMWATCH_KERNEL", "").lower() == "torch"


def status() -> str:
    """How CPU tensors are summarised now: ``"fused: <library>"`` or ``"torch: <why>"``.

    Example:
        >>> from streamwatch import _kernel
        >>> _kernel.status().split(":")[0] in ("fused", "torch", "not loaded yet")
        True
    """
    if _forced_off():
        return "torch: STREAMWATCH_KERNEL=torch"
    if _loaded is not None:
        return f"fused: {_loaded.path}"
    if _failure is not None:
        return f"torch: the fused CPU kernel is unavailable ({_failure})"
    return "not loaded yet"


def _cache_dir() -> Path:
    configured = os.environ.get("STREAMWATCH_CACHE_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "streamwatch"


def _compiler() -> str | None:
    candidates = [
        os.environ.get("CC"),
        (sysconfig.get_config_var("CC") or "").split(" ")[0],
        "cc",
        "gcc",
        "clang",
    ]
    for candidate in candidates:
        if candidate and shutil.which(candidate):
            return candidate
    return None


def _build(compiler: str) -> Path:
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in _SOURCES:
        digest.update((here / name).read_bytes())
    digest.update(" ".join((compiler, *_FLAGS, platform.machine(), platform.system())).encode())
    directory = _cache_dir()
    target = directory / f"fused-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename into place: atomic, so ranks building at once never see a
    # half-written library.
    fd, tmp = tempfile.mkstemp(prefix="fused-", suffix=".so.tmp", dir=directory)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *_FLAGS, "-o", tmp, str(here / "_fused.c")],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load() -> FusedKernel | None:
    """The fused kernel, building it on first use; None (and :func:`status` says why) if unavailable.

    Never raises: a failed build is logged once and streamwatch uses the torch path.
    """
    global _loaded, _failure
    if _forced_off():
        return None
    with _lock:
        if _loaded is not None or _failure is not None:
            return _loaded
        try:
            compiler = _compiler()
            if compiler is None:
                raise OSError("no C compiler found: set CC, or install gcc or clang")
            path = _build(compiler)
            lib = ctypes.PyDLL(str(path))  # keeps the GIL: see the module docstring
            if lib.streamwatch_abi_version() != _ABI:
                raise OSError(f"{path} has another ABI version; delete it to rebuild")
            _loaded = FusedKernel(lib, path)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = (getattr(exc, "stderr", "") or "").strip()
            _failure = f"{exc}: {detail}" if detail else str(exc)
            _LOG.warning("streamwatch: %s; summaries use eager torch (slower on CPU)", status())
        return _loaded
