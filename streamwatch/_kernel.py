"""The fused CPU summary kernel: built with the package, loaded with ctypes from the package directory.

Eager torch needs four calls per tensor for the summary (``_torchpath.summarize``: ``pow``, ``sign``, one
``mm`` for every sum, ``aminmax``), each with ~10 µs of dispatch on a CPU and a pass over the tensor.
``_fused.c`` does it in one pass — and counts
non-finite elements exactly, for free — writing straight into the step's host table. The library is
loaded with ``ctypes.PyDLL``, which keeps the GIL during the call: releasing it (``CDLL``) let the
worker thread take the GIL at every call, and the training thread then waited for it to come back —
measured, a 1 024-element bias took 69 µs instead of 13 µs inside a training loop.

The library is compiled when the package is built (``setup.py``: a wheel carries it, ``pip install .``
and ``pip install -e .`` compile it) and installed next to this file as ``_fused<EXT_SUFFIX>``. At run
time nothing is compiled and nothing is loaded from anywhere but this package's own directory. If the
library is missing (installed without a C compiler) or fails to load, streamwatch falls back to the
eager torch summary with one ``RuntimeWarning`` that says how to get the fused kernel, and
:func:`status` says why; ``STREAMWATCH_KERNEL=torch`` forces the torch path without a warning. Results
are the same apart from the non-finite column, which is then a 0/1 presence flag unless ``stats`` asks
for the exact count.

The kernel serves CPU tensors that are float32/float64 (strided views through one contiguous copy,
:meth:`FusedKernel.readable`); everything else (CUDA, half precision, tensor subclasses, code being
traced by ``torch.compile``) takes the torch path.

Example:
    >>> import numpy as np, torch
    >>> from streamwatch import _kernel
    >>> kernel = _kernel.load()  # None when the library is not installed
    >>> from streamwatch._schema import DEVICE_NAMES
    >>> out = np.zeros(NSTATS)
    >>> kernel.summarize(torch.tensor([1.0, -2.0, 0.0, float("inf")]), out)
    >>> values = dict(zip(DEVICE_NAMES, out.tolist()))
    >>> values["sum"], values["min"], values["nonzero"], values["nonfinite"]
    (inf, -2.0, 3.0, 1.0)
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from streamwatch import _schema

__all__ = ["NSTATS", "Activity", "FusedKernel", "load", "status"]

_LAYOUT_CACHE = 512
"""Tensor layouts remembered per kernel: shapes repeat every step, but a model fed a new shape every
step (variable sequence lengths) must not grow the cache without bound."""
_FAST_PATH_HINT = (
    "reinstall streamwatch where a C compiler is available (pip install --force-reinstall "
    "--no-binary streamwatch streamwatch, or pip install . from a checkout), or install a wheel "
    "built for this platform"
)
NSTATS = len(_schema.DEVICE)
"""Values the kernel writes per tensor (``_schema.DEVICE``: sum, sumsq, min, max, nonzero, ..., nonfinite)."""
_RTOL, _ATOL = 1e-5, 1e-8  # torch.isclose's defaults, as in _summary._inside


_CTYPES: dict[str, Any] = {"int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "double": ctypes.c_double}


class Activity(ctypes.Structure):
    """What "active" means for per-unit activity (``activity_t``, declared in ``_schema.ACTIVITY``)."""

    _fields_ = tuple((name, _CTYPES[ctype]) for name, ctype in _schema.ACTIVITY)

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


def _argtypes(entry: str) -> list[Any]:
    """The ctypes argument types of the kernel's entry point ``entry`` (``_schema.ENTRY_POINTS``):
    pointers are addresses (ints), ``activity_t`` is passed as an :class:`Activity`."""
    params = dict(_schema.ENTRY_POINTS)[entry]
    types: dict[str, Any] = {**_CTYPES, "const activity_t *": ctypes.POINTER(Activity)}
    return [types.get(ctype, ctypes.c_void_p) for _, ctype in params]


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


def _entry(lib: ctypes.CDLL, entry: str) -> dict[torch.dtype, Any]:
    """The library's two variants of ``entry`` (``_f32``, ``_f64``) by dtype, with their ctypes signature."""
    argtypes = _argtypes(entry)
    found: dict[torch.dtype, Any] = {}
    for dtype, suffix in ((torch.float32, "f32"), (torch.float64, "f64")):
        fn = getattr(lib, f"{entry}_{suffix}")
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
        found[dtype] = fn
    return found


