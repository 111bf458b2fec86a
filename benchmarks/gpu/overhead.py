"""Overhead ratios: bench_cuda.py's interleaved rounds as plain functions, with a byte floor and both routes.

A *round* is K steps of one variant between two device synchronizations, timed with ``perf_counter``; a
*cycle* is one round of every variant, the order rotating each cycle; a variant's ratio is the median over
the measured cycles of its round over the baseline's round in the same cycle (K: about 70 ms of baseline
steps a round). After each monitored round the worker is waited for, untimed (``watch.flush``), so no
round pays for another's backlog; the wait is reported (``backlog_ms``). Variants, each on its own copy
of the model (same initial weights) with its own optimizer:

* ``baseline``: unmonitored;
* ``default``: ``observe(model, opt)``, the overhead governor; it runs alone for a few seconds first to
  settle, and the time other variants' rounds take is hidden from its governor (``bench_observe.hide_gap``)
  so it sees its steps back to back, as in a training loop;
* ``every1``, ``every10``: ``observe(model, opt, every=N)``; ``every1_torch``: ``every=1`` with
  ``STREAMWATCH_KERNEL=torch`` (set while it is built and while it runs);
* ``item_hooks``: bench_observe's hand-written ``.norm().item()`` hooks (host syncs);
* ``floor``: one ``x.sum()`` per tapped tensor (every leaf module's output, its gradient through a tensor
  hook, every parameter's gradient after the optimizer step), no host sync: the byte floor.
"""

from __future__ import annotations

import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import bench_observe
import torch
from harness import SKIPPED, Budget, Recorder, free_device
from torch import nn
from workloads import Workload, kernel_route, step

import streamwatch as sw

VARIANTS = ("baseline", "default", "every1", "every10", "item_hooks", "floor", "every1_torch")
TARGET_ROUND_S = 0.07
MOST_STEPS = 200  # K at most
FEWEST_STEPS = 5  # K at least: rounds of 2 steps of a 40 ms model spread ±20–40 % on an H200 (2026-11-28)
CYCLES, WARMUP = 10, 3  # (fewer cycles where the budget runs out)
SETTLE_S = 4.0  # the default variant alone before the cycles, at most (its governor calibrates)


class FloorHooks:
    """One ``sum()`` per tapped tensor and nothing else: no host sync, no copy."""

    def __init__(self, model: nn.Module) -> None:
        self.kept: list[torch.Tensor] = []
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.handles = [
            module.register_forward_hook(self.forward)
            for module in model.modules()
            if next(module.children(), None) is None
        ]

    def forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            self.kept.append(output.detach().sum())
            if output.requires_grad:
                output.register_hook(self.gradient)

    def gradient(self, grad: torch.Tensor) -> None:
        self.kept.append(grad.sum())

    def end_of_step(self) -> None:
        self.kept.extend(p.grad.sum() for p in self.params if p.grad is not None)
        self.kept.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@dataclass
class Variant:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    route: str | None = None
    watch: sw.Watch | None = None
    hooks: Any = None
    rounds: list[float] = field(default_factory=list)
    backlog: list[float] = field(default_factory=list)
    left_at: float | None = None

    def close(self) -> str | None:
        """Remove hooks, close the watch; the error closing it, if any."""
        if self.hooks is not None:
            self.hooks.remove()
        if self.watch is not None and not self.watch.closed:
            try:
                self.watch.close()
            except Exception as err:
                return repr(err)
        return None


def variant(name: str, model: nn.Module, w: Workload) -> Variant:
    v = Variant(name, model, w.optimizer(model.parameters()))
    v.route = "torch" if name.endswith("_torch") else None
    with kernel_route(v.route):
        if name == "default":
            v.watch = sw.observe(model, v.optimizer)
        elif name.startswith("every"):
            every = int(name.removeprefix("every").removesuffix("_torch"))
            v.watch = sw.observe(model, v.optimizer, every=every)
    if name == "item_hooks":
        v.hooks = bench_observe.ItemHooks(model)
    elif name == "floor":
        v.hooks = FloorHooks(model)
    return v


class Rounds:
    """Runs rounds of K steps of a variant; ``hide_gap`` failures (private names moved) are noted once."""

    def __init__(self, w: Workload, device: torch.device) -> None:
        self.w, self.device = w, device
        self.x, self.y = w.batch(device)
        self.hide_gap_error: str | None = None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, v: Variant, k: int) -> float:
        end = v.hooks.end_of_step if isinstance(v.hooks, FloorHooks) else None
        with kernel_route(v.route):
            self._hide_gap(v)
            self.sync()
            start = time.perf_counter()
            for _ in range(k):
                step(self.w, v.model, v.optimizer, self.x, self.y, v.watch, end)
            self.sync()
            seconds = time.perf_counter() - start
            if v.watch is not None:
                v.backlog.append(_flush(v.watch))
                v.left_at = time.perf_counter()
        return seconds

    def _hide_gap(self, v: Variant) -> None:
        if v.name != "default" or v.watch is None or v.left_at is None or self.hide_gap_error:
            return
        try:
            bench_observe.hide_gap(v.watch, time.perf_counter() - v.left_at)
        except Exception as err:
            self.hide_gap_error = repr(err)


def _flush(watch: sw.Watch) -> float:
    start = time.perf_counter()
    flush = getattr(watch, "flush", None)
    if flush is not None:
        flush(60.0)
    return time.perf_counter() - start


