"""The parameter kinds' taps: gradients (``param_grad``), weights (``param``), updates (``update``).

With an optimizer they are read at its step hooks: every gradient as it is about to be applied (after
accumulation, unscaling, clipping, DDP's averaging) at the pre-step hook, the update Δ = w_after − w_before
and the weights at the post-step hook. Without one, gradients are read by post-accumulate hooks (the last,
complete one of a step wins) and weights at the step's end. Parameters the optimizer does not step (another
optimizer's, a frozen body's) have no update row; their weights are read at the step's end. With several
optimizers (Muon with AdamW, a GAN's two halves) each parameter is read at the hooks of the one that steps
it, and what a step's optimizers did not read (one skipped) at its end.

Example:
    >>> import torch, streamwatch as sw
    >>> model = torch.nn.Linear(3, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> records = sw.sinks.collect()
    >>> with sw.observe(model, opt, every=1, cadence={"update": 1}, sinks=[records]) as watch:
    ...     model(torch.randn(4, 3)).sum().backward(); opt.step(); watch.step()
    >>> sorted({key.kind for key in records.items[0].keys} - {"activation", "output_grad"})
    ['param', 'param_grad', 'update']
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from streamwatch._buffer import StepBuffer
from streamwatch._failures import user_frame
from streamwatch._loopchecks import LoopChecks
from streamwatch._record import SeriesKey
from streamwatch._tapstate import TapState, guarded, summarize_into, summarize_many, summarize_pack
from streamwatch._torchpath import GROUP_ELEMENTS, Packing, Packings, batches
from streamwatch._zero import Fragments

__all__ = ["NO_HOOK", "UNOBSERVED_OPTIMIZER", "UNSEEN_FORWARD", "ParamTaps", "place_in_backward"]

GradKey = tuple[SeriesKey, nn.Parameter]
"""A ``param_grad`` row's key and the parameter whose gradient it reads."""

UNOBSERVED_OPTIMIZER = "unobserved_optimizer"
"""The ``statistics().skipped`` reason of sampled steps in which an optimizer the Watch does not observe
stepped some of the model's parameters: their updates are not recorded (:meth:`ParamTaps.new_step`)."""

UNSEEN_FORWARD = "unseen_forward"
"""The ``statistics().skipped`` reason of sampled steps whose forward pass no hook saw (compiled code that
ran a graph traced without them)."""


