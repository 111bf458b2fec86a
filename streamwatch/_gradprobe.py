"""Gradients w.r.t. module outputs in code ``torch.compile`` traces, without a graph break.

Eager code hooks an output's gradient with ``Tensor.register_hook``, which breaks a compiled graph. In a
graph the forward hook instead passes the output through :class:`_Probe`, an autograd function that
copies it forward (a copy: its output may be changed in place, as by ``ReLU(inplace=True)``, which a
custom function's view may not be) and, backward, passes the gradient through unchanged and returns the
gradient's summary — the row :func:`~streamwatch._torchpath.summarize_traced` makes, as one
float64 vector — as the gradient of a small tensor streamwatch owns, the probe's *sink*. Autograd adds
that vector into the sink's ``.grad`` outside the graph, where a post-accumulate-grad hook takes it out
as the step's row (:meth:`GradProbe.landed`). Everything in the graph is tensor code, so dynamo and
AOTAutograd trace the forward and the backward whole; the gradient the model sees is the same tensor.

One probe per module whose output is one tensor, made when the hooks are installed with :data:`CALLS`
sinks (a sink made later would be a new graph input, and the model compiled again), on the model's
device then: an output on
another device, or a module with several output tensors, is skipped and counted
(``skipped["compiled_grad_hook"]``) as before. Per-unit activity is not taken for such rows. A row lands
without its element count: the graph notes the probed output's count (``TapState.probe_count``), added
to the rows at the step's end (``TapState.settle_counts``).

Each call of the module in a pass (:attr:`GradProbe.calls`, set back to 0 after each backward by
``TapState.drain``) has a sink of its own: autograd adds every gradient a leaf gets in one backward
before its hook runs, so two calls' summaries in one sink would arrive as one sum, right for the sums
but not for min and max. A module called again in the same pass (a shared embedding, a cell in a loop,
the second forward of a siamese pair) lands one row per call, which the step merges as eager mode's
repeated rows; past :data:`CALLS` calls its outputs' gradients are skipped and counted.

Example:
    >>> import torch
    >>> rows = []
    >>> probe = GradProbe("fc", torch.device("cpu"), lambda key, count, row: rows.append((count, row)))
    >>> x = torch.tensor([1.0, -2.0, 0.0], requires_grad=True)
    >>> probe.apply(x, count_nonfinite=False).mul(torch.tensor([3.0, 1.0, 2.0])).sum().backward()
    >>> count, row = rows[0]  # (the count comes apart: TapState.probe_count)
    >>> count, [float(v) for v in row.values()][:6]  # the gradient [3, 1, 2]: sum, sumsq, min, max, ...
    (0, [6.0, 14.0, 1.0, 3.0, 3.0, 6.0])
    >>> probe.remove()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from streamwatch._record import SeriesKey
from streamwatch._torchpath import Row, summarize_traced

__all__ = ["CALLS", "SINK_SIZE", "GradProbe"]

CALLS = 8
"""Calls of one module per pass whose output gradients a probe takes (one sink each): a shared
embedding's two, a siamese pair's, a short loop's; the later ones are skipped and counted."""

SINK_SIZE = 19
"""A row as one vector: the 4×4 Gram matrix (16 values, its first the element count), min, max and the
non-finite count (0 when not counted)."""


class _Probe(torch.autograd.Function):
    """Forward: a copy of ``x``. Backward: the gradient unchanged, and its summary as the sink's."""

    @staticmethod
    def forward(x: torch.Tensor, sink: torch.Tensor, count_nonfinite: bool) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.count_nonfinite = inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        if not ctx.needs_input_grad[1]:  # (torch.autograd.grad for other inputs: nothing to land)
            return grad, None, None
        row = summarize_traced(grad, count_nonfinite=ctx.count_nonfinite)
        nonfinite = row.nonfinite if row.nonfinite is not None else torch.zeros_like(row.low)
        return grad, torch.cat([row.gram.reshape(-1), torch.stack([row.low, row.high, nonfinite])]), None


Landing = Callable[[SeriesKey, int, Row], None]
"""What receives each output gradient's row (the key, 0 for its element count, the row), after a
backward."""


class GradProbe:
    """One module's output-gradient probe for compiled code: its sink, and the hook that lands its rows.

    Attributes:
        key: the row's key (``train``, the module, ``output_grad``).
        sinks: the float64 tensors whose gradients carry the summaries out of the graph, one per call.
        nonfinite: whether the last probe counted NaN and ±inf elements (``observe``'s setting).
        calls: the module's outputs probed since the last backward (up to :data:`CALLS`; read in the
            graph, where a guard holds it to 0 at the pass's start).
    """

    def __init__(self, layer: str, device: torch.device, land: Landing) -> None:
        self.key = SeriesKey("train", layer, "output_grad", "")
        zeros = torch.zeros
        self.sinks = tuple(
            zeros(SINK_SIZE, dtype=torch.float64, device=device, requires_grad=True) for _ in range(CALLS)
        )
        self.nonfinite = False  # whether the last probe counted non-finite elements (observe's setting)
        self.calls = 0
        self._land = land
        self._handles = [sink.register_post_accumulate_grad_hook(self.landed) for sink in self.sinks]

    def accepts(self, output: torch.Tensor) -> bool:
        """Whether ``output`` can pass through this probe (its sinks on the same device)."""
        return output.device == self.sinks[0].device and output.is_floating_point() and output.numel() > 0

    def apply(self, output: torch.Tensor, count_nonfinite: bool) -> torch.Tensor | None:
        """``output``, copied, its gradient to be summarised when backward passes it (call in the forward
        hook, in compiled code; its result replaces the module's output); None past the module's
        :data:`CALLS`-th call in a pass (see the module docstring: the caller skips it, counted)."""
        calls = self.calls
        if calls >= CALLS:
            return None
        self.calls = calls + 1
        self.nonfinite = count_nonfinite
        sink = self.sinks[calls]
        return _Probe.apply(output, sink, count_nonfinite)  # type: ignore[no-untyped-call,no-any-return]

    def landed(self, sink: torch.Tensor) -> None:
        """A sink's post-accumulate-grad hook: the summary leaves the sink as a row of the step."""
        values = sink.grad
        sink.grad = None
        if values is None:
            return
        gram = values[:16].view(4, 4)
        nonfinite = values[18] if self.nonfinite else None
        self._land(self.key, 0, Row(gram, values[16], values[17], nonfinite))  # (its count: see above)

    def remove(self) -> None:
        """Take the landing hooks out (idempotent)."""
        for handle in self._handles:
            handle.remove()
