"""Overhead of ``streamwatch.observe`` on CUDA training steps, against the same step unmonitored.

Skipped without a GPU. Run on a GPU machine (about 3 minutes on one H100)::

    python -m pytest benchmarks/bench_cuda.py -o python_files='bench_*.py' -p no:cacheprovider \
        --benchmark-only

Models (fixed seeds; each variant has its own copy with the same initial weights and its own optimizer):

* ``mlp``: the CPU benchmark's MLP (784→1024→1024→1024→10), float32, batch 128, SGD: a step of a few
  hundred microseconds, bound by kernel launches, where the hooks' own launches show most;
* ``cnn``: four Conv2d(3×3)+BatchNorm2d+ReLU blocks (64, 128, 256, 256 channels, a 2×2 max-pool after
  each) and a Linear head, batch 256 of 3×32×32, float32, SGD with momentum;
* ``transformer``: ``nn.TransformerEncoder`` (8 layers, d_model 1024, 16 heads, feed-forward 4096,
  ``batch_first``), bf16 autocast, batch 32, sequence 256, fused AdamW.

Variants: ``baseline`` (unmonitored), ``default`` (``observe(model, opt)``: the overhead governor at its
2 % budget), ``every1`` (every step sampled), ``every10``, and ``item_hooks`` (``.item()`` in forward and
gradient hooks, each a host sync: what people write by hand).

**Timing.** On a GPU the host runs ahead of the device, so a single step's wall time says little. A
*round* is K steps of one variant between two ``torch.cuda.synchronize()`` calls, timed with
``perf_counter``; a *cycle* is one round of every variant, the order rotating each cycle. The ratio of a
variant is the median over cycles of its round time over the baseline's round time in the same cycle.
Warm-up cycles (not measured) let cuDNN pick its algorithms and the governor calibrate.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import bench_observe
import pytest
import torch
from bench_observe import ItemHooks, make_mlp
from torch import nn

import streamwatch as sw

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SEED = 0


def make_cnn() -> nn.Module:
    return bench_observe.make_cnn((64, 128, 256, 256))


def make_transformer() -> nn.Module:
    return bench_observe.SmallTransformer(d_model=1024, heads=16, feedforward=4096, layers=8)


@dataclass(frozen=True)
class Spec:
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    optimizer: Callable[[Any], torch.optim.Optimizer]
    steps: int  # K: steps per round
    autocast: torch.dtype | None = None


SPECS = {
    "mlp": Spec(make_mlp, (128, 784), lambda p: torch.optim.SGD(p, lr=0.01), steps=100),
    "cnn": Spec(make_cnn, (256, 3, 32, 32), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), steps=40),
    "transformer": Spec(
        make_transformer,
        (32, 256, 1024),
        lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True),
        steps=10,
        autocast=torch.bfloat16,
    ),
}
VARIANTS = ("baseline", "default", "every1", "every10", "item_hooks")
CYCLES, WARMUP = 15, 5


@dataclass
class Variant:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    watch: sw.Watch | None = None
    hooks: ItemHooks | None = None
    rounds: list[float] = field(default_factory=list)


def variant(name: str, spec: Spec) -> Variant:
    torch.manual_seed(SEED)
    model = spec.build().cuda().train()
    optimizer = spec.optimizer(model.parameters())
    v = Variant(name, model, optimizer)
    if name == "default":
        v.watch = sw.observe(model, optimizer)
    elif name.startswith("every"):
        v.watch = sw.observe(model, optimizer, every=int(name.removeprefix("every")))
    elif name == "item_hooks":
        v.hooks = ItemHooks(model)
    return v


def run_round(v: Variant, spec: Spec, x: torch.Tensor, y: torch.Tensor) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(spec.steps):
        with torch.autocast("cuda", dtype=spec.autocast or torch.float32, enabled=spec.autocast is not None):
            logits = v.model(x)
            loss = nn.functional.cross_entropy(logits, y)
        v.optimizer.zero_grad()
        loss.backward()
        v.optimizer.step()
        if v.watch is not None:
            v.watch.step(loss=loss, outputs=logits, targets=y, batch_size=x.shape[0])
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(
    spec: Spec, names: tuple[str, ...], cycles: int, warmup: int, benchmark: Any
) -> tuple[list[Variant], dict[str, float]]:
    """Interleaved cycles of ``names`` (the first the baseline); each variant's median ratio to it."""
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(spec.input_shape, generator=gen).cuda()
    y = torch.randint(0, 10, (spec.input_shape[0],), generator=gen).cuda()
    variants = [variant(name, spec) for name in names]
    done = 0

    def cycle() -> None:
        nonlocal done
        order = variants[done % len(variants) :] + variants[: done % len(variants)]
        for v in order:
            seconds = run_round(v, spec, x, y)
            if done >= warmup:
                v.rounds.append(seconds)
        done += 1

    for _ in range(warmup):
        cycle()
    benchmark.pedantic(cycle, rounds=cycles, iterations=1)
    base = variants[0].rounds
    info: dict[str, float] = {"baseline_ms": 1e3 * statistics.median(base) / spec.steps}
    for v in variants[1:]:
        info[v.name] = statistics.median(r / b for r, b in zip(v.rounds, base, strict=True))
    for v in variants:
        if v.watch is not None:
            v.watch.close()
            checked = v.watch.statistics()
            assert checked.hook_errors == 0, f"{v.name}: hook errors"
            assert checked.records_received > 0, f"{v.name}: no records"
        if v.hooks is not None:
            v.hooks.remove()
    return variants, info


