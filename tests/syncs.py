"""``no_host_sync()``: a block in which any CUDA host sync raises (tests of the CUDA path)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Everything queued so far is finished first; inside the block, a synchronizing CUDA call raises
    ``RuntimeError`` (torch's sync debug mode, which warns that it is a prototype: not an error here).

    Example (on a GPU machine)::

        with no_host_sync():
            train_step()  # raises if anything in it waits for the device
    """
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Synchronization debug mode is a prototype", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