def calibrate(rounds: Rounds, baseline: Variant) -> tuple[float, int]:
    """(seconds per baseline step, K for rounds of about TARGET_ROUND_S, at least FEWEST_STEPS)."""
    rounds.run(baseline, 2)
    per_step = min(rounds.run(baseline, 3) for _ in range(2)) / 3
    return per_step, max(FEWEST_STEPS, min(MOST_STEPS, round(TARGET_ROUND_S / max(per_step, 1e-6))))


def measure(w: Workload, device: torch.device, budget: Budget, dry: bool) -> dict[str, Any]:
    """Every variant of one model, within ``budget``; what each round measured, summarised."""
    rounds = Rounds(w, device)
    variants: list[Variant] = []
    out: dict[str, Any] = {}
    try:
        for name, model in zip(VARIANTS, w.copies(device, len(VARIANTS)), strict=True):
            variants.append(variant(name, model, w))
        out["parameters_m"] = sum(p.numel() for p in variants[0].model.parameters()) / 1e6
        for v in variants:
            rounds.run(v, 1)  # first use: allocations, cuDNN/cuBLAS choices, the watches' buffers
        base, governed = variants[0], variants[1]
        per_step, k = (0.0, 1) if dry else calibrate(rounds, base)
        out.update(k=k, calibrated_step_ms=1e3 * per_step)
        settle = Budget.of(0.0 if dry else min(SETTLE_S, 0.2 * budget.left()))
        rounds.run(governed, k)
        settled = k
        while not settle.over():
            rounds.run(governed, k)
            settled += k
        out["settle_steps"] = settled
        out.update(cycle(rounds, variants, k, budget, (0, 1) if dry else (WARMUP, CYCLES)))
        out.update(summarise(variants, k))
        out["hide_gap_error"] = rounds.hide_gap_error
    finally:
        out["close_errors"] = {v.name: e for v in variants if (e := v.close()) is not None}
        out["watches"] = {v.name: watch_facts(v.watch) for v in variants if v.watch is not None}
        variants.clear()
        free_device()
    return out


def cycle(
    rounds: Rounds, variants: list[Variant], k: int, budget: Budget, counts: tuple[int, int]
) -> dict[str, int]:
    """``warmup`` cycles, then up to ``cycles`` measured ones while ``budget`` lasts (at least one)."""
    warmup, cycles = counts
    measured = 0
    for done in range(warmup + cycles):
        measuring = done >= warmup
        if budget.over() and not measuring:
            continue  # the rest of the warm-up is dropped, one cycle is measured
        if budget.over() and measured:
            break
        if done == warmup:  # (the first measured cycle: warm-up rounds are not kept)
            for v in variants:
                v.rounds.clear()
                v.backlog.clear()
        order = variants[done % len(variants) :] + variants[: done % len(variants)]
        for v in order:
            seconds = rounds.run(v, k)
            if measuring:
                v.rounds.append(seconds)
        measured += measuring
    return {"cycles": measured, "warmup_cycles": warmup}


def _ratios(top: list[float], bottom: list[float]) -> list[float]:
    return [a / b for a, b in zip(top, bottom, strict=False) if b > 0]


def _median_ratio(top: list[float], bottom: list[float]) -> float | None:
    pairs = _ratios(top, bottom)
    return statistics.median(pairs) if pairs else None


def summarise(variants: list[Variant], k: int) -> dict[str, Any]:
    by = {v.name: v for v in variants}
    base = by["baseline"].rounds
    if not base:
        return {"ratios": {}, "note": "no measured cycle"}
    governed = by["default"].watch
    stats = governed.statistics() if governed is not None else None
    return {
        "baseline_ms": 1e3 * statistics.median(base) / k,
        "ratios": {v.name: _median_ratio(v.rounds, base) for v in variants[1:]},
        "ratio_range": {v.name: [min(r), max(r)] for v in variants[1:] if (r := _ratios(v.rounds, base))},
        "every1_over_floor": _median_ratio(by["every1"].rounds, by["floor"].rounds),
        "every1_torch_over_every1": _median_ratio(by["every1_torch"].rounds, by["every1"].rounds),
        "governor": {
            "overhead_ratio": getattr(stats, "overhead_ratio", None),
            "sampling_interval": getattr(stats, "sampling_interval", None),
            "overhead_budget": getattr(stats, "overhead_budget", None),
        },
        "backlog_ms": {v.name: 1e3 * statistics.median(v.backlog) for v in variants if v.backlog},
    }


def watch_facts(watch: sw.Watch) -> dict[str, Any]:
    try:
        stats = watch.statistics()
    except Exception as err:
        return {"error": f"statistics(): {err!r}"}
    names = (
        "steps",
        "sampled",
        "records_received",
        "hook_errors",
        "slots_exhausted",
        "dropped_oldest",
        "dropped_newest",
        "sampling_interval",
        "overhead_ratio",
        "dark_steps",
    )
    return {name: getattr(stats, name, None) for name in names}


def run(
    found: dict[str, Workload],
    device: torch.device,
    budget: Budget,
    out: dict[str, Any],
    rec: Recorder,
    dry: bool,
) -> None:
    """Every model in turn, each with an equal share of the time left; each model's result saved as it
    comes (an error in one is recorded and the next runs)."""
    names = list(found)
    for i, name in enumerate(names):
        if budget.over():
            out[name] = SKIPPED
            continue
        rec.log(f"overhead: {name}")
        try:
            out[name] = measure(found[name], device, budget.share(len(names) - i), dry)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
            free_device()
        rec.save()
