"""What each opt-in metric costs when on, and that the defaults cost nothing extra when they are off.

Run (about 2 minutes; not part of the test suite)::

    python -m pytest benchmarks/bench_metrics.py -o python_files='bench_*.py' -p no:cacheprovider \
        --benchmark-only

The MLP of ``bench_observe.py`` (784-1024-1024-1024-10, batch 128, SGD, 2 threads), run the same way:
every variant on its own copy of the model, interleaved round by round, each variant's cost per step the
median over its measured steps, reported as a ratio to the unmonitored step of the same run. Variants:

* ``baseline``: unmonitored; ``no_metrics``: ``observe(model, opt, metrics=())``; ``default``: the
  default, whose worker-side metrics (``update_ratio``, ``layer_mean``) run on the worker thread;
* one variant per opt-in metric, added to the defaults, sampled **every step** (``every=1``, their worst
  case; divide their extra cost by the ``every`` you choose): ``GradientCosine``, ``GradientCosine(of=
  "update")``, ``SpectralNorm``, ``Histogram(param_grad)``, ``Histogram(activation)``, ``PNorm(p=1,
  param_grad)``; and, on their own coarser cadence because each sample is a large job,
  ``ConditionNumber(every=10)``, ``ActivationSimilarity(every=10)`` (a 1 024-sample probe),
  ``HessianMaxEig(every=10)`` (20 iterations on a 128-sample batch) and ``TestAccuracy(every=10)``
  (one forward pass over 1 024 test samples). For those four, ``per_sample_ms`` is what one sampled
  step costs beyond the default's step with weights and updates; ``ratio`` is the amortised cost at
  that cadence.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_observe as bench  # the models, the step and the worker wait (not a package)

import streamwatch as sw

ROUNDS = 6
K = 20  # steps per round and variant
COARSE = 10  # the cadence of the four heavy metrics
HEAVY = ("condition_number", "cca_similarity", "hessian_max_eig", "test_accuracy")


def _variants(spec: bench.Spec) -> dict[str, bench.Variant]:
    g = torch.Generator().manual_seed(7)
    probe = torch.randn(1024, 784, generator=g)
    x_test, y_test = torch.randn(1024, 784, generator=g), torch.randint(0, 10, (1024,), generator=g)
    x_fix, y_fix = torch.randn(128, 784, generator=g), torch.randint(0, 10, (128,), generator=g)

    def evaluate(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        model.eval()
        with torch.no_grad():
            out = model(x_test)
        return {"accuracy": (out.argmax(-1) == y_test).float().mean(), "loss": F.cross_entropy(out, y_test)}

    def hessian_loss(model: torch.nn.Module) -> torch.Tensor:
        return F.cross_entropy(model(x_fix), y_fix)

    opt_in: dict[str, Any] = {
        "cosine_grad": lambda: sw.metrics.GradientCosine(),
        "cosine_update": lambda: sw.metrics.GradientCosine(of="update"),
        "spectral_norm": lambda: sw.metrics.SpectralNorm(),
        "histogram_grad": lambda: sw.metrics.Histogram(kinds=("param_grad",)),
        "histogram_act": lambda: sw.metrics.Histogram(kinds=("activation",)),
        "pnorm1_grad": lambda: sw.metrics.PNorm(p=1, kinds=("param_grad",)),
        "condition_number": lambda: sw.metrics.ConditionNumber(every=COARSE),
        "cca_similarity": lambda: sw.metrics.ActivationSimilarity(probe, layers=["2", "4"], every=COARSE),
        "hessian_max_eig": lambda: sw.metrics.HessianMaxEig(hessian_loss, every=COARSE),
        "test_accuracy": lambda: sw.metrics.TestAccuracy(evaluate, every=COARSE),
    }
    made: dict[str, bench.Variant] = {"baseline": bench.Variant("baseline", bench.build(spec), period=1)}
    for name, metrics in (("no_metrics", ()), ("default", sw.DEFAULT_METRICS)):
        variant = bench.Variant(name, bench.build(spec), period=bench.WEIGHT_CADENCE)
        variant.watch = sw.observe(variant.model, variant.optimizer, metrics=metrics, every=1)
        made[name] = variant
    for name, factory in opt_in.items():
        metric = factory()
        period = bench.WEIGHT_CADENCE if metric.every == 1 else metric.every
        variant = bench.Variant(name, bench.build(spec), period=period)
        variant.watch = sw.observe(
            variant.model, variant.optimizer, metrics=[*sw.DEFAULT_METRICS, metric], every=1
        )
        made[name] = variant
    return made


@pytest.mark.timeout(900)
@pytest.mark.benchmark(group="opt-in metrics: one interleaved cycle (K steps of every variant), mlp")
def test_metric_costs(benchmark: Any, bench_report: list[str]) -> None:
    spec = bench.SPECS["mlp"]
    x, y = spec.data()
    variants = _variants(spec)
    order = list(variants.values())
    cycles = 0
    warmup = 0 if benchmark.disabled else 1
    try:

        def cycle() -> None:
            nonlocal cycles
            shift = cycles % len(order)
            for variant in order[shift:] + order[:shift]:
                variant.recording = cycles >= warmup
                variant.run(K, x, y)
            cycles += 1

        benchmark.pedantic(cycle, rounds=ROUNDS, iterations=1, warmup_rounds=warmup)
        for variant in variants.values():
            if variant.watch is not None:
                stats = variant.watch.statistics()
                assert stats.hook_errors == 0, (variant.name, stats)
                assert stats.records_received > 0, (variant.name, stats)
    finally:
        for variant in variants.values():
            if variant.watch is not None:
                variant.watch.close()
    base = variants["baseline"].cost()
    lines = [f"{'variant':<18}{'ms/step':>9}{'ratio':>8}{'vs default':>12}{'per sample ms':>15}"]
    default = variants["default"].cost()
    for name, variant in variants.items():
        cost = variant.cost()
        per_sample = ""
        if name in HEAVY and variant.times[True]:
            # a sampled step against the default's steps with weights and updates (the same steps)
            extra = statistics.median(variant.times[True]) - statistics.median(
                variants["default"].times[True]
            )
            per_sample = f"{1e3 * extra:.1f}"
            benchmark.extra_info[f"{name}_per_sample_ms"] = 1e3 * extra
        benchmark.extra_info[f"{name}_ratio"] = cost / base
        lines.append(
            f"{name:<18}{1e3 * cost:>9.2f}{cost / base:>8.3f}{cost / default:>12.3f}{per_sample:>15}"
        )
    bench_report.extend(["opt-in metrics on the MLP, every step unless a cadence is given:", *lines])
