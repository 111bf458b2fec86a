"""The Prometheus exporter over real HTTP: what /metrics serves equals ``watch.snapshot()`` and
``watch.statistics()``; identity labels, ports per local rank, a taken port, the series budget and
histograms. The end-to-end scrape by a real Prometheus server is in ``test_prometheus_e2e.py``; the
server's limits (half-open connections, timeouts, scrape storms, methods, hosts, promtool) in
``test_exporter_limits.py``.
"""

from __future__ import annotations

import errno
import logging
import math
import socket
import urllib.request
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

import streamwatch as sw
from streamwatch import SeriesKey
from streamwatch._families import PER_LAYER_FAMILIES, exposed_sample
from streamwatch._schema import COLUMN
from streamwatch._steptimes import STEP_BUCKETS
from streamwatch.sinks._http import OPENMETRICS_CONTENT_TYPE
from tests.promtool import check_metrics, lint_problems
from tests.training import train

IDENTITY = ("run", "rank", "local_rank", "world_size", "host")
OPENMETRICS_ACCEPT = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
SERIES_IDENTITY = ("run", "rank")  # on every series; the rest of the identity on streamwatch_info alone


# the families of the core statistics a scrape over the series budget keeps (docs/prometheus.md)
_CORE_FAMILIES = (
    "elements",
    "sum_of_squares",
    "l2",
    "mean",
    "min",
    "max",
    "nonfinite_elements",
    "dead_ratio",
)


def _train(watch: sw.Watch, model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    train(model, opt, watch, steps, shape=(16, 6), seed=0, flush=True)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _scrape(url: str) -> dict[str, list[Any]]:
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    families: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(body):
        families.setdefault(family.name, []).extend(family.samples)
    return families


def test_metrics_served_equal_the_snapshot_and_statistics() -> None:
    model, opt = _model()
    with sw.observe(model, opt, cadence={"param": 1, "update": 1}, every=1) as watch:
        exporter = watch.expose(port=0, run="unit")
        _train(watch, model, opt)
        families = _scrape(exporter.url)
        snapshot = watch.snapshot()
        stats = watch.statistics()
    ident = {"run": "unit", "rank": "0", "local_rank": "0", "world_size": "1", "host": socket.gethostname()}
    # /metrics serves one family per statistic (streamwatch_tensor{stat="l2"} -> streamwatch_tensor_l2)
    exposed = [exposed_sample(s) for s in snapshot if s.name != "streamwatch_tensor_histogram"]
    want = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in exposed}
    assert len(want) == len(exposed) > 100
    got: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for name in {n for n, _ in want}:
        for sample in families[name]:
            labels = dict(sample.labels)
            # every series carries run and rank, and nothing else of the identity
            assert {k: labels.pop(k) for k in SERIES_IDENTITY} == {"run": "unit", "rank": "0"}
            assert not set(labels) & set(IDENTITY)
            # counters (the detectors' spike counts) are named without _total in the snapshot
            got[(sample.name.removesuffix("_total"), tuple(sorted(labels.items())))] = sample.value
    assert got == want
    served = [s for family in families.values() for s in family]
    assert not [s for s in served if "stat" in s.labels]  # no stat label anywhere on /metrics
    assert not [s for s in served if s.name != "streamwatch_info" and "host" in s.labels]
    info = families["streamwatch_info"]
    assert info[0].name == "streamwatch_info"
    assert info[0].value == 1.0
    assert {k: info[0].labels[k] for k in IDENTITY} == ident

    def one(name: str, **labels: str) -> float:
        matches = [
            s.value
            for s in families[name.removesuffix("_total")]
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        assert len(matches) == 1, (name, labels, families.get(name))
        return float(matches[0])

    assert one("streamwatch_steps_total") == stats.steps == 3
    assert one("streamwatch_steps_sampled_total") == stats.sampled == 3
    assert one("streamwatch_records_total") == 3
    assert one("streamwatch_records_dropped_total", reason="drop_oldest") == 0
    assert one("streamwatch_queue_length") == 0
    assert one("streamwatch_hook_errors_total") == 0
    # every series of the per-layer families counts (no histograms here: one sample per series)
    per_layer = {family.name for family in PER_LAYER_FAMILIES}
    assert one("streamwatch_series") == sum(1 for s in snapshot if s.name in per_layer)
    assert one("streamwatch_series") > sum(1 for s in snapshot if s.name == "streamwatch_tensor")
    assert one("streamwatch_series_wanted") == one("streamwatch_series")
    assert one("streamwatch_overhead_seconds_total") > 0
    assert one("streamwatch_overhead_last_step_seconds") > 0
    assert not [s for f in families.values() for s in f if math.isnan(s.value)]  # absent, never NaN


def test_global_norm_from_exported_sums_of_squares_is_exact() -> None:
    """The documented PromQL sqrt(sum(sumsq)) over the exported rows equals the norm of all gradients."""
    model, opt = _model()
    records = sw.sinks.collect()
    with sw.observe(model, opt, sinks=[records], every=1) as watch:
        exporter = watch.expose(port=0)
        _train(watch, model, opt, steps=1)
        families = _scrape(exporter.url)
    sumsq = [
        s.value for s in families["streamwatch_tensor_sum_of_squares"] if s.labels["kind"] == "param_grad"
    ]
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert math.sqrt(sum(sumsq)) == pytest.approx(float(grads.norm()), rel=1e-5)


def _labels_served_one_port_up() -> dict[str, str]:
    """Train a step with ``expose(port=base)`` for a free base port; check that this process serves on
    ``base + 1`` (its local rank's port); the identity labels it serves."""
    with socket.socket() as probe:  # two free consecutive ports are likely above a free one
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1]
    model, opt = _model()
    with sw.observe(model, opt, every=1) as watch:
        try:
            exporter = watch.expose(port=base)
        except OSError as err:  # base + 1 was taken by chance
            pytest.skip(f"port {base + 1} busy: {err}")
        assert exporter.port == base + 1
        _train(watch, model, opt, steps=1)
        families = _scrape(exporter.url)
    (info,) = families["streamwatch_info"]
    assert dict(families["streamwatch_loss"][0].labels) == {
        "phase": "train",
        "run": info.labels["run"],
        "rank": info.labels["rank"],
    }
    return dict(info.labels)


