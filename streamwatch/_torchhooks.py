"""What streamwatch reads or writes of torch's internals, in one place (each with its fallback):

* **Hook dictionaries** (:class:`HookGroup`): hooks registered once through torch's API, then put back
  into and taken out of the dicts their handles name (``RemovableHandle.hooks_dict_ref`` and
  ``extra_dict_ref``, every torch 2.x) as steps are sampled or not; where a handle does not show its
  dicts, the group registers and removes its hooks each time (``tests/test_arming.py`` checks both).
* **The root module's call slot** (:func:`hold_call_slot`): ``Module.__call__`` calls the instance's
  ``_compiled_call_impl`` (what ``Module.compile()`` sets) when there is one; streamwatch sees the root
  module's calls through it where it is free (:func:`call_slot_free`), else with a forward pre-hook.
* **Backward and checkpointing** (:func:`recomputing`, :func:`in_checkpoint`): whether a forward runs
  inside a backward pass (``torch._C._current_graph_task_id``; absent: never), and whether a
  re-entrant checkpoint's ``forward``/``backward`` is on the stack (its code objects; absent: never).
  Which backward runs (:func:`accumulates`: ``torch._C._will_engine_execute_node``; absent: every
  pass counts), and whether a ``torch.func`` transform does (:func:`in_transform`:
  ``torch._C._functorch.maybe_current_level``; absent: never).
* **Dynamo's hook guards** (:class:`HookGuards`): by default dynamo does not check that a module whose
  hooks were empty when it compiled a graph still has none (``torch._dynamo.config``'s
  ``skip_nnmodule_hook_guards``), so a graph compiled for another instance of an observed model's class
  runs the observed one without streamwatch's hooks. While a Watch is open that check is on (once dynamo
  is loaded: streamwatch never imports it), and the setting goes back when the last Watch closes.

Example:
    >>> import functools, torch
    >>> m = torch.nn.Linear(2, 2)
    >>> group = HookGroup([functools.partial(m.register_forward_hook, lambda *a: None)], switched=True)
    >>> group.set(True); len(m._forward_hooks)
    1
    >>> group.set(False); len(m._forward_hooks)
    0
    >>> call_slot_free(m), recomputing()
    (True, False)
"""

from __future__ import annotations

import collections
import functools
import operator
import sys
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = [
    "CHECKPOINT_BACKWARD",
    "CHECKPOINT_FORWARD",
    "HookGroup",
    "HookGuards",
    "accumulates",
    "call_slot_free",
    "entries_of",
    "graph_task",
    "hold_call_slot",
    "holds_call_slot",
    "in_checkpoint",
    "in_transform",
    "recomputing",
    "release_call_slot",
    "remove_grad_hook",
]

_SLOT = "_compiled_call_impl"
"""The per-instance attribute ``Module.__call__`` calls in place of ``_call_impl`` when it is set."""


_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)  # -1 outside a backward pass
_WILL_EXECUTE = getattr(torch._C, "_will_engine_execute_node", None)
_FUNCTORCH_LEVEL = getattr(getattr(torch._C, "_functorch", None), "maybe_current_level", None)
_CHECKPOINT_FUNCTION = getattr(torch.utils.checkpoint, "CheckpointFunction", None)
CHECKPOINT_FORWARD = getattr(getattr(_CHECKPOINT_FUNCTION, "forward", None), "__code__", None)
CHECKPOINT_BACKWARD = getattr(getattr(_CHECKPOINT_FUNCTION, "backward", None), "__code__", None)


def recomputing() -> bool:
    """Whether a forward runs inside a backward pass: activation checkpointing recomputing it
    (``torch.utils.checkpoint``, either mode). Never inside a compiled graph (the call would break the
    graph; compiled checkpointing recomputes in its own graph, without module hooks)."""
    if torch.compiler.is_compiling() or _GRAPH_TASK_ID is None:
        return False
    return bool(_GRAPH_TASK_ID() != -1)


def in_transform() -> bool:
    """Whether code runs inside a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``, ... over
    ``functional_call``: per-sample gradients, ensembles). Its tensors are functorch's wrappers, with no
    storage to read and a batch dimension they hide: not summarised. Never inside a compiled graph.

    Example:
        >>> import torch
        >>> seen = []
        >>> _ = torch.func.vmap(lambda x: seen.append(in_transform()) or x)(torch.ones(2, 3))
        >>> seen, in_transform()
        ([True], False)
    """
    if _FUNCTORCH_LEVEL is None or torch.compiler.is_compiling():
        return False
    return _FUNCTORCH_LEVEL() is not None


def graph_task() -> int:
    """The running backward pass's id (``torch._C._current_graph_task_id``), -1 outside one (or where
    torch does not say)."""
    return -1 if _GRAPH_TASK_ID is None else int(_GRAPH_TASK_ID())


