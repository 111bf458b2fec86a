"""Launch counts under ``torch.profiler``: what a sampled and an unsampled step add to a training step.

Per model, each phase on its own fresh model copy after warm-up steps, one profile per measured step:

* ``baseline``: one unmonitored step;
* ``sampled``: step 1 of ``observe(every=1)`` (activations, output gradients, parameter gradients);
  ``sampled_weights``: its step 10, which also reads the weights and updates (the default cadence: every
  10th sampled step);
* ``unsampled``: steps 2-9 of ``observe(every=1000)``, per step (the sentinel's copy comes once in 16
  steps: an average of 8 holds half of one).

Counted in each profile: ``launches``, the runtime and driver launch calls (``cudaLaunchKernel``,
``cuLaunchKernel``, ``cudaLaunchKernelExC``, ``cudaGraphLaunch``, ...: every name starting with one of
:data:`LAUNCH_PREFIXES`); ``kernels``, the device-side kernel events, and ``copies``, the device-side
memcpy/memset events; ``ops``, the aten ops dispatched at the top level (an op inside another is not
counted). Each route (the default and ``STREAMWATCH_KERNEL=torch``) is counted apart. Without a GPU
(``--dry-run``) only the CPU is profiled: ``launches``/``kernels`` are 0 and ``ops`` the only count.
"""

from __future__ import annotations

import collections
import traceback
from collections.abc import Callable
from typing import Any

import torch
from harness import SKIPPED, Budget, Recorder, free_device
from torch.autograd import DeviceType
from workloads import Workload, kernel_route, step

import streamwatch as sw

LAUNCH_PREFIXES = ("cudaLaunch", "cuLaunch", "cudaGraphLaunch", "cuGraphLaunch")
COUNTS = ("launches", "kernels", "copies", "ops")
UNSAMPLED_STEPS = 8
WEIGHTS_STEP = 10  # the every=1 watch's step whose record also holds weights and updates


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count(events: Any) -> dict[str, Any]:
    """The counts of one profile's events (see the module docstring)."""
    found: dict[str, Any] = dict.fromkeys(COUNTS, 0)
    runtime: collections.Counter[str] = collections.Counter()
    for e in events:
        name = e.name
        if e.device_type == DeviceType.CUDA:
            found["copies" if name.startswith(("Memcpy", "Memset")) else "kernels"] += 1
        elif name.startswith(LAUNCH_PREFIXES):
            found["launches"] += 1
            runtime[name] += 1
        elif name.startswith("cu"):
            runtime[name] += 1
        elif name.startswith("aten::"):
            parent = e.cpu_parent
            if parent is None or not parent.name.startswith("aten::"):
                found["ops"] += 1
    found["runtime"] = dict(runtime.most_common(12))
    return found


def profiled(run: Callable[[], None], steps: int, device: torch.device) -> dict[str, Any]:
    """Counts per step over ``steps`` calls of ``run``, between two synchronizations."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            run()
        sync(device)
    found = count(prof.events())
    for name in COUNTS:
        found[name] /= steps
    return found


def warm_profiler(device: torch.device) -> None:
    """The first profile of a process pays the profiler's start-up: pay it on nothing."""
    profiled(lambda: torch.ones(4, device=device).sum(), 1, device)


def added(phase: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float]:
    return {name: phase[name] - baseline[name] for name in COUNTS}


def tap_counts(records: Any, step_index: int) -> dict[str, int]:
    """Rows by tap kind in the record of ``step_index`` (empty if it has none)."""
    for record in records.items:
        if getattr(record, "step", None) == step_index and getattr(record, "keys", ()):
            return dict(collections.Counter(key.kind for key in record.keys))
    return {}


def _watch_facts(watch: sw.Watch) -> dict[str, Any]:
    stats = watch.statistics()
    names = ("steps", "sampled", "records_received", "hook_errors", "slots_exhausted", "kernel")
    return {name: getattr(stats, name, None) for name in names}


def count_route(
    w: Workload, device: torch.device, route: str | None, baseline: dict[str, Any], unsampled: int
) -> dict[str, Any]:
    """The sampled and unsampled phases on one kernel route (``route`` as ``STREAMWATCH_KERNEL``)."""
    x, y = w.batch(device)
    out: dict[str, Any] = {}
    with kernel_route(route):
        model = w.model(device)
        opt = w.optimizer(model.parameters())
        records = sw.sinks.collect()
        watch = sw.observe(model, opt, every=1, sinks=[records])
        try:
            step(w, model, opt, x, y, watch)  # step 0: first use (packs, pinned slots)
            out["sampled"] = profiled(lambda: step(w, model, opt, x, y, watch), 1, device)
            for _ in range(2, WEIGHTS_STEP):
                step(w, model, opt, x, y, watch)
            out["sampled_weights"] = profiled(lambda: step(w, model, opt, x, y, watch), 1, device)
        finally:
            watch.close()
        out["taps"] = tap_counts(records, 1)
        out["taps_weights"] = tap_counts(records, WEIGHTS_STEP)
        out["watch_every1"] = _watch_facts(watch)
        del records
        model = w.model(device)
        opt = w.optimizer(model.parameters())
        watch = sw.observe(model, opt, every=1000)
        try:
            step(w, model, opt, x, y, watch)  # step 0: sampled
            step(w, model, opt, x, y, watch)  # step 1: the first unsampled one
            run = lambda: step(w, model, opt, x, y, watch)  # noqa: E731
            out["unsampled"] = profiled(run, unsampled, device)
        finally:
            watch.close()
        out["watch_every1000"] = _watch_facts(watch)
    for phase in ("sampled", "sampled_weights", "unsampled"):
        out[phase]["added"] = added(out[phase], baseline)
    taps = out["taps"]
    out["tensor_taps"] = taps.get("activation", 0) + taps.get("output_grad", 0)
    out["launches_beyond_tensor_taps"] = out["sampled"]["added"]["launches"] - out["tensor_taps"]
    return out


def count_baseline(w: Workload, device: torch.device) -> dict[str, Any]:
    x, y = w.batch(device)
    model = w.model(device)
    opt = w.optimizer(model.parameters())
    for _ in range(2):
        step(w, model, opt, x, y)
    return profiled(lambda: step(w, model, opt, x, y), 1, device)


ROUTES = {"default": None, "torch": "torch"}


def run(
    found: dict[str, Workload],
    device: torch.device,
    budget: Budget,
    out: dict[str, Any],
    rec: Recorder,
    dry: bool,
) -> None:
    """Every model, the baseline once and each route; an error in one is recorded and the rest run."""
    unsampled = 2 if dry else UNSAMPLED_STEPS
    warm_profiler(device)
    for name, w in found.items():
        entry: dict[str, Any] = {}
        out[name] = entry
        for label, route in (("baseline", None), *ROUTES.items()):
            if budget.over():
                entry[label] = SKIPPED
                continue
            rec.log(f"launches: {name} {label}")
            try:
                if label == "baseline":
                    entry[label] = count_baseline(w, device)
                elif isinstance(entry.get("baseline"), dict) and "error" not in entry["baseline"]:
                    entry[label] = count_route(w, device, route, entry["baseline"], unsampled)
                else:
                    entry[label] = {"error": "no baseline count"}
            except Exception:
                entry[label] = {"error": traceback.format_exc()}
            free_device()
        rec.save()