def test_each_local_rank_serves_on_its_own_port_with_torchrun_identity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("STREAMWATCH_RUN", "from-env")
    labels = _labels_served_one_port_up()
    assert (labels["rank"], labels["local_rank"], labels["world_size"], labels["run"]) == (
        "5",
        "1",
        "8",
        "from-env",
    )


def test_a_spawned_rank_takes_its_identity_and_port_from_torch_distributed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``mp.spawn`` sets no ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``: every rank served ``rank="0"``,
    ``world_size="1"``, and every rank tried the same port. (torch.distributed's answers faked: a real
    2-process run is ``tests/test_torchrun.py``'s.)"""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    labels = _labels_served_one_port_up()
    assert (labels["rank"], labels["local_rank"], labels["world_size"]) == ("1", "1", "2")


@pytest.mark.parametrize("name", ["RANK", "LOCAL_RANK", "WORLD_SIZE"])
def test_an_empty_or_bad_rank_variable_is_read_as_unset_or_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    for other in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, "")  # (a launcher that exports it empty: unset)
    model, _ = _model()
    with sw.observe(model, every=1) as watch:
        exporter = watch.expose(port=0)
        model(torch.randn(2, 6)).sum().backward()
        watch.step(loss=1.0)
        assert watch.flush()  # (the scrape reads what the worker has handled)
        labels = _scrape(exporter.url)["streamwatch_info"][0].labels
    assert (labels["rank"], labels["local_rank"], labels["world_size"]) == ("0", "0", "1")
    monkeypatch.setenv(name, "two")
    with pytest.raises(ValueError, match=rf"\${name} to be an integer.*'two'"):
        sw.observe(model, every=1)  # (the rank is read when the watch is made)


