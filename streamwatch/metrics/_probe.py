"""Opt-in metrics that run the model themselves, in ``watch.step()`` on the steps they sample: SVCCA
self-similarity of activations on a fixed probe batch, the Hessian's largest eigenvalue, and a
user-supplied evaluation (test accuracy and loss).

They pause streamwatch's own taps while they run (their forward passes are not training), except
:class:`TestAccuracy`, whose evaluation passes are summarised under ``phase="eval"`` like any other
evaluation loop. Their cost is a forward pass (SVCCA), ``2 × iterations`` extra backward passes
(Hessian) or whatever the evaluation function costs, on the training thread, on sampled steps only:
pick ``every`` accordingly.

Monitoring never changes training: each runs under :meth:`Binding.preserved`, so afterwards every
module's own ``training`` flag (a ``BatchNorm`` frozen with ``.eval()`` inside a training model stays
frozen), every buffer, every parameter's ``.grad`` and the global RNG states (torch CPU and CUDA, python,
numpy) are exactly as they were, whatever the probe pass, the loss closure or the evaluation function did.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from streamwatch._buffer import StepBuffer
from streamwatch._record import SeriesKey
from streamwatch._select import named_layers
from streamwatch.metrics._base import Metric
from streamwatch.metrics._cca import ProbeSimilarity, flatten_samples
from streamwatch.metrics._hessian import HessianEigen

__all__ = ["ActivationSimilarity", "HessianMaxEig", "TestAccuracy"]


class ActivationSimilarity(Metric):
    """SVCCA similarity of each selected layer's activations on a fixed ``probe`` batch between
    consecutive sampled steps (``against="previous"``) or against the first one (``"first"``): 1 = the
    layer represents the probe the same way (up to a linear map), lower = it changed (ikkuna's SVCCA,
    with the SVD reduction step). Written as ``stat="cca_similarity"`` on ``phase="eval"``,
    ``kind="activation"`` series.

    Args:
        probe: a fixed input batch (a tensor, or a tuple of positional inputs) on the model's device;
            use many more samples than the layer widths you compare (≥ 10×), or CCA is trivially 1.
        layers: qualified names of the modules to compare (default: every leaf module with parameters).
            A layer applied straight to the probe without a nonlinearity (the first Linear) is a linear
            map of the probe, so its similarity is 1 whatever it learns: compare nonlinear outputs.
        every: sample one in ``every`` sampled steps (a forward pass of the probe each time).
        keep: the fraction of variance the SVD reduction keeps (0.99 in the SVCCA paper).

    Example:
        >>> import torch, streamwatch as sw
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        >>> sim = sw.metrics.ActivationSimilarity(torch.randn(256, 4), layers=["1"], every=1)
        >>> watch = sw.observe(model, every=1, metrics=[sim])
        >>> watch.step(); watch.step(); watch.close()
        >>> [round(s.value, 6) for s in watch.snapshot() if s.labels.get("stat") == "cca_similarity"]
        [1.0]
    """

    name = "cca_similarity"

    def __init__(
        self,
        probe: torch.Tensor | tuple[Any, ...],
        *,
        layers: Sequence[str] | None = None,
        every: int = 100,
        keep: float = 0.99,
        against: str = "previous",
    ) -> None:
        super().__init__(every)
        self.probe = probe if isinstance(probe, tuple) else (probe,)
        self.layers = None if layers is None else tuple(layers)
        self.keep = keep
        self.against = against
        self._similarity = ProbeSimilarity(keep=keep, against=against)  # type: ignore[arg-type]

    def unbind(self) -> None:
        super().unbind()
        self._similarity.forget()

    def _modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        named = dict(named_layers(model))
        if self.layers is None:
            return [
                (name, m)
                for name, m in named.items()
                if next(m.children(), None) is None and next(m.parameters(recurse=False), None) is not None
            ]
        missing = [name for name in self.layers if name not in named]
        if missing:
            raise ValueError(
                f"ActivationSimilarity: no module named {missing} in the model; pick from {list(named)}"
            )
        return [(name, named[name]) for name in self.layers]

    def on_step(self, buffer: StepBuffer, device_scalars: dict[str, torch.Tensor]) -> None:
        binding = self._bound()
        model = binding.model
        captured: dict[str, torch.Tensor] = {}
        handles = [
            module.register_forward_hook(_capture(captured, name)) for name, module in self._modules(model)
        ]
        try:
            with binding.pause(), binding.preserved(), torch.no_grad():
                model.eval()
                model(*self.probe)
        finally:
            for handle in handles:
                handle.remove()
        for name, activations in captured.items():
            key = SeriesKey("eval", name, "activation", "")
            value = self._similarity(key, flatten_samples(activations))
            if value is not None:
                buffer.add_extra(key, self.name, value)
        silent = [name for name in self.layers or () if name not in captured]
        if silent:  # layers asked for by name that gave nothing to compare: said, not skipped quietly
            raise ValueError(
                f"ActivationSimilarity: the layers {silent} gave no tensor in the probe pass (the model's "
                "forward does not call them, or they return no tensor); name layers that output one"
            )


def _first_tensor(output: Any) -> torch.Tensor | None:
    """A module's output as a tensor: itself, or the first tensor of a tuple or list (an LSTM's sequence
    output) or of a mapping's values (a ``ModelOutput``); None if there is none."""
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, Mapping) else output
    if isinstance(values, tuple | list) or isinstance(output, Mapping):
        return next((v for v in values if isinstance(v, torch.Tensor)), None)
    return None


