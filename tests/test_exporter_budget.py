"""The series budget (``expose(series_budget=...)``, :mod:`streamwatch.sinks._budget`) on models with
hundreds and thousands of layers: every per-layer family counts against it (``streamwatch_tensor``, the
histogram buckets, the detectors' per-layer families); over it a scrape serves one total per phase and
kind (``layer="__all__"``, equal to a numpy reference over the table) and the worst layers in core
detail with their detector series, the same through ``render()`` and ``collect()``, the same layers
from scrape to scrape until one gets worse; ``promtool check metrics`` accepts it. The exporter before
this budgeted ``streamwatch_tensor`` only and fell back to its ``__all__`` rows alone: each test here
fails on it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

import streamwatch as sw
from streamwatch._families import ALL_LAYERS, TENSOR_FAMILIES
from streamwatch._summary import COLUMNS
from streamwatch.sinks._prometheus import CORE_STATS
from tests.promtool import check_metrics
from tests.training import train

RULES = Path(__file__).resolve().parents[1] / "dashboards" / "rules" / "streamwatch.rules.yml"
PER_LAYER_DETECTORS = (
    "streamwatch_grad_norm_ratio",
    "streamwatch_grad_norm_spikes",
    "streamwatch_layer_update_ratio",
    "streamwatch_update_ratio_out_of_band",
)
PER_LAYER = frozenset({"streamwatch_tensor", "streamwatch_tensor_values", *PER_LAYER_DETECTORS})
"""The families with series per layer (as the parser names them: counters without ``_total``)."""
IDENTITY = frozenset({"run", "rank", "local_rank", "world_size", "host"})
Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""(family name, labels without the identity) -> value; a histogram's samples by ``le``."""


def _scrape(store_of: sw.Watch, budget: int, *, collect: bool = False) -> tuple[str, Series]:
    """One scrape of ``store_of``'s values under ``budget`` (``render()``, or ``generate_latest`` over
    the collector in its registry): the body and its series."""
    exporter = sw.sinks.Exporter(
        store_of.store, store_of.statistics, serve=False, run="budget", series_budget=budget
    )
    try:
        body = (generate_latest(exporter.registry) if collect else exporter.collector.render()).decode()
    finally:
        exporter.close()
    return body, _series(body)


_STAT_OF = {family.name: stat for stat, family in TENSOR_FAMILIES.items()}
"""/metrics family -> the ``stat`` of ``snapshot()``'s streamwatch_tensor (one family per statistic)."""


def _series(body: str) -> Series:
    """The series of ``body``, the per-statistic families read back as streamwatch_tensor{stat=...}."""
    out: Series = {}
    for family in text_string_to_metric_families(body):
        stat = _STAT_OF.get(family.name)
        name = family.name if stat is None else "streamwatch_tensor"
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k not in IDENTITY}
            if stat is not None:
                labels["stat"] = stat
            out[(name, tuple(sorted(labels.items())))] = s.value
    return out


def _per_layer(series: Series) -> Series:
    return {key: value for key, value in series.items() if key[0] in PER_LAYER}


def _one(series: Series, name: str) -> float:
    (value,) = [v for (n, _), v in series.items() if n == name]
    return value


def _layers(series: Series, family: str = "streamwatch_tensor") -> set[str]:
    """The layers with series of ``family`` (the totals left out)."""
    return {dict(labels)["layer"] for name, labels in series if name == family} - {ALL_LAYERS}