def test_a_taken_port_is_a_clear_error_naming_the_port_and_the_fix() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        model, _ = _model()
        with sw.observe(model, every=1) as watch:
            with pytest.raises(
                OSError, match=rf"port {port} on 127.0.0.1 is already in use.*expose\(port="
            ) as info:
                watch.expose(port=port)
            assert info.value.errno == errno.EADDRINUSE
            exporter = watch.expose(port=0)  # the failed one left nothing registered behind
            assert exporter.port != port
    with sw.observe(_model()[0], every=1) as watch, pytest.raises(ValueError, match="`port` to be an int"):
        watch.expose(port=70000)


def test_an_expose_the_registry_refuses_keeps_no_port_and_a_closed_watch_refuses_expose() -> None:
    registry = CollectorRegistry(auto_describe=True)  # (as prometheus_client's global REGISTRY)
    with socket.socket() as probe:  # a port free now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with sw.observe(_model()[0], every=1) as first, sw.observe(_model()[0], every=1) as second:
        first.expose(port=0, registry=registry)
        with pytest.raises(ValueError, match="Duplicated"):  # the same series twice in one registry
            second.expose(port=port, registry=registry)
        with socket.socket() as again:  # the refused exporter's socket was closed, not left listening
            again.bind(("127.0.0.1", port))
    with pytest.raises(RuntimeError, match="closed: expose\\(\\) it before close"):
        second.expose(port=0)  # its close() ran: a server started now would never be stopped


