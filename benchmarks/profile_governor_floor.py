"""How steady the governor's floor is in one process: every measurement of it, and the interval after each.

Run (after ``make env``; under ``flock`` where another benchmark may run beside it)::

    .venv/bin/python benchmarks/profile_governor_floor.py                     # the demo MLP, 60 s
    .venv/bin/python benchmarks/profile_governor_floor.py --model mlp --seconds 120
    .venv/bin/python benchmarks/profile_governor_floor.py --model demo --remeasure 0   # drift only

One copy of a benchmark model (``bench_observe.py``'s models, data and step, ``torch.set_num_threads(2)``
unless ``--threads``) trains under ``observe(model, opt)`` (the default governor, 2 %) for ``--seconds``.
The governor measures its floor (docs/governor.md, *The floor*) in two parts: the *seen* part, from the
own time of the recent clean steps, retaken every few clean steps, and the *unseen* part, measured
by a run of dark pairs once the governor has calibrated and again only when the step time drifts by
``DARK_DRIFT``. One process would see one or two measurements of the unseen part, so the script asks for
a new one ``--remeasure`` steps after each completes (it forgets the step time the last was taken at,
as a drift would: ``0`` leaves the governor alone). Each line is one completed measurement: the step,
the seen and unseen parts as the governor holds them after it (``f = seen + unseen``), what that
measurement alone read (the dark pairs' own reading, before the governor pools it with earlier ones),
the cost ratio and the interval the governor chose from them, and the baseline step time; after ``|``,
the same dark and lit steps read by the rule before the pool (each measurement alone: the lit steps'
median less the dark steps', never below 0), the floor with it, and the interval it gives with the
same seen part and cost ratio: the two rules side by side on one machine's noise, which moves too
much between runs to compare them run against run. A summary gives each column's min / median / max
and max ÷ min over the measurements after the first (the first is taken in the first few hundred
steps, against a warming cache). Not a test and not part of ``make bench``: it prints a table; its
numbers move with the machine. Against the code before the pool (``PYTHONPATH`` at a checkout of it)
the governor's own columns are the rule before, its seen part included.

The sentinel checks the loss only (``sentinel=("loss",)``): ``observe()``'s default also tries the
gradient-norm check over the first 8 steps and keeps it where it looks affordable, and on a busy machine
those first steps (warm-up, a neighbour) sometimes make it look so on the demo MLP, where it then costs
about 40 % of every step, all of it in the floor, and every dark pair is declined. That is what the
trial decides, not the governor; ``--grad-norm-trial`` leaves the default (a note says if it stayed on).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_observe as bench  # the benchmark's models and step (not a package)

import streamwatch as sw
from streamwatch import _governor


@dataclass(frozen=True)
class Measurement:
    """The governor just after one measurement of the floor's unseen part, and that measurement's dark and
    lit steps read by the rule before the pool (each measurement alone, by medians)."""

    step: int
    seen: float  # the floor's seen part (own time) as the governor holds it
    unseen: float  # the unseen part as the governor holds it (a ratio to the baseline)
    reading: float  # this measurement's own reading of the unseen part (a ratio to the baseline)
    cost: float  # the cost ratio r
    interval: int  # the interval chosen after it
    step_ms: float  # the baseline
    by_median: float  # the same steps read as before: the lit steps' median less the dark steps', alone
    interval_by_median: int  # the interval that reading gives, with the same seen part and cost ratio

    @property
    def floor(self) -> float:
        return self.seen + self.unseen


def _interval(gov: _governor.Governor, floor: float) -> int:
    """``ceil(r / (budget - floor))`` within ``[1, the ceiling]`` (the governor's rule, without its growth
    limit: where the governor is still growing the interval, its own answer is smaller)."""
    ratio, left, cap = gov.cost_ratio or 0.0, gov.budget - floor, gov._cap
    need = ratio / left if left > 0 else math.inf
    return 1 if need <= 1 else cap if need >= cap else max(1, math.ceil(need - 1e-9))


def _recorder(steps: list[int]) -> list[Measurement]:
    """Wrap the governor's end of a measurement to record each (``steps[0]``: the step count now)."""
    found: list[Measurement] = []
    measure = _governor.Governor._measure_unseen

    def wrapped(self: _governor.Governor) -> None:
        darks, lights = list(self._darks), list(self._lights)
        measure(self)
        base = self._step_seconds
        if not lights or not base:
            return
        stats = self.statistics()
        unseen = stats.unseen_ratio or 0.0
        seen = stats.floor_ratio - unseen
        by_median = max(0.0, statistics.median(lights) - statistics.median(darks)) / base
        pool = getattr(self, "_unseen_pool", None)  # (None: the code before the pool, measured alike)
        found.append(
            Measurement(
                step=steps[0],
                seen=seen,
                unseen=unseen,
                reading=pool[-1][0] if pool else unseen,
                cost=stats.cost_ratio or 0.0,
                interval=stats.interval,
                step_ms=1e3 * base,
                by_median=by_median,
                interval_by_median=_interval(self, seen + by_median),
            )
        )

    _governor.Governor._measure_unseen = wrapped  # type: ignore[method-assign]
    return found


