"""Taps: every torch hook streamwatch installs lives here, and nowhere else.

A tap captures one kind of tensor and hands it to :func:`streamwatch._summary.summarize`, appending the
row to the current :class:`~streamwatch._buffer.StepBuffer`. Kinds:

==============  ===============================================  ==========================================
kind            where                                            hook
==============  ===============================================  ==========================================
``input``       a module's tensor inputs (positional and keyword)  ``register_forward_pre_hook``
``activation``  a module's output (each tensor leaf)             ``register_forward_hook``
``output_grad`` gradient w.r.t. the output                       ``Tensor.register_hook`` on the output
``input_grad``  gradient w.r.t. the inputs                       ``Tensor.register_hook`` on the inputs
``param_grad``  each parameter's gradient, as the optimizer       optimizer step pre-hook, all at once (the
                applies it                                       boundary; without an optimizer,
                                                                 ``register_post_accumulate_grad_hook``)
``param``       each parameter (weights, biases separately)      optimizer step post-hook (or the boundary)
``update``      Δ = w_after − w_before across ``optimizer.step``  optimizer step pre- and post-hooks
==============  ===============================================  ==========================================

Under ``torch.compile`` every tap traces into the graph without a break, except gradients w.r.t.
outputs and inputs: a ``Tensor.register_hook`` inside a compiled forward always breaks the graph, so
those two taps are skipped there and counted (``skipped["compiled_grad_hook"]``); parameter gradients
(read at the optimizer's pre-step, or post-accumulate hooks) are unaffected.

Hooks never raise into the training step: an exception inside one is caught, counted and kept for
``Watch.close()``. The per-module and per-parameter hooks are *armed* only for the steps that sample
their kinds (:meth:`TapSet.arm`, at each step boundary), and so are the root module's forward hook and
the optimizer's pre/post hooks (they time the step's parts, take weights and updates): an unsampled step
runs the model without any hook: only the root module's calls are seen, through its call slot (one
Python call; :meth:`TapSet._root_in`, a forward pre-hook where the slot is taken). Forward passes under
``eval()`` or ``torch.no_grad()`` arm the module hooks for that pass as the root module is called and
are summarised under ``phase="eval"`` on every step they happen, so evaluation loops are never lost and
never mix into training series. Once a hook runs inside ``torch.compile`` every hook stays armed (no
recompilation per sampled step).

Activation checkpointing (``torch.utils.checkpoint``, either ``use_reentrant`` mode) runs a block's
forward twice; it is one training forward, summarised once, exactly as without checkpointing. The
recomputation is recognised as a forward running inside a backward pass (its values are not summarised
again); the first forward of a re-entrant checkpoint, which torch runs under ``no_grad``, is recognised
by ``CheckpointFunction.forward`` on the stack (a training forward, not an evaluation), and its gradients
are hooked in the recomputation, where backward flows.

Installing is all or nothing: if torch refuses a registration half-way, every hook already installed is
removed before the error propagates. TorchScript modules are refused up front (:func:`check_hookable`).
"""

from __future__ import annotations

import collections
import fnmatch
import functools
import itertools
import operator
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from types import FrameType
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.hooks import RemovableHandle

from streamwatch._buffer import StepBuffer
from streamwatch._kernel import FusedKernel
from streamwatch._record import SeriesKey
from streamwatch._summary import saturation_bounds, summarize, unit_dim_for

__all__ = ["DEFAULT_CADENCE", "DEFAULT_TAPS", "KINDS", "Select", "TapSet", "resolve_select"]

KINDS = ("input", "activation", "output_grad", "input_grad", "param", "param_grad", "update")
DEFAULT_TAPS = ("activation", "output_grad", "param", "param_grad", "update")
DEFAULT_CADENCE: Mapping[str, int] = {
    "input": 1,
    "activation": 1,
    "output_grad": 1,
    "input_grad": 1,
    "param_grad": 1,
    # Weights and updates change slowly, and each pass over them reads every parameter byte (an update
    # needs a copy of the weights too): sample them 10x coarser than activations and gradients.
    "param": 10,
    "update": 10,
}

# Modules whose activations lay units (channels) out in dim 1: [batch, channels, *spatial].
_CHANNEL_FIRST = (
    nn.modules.conv._ConvNd,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.GroupNorm,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
)


