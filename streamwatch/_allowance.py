"""Evaluation passes' share of the overhead budget.

An evaluation pass (a forward under ``model.eval()`` or ``torch.no_grad()``) is summarised whatever the
step samples: a validation loop between two training steps is recorded as ``phase="eval"``. A loop that
runs such passes on every step — a reinforcement-learning loop generating with the policy token by token,
PPO's pass for the old log-probabilities, an evaluation batch per step — would then pay for them on every
step, a cost the overhead governor cannot sample away: 1.20–1.29× under the 2 % budget on a small
language model generating 8 tokens a step (``benchmarks/bench_eval_passes.py``; docs/governor.md,
*Evaluation passes between sampled steps*).

Under the governor, an :class:`EvalAllowance` gives those passes a share of the budget: it fills at
``budget × EVAL_SHARE`` seconds of streamwatch's own time per second of wall time, up to
``WINDOW_SECONDS`` of that (it starts full, so a first validation loop is recorded whole); each pass is
granted on its own and spends what its hooks took (``TapSet`` grants and charges). A pass that begins
with the allowance spent runs without hooks, counted (``skipped["eval_budget"]``). With ``every=N``
there is no allowance: every pass is summarised.

Example:
    >>> clock = iter([0.0, 0.0, 0.0, 10.0]).__next__
    >>> allowance = EvalAllowance(0.02, clock=clock)  # 1 % of the time: 0.6 s at most
    >>> allowance.grant(), allowance.charge(0.6), allowance.grant()  # at 0 s: spent
    (True, None, False)
    >>> allowance.grant()  # 10 s later: 0.1 s back
    True
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["EVAL_SHARE", "WINDOW_SECONDS", "EvalAllowance"]

EVAL_SHARE = 0.5
"""The fraction of the overhead budget evaluation passes between sampled steps may spend; the governor
sees their cost in the unsampled steps' and keeps the whole within the budget with the rest."""

WINDOW_SECONDS = 60.0
"""How many seconds of the allowance's rate it holds at most (and starts with): the governor's time
ceiling, so an evaluation loop that comes once a minute or less often is recorded whole."""


class EvalAllowance:
    """Seconds of hook time evaluation passes may spend, refilled with wall time (a token bucket).

    Args:
        budget: the overhead budget (``observe(overhead=...)``), a fraction of the run's time.
        clock: seconds, monotonic (the governor's clock).
        window: seconds of refill held at most, and at the start (None: :data:`WINDOW_SECONDS`).
    """

    def __init__(
        self, budget: float, clock: Callable[[], float] = time.perf_counter, window: float | None = None
    ) -> None:
        self.rate = budget * EVAL_SHARE
        self.cap = self.rate * (WINDOW_SECONDS if window is None else window)
        self.left = self.cap
        self._clock = clock
        self._last = clock()

    def grant(self) -> bool:
        """Whether an evaluation pass beginning now may be summarised (the allowance is not spent)."""
        now = self._clock()
        self.left = min(self.cap, self.left + self.rate * max(0.0, now - self._last))
        self._last = now
        return self.left > 0.0

    def charge(self, seconds: float) -> None:
        """Spend what a summarised pass took (its hooks, and putting them in and out)."""
        self.left -= max(0.0, seconds)