# -- a model with 2 001 leaf modules -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def wide() -> Iterator[sw.Watch]:
    """1 000 × (Linear, ReLU) and a head, every step sampled for 22 steps: GradientSpike's warm-up (20)
    is over, so all four per-layer detector families have series."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(1000):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with sw.observe(model, opt, every=1) as watch:
        train(model, opt, watch, 22, shape=(8, 16), classes=None, seed=0, flush=True)
        yield watch


@pytest.mark.parametrize("budget", [5000, 2000])
def test_every_per_layer_family_counts_against_the_budget(
    wide: sw.Watch, budget: int, caplog: pytest.LogCaptureFixture
) -> None:
    _, full = _scrape(wide, 10**7)
    wanted = _per_layer(full)
    assert _one(full, "streamwatch_series") == _one(full, "streamwatch_series_wanted") == len(wanted)
    detectors = [key for key in wanted if key[0] in PER_LAYER_DETECTORS]
    assert {name for name, _ in detectors} == set(PER_LAYER_DETECTORS)
    assert len(detectors) > 3000  # ~1 000 per family (the ratio only where the gradients are not 0)

    with caplog.at_level("WARNING", logger="streamwatch"):
        body, served = _scrape(wide, budget)
    per_layer = _per_layer(served)
    assert len(per_layer) <= budget  # the detectors' families too (3 004 of them before)
    assert _one(served, "streamwatch_series") == len(per_layer)
    assert _one(served, "streamwatch_series_wanted") == len(wanted) > 160_000
    assert _one(served, "streamwatch_series_reduced") == 1
    # reduced to something useful: layers in core detail with their detector series, beside the totals
    detail = _layers(served)
    assert len(detail) >= 20
    assert {dict(k[1])["stat"] for k in per_layer if k[0] == "streamwatch_tensor"} <= set(CORE_STATS)
    linear = {layer for layer in detail if int(layer) % 2 == 0}
    assert linear
    for name in PER_LAYER_DETECTORS:
        assert _layers(served, name) <= detail  # no detector series of a layer served without detail
    assert _layers(served, "streamwatch_layer_update_ratio") == linear
    assert ("streamwatch_grad_norm_ratio", (("layer", ALL_LAYERS),)) in served  # the global one, always
    assert len(budget_warnings := [r for r in caplog.records if "series budget" in r.getMessage()]) == 1
    assert "worst of 2001 layers in core detail" in budget_warnings[0].getMessage()
    check_metrics(body)


def test_the_totals_equal_a_numpy_reference_and_the_layers_their_rows(wide: sw.Watch) -> None:
    _, served = _scrape(wide, 5000)
    table, keys = wide.store.table()
    column = {name: table[:, i] for i, name in enumerate(COLUMNS)}
    groups: dict[tuple[str, str], list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault((key.phase, key.kind), []).append(i)
    assert len(groups) == 5  # activation, output_grad, param, param_grad, update (no evaluation)

    def reference(rows: list[int]) -> dict[str, float]:
        """Plain numpy over the rows: unknown (NaN) values left out, as PromQL's sum leaves them out."""
        total = {name: float(np.nansum(column[name][rows])) for name in ("count", "sum", "sumsq")}
        dead, units = column["dead"][rows], column["units"][rows]
        return {
            "count": total["count"],
            "sumsq": total["sumsq"],
            "l2": math.sqrt(total["sumsq"]),
            "mean": total["sum"] / total["count"],
            "min": float(np.nanmin(column["min"][rows])),
            "max": float(np.nanmax(column["max"][rows])),
            "nonfinite": float(np.nansum(column["nonfinite"][rows])),
            "dead_fraction": float(np.nansum(dead)) / float(np.nansum(units))
            if not np.isnan(units).all()
            else math.nan,
        }

    for (phase, kind), rows in groups.items():
        labels = {"phase": phase, "layer": ALL_LAYERS, "kind": kind, "param": "", "index": ""}
        for stat, want in reference(rows).items():
            key = ("streamwatch_tensor", tuple(sorted({**labels, "stat": stat}.items())))
            if math.isnan(want):
                assert key not in served, key  # absent, never NaN
            else:
                assert served[key] == pytest.approx(want, rel=1e-12, abs=1e-300), key
    # every layer served in detail: its rows' core statistics, as they are in the table
    detail = _layers(served)
    assert detail
    derived = {"l2": np.sqrt(column["sumsq"]), "mean": column["sum"] / column["count"]}
    for i, key in enumerate(keys):
        if key.layer not in detail:
            continue
        for stat in ("count", "sumsq", "l2", "mean", "min", "max", "nonfinite"):
            want = float(derived[stat][i] if stat in derived else column[stat][i])
            labels = tuple(sorted({**key.labels(), "stat": stat}.items()))
            assert served[("streamwatch_tensor", labels)] == want, (key, stat)


# -- which layers: the worst, and the same ones from scrape to scrape ---------------------------------------


def _deep(blocks: int = 60, width: int = 8) -> nn.Sequential:
    """``blocks`` × (Linear near the identity, Tanh) and a head: gradients reach every layer."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        linear = nn.Linear(width, width)
        with torch.no_grad():
            linear.weight.copy_(torch.eye(width) + 0.05 * torch.randn(width, width))
            linear.bias.zero_()
        layers += [linear, nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 3))


def _once(param: torch.Tensor, change: float) -> None:
    """Multiply ``param``'s next gradient by ``change`` (NaN: every element NaN), once."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        handle.remove()
        return torch.full_like(grad, math.nan) if math.isnan(change) else grad * change

    handle = param.register_hook(hook)


BUDGET = 600  # of ~4 700 per-layer series: the totals and about 8 layers in detail


