"""Fake CUDA tensors without a GPU: ``FakeTensorMode`` tensors on ``device="cuda"`` (tests of the torch path).

``torch._subclasses.fake_tensor.FakeTensorMode`` makes tensors that carry a shape, a dtype and a device but
no data, and runs every op on them by its meta kernel: ``torch.empty(3, device="cuda")`` inside it is a
CUDA tensor on any machine, and an op on it dispatches exactly as on a GPU (the torch path takes its CUDA
branch, not the CPU one). Reading a value (``.item()``, ``float(t)``) raises: a host sync shows.

What torch 2.13's CPU build lacks for it (checked here, 2026-11-28):

- **A CUDA device guard.** Indexing (``x[0]``, ``x[:, :n]``, ``x[0] = 1.0``), ``copy_`` and ``.to("cuda")``
  take a device guard in torch's Python bindings before they dispatch, and a CPU-only build registers
  none for CUDA: "PyTorch is not linked with support for cuda devices". torch has no Python API to
  register one (upstream's fallback to a no-op guard, pytorch/pytorch#160532 and #163016, is not in this
  release's ``c10/core/impl/DeviceGuardImplInterface.h``), so :func:`enable` compiles and loads a ten-line
  C++ library that registers torch's own ``NoOpDeviceGuardImpl`` for CUDA, reporting device 0. It stays
  for the process (a registration cannot be undone); it changes nothing else: a real CUDA op still fails,
  ``torch.cuda.is_available()`` stays False.
- **Backward.** Autograd's engine asks the accelerator for the current stream when it accumulates a
  gradient (``InputBuffer::add``: "Cannot access accelerator device when none is available"): no
  ``backward()``, so no output-gradient taps; gradients can be assigned by hand.
- **Streams, events, pinned copies.** ``torch.cuda.Stream``, ``Event`` and ``current_stream`` need the
  CUDA runtime ("Torch not compiled with CUDA enabled"): a record's side-stream copy cannot run, and a
  fake tensor has no data for the worker to read.
- **``torch.autocast("cuda")``** disables itself with a warning when CUDA is not available:
  :func:`cuda_autocast` sets the autocast state directly.
- **``module.to("cuda")``** fails under the mode (``swap_tensors`` of a parameter with weak references):
  build the module with ``device="cuda"``.

On a machine with a GPU none of this is needed: :func:`enable` loads nothing. A CUDA build of torch
without a GPU cannot make fake CUDA tensors (its CUDA guard initialises CUDA): :func:`enable` says so.

Example (in a test)::

    reason = fakecuda.enable(tmp_path)
    if reason:
        pytest.skip(reason)
    with FakeTensorMode(), fakecuda.cuda_autocast(torch.bfloat16):
        x = torch.randn(8, 4, device="cuda")
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

_GUARD = """\
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {
// torch's no-op guard (the one CPU and meta tensors take), reporting device 0 as the current device
struct FakeCudaGuard final : c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA> {
  c10::Device exchangeDevice(c10::Device) const override { return {c10::DeviceType::CUDA, 0}; }
  c10::Device getDevice() const override { return {c10::DeviceType::CUDA, 0}; }
};
}  // namespace

C10_REGISTER_GUARD_IMPL(CUDA, FakeCudaGuard);
"""

_loaded: list[ctypes.CDLL] = []  # (kept: the library must stay loaded while the guard is registered)


def enable(build_dir: Path) -> str | None:
    """Make fake CUDA tensors work in this process; returns None, or why they cannot (a skip reason).

    Compiles the guard library into ``build_dir`` (about a second, once per process) with ``$CXX`` or
    ``c++``, against the headers torch ships.
    """
    if torch.cuda.is_available() or _loaded:
        return None
    if torch.backends.cuda.is_built():
        return "a CUDA build of torch without a GPU: its CUDA device guard initialises CUDA"
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        return "no C++ compiler ($CXX or c++) for the fake CUDA device guard"
    root = Path(torch.__file__).parent
    source, library = build_dir / "fake_cuda_guard.cpp", build_dir / "fake_cuda_guard.so"
    source.write_text(_GUARD)
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    command = [compiler, "-std=c++17", "-shared", "-fPIC", abi, f"-I{root / 'include'}", str(source)]
    command += [f"-L{root / 'lib'}", "-lc10", f"-Wl,-rpath,{root / 'lib'}", "-o", str(library)]
    built = subprocess.run(command, capture_output=True, text=True, check=False)
    if built.returncode != 0:
        return f"the fake CUDA device guard did not compile: {built.stderr.strip()[-500:]}"
    _loaded.append(ctypes.CDLL(str(library)))  # (its static registrar runs on load)
    return None


@contextmanager
def cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    """CUDA autocast to ``dtype`` in this block, also where ``torch.autocast("cuda")`` would switch itself
    off for want of a GPU: the state its ``__enter__`` and ``__exit__`` set, set directly."""
    enabled, was = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()  # (the weights' casts, as the outermost autocast's exit does)
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", was)