def test_a_module_name_that_is_no_utf8_does_not_fail_the_scrape() -> None:
    # a lone surrogate (add_module accepts any str) cannot be encoded: the scrape answered 500 for every
    # series; now that label reads "?" and everything else is served
    model = nn.Sequential()
    model.add_module("bad\udc80", nn.Linear(6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sw.observe(model, opt, every=1) as watch:
        exporter = watch.expose(port=0)
        _train(watch, model, opt, steps=1)
        families = _scrape(exporter.url)
    layers = {sample.labels.get("layer") for sample in families["streamwatch_tensor_l2"]}
    assert "bad?" in layers
    assert families["streamwatch_loss"]


def test_a_caller_supplied_registry_and_no_values_before_the_first_step() -> None:
    registry = CollectorRegistry()
    model, opt = _model()
    with sw.observe(model, opt, every=1) as watch:
        watch.expose(port=0, registry=registry)
        before = generate_latest(registry).decode()
        assert "\nstreamwatch_tensor_l2{" not in before  # absent before the first step, never a placeholder
        assert "streamwatch_steps_total" in before
        _train(watch, model, opt, steps=1)
        after = generate_latest(registry).decode()
    assert "streamwatch_tensor_l2{" in after
    assert "streamwatch_info{" in after
    assert "streamwatch_tensor" not in generate_latest(registry).decode()  # close() unregistered it


def test_the_series_budget_reduces_to_core_statistics_then_to_aggregates(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, opt = _model()
    with sw.observe(model, opt, cadence={"param": 1, "update": 1}, every=1) as watch:
        _train(watch, model, opt, steps=1)
        snapshot = [s for s in watch.snapshot() if s.name == "streamwatch_tensor"]
        rows = {tuple(sorted((k, v) for k, v in s.labels.items() if k != "stat")) for s in snapshot}
        core = sw.sinks.Exporter(
            watch.store,
            watch.statistics,
            serve=False,
            series_budget=len(rows) * len(sw.sinks._prometheus.CORE_STATS),
        )
        tight = sw.sinks.Exporter(watch.store, watch.statistics, serve=False, series_budget=20)
        with caplog.at_level(logging.WARNING, logger="streamwatch"):
            core_text = generate_latest(core.registry).decode()
            tight_text = generate_latest(tight.registry).decode()
            generate_latest(tight.registry)
        table, keys = watch.store.table()
    core_names = {
        f.name for f in text_string_to_metric_families(core_text) if f.name.startswith("streamwatch_tensor_")
    }
    assert core_names <= {f"streamwatch_tensor_{name}" for name in _CORE_FAMILIES}
    assert len(core_names) >= 6
    tight_samples = [
        s
        for f in text_string_to_metric_families(tight_text)
        if f.name.startswith("streamwatch_tensor_")
        for s in f.samples
    ]
    assert {s.labels["layer"] for s in tight_samples} == {"__all__"}
    # the aggregate of param_grad: sum of the rows' sums of squares, max of maxima
    grads = [i for i, k in enumerate(keys) if k.kind == "param_grad"]
    got = {s.name: s.value for s in tight_samples if s.labels["kind"] == "param_grad"}
    sumsq, high = table[grads, COLUMN["sumsq"]], table[grads, COLUMN["max"]]
    assert got["streamwatch_tensor_sum_of_squares"] == pytest.approx(float(sumsq.sum()), rel=1e-12)
    assert got["streamwatch_tensor_max"] == float(high.max())
    assert got["streamwatch_tensor_l2"] == pytest.approx(math.sqrt(float(sumsq.sum())), rel=1e-12)
    reduced = [
        f
        for f in text_string_to_metric_families(generate_latest(tight.registry).decode())
        if f.name == "streamwatch_series_reduced"
    ]
    assert reduced[0].samples[0].value == 3  # every scrape of the tight exporter reduced
    warnings = [r for r in caplog.records if "series budget" in r.getMessage()]
    assert len(warnings) == 2  # once per exporter
    assert "observe(select=...)" in warnings[0].getMessage()


def test_histograms_are_prometheus_histograms_with_the_fixed_buckets() -> None:
    model, opt = _model()
    buckets = sw.metrics.Buckets(lo=-4, hi=2, per_decade=2)
    metric = sw.metrics.Histogram(kinds=("activation",), buckets=buckets)
    records = sw.sinks.collect()
    with sw.observe(model, opt, metrics=[metric], sinks=[records], every=1) as watch:
        exporter = watch.expose(port=0)
        _train(watch, model, opt, steps=1)
        families = _scrape(exporter.url)
    counts = records.items[-1].extras[(SeriesKey("train", "1", "activation", ""), "histogram")]
    series = [s for s in families["streamwatch_tensor_values"] if s.labels["layer"] == "1"]
    bucket_samples = [s for s in series if s.name == "streamwatch_tensor_values_bucket"]
    upper = buckets.upper_bounds()
    assert [float(s.labels["le"]) for s in bucket_samples] == upper  # ascending, ending at +Inf
    cumulative = np.cumsum(counts[1:])  # the non-finite bucket is not a value
    assert [s.value for s in bucket_samples] == cumulative.tolist()
    assert bucket_samples[-1].value == 16 * 8 - counts[0]  # +Inf: every finite value


def test_step_phase_times_are_read_at_the_step_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake clock (advanced by the model, the test and a user optimizer hook) gives exact parts:
    data wait, forward, backward and optimizer, served as streamwatch_step_phase_seconds{part}."""
    from streamwatch import _tapstate

    clock = [100.0]
    monkeypatch.setattr(_tapstate.StepTimes, "clock", staticmethod(lambda: clock[0]))

    class Tick(nn.Module):
        def __init__(self, seconds: float) -> None:
            super().__init__()
            self.seconds = seconds

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            clock[0] += self.seconds
            return x

    torch.manual_seed(0)
    model = nn.Sequential(Tick(0.25), nn.Linear(4, 2), Tick(0.25))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sw.observe(model, opt, every=1) as watch:
        opt.register_step_pre_hook(lambda *_: clock.__setitem__(0, clock[0] + 0.0625))  # after ours
        for _ in range(2):
            clock[0] += 0.125  # waiting for data
            loss = model(torch.randn(3, 4)).pow(2).mean()
            loss.backward()
            clock[0] += 0.375  # the rest of backward
            opt.step()
            opt.zero_grad()
            watch.step(loss=loss)
        exporter = watch.expose(port=0)
        assert watch.flush()
        families = _scrape(exporter.url)
    parts = {s.labels["part"]: s.value for s in families["streamwatch_step_phase_seconds"]}
    assert parts == {"data_wait": 0.125, "forward": 0.5, "backward": 0.375, "optimizer": 0.0625}
    assert all(s.labels["rank"] == "0" for s in families["streamwatch_step_phase_seconds"])


def test_the_fast_formatter_serves_exactly_what_prometheus_client_would() -> None:
    """expose() formats the per-tensor statistics itself (cached label strings); a caller-supplied
    registry goes through prometheus_client's generate_latest. Both must carry the same samples."""
    model, opt = _model()
    metrics = [*sw.DEFAULT_METRICS, sw.metrics.GradientCosine(), sw.metrics.Histogram(kinds=("param_grad",))]
    registry = CollectorRegistry()
    with sw.observe(model, opt, metrics=metrics, cadence={"param": 1, "update": 1}, every=1) as watch:
        fast = watch.expose(port=0)
        watch.expose(port=0, registry=registry)
        _train(watch, model, opt)
        fast_body = urllib.request.urlopen(fast.url, timeout=10).read().decode()
        reference_body = generate_latest(registry).decode()

    def samples(body: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        out = {}
        for family in text_string_to_metric_families(body):
            for s in family.samples:
                if not s.name.startswith(("streamwatch_overhead", "streamwatch_worker_lag")):  # time-varying
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    fast_samples, reference_samples = samples(fast_body), samples(reference_body)
    assert fast_samples == reference_samples
    assert sum(1 for name, _ in fast_samples if name.startswith("streamwatch_tensor_")) > 100
    assert fast_body.count("# TYPE streamwatch_tensor_l2 gauge") == 1  # one contiguous family
    assert fast_body.count("# TYPE streamwatch_tensor_cosine_previous gauge") == 1


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("info", r"^Expected `name` not to be a built-in family's, got 'info': streamwatch_info is served"),
        ("queue_length", r"got 'queue_length': streamwatch_queue_length is served by streamwatch itself"),
        ("steps", r"got 'steps': streamwatch_steps is served"),
        ("tensor", r"got 'tensor': streamwatch_tensor is served"),
        ("tensor_values", r"got 'tensor_values': streamwatch_tensor_values is served"),
        ("tensor_histogram", r"got 'tensor_histogram': streamwatch_tensor_histogram is served"),
        ("loss", r"got 'loss': streamwatch_loss is served"),
        ("layer_mean", r"got 'layer_mean': streamwatch_layer_mean is served"),
        ("tensor_l2", r"got 'tensor_l2': streamwatch_tensor_l2 is served"),
        ("layer_mean_rms", r"got 'layer_mean_rms': streamwatch_layer_mean_rms is served"),
        ("tensor_mine", r"^Expected `name` not to start with tensor_ or layer_mean_ .*got 'tensor_mine'"),
        ("hits_total", r"^Expected `name` not to end in _total, _count, _sum, _bucket .*got 'hits_total'$"),
        ("latency_count", r"not to end in .*got 'latency_count'$"),
        ("latency_sum", r"not to end in .*got 'latency_sum'$"),
        ("latency_bucket", r"not to end in .*got 'latency_bucket'$"),
        ("bad-name", r"^Expected `name` to be a metric name of letters, digits and _, got 'bad-name'$"),
        ("", r"got ''$"),
        ("a:b", r"got 'a:b'$"),
    ],
)
def test_serve_refuses_names_that_would_corrupt_the_exposition(name: str, message: str) -> None:
    with sw.observe(_model()[0], every=1) as watch, pytest.raises(ValueError, match=message):
        watch.serve(name)


@pytest.mark.parametrize(
    ("labels", "error", "message"),
    [
        ({"le": "1"}, ValueError, r"^Expected `labels` not to use the reserved label 'le'"),
        ({"quantile": "0.5"}, ValueError, r"reserved label 'quantile'"),
        ({"run": "x"}, ValueError, r"reserved label 'run'"),
        ({"rank": "0"}, ValueError, r"reserved label 'rank'"),
        ({"local_rank": "0"}, ValueError, r"reserved label 'local_rank'"),
        ({"world_size": "1"}, ValueError, r"reserved label 'world_size'"),
        ({"host": "h"}, ValueError, r"reserved label 'host'"),
        (
            {"__name__": "x"},
            ValueError,
            r"^Expected `labels` to have Prometheus label names .*got '__name__'$",
        ),
        ({"bad-label": "x"}, ValueError, r"got 'bad-label'$"),
        ({1: "x"}, TypeError, r"^Expected `labels` to map str to str, got 1: 'x'$"),
        ({"model": 1}, TypeError, r"^Expected `labels` to map str to str, got 'model': 1$"),
        (["model"], TypeError, r"^Expected `labels` to be a mapping of str to str \(or None\)"),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict | list) else "",
)
def test_serve_refuses_reserved_and_malformed_labels(
    labels: Any, error: type[Exception], message: str
) -> None:
    with sw.observe(_model()[0], every=1) as watch, pytest.raises(error, match=message):
        watch.serve("tenfold", labels)


def _served_run(**expose: Any) -> tuple[str, sw.Watch, str]:
    """A run with a histogram and a served family, scraped through ``expose(**expose)``: the text body,
    the watch, and the OpenMetrics body of the same route."""
    model, opt = _model()
    registry = expose.pop("registry", None)
    metrics = [*sw.DEFAULT_METRICS, sw.metrics.Histogram(kinds=("param_grad",))]
    with sw.observe(model, opt, metrics=metrics, cadence={"param": 1, "update": 1}, every=1) as watch:
        pipe = sw.source() | sw.ops.map(lambda r: {"a": r.step, "b": 2.0})
        watch.pipe(pipe | watch.serve("custom_ratio", {"model": "mlp"}))
        if registry is None and "series_budget" not in expose:
            exporter = watch.expose(port=0, **expose)
            _train(watch, model, opt)
            body = urllib.request.urlopen(exporter.url, timeout=10).read().decode()
            asked = urllib.request.Request(exporter.url, headers={"Accept": OPENMETRICS_ACCEPT})
            with urllib.request.urlopen(asked, timeout=10) as resp:
                assert resp.headers["Content-Type"] == OPENMETRICS_CONTENT_TYPE
                om = resp.read().decode()
        else:
            exporter = sw.sinks.Exporter(
                watch.store, watch.statistics, serve=False, registry=registry, **expose
            )
            _train(watch, model, opt)
            body = generate_latest(exporter.registry).decode()
            om = generate_openmetrics(exporter.registry).decode()
            exporter.close()
    return body, watch, om


@pytest.mark.parametrize(
    "route",
    [
        {},
        {"registry": CollectorRegistry()},
        {"series_budget": 250},
        {"series_budget": 200},
        {"series_budget": 10},
    ],
    ids=[
        "expose",
        "caller registry",
        "budget: core statistics",
        "budget: totals and the worst layer",
        "budget: totals only",
    ],
)
def test_promtool_accepts_every_route(route: dict[str, Any]) -> None:
    body, _, _ = _served_run(**route)
    families = {f.name: f for f in text_string_to_metric_families(body)}
    served = families["streamwatch_custom_ratio"]
    assert served.type == "gauge"
    assert {s.labels["series"]: s.labels["model"] for s in served.samples} == {"a": "mlp", "b": "mlp"}
    assert families["streamwatch_tensor_values"].type == "histogram"
    assert families["streamwatch_steps"].type == "counter"
    assert body.count("# HELP ") == len(families)  # one HELP per family, never a second one
    check_metrics(body)


def test_every_step_is_counted_in_the_step_counters_and_the_duration_histogram(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps of known lengths (a fake perf_counter) land in the right buckets of
    streamwatch_step_duration_seconds; the counters add every step, sampled or not."""
    from streamwatch import _boundary

    clock = [1000.0]
    monkeypatch.setattr(_boundary.time, "perf_counter", lambda: clock[0])
    model, opt = _model()
    lengths = [0.003, 0.003, 0.2, 7.0, 0.04, 0.04, 0.04, 100.0]
    with sw.observe(model, opt, every=4) as watch:
        exporter = watch.expose(port=0)
        for i, seconds in enumerate(lengths):
            clock[0] += seconds
            watch.step(batch_size=8 if i % 2 else None)
        assert watch.flush()
        families = _scrape(exporter.url)
    hist = {s.name: s for s in families["streamwatch_step_duration_seconds"] if "le" not in s.labels}
    buckets = [s for s in families["streamwatch_step_duration_seconds"] if "le" in s.labels]
    # the reference: counting each step by hand against the bounds
    expected = [sum(1 for x in lengths if x <= bound) for bound in STEP_BUCKETS]
    assert [float(s.labels["le"]) for s in buckets] == list(STEP_BUCKETS)
    assert [s.value for s in buckets] == expected
    assert hist["streamwatch_step_duration_seconds_count"].value == len(lengths)
    assert hist["streamwatch_step_duration_seconds_sum"].value == pytest.approx(sum(lengths), abs=1e-9)
    (seconds,) = families["streamwatch_step_seconds"]
    (samples,) = families["streamwatch_samples"]
    (steps,) = [s for s in families["streamwatch_steps"] if s.name == "streamwatch_steps_total"]
    assert (seconds.name, samples.name) == ("streamwatch_step_seconds_total", "streamwatch_samples_total")
    assert seconds.value == pytest.approx(sum(lengths), abs=1e-9)
    assert samples.value == 8 * 4  # the four steps that gave a batch size
    assert steps.value == len(lengths)


def test_no_samples_counter_until_a_step_gives_its_batch_size() -> None:
    model, opt = _model()
    with sw.observe(model, opt, every=1) as watch:
        exporter = watch.expose(port=0)
        for _ in range(2):
            model(torch.randn(4, 6)).sum().backward()
            watch.step(loss=1.0)
        assert watch.flush()
        families = _scrape(exporter.url)
    assert "streamwatch_samples" not in families
    assert families["streamwatch_step_duration_seconds"]


@pytest.mark.parametrize(
    "route",
    [{}, {"registry": CollectorRegistry()}, {"series_budget": 200}],
    ids=["expose", "caller registry", "budget: totals and the worst layer"],
)
def test_openmetrics_serves_the_same_samples_and_ends_with_eof(route: dict[str, Any]) -> None:
    """A scrape that asks for OpenMetrics gets it: the same samples as the text format, counters' families
    named without _total (their samples keep it), # EOF last; prometheus_client's strict OpenMetrics
    parser reads it. promtool has no OpenMetrics parser (prometheus/prometheus#8932): it reads the body
    as the 0.0.4 text format and its only complaint is that each counter's _total samples have no HELP
    of their own (the HELP is the family's, as OpenMetrics has it); nothing else."""
    body, _, om = _served_run(**route)
    assert om.endswith("\n# EOF\n")
    assert om.count("# EOF") == 1

    def samples(families: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in families
            for s in family.samples
            # time-varying, and the count of scrapes that reduced (one more for the second scrape)
            if not s.name.startswith(
                ("streamwatch_overhead", "streamwatch_worker_lag", "streamwatch_series_red")
            )
        }

    om_families = list(parse_openmetrics(om))
    assert samples(om_families) == samples(text_string_to_metric_families(body))
    counters = {f.name for f in om_families if f.type == "counter" and f.samples}
    assert {"streamwatch_steps", "streamwatch_step_seconds", "streamwatch_samples"} <= counters
    for name in counters:
        assert f"# TYPE {name} counter\n" in om
        assert f"\n{name}_total{{" in om
    assert {f.name: f.type for f in om_families}["streamwatch_step_duration_seconds"] == "histogram"
    problems = lint_problems(om)
    assert problems == sorted(f"{name}_total no help text" for name in counters)
    assert len(problems) >= 10
    check_metrics(body)