@dataclass(frozen=True, slots=True)
class Select:
    """Which modules to tap; every criterion given must hold (AND), none given means all leaf modules.

    Attributes:
        types: module classes (``isinstance``).
        names: ``fnmatch`` globs on the qualified name (``"encoder.*.fc"``).
        depth: only modules at this depth (``0`` is the model itself, ``1`` its children, ...).
        indices: positions in ``model.named_modules()`` order (torchfunc's ``indices``).
        leaves: only modules without children (default when no other criterion is given).

    A single class, glob or index is read as a one-element tuple (``Select(names="fc")`` is
    ``Select(names=("fc",))``); anything else that is not a criterion is refused with a ``TypeError``.

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> [name for name, _ in Select(types=(nn.Linear,)).modules(model)]
        ['0', '2']
        >>> [name for name, _ in Select(names=("1",)).modules(model)]
        ['1']
    """

    types: tuple[type[nn.Module], ...] = ()
    names: tuple[str, ...] = ()
    depth: int | None = None
    indices: tuple[int, ...] = ()
    leaves: bool | None = None

    def __post_init__(self) -> None:
        types = _as_tuple(self.types, "types", lambda t: isinstance(t, type) and issubclass(t, nn.Module))
        names = _as_tuple(self.names, "names", lambda n: isinstance(n, str))
        indices = _as_tuple(self.indices, "indices", _is_index)
        if self.depth is not None and not _is_index(self.depth):
            raise TypeError(f"Expected `Select.depth` to be an integer >= 0 or None, got {self.depth!r}")
        if self.leaves is not None and not isinstance(self.leaves, bool):
            raise TypeError(f"Expected `Select.leaves` to be True, False or None, got {self.leaves!r}")
        object.__setattr__(self, "types", types)
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "indices", indices)

    def modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The selected ``(name, module)`` pairs, in ``named_modules()`` order."""
        leaves = self.leaves
        if leaves is None:
            leaves = not (self.types or self.names or self.depth is not None or self.indices)
        picked = []
        for index, (name, module) in enumerate(model.named_modules()):
            if leaves and next(module.children(), None) is not None:
                continue
            if self.types and not isinstance(module, self.types):
                continue
            if self.names and not any(fnmatch.fnmatchcase(name, pattern) for pattern in self.names):
                continue
            if self.depth is not None and (name.count(".") + 1 if name else 0) != self.depth:
                continue
            if self.indices and index not in self.indices:
                continue
            picked.append((name, module))
        return picked


_CRITERIA = {
    "types": "module classes",
    "names": "name globs (str)",
    "indices": "integers >= 0 (positions in model.named_modules())",
}


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _as_tuple(value: object, field_name: str, ok: Callable[[object], bool]) -> tuple[Any, ...]:
    """One criterion of :class:`Select` as a tuple: a single item is a one-element tuple."""
    items = tuple(value) if isinstance(value, tuple | list) else (value,)
    bad = [item for item in items if not ok(item)]
    if bad:
        raise TypeError(
            f"Expected `Select.{field_name}` to be a tuple of {_CRITERIA[field_name]}, got {value!r}"
        )
    return items


def describe_modules(model: nn.Module, limit: int = 8) -> str:
    """A few of ``model``'s qualified module names, for error messages."""
    names = [name for name, _ in model.named_modules()]
    shown = ", ".join(repr(name) for name in names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def check_hookable(model: nn.Module, modules: list[tuple[str, nn.Module]]) -> None:
    """Refuse TorchScript modules before any hook is installed: they run without Python hooks, so
    streamwatch would observe nothing (and torch refuses the registration half-way)."""
    script = torch.jit.ScriptModule
    if isinstance(model, script):
        raise TypeError(
            f"Expected `model` to be an eager torch.nn.Module, got a TorchScript module "
            f"({type(model).__name__}, from torch.jit.script or torch.jit.trace): TorchScript runs without "
            "Python hooks, so nothing could be observed. Observe the eager model (torch.compile works)."
        )
    scripted = [name for name, module in model.named_modules() if isinstance(module, script)]
    for name, module in modules:
        if isinstance(module, script):
            outer = next(s for s in scripted if name == s or name.startswith(f"{s}."))  # pre-order: outermost
            raise TypeError(
                f"Layer {outer!r} of `model` is a TorchScript module ({type(module).__name__}): TorchScript "
                "runs without Python hooks, so it cannot be observed. Keep it eager, or leave it out with "
                "`select=` (e.g. streamwatch.Select(names=...))."
            )


def resolve_select(select: object) -> Select:
    """Turn the ``select=`` shorthands into a :class:`Select`.

    Accepts ``None`` (leaf modules), a :class:`Select`, a glob ``str``, a module class, a tuple of
    classes, or a sequence of globs.
    """
    if select is None:
        return Select()
    if isinstance(select, Select):
        return select
    if isinstance(select, str):
        return Select(names=(select,))
    if isinstance(select, type) and issubclass(select, nn.Module):
        return Select(types=(select,))
    if (
        isinstance(select, tuple)
        and select
        and all(isinstance(t, type) and issubclass(t, nn.Module) for t in select)
    ):
        return Select(types=select)
    if isinstance(select, Sequence) and select and all(isinstance(s, str) for s in select):
        return Select(names=tuple(select))
    raise TypeError(
        "Expected `select` to be None, a streamwatch.Select, a name glob, a module class or a tuple of "
        f"classes, got {select!r}"
    )


@dataclass(slots=True)
class StepTimes:
    """Host wall-clock boundaries of the current training step (``perf_counter`` seconds; 0: not seen).

    Set by the root module's forward hooks and the optimizer's step hooks, read at ``watch.step()``,
    which hands them with the step's end to the worker: reading the clock never waits for the device.
    On CUDA the host runs ahead of the device, so a part is when the host got through it — a rank that
    waits (the gradient all-reduce, a data loader) shows it. The worker turns them into the step's
    parts (:func:`~streamwatch._record.step_parts`).

    Example:
        >>> t = StepTimes(step_end=1.0, forward_start=1.5, forward_end=2.0)
        >>> t.optimizer_start, t.optimizer_end = 3.0, 3.25
        >>> from streamwatch._record import step_parts
        >>> marks = (t.step_end, t.forward_start, t.forward_end, t.optimizer_start, t.optimizer_end, 3.5)
        >>> step_parts(marks, {})
        {'part/data_wait': 0.5, 'part/forward': 0.5, 'part/backward': 1.0, 'part/optimizer': 0.25}
    """

    step_end: float = 0.0
    forward_start: float = 0.0
    forward_end: float = 0.0
    optimizer_start: float = 0.0
    optimizer_end: float = 0.0

    clock = staticmethod(perf_counter)
    """The clock every boundary is read from: ``time.perf_counter`` itself (a C call; tests may fake
    it)."""


@dataclass(slots=True)
class TapState:
    """What hooks read on every call; written by the Watch at each step boundary (one thread)."""

    on: dict[str, bool] = field(default_factory=dict)  # this step samples this kind
    forward: bool = False  # any forward-side kind is sampled this step
    taps: frozenset[str] = frozenset()
    buffer: StepBuffer = field(default_factory=StepBuffer)
    channel_last: bool | None = None  # the user's override; None: per module, and 4-D/5-D tensors are NCHW
    dead_units: bool = True
    count_nonfinite: bool = False
    kernel: FusedKernel | None = None  # the fused CPU kernel, if it could be built
    skipped: dict[str, int] = field(default_factory=dict)
    errors: list[BaseException] = field(default_factory=list)
    hook_errors: int = 0
    paused: bool = False  # an opt-in metric runs the model itself (probe batch, Hessian): no taps
    # the root module's last call was a training forward (train mode, gradients on): a submodule in eval
    # mode inside it (a frozen BatchNorm) is part of the training step, not an evaluation pass
    root_training: bool = False
    compiled: bool = False  # a hook ran inside torch.compile: hooks stay installed (TapSet.static)
    timed: bool = True  # the step samples something: its parts are timed, the optimizer hooks are in
    busy: float = 0.0  # seconds spent inside streamwatch's hooks since the last step boundary
    times: StepTimes = field(default_factory=StepTimes)
    # this step's opt-in metrics: tensor metrics by the kind they read, and parameter-level ones
    kind_metrics: dict[str, list[Callable[[StepBuffer, SeriesKey, torch.Tensor], None]]] = field(
        default_factory=dict
    )
    step_metrics: tuple[Any, ...] = ()
    # how many coming step ends may take the Watch's quiet path; anything that records (an evaluation
    # pass arming its hooks) or fails on the training thread sets it to 0
    quiet: int = 0

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def fail(self, exc: BaseException) -> None:
        """Count (and keep the first few of) an exception caught on the training thread."""
        self.hook_errors += 1
        self.quiet = 0  # the next boundary surfaces it
        if len(self.errors) < 16:
            self.errors.append(exc)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)``, an exception counted and kept, never raised (one metric cannot stop another)."""
        try:
            fn(*args)
        except Exception as exc:
            self.fail(exc)


def _leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(name, leaf) for every leaf of a tensor / tuple / list / dict output ("" for a bare tensor)."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, tuple | list):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{prefix}.{i}" if prefix else str(i))
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _leaves(item, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, value


def _local(x: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP2's sharded parameters, gradients and updates; tensor
    parallel): a view, no collective. Its sums of squares and counts add up across ranks to the whole
    tensor's (docs/scale.md). Any other tensor as it is."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # loaded by whatever made a DTensor
    if dtensor is not None and isinstance(x, dtensor.DTensor):
        return x.to_local()  # type: ignore[no-any-return]
    return x


def _prepare(x: torch.Tensor, state: TapState) -> torch.Tensor | None:
    """A dense real floating view of ``x`` to summarise, or None (skipped and counted)."""
    x = _local(x)
    if x.is_nested:  # (strided or jagged: no single shape to take units or a flat pass from)
        state.skip("nested")
        return None
    if x.is_sparse or x.layout != torch.strided:
        state.skip("sparse")
        return None
    if x.is_complex():
        state.skip("complex")
        return None
    if x.is_quantized or x.device.type == "meta":
        state.skip("unsupported_tensor")
        return None
    if x.numel() == 0:
        state.skip("empty")
        return None
    x = x.detach()
    if not x.is_floating_point():
        x = x.to(torch.float32)  # bool masks, integer ids: summarised as numbers
    return x


def summarize_into(
    state: TapState,
    key: SeriesKey,
    x: torch.Tensor,
    channel_last: bool | None,
    replace: bool = False,
    bounds: tuple[float, float] | None = None,
) -> None:
    """Summarise ``x`` into the current step buffer under ``key`` (skips odd tensors, counted).

    ``channel_last`` says where units are for per-unit activity (None: none taken); ``bounds`` are the
    producing module's saturation bounds (activations only).
    """
    prepared = _prepare(x, state)
    if prepared is None:
        return
    unit_dim = None
    if channel_last is not None and state.dead_units:
        if state.channel_last is None and prepared.dim() >= 4:
            channel_last = False  # NCHW / NCDHW: a ReLU after a Conv2d has channels in dim 1 too
        unit_dim = unit_dim_for(prepared, channel_last)
    kernel = state.kernel
    readable = kernel.readable(prepared) if kernel is not None else None
    if readable is not None and not torch.compiler.is_compiling():
        assert kernel is not None
        prepared = readable  # (a strided view: copied once, contiguous)
        state.buffer.add_host(kernel, key, prepared, unit_dim=unit_dim, bounds=bounds, replace=replace)
    else:
        row = summarize(prepared, unit_dim=unit_dim, count_nonfinite=state.count_nonfinite, bounds=bounds)
        state.buffer.add(key, prepared.numel(), row, replace=replace)
    if state.kind_metrics:  # opt-in tensor metrics (histograms, p-norms) on this step's tensors
        for metric in state.kind_metrics.get(key.kind, ()):
            state.call(metric, state.buffer, key, prepared)


_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)  # -1 outside a backward pass
_CHECKPOINT_FUNCTION = getattr(torch.utils.checkpoint, "CheckpointFunction", None)
_CHECKPOINT_FORWARD = getattr(getattr(_CHECKPOINT_FUNCTION, "forward", None), "__code__", None)
_CHECKPOINT_BACKWARD = getattr(getattr(_CHECKPOINT_FUNCTION, "backward", None), "__code__", None)


def _recomputing() -> bool:
    """Whether a forward runs inside a backward pass: activation checkpointing recomputing it
    (``torch.utils.checkpoint``, either mode). Never inside a compiled graph (the call would break the
    graph; compiled checkpointing recomputes in its own graph, without module hooks)."""
    if torch.compiler.is_compiling() or _GRAPH_TASK_ID is None:
        return False
    return bool(_GRAPH_TASK_ID() != -1)


def _in_checkpoint(code: Any) -> bool:
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


def _steps_forward(module: nn.Module) -> bool:
    """Whether the root module's forward is the training step's own (its wall-clock bounds): not
    compiled (no clock inside a graph), not an evaluation pass, not a checkpoint's recomputation."""
    if torch.compiler.is_compiling() or not (module.training and torch.is_grad_enabled()):
        return False
    return not _recomputing()