def governor_info(v: Variant, spec: Spec) -> tuple[str, dict[str, float]]:
    """What the governed variant's watch says of itself: interval, measured overhead, samples/s."""
    assert v.watch is not None
    stats = v.watch.statistics()
    measured = float("nan") if stats.overhead_ratio is None else stats.overhead_ratio
    samples = spec.steps / statistics.median(v.rounds) / stats.sampling_interval
    line = f"governor: interval {stats.sampling_interval}, measured {measured:.3f}, {samples:.2f} samples/s"
    return line, {"interval": float(stats.sampling_interval), "measured": measured, "samples_s": samples}


@pytest.mark.parametrize("model_name", list(SPECS))
def test_cuda_overhead(benchmark: Any, bench_report: list[str], model_name: str) -> None:
    """Every variant, 15 measured cycles after 5 warm-up ones: the governor is still starting here
    (its first step is sampled, then it calibrates); ``test_cuda_governor`` measures it settled."""
    spec = SPECS[model_name]
    variants, info = measure(spec, VARIANTS, CYCLES, WARMUP, benchmark)
    line, governed = governor_info(variants[1], spec)
    benchmark.extra_info.update(info | governed)
    bench_report.append(
        f"{model_name:12s} step {info['baseline_ms']:.2f} ms  "
        + "  ".join(f"{v.name} {info[v.name]:.3f}x" for v in variants[1:])
        + f"  | {line}"
    )


# warm-up steps for the governor to calibrate and settle (about 3000 steps, 600 on the transformer)
SETTLE = {"mlp": 30, "cnn": 75, "transformer": 60}


@pytest.mark.parametrize("model_name", list(SPECS))
def test_cuda_governor(benchmark: Any, bench_report: list[str], model_name: str) -> None:
    """The default watch against the baseline alone, measured after the governor settled."""
    spec = SPECS[model_name]
    variants, info = measure(spec, ("baseline", "default"), CYCLES, SETTLE[model_name], benchmark)
    line, governed = governor_info(variants[1], spec)
    benchmark.extra_info.update(info | governed)
    bench_report.append(
        f"{model_name:12s} settled: step {info['baseline_ms']:.2f} ms, default {info['default']:.3f}x {line}"
    )
