"""Loop checks: how the training loop uses the Watch, as the optimizer's hooks see it, and what is wrong.

The optimizer's step hooks (``_param_taps.ParamTaps``, on sampled steps) tell :class:`LoopChecks` what
they see; it warns once per mistake, each a ``RuntimeWarning`` pointing at the user's line
(docs/observe.md, *One step, one optimizer step* and *Phases*):

* **the optimizer steps after ``watch.step()``**: it steps before the step's first forward, and a forward
  comes after it (each step's gradients are read in the next step);
* **a forward no hook saw**: it steps gradients of a forward pass no hook saw (``model.forward(x)``,
  compiled code traced without the hooks): that step has no activations (counted by the caller);
* **``watch.step()`` per micro-batch**: once the optimizer has stepped, as many sampled steps without its
  step as with one (at least :data:`UNSTEPPED_STEPS`);
* **a model trained in eval mode**: it steps after forwards in eval mode with gradients on, and none in
  train mode since its last step (``model.train()`` forgotten after a validation).

Example:
    >>> import warnings
    >>> checks = LoopChecks()
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     checks.optimizer_steps(seen=False, forward=True, grads=True)
    ...     checks.step_ends(seen=True, hooked=True, stepped=True)
    False
    >>> "after watch.step()" in str(caught[0].message)
    True
"""

from __future__ import annotations

import warnings

from streamwatch._failures import user_frame

__all__ = ["UNSTEPPED_STEPS", "LoopChecks"]

UNSTEPPED_STEPS = 4
"""Sampled steps without an optimizer step (after its first) before the micro-batch warning."""


class LoopChecks:
    """What the optimizer's hooks saw of the loop, step by step; each mistake warned about once."""

    __slots__ = ("_counts", "_early", "_early_forward", "_warned")

    def __init__(self) -> None:
        self._early = False  # this step: the optimizer stepped gradients before any forward was seen
        self._early_forward = False  # and the step sampled the forward side
        self._counts = [0, 0]  # steps with the hooks in: with an optimizer step, without (after one)
        self._warned: set[str] = set()

    def optimizer_steps(self, seen: bool, forward: bool, grads: bool) -> None:
        """An observed optimizer's step begins (its pre-step hook, without a closure): ``seen`` whether a
        forward of this step was seen, ``forward`` whether the step samples the forward side, ``grads``
        whether any parameter has a gradient. Judged at the step's end (:meth:`step_ends`)."""
        if not seen and not self._early:
            self._early, self._early_forward = grads, forward

    def eval_mode(self, eval_with_grad: bool, trained: bool) -> None:
        """The first observed optimizer's step of a step begins: since the last one the hooks saw, the
        model ran in eval mode with gradients on (``eval_with_grad``), and in train mode (``trained``)."""
        if eval_with_grad and not trained and "eval" not in self._warned:
            self._warn(
                "eval",
                "the optimizer steps gradients of forward passes run with the model in eval mode "
                "(model.training is False, gradients on), and no forward in train mode came since its last "
                "step: did an evaluation leave the model in eval mode? Its Dropout and BatchNorm layers "
                "then run as in evaluation. Call model.train() before training. While the model trains in "
                "eval mode its forwards are recorded as phase='eval', without output gradients "
                "(docs/observe.md#phases); to keep a layer in eval mode inside training (a frozen "
                "BatchNorm), call model.train() and then layer.eval(). If the model trains in eval mode on "
                "purpose (dropout off in a policy-gradient loop), ignore this warning",
                "torch",
            )

    def step_ends(self, seen: bool, hooked: bool, stepped: bool | None) -> bool:
        """The step ends (``seen``: a forward of it was seen). ``hooked``: the optimizer's hooks were in,
        and ``stepped`` whether an observed optimizer stepped (None: not to be counted, as when an
        unobserved one stepped). True when the optimizer stepped gradients of a forward no hook saw, on a
        step that sampled the forward side (the caller counts it)."""
        unseen = False
        if self._early:
            self._early = False
            if seen:  # (a forward came after the optimizer's step)
                self._warn(
                    "order",
                    "the optimizer stepped before this step's forward pass, and the forward came after it: "
                    "the loop calls optimizer.step() after watch.step(). Each step's gradients and update "
                    "are then read in the next step and filed with it (and with sampling, the step that "
                    "ran the forward is not the one whose gradients are recorded). Call watch.step() last "
                    "in the step, after optimizer.step() (docs/observe.md#one-step-one-optimizer-step)",
                )
            elif self._early_forward:
                unseen = True
                self._warn(
                    "unseen",
                    "the optimizer steps gradients of a forward pass that no streamwatch hook saw, so this "
                    "step has no activations (counted in statistics().skipped['unseen_forward']). Either "
                    "the forward was called as model.forward(x), which skips every module hook: call "
                    "model(x); or a compiled graph traced without the hooks ran: dynamo reuses a graph "
                    "compiled for another instance of the model's class, or compiled before observe(), "
                    "since by default it does not check module hooks. Call observe() before any instance "
                    "of the class runs compiled, or torch._dynamo.reset() after observe() "
                    "(docs/observe.md#torchcompile)",
                )
        if hooked and stepped is not None and "micro" not in self._warned:
            self._count(stepped)
        return unseen

    def _count(self, stepped: bool) -> None:
        counts = self._counts
        if stepped:
            counts[0] += 1
        elif counts[0]:  # (a GradScaler skips its first steps, before the optimizer ever stepped)
            counts[1] += 1
            if counts[1] >= UNSTEPPED_STEPS and counts[1] >= counts[0]:
                self._warn(
                    "micro",
                    f"watch.step() ended {counts[1]} sampled steps in which no observed optimizer stepped, "
                    f"and {counts[0]} in which one did. A streamwatch step is one optimizer step: with "
                    "gradient accumulation, call watch.step() once, after optimizer.step(), with the whole "
                    "step's loss; as it is, each record holds a micro-batch and its gradient rows a "
                    "part-accumulated gradient (or the last step's). If the optimizer is meant to skip "
                    "these steps, ignore this warning (docs/observe.md#one-step-one-optimizer-step)",
                )

    def _warn(self, mistake: str, message: str, through: str = "") -> None:
        if mistake in self._warned:
            return
        self._warned.add(mistake)
        warnings.warn(f"streamwatch: {message}", RuntimeWarning, stacklevel=user_frame(through))
