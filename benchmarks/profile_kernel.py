"""What one fused-kernel call costs per tensor, against another build of the kernel in the same process.

A new statistic adds accumulators to the kernel's one pass (``_schema.py``); this says what that costs on
this machine. Both libraries are called through ctypes with the signatures of ``_schema.ENTRY_POINTS``
(unchanged since before the schema), on the same warm tensors, in interleaved rounds (the order reversed
every other round), so the ratio holds while the machine's speed moves; the absolute times and GB/s do
not. Warm tensors: the kernel reads them from cache where they fit (a 1024×1024 float32 does not), where
the training step reads them right after torch wrote them; the byte floor is what it reads.

Run (after ``make env``; under ``flock /tmp/bench.lock`` on a shared machine)::

    .venv/bin/python benchmarks/profile_kernel.py                        # this package's kernel alone
    .venv/bin/python benchmarks/profile_kernel.py --against old/_fused.cpython-311-x86_64-linux-gnu.so

``--against`` takes a library built from another checkout (``python setup.py build_ext --inplace`` there):
the table shows each call's median time for both and the ratio this / other. Not a test and not part of
``make bench``: it prints a table.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from streamwatch import _kernel

CASES = (
    # label, shape, dtype, how: plain (no units), diff (an update: a - b), units (per-unit activity)
    ("1024x1024 f32", (1024, 1024), torch.float32, "plain"),
    ("1024x1024 f32 diff", (1024, 1024), torch.float32, "diff"),
    ("128x1024 f32", (128, 1024), torch.float32, "plain"),
    ("128x1024 f32 units", (128, 1024), torch.float32, "units"),
    ("64x32x32x32 f32 units", (64, 32, 32, 32), torch.float32, "units"),
    ("1024 f32", (1024,), torch.float32, "plain"),
    ("1024x1024 f64", (1024, 1024), torch.float64, "plain"),
)


def _call(kernel: _kernel.FusedKernel, x: torch.Tensor, y: torch.Tensor, how: str) -> Callable[[], None]:
    """One call of ``kernel`` on ``x`` as ``how`` says, through the kernel's own Python entry points."""
    out = np.zeros(64)  # room for any build's values per tensor
    units = np.zeros(x.shape[1] if x.dim() > 1 else 1)
    layout = kernel.layout(x.shape, 1) if x.dim() > 1 else None

    def call() -> None:  # (holds out and units: the kernel writes through their addresses)
        if how == "diff":
            kernel.run_diff(x, y, out.ctypes.data)
        elif how == "units":
            kernel.run(x, out.ctypes.data, layout, units.ctypes.data)
        else:
            kernel.run(x, out.ctypes.data)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, help="another build of the kernel library")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    here = _kernel.library_path()
    if here is None:
        raise SystemExit(f"no kernel library in the package: {_kernel.status()}")
    libraries = {"this": _kernel.FusedKernel(ctypes.PyDLL(str(here)), here)}
    if args.against is not None:
        libraries["other"] = _kernel.FusedKernel(ctypes.PyDLL(str(args.against)), args.against)
    g = torch.Generator().manual_seed(0)
    print(f"this: {here}" + (f"\nother: {args.against}" if args.against else ""))
    for label, shape, dtype, how in CASES:
        x, y = torch.randn(shape, generator=g, dtype=dtype), torch.randn(shape, generator=g, dtype=dtype)
        calls = {name: _call(kernel, x, y, how) for name, kernel in libraries.items()}
        times: dict[str, list[float]] = {name: [] for name in calls}
        repeat = max(3, int(3e6 // x.numel()))
        for r in range(args.rounds):
            for name, call in list(calls.items())[:: 1 if r % 2 == 0 else -1]:
                start = time.perf_counter()
                for _ in range(repeat):
                    call()
                times[name].append((time.perf_counter() - start) / repeat)
        read = x.numel() * x.element_size() * (2 if how == "diff" else 1)
        cells = []
        for name, seconds in times.items():
            median = statistics.median(seconds)
            cells.append(f"{name} {median * 1e6:8.1f} µs {read / median / 1e9:5.1f} GB/s")
        if "other" in times:
            cells.append(
                f"this/other {statistics.median(times['this']) / statistics.median(times['other']):.2f}"
            )
        print(f"{label:24} " + "   ".join(cells))


if __name__ == "__main__":
    main()
