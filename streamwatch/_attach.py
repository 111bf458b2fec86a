"""Attaching a Watch: the model and optimizer it is given, checked, and who observes what.

One Watch per model and per module (:class:`Attachments`): a module two observed models share would have
both models' passes in each watch's rows. The optimizer a framework wraps is unwrapped to the torch
optimizers whose hooks fire (:func:`unwrap_optimizers`: one, or several such as Muon's with AdamW's), and
one that steps none of the model's parameters is warned about (:func:`check_optimizer_steps`).
:func:`checked` runs every check ``observe()`` makes before it attaches anything.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> device_type(model), unwrap_optimizer(None)
    ('cpu', None)
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from streamwatch import _zero
from streamwatch._exit import at_exit
from streamwatch._failures import user_frame
from streamwatch._options import Options
from streamwatch._select import check_hookable, describe_modules

__all__ = [
    "OBSERVED",
    "Attachments",
    "OptimizerArg",
    "check_optimizer_steps",
    "checked",
    "close_at_exit",
    "device_type",
    "unobserve",
    "unwrap_optimizer",
    "unwrap_optimizers",
]

OptimizerArg = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None
"""What ``observe(model, optimizer)`` takes: one optimizer, several in a list or tuple, or none."""


class Attachments:
    """The models and modules the open Watches observe: one Watch per model and per module. A module
    two observed models share would have both models' passes merged into each watch's rows (its hooks
    cannot tell whose forward called it), so the second ``observe()`` naming it is refused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # each observed model: its Watch (weakly) and where observe() was called for it
        self._models: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[Any], str]] = (
            weakref.WeakKeyDictionary()
        )
        self._modules: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self._dropped: list[Any] = []  # the Closing of each Watch collected without close(), until reaped

    def claim(self, model: nn.Module, modules: list[tuple[str, nn.Module]], watch: object) -> str:
        """Take ``model`` and its selected ``modules`` for one ``watch``, or raise naming the clash and where
        the other Watch was made; first close the Watches dropped without ``close()`` (:meth:`reap`).
        Returns where ``observe()`` was called (``file:line``)."""
        self.reap()
        with self._lock:
            if model in self._models:
                _, site = self._models[model]
                raise RuntimeError(
                    f"{type(model).__name__} is already observed by another Watch (made at {site}); close "
                    "that one first: watch.close(), or streamwatch.unobserve(model) where you no longer hold "
                    "it (a notebook cell run again). One Watch per model: use watch.pipe() to add pipelines "
                    "to it"
                )
            for name, module in modules:
                owner = self._modules.get(module)
                if owner is not None:
                    raise RuntimeError(
                        f"Layer {name or '(the model itself)'!r} ({type(module).__name__}) of "
                        f"{type(model).__name__} is already observed by another Watch, as {owner}: a module "
                        "two observed models share would have both models' passes in each watch's rows. "
                        "Close that Watch first, or leave the shared module out of this one with select="
                    )
            frame = sys._getframe(user_frame() - 1)  # (the user's observe() call)
            site = f"{frame.f_code.co_filename}:{frame.f_lineno}"
            self._models[model] = (weakref.ref(watch), site)
            for name, module in modules:
                self._modules[module] = f"layer {name!r} of a {type(model).__name__}" if name else "its model"
            return site

    def release(self, model: nn.Module | None, modules: list[tuple[str, nn.Module]]) -> None:
        """Give back what :meth:`claim` took (idempotent)."""
        with self._lock:
            if model is not None:
                self._models.pop(model, None)
            for _, module in modules:
                self._modules.pop(module, None)

    def owner(self, model: nn.Module) -> Any:
        """The open Watch observing ``model``, or None."""
        with self._lock:
            held = self._models.get(model)
        return None if held is None else held[0]()

    def drop(self, closing: Any, state: Any) -> None:
        """A Watch was collected without ``close()`` (its finalizer, on whatever thread collected it): its
        hooks, still on the model, do nothing from now on, and its :class:`~streamwatch._closing.Closing`
        waits for :meth:`reap` (setting a flag and appending to a list are safe at any moment; taking
        hooks out or waiting for the worker from inside a garbage collection is not)."""
        state.paused = True
        self._dropped.append(closing)

    def reap(self, model: nn.Module | None = None) -> bool:
        """Close every Watch collected without ``close()``, on this thread (``observe()``, ``unobserve()``,
        exit): its last steps go to its sinks, its hooks come out, its model is free. What fails is warned
        about, naming where the Watch was made. True if one of them observed ``model``."""
        found = False
        while self._dropped:
            try:
                closing = self._dropped.pop(0)
            except IndexError:  # (another thread reaped it first)
                break
            found = found or (model is not None and closing.model() is model)
            _close(partial(closing.close, closing.timeout), closing.site, "dropped without close()")
        return found

    def open_watches(self) -> list[tuple[Any, str]]:
        """Every Watch still open, with where ``observe()`` made it, in the order they were made."""
        with self._lock:
            held = list(self._models.values())
        watches = [(ref(), site) for ref, site in held]
        return [(watch, site) for watch, site in watches if watch is not None and not watch.closed]