def run(model_name: str, seconds: float, remeasure: int, threads: int, trial: bool) -> list[Measurement]:
    spec = bench.SPECS[model_name]
    model = bench.build(spec)
    torch.set_num_threads(threads)
    opt = torch.optim.SGD(model.parameters(), lr=bench.LR)
    x, y = spec.data()
    steps = [0]
    found = _recorder(steps)
    watch = sw.observe(model, opt) if trial else sw.observe(model, opt, sentinel=("loss",))
    gov = watch._governor
    assert gov is not None
    since, end, shown = None, time.perf_counter() + seconds, 0
    try:
        while time.perf_counter() < end:
            for _ in range(10):
                outputs = model(x)
                loss = F.cross_entropy(outputs, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                watch.step(loss=loss, outputs=outputs, targets=y, batch_size=x.shape[0])
                steps[0] += 1
            if len(found) > shown:
                print(_line(found[-1]), flush=True)
                shown, since = len(found), steps[0]
            if remeasure and since is not None and steps[0] - since >= remeasure and not gov._dark_todo:
                gov._unseen_at = None  # as a drift would: the next refresh starts a measurement
                since = None
    finally:
        stats = gov.statistics()
        print(
            f"ended after {steps[0]} steps: interval {stats.interval}, floor {stats.floor_ratio:.4f}, "
            f"{stats.dark_steps} dark steps, baseline {1e3 * (stats.step_seconds or math.nan):.3f} ms",
            flush=True,
        )
        sentinel = watch._sentinel
        if sentinel is not None and sentinel.grad_norm:  # (its cost is in every step's own time)
            print("note: the gradient-norm check stayed on (its trial kept it): the floor includes it")
        watch.close()
    return found


HEADER = (
    f"{'step':>8}{'seen':>9}{'unseen':>9}{'floor f':>9}{'reading':>9}{'r':>8}{'N':>6}{'step ms':>9}"
    f"  |{'by median':>10}{'f':>9}{'N':>6}"
)


def _line(m: Measurement) -> str:
    return (
        f"{m.step:>8}{m.seen:>9.4f}{m.unseen:>9.4f}{m.floor:>9.4f}{m.reading:>9.4f}{m.cost:>8.3f}"
        f"{m.interval:>6}{m.step_ms:>9.3f}  |{m.by_median:>10.4f}{m.seen + m.by_median:>9.4f}"
        f"{m.interval_by_median:>6}"
    )


def summary(found: list[Measurement]) -> None:
    later = found[1:]
    if len(later) < 2:
        print(f"{len(found)} measurement(s): too few for a spread (run longer)")
        return
    columns = {
        "seen": [m.seen for m in later],
        "unseen": [m.unseen for m in later],
        "floor f": [m.floor for m in later],
        "interval": [float(m.interval) for m in later],
        "reading": [m.reading for m in later],
        "by median": [m.by_median for m in later],
        "f so": [m.seen + m.by_median for m in later],
        "N so": [float(m.interval_by_median) for m in later],
    }
    print(f"spread over measurements 2-{len(found)} (min / median / max, max/min):")
    for name, values in columns.items():
        if name == "by median":
            print("  the same measurements, each alone by medians (the rule before the pool):")
        low, mid, high = min(values), statistics.median(values), max(values)
        factor = high / low if low > 0 else math.inf
        print(f"  {name:>9}: {low:.4f} / {mid:.4f} / {high:.4f}   x{factor:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(bench.SPECS), default="demo")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to train (default 60)")
    parser.add_argument(
        "--remeasure", type=int, default=2000, help="steps after a measurement to ask for the next (0: never)"
    )
    parser.add_argument("--threads", type=int, default=bench.THREADS, help="torch threads (default 2)")
    parser.add_argument(
        "--grad-norm-trial", action="store_true", help="leave observe()'s sentinel default (see above)"
    )
    args = parser.parse_args()
    print(f"streamwatch from {Path(sw.__file__).parent}; model {args.model}, {args.seconds:g} s", flush=True)
    print(HEADER, flush=True)
    found = run(args.model, args.seconds, args.remeasure, args.threads, args.grad_norm_trial)
    summary(found)


if __name__ == "__main__":
    main()
