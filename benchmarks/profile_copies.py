"""How far apart identical unwatched copies of a model read, interleaved like ``test_governor``.

Builds ``COPIES`` copies of one benchmark model, none of them watched, runs them in the governor
benchmark's short interleaved rounds (``Spec.governor``: the same round length, warm-up and rotation,
each round's first step unrecorded) and prints, for several estimators of a copy's cost per step, how far
the copies read from their mean: the standard deviation and the range, in percent. Every copy does the
same work, so any spread is noise the benchmark's ratios carry too; it is why ``test_governor`` takes the
mean of two baseline copies and reports first quartiles (docs/performance.md).

Usage::

    python benchmarks/profile_copies.py mlp 48 6      # MODEL CYCLES COPIES
    mlp 48 6 median sd 0.89% range 2.66% | q1 sd 0.43% range 1.20% | ...
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_observe as bench  # (run as a script from anywhere)

ESTIMATORS: dict[str, Callable[[np.ndarray], float]] = {
    "median": lambda t: float(np.median(t)),
    "q1": lambda t: float(np.percentile(t, 25)),
    "q10": lambda t: float(np.percentile(t, 10)),
    "mean": lambda t: float(np.mean(t)),
}


def spread(costs: list[float]) -> tuple[float, float]:
    """(standard deviation, range) of ``costs`` relative to their mean, in percent.

    Example:
        >>> spread([1.0, 1.0, 1.0])
        (0.0, 0.0)
        >>> [round(x, 2) for x in spread([0.99, 1.01])]
        [1.41, 2.0]
    """
    values = np.asarray(costs) / np.mean(costs)
    return 100 * float(values.std(ddof=1)), 100 * float(values.max() - values.min())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(bench.SPECS))
    parser.add_argument("cycles", type=int, help="measured cycles (one round of every copy each)")
    parser.add_argument("copies", type=int, help="identical unwatched copies (at least 2)")
    args = parser.parse_args()
    if args.copies < 2 or args.cycles < 1:
        parser.error("need at least 2 copies and 1 cycle")
    spec = bench.SPECS[args.model]
    x, y = spec.data()
    steps, _, warmup = spec.governor
    copies = [bench.Variant(f"copy{i}", bench.build(spec), period=1) for i in range(args.copies)]
    for cycle in range(warmup + args.cycles):
        shift = cycle % len(copies)
        for copy in copies[shift:] + copies[:shift]:
            copy.recording = cycle >= warmup
            copy.run(steps, x, y, skip_first=True)
    parts = []
    for name, estimate in ESTIMATORS.items():
        sd, width = spread([estimate(np.asarray(copy.measured())) for copy in copies])
        parts.append(f"{name} sd {sd:.2f}% range {width:.2f}%")
    print(args.model, args.cycles, args.copies, " | ".join(parts))


if __name__ == "__main__":
    main()
