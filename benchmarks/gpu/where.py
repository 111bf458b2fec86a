"""Where a monitored step's time goes on a GPU: device-busy time, idle gaps, the kernels a variant adds.

    PYTHONPATH=. python3 benchmarks/gpu/where.py --out OUT [--models gpt2 mlp] [--dry-run]

For each model (``workloads.py``) and variant (``overhead.py``: baseline, floor, every1, default), after
warm-up (the default variant's governor settles first), ``torch.profiler`` records ``k`` steps between
two synchronizations. From its device events, per step:

* ``wall_ms``: from the first kernel's start to the last one's end, over the ``k`` steps, divided by k;
* ``busy_ms``: the union of the kernels' and copies' intervals (one stream: the GPU's working time);
  ``idle``: ``1 − busy / wall`` — the share of the step the GPU waited for the host (launch-bound or a
  host sync when it grows with a variant);
* ``added_kernels``: the kernel names whose total time grew most against the baseline (µs per step).

Then ``cProfile`` over ``k`` more steps of the monitored variants: the functions with the most own
(``tottime``) time, in µs per step (inflated by cProfile itself: read the proportions); and, without a
profiler, the host time of each ``watch.step()`` call over at least 32 steps (median, mean, p90, most),
the boundary paths those steps took (quiet, dark, full) with their mean µs, and the garbage collector's
time per step beside the baseline's.

Writes ``where.json`` and prints a Markdown summary. ``--dry-run``: CPU, toy sizes (no device events).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import json
import pstats
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from harness import free_device
from overhead import SETTLE_S, FloorHooks, Rounds, Variant, calibrate, variant
from torch.autograd import DeviceType
from workloads import Workload, kernel_route, step, workloads

VARIANTS = ("baseline", "floor", "every1", "default")


def _intervals(events: Any) -> tuple[list[tuple[float, float]], collections.Counter[str]]:
    spans: list[tuple[float, float]] = []
    by_name: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue  # (a user annotation, "Optimizer.step#AdamW.step", spans kernels: not one)
        start, end = e.time_range.start, e.time_range.end
        spans.append((start, end))
        by_name[e.name[:90]] += end - start
    return spans, by_name


def _union(spans: list[tuple[float, float]]) -> float:
    total, reach = 0.0, -float("inf")
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def profile(rounds: Rounds, v: Variant, k: int) -> dict[str, Any]:
    """One profile of ``k`` steps of ``v``: wall, busy, idle per step and the time per kernel name."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    cuda = rounds.device.type == "cuda"
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    end = v.hooks.end_of_step if isinstance(v.hooks, FloorHooks) else None
    with kernel_route(v.route):
        rounds.sync()
        host = time.perf_counter()
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(k):
                step(rounds.w, v.model, v.optimizer, rounds.x, rounds.y, v.watch, end)
            rounds.sync()
        host = time.perf_counter() - host
        if v.watch is not None:
            v.watch.flush(60.0)
    spans, by_name = _intervals(prof.events())
    out: dict[str, Any] = {"host_ms": 1e3 * host / k, "kernels": len(spans) / k}
    if spans:
        wall = max(e for _, e in spans) - min(s for s, _ in spans)
        busy = _union(spans)
        out.update(wall_ms=wall / 1e3 / k, busy_ms=busy / 1e3 / k, idle=1 - busy / wall if wall else None)
    out["by_name_us"] = {n: t / k for n, t in by_name.items()}
    return out


