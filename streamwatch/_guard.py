"""The guard: the per-step sentinel, the escalation a trip starts, and ``on_nonfinite="raise"``.

Every step, sampled or not, the :class:`streamwatch._nonfinite.Sentinel` checks the loss (and, if asked
or affordable, the global gradient norm) for NaN/Inf. A trip *escalates*: from the next step on, every
step is sampled in full for ``escalate`` steps, so that the origin is recorded if the fault recurs (one
escalation at a time: bounded cost). Under ``on_nonfinite="raise"`` the guard raises
:class:`streamwatch.NonFiniteError` once per episode, with the worker's verdict on where it started when
the step was recorded (docs/nonfinite.md).

Under the overhead governor with the default ``sentinel=None``, the gradient-norm check is on trial for
:data:`GRAD_NORM_TRIAL` steps: kept if its median cost is at most a quarter of what the budget allows.

Example:
    >>> guard = NonFiniteGuard(frozenset({"loss"}), False, None, escalate=3, reaction="warn", rank=0)
    >>> guard.checks(), guard.escalated(0)
    (('loss',), False)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from streamwatch._nonfinite import FirstNonFinite, NonFiniteTracker, Reaction, Sentinel, direction_of, log

__all__ = ["GRAD_NORM_TRIAL", "Alarm", "NonFiniteGuard"]

GRAD_NORM_TRIAL = 8
"""Steps over which an automatic gradient-norm sentinel (``overhead=`` with the default ``sentinel``) is
timed before it is kept or turned off."""


class Alarm:
    """A detector fired (``LossSpike``, ``GradientSpike``, ``Drift``): posted by the worker thread, taken by
    the guard at the next step boundary, which escalates as a sentinel trip does (docs/detectors.md).

    :meth:`fire` (also the object's call) ends the Watch's quiet window (``state.quiet = 0``, the same as
    a hook error does), so the next step's end runs the full boundary that takes it — unless the training
    thread was just counting that window down, then at the window's end (at most :data:`SCALAR_SECONDS`
    later): the countdown is the training thread's and is never locked.

    :attr:`line` is ``LossSpike``'s spike line (:meth:`post_line`, after each record its baseline
    folded): a step whose CPU loss passes it is sent at once in a scalar record, not kept for the next
    record, so the spike is judged (and escalates) at that step, sampled or not (:meth:`crossed`).

    Example:
        >>> class State: quiet = 5
        >>> alarm = Alarm(State())
        >>> alarm.fire(); alarm.take(), alarm.take(), alarm.fired, alarm.state.quiet
        (True, False, 1, 0)
        >>> alarm.post_line(2.5); alarm.crossed(3.0), alarm.crossed(torch.tensor(2.0)), alarm.crossed(None)
        (True, False, False)
    """

    __slots__ = ("fired", "line", "pending", "state")

    def __init__(self, state: Any) -> None:
        self.state = state  # (the TapState: what ends the quiet window)
        self.pending = False
        self.fired = 0
        self.line = math.inf  # (a float read by the training thread, written by the worker: no lock)

    def fire(self) -> None:
        """A detector's count rose (worker thread; never blocks)."""
        self.fired += 1
        self.pending = True
        self.state.quiet = 0

    __call__ = fire

    def take(self) -> bool:
        """Whether a detector fired since the last call (training thread)."""
        if self.pending:
            self.pending = False
            return True
        return False

    def post_line(self, level: float) -> None:
        """The loss a step must pass to be a spike now (worker thread; ``inf``: none yet)."""
        self.line = level

    def crossed(self, loss: object) -> bool:
        """Whether a step's loss (a number or a one-element CPU tensor) passes :attr:`line`; a device
        loss is never read here (no sync): it waits for the next record."""
        if isinstance(loss, torch.Tensor):
            if not loss.is_cpu or loss.numel() != 1:
                return False
            loss = loss.item()
        return isinstance(loss, float | int) and loss > self.line