OBSERVED = Attachments()


def close_at_exit() -> None:
    """At interpreter exit (a script that ends, or raises, without ``close()``): close every Watch left
    open, dropped ones first, so every completed step reaches the sinks (a run file's last lines, the last
    records). What fails is warned about, naming where that Watch was made. Python runs no exit handler
    when a signal such as SIGTERM kills it (docs/observe.md#close says how to flush then)."""
    OBSERVED.reap()
    for watch, site in OBSERVED.open_watches():
        _close(watch.close, site, "at exit")


def _close(close: Any, site: str, when: str) -> None:
    """``close()`` a Watch nobody closed: what it raises (failed pipelines, say) is warned about."""
    try:
        close()
    except Exception as exc:
        warnings.warn(
            f"streamwatch: closing the Watch made at {site} ({when}) failed: {type(exc).__name__}: {exc}",
            RuntimeWarning,
            stacklevel=1,
        )


at_exit(close_at_exit)


def device_type(model: nn.Module) -> str:
    """Where the model's tensors live (its first parameter's or buffer's device type; ``"cpu"`` if it has
    none): the summaries are chosen for it (the fused kernel for the CPU, the Triton kernels for CUDA)."""
    for param in model.parameters():
        return param.device.type
    for buffer in model.buffers():
        return buffer.device.type
    return "cpu"


def unwrap_optimizer(optimizer: object) -> torch.optim.Optimizer | None:
    """The torch optimizer to hook: ``optimizer`` itself, or the one a framework's wrapper steps
    (Accelerate's ``AcceleratedOptimizer.optimizer``, Lightning's ``LightningOptimizer._optimizer``):
    those subclass or imitate ``torch.optim.Optimizer`` without its hook tables, and step the inner one
    only when a step really happens (not on an accumulation micro-step, not when a scaler skips it). A
    DeepSpeed ZeRO optimizer (or Accelerate's wrapper of one): the torch optimizer it steps this rank's
    partitions with (:mod:`streamwatch._zero`).

    Example:
        >>> import torch
        >>> inner = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        >>> class Wrapper(torch.optim.Optimizer):
        ...     def __init__(self, optimizer):  # does not call Optimizer.__init__, as Accelerate's does not
        ...         self.optimizer = optimizer
        >>> unwrap_optimizer(Wrapper(inner)) is inner, unwrap_optimizer(inner) is inner
        (True, True)
    """
    seen = optimizer
    zero = _zero.find(optimizer)
    if zero is not None:  # DeepSpeed ZeRO: the torch optimizer it steps its partitions with (_zero)
        optimizer = zero.optimizer
    for _ in range(8):  # wrappers of wrappers, bounded
        if optimizer is None or (
            isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "_optimizer_step_pre_hooks")
        ):
            return optimizer
        inner = next(
            (
                value
                for value in (getattr(optimizer, name, None) for name in ("optimizer", "_optimizer"))
                if isinstance(value, torch.optim.Optimizer)
            ),
            None,
        )
        if inner is None:
            break
        optimizer = inner
    if isinstance(seen, torch.optim.Optimizer):
        raise TypeError(
            f"Expected `optimizer` to be a torch.optim.Optimizer initialised by its __init__ (it has no "
            f"step hooks), or a wrapper whose `optimizer` attribute is one; got a {type(seen).__qualname__} "
            "without them: pass the torch optimizer it wraps"
        )
    raise TypeError(
        f"Expected `optimizer` to be a torch.optim.Optimizer, a list of them or None, got a "
        f"{type(seen).__qualname__}: {_short(seen)}"
    )


def unwrap_optimizers(optimizer: object) -> tuple[torch.optim.Optimizer, ...]:
    """The torch optimizers to hook: none for None, one for an optimizer (or a framework's wrapper of one,
    :func:`unwrap_optimizer`), each of a list or tuple in its order (Muon for the matrices with AdamW for
    the rest, a GAN's generator and discriminator).

    Raises:
        TypeError: an item is no optimizer (the message names its position).
        ValueError: the same optimizer twice (its hooks would read every parameter twice a step).

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> a = torch.optim.SGD([model.weight], lr=0.1)
        >>> b = torch.optim.Adam([model.bias])
        >>> unwrap_optimizers([a, b]) == (a, b), unwrap_optimizers(a) == (a,), unwrap_optimizers(None)
        (True, True, ())
    """
    if optimizer is None:
        return ()
    if not isinstance(optimizer, list | tuple):
        found = unwrap_optimizer(optimizer)
        return () if found is None else (found,)
    found_all: list[torch.optim.Optimizer] = []
    for i, item in enumerate(optimizer):
        try:
            found = unwrap_optimizer(item) if item is not None else None
        except TypeError as exc:
            raise TypeError(f"`optimizer[{i}]`: {exc}") from None
        if found is None:
            raise TypeError(f"Expected `optimizer[{i}]` to be a torch.optim.Optimizer, got None")
        if any(found is seen for seen in found_all):
            raise ValueError(
                f"`optimizer[{i}]` ({type(found).__name__}) is in the list twice: pass each optimizer once"
            )
        found_all.append(found)
    return tuple(found_all)