def _call_slot_free(model: nn.Module) -> bool:
    """Whether the root module's calls can be seen through its call slot (:meth:`TapSet._root_in`): its
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
forward pre-hook (whose copies are inert, :class:`_Hook`), not through its call slot."""


def _inert(*args: Any, **kwargs: Any) -> None:
    """What a copy of an observed model holds in place of a streamwatch hook: nothing happens."""


def _make_inert() -> Callable[..., None]:
    return _inert


def _has_closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an optimizer step hook's call passes a closure: ``step(closure)`` or ``step(closure=...)``
    (torch hands the hooks the step's arguments with the optimizer itself first)."""
    return (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None


class _NoHook:
    """The handle of a hook not installed (:func:`_grad_hook_on` on a frozen parameter)."""

    __slots__ = ()

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()

_GROUPS = ("forward", "param_grad", "step")
"""The hook groups :meth:`TapSet.arm` installs and removes, in the order of its flags."""


_CALL = operator.methodcaller("__call__")


def _consume(calls: Iterator[Any]) -> None:
    """Run an iterator to its end in C (the ``consume`` recipe of itertools' documentation)."""
    collections.deque(calls, maxlen=0)


def _entries_of(handles: list[Any]) -> list[tuple[dict[int, Any], int, Any]] | None:
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


class _HookGroup:
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
        >>> group = _HookGroup([functools.partial(m.register_forward_hook, lambda *a: None)], switched=True)
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
            entries = _entries_of(handles) if self.switched else None
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


def _grad_hook_on(param: nn.Parameter, hook: Callable[[nn.Parameter], None]) -> Any:
    """Install ``hook`` after ``param``'s gradient is accumulated, if it requires one (torch refuses a
    hook on a tensor that does not: a parameter frozen mid-run is passed over until it is unfrozen)."""
    if not param.requires_grad:
        return _NO_HOOK
    return param.register_post_accumulate_grad_hook(hook)


class _Hook:
    """A hook streamwatch installs. ``copy.deepcopy`` of the model (an EMA or a teacher copy) and
    pickling it whole (``torch.save(model)``) copy a module's hooks: they get :func:`_inert` instead, so
    the copy carries nothing of the Watch (its calls are not summarised into it, and a hook that holds
    the kernel's C pointers does not make the copy fail).

    Example:
        >>> import copy, pickle
        >>> hook = _Hook(print)
        >>> copy.deepcopy(hook) is _inert, pickle.loads(pickle.dumps(hook)) is _inert
        (True, True)
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return _inert

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return _make_inert, ()


def _guarded(state: TapState, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a hook body so that nothing it raises reaches the training step (counted, kept)."""

    def hook(*args: Any) -> None:
        compiling = torch.compiler.is_compiling()  # a constant to dynamo: no wall clock inside a graph
        start = 0.0 if compiling else perf_counter()
        try:
            fn(*args)
        except Exception as exc:
            state.fail(exc)
        if not compiling:
            state.busy += perf_counter() - start  # streamwatch's own time on the training thread

    return _Hook(hook)


class TapSet:
    """Installs and removes every hook for one Watch."""

    def __init__(
        self,
        model: nn.Module,
        modules: list[tuple[str, nn.Module]],
        params: list[tuple[str, str, nn.Parameter]],
        optimizer: torch.optim.Optimizer | None,
        state: TapState,
    ) -> None:
        self.state = state
        self.params = params
        # The root module's calls are seen for the Watch's life (:meth:`_root_in`): through its call slot
        # (``_entry``) or, where the slot is taken, a forward pre-hook (``_root_handle``).
        self._entry: Callable[..., Any] | None = None
        self._root_handle: RemovableHandle | None = None
        # Hooks installed only while a step (or an evaluation pass) needs them, by group: "forward" (the
        # selected modules' forward and pre-forward hooks) and "param_grad" (post-accumulate hooks). An
        # unsampled step then runs the model with none of them: no Python call per module or parameter.
        # "step": the root module's forward (post-)hook and the optimizer's pre/post hooks, which time the
        # step's parts and take weights and updates: in only for steps that sample something.
        self._registrations: dict[str, list[Callable[[], RemovableHandle]]] = {
            "forward": [],
            "param_grad": [],
            "step": [],
        }
        # (post-accumulate hooks are registered each time: torch refuses one on a frozen parameter)
        self._groups = {
            group: _HookGroup(self._registrations[group], group != "param_grad") for group in _GROUPS
        }
        self._armed_now = (False, False, False)  # whether each of _GROUPS has its hooks in
        self._has_group = (False, False, False)  # whether each of _GROUPS has registrations
        self._eval_armed = False  # the forward hooks are in for an evaluation pass only
        # Gradient hooks on leaf tensors (a parameter a module returns as is, an input made with
        # requires_grad): such a tensor outlives the step and keeps its hooks, so they are held here,
        # one per tensor and key, and removed at the next step boundary (arm) and at remove().
        self._leaf_hooks: dict[tuple[int, SeriesKey], tuple[weakref.ref[torch.Tensor], RemovableHandle]] = {}
        # Under torch.compile, installing and removing hooks would change what dynamo guards on and
        # recompile the graph: once a hook runs while compiling, every hook stays in for good.
        self.static = False
        self._before: list[torch.Tensor] | None = None
        # a GradScaler's found_inf at a fused step whose updates were summarised: for the step's record
        self.found_inf: torch.Tensor | None = None
        self.has_optimizer = optimizer is not None
        self._grads: list[tuple[SeriesKey, nn.Parameter]] = []  # the param_grad tap's keys and parameters
        self._grad_flags: list[bool] = []  # their requires_grad when their hooks went in (no optimizer)
        # With an optimizer: the parameters it steps (read at its hooks) and the others (at the step's
        # end), by its param groups as they were last seen (:meth:`_split`)
        self._split_signature: tuple[tuple[int, int], ...] | None = None
        self._owned_params: list[tuple[str, str, nn.Parameter]] = []
        self._other_params: list[tuple[str, str, nn.Parameter]] = []
        self._owned_grads: list[tuple[SeriesKey, nn.Parameter]] = []
        self._other_grads: list[tuple[SeriesKey, nn.Parameter]] = []
        self._before_params: list[tuple[str, str, nn.Parameter]] = []
        self._grads_after: list[tuple[SeriesKey, nn.Parameter]] | None = None
        self._closure = False  # the optimizer step under way was given a closure
        self.params_taken = False
        self.grads_taken = False  # this step's gradients are summarised (at the optimizer's pre-step)
        try:
            self._install(model, modules, params, optimizer)
        except BaseException:
            self.remove()  # all or nothing: a registration that failed half-way leaves no hook behind
            raise

    def _install(
        self,
        model: nn.Module,
        modules: list[tuple[str, nn.Module]],
        params: list[tuple[str, str, nn.Parameter]],
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        state = self.state
        taps = state.taps
        for name, module in modules:
            channel_last = state.channel_last
            if channel_last is None:
                channel_last = not isinstance(module, _CHANNEL_FIRST)
                # (4-D/5-D tensors are channels-first whatever module made them: see summarize_into)
            forward = self._registrations["forward"]
            if taps & {"activation", "output_grad"}:
                hook = self._forward_hook(name, channel_last, saturation_bounds(module))
                forward.append(functools.partial(module.register_forward_hook, hook))
            if taps & {"input", "input_grad"}:
                hook = self._forward_pre_hook(name)
                forward.append(functools.partial(module.register_forward_pre_hook, hook, with_kwargs=True))
        # The root module's calls are seen for the Watch's life: evaluation passes coming (their hooks go
        # in for the pass), a sampled step's forward starting (its clock). Its forward hook ends that
        # clock: with the optimizer's hooks, only on steps that sample something.
        self._model = weakref.ref(model)  # (for go_light; the Watch releases the model at close)
        self._root_in(model)
        step = self._registrations["step"]
        step.append(functools.partial(model.register_forward_hook, _Hook(self._root_forward_end)))
        if "param_grad" in taps:
            self._grads = [(SeriesKey("train", layer, "param_grad", pname), p) for layer, pname, p in params]
            if optimizer is None:  # with an optimizer: all of them at its pre-step hook, in one call
                for key, param in self._grads:  # (a frozen one gets its hook when it is unfrozen)
                    self._registrations["param_grad"].append(
                        functools.partial(_grad_hook_on, param, self._param_grad_hook(key))
                    )
        if optimizer is not None:
            before = _guarded(state, self._before_optimizer_step)
            after = _guarded(state, self._after_optimizer_step)
            step.append(functools.partial(optimizer.register_step_pre_hook, before))
            step.append(functools.partial(optimizer.register_step_post_hook, after))
        self._has_group = tuple(bool(self._registrations[group]) for group in _GROUPS)  # type: ignore[assignment]
        for group in self._registrations:  # every hook once: torch refuses now, not on a later step
            self._set_group(group, True)

    # -- arming -----------------------------------------------------------------------------------------

    def _root_in(self, model: nn.Module) -> None:
        """See the root module's calls: through torch's per-instance call slot where the model leaves it
        free (:func:`_call_slot_free`), else with a forward pre-hook. The slot costs the step a Python
        call; a pre-hook, torch's dispatch of a module with a hook (~6 µs on a CPU, docs/performance.md).
        The slot is the attribute ``Module.compile()`` sets, ``_compiled_call_impl``: ``__call__`` calls
        it instead of ``_call_impl``, and pickling, ``copy`` and ``deepcopy`` leave it out (a copy of an
        observed model is not observed). If something takes the slot later (``model.compile()``), the
        next step boundary sees it and a pre-hook takes over (:meth:`arm`)."""
        if not _call_slot_free(model):
            self._root_handle = model.register_forward_pre_hook(_Hook(self._root_forward_start))
            return
        start = self._root_forward_start
        call: Callable[..., Any] = (
            model._call_impl
        )  # (what __call__ runs with the slot empty: every hook of the root's own)
        state = self.state

        def entry(*args: Any, **kwargs: Any) -> Any:
            try:
                start(model, args)
            except Exception as exc:  # never into the user's forward
                state.fail(exc)
            return call(*args, **kwargs)

        model.__dict__["_compiled_call_impl"] = entry  # (a cycle through the model's own dict, until out)
        self._entry = entry

    def _root_out(self) -> None:
        """Stop seeing the root module's calls (the slot emptied only if it still holds ours)."""
        entry, self._entry = self._entry, None
        model = self._model()
        if entry is not None and model is not None and model.__dict__.get("_compiled_call_impl") is entry:
            del model.__dict__["_compiled_call_impl"]
        handle, self._root_handle = self._root_handle, None
        if handle is not None:
            handle.remove()

    def go_dark(self) -> bool:
        """Stop seeing the root module's calls for a dark pair (the governor's measurement of what no
        own time shows: cold caches, torch's dispatch of a module with a hook where the slot was taken,
        among others); False if they are not seen (under torch.compile everything stays)."""
        if (self._entry is None and self._root_handle is None) or self.static or self.state.compiled:
            return False
        self._root_out()
        return True

    def go_light(self) -> None:
        """See the root module's calls again after a dark pair."""
        model = self._model()
        if self._entry is None and self._root_handle is None and model is not None:
            self._root_in(model)

    def _set_group(self, group: str, on: bool) -> None:
        hooks = self._groups[group]
        if on and not hooks.on and group == "param_grad":
            # which parameters get a hook: those that require a gradient now
            self._grad_flags = [param.requires_grad for _, param in self._grads]
        hooks.set(on)
        groups = self._groups
        self._armed_now = (groups["forward"].on, groups["param_grad"].on, groups["step"].on)

    def arm(self) -> None:
        """Install or remove the per-module and per-parameter hooks for the step that begins: only the
        groups the step samples (every group while ``static``). Called at each step boundary."""
        state = self.state
        entry = self._entry
        if entry is not None:
            model = self._model()
            if model is not None and model.__dict__.get("_compiled_call_impl") is not entry:
                # The slot was taken: by Module.compile(), the one thing in torch that sets it. A pre-hook
                # sees the calls from now on, and every hook stays in, as under torch.compile.
                self._entry = None
                self._root_handle = model.register_forward_pre_hook(_Hook(self._root_forward_start))
                state.compiled = True
        static = self.static or state.compiled
        self.static = static
        self._eval_armed = False
        if self._leaf_hooks:
            self._release_leaves()
        self.grads_taken = self.params_taken = False
        self._grads_after = None
        has = self._has_group  # (a group without registrations stays empty: with an optimizer,
        wanted = (  # param_grad's, whose gradients are read at its pre-step hook)
            has[0] and (static or state.forward),
            has[1] and (static or state.on.get("param_grad", False)),
            has[2] and (static or state.timed),
        )
        if wanted != self._armed_now:  # (groups already as wanted are left alone: the every-step case)
            for group, on, now in zip(_GROUPS, wanted, self._armed_now, strict=True):
                if on != now:
                    self._set_group(group, on)
        elif wanted[1] and self._grad_flags != [param.requires_grad for _, param in self._grads]:
            # a parameter frozen or unfrozen since its hooks went in (a fine-tuning schedule): an
            # unfrozen one gets its hook now (a frozen one keeps its own: it fires if it is unfrozen)
            handles = self._groups["param_grad"].handles
            registrations = self._registrations["param_grad"]
            for i, (_, param) in enumerate(self._grads):
                if handles[i] is _NO_HOOK and param.requires_grad:
                    handles[i] = registrations[i]()
            self._grad_flags = [param.requires_grad for _, param in self._grads]

    @property
    def pending(self) -> bool:
        """Whether :meth:`arm` has something to do after an unsampled step for another one: an evaluation
        pass left its hooks in, or a compiled graph ran a hook (every hook goes in for good)."""
        return self._eval_armed or (self.state.compiled and not self.static)

    # -- forward side ---------------------------------------------------------------------------------

    def _tap(
        self,
        name: str,
        value_kind: str,
        grad_kind: str,
        channel_last: bool | None,
        bounds: tuple[float, float] | None,
    ) -> Callable[[nn.Module, Iterable[tuple[str, Any]]], None]:
        """The shared body of the forward-side hooks: for each tensor leaf, summarise its value
        (``value_kind``) and hook its gradient (``grad_kind``)."""
        state = self.state

        def tap(module: nn.Module, leaves: Iterable[tuple[str, Any]]) -> None:
            if state.paused:
                return
            grad = torch.is_grad_enabled()
            train = (module.training or (grad and state.root_training)) and (
                grad or _in_checkpoint(_CHECKPOINT_FORWARD)
            )
            if train and not state.forward:
                return
            # Activation checkpointing (torch.utils.checkpoint) runs a training forward twice: the values
            # are summarised once, in the first forward (a re-entrant one runs it under no_grad, so its
            # gradients are hooked in the recomputation, where backward flows; a non-reentrant one keeps
            # the first forward's graph, so nothing of the recomputation is hooked).
            again = train and _recomputing()
            hook_grads = train and grad and (not again or _in_checkpoint(_CHECKPOINT_BACKWARD))
            phase = "train" if train else "eval"
            on = state.on
            for leaf_name, leaf in leaves:
                if not isinstance(leaf, torch.Tensor):
                    state.skip("non_tensor")
                    continue
                if not again and ((not train and value_kind in state.taps) or (train and on[value_kind])):
                    key = SeriesKey(phase, name, value_kind, leaf_name)
                    summarize_into(state, key, leaf, channel_last, bounds=bounds)
                if hook_grads and on[grad_kind] and leaf.requires_grad:
                    if torch.compiler.is_compiling():
                        # A tensor hook registered inside a compiled forward breaks the graph; keep the
                        # graph whole and say what is missing instead.
                        state.skip("compiled_grad_hook")
                        continue
                    key = SeriesKey("train", name, grad_kind, leaf_name)
                    if leaf.grad_fn is None:  # a leaf: its hook would outlive the step (see __init__)
                        self._hook_leaf(leaf, key, channel_last)
                    else:  # (the hook goes with the tensor, freed with its graph)
                        leaf.register_hook(self._grad_hook(key, channel_last))

        return tap

    def _forward_hook(
        self, name: str, channel_last: bool, bounds: tuple[float, float] | None
    ) -> Callable[..., Any]:
        tap = self._tap(name, "activation", "output_grad", channel_last, bounds)

        def body(module: nn.Module, args: Any, output: Any) -> None:
            tap(module, _leaves(output))

        return _guarded(self.state, body)

    def _forward_pre_hook(self, name: str) -> Callable[..., Any]:
        tap = self._tap(name, "input", "input_grad", None, None)  # inputs: no per-unit activity

        def body(module: nn.Module, args: Any, kwargs: Any) -> None:
            # positional leaves are named by position ("0", "1.0"), keyword ones by name ("mask")
            tap(module, itertools.chain(_leaves(args), _leaves(kwargs)))

        return _guarded(self.state, body)

    def _hook_leaf(self, leaf: torch.Tensor, key: SeriesKey, channel_last: bool | None) -> None:
        """Hook a leaf tensor's gradient once per step and key: its gradient sums every use in the step,
        and reaches its hooks once per backward (a second hook would count it twice)."""
        held = self._leaf_hooks.get((id(leaf), key))
        if held is not None:
            if held[0]() is leaf:
                return
            held[1].remove()  # (another tensor at a freed one's address)
        handle = leaf.register_hook(self._grad_hook(key, channel_last))
        self._leaf_hooks[(id(leaf), key)] = (weakref.ref(leaf), handle)

    def _release_leaves(self) -> None:
        """Remove the leaf tensors' gradient hooks (at a step boundary: their backward is over)."""
        if self._leaf_hooks:
            for _, handle in self._leaf_hooks.values():
                handle.remove()
            self._leaf_hooks.clear()

    def _grad_hook(self, key: SeriesKey, channel_last: bool | None) -> Callable[[torch.Tensor], None]:
        state = self.state

        def body(grad: torch.Tensor) -> None:
            summarize_into(state, key, grad, channel_last)

        return _guarded(state, body)

    # -- parameters -------------------------------------------------------------------------------------

    def _param_grad_hook(self, key: SeriesKey) -> Callable[[nn.Parameter], None]:
        state = self.state

        def body(param: nn.Parameter) -> None:
            if state.on.get("param_grad") and param.grad is not None:
                # Gradient accumulation fires this once per micro-step: the last (full) gradient wins.
                summarize_into(state, key, param.grad, None, replace=True)

        return _guarded(state, body)

    def summarize_grads(
        self, grads: list[tuple[SeriesKey, nn.Parameter]] | None = None, scale: torch.Tensor | None = None
    ) -> None:
        """Every parameter's gradient (or ``grads``'; divided by ``scale`` where a ``GradScaler`` left
        them scaled for a fused optimizer) as the optimizer is about to apply it (accumulated, unscaled by a
        ``GradScaler``, clipped if the loop clips, averaged by DDP), in one pass: at the optimizer's
        pre-step hook, or at ``watch.step()`` on a sampled step whose optimizer step did not run (a
        ``GradScaler`` skipping a step with infs). Each row is placed in the step's execution order where
        autograd produced that gradient: parameters in reverse order, each right after the gradient
        w.r.t. its own module's output (:func:`place_in_backward`). One failing tensor stops only itself."""
        state = self.state
        self.grads_taken = True
        buffer = state.buffer
        start = len(buffer.keys)
        present: list[tuple[SeriesKey, torch.Tensor]] = []
        for key, param in reversed(self._grads if grads is None else grads):
            grad = param.grad
            if grad is not None:
                present.append((key, grad))
        if scale is not None and present:  # still scaled: a fused optimizer unscales inside its kernel
            with torch.no_grad():
                tensors = [grad.detach() for _, grad in present]
                unscaled: list[torch.Tensor] = (
                    list(torch._foreach_div(tensors, scale))
                    if all(t.device == scale.device for t in tensors)
                    else [t / scale.to(t.device) for t in tensors]
                )
            present = [(key, grad) for (key, _), grad in zip(present, unscaled, strict=True)]
        for key, grad in present:
            state.call(summarize_into, state, key, grad, None, True)
        place_in_backward(buffer, start)

    def summarize_params(self, params: list[tuple[str, str, nn.Parameter]] | None = None) -> None:
        """Weights and biases, each on its own row (``kind="param"``): every parameter's, or ``params``'."""
        self.params_taken = True
        for layer, pname, param in self.params if params is None else params:
            summarize_into(self.state, SeriesKey("train", layer, "param", pname), param, None, replace=True)

    def summarize_rest(self) -> None:
        """At a sampled step's end, with an optimizer: what its hooks did not read. Every gradient and
        weight if they did not run (a ``GradScaler`` skipped the step); else the weights of the
        parameters it does not step (another optimizer's may step after its hooks). Their gradients are
        read at its pre-step hook, as they are then: a loop may zero them before ``watch.step()``."""
        on = self.state.on
        if self.grads_taken and not on.get("param"):
            return  # (the common step: its hooks read everything)
        if on.get("param_grad") and self._grads and not self.grads_taken:
            self.summarize_grads()
        if on.get("param") and self.params:
            if not self.params_taken:
                self.summarize_params()
            elif self._other_params:
                self.summarize_params(self._other_params)

    def _split(
        self, optimizer: Any
    ) -> tuple[list[tuple[str, str, nn.Parameter]], list[tuple[SeriesKey, nn.Parameter]]]:
        """The parameters ``optimizer`` steps (its param groups, as they are now) and their gradient keys;
        sets the others aside for :meth:`summarize_rest`. Cached while the groups keep their lists."""
        groups = optimizer.param_groups
        signature = tuple((id(group["params"]), len(group["params"])) for group in groups)
        if signature != self._split_signature:
            owned = {id(param) for group in groups for param in group["params"]}
            self._owned_params = [t for t in self.params if id(t[2]) in owned]
            self._other_params = [t for t in self.params if id(t[2]) not in owned]
            self._owned_grads = [t for t in self._grads if id(t[1]) in owned]
            self._other_grads = [t for t in self._grads if id(t[1]) not in owned]
            self._split_signature = signature
        return self._owned_params, self._owned_grads

    def _root_forward_start(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            self.state.compiled = True  # every hook stays in from the next step boundary on
            return
        state = self.state
        state.root_training = training = module.training and torch.is_grad_enabled()
        if not training:
            state.quiet = 0  # an evaluation pass records: the step ends at a full boundary
            if not self._armed_now[0] and not state.paused and self._has_group[0]:
                # An evaluation pass is summarised whatever the step samples: its hooks go in for it.
                try:
                    self._set_group("forward", True)
                except Exception as exc:  # never into the user's forward
                    state.fail(exc)
                self._eval_armed = True
        else:
            if (
                self._eval_armed
            ):  # a training forward after an evaluation pass (no root forward hook ended it)
                self._end_eval()
            if (
                state.timed and not _recomputing()
            ):  # (not an unsampled step; not a checkpoint's recomputation)
                times = state.times
                if not times.forward_start:
                    times.forward_start = times.clock()

    def _root_forward_end(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._eval_armed:
            self._end_eval()
            return
        if not _steps_forward(module):
            return
        self.state.times.forward_end = self.state.times.clock()

    def pass_begins(self, module: nn.Module) -> None:
        """A framework's batch begins, whose step function may call submodules and never the root
        (Lightning's ``training_step`` calling ``self.net(x)``): the root's call as seen, so that the pass
        is told train or evaluation (by the root module's mode and grad mode) as if it were called."""
        self._root_forward_start(module, ())

    def pass_ends(self) -> None:
        """The batch :meth:`pass_begins` announced ended: an evaluation pass's hooks come out."""
        if self._eval_armed:
            self._end_eval()

    def _end_eval(self) -> None:
        """An evaluation pass is over: the forward hooks go back to what the step samples."""
        self._eval_armed = False
        try:
            self._set_group("forward", self.static or self.state.forward)
        except Exception as exc:  # never into the user's forward
            self.state.fail(exc)

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        state = self.state
        state.times.optimizer_start = state.times.clock()
        on = state.on
        if on.get("param_grad") or on.get("update") or on.get("param"):
            params, grads = self._split(optimizer)
            if on.get("param_grad") and self._grads:
                if self._other_grads:  # another optimizer's: as they are now (a loop may zero them
                    self.summarize_grads(self._other_grads)  # after the steps, before watch.step())
                if _has_closure(args, kwargs):
                    self._grads_after = grads  # a closure (LBFGS) computes them inside the step
                elif grads:
                    scale = getattr(optimizer, "grad_scale", None)  # (a GradScaler, fused optimizer)
                    self.summarize_grads(grads, scale if isinstance(scale, torch.Tensor) else None)
            if on.get("update") and params:
                # Costs one copy of the parameters, only on steps that sample updates (docs/observe.md).
                # Those without a gradient are not stepped (a frozen layer in the optimizer's groups);
                # with a closure the gradients come inside the step (judged after it, _summarize_updates).
                self._closure = closure = _has_closure(args, kwargs)
                stepped = params if closure else [t for t in params if t[2].grad is not None]
                with torch.no_grad():
                    self._before = [param.detach().clone() for _, _, param in stepped]
                self._before_params = stepped
        for metric in state.step_metrics:
            state.call(metric.before_optimizer_step, state.buffer)

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        state = self.state
        state.times.optimizer_end = state.times.clock()
        for metric in state.step_metrics:
            state.call(metric.after_optimizer_step, state.buffer)
        # The updates first, then the weights they produced: in the step's execution order an update
        # comes before the weight it changed (a bad update is the origin, a bad weight its consequence).
        grads, self._grads_after = self._grads_after, None
        if grads is not None:  # (the last closure's: the gradient the step applied last)
            self.summarize_grads(grads)
        found = getattr(optimizer, "found_inf", None)  # a GradScaler's, for a fused optimizer: a step
        if self._before is not None and isinstance(found, torch.Tensor):  # it skips inside the kernel
            self.found_inf = found.detach().reshape(()).to(torch.float32, copy=True)  # (read by the worker)
        self._summarize_updates()
        if state.on.get("param"):
            self.summarize_params(self._split(optimizer)[0])

    def _summarize_updates(self) -> None:
        state = self.state
        before, self._before = self._before, None
        if before is None:
            return
        # Fused path: Δ's statistics straight from the two copies, never materialised; the rest
        # (CUDA, half precision, subclasses, compiled code) subtracts in one foreach call.
        kernel = None if torch.compiler.is_compiling() else state.kernel
        rest: list[tuple[SeriesKey, torch.Tensor, torch.Tensor]] = []
        for (layer, pname, param), old in zip(self._before_params, before, strict=True):
            if self._closure and param.grad is None:
                continue  # not stepped (copied before a closure computed the gradients)
            key = SeriesKey("train", layer, "update", pname)
            after = param.detach()
            if kernel is not None and after.numel() and kernel.accepts(after) and kernel.accepts(old):
                state.buffer.add_host(kernel, key, after, replace=True, minus=old)
            else:
                rest.append((key, after, old))
        if rest:
            with torch.no_grad():
                deltas = torch._foreach_sub([after for _, after, _ in rest], [old for _, _, old in rest])
            for (key, _, _), delta in zip(rest, deltas, strict=True):
                summarize_into(state, key, delta, None, replace=True)

    def remove(self) -> None:
        """Remove every hook. Idempotent."""
        self._root_out()
        self._release_leaves()
        for group in _GROUPS:
            self._set_group(group, False)
        self._registrations = {group: [] for group in self._registrations}
        self._groups = {group: _HookGroup([], False) for group in _GROUPS}
        self._has_group = (False, False, False)
        self._before = None
        self._before_params = self._owned_params = self._other_params = []
        self._owned_grads = self._other_grads = []
        self.params = []  # a closed Watch must not keep the model's parameters alive
        self._grads = []


def place_in_backward(buffer: StepBuffer, start: int) -> None:
    """Give the rows from ``start`` on (parameter gradients summarised together, in reverse parameter
    order) their places in the step's execution order: each right after the last gradient w.r.t. its
    own module's output (autograd computes a module's parameter gradients from it), a parameter whose
    module has no such row right after the one placed before it, the first such ones before the step's
    first backward row. Without backward rows they stay where they are, after the forward.

    Example:
        >>> buffer = StepBuffer()
        >>> for layer, kind in [("a", "activation"), ("b", "activation"), ("b", "output_grad"),
        ...                     ("a", "output_grad"), ("b", "param_grad"), ("a", "param_grad")]:
        ...     buffer._append(SeriesKey("train", layer, kind, ""), 1, False)
        >>> place_in_backward(buffer, 4)
        >>> [" ".join(buffer.keys[i][1:3]) for i in sorted(range(6), key=buffer.order.__getitem__)]
        ['a activation', 'b activation', 'b output_grad', 'b param_grad', 'a output_grad', 'a param_grad']
    """
    keys, order = buffer.keys, buffer.order
    backward: dict[str, int] = {}  # module -> position of the last gradient w.r.t. its output
    first = None  # position of the step's first backward row
    for key, position in zip(keys[:start], order[:start], strict=True):
        if isinstance(key, SeriesKey) and key.phase == "train" and key.kind.endswith("_grad"):
            if first is None or position < first:
                first = position
            if key.kind == "output_grad" and position > backward.get(key.layer, -1):
                backward[key.layer] = position
    if first is None or len(keys) == start:
        return
    slots: list[tuple[float, int, int]] = [(position, 0, i) for i, position in enumerate(order[:start])]
    anchor: tuple[float, int] = (first, -1)  # before the first backward row
    for i in range(start, len(keys)):
        key = keys[i]
        layer = key.layer if isinstance(key, SeriesKey) else None
        if layer in backward:
            anchor = (backward[layer], 1)
        slots.append((anchor[0], anchor[1], i))
    slots.sort()
    for rank, (_, _, i) in enumerate(slots):
        order[i] = rank


def named_params(
    model: nn.Module, modules: list[tuple[str, nn.Module]], all_params: bool
) -> list[tuple[str, str, nn.Parameter]]:
    """``(layer, name, parameter)`` triples: every parameter of the model (by owner) or the selected ones."""
    if all_params:
        triples = []
        for qualified, param in model.named_parameters():
            layer, _, pname = qualified.rpartition(".")
            triples.append((layer, pname, param))
        return triples
    seen: set[int] = set()
    triples = []
    for layer, module in modules:
        for pname, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                triples.append((layer, pname, param))
    return triples
