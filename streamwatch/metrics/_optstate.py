"""``OptimizerState``: the Adam/AdamW moment estimates of every selected parameter, after the optimizer step.

Adam keeps, per parameter, ``exp_avg`` (m, the EWM of the gradients) and ``exp_avg_sq`` (v, the EWM of their
squares). Their sizes say what the gradients' own do not on a single step: ``v`` collapsing towards 0 makes
the next update ``m / (√v + eps)`` huge (the classic Adam instability after a quiet stretch), and ``m``
growing while the gradients are clipped shows a push the clipping hides. On each step the metric samples,
after ``optimizer.step()`` (the state the next step will use), for every selected parameter that has them:
the 2-norm and the largest magnitude of each, with two multi-tensor calls per moment
(``torch._foreach_norm`` with ``ord=2`` and ``ord=inf``: the kernels ``clip_grad_norm_`` uses, on the
state's device, no sync; read on the worker like every opt-in metric's value). Written on the ``param``
series of the parameter (``layer``, ``param``) as ``stat="exp_avg_norm"``, ``"exp_avg_max"``,
``"exp_avg_sq_norm"`` and ``"exp_avg_sq_max"`` (SGD with momentum: ``"momentum_buffer_norm"`` and
``"momentum_buffer_max"``). A parameter without the state (not stepped yet, plain SGD) has none. Fused and
foreach Adam keep the same per-parameter state.

Example:
    >>> import torch
    >>> import streamwatch as sw
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    >>> state = sw.metrics.OptimizerState()
    >>> watch = sw.observe(model, opt, every=1, metrics=[state])
    >>> for _ in range(3):
    ...     opt.zero_grad(); model(torch.ones(8, 4)).pow(2).mean().backward(); opt.step(); watch.step()
    >>> watch.close()
    >>> got = {s.labels["param"]: s.value for s in watch.snapshot() if s.labels.get("stat") == "exp_avg_max"}
    >>> want = float(opt.state[model.weight]["exp_avg"].abs().max())
    >>> abs(got["weight"] - want) <= 1e-6 * want
    True
"""

from __future__ import annotations

import math

import torch

from streamwatch._buffer import StepBuffer
from streamwatch._record import SeriesKey
from streamwatch.metrics._base import Metric

__all__ = ["MOMENTS", "OptimizerState"]

MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")
"""The optimizer state entries read, by torch's names: Adam's and AdamW's (NAdam, RAdam too; Adamax's
first), and SGD's momentum buffer (the same role as ``exp_avg``, without the ``1 − β`` weight)."""


class OptimizerState(Metric):
    """The 2-norm and the largest magnitude of every selected parameter's ``exp_avg`` and ``exp_avg_sq``
    (Adam-family optimizer state; SGD's ``momentum_buffer``) after the optimizer step of each sampled
    step (module docstring).

    Args:
        every: sample one in ``every`` sampled steps.
    """

    name = "optimizer_state"
    stats = tuple(f"{moment}_{what}" for moment in MOMENTS for what in ("norm", "max"))
    """The ``stat`` labels it writes."""

    def after_optimizer_step(self, buffer: StepBuffer) -> None:
        binding = self._bound()
        states = [optimizer.state for optimizer in binding.optimizers]
        if not states:
            return
        for moment in MOMENTS:
            keys, tensors = [], []
            for layer, name, param in binding.params:
                # (each parameter's from the optimizer that holds state for it; get: never adds to the
                # defaultdict)
                value = next((state[param].get(moment) for state in states if param in state), None)
                if isinstance(value, torch.Tensor) and value.numel() and value.is_floating_point():
                    keys.append(SeriesKey("train", layer, "param", name))
                    tensors.append(value.detach())
            if not tensors:
                continue
            for what, norms in (
                ("norm", torch._foreach_norm(tensors, 2)),
                ("max", torch._foreach_norm(tensors, math.inf)),
            ):
                for key, norm in zip(keys, norms, strict=True):
                    buffer.add_extra(key, f"{moment}_{what}", norm)

    @property
    def requires_optimizer(self) -> bool:
        return True