def _short(value: object, limit: int = 120) -> str:
    """``repr(value)`` on one line, cut at ``limit`` characters (an optimizer's repr runs many lines)."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def check_optimizer_steps(
    model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], stacklevel: int = 2
) -> None:
    """Warn when an optimizer steps none of ``model``'s parameters (another model's optimizer): its
    ``update`` and ``param`` taps, read around its step, would then watch nothing of the model.
    ``stacklevel``: the caller's frame the warning names, as ``warnings.warn`` counts from here."""
    own = {id(p) for p in model.parameters()}
    for i, optimizer in enumerate(optimizers):
        stepped = [p for group in optimizer.param_groups for p in group.get("params", ())]
        if not (own and stepped) or any(id(p) in own for p in stepped):
            continue
        which = "`optimizer`" if len(optimizers) == 1 else f"`optimizer[{i}]`"
        warnings.warn(
            f"streamwatch: {which} ({type(optimizer).__name__}, {len(stepped)} parameters) steps none of "
            f"`model`'s {len(own)} parameters ({type(model).__name__}): is it another model's? The update "
            "and weight rows are read around its step, so they would watch nothing of this model; pass the "
            "optimizer that steps it, observe(model, optimizer)",
            UserWarning,
            stacklevel=stacklevel,
        )


def checked(
    model: object, optimizer: object, options: Options
) -> tuple[tuple[torch.optim.Optimizer, ...], list[tuple[str, nn.Module]]]:
    """What ``observe(model, optimizer, ...)`` checks before it attaches anything (a refused call touches
    nothing): the model, the optimizers (unwrapped), the metrics that need one, the modules ``select``
    picks and whether torch can hook them. Returns the optimizers and the modules.

    Example:
        >>> from streamwatch._options import parse_options
        >>> from streamwatch._options import OBSERVE_DEFAULTS
        >>> options = parse_options(**OBSERVE_DEFAULTS)
        >>> optimizers, modules = checked(torch.nn.Linear(2, 1), None, options)
        >>> optimizers, [name for name, _ in modules]
        ((), [''])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"Expected `model` to be a torch.nn.Module, got {type(model).__name__}")
    optimizers = unwrap_optimizers(optimizer)
    if options.taps_asked and "update" in options.taps and not optimizers:
        warnings.warn(
            "streamwatch: taps include 'update', which is read around optimizer.step() (its hooks): "
            "without an optimizer no update is recorded; pass it, observe(model, optimizer, ...)",
            UserWarning,
            stacklevel=4,  # the user's observe() call (through Watch.__init__)
        )
    for metric in options.metrics:
        if metric.requires_optimizer and not optimizers:
            raise ValueError(
                f"{metric!r} measures what optimizer.step() does: pass the optimizer, "
                "streamwatch.observe(model, optimizer, metrics=[...])"
            )
    modules = options.select.modules(model)
    if not modules:
        raise ValueError(
            f"`select` matched no module of {type(model).__name__} (select={options.select!r}); its "
            f"modules are {describe_modules(model)}. Observing no layer is never what is wanted: match "
            "these qualified names (globs), or pass select=None for every leaf module"
        )
    check_hookable(model, modules)
    if _zero.find(optimizer) is None:  # (ZeRO's steps flat partitions: its parameters are not the model's)
        check_optimizer_steps(model, optimizers, stacklevel=5)  # the user's observe() call
    return optimizers, modules


def unobserve(model: nn.Module) -> bool:
    """Close the Watch observing ``model``, if one does: for the Watch you no longer hold (a notebook cell
    run again after its ``observe()``, a loop that raised before ``close()``, a Watch dropped without
    ``close()``, whose hooks wait paused for the next ``observe()``). What ``close()`` does is done (the
    last records sent, the sinks closed, every hook removed). True if a Watch was closed.

    Example:
        >>> import torch, streamwatch as sw
        >>> model = torch.nn.Linear(2, 1)
        >>> _ = sw.observe(model, every=1)  # (not kept)
        >>> sw.unobserve(model), sw.unobserve(model)
        (True, False)
        >>> sw.observe(model, every=1).close()
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"Expected `model` to be a torch.nn.Module, got {type(model).__name__}")
    if OBSERVED.reap(model):  # (its Watch was dropped without close(): closed now)
        return True
    watch = OBSERVED.owner(model)
    if watch is None or watch.closed:
        return False
    watch.close()
    return True