def test_a_reduced_scrape_serves_the_worst_layers_and_keeps_them() -> None:
    model = _deep()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    spiked, broken = model[90], model[100]
    assert isinstance(spiked, nn.Linear)
    assert isinstance(broken, nn.Linear)
    g = torch.Generator().manual_seed(1)
    with sw.observe(model, opt, every=1) as watch:
        exporter = sw.sinks.Exporter(
            watch.store, watch.statistics, serve=False, run="budget", series_budget=BUDGET
        )
        try:

            def scrape() -> tuple[Series, set[str]]:
                served = _series(exporter.collector.render().decode())
                assert len(_per_layer(served)) <= BUDGET
                return served, _layers(served)

            train(model, opt, watch, 22, shape=(16, 8), generator=g, flush=True)
            _, healthy = scrape()
            assert healthy
            assert {"90", "100"}.isdisjoint(healthy)

            # a gradient 10 000 times its usual size in one deep layer: GradientSpike counts a spike
            _once(spiked.weight, 1e4)
            train(model, opt, watch, 1, shape=(16, 8), generator=g, flush=True)
            served, after_spike = scrape()
            assert "90" in after_spike
            assert served[("streamwatch_grad_norm_spikes", (("layer", "90"),))] == 1
            assert after_spike - {"90"} <= healthy  # the others stay: it displaced the last one only

            # healthy steps: the same layers (no series comes and goes)
            train(model, opt, watch, 2, shape=(16, 8), generator=g, flush=True)
            assert scrape()[1] == after_spike

            # NaN gradients in another deep layer: it comes first, and the spiked one stays
            _once(broken.weight, math.nan)
            train(model, opt, watch, 1, shape=(16, 8), generator=g, flush=True)
            body = exporter.collector.render().decode()
            served, after_nan = _series(body), _layers(_series(body))
            assert {"90", "100"} <= after_nan
            nonfinite = {"phase": "train", "layer": "100", "kind": "param_grad", "param": "weight"}
            key = (
                "streamwatch_tensor",
                tuple(sorted({**nonfinite, "index": "", "stat": "nonfinite"}.items())),
            )
            assert served[key] > 0
            first = [dict(k[1]) for k in served if k[0] == "streamwatch_first_nonfinite_info"]
            assert [labels["layer"] for labels in first] == ["100"]
            check_metrics(body)
        finally:
            exporter.close()


def test_render_and_collect_serve_the_same_reduction() -> None:
    model = _deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with sw.observe(model, opt, every=1) as watch:
        train(model, opt, watch, 3, shape=(16, 8), seed=1, flush=True)
        rendered, by_render = _scrape(watch, BUDGET)
        collected, by_collect = _scrape(watch, BUDGET, collect=True)
    assert _layers(by_render)  # layers in detail beside the totals
    assert by_render == by_collect
    assert _one(by_render, "streamwatch_series") == len(_per_layer(by_render)) <= BUDGET
    check_metrics(rendered)
    check_metrics(collected)


def test_histogram_buckets_count_and_are_summed_per_phase_and_kind_over_the_budget() -> None:
    model = _deep(blocks=20)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    buckets = sw.metrics.Buckets(lo=-4, hi=2, per_decade=2)
    metrics = [*sw.DEFAULT_METRICS, sw.metrics.Histogram(kinds=("param_grad",), buckets=buckets)]
    with sw.observe(model, opt, metrics=metrics, every=1) as watch:
        train(model, opt, watch, 2, shape=(16, 8), seed=1, flush=True)
        _, full = _scrape(watch, 10**7)
        bounds = {dict(k[1])["le"] for k in full if k[0] == "streamwatch_tensor_values"}
        for budget in (2000, 400):  # core statistics per layer; the totals and the worst layers
            body, served = _scrape(watch, budget)
            per_layer = _per_layer(served)
            assert len(per_layer) <= budget
            assert _one(served, "streamwatch_series") == len(per_layer)
            assert _one(served, "streamwatch_series_wanted") == len(_per_layer(full))
            histograms = {k: v for k, v in served.items() if k[0] == "streamwatch_tensor_values"}
            assert {dict(k[1])["layer"] for k in histograms} == {ALL_LAYERS}
            for (name, labels), value in histograms.items():
                le = dict(labels)["le"]
                summed = sum(
                    v
                    for (n, layer_labels), v in full.items()
                    if n == name
                    and dict(layer_labels)["le"] == le
                    and dict(layer_labels)["kind"] == "param_grad"
                )
                assert value == summed, le
            assert len(histograms) == len(bounds)
            check_metrics(body)
    per_layer_histograms = [k for k in full if k[0] == "streamwatch_tensor_values"]
    assert len(per_layer_histograms) == 21 * 2 * len(bounds)  # 21 Linear layers, weight and bias


def test_the_dead_units_rank_threshold_is_the_alerts() -> None:
    from streamwatch._families import PER_LAYER_FAMILIES
    from streamwatch.sinks._budget import DEAD_FRACTION_HIGH

    assert {family.name for family in PER_LAYER_FAMILIES} == PER_LAYER
    rule = re.search(r"streamwatch_tensor_dead_ratio\{[^}]*\} > ([\d.]+)", RULES.read_text(encoding="utf-8"))
    assert rule
    assert float(rule[1]) == DEAD_FRACTION_HIGH