class FusedKernel:
    """The loaded library: one call per tensor."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._fns: dict[torch.dtype, Any] = {}
        self._fns = _entry(lib, "streamwatch_summarize")
        self._diffs = _entry(lib, "streamwatch_summarize_diff")
        self._histograms = _entry(lib, "streamwatch_histogram")
        self._flags = _Flags()
        self._layouts: dict[tuple[torch.Size, int], tuple[int, int, int, int]] = {}
        self._activities: dict[tuple[float, float], Activity] = {}

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether ``x`` can take the fused path: a plain CPU tensor, contiguous float32/float64.

        Tensor subclasses (DTensor, FSDP's views, user subclasses with ``__torch_function__``) take
        the torch path: their raw memory is not necessarily what their ops see.
        """
        return x.dtype in self._fns and type(x) in _PLAIN and x.device.type == "cpu" and x.is_contiguous()

    def readable(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x`` as the fused path reads it: ``x`` itself if :meth:`accepts` it, a contiguous copy of a
        strided view of a plain CPU float32/float64 tensor (a transpose, a slice), or None (the torch
        path). One copy costs far less than the torch path's reductions over the view: 29 µs against
        330 µs for a transposed ``[16, 64, 256]`` activation (a ``batch_first`` attention block's).

        Example:
            >>> kernel = load()
            >>> x = torch.arange(6.0).reshape(2, 3).t()
            >>> kernel is None or (kernel.readable(x).is_contiguous() and kernel.readable(x).equal(x))
            True
        """
        if x.dtype not in self._fns or type(x) not in _PLAIN or x.device.type != "cpu":
            return None
        return x if x.is_contiguous() else x.contiguous()

    def layout(self, shape: torch.Size, unit_dim: int) -> tuple[int, int, int, int]:
        """``shape`` as ``(N, A, U, B)`` around ``unit_dim`` (cached: shapes repeat every step)."""
        key = (shape, unit_dim)
        found = self._layouts.get(key)
        if found is None:
            if len(self._layouts) >= _LAYOUT_CACHE:
                self._layouts.clear()  # cheap to rebuild; keeps memory flat under ever-new shapes
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
_failure: str | None = None  # why the library could not be used, once that is known (never retried)


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


def library_path(directory: Path | None = None) -> Path | None:
    """The installed kernel library in ``directory`` (default: this package's), or None if there is none.

    Only names this interpreter would import an extension module by are considered
    (``importlib.machinery.EXTENSION_SUFFIXES``), so a library built for another Python is never picked.
    """
    here = Path(__file__).parent if directory is None else directory
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"_fused{suffix}"
        if candidate.is_file():
            return candidate
    return None


def _open(path: Path) -> FusedKernel:
    """Load the library at ``path`` and check that it was built from this schema: the one place that
    check lives (``_schema.SIGNATURE``, which covers the values, the columns and the entry points)."""
    lib = ctypes.PyDLL(str(path))  # keeps the GIL: see the module docstring
    try:
        schema = lib.streamwatch_schema
    except AttributeError:
        raise OSError(f"{path} was built by an older streamwatch (it has no schema): rebuild it") from None
    schema.restype = ctypes.c_char_p
    found = schema().decode()
    if found != _schema.SIGNATURE:
        raise OSError(f"{path} was built from another column schema: {_difference(found)}; rebuild it")
    return FusedKernel(lib, path)


def _difference(found: str) -> str:
    """Where a library's schema signature first differs from this streamwatch's, in a few words."""
    ours = _schema.SIGNATURE
    at = next((i for i, (a, b) in enumerate(zip(found, ours, strict=False)) if a != b), len(found))
    start = max(0, at - 20)
    return f"it has {found[start : at + 40]!r} where this streamwatch has {ours[start : at + 40]!r}"


def load(directory: Path | None = None) -> FusedKernel | None:
    """The fused kernel from this package's directory; None (and :func:`status` says why) if unavailable.

    Never raises and never compiles anything: a missing or unloadable library is warned about once per
    process (``RuntimeWarning``) and streamwatch uses the torch path. ``directory`` is for tests.
    """
    global _loaded, _failure
    if _forced_off():
        return None
    with _lock:
        if _loaded is not None or _failure is not None:
            return _loaded
        path = library_path(directory)
        try:
            if path is None:
                raise OSError(
                    f"no _fused library in {directory or Path(__file__).parent}: streamwatch was installed "
                    "without a C compiler"
                )
            _loaded = _open(path)
        except (OSError, AttributeError) as exc:  # AttributeError: a library without our symbols
            _failure = str(exc)
    if _failure is not None:
        warnings.warn(
            f"streamwatch: {status()}; CPU summaries use eager torch (slower). For the fused kernel, "
            f"{_FAST_PATH_HINT}. Set STREAMWATCH_KERNEL=torch to choose the torch path without this warning.",
            RuntimeWarning,
            stacklevel=2,
        )
    return _loaded


def scalar_reader() -> Callable[[int], float] | None:
    """The compiled module's one-call read of the float32 at an address: a sampled step's CPU loss
    without ``Tensor.item()``'s dispatch through torch, which costs microseconds on a step that evicted
    the interpreter's caches (and the boundary read the loss twice: for the record and the sentinel).
    None (callers use torch) when the module is missing, predates it, or ``STREAMWATCH_KERNEL=torch``.
    Never raises, never warns.

    Example:
        >>> import torch
        >>> from streamwatch import _kernel
        >>> read = _kernel.scalar_reader()
        >>> loss = torch.tensor(0.1)
        >>> read(loss.data_ptr()) if read else loss.item()
        0.10000000149011612
    """
    return None if _forced_off() else _module_function("scalar_f32")


def correct_counters() -> dict[torch.dtype, Callable[[int, int, int, int], float]]:
    """The compiled module's count of correct class predictions, by the scores' dtype:
    ``f(scores address, int64 targets address, rows, classes)`` for contiguous CPU ``[N, C]`` scores and
    ``[N]`` targets, what ``(scores.argmax(-1) == targets).sum()`` gives (train accuracy on a sampled
    step, ``_observe.py``: one C call instead of three torch dispatches). Empty when the module is
    missing, predates them, or ``STREAMWATCH_KERNEL=torch``. Never raises, never warns.

    Example:
        >>> import torch
        >>> from streamwatch import _kernel
        >>> count = _kernel.correct_counters().get(torch.float32)
        >>> scores, targets = torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1])
        >>> count(scores.data_ptr(), targets.data_ptr(), 2, 2) if count else 1.0
        1.0
    """
    return _by_dtype("correct_f32", "correct_f64")


def ewm_fold() -> Any:
    """The compiled module's fold of a smoothed detector's baseline (``_detectors._Smoothed.fold``: the
    same bits as its Python reference, one C call per record); None when the module is missing or
    predates it. ``STREAMWATCH_KERNEL`` chooses how tensors are summarised and leaves this alone. Never
    raises, never warns.

    Example:
        >>> fold = ewm_fold()
        >>> fold is None or callable(fold)
        True
    """
    return _module_function("ewm_fold")


def _by_dtype(f32: str, f64: str) -> dict[torch.dtype, Any]:
    """The compiled module's functions ``f32`` and ``f64`` by the dtype they read; empty when the module
    is missing, predates them, or ``STREAMWATCH_KERNEL=torch``."""
    if _forced_off():
        return {}
    by_dtype = {torch.float32: _module_function(f32), torch.float64: _module_function(f64)}
    return {} if None in by_dtype.values() else by_dtype


def _module_function(name: str) -> Any:
    """The compiled module's function ``name``; None when the module is missing, predates it or was built
    from another column schema."""
    try:
        from streamwatch import _fused  # (the compiled module)

        if getattr(_fused, "SCHEMA", None) != _schema.SIGNATURE:
            return None
        return getattr(_fused, name)
    except (ImportError, AttributeError):
        return None


def assembler() -> Callable[..., int] | None:
    """The compiled module's ``assemble``: a step's summary table in one C call
    (``_record.PendingRecord.resolve``; ``_summary.finalize`` is its reference and the fallback). None
    when the module is missing or predates it. Never raises, never warns.

    Example:
        >>> import numpy as np
        >>> from streamwatch import _kernel
        >>> from streamwatch._schema import COLUMN, COLUMN_NAMES, DEVICE_INDEX
        >>> assemble = _kernel.assembler()
        >>> table = np.empty((1, len(COLUMN_NAMES)))
        >>> host = np.zeros((1, _kernel.NSTATS))  # x = [2.0, 0.0]
        >>> for name, value in {"sum": 2.0, "sumsq": 4.0, "max": 2.0, "nonzero": 1.0}.items():
        ...     host[0, DEVICE_INDEX[name]] = value
        >>> if assemble is not None:
        ...     _ = assemble(table, host, [2], [0], [0], [], np.zeros(1), False, np.zeros(0), [], [], 0)
        ...     print([float(table[0, COLUMN[c]]) for c in ("count", "sumsq", "min", "zeros", "nonfinite")])
        ... else:
        ...     print([2.0, 4.0, 0.0, 1.0, 0.0])
        [2.0, 4.0, 0.0, 1.0, 0.0]
    """
    return _module_function("assemble")  # type: ignore[no-any-return]


def _reset() -> None:
    """Forget what :func:`load` found (tests only)."""
    global _loaded, _failure
    with _lock:
        _loaded, _failure = None, None