def accumulates(params: Iterable[torch.Tensor]) -> bool:
    """Whether the backward pass running now adds to the ``.grad`` of one of ``params``: a
    ``backward()`` does (those in its graph); ``torch.autograd.grad`` does not (a gradient penalty's
    pass, a meta-learning inner step). True where it cannot be told: no parameter needs a gradient, or
    torch lacks ``_will_engine_execute_node``.

    Call it inside a backward pass that builds a graph (``create_graph=True``: grad mode is on there):
    it takes a view of each parameter to reach the gradient accumulator its graph holds, one small node
    per parameter, so it is for the rare passes that need telling apart, once per pass.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> seen = []
        >>> def hook(grad):
        ...     with torch.enable_grad():  # (as in a create_graph pass)
        ...         seen.append(accumulates([w]))
        >>> y = (w * 3).sum(); _ = y.grad_fn.register_prehook(hook)
        >>> _ = torch.autograd.grad(y, w, retain_graph=True); y.backward()
        >>> seen
        [False, True]
    """
    if _WILL_EXECUTE is None:
        return True
    told = False
    for param in params:
        if not param.requires_grad:
            continue
        node = param.view_as(param).grad_fn
        if node is None:  # (grad mode off after all: cannot tell)
            return True
        told = True
        try:
            if _WILL_EXECUTE(node.next_functions[0][0]):
                return True
        except RuntimeError:  # torch.autograd.grad captures this parameter's gradient: no accumulation
            continue
    return not told


def in_checkpoint(code: Any) -> bool:
    """Whether a re-entrant checkpoint's ``forward`` (``code`` is ``CheckpointFunction.forward``: its first
    forward, under ``no_grad``) or ``backward`` (the recomputation) is on the stack. Walks the stack; called
    only for a training-mode module under ``no_grad``, or inside a backward pass."""
    if code is None or torch.compiler.is_compiling():
        return False
    frame: FrameType | None = sys._getframe(1)
    for _ in range(256):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def call_slot_free(model: nn.Module) -> bool:
    """Whether the root module's calls can be seen through its call slot (:func:`hold_call_slot`): its
    class calls as ``nn.Module`` does (``__call__`` reads the slot) and nothing holds the slot (not
    ``model.compile()``-d)."""
    cls = type(model)
    module_call = getattr(nn.Module, "_wrapped_call_impl", None)
    return (
        module_call is not None
        and cls.__call__ is module_call
        and getattr(cls, "_wrapped_call_impl", None) is module_call
        and getattr(cls, "_compiled_call_impl", False) is None
        and model.__dict__.get("_compiled_call_impl") is None
        # copied and pickled as nn.Module does it, which leaves the slot out (LightningModule's own
        # __getstate__ keeps it: a copy, an EMA or teacher model, would run the original's forward)
        and all(getattr(cls, name, None) is getattr(nn.Module, name, None) for name in _COPYING)
    )


_COPYING = ("__getstate__", "__setstate__", "__reduce__", "__reduce_ex__", "__copy__", "__deepcopy__")
"""How an object is copied and pickled: a root module whose class changes any of these is seen with a
forward pre-hook (whose copies are inert), not through its call slot."""


def hold_call_slot(model: nn.Module, entry: Callable[..., Any]) -> None:
    """Make ``model``'s calls go through ``entry`` (which must call ``model._call_impl``)."""
    model.__dict__[_SLOT] = entry  # (a cycle through the model's own dict, until released)


def holds_call_slot(model: nn.Module, entry: Callable[..., Any]) -> bool:
    """Whether ``model``'s call slot still holds ``entry`` (``Module.compile()`` takes it)."""
    return model.__dict__.get(_SLOT) is entry


def release_call_slot(model: nn.Module, entry: Callable[..., Any]) -> None:
    """Empty ``model``'s call slot if it still holds ``entry``."""
    if holds_call_slot(model, entry):
        del model.__dict__[_SLOT]


_CALL = operator.methodcaller("__call__")


def _consume(calls: Iterator[Any]) -> None:
    """Run an iterator to its end in C (the ``consume`` recipe of itertools' documentation)."""
    collections.deque(calls, maxlen=0)


def entries_of(handles: list[Any]) -> list[tuple[dict[int, Any], int, Any]] | None:
    """Where torch keeps each registered hook: ``(dict, key, value)`` for the hook dict and every extra
    dict (``with_kwargs``, ``always_call``) a handle names; None where a handle does not show them."""
    entries: list[tuple[dict[int, Any], int, Any]] = []
    for handle in handles:
        try:
            refs = (handle.hooks_dict_ref, *handle.extra_dict_ref)
            key = handle.id
        except (AttributeError, TypeError):
            return None
        for ref in refs:
            hooks = ref() if callable(ref) else None
            if not isinstance(hooks, dict):
                if hooks is None:
                    continue
                return None
            if key in hooks:
                entries.append((hooks, key, hooks[key]))
    return entries


