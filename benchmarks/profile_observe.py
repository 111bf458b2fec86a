"""Where the monitored step's extra time goes: a per-step breakdown of ``observe(model, opt)`` (default).

Run (after ``make env``)::

    .venv/bin/python benchmarks/profile_observe.py            # all three benchmark models
    .venv/bin/python benchmarks/profile_observe.py mlp --rounds 12

The models, data and step are ``bench_observe.py``'s. A baseline copy and an observed copy run in
interleaved rounds (as in the benchmark); on the observed one, timers wrap the parts streamwatch adds to
the training thread:

* **hook bodies**: every hook streamwatch installs, measured inside torch's call (``_tapstate.guarded``);
  inside them, the **fused kernel** (the C call, ``FusedKernel.run``), **torch-path summaries**
  (``_tapstate.summarize``: CUDA, half precision, tensor subclasses) and the rest (Python around the calls,
  update Δ's copy and subtraction, ``register_hook`` on outputs);
* **watch.step()**: sealing the record and handing it over;
* **unattributed**: the observed step's median minus the baseline's minus the two above — torch's own
  hook dispatch, the autograd nodes that output-gradient hooks add, cache effects and waiting for the GIL
  while the worker thread holds it.

Beside it: the **worker's busy time per record** (resolve + pipelines, ``Worker.statistics``), which
runs concurrently but holds the GIL while it runs Python.

Numbers are per-step means of the timers and medians of whole steps over the measured rounds; timer
overhead is ~0.1 µs per call. Not a test and not part of ``make bench``: it prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_observe as bench  # the benchmark's models and step (not a package)

import streamwatch as sw
from streamwatch import _kernel, _param_taps, _taps, _tapstate

TIMERS: dict[str, float] = defaultdict(float)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its wall time added to ``TIMERS[name]``."""
    clock = time.perf_counter

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMERS[name] += clock() - start

    return wrapper


def instrument() -> None:
    """Wrap the training-thread parts streamwatch adds (before ``observe`` builds its hooks)."""
    guarded = _tapstate.guarded
    names = {  # first match wins: "_param_grad_hook" before "_grad_hook"
        "_forward_hook": "forward",
        "_forward_pre_hook": "forward",
        "_param_grad_hook": "param_grad",
        "_grad_hook": "output_grad",
        "_before_optimizer_step": "optimizer",
        "_after_optimizer_step": "optimizer",
    }

    def timed_hook(state: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
        where = next((v for k, v in names.items() if k in fn.__qualname__), "other")
        return guarded(state, timed("hooks", timed(f"hooks:{where}", fn)))

    _taps.guarded = timed_hook  # type: ignore[assignment]  # (each module's own name for it)
    _param_taps.guarded = timed_hook  # type: ignore[assignment]
    _tapstate.summarize = timed("torch_summaries", _tapstate.summarize)  # type: ignore[assignment]
    _kernel.FusedKernel.run = timed("kernel", _kernel.FusedKernel.run)  # type: ignore[method-assign]
    _kernel.FusedKernel.run_diff = timed("kernel", _kernel.FusedKernel.run_diff)  # type: ignore[method-assign]
    sw.Watch.step = timed("step", sw.Watch.step)  # type: ignore[method-assign]


def run_steps(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    watch: sw.Watch | None,
    k: int,
    x: torch.Tensor,
    y: torch.Tensor,
    times: list[float],
    step_args: str = "full",
) -> None:
    """``k`` training steps, each one's wall time appended to ``times``. ``step_args``: what
    ``watch.step()`` is given: ``full`` (loss, outputs and targets for train accuracy, batch size),
    ``loss`` (the loss alone) or ``none`` (no argument)."""
    for _ in range(k):
        start = time.perf_counter()
        outputs = model(x)
        loss = F.cross_entropy(outputs, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if watch is None:
            pass
        elif step_args == "full":
            watch.step(loss=loss, outputs=outputs, targets=y, batch_size=x.shape[0])
        elif step_args == "loss":
            watch.step(loss=loss)
        else:
            watch.step()
        times.append(time.perf_counter() - start)


def profile(name: str, rounds: int) -> list[str]:
    spec = bench.SPECS[name]
    x, y = spec.data()
    base_model, seen_model = bench.build(spec), bench.build(spec)
    base_opt = torch.optim.SGD(base_model.parameters(), lr=bench.LR)
    seen_opt = torch.optim.SGD(seen_model.parameters(), lr=bench.LR)
    k = spec.steps * 2
    base_times: list[float] = []
    seen_times: list[float] = []
    with sw.observe(seen_model, seen_opt, every=1) as watch:
        for r in range(rounds + 1):  # round 0 warms up
            if r == 1:
                TIMERS.clear()
                base_times.clear()
                seen_times.clear()
                busy0 = watch._worker.statistics().busy_seconds
                records0 = watch.statistics().records_received
            run_steps(base_model, base_opt, None, k, x, y, base_times)
            run_steps(seen_model, seen_opt, watch, k, x, y, seen_times)
            bench.wait_for_worker(watch)
        busy = watch._worker.statistics().busy_seconds - busy0
        records = watch.statistics().records_received - records0
        kernel_status = watch.statistics().kernel
    steps = len(seen_times)
    ms = {key: 1e3 * value / steps for key, value in TIMERS.items()}
    base, seen = 1e3 * statistics.median(base_times), 1e3 * statistics.median(seen_times)
    hooks, step = ms.get("hooks", 0.0), ms.get("step", 0.0)
    rest = hooks - ms.get("kernel", 0.0) - ms.get("torch_summaries", 0.0)
    rest_ms = seen - base - hooks - step
    per_record = 1e3 * busy / max(records, 1)
    return [
        f"{name}: baseline {base:.2f} ms/step, observed {seen:.2f} ms/step: +{seen - base:.2f} ms "
        f"({seen / base:.3f}×), {steps} steps of each; summaries: {kernel_status.split(':')[0]}",
        f"  {'hook bodies':<58}{hooks:>8.2f} ms  {100 * hooks / base:>5.1f} % of the baseline step",
        f"  {'  fused kernel (C)':<58}{ms.get('kernel', 0.0):>8.2f} ms",
        f"  {'  torch-path summaries':<58}{ms.get('torch_summaries', 0.0):>8.2f} ms",
        f"  {'  the rest (Python, update copy and Δ, register_hook)':<58}{rest:>8.2f} ms",
        "  by hook: "
        + ", ".join(f"{k[6:]} {v:.2f} ms" for k, v in sorted(ms.items()) if k.startswith("hooks:")),
        f"  {'watch.step()':<58}{step:>8.2f} ms  {100 * step / base:>5.1f} %",
        f"  {'unattributed (hook dispatch, autograd nodes, GIL waits)':<58}{rest_ms:>8.2f} ms"
        f"  {100 * rest_ms / base:>5.1f} %",
        f"  {'worker busy per record (concurrent; holds the GIL)':<58}{per_record:>8.2f} ms",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", help=f"any of {', '.join(bench.SPECS)} (default: all)")
    parser.add_argument("--rounds", type=int, default=8, help="measured rounds (after one warm-up)")
    args = parser.parse_args()
    unknown = set(args.models) - set(bench.SPECS)
    if unknown:
        parser.error(f"unknown model(s) {sorted(unknown)}: choose from {', '.join(bench.SPECS)}")
    instrument()
    for name in args.models or list(bench.SPECS):
        print("\n".join(profile(name, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
