"""Opt-in metrics over tensors: cosines of consecutive gradients and updates, spectral norms, condition
numbers, histograms and p-norms.

Each writes device tensors into the step's buffer (``(key, stat)`` extras, read on the worker), so none
of them synchronises with the device on the training thread — except :class:`ConditionNumber`, whose
SVD runs where the weights are (on CUDA the solver may sync; it is sampled and documented as such).

Memory, when on: :class:`GradientCosine` keeps one copy of every selected parameter's gradient (updates:
one copy of the weights on the two steps around a sampled one, and the previous update);
:class:`SpectralNorm` keeps one vector per weight (its columns); the others keep nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from streamwatch._buffer import StepBuffer
from streamwatch._record import SeriesKey
from streamwatch._validate import check_real
from streamwatch.metrics._base import Metric
from streamwatch.metrics._histogram import Buckets, histogram
from streamwatch.metrics._spectral import PowerIteration, condition_number

__all__ = ["ConditionNumber", "GradientCosine", "Histogram", "PNorm", "SpectralNorm"]

_TENSOR_KINDS = ("input", "activation", "output_grad", "input_grad", "param", "param_grad", "update")


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """cos(a, b) in float32 (float64 stays), on the device; NaN when either is all zero."""
    dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
    a, b = a.reshape(-1).to(dtype), b.reshape(-1).to(dtype)
    cosine: torch.Tensor = torch.dot(a, b) / (torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b))
    return cosine


class GradientCosine(Metric):
    """Cosine similarity between consecutive steps' parameter gradients (``of="param_grad"``) or
    updates (``of="update"``), per parameter: 1 = the same direction, 0 = orthogonal, −1 = reversed
    (monitorch's GradientGeometry "correlation", ikkuna's gradient/update comparisons).

    "Consecutive" is exact even with ``every`` > 1: the copy is taken on the step just before each
    sampled one. Written as ``stat="cosine"`` on the ``param_grad`` / ``update`` series.

    Cost when on: one copy of the selected gradients (for updates: a copy of the weights before the step,
    and the previous update, kept until the next sampled step), taken on the two steps around each
    sampled one; a dot product and two norms per parameter.

    Example:
        >>> import torch, streamwatch as sw
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> watch = sw.observe(model, opt, every=1, metrics=[sw.metrics.GradientCosine()])
        >>> for _ in range(3):
        ...     opt.zero_grad(); model(torch.ones(8, 4)).pow(2).mean().backward(); opt.step(); watch.step()
        >>> watch.close()
        >>> cosines = [s.value for s in watch.snapshot() if s.labels.get("stat") == "cosine"]
        >>> len(cosines), all(-1.0 <= c <= 1.0 + 1e-6 for c in cosines)
        (2, True)
    """

    name = "cosine"

    def __init__(self, of: str = "param_grad", every: int = 1) -> None:
        super().__init__(every)
        if of not in ("param_grad", "update"):
            raise ValueError(f"Expected `of` to be 'param_grad' or 'update', got {of!r}")
        self.of = of
        self._previous: dict[int, torch.Tensor] = {}  # id(param) -> the previous step's gradient / update
        self._before: list[torch.Tensor] | None = None  # weights before this step's optimizer.step()
        self._delta: list[torch.Tensor] | None = None  # this step's updates, once computed

    def unbind(self) -> None:
        super().unbind()
        self._previous, self._before, self._delta = {}, None, None

    # On a sampled step the Watch calls before/after_optimizer_step; on the step before a sampled one
    # prepare/prepare_after (after the sampled step's calls when a step is both).

    def before_optimizer_step(self, buffer: StepBuffer) -> None:
        if self.of == "update":
            self._snapshot()
            return
        for layer, name, param in self._bound().params:
            previous = self._previous.pop(id(param), None)
            grad = param.grad
            if grad is not None and previous is not None and previous.shape == grad.shape:
                buffer.add_extra(
                    SeriesKey("train", layer, "param_grad", name), "cosine", _cosine(grad, previous)
                )

    def after_optimizer_step(self, buffer: StepBuffer) -> None:
        if self.of != "update":
            return
        deltas = self._deltas()
        for (layer, name, param), delta in zip(self._bound().params, deltas, strict=False):
            previous = self._previous.pop(id(param), None)
            if previous is not None and previous.shape == delta.shape:
                buffer.add_extra(
                    SeriesKey("train", layer, "update", name), "cosine", _cosine(delta, previous)
                )

    def prepare(self, buffer: StepBuffer) -> None:
        if self.of == "update":
            self._snapshot()
            return
        for _, _, param in self._bound().params:
            if param.grad is not None:
                self._previous[id(param)] = param.grad.detach().clone()

    def prepare_after(self, buffer: StepBuffer) -> None:
        if self.of == "update":
            for (_, _, param), delta in zip(self._bound().params, self._deltas(), strict=False):
                self._previous[id(param)] = delta
        self._delta = None

    def _snapshot(self) -> None:
        if self._before is None:  # a step both sampled and preparing copies the weights once
            self._delta = None
            with torch.no_grad():
                self._before = [param.detach().clone() for _, _, param in self._bound().params]

    def _deltas(self) -> list[torch.Tensor]:
        if self._delta is None:
            before, self._before = self._before, None
            params = self._bound().params
            if before is None:  # bound mid-step: no copy yet
                return []
            with torch.no_grad():
                self._delta = [p.detach() - old for (_, _, p), old in zip(params, before, strict=True)]
        return self._delta

    @property
    def needs_prepare(self) -> bool:
        return True

    @property
    def requires_optimizer(self) -> bool:
        return self.of == "update"  # an update is what optimizer.step() did


class SpectralNorm(Metric):
    """The largest singular value σmax of every weight matrix (parameters of 2+ dimensions, viewed as
    ``(out, -1)``), by power iteration warm-started from the previous sampled step: ``iterations``
    matrix-vector products per weight per sampled step (ikkuna's SpectralNorm subscriber). Written as
    ``stat="spectral_norm"`` on the ``param`` series.

    Example:
        >>> import torch, streamwatch as sw
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Linear(4, 3)
        >>> watch = sw.observe(model, metrics=[sw.metrics.SpectralNorm(iterations=50)])
        >>> watch.step(); watch.close()
        >>> [got] = [s.value for s in watch.snapshot() if s.labels.get("stat") == "spectral_norm"]
        >>> abs(got - float(torch.linalg.matrix_norm(model.weight.detach(), ord=2))) <= 1e-4 * got
        True
    """

    name = "spectral_norm"

    def __init__(self, every: int = 1, iterations: int = 2) -> None:
        super().__init__(every)
        self.iterations = iterations
        self._power = PowerIteration(iterations=iterations)

    def unbind(self) -> None:
        super().unbind()
        self._power.forget()

    def after_optimizer_step(self, buffer: StepBuffer) -> None:
        for layer, name, param in self._bound().named_params(min_dim=2):
            key = SeriesKey("train", layer, "param", name)
            buffer.add_extra(key, self.name, self._power(key, param.detach()))


class ConditionNumber(Metric):
    """σmax/σmin of every weight matrix (``(out, -1)``), from its singular values (``svdvals``): +inf for a
    rank-deficient matrix. Not ikkuna's σmax·σmin (a bug this does not reproduce). Written as
    ``stat="condition_number"`` on the ``param`` series.

    Cost: one SVD per weight per sampled step (a 1024×1024 float32 weight: tens of milliseconds on a
    CPU core); sample it rarely (``every=100`` or more). On CUDA the solver may synchronise.

    Example:
        >>> import torch, streamwatch as sw
        >>> model = torch.nn.Linear(3, 3)
        >>> with torch.no_grad():
        ...     _ = model.weight.copy_(torch.diag(torch.tensor([4.0, 2.0, 0.5])))
        >>> watch = sw.observe(model, metrics=[sw.metrics.ConditionNumber()])
        >>> watch.step(); watch.close()
        >>> [round(s.value, 3) for s in watch.snapshot() if s.labels.get("stat") == "condition_number"]
        [8.0]
    """

    name = "condition_number"

    def after_optimizer_step(self, buffer: StepBuffer) -> None:
        for layer, name, param in self._bound().named_params(min_dim=2):
            buffer.add_extra(
                SeriesKey("train", layer, "param", name), self.name, condition_number(param.detach())
            )


class Histogram(Metric):
    """Histograms of tapped tensors with fixed, log-spaced, sign-aware buckets (see
    :class:`streamwatch.metrics.Buckets`): the same edges on every step and rank, so counts add up.
    Written as ``stat="histogram"`` (a vector of bucket counts) on the tapped series.

    Cost: one ``bucketize`` pass and a ``bincount`` per tensor per sampled step.

    Example:
        >>> import torch, streamwatch as sw
        >>> model = torch.nn.Linear(4, 2)
        >>> watch = sw.observe(model, metrics=[sw.metrics.Histogram(kinds=("activation",))])
        >>> _ = model(torch.randn(8, 4)); watch.step(); watch.close()
        >>> counts = [s.value for s in watch.snapshot() if s.name == "streamwatch_tensor_histogram"]
        >>> sum(counts)
        16.0
    """

    name = "histogram"

    def __init__(
        self, kinds: Sequence[str] = ("param_grad",), every: int = 1, buckets: Buckets | None = None
    ) -> None:
        super().__init__(every)
        unknown = [k for k in kinds if k not in _TENSOR_KINDS]
        if unknown or not kinds:
            raise ValueError(f"Expected `kinds` from {_TENSOR_KINDS}, got {tuple(kinds)!r}")
        self.kinds = tuple(kinds)
        self.buckets = buckets if buckets is not None else Buckets()

    def on_tensor(self, buffer: StepBuffer, key: SeriesKey, x: torch.Tensor) -> None:
        buffer.add_extra(key, self.name, histogram(x, self.buckets))

    def edges(self) -> Mapping[str, tuple[float, ...]]:
        """The buckets' upper bounds for each kind it reads (``Buckets.upper_bounds()``).

        Example:
            >>> Histogram(kinds=("activation",), buckets=Buckets(lo=0, hi=1, per_decade=1)).edges()
            {'activation': (-10.0, -1.0, -5e-324, 0.0, 1.0, 10.0, inf)}
        """
        bounds = tuple(self.buckets.upper_bounds())
        return dict.fromkeys(self.kinds, bounds)


class PNorm(Metric):
    """The p-norm ``(Σ|x|^p)^(1/p)`` of tapped tensors for any ``p > 0`` (``inf``: the abs-max). The 2-norm
    and the abs-max already come with every summary (``stat="l2"``, ``"absmax"``); this adds other p.
    Written as ``stat="norm_p<p>"`` (``norm_p1``, ``norm_p0.5``).

    Example:
        >>> import torch, streamwatch as sw
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Linear(4, 2)
        >>> watch = sw.observe(model, metrics=[sw.metrics.PNorm(p=1, kinds=("activation",))])
        >>> y = model(torch.randn(8, 4)); watch.step(); watch.close()
        >>> [got] = [s.value for s in watch.snapshot() if s.labels.get("stat") == "norm_p1"]
        >>> abs(got - float(y.detach().abs().sum())) <= 1e-5 * got  # (summed in float32 here)
        True
    """

    def __init__(self, p: float = 1.0, kinds: Sequence[str] = ("param_grad",), every: int = 1) -> None:
        super().__init__(every)
        check_real(p, "p", above=0, note="or float('inf')")
        unknown = [k for k in kinds if k not in _TENSOR_KINDS]
        if unknown or not kinds:
            raise ValueError(f"Expected `kinds` from {_TENSOR_KINDS}, got {tuple(kinds)!r}")
        self.p = float(p)
        self.kinds = tuple(kinds)
        self.name = f"norm_p{self.p:g}"

    def on_tensor(self, buffer: StepBuffer, key: SeriesKey, x: torch.Tensor) -> None:
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        buffer.add_extra(key, self.name, torch.linalg.vector_norm(x, ord=self.p, dtype=dtype))