class _TimedWatch:
    """A watch whose ``step()`` calls are timed by the host clock (µs each), and the boundary's paths
    (quiet, dark, full) counted and timed, nothing else changed."""

    PATHS = ("_quiet_step", "_dark_step", "_full_step")

    def __init__(self, watch: Any) -> None:
        self.watch = watch
        self.calls: list[float] = []
        self.paths: dict[str, list[float]] = {name: [0, 0.0] for name in self.PATHS}
        boundary = watch._boundary
        for name in self.PATHS:
            setattr(boundary, name, self._timed(name, getattr(boundary, name)))

    def _timed(self, name: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.paths[name][0] += 1
                self.paths[name][1] += 1e6 * (time.perf_counter() - start)

        return timed

    def restore(self) -> None:
        for name in self.PATHS:
            delattr(self.watch._boundary, name)

    def step(self, **kwargs: Any) -> None:
        start = time.perf_counter()
        self.watch.step(**kwargs)
        self.calls.append(1e6 * (time.perf_counter() - start))


class _GcClock:
    """Time spent in the garbage collector (``gc.callbacks``), and its collections by generation."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.collections[info["generation"]] += 1

    def __enter__(self) -> _GcClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def step_calls(rounds: Rounds, v: Variant, k: int) -> dict[str, Any]:
    """The host time of each ``watch.step()`` over ``k`` steps of ``v``: median, mean, 90th percentile,
    most (no profiler: the quiet step's cost as the training thread pays it); which boundary paths those
    steps took, with their mean µs; the garbage collector's time per step; the threads alive."""
    timed = _TimedWatch(v.watch)
    try:
        with kernel_route(v.route), _GcClock() as gc_clock:
            rounds.sync()
            for _ in range(k):
                step(rounds.w, v.model, v.optimizer, rounds.x, rounds.y, timed)
            rounds.sync()
    finally:
        timed.restore()
    v.watch.flush(60.0)  # type: ignore[union-attr]
    calls = sorted(timed.calls)
    return {
        "median_us": calls[len(calls) // 2],
        "mean_us": sum(calls) / len(calls),
        "p90_us": calls[min(len(calls) - 1, (9 * len(calls)) // 10)],
        "max_us": calls[-1],
        "steps": len(calls),
        "paths": {n.strip("_"): {"calls": c, "mean_us": t / max(c, 1)} for n, (c, t) in timed.paths.items()},
        "gc_us_per_step": 1e6 * gc_clock.seconds / k,
        "gc_collections": gc_clock.collections,
        "threads": sorted(t.name for t in threading.enumerate()),
    }


def gc_per_step(rounds: Rounds, v: Variant, k: int) -> dict[str, Any]:
    """The garbage collector's time per step of ``v`` (any variant, the baseline too), no profiler."""
    with kernel_route(v.route), _GcClock() as gc_clock:
        rounds.sync()
        for _ in range(k):
            step(rounds.w, v.model, v.optimizer, rounds.x, rounds.y, v.watch)
        rounds.sync()
    return {"gc_us_per_step": 1e6 * gc_clock.seconds / k, "gc_collections": gc_clock.collections}


def hot_functions(rounds: Rounds, v: Variant, k: int, top: int = 25) -> list[dict[str, Any]]:
    """cProfile's functions with the most own time over ``k`` steps of ``v``, µs per step."""
    prof = cProfile.Profile()
    with kernel_route(v.route):
        rounds.sync()
        prof.enable()
        for _ in range(k):
            step(rounds.w, v.model, v.optimizer, rounds.x, rounds.y, v.watch)
        rounds.sync()
        prof.disable()
        if v.watch is not None:
            v.watch.flush(60.0)
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, name), (_, nc, tt, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{Path(path).name}:{line}({name})",
                "calls": nc / k,
                "own_us": 1e6 * tt / k,
                "cumulative_us": 1e6 * ct / k,
            }
        )
    rows.sort(key=lambda r: -r["own_us"])
    return rows[:top]


def model_report(w: Workload, device: torch.device, dry: bool) -> dict[str, Any]:
    rounds = Rounds(w, device)
    variants = [
        variant(name, m, w) for name, m in zip(VARIANTS, w.copies(device, len(VARIANTS)), strict=True)
    ]
    out: dict[str, Any] = {}
    try:
        for v in variants:
            rounds.run(v, 2)
        per_step, k = (0.0, 1) if dry else calibrate(rounds, variants[0])
        k = max(1, min(k, 32))
        out.update(k=k, step_ms=1e3 * per_step)
        governed = variants[-1]
        settle = time.monotonic() + (0.0 if dry else SETTLE_S)
        while time.monotonic() < settle:
            rounds.run(governed, k)
        for v in variants:
            rounds.run(v, k)
            out[v.name] = profile(rounds, v, k)
        base = out["baseline"]["by_name_us"]
        for v in variants[1:]:
            mine = out[v.name]["by_name_us"]
            added = {n: mine.get(n, 0.0) - base.get(n, 0.0) for n in set(mine) | set(base)}
            out[v.name]["added_kernels_us"] = dict(
                sorted(((n, t) for n, t in added.items() if abs(t) >= 1.0), key=lambda x: -abs(x[1]))[:15]
            )
            out[v.name]["added_total_us"] = sum(added.values())
        for v in variants:
            del out[v.name]["by_name_us"]
        out["baseline"]["gc"] = gc_per_step(rounds, variants[0], max(k, 32))
        for v in variants[2:]:
            out[v.name]["hot_functions"] = hot_functions(rounds, v, k)
            out[v.name]["step_call"] = step_calls(rounds, v, max(k, 32))
        if governed.watch is not None:
            stats = governed.watch.statistics()
            out["governor"] = {
                "sampling_interval": stats.sampling_interval,
                "overhead_ratio": stats.overhead_ratio,
                "dark_steps": getattr(stats, "dark_steps", None),
            }
    finally:
        for v in variants:
            v.close()
        free_device()
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = []
    for model, r in report.items():
        if not isinstance(r, dict) or "baseline" not in r:
            lines.append(f"## {model}\n\n{r}\n")
            continue
        lines.append(f"## {model} (k {r['k']}, {r.get('step_ms', 0):.2f} ms calibrated)\n")
        lines.append("| variant | host ms | wall ms | busy ms | idle | kernels | added µs |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- |")
        for name in VARIANTS:
            v = r[name]
            lines.append(
                f"| {name} | {v['host_ms']:.2f} | {v.get('wall_ms', 0):.2f} | {v.get('busy_ms', 0):.2f} "
                f"| {v.get('idle') or 0:.3f} | {v['kernels']:.0f} | {v.get('added_total_us', 0):.0f} |"
            )
        for name in VARIANTS[1:]:
            lines.append(
                f"\n{name}, kernels added (µs/step): "
                + "; ".join(f"{n} {t:.0f}" for n, t in r[name].get("added_kernels_us", {}).items())
            )
        for name in VARIANTS[2:]:
            call = r[name].get("step_call", {})
            lines.append(
                f"\n{name}, `watch.step()` host time: median {call.get('median_us', 0):.1f} µs, "
                f"mean {call.get('mean_us', 0):.1f}, p90 {call.get('p90_us', 0):.1f}, "
                f"most {call.get('max_us', 0):.1f} ({call.get('steps', 0)} steps); paths: "
                + ", ".join(
                    f"{p} {c['calls']} × {c['mean_us']:.1f} µs" for p, c in call.get("paths", {}).items()
                )
                + f"; gc {call.get('gc_us_per_step', 0):.1f} µs/step {call.get('gc_collections')}"
                f" (baseline {r['baseline'].get('gc', {}).get('gc_us_per_step', 0):.1f}"
                f" {r['baseline'].get('gc', {}).get('gc_collections')}); threads {call.get('threads')}"
            )
            lines.append(f"\n{name}, own time (µs/step):")
            for row in r[name].get("hot_functions", [])[:15]:
                lines.append(f"- {row['function']}: {row['own_us']:.0f} ({row['calls']:.1f} calls)")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", nargs="*", default=["gpt2", "mlp"])
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    found = workloads(dry)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}
    for name in args.models:
        start = time.monotonic()
        try:
            report[name] = model_report(found[name], device, dry)
        except Exception as err:  # (the next model still runs)
            import traceback

            report[name] = {"error": repr(err), "traceback": traceback.format_exc()}
        print(f"[where] {name}: {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
        (args.out / "where.json").write_text(json.dumps(report, indent=1, default=str))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
