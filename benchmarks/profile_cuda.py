"""Where a CUDA step's monitoring time goes: host time per step of quiet and sampled steps, and the
functions that take it.

Run on a GPU machine::

    python benchmarks/profile_cuda.py            # bench_cuda.py's MLP, the launch-bound worst case
    python benchmarks/profile_cuda.py cnn --steps 100

On a GPU the host runs ahead of the device, so a monitored step costs training time only where it adds
host time beyond the device's (a launch-bound step: every microsecond) or device time (kernels). Each
variant runs rounds of ``--steps`` steps between two ``torch.cuda.synchronize()`` calls:

* ``baseline``: unmonitored;
* ``default``: ``observe(model, opt)``: the overhead governor at its 2 % budget;
* ``quiet``: ``observe(model, opt, every=10**9)``: after the first step no step is sampled, so a round
  shows what an unsampled step costs (the sentinel's finite check, the scalar record);
* ``quiet_nosentinel``: the same with ``sentinel=()``;
* ``every1``: every step sampled.

It prints the median round time per step of each, then cProfile's top functions (by own time) over one
round of ``default``, ``quiet`` and ``every1`` (``--kernels``: torch.profiler's top operators by CUDA
time over three ``every1`` steps). Not a test and not part of ``make bench``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
from bench_cuda import SPECS, Spec

import streamwatch as sw

VARIANTS = {
    "baseline": None,
    "default": {},
    "quiet": {"every": 10**9},
    "quiet_nosentinel": {"every": 10**9, "sentinel": ()},
    "every1": {"every": 1},
}


def step(
    spec: Spec,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    watch: sw.Watch | None,
    x: torch.Tensor,
    y: torch.Tensor,
) -> None:
    with torch.autocast("cuda", dtype=spec.autocast or torch.float32, enabled=spec.autocast is not None):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if watch is not None:
        watch.step(loss=loss, outputs=logits, targets=y, batch_size=x.shape[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="mlp", choices=list(SPECS))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--kernels", action="store_true", help="print the top CUDA operators of 3 every1 steps"
    )
    args = parser.parse_args()
    spec = SPECS[args.model]
    steps = args.steps or spec.steps
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(spec.input_shape, generator=gen).cuda()
    y = torch.randint(0, 10, (spec.input_shape[0],), generator=gen).cuda()
    runs = {}
    for name, kwargs in VARIANTS.items():
        torch.manual_seed(0)
        model = spec.build().cuda().train()
        opt = spec.optimizer(model.parameters())
        watch = None if kwargs is None else sw.observe(model, opt, **kwargs)
        runs[name] = (model, opt, watch, [])
    for r in range(args.rounds + 2):
        for model, opt, watch, times in runs.values():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                step(spec, model, opt, watch, x, y)
            torch.cuda.synchronize()
            if r >= 2:
                times.append((time.perf_counter() - start) / steps)
    base = statistics.median(runs["baseline"][3])
    for name, (_, _, _, times) in runs.items():
        t = statistics.median(times)
        print(f"{name:18s} {1e3 * t:8.3f} ms/step  {t / base:6.3f}x  (+{1e6 * (t - base):7.1f} us)")
    for name in ("default", "quiet", "every1"):
        model, opt, watch, _ = runs[name]
        profiler = cProfile.Profile()
        torch.cuda.synchronize()
        profiler.enable()
        for _ in range(steps):
            step(spec, model, opt, watch, x, y)
        torch.cuda.synchronize()
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
        print(f"\n== {name}: top functions by own time over {steps} steps ==")
        print("\n".join(out.getvalue().splitlines()[6:40]))
    if args.kernels:
        model, opt, watch, _ = runs["every1"]
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(3):
                step(spec, model, opt, watch, x, y)
            torch.cuda.synchronize()
        print("\n== every1: top operators by CUDA time over 3 steps ==")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    for _, _, watch, _ in runs.values():
        if watch is not None:
            watch.close()
            stats = watch.statistics()
            print(
                f"{stats.hook_errors} hook errors, {stats.sampled} sampled, {stats.scalar_records} scalar "
                f"records, interval {stats.sampling_interval}, measured {stats.overhead_ratio}, sentinel "
                f"{stats.sentinel}, dark steps {stats.dark_steps}"
            )


if __name__ == "__main__":
    main()
