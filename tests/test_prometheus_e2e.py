"""End to end against a real Prometheus server (Debian's ``prometheus``, started by the test on
127.0.0.1 with its own config and data dir, 1 s scrapes): a real training run exposes /metrics, Prometheus
scrapes it, and what PromQL returns equals ``watch.snapshot()`` — including the global gradient norm
computed in PromQL from the exported sums of squares.

Skipped when the ``prometheus`` binary is missing, except under ``STREAMWATCH_REQUIRE_PROMETHEUS=1``
(``.ci/run`` sets it), where a missing server fails the run.
"""

from __future__ import annotations

import math
import socket
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streamwatch as sw
from streamwatch._families import exposed_sample
from tests.promserver import PrometheusServer, require_prometheus


def test_a_real_prometheus_scrapes_a_real_training_run(tmp_path: Path) -> None:
    require_prometheus()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    with sw.observe(model, opt, every=1) as watch:
        exporter = watch.expose(port=0, run="e2e")
        target = f"127.0.0.1:{exporter.port}"
        with PrometheusServer(tmp_path, [target]) as prom:
            for _ in range(20):
                x, y = torch.randn(32, 10, generator=g), torch.randint(0, 4, (32,), generator=g)
                out = model(x)
                loss = F.cross_entropy(out, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                watch.step(loss=loss, outputs=out, targets=y, batch_size=32)
            assert watch.flush()
            last = watch.statistics().steps - 1
            prom.wait_for('up{job="streamwatch"}', lambda r: bool(r) and r[0]["value"][1] == "1")
            prom.wait_for(f'streamwatch_step{{run="e2e"}} == {last}', bool)
            # one more scrape after the last step was served, so every series holds its final value
            prom.wait_for('timestamp(streamwatch_step{run="e2e"}) > time() - 1', bool)
            # /metrics: one family per statistic (streamwatch_tensor{stat="l2"} -> streamwatch_tensor_l2)
            snapshot = {  # (Prometheus drops empty labels: param="" on activations, index="" on params)
                (e.name, tuple(sorted((k, v) for k, v in e.labels.items() if v))): e.value
                for e in map(exposed_sample, watch.snapshot())
                if e.name.startswith("streamwatch_tensor_")
                or e.name in ("streamwatch_loss", "streamwatch_accuracy")
            }
            served: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
            selector = '{__name__=~"streamwatch_tensor_.+|streamwatch_loss|streamwatch_accuracy", run="e2e"}'
            for series in prom.query(selector):
                labels = dict(series["metric"])
                name = labels.pop("__name__")
                assert not {"stat", "host", "local_rank", "world_size"} & set(labels), labels
                labels = {k: v for k, v in labels.items() if k not in ("job", "instance", "run", "rank")}
                served[(name, tuple(sorted(labels.items())))] = float(series["value"][1])
            assert len(snapshot) > 100
            assert served.keys() == snapshot.keys()
            for key, value in snapshot.items():
                assert served[key] == value, key  # the text format carries floats exactly
            norm = prom.query(
                'sqrt(sum by (run) (streamwatch_tensor_sum_of_squares{run="e2e", kind="param_grad"}))'
            )
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            assert float(norm[0]["value"][1]) == pytest.approx(float(grads.norm()), rel=1e-5)
            # Prometheus asks for OpenMetrics first, and got it: every scrape of this run parsed as such
            assert exporter._server is not None
            assert exporter._server.openmetrics_responses > 0
            identity = prom.query('streamwatch_info{run="e2e"}')
            assert identity[0]["metric"]["rank"] == "0"
            assert identity[0]["metric"]["world_size"] == "1"
            # the identity joined where a query needs it (docs/prometheus.md): the host on a tensor series
            joined = prom.query(
                'streamwatch_tensor_l2{run="e2e", kind="param_grad"}'
                " * on (job, instance) group_left (host, world_size) streamwatch_info"
            )
            assert joined
            assert all(j["metric"]["host"] == socket.gethostname() for j in joined)
            # every step counted: the histogram's count and the counters agree with the run
            steps = watch.statistics().steps
            count = prom.query('streamwatch_step_duration_seconds_count{run="e2e"}')
            assert float(count[0]["value"][1]) == steps == 20
            samples = prom.query('streamwatch_samples_total{run="e2e"}')
            assert float(samples[0]["value"][1]) == 32 * steps
            p50 = prom.query(
                'histogram_quantile(0.5, sum by (le) (streamwatch_step_duration_seconds_bucket{run="e2e"}))'
            )
            assert 0 < float(p50[0]["value"][1]) < 60
            assert not math.isnan(
                float(prom.query('streamwatch_overhead_seconds_total{run="e2e"}')[0]["value"][1])
            )
