"""The worker's cost per record, stage by stage, on one quiet thread.

Run (after ``make env``)::

    .venv/bin/python benchmarks/profile_worker.py             # the demo MLP, every step sampled
    .venv/bin/python benchmarks/profile_worker.py mlp --steps 500

The model, data and step are ``bench_observe.py``'s, observed with ``every=1`` (everything the default
cadence samples, on every step). The worker is held back while training runs, so every record waits in
the channel; then the garbage collector's heap is frozen (the queued records would otherwise make every
collection slow) and the worker drains them alone while the training thread sleeps. Timers wrap each
stage:

* **resolve**: ``PendingRecord.resolve`` (the copy off the device, merging rows into the summary table);
* each **pipeline** the watch runs: the series store (latest values and the worker-side metrics), the
  non-finite tracker and the detectors.

This is the floor of the worker's cost: concurrently with training (``profile_observe.py``'s "worker
busy per record") the same work takes longer, because the two threads share caches and cores.

While the worker is held back, each sampled ``watch.step()`` is timed too: its own cost on the training
thread (median over the steps after the first tenth), with no worker competing for the GIL;
``--step-args loss`` or ``none`` passes it the loss alone or nothing (no train accuracy, no batch size),
to show what the arguments cost. Not a test and not part of ``make bench``: it prints a table.

``--governed`` observes with the default overhead governor instead of ``every=1`` and times the
boundaries that end a sampled step apart from the others (median of each; a sampled step's boundary
there also takes the hooks out for the unsampled steps after it, and ticks the governor).

``--main-thread`` measures the work without the thread: the worker never starts, the queued records are
taken from the channel and resolved and pushed through the watch's pipelines on the main thread, several
passes over the same records, each stage's best pass reported. On a shared VM, where the worker thread's
time swings by 2× between runs, this is the steadier number for comparing two versions of the code (run
both in the same hour, alternating)::

    .venv/bin/python benchmarks/profile_worker.py transformer --steps 200 --main-thread
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_observe as bench  # the benchmark's models and step (not a package)
from profile_observe import run_steps  # its training loop (importing it instruments nothing)

import streamwatch as sw
from streamwatch import _channel, _pipeline, _record, _worker

STAGES = ("SeriesStore", "NonFiniteTracker", "LossSpike", "GradientSpike", "UpdateRatioBand")
"""Pipelines by what their description names (anything else is reported under its own description)."""


def stage_of(pipeline: _pipeline.Pipeline) -> str:
    text = str(pipeline)
    return next((name for name in STAGES if name in text), text[:60])


def instrument(timers: dict[str, float], gate: threading.Event) -> None:
    """Hold the worker at its first receive until ``gate`` is set; time resolve and every pipeline."""
    recv_many = _channel.Receiver.recv_many
    push = _pipeline.Pipeline.push
    resolve = _record.PendingRecord.resolve
    clock = time.perf_counter

    def gated_recv_many(self: Any, limit: int, timeout: float | None = None) -> Any:
        gate.wait()
        return recv_many(self, limit, timeout)

    stages: dict[int, str] = {}  # by pipeline: describing one per push would be timed with it

    def timed_push(self: _pipeline.Pipeline, item: Any) -> None:
        start = clock()
        try:
            push(self, item)
        finally:
            elapsed = clock() - start
            stage = stages.get(id(self))
            if stage is None:
                stage = stages[id(self)] = stage_of(self)
            timers[stage] += elapsed

    def timed_resolve(self: _record.PendingRecord) -> Any:
        start = clock()
        try:
            return resolve(self)
        finally:
            timers["resolve"] += clock() - start

    _channel.Receiver.recv_many = gated_recv_many  # type: ignore[method-assign]
    _pipeline.Pipeline.push = timed_push  # type: ignore[method-assign]
    _record.PendingRecord.resolve = timed_resolve  # type: ignore[method-assign]


def time_steps(durations: list[float], unsampled: list[float] | None = None) -> None:
    """Append each ``watch.step()``'s wall time to ``durations``; with ``unsampled``, those that end an
    unsampled step go there instead."""
    step = sw.Watch.step
    clock = time.perf_counter

    def timed_step(self: sw.Watch, *args: Any, **kwargs: Any) -> None:
        sampled = unsampled is None or self._sampling_now
        start = clock()
        try:
            step(self, *args, **kwargs)
        finally:
            (durations if sampled or unsampled is None else unsampled).append(clock() - start)

    sw.Watch.step = timed_step  # type: ignore[method-assign]


def profile(name: str, steps: int, step_args: str = "full", governed: bool = False) -> list[str]:
    timers: dict[str, float] = defaultdict(float)
    gate = threading.Event()
    instrument(timers, gate)
    durations: list[float] = []
    unsampled: list[float] = []
    time_steps(durations, unsampled if governed else None)
    spec = bench.SPECS[name]
    x, y = spec.data()
    model = bench.build(spec)
    opt = torch.optim.SGD(model.parameters(), lr=bench.LR)
    cadence: dict[str, Any] = {} if governed else {"every": 1}
    with sw.observe(model, opt, capacity=steps + 8, **cadence) as watch:
        run_steps(model, opt, watch, steps, x, y, [], step_args)
        gc.collect()
        gc.freeze()
        start = time.perf_counter()
        gate.set()
        if not watch.flush(timeout=120):
            raise RuntimeError("the worker did not drain the records within 120 s")
        drained = time.perf_counter() - start
        busy = watch._worker.statistics().busy_seconds
        rows = watch.snapshot() and len(watch.store.table()[1])
    gc.unfreeze()
    records = watch.statistics().sampled + watch.statistics().scalar_records
    us = 1e6 / records
    sampled = statistics.median(durations[len(durations) // 10 :]) * 1e6
    how = f"the default governor, {len(durations)} sampled" if governed else "every=1"
    lines = [
        f"{name}: {records} records of {rows} rows, drained alone ({how})",
        f"  {f'sampled watch.step({step_args}), median':<34}{sampled:>8.1f} µs   (the worker held back)",
        f"  {'worker busy per record':<34}{busy * us:>8.1f} µs   (drain wall time {drained * us:.1f} µs)",
    ]
    if governed:
        quiet = statistics.median(unsampled[len(unsampled) // 10 :]) * 1e6
        lines.append(f"  {'unsampled watch.step(), median':<34}{quiet:>8.1f} µs")
    for stage, seconds in sorted(timers.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {stage:<32}{seconds * us:>8.1f} µs")
    return lines


def profile_main_thread(name: str, steps: int, passes: int) -> list[str]:
    """The worker's work per record on the main thread: each stage's best of ``passes`` passes."""
    start_worker = _worker.Worker.start
    _worker.Worker.start = lambda self: self  # type: ignore[method-assign]  # records stay queued
    try:
        spec = bench.SPECS[name]
        x, y = spec.data()
        model = bench.build(spec)
        opt = torch.optim.SGD(model.parameters(), lr=bench.LR)
        watch = sw.observe(model, opt, every=1, capacity=steps + 8)
    finally:
        _worker.Worker.start = start_worker  # type: ignore[method-assign]
    run_steps(model, opt, watch, steps, x, y, [])
    worker = watch._worker
    items = worker._receiver.recv_many(steps + 8, timeout=0)
    prepare, pipelines = worker._prepare, worker.pipelines
    assert prepare is not None
    stages = [stage_of(p) for p in pipelines]
    gc.collect()
    gc.freeze()
    clock = time.perf_counter
    best: dict[str, float] = defaultdict(lambda: float("inf"))
    totals = []
    for _ in range(passes):
        timers: dict[str, float] = defaultdict(float)
        for item in items:
            start = clock()
            record = prepare(item)
            timers["resolve"] += clock() - start
            for stage, pipeline in zip(stages, pipelines, strict=True):
                start = clock()
                pipeline.push(record)
                timers[stage] += clock() - start
        totals.append(sum(timers.values()))
        for stage, seconds in timers.items():
            best[stage] = min(best[stage], seconds)
    gc.unfreeze()
    watch.close()
    us = 1e6 / len(items)
    lines = [
        f"{name}: {len(items)} records, resolved and pushed on the main thread, best of {passes} passes",
        f"  {'work per record':<34}{min(totals) * us:>8.1f} µs   "
        f"(median pass {statistics.median(totals) * us:.1f} µs)",
    ]
    for stage, seconds in sorted(best.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {stage:<32}{seconds * us:>8.1f} µs")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="demo", choices=sorted(bench.SPECS))
    parser.add_argument("--steps", type=int, default=2000, help="records to queue and drain")
    parser.add_argument(
        "--main-thread", action="store_true", help="the work alone: resolve and push on the main thread"
    )
    parser.add_argument("--passes", type=int, default=5, help="passes over the records (--main-thread)")
    parser.add_argument(
        "--step-args",
        choices=("full", "loss", "none"),
        default="full",
        help="what watch.step() is given: loss, outputs, targets, batch size (full); the loss alone; nothing",
    )
    parser.add_argument(
        "--governed", action="store_true", help="the default overhead governor instead of every=1"
    )
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.main_thread:
        print("\n".join(profile_main_thread(args.model, args.steps, args.passes)))
    else:
        print("\n".join(profile(args.model, args.steps, args.step_args, args.governed)))


if __name__ == "__main__":
    main()
