"""Replay equals live: a real run with every default and opt-in metric, scraped live at its end and
scraped again from ``streamwatch replay`` of its run file, serves the same families, label sets and
values (the monitoring's own process metrics aside, listed in :data:`SELF_METRICS`). Both bodies pass
``promtool check metrics``."""

from __future__ import annotations

import urllib.request

import pytest
import torch
import torch.nn.functional as F
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

import streamwatch as sw
from streamwatch._replay import Replay
from streamwatch.sinks import RunFile, read_run
from tests.promtool import check_metrics
from tests.training import train

SELF_METRICS = frozenset(
    {
        "streamwatch_info",  # carries the package version; replay serves the replaying process's
        "streamwatch_steps",
        # every step's time and samples are counted on the training thread: a run file holds the sampled
        # records only, so a replay serves 0 s and no histogram or samples
        "streamwatch_step_seconds",
        "streamwatch_samples",
        "streamwatch_step_duration_seconds",
        "streamwatch_steps_sampled",
        "streamwatch_records",
        "streamwatch_records_dropped",
        "streamwatch_queue_length",
        "streamwatch_queue_high_water",
        "streamwatch_worker_lag_seconds",
        "streamwatch_hook_errors",
        "streamwatch_sink_errors",
        "streamwatch_tensors_skipped",
        "streamwatch_series",
        "streamwatch_series_wanted",
        "streamwatch_series_reduced",
        "streamwatch_overhead_last_step_seconds",
        "streamwatch_overhead_seconds",
        "streamwatch_sampling_interval",
        "streamwatch_overhead_ratio",  # only under observe(overhead=...): absent here, live and replayed
    }
)
"""Families about the process that serves (how its monitoring is doing), not about the run."""

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _every_metric(
    model: nn.Module, probe: torch.Tensor, target: torch.Tensor
) -> list[str | sw.metrics.Metric]:
    m = sw.metrics

    def loss_fn(module: nn.Module) -> torch.Tensor:
        return F.cross_entropy(module(probe), target)

    def evaluate(module: nn.Module) -> dict[str, float]:
        with torch.no_grad():
            out = module(probe)
        return {
            "loss": float(F.cross_entropy(out, target)),
            "accuracy": float((out.argmax(1) == target).float().mean()),
        }

    return [
        *sw.DEFAULT_METRICS,
        m.GradientCosine(),
        m.GradientCosine(of="update", every=2),
        m.SpectralNorm(),
        m.ConditionNumber(every=2),
        m.Histogram(kinds=("param_grad", "activation"), buckets=m.Buckets(lo=-6, hi=2, per_decade=2)),
        m.PNorm(p=1.0, kinds=("param_grad",)),
        m.ActivationSimilarity(probe, every=2),
        m.HessianMaxEig(loss_fn, every=3, iterations=3),
        m.TestAccuracy(evaluate, every=2),
    ]


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def _samples(body: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        if family.name not in SELF_METRICS
        for s in family.samples
    }


def _families(body: str) -> dict[str, tuple[str, str]]:
    return {f.name: (f.type, f.documentation) for f in text_string_to_metric_families(body)}


@pytest.fixture(scope="module")
def bodies(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(live body at the end of the run, replayed body of its run file)."""
    path = tmp_path_factory.mktemp("parity") / "run.jsonl"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    probe, target = torch.randn(24, 6, generator=g), torch.randint(0, 3, (24,), generator=g)
    with sw.observe(
        model,
        opt,
        cadence={"param": 2, "update": 2},
        metrics=_every_metric(model, probe, target),
        sinks=[RunFile(path)],
        overflow="block",
        every=1,
    ) as watch:
        exporter = watch.expose(port=0, run="parity")
        train(model, opt, watch, 7, shape=(16, 6), generator=g, flush=True)
        live = _scrape(exporter.url)
    with Replay(read_run(path), port=0, speed=0, run_name="parity") as replay:
        assert replay.wait_until_done(timeout=30)
        replayed = _scrape(replay.url)
    return live, replayed


def test_every_metric_produced_values_in_the_live_run(bodies: tuple[str, str]) -> None:
    live = _samples(bodies[0])
    names = {name for name, _ in live}
    assert not [labels for _, labels in live if "stat" in dict(labels)]
    assert {
        "streamwatch_tensor_update_ratio",
        "streamwatch_tensor_cosine_previous",
        "streamwatch_tensor_spectral_norm",
        "streamwatch_tensor_condition_number",
        "streamwatch_tensor_norm_p1",
        "streamwatch_tensor_cca_similarity",
    } <= names
    assert {
        "streamwatch_layer_mean_rms",
        "streamwatch_tensor_values_bucket",
        "streamwatch_hessian_max_eig",
        "streamwatch_learning_rate",
        "streamwatch_step_phase_seconds",
    } <= names
    phases = {dict(labels).get("phase") for name, labels in live if name == "streamwatch_accuracy"}
    assert phases == {"train", "eval"}


def test_replay_serves_the_same_families_label_sets_and_values_as_live(bodies: tuple[str, str]) -> None:
    live, replayed = bodies
    got, want = _samples(replayed), _samples(live)
    assert sorted(set(want) - set(got)) == []  # served live, missing from the replay
    assert sorted(set(got) - set(want)) == []
    assert got == want
    assert sum(1 for name, _ in want if name == "streamwatch_tensor_values_bucket") > 100
    live_families, replayed_families = _families(live), _families(replayed)
    assert {n: f for n, f in live_families.items() if n not in SELF_METRICS} == {
        n: f for n, f in replayed_families.items() if n not in SELF_METRICS
    }
    assert set(replayed_families) >= SELF_METRICS - {
        "streamwatch_worker_lag_seconds",
        "streamwatch_overhead_ratio",
        "streamwatch_samples",
        "streamwatch_step_duration_seconds",
    }


@pytest.mark.parametrize("route", [0, 1], ids=["live", "replay"])
def test_promtool_accepts_both_routes(bodies: tuple[str, str], route: int) -> None:
    check_metrics(bodies[route])
