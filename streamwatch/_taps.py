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

Under ``torch.compile`` every tap traces into the graph without a break. A ``Tensor.register_hook``
inside a compiled forward always breaks the graph: there a module's output passes through its
:class:`~streamwatch._gradprobe.GradProbe` instead, which hands its gradient's summary out of the
backward graph; inputs' gradients and outputs of several tensors are skipped and counted
(``skipped["compiled_grad_hook"]``: under compile a reason is counted once per step); parameter
gradients (read at the optimizer's pre-step, or post-accumulate hooks) are unaffected.

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

import functools
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from time import perf_counter
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from streamwatch._allowance import EvalAllowance
from streamwatch._clip_tap import ClipHandle
from streamwatch._gradprobe import GradProbe
from streamwatch._param_taps import ParamTaps
from streamwatch._record import SeriesKey
from streamwatch._summary import saturation_bounds
from streamwatch._tapstate import Hook, TapState, guarded, load_summaries, summarize_into
from streamwatch._torchhooks import (
    CHECKPOINT_BACKWARD,
    CHECKPOINT_FORWARD,
    HookGroup,
    HookGuards,
    accumulates,
    call_slot_free,
    graph_task,
    hold_call_slot,
    holds_call_slot,
    in_checkpoint,
    in_transform,
    recomputing,
    release_call_slot,
    remove_grad_hook,
)
from streamwatch._torchpath import Row
from streamwatch._zero import Fragments

__all__ = ["DEFAULT_CADENCE", "DEFAULT_TAPS", "KINDS", "TapSet"]

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


def _steps_forward(module: nn.Module) -> bool:
    """Whether the root module's forward is the training step's own (its wall-clock bounds): not
    compiled (no clock inside a graph), not an evaluation pass, not a checkpoint's recomputation."""
    if torch.compiler.is_compiling() or not (module.training and torch.is_grad_enabled()):
        return False
    return not recomputing()


_GROUPS = ("forward", "param_grad", "step")
"""The hook groups :meth:`TapSet.arm` installs and removes, in the order of its flags."""


class TapSet:
    """Installs and removes every hook for one Watch."""

    def __init__(
        self,
        model: nn.Module,
        modules: list[tuple[str, nn.Module]],
        params: list[tuple[str, str, nn.Parameter]],
        optimizers: tuple[torch.optim.Optimizer, ...],
        state: TapState,
        zero: tuple[list[tuple[str, str, nn.Parameter]], Fragments] | None = None,
    ) -> None:
        """``zero``: under DeepSpeed ZeRO, the parameters with their fragment views, which the parameter
        kinds read in place of ``params`` (:mod:`streamwatch._zero`)."""
        self.state = state
        self.clip: ClipHandle | None = None  # the clip tap (streamwatch._clip_tap), removed with the hooks
        # The root module's calls are seen for the Watch's life (:meth:`_root_in`): through its call slot
        # (``_entry``) or, where the slot is taken, a forward pre-hook (``_root_handle``).
        self._entry: Callable[..., Any] | None = None
        self._root_handle: RemovableHandle | None = None
        self._dark_entry: Callable[..., Any] | None = None  # the slot's entry in a dark pair (go_dark)
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
            group: HookGroup(self._registrations[group], group != "param_grad") for group in _GROUPS
        }
        self._armed_now = (False, False, False)  # whether each of _GROUPS has its hooks in
        self._has_group = (False, False, False)  # whether each of _GROUPS has registrations
        self._eval_armed = False  # the forward hooks are in for an evaluation pass only
        self.eval_allowance: EvalAllowance | None = None  # evaluation passes' share of the budget (governor)
        self._eval_mark = 0.0  # the hooks' busy time already charged to the allowance (less arming's)
        # Gradient hooks on leaf tensors (a parameter a module returns as is, an input made with
        # requires_grad): such a tensor outlives the step and keeps its hooks, so they are held here,
        # one per tensor and key, and removed at the next step boundary (arm) and at remove().
        self._leaf_hooks: dict[tuple[int, SeriesKey], tuple[weakref.ref[torch.Tensor], RemovableHandle]] = {}
        # Under torch.compile, installing and removing hooks would change what dynamo guards on and
        # recompile the graph: once a hook runs while compiling, every hook stays in for good.
        self.static = False
        self.guards = HookGuards()  # dynamo checks module hooks while the Watch is open (once it is loaded)
        self.guards.hold()
        self.parameters = (  # the parameter kinds' taps
            ParamTaps(state, params, optimizers, state.taps)
            if zero is None
            else ParamTaps(state, zero[0], optimizers, state.taps, zero[1])
        )
        self._where = params[0][2] if params else None  # (its device: where the model is now, arm)
        self._probes: list[GradProbe] = []  # output gradients in compiled code (_gradprobe)
        self._model: Callable[[], nn.Module | None] = lambda: None  # (weakly, once installed)
        self._auxiliary = (-1, False)  # (graph task id, whether that backward is auxiliary): see _grad_hook
        try:
            self._install(model, modules, params)
            self._drain_params = [param for _, _, param in params]
            self._drain_handle: tuple[torch.Tensor, RemovableHandle] | None = None
            self._arms = 0
            self._keep_draining(True)
        except BaseException:
            self.remove()  # all or nothing: a registration that failed half-way leaves no hook behind
            raise

    def _install(
        self,
        model: nn.Module,
        modules: list[tuple[str, nn.Module]],
        params: list[tuple[str, str, nn.Parameter]],
    ) -> None:
        state = self.state
        taps = state.taps
        device: torch.device | None = next(
            itertools.chain(model.parameters(), model.buffers()), torch.empty(0)
        ).device
        for name, module in modules:
            channel_last = state.channel_last
            if channel_last is None:
                channel_last = not isinstance(module, _CHANNEL_FIRST)
                # (4-D/5-D tensors are channels-first whatever module made them: see summarize_into)
            forward = self._registrations["forward"]
            if taps & {"activation", "output_grad"}:
                probe = None
                if "output_grad" in taps and device is not None:
                    try:
                        probe = GradProbe(name, device, self._landed)
                    except (RuntimeError, TypeError):  # (a device without float64, as MPS: compiled
                        device = None  # code skips output gradients there, counted; eager code is unaffected)
                    else:
                        self._probes.append(probe)
                        state.probes.append(probe)
                hook = self._forward_hook(name, channel_last, saturation_bounds(module), probe)
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
        step.append(functools.partial(model.register_forward_hook, Hook(self._root_forward_end)))
        self._registrations["param_grad"].extend(self.parameters.grad_registrations)
        step.extend(self.parameters.step_registrations)
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
        if not call_slot_free(model):
            self._root_handle = model.register_forward_pre_hook(Hook(self._root_forward_start))
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

        hold_call_slot(model, entry)
        self._entry = entry

    def _root_out(self) -> None:
        """Stop seeing the root module's calls (the slot emptied only if it still holds ours)."""
        entry, self._entry = self._entry, None
        dark, self._dark_entry = self._dark_entry, None
        model = self._model()
        for each in (entry, dark):
            if each is not None and model is not None:
                release_call_slot(model, each)
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
        model = self._model()
        if model is not None and call_slot_free(model):
            self._dark_entry = self._dark_call(model)
            hold_call_slot(model, self._dark_entry)
        return True

    def _dark_call(self, model: nn.Module) -> Callable[..., Any]:
        """The root's call slot in a dark pair: no hook, no clock; an evaluation pass (eval mode or no
        gradients) is only counted (``skipped["dark_step"]``): none of its hooks can go in there without
        spoiling the pair's measurement, but it is not lost silently (docs/governor.md)."""
        call: Callable[..., Any] = model._call_impl
        skip = self.state.skip

        def dark(*args: Any, **kwargs: Any) -> Any:
            if not (model.training and torch.is_grad_enabled()):
                skip("dark_step")
            return call(*args, **kwargs)

        return dark

    def go_light(self) -> None:
        """See the root module's calls again after a dark pair."""
        model = self._model()
        dark, self._dark_entry = self._dark_entry, None
        if dark is not None and model is not None:
            release_call_slot(model, dark)
        if self._entry is None and self._root_handle is None and model is not None:
            self._root_in(model)

    def _keep_draining(self, wanted: bool) -> None:
        """Move the rows compiled code made into the step buffer after each backward pass
        (``TapState.drain``), from a hook on the first observed parameter that takes a gradient: in for
        step 0 (a model compiled before its first step runs its first micro-batches before any
        boundary) and for every step whose forward hooks record (a model first compiled at a later
        step), kept for good once compiled code ran a hook; out on the other steps of an eager model (a
        Python call per backward saved where nothing is recorded)."""
        handle = self._drain_handle
        if wanted and handle is None:
            trainable = [param for param in self._drain_params if param.requires_grad]
            if trainable:
                self._drain_handle = (
                    trainable[0],
                    trainable[0].register_post_accumulate_grad_hook(self._drain),
                )
        elif not wanted and handle is not None:
            remove_grad_hook(*handle)
            self._drain_handle = None

    def _drain(self, param: torch.Tensor) -> None:
        try:
            self.state.drain()
        except Exception as exc:  # never into the user's backward
            self.state.fail(exc)

    def _set_group(self, group: str, on: bool) -> None:
        hooks = self._groups[group]
        if on and not hooks.on and group == "param_grad":
            self.parameters.grad_hooks_going_in()  # which parameters get a hook: those that require one now
        hooks.set(on)
        groups = self._groups
        self._armed_now = (groups["forward"].on, groups["param_grad"].on, groups["step"].on)

    def arm(self) -> None:
        """Install or remove the per-module and per-parameter hooks for the step that begins: only the
        groups the step samples (every group while ``static``). Called at each step boundary."""
        state = self.state
        state.count_noted()  # (what compiled code skipped: TapState.skip)
        entry = self._entry
        if entry is not None:
            model = self._model()
            if model is not None and not holds_call_slot(model, entry):
                # The slot was taken: by Module.compile(), the one thing in torch that sets it. A pre-hook
                # sees the calls from now on, and every hook stays in, as under torch.compile.
                self._entry = None
                self._root_handle = model.register_forward_pre_hook(Hook(self._root_forward_start))
                state.compiled = True
        static = self.static or state.compiled
        self.static = static
        if self._eval_armed:  # (evaluation passes ran up to this boundary: their hooks go below)
            self._charge_eval()
        if self._leaf_hooks:
            self._release_leaves()
        self.parameters.new_step(self._armed_now[2])
        state.seen = False
        self.guards.hold()  # (dynamo loaded since the last boundary: its hook check goes on now)
        self._arms += 1
        has = self._has_group  # (a group without registrations stays empty: with an optimizer,
        wanted = (  # param_grad's, whose gradients are read at its pre-step hook)
            has[0] and (static or state.forward),
            has[1] and (static or state.on.get("param_grad", False)),
            has[2] and (static or state.timed),
        )
        where = self._where
        if where is not None and where.device.type != state.device:  # moved since observe(): its summaries
            load_summaries(state, where.device.type)
        # (step 0, compiled code, or a step whose forward hooks record: a model compiled only now drains)
        self._keep_draining(state.compiled or self._arms == 1 or wanted[0])
        if wanted != self._armed_now:  # (groups already as wanted are left alone: the every-step case)
            for group, on, now in zip(_GROUPS, wanted, self._armed_now, strict=True):
                if on != now:
                    self._set_group(group, on)
        elif wanted[1]:  # a parameter frozen or unfrozen since its hooks went in (a fine-tuning schedule)
            self.parameters.refresh_grad_hooks(self._groups["param_grad"].handles)

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
    ) -> Callable[[nn.Module, Iterable[tuple[str, Any]], GradProbe | None], torch.Tensor | None]:
        """The shared body of the forward-side hooks: for each tensor leaf, summarise its value
        (``value_kind``) and hook its gradient (``grad_kind``). In compiled code an output that is one
        tensor passes through the module's ``probe`` instead (the result, returned, replaces it)."""
        state = self.state

        def tap(
            module: nn.Module, leaves: Iterable[tuple[str, Any]], probe: GradProbe | None = None
        ) -> torch.Tensor | None:
            replaced = None
            if state.paused:
                return None
            state.seen = True
            if in_transform():  # (torch.func's wrapped tensors: nothing to read, no hook to take)
                for _, leaf in leaves:
                    state.skip("functorch" if isinstance(leaf, torch.Tensor) else "non_tensor")
                return None
            grad = torch.is_grad_enabled()
            train = (module.training or (grad and state.root_training)) and (
                grad or in_checkpoint(CHECKPOINT_FORWARD)
            )
            if train and not state.forward:
                return None
            # Activation checkpointing (torch.utils.checkpoint) runs a training forward twice: the values
            # are summarised once, in the first forward (a re-entrant one runs it under no_grad, so its
            # gradients are hooked in the recomputation, where backward flows; a non-reentrant one keeps
            # the first forward's graph, so nothing of the recomputation is hooked).
            again = train and recomputing()
            hook_grads = train and grad and (not again or in_checkpoint(CHECKPOINT_BACKWARD))
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
                        # A tensor hook registered inside a compiled forward breaks the graph: the output
                        # passes through the probe instead, or is skipped (and counted)
                        probed = None
                        if probe is not None and not leaf_name and probe.accepts(leaf):
                            probed = probe.apply(leaf, state.count_nonfinite)
                        if probed is None:
                            state.skip("compiled_grad_hook")
                        else:
                            state.probe_count(probe.key, leaf.numel())  # type: ignore[union-attr]
                            replaced = probed
                        continue
                    key = SeriesKey("train", name, grad_kind, leaf_name)
                    if leaf.grad_fn is None:  # a leaf: its hook would outlive the step (see __init__)
                        self._hook_leaf(leaf, key, channel_last)
                    else:  # (the hook goes with the tensor, freed with its graph)
                        leaf.register_hook(self._grad_hook(key, channel_last))
            return replaced

        return tap

    def _forward_hook(
        self, name: str, channel_last: bool, bounds: tuple[float, float] | None, probe: GradProbe | None
    ) -> Callable[..., Any]:
        tap = self._tap(name, "activation", "output_grad", channel_last, bounds)

        def body(module: nn.Module, args: Any, output: Any) -> torch.Tensor | None:
            return tap(module, _leaves(output), probe)  # (a tensor: the output through its probe)

        return guarded(self.state, body)

    def _landed(self, key: SeriesKey, count: int, row: Row) -> None:
        """An output gradient's row, out of a compiled backward (:class:`GradProbe`): into the step."""
        state = self.state
        try:
            if state.memory.copy:  # (CUDA graphs overwrote rows once: copied while still readable)
                keep = state.memory.keep
                nonfinite = None if row.nonfinite is None else keep(row.nonfinite)
                row = Row(keep(row.gram), keep(row.low), keep(row.high), nonfinite)
            state.buffer.add(key, count, row, traced=True)
        except Exception as exc:  # never into the user's backward
            state.fail(exc)

    def _forward_pre_hook(self, name: str) -> Callable[..., Any]:
        tap = self._tap(name, "input", "input_grad", None, None)  # inputs: no per-unit activity

        def body(module: nn.Module, args: Any, kwargs: Any) -> None:
            # positional leaves are named by position ("0", "1.0"), keyword ones by name ("mask")
            tap(module, itertools.chain(_leaves(args), _leaves(kwargs)), None)  # (inputs: no probe)

        return guarded(self.state, body)

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
            if torch.is_grad_enabled() and self._auxiliary_pass():  # (grad mode is on: create_graph)
                state.skip("auxiliary_backward")
                return
            summarize_into(state, key, grad, channel_last)

        return guarded(state, body)

    def _auxiliary_pass(self) -> bool:
        """Whether the backward running now (one with ``create_graph=True``) adds to no gradient of the
        model's parameters: ``torch.autograd.grad`` for a gradient penalty (WGAN-GP, R1) or a
        meta-learning inner step. Its output and input gradients are not the step's (the training
        ``backward()`` fires the same hooks again), so they are skipped and counted. Told once per pass."""
        task = graph_task()
        if self._auxiliary[0] != task:
            model = self._model()
            self._auxiliary = (task, model is not None and not accumulates(model.parameters()))
        return self._auxiliary[1]

    # -- parameters -------------------------------------------------------------------------------------

    def _root_forward_start(self, module: nn.Module, args: Any) -> None:
        self.state.seen = True
        if torch.compiler.is_compiling():
            self.state.compiled = True  # every hook stays in from the next step boundary on
            return
        state = self.state
        grad = torch.is_grad_enabled()
        state.root_training = training = module.training and grad
        if not training:
            if grad and not state.paused:  # (in eval mode: an evaluation without no_grad, or training)
                state.eval_with_grad = True
            allowance = self.eval_allowance
            if self._eval_armed and allowance is not None:
                # another evaluation pass with their hooks in: what the last took is spent, and this one
                # is granted on its own (a long evaluation loop stops when the allowance is spent)
                self._charge_eval(ended=False)
                if not allowance.grant():
                    self._end_eval()
                    state.skip("eval_budget")
                    return
            elif not self._armed_now[0] and not state.paused and self._has_group[0]:
                # Evaluation passes are summarised whatever the step samples (under the governor, within
                # their share of the budget: _allowance): their hooks go in for them.
                if allowance is not None and not allowance.grant():
                    state.skip("eval_budget")  # (it runs without hooks; the step may still be quiet)
                    return
                arming = perf_counter()
                try:
                    self._set_group("forward", True)
                except Exception as exc:  # never into the user's forward
                    state.fail(exc)
                self._eval_armed = True
                self._eval_mark = state.busy - (perf_counter() - arming)  # (spent: busy since, and this)
            state.quiet = 0  # an evaluation pass records: the step ends at a full boundary
        else:
            state.trained = True
            if (
                self._eval_armed
            ):  # a training forward after an evaluation pass (no root forward hook ended it)
                self._end_eval()
            if state.timed and not recomputing():  # (not an unsampled step; not a checkpoint's recomputation)
                times = state.times
                if not times.forward_start:
                    times.forward_start = times.clock()

    def _root_forward_end(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._eval_armed:  # (its hooks stay in for the passes after it: the next training forward,
            return  # pass_ends() or the step boundary take them out, _end_eval)
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
        """Evaluation passes are over (a training forward begins, a framework's batch ended, or the
        allowance is spent): the forward hooks go back to what the step samples, and what the passes took
        is charged."""
        disarming = perf_counter()
        try:
            self._set_group("forward", self.static or self.state.forward)
        except Exception as exc:  # never into the user's forward
            self.state.fail(exc)
        self._charge_eval(more=perf_counter() - disarming)

    def _charge_eval(self, ended: bool = True, more: float = 0.0) -> None:
        """Charge what the evaluation passes took since the last charge (their hooks, putting the hooks
        in and ``more``: taking them out) to the evaluation allowance, under the governor; ``ended``: their
        hooks are out (or going out at the step boundary)."""
        busy = self.state.busy
        if self.eval_allowance is not None:
            self.eval_allowance.charge(busy - self._eval_mark + more)
        self._eval_mark = busy
        if ended:
            self._eval_armed = False

    def remove(self) -> None:
        """Remove every hook. Idempotent."""
        if self.clip is not None:
            self.clip.remove()
            self.clip = None
        self._root_out()
        self._release_leaves()
        self.guards.release()
        if getattr(self, "_drain_handle", None) is not None:
            self._keep_draining(False)
        self._drain_params = []
        self._where = None
        for probe in getattr(self, "_probes", ()):
            probe.remove()
        self._probes = []
        self.state.probes.clear()
        for group in _GROUPS:
            self._set_group(group, False)
        self._registrations = {group: [] for group in self._registrations}
        self._groups = {group: HookGroup([], False) for group in _GROUPS}
        self._has_group = (False, False, False)
        self.parameters.clear()  # a closed Watch must not keep the model's parameters alive
