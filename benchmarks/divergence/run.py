"""The divergence benchmark: every scenario, every detector, steps of warning and false alarms (Markdown).

    python benchmarks/divergence/run.py [--only NAME ...]        (make bench-divergence)

Each scenario is trained twice from its seed, under the default overhead governor (``observe(model,
opt)``) and with every step sampled (``every=1``); the two runs' losses are checked to be identical
(monitoring never changes training), so the divergence step and the loss-only baselines — Lightning's
``SpikeDetection`` with its defaults and a plain 50-step z-score above 3 — are the same for both. The
criterion, the onset and how a firing is judged: ``harness.py``. A cell is the lead (steps from the first
warning to the divergence step), **missed**, or, on a healthy control, its false alarms (fa).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    FACTOR,
    WINDOW,
    Firing,
    Trace,
    Verdict,
    detector_firings,
    spike_detection_firings,
    train,
    verdict,
    zscore_firings,
)
from scenarios import SCENARIOS, Scenario

from streamwatch import detectors

Column = tuple[str, str, Callable[[Trace], list[Firing]]]
"""A column of the table: its title, which run it reads (``governor`` or ``every=1``), its judge."""


def columns() -> list[Column]:
    cols: list[Column] = []
    for name, make in (
        ("LossSpike", detectors.LossSpike),
        ("GradientSpike", detectors.GradientSpike),
        ("UpdateRatioBand", detectors.UpdateRatioBand),
        ("Drift", detectors.Drift),
    ):
        for run in ("governor", "every=1"):
            cols.append(
                (f"{name} ({run})", run, lambda trace, make=make: detector_firings(make(), trace.records))
            )
    cols.append(("Lightning SpikeDetection", "every=1", lambda trace: spike_detection_firings(trace.losses)))
    cols.append(("z-score 50/3", "every=1", lambda trace: zscore_firings(trace.losses)))
    return cols


def delivery_lag(trace: Trace) -> tuple[float, int]:
    """(median, max) steps between an unsampled step and the record that carried it to the worker."""
    lags = [r.step - s.step for r in trace.records for s in r.steps]
    return (statistics.median(lags), max(lags)) if lags else (0.0, 0)


def judge(scenario: Scenario, cols: Sequence[Column]) -> tuple[Trace, list[Verdict], float]:
    start = time.perf_counter()
    traces = {"governor": train(scenario, {}), "every=1": train(scenario, {"every": 1})}
    governed, every = traces["governor"], traces["every=1"]
    if governed.losses != every.losses:
        raise AssertionError(f"{scenario.name}: the two runs' losses differ: monitoring changed training")
    d = every.divergence
    if scenario.control and d is not None:
        print(f"warning: control {scenario.name} diverged at step {d}", file=sys.stderr)
    if not scenario.control and (d is None or d < (scenario.onset or 0)):
        print(f"warning: {scenario.name} diverged at {d}, onset {scenario.onset}", file=sys.stderr)
    verdicts = [verdict(judge(traces[run]), scenario.onset, d) for _, run, judge in cols]
    lag = delivery_lag(governed)
    sampled = sum(1 for r in governed.records if r.keys)
    every.extra["governor"] = f"{sampled} sampled steps, lag median {lag[0]:g} / max {lag[1]} steps"
    return every, verdicts, time.perf_counter() - start


def table(rows: Sequence[tuple[Scenario, Trace, list[Verdict]]], cols: Sequence[Column]) -> str:
    head = ["scenario", "onset", "diverges"] + [title for title, _, _ in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for scenario, trace, verdicts in rows:
        onset = "control" if scenario.control else str(scenario.onset)
        d = "—" if trace.divergence is None else str(trace.divergence)
        lines.append("| " + " | ".join([scenario.name, onset, d] + [v.cell() for v in verdicts]) + " |")
    summary = ["**median lead (missed)**", "", ""]
    alarms = ["**false alarms on controls**", "", ""]
    for i in range(len(cols)):
        diverging = [r[2][i] for r in rows if r[2][i].diverged]
        leads = [v.lead for v in diverging if v.lead is not None]
        missed = len(diverging) - len(leads)
        summary.append(f"{statistics.median(leads):g} ({missed})" if leads else f"— ({missed})")
        alarms.append(str(sum(r[2][i].false_alarms for r in rows if not r[2][i].diverged)))
    lines += ["| " + " | ".join(summary) + " |", "| " + " | ".join(alarms) + " |"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="scenario names (default: all)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    chosen = [s for s in SCENARIOS if args.only is None or s.name in args.only]
    if not chosen:
        parser.error(f"no scenario named {args.only}; known: {[s.name for s in SCENARIOS]}")
    cols = columns()
    rows = []
    for scenario in chosen:
        trace, verdicts, seconds = judge(scenario, cols)
        print(
            f"{scenario.name}: {len(trace.losses)} steps, diverges at {trace.divergence}, {seconds:.1f} s",
            file=sys.stderr,
        )
        rows.append((scenario, trace, verdicts))
    print(
        f"Ground truth: first non-finite loss, or trailing {WINDOW}-step median > {FACTOR:g}× the best one "
        f"that ended {WINDOW}+ steps before. Cells: steps of warning (lead), **missed**, fa = false alarms.\n"
    )
    print(table(rows, cols))
    print("\nUnder the governor (sampled steps; lag: from an unsampled step to the record carrying it):")
    for scenario, trace, _ in rows:
        print(f"- {scenario.name}: {len(trace.losses)} steps, {trace.extra['governor']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
