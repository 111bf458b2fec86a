"""What an opt-in metric is: an object ``observe(metrics=[...])`` binds to the model and calls on the steps
it samples.

A metric runs on the training thread, so it follows the taps' rules: device tensors only (no ``.item()``,
no ``.cpu()``), values written into the step's buffer with :meth:`StepBuffer.add_extra` (read on the
worker, after the step's copy), exceptions caught and counted like a hook's. It samples one step in
``every`` *sampled* steps (``observe(every=N)`` × the metric's ``every``), like a tap kind's cadence.

Four call sites, each optional:

* :meth:`Metric.on_tensor` — a tap's tensor of one of :attr:`Metric.kinds` (activation, param_grad, ...),
  right after its summary, on the steps the metric samples (histograms, p-norms);
* :meth:`Metric.before_optimizer_step` / :meth:`Metric.after_optimizer_step` — around ``optimizer.step()``
  (gradients complete / weights updated: cosines, spectral norms);
* :meth:`Metric.on_step` — in ``watch.step()`` before the record is sealed (probe batches, the Hessian, an
  evaluation function); without an optimizer, parameter metrics run here too.

:meth:`Metric.prepare` lets a metric that compares consecutive steps (cosines) take its copy on the step
just before the one it samples, so "consecutive" means consecutive even with ``every`` > 1.

A metric that runs the model or user code (a probe batch, a loss closure, an evaluation function) does so
under :func:`preserved` (:meth:`Binding.preserved`): monitoring never changes training, so on exit every
module's own ``training`` flag, every buffer, every parameter's ``.grad`` and the global random number
generators are exactly as the metric found them, whatever the code in between did.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from streamwatch._buffer import StepBuffer
from streamwatch._validate import check_int

__all__ = ["Binding", "Metric", "preserved"]


@contextlib.contextmanager
def preserved(model: nn.Module, params: Iterable[torch.Tensor] = ()) -> Iterator[None]:
    """Run the body, then put back everything of ``model`` that training reads, exactly as it was.

    For metrics that run the model or user code on a sampled step; on exit (normal or by exception):

    * every module's own ``training`` flag (not ``model.train(was_training)``, which would switch a
      deliberately frozen ``BatchNorm`` inside a training model back to training);
    * every buffer, bit for bit (batch-norm statistics a train-mode forward updated, spectral-norm vectors,
      caches); a buffer the body replaced is put back;
    * every parameter's ``.grad`` (of ``model`` and of ``params``, e.g. the optimizer's): the body runs
      with ``.grad`` set to None, so a ``backward()`` in it accumulates into fresh tensors, which are
      dropped; the original tensors (or None) come back untouched;
    * the global random number generators: torch's CPU generator, every CUDA device's generator once
      CUDA is initialised, python's ``random`` and numpy's global state (dropout masks, a shuffling
      ``DataLoader``, user code drawing numbers).

    Cost: one copy of the model's buffers (kept until the end of the body, then copied back) and of the
    RNG states; no host synchronisation. Parameter values are not copied: code run by a metric must not
    modify weights.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        >>> _ = model[1].eval()  # frozen inside a training model
        >>> state = torch.get_rng_state()
        >>> with preserved(model):
        ...     _ = model.train()(torch.randn(4, 2)).sum().backward()
        >>> model.training, model[1].training, model[0].weight.grad, torch.equal(torch.get_rng_state(), state)
        (True, False, None, True)
    """
    modes = [(module, module.training) for module in model.modules()]
    grads: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for param in (*model.parameters(), *params):
        grads.setdefault(id(param), (param, param.grad))
    buffers = [
        (module._buffers, name, buffer, buffer.detach().clone())
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None and not buffer.is_inference()  # read-only outside inference_mode
    ]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    python_rng = random.getstate()
    numpy_rng = np.random.get_state()
    for param, _ in grads.values():
        param.grad = None
    try:
        yield
    finally:
        for module, training in modes:
            if module.training != training:
                module.training = training
        for param, grad in grads.values():
            if param.grad is not grad:
                param.grad = grad
        with torch.no_grad():
            for owner, name, buffer, saved in buffers:
                if owner.get(name) is not buffer:
                    owner[name] = buffer
                if buffer.shape == saved.shape and buffer.dtype == saved.dtype:
                    # Through .data: no version bump, so a graph that saved the buffer (an eval-mode
                    # BatchNorm's statistics) can still back-propagate. Always copied: batch norm's kernels
                    # update the running statistics without bumping their version either.
                    buffer.data.copy_(saved)
                else:
                    owner[name] = saved
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(python_rng)
        np.random.set_state(numpy_rng)


@dataclass(frozen=True)
class Binding:
    """What a metric may use of the observed run (given to :meth:`Metric.bind`).

    Attributes:
        model: the observed module.
        params: ``(layer, name, parameter)`` of every selected module's parameters, in module order.
        optimizers: the observed optimizers, in the order given (none without one).
        pause: a context manager under which streamwatch's own taps do nothing (for metrics that run
            the model on a probe batch or differentiate the loss again).
    """

    model: nn.Module
    params: Sequence[tuple[str, str, nn.Parameter]]
    optimizers: tuple[torch.optim.Optimizer, ...]
    pause: Callable[[], AbstractContextManager[None]]

    def preserved(self) -> AbstractContextManager[None]:
        """:func:`preserved` for the observed model (and the optimizers' parameters): run the model or user
        code under it, and training finds everything as it left it."""
        extra = [
            p for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"]
        ]
        return preserved(self.model, extra)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The first observed optimizer, or None (:attr:`optimizers` holds them all)."""
        return self.optimizers[0] if self.optimizers else None

    def named_params(self, *, min_dim: int = 0) -> Iterator[tuple[str, str, nn.Parameter]]:
        """The parameters with at least ``min_dim`` dimensions (``2`` for weight matrices and kernels)."""
        for layer, name, param in self.params:
            if param.dim() >= min_dim:
                yield layer, name, param


class Metric:
    """Base of the opt-in metrics. Subclasses set :attr:`name` and override the call sites they need.

    Attributes:
        name: the metric's name (the ``stat`` label of the values it writes, unless it writes several).
        every: sample one in ``every`` sampled steps.
        kinds: tap kinds whose tensors :meth:`on_tensor` receives.
    """

    name: str = "metric"
    kinds: tuple[str, ...] = ()

    def __init__(self, every: int = 1) -> None:
        self.every = check_int(every, "every")
        self.binding: Binding | None = None

    # -- lifecycle (the Watch calls these) ------------------------------------------------------------------

    def bind(self, binding: Binding) -> None:
        """Attach to an observed run; a metric object serves one run at a time."""
        if self.binding is not None:
            raise RuntimeError(
                f"{self!r} is already bound to an observed model; create a new one per observe()"
            )
        self.binding = binding

    def unbind(self) -> None:
        """Detach, dropping every tensor kept between steps (copies, warm-start vectors)."""
        self.binding = None

    def prepare(self, buffer: StepBuffer) -> None:
        """Before ``optimizer.step()`` (or in ``watch.step()``) of the step *before* a sampled one."""

    def prepare_after(self, buffer: StepBuffer) -> None:
        """After ``optimizer.step()`` (or in ``watch.step()``) of the step *before* a sampled one."""

    # -- call sites, on the steps the metric samples ------------------------------------------------------

    def on_tensor(self, buffer: StepBuffer, key: Any, x: torch.Tensor) -> None:
        """A tapped tensor of one of :attr:`kinds` (detached, dense, floating)."""

    def before_optimizer_step(self, buffer: StepBuffer) -> None:
        """Gradients are complete; the weights are not updated yet."""

    def after_optimizer_step(self, buffer: StepBuffer) -> None:
        """The weights were just updated."""

    def on_step(self, buffer: StepBuffer, device_scalars: dict[str, torch.Tensor]) -> None:
        """In ``watch.step()``, before the record is sealed; step-level values go into ``device_scalars``
        (0-d tensors, read on the worker)."""

    def edges(self) -> Mapping[str, tuple[float, ...]]:
        """What rendering its values takes besides the values (carried by every record as
        :attr:`streamwatch.StepRecord.edges`): a histogram's bucket upper bounds by tap kind."""
        return {}

    @property
    def requires_optimizer(self) -> bool:
        """Whether it needs ``observe(model, optimizer)`` (it reads what ``optimizer.step()`` does)."""
        return False

    @property
    def needs_prepare(self) -> bool:
        """Whether :meth:`prepare` does anything (the Watch skips the call otherwise)."""
        return type(self).prepare is not Metric.prepare

    def _bound(self) -> Binding:
        if self.binding is None:
            raise RuntimeError(f"{self!r} is not bound: pass it to streamwatch.observe(metrics=[...])")
        return self.binding

    def __repr__(self) -> str:
        return f"{type(self).__name__}(every={self.every})"
