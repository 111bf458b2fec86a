"""The tests' training loop: ``train(model, opt, watch, steps)`` runs real optimizer steps under a watch.

Each step builds a batch, runs the forward, the loss, ``opt.zero_grad()``, ``loss.backward()``,
``opt.step()`` and then ``watch.step(...)``, in that order, as a user's training loop would. Tests take it
as the ``train`` fixture (``tests/conftest.py``); module-level helpers, threads and parametrisation code
import it from here. Loops that are something else (several micro-batches per step, no optimizer, a custom
optimizer step, a ``watch.step()`` that is itself under test) stay written out in their tests.

The batches, by default random: ``shape`` features, ``classes`` class indices (``classes=None``: no targets)
drawn from ``generator`` (kept across calls), from a fresh generator seeded with ``seed``, or, with neither,
from torch's global RNG (``torch.manual_seed`` in the test) — always ``randn`` then ``randint`` per step,
interleaved with training, so a test that builds the same tensors by hand sees the same data. ``data`` gives
the batches instead. The loss is cross-entropy with targets, the mean square of the outputs without.

Callbacks see a ``Step`` (the index, batch, outputs and loss) at three points: ``before_opt_step`` (after
``backward``: the gradients), ``after_opt_step`` (the updated weights, before the watch sees the step) and
``after_watch_step``.

>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> grads = []
>>> with sw.observe(model, opt) as watch:
...     losses = train(model, opt, watch, 3, seed=1, before_opt_step=lambda s: grads.append(s.index))
>>> len(losses), grads, watch.statistics().steps
(3, [0, 1, 2], 3)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import streamwatch as sw

Batch = tuple[torch.Tensor, torch.Tensor | None]
"""Inputs and targets (``None``: a batch without targets)."""

LossFn = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
"""``loss(outputs, targets)``."""

Train = Callable[..., list[float]]
"""The type of ``train`` (and of the ``train`` fixture)."""


@dataclass
class Step:
    """One training step, as the callbacks see it."""

    index: int
    """0, 1, … within this ``train`` call (not the watch's step number)."""
    inputs: torch.Tensor
    targets: torch.Tensor | None
    outputs: torch.Tensor
    loss: torch.Tensor


def random_batches(
    steps: int, shape: Sequence[int], classes: int | None, generator: torch.Generator | None
) -> Iterator[Batch]:
    """``steps`` batches of ``randn(*shape)`` inputs and, unless ``classes`` is None, ``randint(0, classes)``
    targets, one per sample, drawn lazily (one batch per step) from ``generator`` (None: torch's global
    RNG)."""
    for _ in range(steps):
        x = torch.randn(*shape, generator=generator)
        y = None if classes is None else torch.randint(0, classes, (shape[0],), generator=generator)
        yield x, y


def default_loss(outputs: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    """Cross-entropy against class ``targets``; without targets, the mean square of the outputs."""
    if targets is None:
        return outputs.pow(2).mean()
    return F.cross_entropy(outputs, targets)


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    watch: sw.Watch | None,
    steps: int | None = None,
    *,
    data: Iterable[Batch] | None = None,
    shape: Sequence[int] = (8, 4),
    classes: int | None = 3,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    loss: LossFn = default_loss,
    report_outputs: bool = True,
    before_opt_step: Callable[[Step], object] | None = None,
    after_opt_step: Callable[[Step], object] | None = None,
    after_watch_step: Callable[[Step], object] | None = None,
    flush: bool = False,
) -> list[float]:
    """Train ``model`` for ``steps`` steps (or over ``data``); return each step's loss.

    Args:
        model, opt: what to train; ``watch`` observes it (None: train unobserved, e.g. for a reference run).
        steps: how many steps; may be left out when ``data`` is given (then every batch of it is one step).
        data: the batches, ``(inputs, targets)`` pairs (targets may be None); otherwise random batches of
            ``shape`` and ``classes`` from ``generator``, a new generator seeded with ``seed``, or the global
            RNG (see the module docstring).
        loss: ``loss(outputs, targets)``; by default cross-entropy, or the outputs' mean square without
            targets.
        report_outputs: pass ``outputs``, ``targets`` and ``batch_size`` to ``watch.step`` along with the loss
            (when the batch has targets), so the watch scores train accuracy; False: the loss only.
        before_opt_step, after_opt_step, after_watch_step: called with the ``Step`` after ``backward()``,
            after ``opt.step()`` and after ``watch.step()``.
        flush: ``assert watch.flush()`` at the end: every step is in the snapshot and the sinks.
    """
    if seed is not None and generator is not None:
        raise ValueError("pass `seed` or `generator`, not both")
    if data is None:
        if steps is None:
            raise ValueError("pass `steps` (or `data`)")
        if seed is not None:
            generator = torch.Generator().manual_seed(seed)
        data = random_batches(steps, shape, classes, generator)
    elif seed is not None or generator is not None:
        raise ValueError("`seed` and `generator` draw random batches: with `data`, leave them out")
    elif steps is not None:
        data = itertools.islice(data, steps)
    losses = []
    for index, (x, y) in enumerate(data):
        outputs = model(x)
        step = Step(index, x, y, outputs, loss(outputs, y))
        opt.zero_grad()
        step.loss.backward()
        if before_opt_step is not None:
            before_opt_step(step)
        opt.step()
        if after_opt_step is not None:
            after_opt_step(step)
        if watch is not None:
            if report_outputs and y is not None:
                watch.step(loss=step.loss, outputs=outputs, targets=y, batch_size=len(y))
            else:
                watch.step(loss=step.loss)
        if after_watch_step is not None:
            after_watch_step(step)
        losses.append(step.loss.item())
    if steps is not None:
        assert len(losses) == steps, f"`data` ran out after {len(losses)} of {steps} steps"
    if flush:
        assert watch is not None, "flush=True needs a watch"
        assert watch.flush()
    return losses


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    """Whether two models trained apart (one observed, one not) hold bit-identical parameters."""
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def root_seen(model: nn.Module) -> bool:
    """Whether a Watch sees ``model``'s calls: through its call slot or a forward pre-hook. The bare entry a
    dark pair leaves in the slot (it only counts evaluation passes: ``TapSet._dark_call``) sees nothing."""
    slot = model.__dict__.get("_compiled_call_impl")
    dark = slot is not None and "._dark_call." in getattr(slot, "__qualname__", "")
    return (slot is not None and not dark) or bool(model._forward_pre_hooks)


def layer_mean_reference(layers: list[torch.Tensor]) -> dict[str, float]:
    """The ``layer_mean`` reference: the mean over ``layers`` (each a layer's values, its weight and bias
    together) of each one's mean, L2 norm and RMS, in float64."""
    values = [layer.detach().double().flatten() for layer in layers]
    return {
        "mean": float(np.mean([float(v.mean()) for v in values])),
        "l2": float(np.mean([float(v.norm()) for v in values])),
        "rms": float(np.mean([float(v.square().mean().sqrt()) for v in values])),
    }
