"""Values streamwatch keeps past the pass that made them, under CUDA graphs that reuse their memory.

``torch.compile(mode="reduce-overhead")`` replays CUDA graphs whose outputs live in one memory pool. When
a new pass starts (the next step's forward, the next micro-batch of a step with gradient accumulation,
an evaluation pass), cudagraph trees hand the last pass's memory to it and mark the storage of every
output still alive: reading one raises ("accessing tensor output of CUDAGraphs that has been overwritten
by a subsequent run"). streamwatch keeps such outputs past their pass in three places:

- the step buffer's rows from compiled code (its partial sums are outputs of the graph), read at the
  step's end: a row of an earlier micro-batch is dropped (``StepBuffer.drop_overwritten``), the rows of
  the pass still readable (the last one) stay;
- the device loss of an unsampled step, kept as a 0-d view until the next record (the step log) and the
  sentinel's batch: an overwritten one is dropped;
- opt-in metric values and values given to ``watch.log``, dropped the same way.

Whatever is dropped is counted in ``statistics().skipped["cuda_graphs"]`` and warned about once, and
from then on (:attr:`GraphMemory.copy`) each pass's rows are copied when they move into the step after its
backward (``TapState.drain``), while their memory is still theirs, and device losses when they are kept:
a few small kernels a step, and the rest of the run loses nothing.
Telling an overwritten tensor needs no launch and no sync: :func:`overwritten` reads its data pointer.

Example:
    >>> import torch
    >>> memory = GraphMemory({})
    >>> loss = torch.tensor(0.5)
    >>> memory.keep(loss) is loss  # (a view is kept until something was overwritten)
    True
"""

from __future__ import annotations

import sys
import warnings

import torch

__all__ = ["REASON", "GraphMemory", "overwritten"]

REASON = "cuda_graphs"
"""The ``statistics().skipped`` reason of values CUDA graphs overwrote before streamwatch read them."""


def overwritten(x: torch.Tensor) -> bool:
    """Whether ``x``'s memory was handed to a later pass of the CUDA graphs that made it (reading it
    raises). No launch, no sync: only the data pointer is read.

    Example:
        >>> overwritten(torch.ones(2))
        False
    """
    fake = sys.modules.get("torch._subclasses.fake_tensor")  # (loaded wherever there are fake tensors)
    if fake is not None and isinstance(x, fake.FakeTensor):  # (no memory: its data pointer warns)
        return False
    try:
        x.data_ptr()
    except RuntimeError as exc:  # (torch's words: "accessing tensor output of CUDAGraphs that has been
        return "CUDAGraphs" in str(exc)  # overwritten by a subsequent run"; a tensor without storage: no)
    return False


class GraphMemory:
    """One Watch's account of values CUDA graphs overwrote (training thread only).

    Args:
        skipped: the Watch's skip counts (``TapState.skipped``), where the lost values are counted.

    Attributes:
        copy: rows of compiled code and device losses are copied when kept past their pass (set at the
            first value lost).
        lost: values lost so far.

    Example:
        >>> skipped = {}
        >>> memory = GraphMemory(skipped)
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as said:
        ...     warnings.simplefilter("always")
        ...     memory.found(3, "rows")
        ...     memory.found(1, "losses")  # (warned once)
        >>> skipped, memory.copy, len(said)
        ({'cuda_graphs': 4}, True, 1)
    """

    def __init__(self, skipped: dict[str, int]) -> None:
        self._skipped = skipped
        self.copy = False
        self.lost = 0

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (a detached device tensor) to keep past its step: a copy once CUDA graphs overwrote a
        kept value, else ``x`` itself (a view: no launch)."""
        return x.clone() if self.copy else x

    def found(self, n: int, what: str) -> None:
        """``n`` values (``what``: rows, losses, ...) were overwritten before they were read: count them,
        copy device losses from now on, and warn the first time."""
        if n <= 0:
            return
        first = not self.lost
        self.lost += n
        self._skipped[REASON] = self._skipped.get(REASON, 0) + n
        self.copy = True
        if first:
            warnings.warn(
                f"streamwatch: {n} {what} made by CUDA graphs (torch.compile mode='reduce-overhead') were "
                "overwritten by a later pass before streamwatch read them; they are skipped and counted in "
                f"statistics().skipped[{REASON!r}]. From now on the rows of compiled code are copied after "
                "each backward pass and device losses when kept (a few small kernels a step), so nothing "
                "more is lost; compile with mode='max-autotune-no-cudagraphs' to avoid the copies "
                "(docs/observe.md#torchcompile)",
                RuntimeWarning,
                stacklevel=2,
            )