def _has_closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an optimizer step hook's call passes a closure: ``step(closure)`` or ``step(closure=...)``
    (torch hands the hooks the step's arguments with the optimizer itself first)."""
    return (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None


class _NoHook:
    """The handle of a hook not installed (:func:`_grad_hook_on` on a frozen parameter)."""

    __slots__ = ()

    def remove(self) -> None:
        pass


NO_HOOK = _NoHook()


def _grad_hook_on(param: nn.Parameter, hook: Callable[[nn.Parameter], None]) -> Any:
    """Install ``hook`` after ``param``'s gradient is accumulated, if it requires one (torch refuses a
    hook on a tensor that does not: a parameter frozen mid-run is passed over until it is unfrozen)."""
    if not param.requires_grad:
        return NO_HOOK
    return param.register_post_accumulate_grad_hook(hook)


class ParamTaps:
    """The parameter kinds' taps for one Watch.

    Args:
        state: the Watch's tap state.
        params: ``(layer, name, parameter)`` of every observed parameter.
        optimizers: the observed optimizers (none, one or several).
        taps: the tapped kinds.

    Attributes:
        params: the observed parameters (emptied at :meth:`clear`: a closed Watch keeps none alive).
        has_optimizer: an optimizer is observed (its step hooks read the parameter kinds).
        several: more than one is: opt-in metrics' ``before_optimizer_step`` runs at the first one's
            pre-step hook of a step, their ``after_optimizer_step`` at the step's end (an update is what
            every optimizer did; the boundary calls it, :meth:`metrics_after`).
        found_inf: a ``GradScaler``'s found-inf flag at a fused step whose updates were summarised (the
            record carries it; the worker drops the updates of a step that did not happen).
        grad_registrations: without an optimizer, one post-accumulate hook per gradient (registered
            each time they go in: torch refuses one on a frozen parameter).
        step_registrations: with optimizers, their pre- and post-step hooks.
    """

    def __init__(
        self,
        state: TapState,
        params: list[tuple[str, str, nn.Parameter]],
        optimizers: tuple[torch.optim.Optimizer, ...],
        taps: frozenset[str],
        fragments: Fragments | None = None,
    ) -> None:
        self.state = state
        self.params = params
        self.fragments = fragments  # DeepSpeed ZeRO: ``params`` hold fragment views (_zero)
        self.has_optimizer = bool(optimizers)
        self.several = len(optimizers) > 1
        self._optimizers = optimizers
        self.found_inf: torch.Tensor | None = None
        self._before: list[torch.Tensor] | None = None
        self._packed: list[tuple[Packing, list[tuple[str, str, nn.Parameter]]]] = []  # packed snapshots
        self._snapshots = Packings()  # their packs, by layout
        self._afters = Packings()  # the weights after the step, for the Triton kernels to read Δ from
        self._grads: list[tuple[SeriesKey, nn.Parameter]] = []  # the param_grad tap's keys and parameters
        self._grad_flags: list[bool] = []  # their requires_grad when their hooks went in (no optimizer)
        # With optimizers: the parameters each steps (read at its hooks, by its position) and the others (at
        # the step's end), by their param groups as they were last seen (:meth:`_split`)
        self._split_signature: tuple[tuple[int, int], ...] | None = None
        self._owned: dict[int, tuple[list[tuple[str, str, nn.Parameter]], list[GradKey]]] = {}
        self._other_params: list[tuple[str, str, nn.Parameter]] = []
        self._other_grads: list[tuple[SeriesKey, nn.Parameter]] = []
        # this step's optimizers whose pre- and post-step hooks ran (by position), with several of them
        self._pre_ran: set[int] = set()
        self._post_ran: set[int] = set()
        self.metrics_started = False  # with several: the opt-in metrics' before_optimizer_step ran
        self._before_params: list[tuple[str, str, nn.Parameter]] = []
        self._grads_after: list[tuple[SeriesKey, nn.Parameter]] | None = None
        self._closure = False  # the optimizer step under way was given a closure
        self.checks = LoopChecks()  # how the loop uses the watch, as these hooks see it
        self.params_taken = False
        self.grads_taken = False  # this step's gradients are summarised (at the optimizer's pre-step)
        self.grad_registrations: list[Callable[[], Any]] = []
        self.step_registrations: list[Callable[[], Any]] = []
        if "param_grad" in taps:
            self._grads = [(SeriesKey("train", layer, "param_grad", pname), p) for layer, pname, p in params]
            if not optimizers:  # with an optimizer: at its pre-step hook, in one call
                for key, param in self._grads:  # (a frozen one gets its hook when it is unfrozen)
                    self.grad_registrations.append(
                        functools.partial(_grad_hook_on, param, self._param_grad_hook(key))
                    )
        # (run as they are under torch.compile(optimizer.step) too: traced, they would be compiled as
        # dozens of frames of their own, guarded on the step's Python state)
        # Each optimizer's hooks know its position: the optimizer torch hands them may be another object
        # sharing its state (a LightningOptimizer given to observe() while the loop steps the inner one)
        for i, optimizer in enumerate(optimizers):
            before = guarded(state, functools.partial(self._before_optimizer_step, i), eager=True)
            after = guarded(state, functools.partial(self._after_optimizer_step, i), eager=True)
            self.step_registrations.append(functools.partial(optimizer.register_step_pre_hook, before))
            self.step_registrations.append(functools.partial(optimizer.register_step_post_hook, after))
        # Any optimizer's step, on the steps the hooks are in: one the Watch does not observe that steps
        # the model (a loop that made a new optimizer, or a second one not passed) is counted, and warned
        # about if the observed ones did not step (their learning rates are then no longer the run's)
        self._foreign: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._ids = {id(param) for _, _, param in params}
        self.stepped = False  # this step: an observed optimizer stepped
        self.foreign: str | None = None  # this step: an unobserved optimizer stepped the model (its class)
        self._warned_foreign = False
        # An optimizer sharing an observed one's param groups that steps outside its step (SAM's
        # first_step/second_step steps its base_optimizer) stands in for it: its step is read as the
        # observed one's would be (_stand_in)
        self._stepping: set[int] = set()  # observed optimizers inside their step now (by position)
        self._stand_in: tuple[Any, int] | None = None  # the optimizer standing in now, for which one
        if optimizers:
            seen = guarded(state, self._any_optimizer_step, eager=True)
            self.step_registrations.append(functools.partial(register_optimizer_step_pre_hook, seen))
            done = guarded(state, self._any_optimizer_stepped, eager=True)
            self.step_registrations.append(functools.partial(register_optimizer_step_post_hook, done))

    def new_step(self, hooked: bool = False) -> None:
        """A step begins: nothing of it is read yet. An unobserved optimizer that stepped the model in
        the step before is counted now, and warned about once if the observed ones did not step.
        ``hooked``: the step before had the optimizer's hooks in, so whether it stepped is known
        (``LoopChecks.step_ends``)."""
        foreign = self.foreign
        if foreign is not None:
            self._unobserved_optimizer(foreign)
        stepped = self.stepped if self.has_optimizer and foreign is None else None  # (foreign: warned above)
        if self.checks.step_ends(self.state.seen, hooked, stepped):
            self.state.skip(UNSEEN_FORWARD)
        self.stepped, self.foreign = False, None
        self._stepping.clear()  # (a step that raised inside the optimizer's step left it there)
        self._stand_in = None
        self.grads_taken = self.params_taken = False
        self._grads_after = None
        if self.fragments is not None:  # (a step that raised inside the optimizer's step left them given)
            self.fragments.release()
        if self.several:
            self._pre_ran.clear()
            self._post_ran.clear()
            self.metrics_started = False

    def grad_hooks_going_in(self) -> None:
        """The post-accumulate hooks go in: remember which parameters require a gradient now."""
        self._grad_flags = [param.requires_grad for _, param in self._grads]

    def refresh_grad_hooks(self, handles: list[Any]) -> None:
        """A parameter frozen or unfrozen since its hooks went in (a fine-tuning schedule): an unfrozen
        one gets its hook now (a frozen one keeps its own: it fires if it is unfrozen)."""
        if self._grad_flags == [param.requires_grad for _, param in self._grads]:
            return
        for i, (_, param) in enumerate(self._grads):
            if handles[i] is NO_HOOK and param.requires_grad:
                handles[i] = self.grad_registrations[i]()
        self.grad_hooks_going_in()

    def _param_grad_hook(self, key: SeriesKey) -> Callable[[nn.Parameter], None]:
        state = self.state

        def body(param: nn.Parameter) -> None:
            if state.on.get("param_grad") and param.grad is not None:
                # Gradient accumulation fires this once per micro-step: the last (full) gradient wins.
                summarize_into(state, key, param.grad, None, replace=True)

        return guarded(state, body)

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
        summarize_many(state, present)
        place_in_backward(buffer, start)

    def summarize_params(self, params: list[tuple[str, str, nn.Parameter]] | None = None) -> None:
        """Weights and biases, each on its own row (``kind="param"``): every parameter's, or ``params``'."""
        self.params_taken = True
        chosen = self.params if params is None else params
        items = [(SeriesKey("train", layer, "param", p), param) for layer, p, param in chosen]
        summarize_many(self.state, items)

    def summarize_rest(self) -> None:
        """At a sampled step's end, with an optimizer: what its hooks did not read. Every gradient and
        weight if they did not run (a ``GradScaler`` skipped the step); else the weights of the
        parameters it does not step (another optimizer's may step after its hooks). Their gradients are
        read at its pre-step hook, as they are then: a loop may zero them before ``watch.step()``."""
        on = self.state.on
        several = self.several
        if self.grads_taken and not on.get("param") and not (several and self._unstepped(self._pre_ran)):
            return  # (the common step: its hooks read everything)
        if on.get("param_grad") and self._grads:
            if not self.grads_taken:
                self.summarize_grads()
            elif several:  # (the gradients of the optimizers that did not step)
                missed = [t for i in self._unstepped(self._pre_ran) for t in self._owned[i][1]]
                if missed:
                    self.summarize_grads(missed)
        if on.get("param") and self.params:
            if not self.params_taken:
                self.summarize_params()
            else:
                rest = self._other_params
                if several:
                    rest = rest + [t for i in self._unstepped(self._post_ran) for t in self._owned[i][0]]
                if rest:
                    self.summarize_params(rest)

    def _unstepped(self, ran: set[int]) -> list[int]:
        """The positions of the observed optimizers not in ``ran`` (whose parameters :meth:`_split` knows)."""
        return [i for i in self._owned if i not in ran]

    def metrics_after(self) -> None:
        """With several optimizers, at the step's end: the opt-in metrics' ``after_optimizer_step`` (and
        their ``before_optimizer_step`` first if no optimizer stepped)."""
        state = self.state
        if not self.metrics_started:
            for metric in state.step_metrics:
                state.call(metric.before_optimizer_step, state.buffer)
        for metric in state.step_metrics:
            state.call(metric.after_optimizer_step, state.buffer)

    def _split(self, index: int) -> tuple[list[tuple[str, str, nn.Parameter]], list[GradKey]]:
        """The parameters optimizer ``index`` steps (its param groups, as they are now), their gradient keys;
        sets those no observed optimizer steps aside for :meth:`summarize_rest`. Cached while the groups
        keep their lists."""
        optimizers = self._optimizers
        signature = tuple(
            (id(group["params"]), len(group["params"])) for each in optimizers for group in each.param_groups
        )
        # (ZeRO: a fragment is stepped with its flat partition; stage 3 gives the inner optimizer a new
        # list of one partition at each step of a sub-group, whose id may be an old one's: not cached)
        home = {} if self.fragments is None else self.fragments.home
        if signature != self._split_signature or home:
            self._owned = {}
            every: set[int] = set()
            for i, each in enumerate(optimizers):
                owned = {id(param) for group in each.param_groups for param in group["params"]}
                every |= owned
                self._owned[i] = (
                    [t for t in self.params if id(home.get(id(t[2]), t[2])) in owned],
                    [t for t in self._grads if id(home.get(id(t[1]), t[1])) in owned],
                )
            self._other_params = [t for t in self.params if id(home.get(id(t[2]), t[2])) not in every]
            self._other_grads = [t for t in self._grads if id(home.get(id(t[1]), t[1])) not in every]
            self._split_signature = signature
        return self._owned[index]

    def _any_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """torch's global pre-step hook (it runs before the optimizer's own): note an optimizer the Watch
        does not observe that steps some of the model's parameters. One sharing an observed optimizer's
        param groups is ours: inside that one's step (a wrapper stepping the optimizer it wraps) or with
        its hooks (a wrapper sharing its state) nothing is to do; otherwise it stands in for it (SAM,
        whose ``second_step`` steps its ``base_optimizer``: the observed SAM never steps itself). Any
        optimizer stepping inside an observed one's step is part of it (ZeroRedundancyOptimizer's local
        optimizer, whose groups are its shard's)."""
        groups = optimizer.param_groups
        for index, each in enumerate(self._optimizers):
            if groups is each.param_groups:
                hooks = getattr(optimizer, "_optimizer_step_pre_hooks", None)
                if index not in self._stepping and hooks is not each._optimizer_step_pre_hooks:
                    self._stand_in = (optimizer, index)
                    self._before_optimizer_step(index, optimizer, args, kwargs)
                return
        if self._stepping:  # inside an observed optimizer's step: the one it wraps (ZeroRedundancyOptimizer's
            return  # local optimizer over this rank's shard), part of that step
        owns = self._foreign.get(optimizer)
        if owns is None:
            ids = self._ids
            owns = self._foreign[optimizer] = any(id(p) in ids for group in groups for p in group["params"])
        if owns:
            self.foreign = type(optimizer).__name__

    def _any_optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """torch's global post-step hook: the step of an optimizer standing in for an observed one is
        over (:meth:`_any_optimizer_step`)."""
        stand_in = self._stand_in
        if stand_in is not None and stand_in[0] is optimizer:
            self._stand_in = None
            self._after_optimizer_step(stand_in[1], optimizer, args, kwargs)

    def _standing_in(self, index: int, optimizer: Any) -> bool:
        """Whether another optimizer stands in for observed optimizer ``index`` now, and steps it inside
        its own step (a wrapper sharing its groups, Lookahead's, with the inner one observed)."""
        stand_in = self._stand_in
        return stand_in is not None and stand_in[1] == index and stand_in[0] is not optimizer

    def _unobserved_optimizer(self, name: str) -> None:
        self.state.skip(UNOBSERVED_OPTIMIZER)
        if self.stepped or self._warned_foreign:
            return
        self._warned_foreign = True
        observed = ", ".join(type(each).__name__ for each in self._optimizers)
        warnings.warn(
            f"streamwatch: an optimizer this watch does not observe ({name}) stepped the model's parameters "
            f"and the observed one(s) ({observed}) did not: the updates are not recorded (counted in "
            "statistics().skipped['unobserved_optimizer']) and the learning rates recorded are the observed "
            "optimizer's, not the run's. If the loop made a new optimizer, close the watch and observe the "
            "new one (observe(model, new_optimizer, start_step=...)); pass several as a list "
            "(docs/observe.md#several-optimizers)",
            RuntimeWarning,
            stacklevel=user_frame(),  # (the user's watch.step())
        )

    def _before_optimizer_step(self, index: int, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._standing_in(index, optimizer):
            return  # (the wrapper standing in for it reads the step: it began first, it ends last)
        state = self.state
        on = state.on
        if self.fragments is not None and (on.get("param_grad") or on.get("update") or state.step_metrics):
            self.fragments.refresh()  # (ZeRO: the partitions it steps now have their gradients)
        self.stepped = True
        self._stepping.add(index)
        several, first = self.several, not self._pre_ran
        if first or not several:  # (several: the optimizer part runs from the first one's step)
            state.times.optimizer_start = state.times.clock()
        if several:
            self._pre_ran.add(index)
        if not state.seen and not _has_closure(args, kwargs):  # (no forward of this step seen yet)
            has_grads = any(param.grad is not None for _, _, param in self.params)
            self.checks.optimizer_steps(state.seen, state.forward, has_grads)
        if first:
            self.checks.eval_mode(state.eval_with_grad, state.trained)
            state.eval_with_grad = state.trained = False
        if on.get("param_grad") or on.get("update") or on.get("param"):
            params, grads = self._split(index)
            if on.get("param_grad") and self._grads:
                if self._other_grads and first:  # another optimizer's: as they are now (a loop may zero
                    self.summarize_grads(self._other_grads)  # them after the steps, before watch.step())
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
                self._snapshot(stepped)
        if several:
            if self.metrics_started:
                return
            self.metrics_started = True
        for metric in state.step_metrics:
            state.call(metric.before_optimizer_step, state.buffer)

    def _after_optimizer_step(self, index: int, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._standing_in(index, optimizer):
            return
        state = self.state
        self._stepping.discard(index)
        state.times.optimizer_end = state.times.clock()
        if self.several:
            self._post_ran.add(index)
        else:  # (several: at the step's end, metrics_after)
            for metric in state.step_metrics:
                state.call(metric.after_optimizer_step, state.buffer)
        # The updates first, then the weights they produced: in the step's execution order an update
        # comes before the weight it changed (a bad update is the origin, a bad weight its consequence).
        grads, self._grads_after = self._grads_after, None
        if grads is not None:  # (the last closure's: the gradient the step applied last)
            self.summarize_grads(grads)
        found = getattr(optimizer, "found_inf", None)  # a GradScaler's, for a fused optimizer: a step
        if self._before is not None and isinstance(found, torch.Tensor):  # it skips inside the kernel
            flag = found.detach().reshape(()).to(torch.float32, copy=True)  # (read by the worker)
            held = self.found_inf  # (several: a step any of them skipped has no update rows at all, not
            self.found_inf = flag if held is None or not self.several else torch.maximum(held, flag)  # Δ=0)
        self._summarize_updates()
        if state.on.get("param"):
            self.summarize_params(self._split(index)[0])
        if self.fragments is not None:
            self.fragments.release()

    def _snapshot(self, stepped: list[tuple[str, str, nn.Parameter]]) -> None:
        """The weights before the step: with the fused kernel and CPU parameters (the first one's device
        decides) cloned one by one (the kernel reads Δ from the two copies); otherwise (CUDA;
        ``STREAMWATCH_KERNEL=torch``) copied into packs by one multi-tensor copy each
        (``_torchpath.Packing``), where Δ is computed in place. Exact non-finite counts, opt-in metrics
        of updates and compiled code clone, as :func:`~streamwatch._tapstate.summarize_many` decides."""
        state = self.state
        cloned, packed = stepped, []
        if not (
            (state.kernel is not None and stepped and stepped[0][2].device.type == "cpu")
            or (
                state.count_nonfinite
                and not (state.triton is not None and stepped and state.triton.accepts(stepped[0][2]))
            )
            or state.kind_metrics.get("update")
            or torch.compiler.is_compiling()
        ):  # (a tensor larger than a pack is cloned and summarised alone)
            cloned = [t for t in stepped if t[2].numel() > GROUP_ELEMENTS]
            packed = [t for t in stepped if t[2].numel() <= GROUP_ELEMENTS] if cloned else stepped
        with torch.no_grad():
            self._before = [param.detach().clone() for _, _, param in cloned]
            self._packed = []
            by_device: dict[torch.device, list[tuple[str, str, nn.Parameter]]] = {}
            for t in packed:
                by_device.setdefault(t[2].device, []).append(t)
            for members in by_device.values():
                for run in batches([param.numel() for _, _, param in members]):
                    batch = [members[i] for i in run]
                    pack, _ = self._snapshots.get([param for _, _, param in batch], either_order=False)
                    pack.fill([param for _, _, param in batch])
                    self._packed.append((pack, batch))
        self._before_params = cloned

    def _summarize_packed_updates(self) -> None:
        """Δ = after − before of the packed snapshots: with the Triton kernels, the weights copied into a
        second pack (one multi-tensor copy) and Δ read from the two in one launch, never stored;
        otherwise in place (two multi-tensor ops per pack), then summarised as a pack."""
        packed, self._packed = self._packed, []
        state, triton = self.state, self.state.triton
        for pack, batch in packed:
            params: list[torch.Tensor] = [param for _, _, param in batch]
            with torch.no_grad():
                rows = None
                if triton is not None and triton.accepts(pack.buffer):
                    after, _ = self._afters.get(params, either_order=False)
                    after.fill(params)
                    try:
                        rows = state.buffer.triton_arena(triton, pack.device).summarize_packed(
                            after, minus=pack
                        )
                    except Exception as exc:  # (a kernel that would not compile: the torch path from now on)
                        triton.give_up(exc)
                if rows is None:
                    torch._foreach_mul_(pack.views, -1.0)  # -before, then after + (-before): after - before
                    torch._foreach_add_(pack.views, params)  # (signed zeros too)
                    rows = summarize_pack(state, pack)
            for (layer, pname, param), row, view in zip(batch, rows, pack.views, strict=True):
                if self._closure and param.grad is None:
                    continue  # not stepped (copied before a closure computed the gradients)
                state.buffer.add(SeriesKey("train", layer, "update", pname), view.numel(), row, replace=True)

    def _summarize_updates(self) -> None:
        state = self.state
        if self._packed:
            state.call(self._summarize_packed_updates)
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
        if rest:  # (half precision: Δ in float32, exact, as in the packs)
            with torch.no_grad():
                deltas = torch._foreach_sub([_wide(a) for _, a, _ in rest], [_wide(b) for _, _, b in rest])
            for (key, _, _), delta in zip(rest, deltas, strict=True):
                summarize_into(state, key, delta, None, replace=True)

    def clear(self) -> None:
        """Forget every parameter and registration (``remove()``: a closed Watch keeps none alive)."""
        self._before = None
        self._packed, self._snapshots, self._afters = [], Packings(), Packings()
        self._before_params = self._other_params = []
        self._other_grads = []
        self._owned = {}
        self._optimizers = ()
        self._stand_in = None  # (an optimizer of the user's: not kept alive by a closed Watch)
        self.params = []
        self._grads = []
        self.grad_registrations, self.step_registrations = [], []


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x``, in float32 if it is in half precision (the difference of two such is exact in float32)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


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