class HookGroup:
    """One group of hooks that :meth:`TapSet.arm` puts in and takes out as steps are sampled or not.

    The first time they go in they are registered through torch's API. From then on, with ``switched``
    and where torch's handles show the dicts the hooks live in (``RemovableHandle.hooks_dict_ref`` and
    ``extra_dict_ref``, every torch 2.x), they are put back into and taken out of those dicts under
    the same keys, the way registering and removing them does: a dict operation per hook, where
    registering and removing again run ~50 bytecodes of torch's Python per hook, on the boundaries
    around every sampled step. Otherwise (``switched`` false: hooks whose registration depends on the
    moment, a parameter that may be frozen) they are registered and removed each time.

    Example:
        >>> m = torch.nn.Linear(2, 2)
        >>> group = HookGroup([functools.partial(m.register_forward_hook, lambda *a: None)], switched=True)
        >>> group.set(True); len(m._forward_hooks)
        1
        >>> group.set(False); len(m._forward_hooks), group.entries is not None
        (0, True)
        >>> group.set(True); len(m._forward_hooks)
        1
    """

    __slots__ = ("entries", "handles", "on", "put_in", "registrations", "switched", "take_out")

    def __init__(self, registrations: list[Callable[[], Any]], switched: bool) -> None:
        self.registrations = registrations
        self.switched = switched
        self.handles: list[Any] = []  # (registered: the handles; empty once switched)
        self.entries: list[tuple[dict[int, Any], int, Any]] | None = None
        # once switched: a call per dict entry to put it back (a re-inserted key goes last, the order
        # registering gives) and to take it out, run in one C loop
        self.put_in: tuple[Callable[[], Any], ...] = ()
        self.take_out: tuple[Callable[[], Any], ...] = ()
        self.on = False

    def set(self, on: bool) -> None:
        """Put the hooks in (``on``) or take them out; nothing if they are so already."""
        if on == self.on:
            return
        if self.entries is not None:
            _consume(map(_CALL, self.put_in if on else self.take_out))
        elif on:
            handles: list[Any] = []
            try:
                for register in self.registrations:
                    handles.append(register())
            except BaseException:  # all or nothing: a registration torch refused leaves none in
                for handle in handles:
                    handle.remove()
                raise
            self.handles = handles
            entries = entries_of(handles) if self.switched else None
            if entries is not None:
                self.entries, self.handles = entries, []
                self.put_in = tuple(
                    functools.partial(hooks.__setitem__, key, value) for hooks, key, value in entries
                )
                self.take_out = tuple(functools.partial(hooks.pop, key, None) for hooks, key, _ in entries)
        else:
            for handle in self.handles:
                handle.remove()
            self.handles = []
        self.on = on


_DYNAMO_CONFIG = "torch._dynamo.config"
_SKIP_HOOK_GUARDS = "skip_nnmodule_hook_guards"


class HookGuards:
    """Dynamo's guards on empty module hooks, on while a Watch that asked is open (one per Watch).

    A graph dynamo compiled for a module with no hooks is reused for another instance of its class that
    has hooks unless dynamo checks them (``skip_nnmodule_hook_guards=False``): streamwatch's hooks would
    then never run in the observed model's compiled forward (``tests/test_observe_compile.py``). The
    check costs a length test per hook dictionary of a compiled module at each call of its graph.

    Example:
        >>> guards = HookGuards()
        >>> guards.hold()  # (nothing while dynamo is not loaded: it is never imported here)
        >>> guards.release()
    """

    _holders = 0
    _turned = False  # streamwatch turned the check on (and turns it off when the last holder goes)

    def __init__(self) -> None:
        self.held = False

    def hold(self) -> None:
        """Turn the check on for this Watch, if dynamo is loaded (else nothing: :meth:`hold` again later)."""
        config = sys.modules.get(_DYNAMO_CONFIG)
        if self.held or config is None or not hasattr(config, _SKIP_HOOK_GUARDS):
            return
        self.held = True
        HookGuards._holders += 1
        if getattr(config, _SKIP_HOOK_GUARDS):
            setattr(config, _SKIP_HOOK_GUARDS, False)
            HookGuards._turned = True

    def release(self) -> None:
        """This Watch closes: the setting goes back when no other Watch holds it."""
        if not self.held:
            return
        self.held = False
        HookGuards._holders -= 1
        config = sys.modules.get(_DYNAMO_CONFIG)
        if not HookGuards._holders and HookGuards._turned and config is not None:
            setattr(config, _SKIP_HOOK_GUARDS, True)
            HookGuards._turned = False


def remove_grad_hook(param: torch.Tensor, handle: Any) -> None:
    """Remove a post-accumulate-grad hook, and the parameter's hook table with it when that leaves it
    empty: torch's backward calls into a parameter's table whenever it has one, empty or not.

    Example:
        >>> p = torch.nn.Parameter(torch.ones(1))
        >>> remove_grad_hook(p, p.register_post_accumulate_grad_hook(lambda p: None))
        >>> p._post_accumulate_grad_hooks is None
        True
    """
    handle.remove()
    if not getattr(param, "_post_accumulate_grad_hooks", None):
        try:
            param._post_accumulate_grad_hooks = None  # type: ignore[assignment]
        except (AttributeError, RuntimeError):  # (a torch that keeps it elsewhere: an empty table stays)
            pass
