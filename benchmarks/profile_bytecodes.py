"""Bytecodes one sampled ``watch.step()`` executes, function by function: a count that does not move.

A sampled boundary runs right after a training step has evicted the interpreter's caches, so its time
on this VM follows the number of bytecodes and distinct calls it executes (about 0.08 µs a bytecode,
cold) far more than what each one does (``benchmarks/profile_cold.py``). Its wall time moves by ±10 %
from one run to the next; this count does not, so it is the number to compare two versions of the
boundary by (``benchmarks/profile_worker.py`` gives the time).

Run (after ``make env``)::

    .venv/bin/python benchmarks/profile_bytecodes.py                  # the MLP, every=1
    .venv/bin/python benchmarks/profile_bytecodes.py transformer --governed
    .venv/bin/python benchmarks/profile_bytecodes.py mlp --lines      # and line by line

The model, data and loop are ``bench_observe.py``'s. With ``every=1`` (the default here) the step
traced is the 21st; with ``--governed`` (the default overhead governor) it is the first sampled step
after 600 steps, whose boundary also takes the hooks out for the unsampled steps after it and ticks the
governor. The worker is held back, so none of its bytecodes are counted. Not a test and not part of
``make bench``: it prints a table.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_observe as bench  # the benchmark's models and step (not a package)
from profile_observe import run_steps  # its training loop (importing it instruments nothing)

import streamwatch as sw
from streamwatch import _channel


def count(name: str, governed: bool) -> tuple[int, collections.Counter[tuple[str, str, int]]]:
    """The bytecodes of one sampled ``watch.step()``: the total, and by (file, function, line)."""
    gate = threading.Event()
    recv_many = _channel.Receiver.recv_many

    def held(self: Any, limit: int, timeout: float | None = None) -> Any:  # the worker waits here
        gate.wait()
        return recv_many(self, limit, timeout)

    lines: collections.Counter[tuple[str, str, int]] = collections.Counter()

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            lines[(Path(code.co_filename).name, code.co_name, frame.f_lineno or 0)] += 1
        return tracer

    step = sw.Watch.step
    armed = {"on": False, "done": False}

    def traced(self: sw.Watch, *args: Any, **kwargs: Any) -> None:
        if armed["on"] and not armed["done"] and self._boundary._sampling_now:
            armed["done"] = True
            sys.settrace(tracer)
            try:
                step(self, *args, **kwargs)
            finally:
                sys.settrace(None)
            return
        step(self, *args, **kwargs)

    _channel.Receiver.recv_many = held  # type: ignore[method-assign]
    sw.Watch.step = traced  # type: ignore[method-assign]
    try:
        spec = bench.SPECS[name]
        x, y = spec.data()
        model = bench.build(spec)
        opt = torch.optim.SGD(model.parameters(), lr=bench.LR)
        warm = 600 if governed else 20
        cadence: dict[str, Any] = {} if governed else {"every": 1}
        with sw.observe(model, opt, capacity=warm + 400, **cadence) as watch:
            run_steps(model, opt, watch, warm, x, y, [])
            armed["on"] = True
            while not armed["done"]:
                run_steps(model, opt, watch, 1, x, y, [])
            gate.set()
    finally:
        _channel.Receiver.recv_many = recv_many  # type: ignore[method-assign]
        sw.Watch.step = step  # type: ignore[method-assign]
    return sum(lines.values()), lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="mlp", choices=sorted(bench.SPECS))
    parser.add_argument("--governed", action="store_true", help="the default governor instead of every=1")
    parser.add_argument("--lines", action="store_true", help="also every line that ran, with its count")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    total, lines = count(args.model, args.governed)
    functions: collections.Counter[tuple[str, str]] = collections.Counter()
    for (file, function, _), n in lines.items():
        functions[(file, function)] += n
    how = "the default governor" if args.governed else "every=1"
    print(
        f"{args.model} ({how}): one sampled watch.step() runs {total} bytecodes in {len(functions)} functions"
    )
    for (file, function), n in functions.most_common():
        print(f"  {n:6d}  {file}:{function}")
    if args.lines:
        for (file, function, line), n in sorted(lines.items()):
            print(f"  {n:6d}  {file}:{line} ({function})")


if __name__ == "__main__":
    main()