class NonFiniteGuard:
    """The sentinel, its escalation and its reaction for one Watch (training thread only).

    Args:
        checks: what the sentinel checks (``observe(sentinel=)``, checked); empty: no sentinel.
        auto_grad_norm: the gradient norm joins the checks on trial (``sentinel=None`` under a governor).
        budget: the governor's budget (the trial's yardstick), None with a fixed interval.
        escalate: steps sampled in full after a trip (0: never).
        reaction: ``observe(on_nonfinite=)``.
        rank: this process's rank (what a raised error names).
        alarm: the detectors' :class:`Alarm`, which escalates too (None: only trips do).

    Attributes:
        escalated_until: while escalated, the first step after the escalation; else None.
        escalations: escalations started so far.
    """

    def __init__(
        self,
        checks: Collection[str],
        auto_grad_norm: bool,
        budget: float | None,
        *,
        escalate: int,
        reaction: Reaction,
        rank: int,
        alarm: Alarm | None = None,
    ) -> None:
        self.sentinel = Sentinel(grad_norm="grad_norm" in checks or auto_grad_norm) if checks else None
        if self.sentinel is not None:
            self.sentinel.alarm = alarm  # (a device loss's values meet LossSpike's line there)
        self.checks_loss = "loss" in checks
        # (grad-norm check seconds, step seconds) of the first steps, while an automatic grad-norm check
        # is on trial against the governor's budget; None when no trial runs
        self._trial: list[tuple[float, float]] | None = [] if auto_grad_norm else None
        self._budget = budget
        self._escalate = escalate
        self._reaction = reaction
        self.raises = reaction == "raise"
        self._rank = rank
        self.escalated_until: int | None = None
        self.escalations = 0
        self.alarm = alarm
        self.tripped: list[int] = []  # sentinel trips learnt at this step's boundary
        self._trip_kind = "loss"  # what the last trip saw go bad: "loss" or "grad_norm"
        self._last_trip = -2

    @property
    def idle(self) -> bool:
        """Whether the step's end has nothing for the guard but a CPU loss to look at: no escalation, no
        trial, a sentinel with no device probes pending (a quiet step may then skip the full boundary)."""
        sentinel = self.sentinel
        alarm = self.alarm
        return (
            self.escalated_until is None
            and (alarm is None or not alarm.pending)
            and (sentinel is None or (sentinel.idle and self._trial is None))
        )

    @property
    def quiet_ready(self) -> bool:
        """Whether a quiet step may end without the full boundary, a device loss's probe waiting for its
        batch (or its copy in flight) allowed: no escalation, no trial, a sentinel with no gradient-norm
        check and no failed step to report (:attr:`Sentinel.takes_quiet_probes`)."""
        sentinel = self.sentinel
        return (
            self.escalated_until is None
            and self._trial is None
            and (sentinel is None or sentinel.idle or sentinel.takes_quiet_probes)
        )

    def crossed(self) -> bool:
        """Whether a device loss read from the sentinel's batches passed LossSpike's line since the last
        call: the boundary then sends the step log at once, as for a CPU loss past it."""
        return self.sentinel is not None and bool(self.sentinel.take_crossed())

    def needs(self, loss: object) -> bool:
        """Whether the sentinel has anything to check at a step that ended with ``loss`` (checked): not
        for a finite number it reads already, while idle and without a trip to report."""
        sentinel = self.sentinel
        return sentinel is not None and not (
            type(loss) is float
            and math.isfinite(loss)
            and self.checks_loss
            and not self.tripped
            and self._trial is None
            and sentinel.idle
        )

    def escalated(self, step: int) -> bool:
        """Whether ``step`` is escalated (sampled in full); an escalation past its end is over. A detector's
        alarm taken here starts one from ``step`` on (one escalation at a time, as for trips)."""
        until = self.escalated_until
        if until is not None and step >= until:
            self.escalated_until = until = None
        alarm = self.alarm
        if alarm is not None and alarm.take() and until is None and self._escalate:
            self.escalated_until = until = step + self._escalate
            self.escalations += 1
        return until is not None

    def check(
        self,
        step: int,
        loss: torch.Tensor | float | None,
        grads: Callable[[], Sequence[torch.Tensor]],
        seconds: float,
    ) -> None:
        """The per-step finite check of ``step`` (``grads``: the gradients, asked only when the
        gradient norm is checked); a trip may escalate. A failure raises: the caller counts it."""
        sentinel = self.sentinel
        assert sentinel is not None
        if self.tripped:
            self.tripped = []
        trial = self._trial
        start = time.perf_counter() if trial is not None else 0.0
        gradients = grads() if sentinel.grad_norm else ()
        tripped = sentinel.check(step, loss if self.checks_loss else None, gradients)
        if trial is not None and gradients:
            self._judge_grad_norm(trial, time.perf_counter() - start, seconds)
        if not tripped:
            return
        self.tripped = tripped
        # what tripped: the gradients where the sentinel saw them go bad with a finite loss (or none
        # checked); else the loss (a device flag covers both: the loss, if it is checked)
        self._trip_kind = "grad_norm" if sentinel.grads_tripped or not self.checks_loss else "loss"
        if self._escalate and self.escalated_until is None:
            # From the next step on, every step is sampled in full (every tapped kind): when the fault
            # recurs, its record holds the origin. One escalation at a time: bounded cost.
            self.escalated_until = step + 1 + self._escalate
            self.escalations += 1
            if self._reaction == "warn":
                log.warning(
                    "streamwatch: non-finite %s at step %d (sentinel); sampling every step, every tapped "
                    "kind, for the next %d steps so that the origin is recorded if it happens again",
                    "gradients" if self._trip_kind == "grad_norm" else "loss",
                    tripped[0],
                    self._escalate,
                )

    def drain(self) -> None:
        """``close()``: the device probes not yet read (the last batch, copies in flight) are checked
        now, waiting for the device; a trip is logged (too late to escalate, never raised). A failure
        raises: the caller counts it."""
        sentinel = self.sentinel
        if sentinel is None:
            return
        tripped = sentinel.drain()
        if tripped:
            log.warning(
                "streamwatch: non-finite %s at step %d (sentinel, read at close(): the last steps' device "
                "checks are read there)%s",
                "gradients or loss" if sentinel.grad_norm else "loss",
                tripped[0],
                f", and at {len(tripped) - 1} later step(s)" if len(tripped) > 1 else "",
            )

    def checks(self) -> tuple[str, ...]:
        """What the sentinel checks now (``statistics().sentinel``)."""
        sentinel = self.sentinel
        if sentinel is None:
            return ()
        checks = ("loss",) if self.checks_loss else ()
        return (*checks, "grad_norm") if sentinel.grad_norm and self._trial is None else checks

    @property
    def trips(self) -> int:
        """Steps whose sentinel found a non-finite value."""
        return 0 if self.sentinel is None else self.sentinel.trips

    def _judge_grad_norm(self, trial: list[tuple[float, float]], cost: float, seconds: float) -> None:
        """Keep the gradient-norm check if, over the first :data:`GRAD_NORM_TRIAL` steps that had
        gradients, its median cost is at most a quarter of what the budget allows per step (``budget *
        step seconds``); else turn it off for the run."""
        if seconds > 0:
            trial.append((cost, seconds))
        if len(trial) < GRAD_NORM_TRIAL:
            return
        costs = sorted(c for c, _ in trial)
        steps = sorted(s for _, s in trial)
        affordable = costs[len(costs) // 2] <= 0.25 * (self._budget or 0.0) * steps[len(steps) // 2]
        assert self.sentinel is not None
        self.sentinel.set_grad_norm(affordable)
        self._trial = None

    def raise_nonfinite(
        self, tracker: NonFiniteTracker, sent: Collection[int], flush: Callable[[], Any]
    ) -> None:
        """``on_nonfinite="raise"``: raise :class:`streamwatch.NonFiniteError` for a new episode. A trip
        on a step whose record was ``sent`` waits (``flush``) for the worker's verdict on it (the
        origin); a trip on a step without a record raises with what the sentinel saw; a verdict the
        worker found on its own (a non-finite tensor while the loss stayed finite) is raised as soon as
        it is there."""
        tripped, self.tripped = self.tripped, []
        new = [t for t in tripped if t != self._last_trip + 1]  # consecutive trips: one episode
        if tripped:
            self._last_trip = tripped[-1]
        if new and new[0] in sent:
            flush()
        verdict = tracker.take_verdict()
        if verdict is not None:
            raise verdict.error()
        episode = tracker.episode
        if new and new[0] in sent and episode is not None and episode.step < new[0]:
            # the record continues an episode whose verdict was taken already (the caller went on)
            raise episode.error(
                f"step {new[0]}'s loss is non-finite too: the episode that began there goes on"
            )
        if new:
            kind = self._trip_kind
            seen = FirstNonFinite(new[0], "train", "", kind, "", "", direction_of(kind), self._rank)
            raise seen.error(
                "the step was not sampled, so only the sentinel saw it and the origin is unknown: sample "
                'more steps (every=) or use on_nonfinite="warn", whose escalation records the origin if it '
                "recurs"
            )