def _capture(into: dict[str, torch.Tensor], name: str) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        tensor = _first_tensor(output)
        if tensor is not None:  # a copy: a later in-place op of the forward (ReLU(inplace=True)) would
            into[name] = tensor.detach().clone()  # overwrite the layer's output before it is compared

    return hook


class HessianMaxEig(Metric):
    """The loss Hessian's largest-magnitude eigenvalue (the sharpness) by power iteration on
    Hessian-vector products, warm-started from the previous sampled step's eigenvector. Written as the
    step scalar ``hessian_max_eig`` (served as ``streamwatch_hessian_max_eig``).

    Args:
        loss_fn: ``loss_fn(model) -> loss`` on a fixed batch, called once per sampled step; its graph is
            differentiated again for every product. Call ``model.eval()`` in it (or use a model without
            dropout) for a Hessian that does not depend on random dropout masks. Whatever it changes (modes,
            batch-norm statistics, RNG state, ``.grad``) is put back afterwards.
        every: sample one in ``every`` sampled steps.
        iterations: at most this many Hessian-vector products (each costs about two backward passes);
            stops early when the estimate settles (which reads it on the host: a sync on CUDA).

    Example:
        >>> import torch, streamwatch as sw
        >>> model = torch.nn.Linear(3, 1, bias=False)
        >>> x = torch.eye(3) * torch.tensor([[1.0], [2.0], [3.0]])
        >>> metric = sw.metrics.HessianMaxEig(lambda m: 0.5 * m(x).pow(2).sum(), every=1)
        >>> watch = sw.observe(model, metrics=[metric]); watch.step(); watch.close()
        >>> [round(s.value, 3) for s in watch.snapshot() if s.name == "streamwatch_hessian_max_eig"]
        [9.0]
    """

    name = "hessian_max_eig"

    def __init__(
        self, loss_fn: Callable[[nn.Module], torch.Tensor], every: int = 100, iterations: int = 20
    ) -> None:
        super().__init__(every)
        self.loss_fn = loss_fn
        self.iterations = iterations
        self._eigen = HessianEigen(iterations=iterations)

    def unbind(self) -> None:
        super().unbind()
        self._eigen = HessianEigen(iterations=self.iterations)

    def on_step(self, buffer: StepBuffer, device_scalars: dict[str, torch.Tensor]) -> None:
        binding = self._bound()
        model = binding.model
        params = [p for p in model.parameters() if p.requires_grad]
        with binding.pause(), binding.preserved():
            device_scalars[self.name] = self._eigen(lambda: self.loss_fn(model), params)


class TestAccuracy(Metric):
    """A user-supplied evaluation run every ``every`` sampled steps, in ``watch.step()``: ``fn(model)``
    returns the accuracy (a float in [0, 1] or a 0-d tensor) or a mapping with ``"accuracy"`` and/or
    ``"loss"``. Served as ``streamwatch_accuracy{phase="eval"}`` and ``streamwatch_loss{phase="eval"}``.
    Forward passes under ``eval()``/``no_grad`` inside ``fn`` are summarised under ``phase="eval"``.
    ``fn`` is responsible for ``model.eval()``; afterwards every module's own training flag, the buffers,
    the parameters' ``.grad`` and the global RNG states (a shuffling ``DataLoader`` draws from torch's)
    are put back exactly as they were (``.grad`` is None inside ``fn``).

    Example:
        >>> import torch, streamwatch as sw
        >>> model = torch.nn.Linear(2, 2)
        >>> x, y = torch.randn(32, 2), torch.randint(0, 2, (32,))
        >>> def evaluate(m):
        ...     with torch.no_grad():
        ...         return (m(x).argmax(-1) == y).float().mean()
        >>> watch = sw.observe(model, metrics=[sw.metrics.TestAccuracy(evaluate, every=1)])
        >>> watch.step(); watch.close()
        >>> [s.labels for s in watch.snapshot() if s.name == "streamwatch_accuracy"]
        [{'phase': 'eval'}]
    """

    __test__ = False  # not a pytest test class
    name = "eval"

    def __init__(self, fn: Callable[[nn.Module], Any], every: int = 100) -> None:
        super().__init__(every)
        self.fn = fn

    def on_step(self, buffer: StepBuffer, device_scalars: dict[str, torch.Tensor]) -> None:
        binding = self._bound()
        with binding.preserved():
            result = self.fn(binding.model)
        values = result if isinstance(result, Mapping) else {"accuracy": result}
        unknown = set(values) - {"accuracy", "loss"}
        if unknown:
            raise ValueError(
                f"TestAccuracy: the evaluation function returned keys {sorted(unknown)}; return a number "
                "(the accuracy) or a mapping with 'accuracy' and/or 'loss'"
            )
        for name, value in values.items():
            tensor = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            if tensor.numel() != 1:
                raise ValueError(
                    f"TestAccuracy: {name!r} must be a number or a 1-element tensor, "
                    f"got shape {tuple(tensor.shape)}"
                )
            device_scalars[f"eval/{name}"] = tensor.reshape(()).to(torch.float32)
