"""Cadence: which steps are sampled, and which tap kinds a sampled step samples.

A fixed interval (``every=N``) samples step ``s`` when ``s % N == 0``; under the overhead governor the
governor answers per step. Either way the ``k``-th sampled step (from 0) samples kind ``kind`` when
``k % cadence[kind] == 0`` (weights and updates 10× coarser by default). The flags of a sampled step are
one shared, never-mutated dict per pattern of kinds; cadences whose least common multiple is short are
looked up by phase.

Example:
    >>> cadence = Cadence(every=2, periods=[("activation", 1), ("param", 3)])
    >>> [cadence.decide(step, None) for step in range(5)]
    [(True, 0), (False, 0), (True, 1), (False, 1), (True, 2)]
    >>> on, forward = cadence.flags(3)
    >>> on["activation"], on["param"], forward
    (True, True, True)
    >>> cadence.flags(1)[0]["param"]
    False
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from streamwatch._taps import KINDS
from streamwatch.metrics._base import Metric

__all__ = ["FORWARD_KINDS", "Cadence", "Preparing"]

FORWARD_KINDS = ("input", "activation", "output_grad", "input_grad")
"""The kinds the forward-side hooks read (their hooks go in when any of them is sampled)."""

_CYCLE_MAX = 4096  # cadences whose lcm is longer: each sampled step's flags are looked up by pattern


class Cadence:
    """The sampling decision of each step and the flags of each sampled one.

    Args:
        every: the fixed interval (1 under the governor, which decides instead).
        periods: ``(kind, cadence)`` for each tapped kind, in :data:`streamwatch._taps.KINDS` order.
    """

    __slots__ = ("_cycle", "_patterns", "_periods", "all_off", "all_on", "every", "forward_all", "sampled")

    def __init__(self, every: int, periods: Sequence[tuple[str, int]]) -> None:
        self.every = every
        self._periods = tuple(periods)
        self.sampled = 0  # governor mode: sampled steps so far (the cadences count these)
        self._patterns: dict[tuple[bool, ...], tuple[Mapping[str, bool], bool]] = {}
        self.all_off: Mapping[str, bool] = dict.fromkeys(KINDS, False)
        self.all_on: Mapping[str, bool] = self.all_off | {kind: True for kind, _ in self._periods}
        self.forward_all = any(self.all_on[kind] for kind in FORWARD_KINDS)
        period = math.lcm(*(cadence for _, cadence in self._periods)) if self._periods else 1
        self._cycle = [self._flags_for(k) for k in range(period)] if period <= _CYCLE_MAX else []

    def decide(self, step: int, governed: bool | None) -> tuple[bool, int]:
        """Whether ``step`` is sampled and its index ``k`` among the sampled steps: by the fixed interval
        (``governed`` None), else the governor's answer (which counts the sampled steps here)."""
        if governed is None:
            return step % self.every == 0, step // self.every
        k = self.sampled
        self.sampled += governed
        return governed, k

    def flags(self, k: int) -> tuple[Mapping[str, bool], bool]:
        """The kinds the ``k``-th sampled step samples, and whether any of them is forward-side."""
        cycle = self._cycle
        return cycle[k % len(cycle)] if cycle else self._flags_for(k)

    def metrics_for(
        self, metrics: Sequence[Metric], step: int, k: int | None, governed: bool
    ) -> tuple[dict[str, list[Any]], tuple[Any, ...]]:
        """The opt-in metrics ``step`` runs (``k``: its index among the sampled steps, None if it is not
        sampled): those it samples (``k`` a multiple of the metric's ``every``), and the preparation of
        those that sample the next step (a fixed interval only: observe() refuses them under a governor,
        which decides whether a step is sampled only when it begins). Returns the tensor metrics by the
        kind they read, and the step-level ones (a preparing metric as :class:`Preparing`)."""
        sampled = [] if k is None else [m for m in metrics if k % m.every == 0]
        preparing = [
            Preparing(m)
            for m in metrics
            if m.needs_prepare and not governed and (step + 1) % (self.every * m.every) == 0
        ]
        kinds: dict[str, list[Any]] = {}
        for metric in sampled:
            for kind in metric.kinds:
                kinds.setdefault(kind, []).append(metric.on_tensor)
        return kinds, (*sampled, *preparing)

    def _flags_for(self, k: int) -> tuple[Mapping[str, bool], bool]:
        pattern = tuple(k % cadence == 0 for _, cadence in self._periods)
        flags = self._patterns.get(pattern)
        if flags is None:
            kinds = [kind for kind, _ in self._periods]
            on = dict.fromkeys(KINDS, False) | dict(zip(kinds, pattern, strict=True))
            flags = self._patterns[pattern] = (on, any(on[kind] for kind in FORWARD_KINDS))
        return flags


class Preparing:
    """A metric on the step before one it samples: its ``prepare`` calls, under the optimizer hooks'
    names (so the step boundary and the taps call every step metric alike)."""

    __slots__ = ("metric",)

    def __init__(self, metric: Metric) -> None:
        self.metric = metric

    def before_optimizer_step(self, buffer: Any) -> None:
        self.metric.prepare(buffer)

    def after_optimizer_step(self, buffer: Any) -> None:
        self.metric.prepare_after(buffer)
