"""Past one Prometheus: a real Prometheus scrapes two real exporters (ranks 0 and 1 of one run) and
remote-writes everything — scraped series, recording rules, ``ALERTS`` — to a real VictoriaMetrics single
node; every query of every dashboard (the variables resolved against each store the way Grafana would,
``tests/test_dashboards_e2e.py``) returns the same series with the same values from VictoriaMetrics as
from Prometheus, at the same instant during training.

Skipped without the ``prometheus`` or ``victoria-metrics`` binary, except under
``STREAMWATCH_REQUIRE_PROMETHEUS=1`` (CI), where a missing one fails the test.
"""

from __future__ import annotations

import math
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streamwatch as sw
from tests.promserver import (
    PrometheusServer,
    VictoriaMetricsServer,
    require_prometheus,
    require_victoria_metrics,
)
from tests.test_dashboards import load_generator
from tests.test_dashboards_e2e import ALWAYS_FIRING, RULES, all_values, first, resolved_queries

TRAIN_S = 14.0  # seconds of training: the rate windows ($__rate_interval = 4 s) well inside it


class AtTime:
    """A query backend whose instant queries all run at one time (both stores asked about one instant)."""

    def __init__(self, backend: PrometheusServer, at: float) -> None:
        self.backend, self.at = backend, at

    def query(self, promql: str, time: float | None = None) -> list[dict[str, Any]]:
        return self.backend.query(promql, self.at)

    def label_values(self, label: str, match: str | None = None) -> list[str]:
        return self.backend.label_values(label, match)


def _result(series: list[dict[str, Any]]) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s["metric"].items())): float(s["value"][1]) for s in series}


RATES = re.compile(r"\b(rate|increase)\(")
RANGE_SELECTOR = re.compile(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\{[^}]*\}\[[^\]]+\]")


def _raw(series: list[dict[str, Any]]) -> dict[tuple[tuple[str, str], ...], list[tuple[float, float]]]:
    """A range selector's stored samples (an instant query's matrix), by label set: (time in ms, value)."""
    return {
        tuple(sorted(s["metric"].items())): [(round(float(t) * 1000), float(v)) for t, v in s["values"]]
        for s in series
    }


def _same(a: float, b: float) -> bool:
    """Equal to VictoriaMetrics' precision: it stores a float as a decimal of about 15 digits."""
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _same_samples(a: dict[Any, list[tuple[float, float]]], b: dict[Any, list[tuple[float, float]]]) -> bool:
    return a.keys() == b.keys() and all(
        len(a[k]) == len(b[k])
        and all(ta == tb and _same(va, vb) for (ta, va), (tb, vb) in zip(a[k], b[k], strict=True))
        for k in a
    )


def _train(stop: threading.Event, watches: list[tuple[sw.Watch, nn.Module, torch.optim.Optimizer]]) -> None:
    g = torch.Generator().manual_seed(1)
    while not stop.is_set():
        for watch, model, opt in watches:
            x, y = torch.randn(32, 10, generator=g), torch.randint(0, 4, (32,), generator=g)
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            watch.step(loss=loss, outputs=out, targets=y, batch_size=32)
        time.sleep(0.01)


@pytest.mark.timeout(240)
def test_every_dashboard_query_returns_the_same_from_victoriametrics_as_from_prometheus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_prometheus()
    require_victoria_metrics()
    generator = load_generator()
    dashboards = {name: generator.build(name) for name in generator.DASHBOARDS}
    watches = []
    exporters = []
    for rank in (0, 1):  # two ranks of one run, each with its identity (torchrun's variables)
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        torch.manual_seed(rank)
        model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        metrics = [*sw.DEFAULT_METRICS, sw.metrics.Histogram(kinds=("param_grad",))]  # (one per watch)
        watch = sw.observe(model, opt, metrics=metrics, overhead=0.05)
        exporters.append(watch.expose(port=0, run="vm"))
        watches.append((watch, model, opt))
    always = tmp_path / "always.rules.yml"
    always.write_text(ALWAYS_FIRING, encoding="utf-8")
    stop = threading.Event()
    trainer = threading.Thread(target=_train, args=(stop, watches))
    try:
        with (
            VictoriaMetricsServer(tmp_path / "vm") as vm,
            PrometheusServer(
                tmp_path / "prom",
                [f"127.0.0.1:{e.port}" for e in exporters],
                rule_files=[RULES, always],
                remote_write=[vm.write_url],
            ) as prom,
        ):
            trainer.start()
            prom.wait_for('count(up{job="streamwatch"} == 1) == 2', timeout=30)
            time.sleep(TRAIN_S)
            at = time.time() - 2.0  # an instant inside training, every series scraped around it
            time.sleep(1.0)
            stop.set()
            trainer.join()
            # every sample up to `at`, scraped and recorded, has reached VictoriaMetrics
            vm.wait_for(
                f"count(last_over_time(streamwatch_step[1m] @ {at:.3f}))", lambda r: bool(r), timeout=30
            )
            time.sleep(3.0)  # (remote write sends in batches within a second)
            for pick in (first, all_values):
                on_prom = resolved_queries(AtTime(prom, at), dashboards, pick)
                on_vm = resolved_queries(AtTime(vm, at), dashboards, pick)
                assert [q[:3] for q in on_vm] == [q[:3] for q in on_prom]  # the same variables resolved
                differ = []
                for name, title, query, required in on_prom:
                    want, got = _result(prom.query(query, at)), _result(vm.query(query, at))
                    if required:
                        assert want, f"{name}: {title}: no data from Prometheus: {query}"
                    if RATES.search(query):
                        # the same series from the same stored samples; MetricsQL's rate() and increase()
                        # do not extrapolate to the window's edges (they read the sample before it), so
                        # their values differ from Prometheus' by design (docs/scale.md)
                        if "topk" in query:  # which rank is the slowest may differ with the values
                            same = len(want) == len(got)
                        else:
                            same = want.keys() == got.keys() and all(
                                math.isnan(want[k]) == math.isnan(got[k]) for k in want
                            )
                        for selector in RANGE_SELECTOR.findall(query):
                            raw_prom, raw_vm = _raw(prom.query(selector, at)), _raw(vm.query(selector, at))
                            same = same and _same_samples(raw_prom, raw_vm) and (bool(raw_prom) or not want)
                    else:
                        same = want.keys() == got.keys() and all(_same(want[k], got[k]) for k in want)
                    if not same:
                        differ.append(f"{name}: {title}: {query}\n  prometheus: {want}\n  victoria:   {got}")
                assert not differ, "\n".join(differ)
    finally:
        stop.set()
        if trainer.is_alive():
            trainer.join()
        for watch, _, _ in watches:
            watch.close()
