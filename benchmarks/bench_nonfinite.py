"""What finding the first NaN costs: ``torch.autograd.detect_anomaly()`` against streamwatch's per-step
sentinel, its escalation and full sampling, each as a ratio to the same training step unmonitored.

Run:  make bench PYTEST_ARGS="-k nonfinite"
  or: python -m pytest benchmarks/bench_nonfinite.py -o python_files='bench_*.py' --benchmark-only

Every variant trains the same MLP (4 × Linear(512, 512), batch 64, SGD) in the same session; the ratios
to the unmonitored baseline measured in that session are printed under "benchmark report" and saved in
``extra_info``. No timing is asserted. ``tests/test_nonfinite.py`` checks that detect_anomaly and
streamwatch name the same module for a NaN produced in backward; this file records what each costs to
leave on:

* ``detect_anomaly``: anomaly mode on every step (it checks every backward function's outputs and keeps
  every forward's traceback) — what finding a backward NaN costs with torch alone;
* ``sentinel only``: ``observe(every=1000)`` — the steps are unsampled: the per-step finite check of the
  loss (and streamwatch's unsampled-step floor); ``no sentinel`` is the same with ``sentinel=()``, so
  their difference is the sentinel's cost;
* ``sentinel + grad_norm``: also the global gradient norm on every step (one pass over the gradients);
* ``every step`` and ``escalated``: the default ``observe()`` (every step sampled; weights and updates on
  one in 10) and every kind on every step, what sampling costs while an escalation lasts.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streamwatch as sw

STEPS = 40
WIDTH = 512
GROUP = "nonfinite: one MLP training step (4 x Linear(512, 512), batch 64)"
_baseline: dict[str, float] = {}


def _model() -> tuple[nn.Sequential, torch.optim.SGD]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


@contextmanager
def _anomaly() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled..."
        with torch.autograd.detect_anomaly():
            yield


def _runner(kind: str) -> Callable[[], None]:
    model, opt = _model()
    x, y = torch.randn(64, WIDTH), torch.randn(64, WIDTH)
    options: dict[str, object] = {
        "sentinel only": {"every": 1000},
        "no sentinel": {"every": 1000, "sentinel": ()},
        "sentinel + grad_norm": {"every": 1000, "sentinel": ("loss", "grad_norm")},
        "every step": {"every": 1},
        "escalated": {"cadence": {"param": 1, "update": 1}, "every": 1},
    }.get(kind, {})
    watch = sw.observe(model, opt, **options) if kind not in ("baseline", "detect_anomaly") else None  # type: ignore[arg-type]

    def run() -> None:
        context = _anomaly() if kind == "detect_anomaly" else nullcontext()
        with context:
            for _ in range(STEPS):
                loss = F.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if watch is not None:
                    watch.step(loss=loss)

    run.watch = watch  # type: ignore[attr-defined]
    return run


KINDS = [
    "baseline",
    "detect_anomaly",
    "no sentinel",
    "sentinel only",
    "sentinel + grad_norm",
    "every step",
    "escalated",
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.benchmark(group=GROUP)
def test_step_cost(benchmark: pytest.FixtureRequest, bench_report: list[str], kind: str) -> None:
    run = _runner(kind)
    run()  # warm-up
    benchmark.pedantic(run, rounds=7, iterations=1)
    per_step = benchmark.stats.stats.median / STEPS
    benchmark.extra_info["ms_per_step"] = per_step * 1e3
    if kind == "baseline":
        _baseline["step"] = per_step
    watch = run.watch  # type: ignore[attr-defined]
    if watch is not None:
        watch.close()
    if "step" in _baseline:
        ratio = per_step / _baseline["step"]
        benchmark.extra_info["ratio_to_baseline"] = ratio
        bench_report.append(f"nonfinite {kind:>22}: {per_step * 1e3:7.3f} ms/step  {ratio:5.2f}x unmonitored")


@pytest.mark.benchmark(group=GROUP)
def test_paired_ratios(benchmark: pytest.FixtureRequest, bench_report: list[str]) -> None:
    """The same variants timed in turn, round after round (paired: a noisy neighbour slows a round's
    variants alike); each ratio is the median over the rounds of the variant's time over the baseline's
    in the same round."""
    import statistics
    import time

    runners = {kind: _runner(kind) for kind in KINDS}
    for run in runners.values():
        run()  # warm-up
    ratios: dict[str, list[float]] = {kind: [] for kind in KINDS}

    def rounds() -> None:
        for _ in range(9):
            times = {}
            for kind, run in runners.items():
                start = time.perf_counter()
                run()
                times[kind] = time.perf_counter() - start
            for kind in KINDS:
                ratios[kind].append(times[kind] / times["baseline"])

    benchmark.pedantic(rounds, rounds=1, iterations=1)
    for kind in KINDS:
        ratio = statistics.median(ratios[kind])
        benchmark.extra_info[f"paired_ratio[{kind}]"] = ratio
        bench_report.append(f"nonfinite paired {kind:>22}: {ratio:5.2f}x unmonitored (median of 9 rounds)")
    for run in runners.values():
        if run.watch is not None:  # type: ignore[attr-defined]
            run.watch.close()  # type: ignore[attr-defined]
