"""How long one ``/metrics`` render takes for 1 k and 10 k series (budget: ≤ 40 ms at 10 k), against the
same series as plain ``prometheus_client`` ``Gauge.labels(...).set(...)`` objects in the same run.

Run::

    python -m pytest benchmarks/bench_exporter.py -o python_files='bench_*.py' -p no:cacheprovider \
        --benchmark-only

The streamwatch side is the real thing: a Watch over a model with enough layers that its
``streamwatch_tensor`` family has the wanted number of series (about 29 statistics per tapped tensor),
its worker's latest values, and the work a scrape does: ``Exporter.collector.render()`` behind
``watch.expose()``'s endpoint, and ``generate_latest`` when the collector sits in a caller's registry.
The baseline registers one labelled ``Gauge`` with the same label sets and values, already set (what
people write by hand; its cost on the training thread, one ``.set()`` per series per step, is not counted).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from torch import nn

import streamwatch as sw

STATS_PER_ROW = 29  # streamwatch_tensor series per tapped tensor (COLUMNS + derived + update_ratio)


def _watch(series: int) -> tuple[sw.Watch, Any]:
    width = max(
        1, series // (STATS_PER_ROW * 3)
    )  # 3 tapped tensors per Linear: activation, output/param grads
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(width)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = sw.observe(model, opt, metrics=())
    exporter = watch.expose(port=0, series_budget=10**6)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    watch.step()
    assert watch.flush()
    return watch, exporter


@pytest.mark.parametrize("path", ["expose", "registry"])
@pytest.mark.parametrize("series", [1_000, 10_000])
@pytest.mark.benchmark(group="/metrics render")
def test_streamwatch_collector(benchmark: Any, series: int, path: str, bench_report: list[str]) -> None:
    """``expose``: the render ``watch.expose()``'s endpoint runs (cached label strings); ``registry``:
    ``generate_latest`` over the same collector in a registry (prometheus_client's formatter)."""
    watch, exporter = _watch(series)
    try:
        exported = sum(1 for s in watch.snapshot() if s.name == "streamwatch_tensor")
        render = exporter.collector.render if path == "expose" else lambda: generate_latest(exporter.registry)
        body = benchmark(render)
        assert body.count(b"streamwatch_tensor{") == exported
        benchmark.extra_info["series"] = exported
        if not benchmark.disabled:
            bench_report.append(
                f"/metrics render, streamwatch ({path}): {exported} series, "
                f"median {benchmark.stats.stats.median * 1e3:.1f} ms (budget ≤ 40 ms at 10 k)"
            )
    finally:
        watch.close()


@pytest.mark.parametrize("series", [1_000, 10_000])
@pytest.mark.benchmark(group="/metrics render")
def test_plain_gauges(benchmark: Any, series: int, bench_report: list[str]) -> None:
    watch, _ = _watch(series)
    try:
        samples = [s for s in watch.snapshot() if s.name == "streamwatch_tensor"]
    finally:
        watch.close()
    registry = CollectorRegistry()
    names = list(samples[0].labels)
    gauge = Gauge("streamwatch_tensor", "the same series by hand", names, registry=registry)
    for s in samples:
        gauge.labels(*(s.labels[n] for n in names)).set(s.value)
    body = benchmark(generate_latest, registry)
    assert body.count(b"streamwatch_tensor{") == len(samples)
    if not benchmark.disabled:
        bench_report.append(
            f"/metrics render, plain Gauge.labels: {len(samples)} series, "
            f"median {benchmark.stats.stats.median * 1e3:.1f} ms"
        )
