"""Pipeline cost per event: ``map -> window(100) -> mean`` vs the same thing written by hand.

Run:  make bench
  or: python -m pytest benchmarks/bench_pipeline.py -o python_files='bench_*.py' --benchmark-only

Both variants run in the same session on the same 100 000 floats, so their ratio is meaningful on any
machine. The vectorised variant pushes one numpy row of 1 000 per-layer values per event, the way the
worker pushes whole step records: the per-event Python cost is paid once for all layers.
"""

from __future__ import annotations

import numpy as np
import pytest

import streamwatch as sw
from streamwatch import ops

EVENTS = 100_000
VALUES = [float(i % 977) for i in range(EVENTS)]


def scale(x: float) -> float:
    return x * 0.5


def run_pipeline() -> list[float]:
    out = sw.sinks.collect()
    pipeline = sw.source() | ops.map(scale) | ops.window(100) | ops.mean() | out
    push = pipeline.push
    for x in VALUES:
        push(x)
    pipeline.close()
    return out.items


def run_by_hand() -> list[float]:
    out: list[float] = []
    window: list[float] = []
    for x in VALUES:
        window.append(scale(x))
        if len(window) == 100:
            out.append(sum(window) / 100)
            window = []
    return out


def test_same_result() -> None:
    np.testing.assert_allclose(run_pipeline(), run_by_hand())


@pytest.mark.benchmark(group="pipeline: map->window(100)->mean, 100k events")
def test_pipeline(benchmark: pytest.FixtureRequest) -> None:
    result = benchmark.pedantic(run_pipeline, rounds=5, iterations=1)
    benchmark.extra_info["ns_per_event"] = benchmark.stats.stats.median / EVENTS * 1e9
    assert len(result) == EVENTS // 100


@pytest.mark.benchmark(group="pipeline: map->window(100)->mean, 100k events")
def test_hand_written_loop(benchmark: pytest.FixtureRequest) -> None:
    result = benchmark.pedantic(run_by_hand, rounds=5, iterations=1)
    benchmark.extra_info["ns_per_event"] = benchmark.stats.stats.median / EVENTS * 1e9
    assert len(result) == EVENTS // 100


ROWS = np.random.default_rng(0).random((2_000, 1_000), dtype=np.float32)


def run_vectorised() -> list[np.ndarray]:
    out = sw.sinks.collect()
    pipeline = sw.source() | ops.map(np.sqrt) | ops.window(100) | ops.mean() | out
    for row in ROWS:
        pipeline.push(row)
    pipeline.close()
    return out.items


@pytest.mark.benchmark(group="pipeline: 1000 layers per event, 2k events")
def test_pipeline_vectorised_over_layers(benchmark: pytest.FixtureRequest) -> None:
    result = benchmark.pedantic(run_vectorised, rounds=5, iterations=1)
    per_event = benchmark.stats.stats.median / len(ROWS)
    benchmark.extra_info["summaries_per_s"] = ROWS.shape[1] / per_event
    np.testing.assert_allclose(result[0], np.sqrt(ROWS[:100]).mean(axis=0), rtol=1e-5)
